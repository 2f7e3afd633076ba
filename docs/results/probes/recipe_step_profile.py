"""Where ``optimizer.step()`` spends its time inside one recipe run (a real Trainer loop, not the step benchmark).

The recipe records the step with CUDA events around it: the GPU's time from the step's first to its last kernel, host
gaps included. This probe runs one fine-tune through the recipe's own ``run_finetune`` and adds, around the same
``optimizer.step()``:

* the host wall time of the call (``time.perf_counter`` before and after, no synchronization: what the Python side
  costs, the launches being asynchronous);
* ``torch.profiler`` over ``--profile-steps`` training steps from ``--profile-from`` on (CPU and CUDA activity), whose
  tables (by CUDA time and by CPU time) are printed and written, with a Chrome trace, under ``--out``.

    python docs/results/probes/recipe_step_profile.py configs/llama32_3b_h200_random.yaml --optim apexw_compact \
        --out /tmp/prof --set train.max_steps=40 [--prepared prepared_paths.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from apexw_hf.recipe import finetune  # noqa: E402
from apexw_hf.recipe.config import load_config  # noqa: E402

_RECIPE_TIMER = finetune._StepTimer


def _profiling_timer(profile_from: int, profile_steps: int, out: Path, record: dict):
    """The recipe's step timer, with host wall time of every ``optimizer.step()`` and a profiler window added."""
    import torch

    timer = _RECIPE_TIMER()
    host_ms: list[float] = []
    prof = {"p": None, "t0": None}
    pre, post, end = timer.on_pre_optimizer_step, timer.on_optimizer_step, timer.on_step_end

    def on_pre_optimizer_step(args, state, control, **kw):
        pre(args, state, control, **kw)
        prof["t0"] = time.perf_counter()

    def on_optimizer_step(args, state, control, **kw):
        if prof["t0"] is not None:
            host_ms.append((time.perf_counter() - prof["t0"]) * 1e3)
            prof["t0"] = None
        post(args, state, control, **kw)

    def on_step_end(args, state, control, **kw):
        end(args, state, control, **kw)
        if state.global_step == profile_from:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            prof["p"] = torch.profiler.profile(activities=acts, record_shapes=False, with_stack=False)
            prof["p"].__enter__()
        elif state.global_step == profile_from + profile_steps and prof["p"] is not None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            p = prof["p"]
            p.__exit__(None, None, None)
            prof["p"] = None
            ka = p.key_averages()
            by_dev = ka.table(sort_by="self_device_time_total", row_limit=30)
            by_cpu = ka.table(sort_by="self_cpu_time_total", row_limit=30)
            (out / "by_device_time.txt").write_text(by_dev)
            (out / "by_cpu_time.txt").write_text(by_cpu)
            p.export_chrome_trace(str(out / "trace.json"))
            record["profiled_steps"] = [profile_from + 1, profile_from + profile_steps]
            print(by_dev, flush=True)
            print(by_cpu, flush=True)

    timer.on_pre_optimizer_step = on_pre_optimizer_step
    timer.on_optimizer_step = on_optimizer_step
    timer.on_step_end = on_step_end
    record["host_ms"] = host_ms
    return timer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--optim", required=True)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--prepared", type=Path, default=None, help="prepared_paths.json of a `--prepare-only` run")
    ap.add_argument("--profile-from", type=int, default=20, help="global step after which profiling starts")
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    overrides = [*a.overrides, f"train.optim={a.optim}"]
    if a.lr is not None:
        overrides.append(f"train.learning_rate={a.lr}")
    cfg = load_config(a.config, overrides)
    a.out.mkdir(parents=True, exist_ok=True)
    record: dict = {"optim": a.optim, "overrides": overrides}
    finetune._StepTimer = lambda: _profiling_timer(a.profile_from, a.profile_steps, a.out, record)
    prepared = json.loads(a.prepared.read_text()) if a.prepared else None
    result = finetune.run_finetune(cfg, a.out / "run", prepared, verbose=True)
    host = record["host_ms"][len(record["host_ms"]) // 10 :]
    summary = {
        "optim": a.optim,
        "optimizer_step_ms_events": result.get("optimizer_step_ms"),
        "optimizer_step_host_ms_median": statistics.median(host) if host else None,
        "optimizer_step_host_ms_p90": sorted(host)[int(0.9 * (len(host) - 1))] if host else None,
        "steps_per_s": result.get("steps_per_s"),
        "steps_per_s_steady": result.get("steps_per_s_steady"),
        "optimizer_triton_engine_used": result.get("optimizer_triton_engine_used"),
        "git_commit": result.get("environment", {}).get("git_commit"),
        "device": result.get("environment", {}).get("device"),
        "host_ms_all": record["host_ms"],
        "profiled_steps": record.get("profiled_steps"),
    }
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "host_ms_all"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
