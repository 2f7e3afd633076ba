"""Optimizer-step benchmark on the CPU: ApexW's plain-PyTorch engine against torch.optim.AdamW (foreach, for-loop).

Optimizer step only, fp32 parameters: gradients are random and fixed across steps; each step is timed with
``time.perf_counter`` after warm-up. All optimizers of a workload run in the same process, in ``--rounds`` interleaved
rounds of ``--steps`` steps each; the table shows, per optimizer, the lowest of its round medians (a shared machine
slows some rounds down; every round median is stored). ``ApexW8bit`` and ``ApexW4bit`` run on the fused numba path
when numba is installed (``apexw_hf/engines/numba.py``); the ``(torch passes)`` rows are the same optimizers with
that path switched off, the engine without numba. ``--reference`` adds the per-tensor
``reference.adamw_step_ref_`` loop (the CPU path before the engine) for comparison; it is slow, so it gets a sixth of
the steps.

Results (CPU, thread count, versions, git commit, date) are appended as one line to the ledger
``docs/results/cpu_step.jsonl`` (``--no-store``: printed only, as a short table).

Usage::

    python benchmarks/bench_cpu_step.py                 # both workloads, stores the result
    python benchmarks/bench_cpu_step.py --reference     # also the old per-tensor path
    python benchmarks/bench_cpu_step.py --no-store --steps 20
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from apexw_hf import ApexW, reference  # noqa: E402
from apexw_hf.provenance import source_commit  # noqa: E402

HP = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
WORKLOADS = {
    "56 x 16x256": [(16, 256)] * 56,
    "8 x 1024x1024": [(1024, 1024)] * 8,
}


def _params(shapes, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]
    for p in ps:
        p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(dtype)
    return ps


class _ReferenceLoop:
    """The CPU path before the engine: ``reference.adamw_step_ref_`` once per tensor."""

    def __init__(self, params, fmt):
        self.opt = ApexW(params, state_format=fmt, engine="torch", **HP)

    @torch.no_grad()
    def step(self):
        opt = self.opt
        for group in opt.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                state = opt._init_state(p, group)
                state["step"] += 1
                t = int(state["step"].item())
                scalars = reference.StepScalars.make(
                    lr=group["lr"], beta1=b1, beta2=b2, eps=group["eps"], weight_decay=group["weight_decay"], step=t
                )
                reference.adamw_step_ref_(
                    p,
                    p.grad,
                    state,
                    fmt=group["state_format"],
                    scalars=scalars,
                    seed=group["seed"],
                    tensor_index=opt._tensor_index(p),
                    step=t,
                )


def _without_numba(fmt):
    def make(ps):
        opt = ApexW(ps, state_format=fmt, engine="torch", **HP)
        opt._torch_engine().use_numba = False
        return opt

    return make


def _numba_version():
    try:
        import numba
    except ImportError:
        return None
    return numba.__version__


def _candidates(with_reference: bool):
    out = {
        "torch AdamW foreach": lambda ps: torch.optim.AdamW(ps, foreach=True, **HP),
        "torch AdamW for-loop": lambda ps: torch.optim.AdamW(ps, foreach=False, **HP),
        "ApexW fp32": lambda ps: ApexW(ps, state_format="fp32", engine="torch", **HP),
        "ApexWCompact": lambda ps: ApexW(ps, state_format="compact", engine="torch", **HP),
        "ApexW8bit": lambda ps: ApexW(ps, state_format="8bit", engine="torch", **HP),
        "ApexW8bit (torch passes)": _without_numba("8bit"),
        "ApexW4bit": lambda ps: ApexW(ps, state_format="4bit", engine="torch", **HP),
        "ApexW4bit (torch passes)": _without_numba("4bit"),
    }
    if with_reference:
        out["ApexWCompact (per-tensor reference)"] = lambda ps: _ReferenceLoop(ps, "compact")
        out["ApexW8bit (per-tensor reference)"] = lambda ps: _ReferenceLoop(ps, "8bit")
        out["ApexW4bit (per-tensor reference)"] = lambda ps: _ReferenceLoop(ps, "4bit")
    return out


def _time_workload(candidates, shapes, dtype, steps, warmup, rounds):
    """Median ms per step of each candidate, in ``rounds`` interleaved rounds (each candidate keeps its optimizer)."""
    opts = {}
    for name, make in candidates.items():
        opts[name] = make(_params(shapes, dtype))
        for _ in range(1 if "reference" in name else warmup):
            opts[name].step()
    per_round = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, opt in opts.items():
            n = max(5, steps // 6) if "reference" in name else steps
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                opt.step()
                times.append((time.perf_counter() - t0) * 1e3)
            per_round[name].append(statistics.median(times))
    return {
        name: {
            "median_ms": min(r),
            "round_medians_ms": r,
            "steps_per_round": max(5, steps // 6) if "reference" in name else steps,
        }
        for name, r in per_round.items()
    }


def _cpu_info():
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "model": model,
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60, help="timed steps per optimizer (default 60)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds; the table shows each optimizer's best round median"
    )
    ap.add_argument("--reference", action="store_true", help="also time the old per-tensor reference path")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="parameter and gradient dtype")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    ap.add_argument("--no-store", action="store_true", help="print only, write no result files")
    ap.add_argument("--note", default="", help="free text stored with the result (e.g. how busy the machine was)")
    args = ap.parse_args(argv)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    rows = []
    for wname, shapes in WORKLOADS.items():
        timed = _time_workload(_candidates(args.reference), shapes, dtype, args.steps, args.warmup, args.rounds)
        for cname, r in timed.items():
            rows.append({"workload": wname, "optimizer": cname, **r})
            rounds = ", ".join(f"{x:.2f}" for x in r["round_medians_ms"])
            print(f"{wname:>14}  {cname:<38} {r['median_ms']:8.2f} ms  (round medians {rounds})", flush=True)
    commit, dirty = source_commit()
    now = datetime.datetime.now(datetime.timezone.utc)
    result = {
        "benchmark": "cpu_step",
        "date": now.isoformat(timespec="seconds"),
        "git_commit": commit,
        "git_dirty": dirty,
        "param_dtype": args.dtype,
        "hyperparameters": {k: list(v) if isinstance(v, tuple) else v for k, v in HP.items()},
        "warmup": args.warmup,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "numpy": _numpy_version(),
            "numba": _numba_version(),
        },
        "cpu": _cpu_info(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "rounds": args.rounds,
        "note": args.note,
        "rows": rows,
    }
    md = _markdown(result)
    print()
    print(md)
    if not args.no_store:
        sys.path.insert(0, str(ROOT / "scripts"))
        import ledger

        stem = f"cpu_step_{now:%Y-%m-%dT%H%M}_{(commit or 'nocommit')[:7]}_{torch.get_num_threads()}t"
        stem += "_bf16" if args.dtype == "bf16" else ""
        gpu = result["cpu"].get("model")
        ledger.append("cpu_step", [ledger.row(result, stem, None, gpu, commit, result["date"], " ".join(sys.argv))])
        print(f"added {stem} to {ledger.path('cpu_step').relative_to(ROOT)}")


def _numpy_version():
    import numpy

    return numpy.__version__


def _markdown(result) -> str:
    """The stored result as a table: ms per step (median), one column per optimizer."""
    names = list(dict.fromkeys(r["optimizer"] for r in result["rows"]))
    lines = [
        f"# CPU optimizer step, {result['param_dtype']} params ({result['date']}, commit "
        f"{(result['git_commit'] or 'unknown')[:7]})",
        "",
        f"{result['cpu']['model']}, {result['cpu']['torch_threads']} torch threads, "
        f"torch {result['versions']['torch']}, numba {result['versions'].get('numba') or 'not installed'}; "
        f"load average before the run {', '.join(f'{x:.2f}' for x in result['load_average_before'])}. "
        f"ms per step: the best of {result['rounds']} interleaved round medians. "
        "Generated by benchmarks/bench_cpu_step.py.",
        "",
        "| workload | " + " | ".join(names) + " | ApexW8bit / faster torch AdamW |",
        "|---|" + "---:|" * (len(names) + 1),
    ]
    for w in dict.fromkeys(r["workload"] for r in result["rows"]):
        cells = {r["optimizer"]: r["median_ms"] for r in result["rows"] if r["workload"] == w}
        torch_best = min(cells.get("torch AdamW foreach", math.inf), cells.get("torch AdamW for-loop", math.inf))
        ratio = f"{cells['ApexW8bit'] / torch_best:.2f}" if "ApexW8bit" in cells and math.isfinite(torch_best) else "-"
        row = " | ".join(f"{cells[n]:.2f}" if n in cells else "-" for n in names)
        lines.append(f"| {w} | {row} | {ratio} |")
    if result["note"]:
        lines += ["", result["note"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
