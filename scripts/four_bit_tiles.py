"""4-bit kernel variants against version 1, in one process on one GPU: tiles, register caps, and the old kernel.

Issue 27's speed target compares the 4-bit kernel of format version 2 with version 1's. Two benchmark processes one
after the other (scripts/gpu_four_bit_v2_check.sh with V1_DIR) leave a few percent of process-to-process drift in
that ratio; this script times both kernels in the SAME process, interleaved round after round on the same
parameters and gradients, so drift hits both alike. Version 1 is loaded from a source copy of a329abf (``--v1``, made
with ``git archive a329abf apexw_hf | tar -x -C runs/v1_4bit``) as the package ``apexw_v1`` (its kernel, reference
and state modules only: they import each other relatively), beside this checkout's ``apexw_hf``.

Each version-2 variant is a tile (rows of 256 elements per program x warps) and a register cap
(``LaunchPlan(rows=, num_warps=, maxnreg=)``); one step of each variant is checked bit for bit against the default
plan's step from the same parameters and state (a tile or a cap changes scheduling, never a result). Kernel launches
only, no optimizer step around them.

    python3 scripts/four_bit_tiles.py --v1 runs/v1_4bit --variants 1x1,1x1@72,2x2@72,4x4@72 --out tiles.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_step import WORKLOADS, environment, time_launches  # noqa: E402

from apexw_hf import reference as ref  # noqa: E402
from apexw_hf.engines.triton.kernels import LaunchPlan  # noqa: E402
from apexw_hf.engines.triton.kernels.launch import MAXNREG_RANGE  # noqa: E402
from apexw_hf.optim import state as st  # noqa: E402

DEFAULT_WORKLOADS = ("4x8192^2 bf16", "4x8192^2 fp32", "Llama-3.2-1B shapes bf16", "Llama-3.2-1B shapes fp32")


def parse_variants(text: str) -> list[tuple[int, int, int | None]]:
    """``"1x1,2x2@72"`` -> [(1, 1, None), (2, 2, 72)]: rows x warps, optionally @ a register cap."""
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        tile, _, cap = item.partition("@")
        r, _, w = tile.partition("x")
        if not (r.isdigit() and w.isdigit() and int(r) in (1, 2, 4, 8) and int(w) in (1, 2, 4, 8)):
            raise SystemExit(f"--variants: {item!r} is not ROWSxWARPS[@CAP] with rows and warps in 1, 2, 4, 8")
        if cap and not (cap.isdigit() and int(cap) in MAXNREG_RANGE):
            raise SystemExit(f"--variants: cap {cap!r} in {item!r} is not a register count in 24..255")
        out.append((int(r), int(w), int(cap) if cap else None))
    if not out:
        raise SystemExit("--variants: none given")
    return out


def load_v1(path: Path):
    """Version 1's kernels, reference and state modules from a source copy, as the package ``apexw_v1``."""
    pkg = path.resolve() / "apexw_hf"
    if not (pkg / "kernels" / "launch.py").is_file():
        raise SystemExit(f"--v1: {pkg} has no kernels/launch.py (a source copy of a329abf is expected)")
    # Package shells without their __init__ (which would import the integrations, and with them this apexw_hf).
    for name, where in (("apexw_v1", pkg), ("apexw_v1.optim", pkg / "optim")):
        mod = types.ModuleType(name)
        mod.__path__ = [str(where)]
        sys.modules[name] = mod
    launch = importlib.import_module("apexw_v1.kernels.launch")
    return (
        launch.LaunchPlan,
        importlib.import_module("apexw_v1.reference"),
        importlib.import_module("apexw_v1.optim.state"),
    )


def _bits(tensors):
    return [t.reshape(-1).view(torch.uint8).clone() for t in tensors]


def run_workload(name, variants, v1, rounds, launches):
    shapes, dtype = WORKLOADS[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    ps0 = [torch.randn(s, device="cuda", dtype=dtype, generator=gen) for s in shapes]
    gs = [torch.randn(s, device="cuda", dtype=dtype, generator=gen) * 1e-3 for s in shapes]
    stochastic = dtype != torch.float32
    scal = ref.StepScalars.make(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=10)

    def plan_v2(ps, states, var):
        r, w, cap = var
        return LaunchPlan(ps, states, "4bit", list(range(len(ps))), 0, dtype, rows=r, num_warps=w, maxnreg=cap)

    def launch_v2(plan):
        plan.launch(step=10, scalars=scal, maximize=False, stochastic_param=stochastic)

    # bits: one step of each variant from the same (warmed, nonzero) state, against the default plan's step
    base_states = [st.init_state(p, "4bit") for p in ps0]
    warm = LaunchPlan(ps0, base_states, "4bit", list(range(len(ps0))), 0, dtype)
    warm.set_grad_ptrs([g.data_ptr() for g in gs])
    for _ in range(3):
        launch_v2(warm)

    def one_step(plan_fn):
        ps = [p.clone() for p in ps0]
        states = [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()} for s in base_states]
        plan = plan_fn(ps, states)
        plan.set_grad_ptrs([g.data_ptr() for g in gs])
        launch_v2(plan)
        torch.cuda.synchronize()
        return _bits(ps + [v for s in states for k, v in s.items() if k != "step"])

    ref_bits = one_step(lambda ps, states: LaunchPlan(ps, states, "4bit", list(range(len(ps))), 0, dtype))
    same = {}
    for var in variants:
        out = one_step(lambda ps, states, var=var: plan_v2(ps, states, var))
        same[var] = all(torch.equal(a, b) for a, b in zip(out, ref_bits))
        del out
    del ref_bits
    # timing, interleaved: version 1 (its default plan) and each variant, round after round
    fns, plans = {}, {}
    for var in variants:
        plans[var] = plan_v2(ps0, base_states, var)
        plans[var].set_grad_ptrs([g.data_ptr() for g in gs])
        fns[var] = lambda p=plans[var]: launch_v2(p)
    if v1 is not None:
        plan_cls, ref1, st1 = v1
        states1 = [st1.init_state(p, "4bit") for p in ps0]
        p1 = plan_cls(ps0, states1, "4bit", list(range(len(ps0))), 0, dtype)
        p1.set_grad_ptrs([g.data_ptr() for g in gs])
        scal1 = ref1.StepScalars.make(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=10)
        fns["v1"] = lambda: p1.launch(step=10, scalars=scal1, maximize=False, stochastic_param=stochastic)
        plans["v1"] = p1
    for fn in fns.values():
        fn()  # compile
    torch.cuda.synchronize()
    meds = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            meds[k].append(time_launches(fn, launches, warmup=3)[0])
    rows = []
    for k in fns:
        compiled = list(plans[k]._compiled.values())
        kern = compiled[0] if compiled else None
        r, w, cap = (1, 1, None) if k == "v1" else k
        rows.append(
            dict(
                workload=name,
                kernel="version 1 (a329abf), default plan" if k == "v1" else "version 2",
                rows=r,
                num_warps=w,
                maxnreg=cap,
                median_ms=statistics.median(meds[k]),
                round_medians_ms=[round(x, 4) for x in meds[k]],
                registers=getattr(kern, "n_regs", None),
                spill_bytes=getattr(kern, "n_spills", None),
                bits_equal_to_default_plan=None if k == "v1" else same[k],
                paired_ratio_v1=paired_ratio(meds[k], meds["v1"]) if "v1" in meds else None,
            )
        )
    return rows


def paired_ratio(times: list[float], base: list[float]) -> float:
    """The median over rounds of each round's ``times[i] / base[i]``: the two kernels paired round by round, so
    drift between rounds cancels (the ratio of the two medians does not)."""
    if len(times) != len(base) or not times:
        raise ValueError(f"paired_ratio: {len(times)} rounds against {len(base)}")
    return statistics.median(a / b for a, b in zip(times, base))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="1x1,1x1@72,2x2@72,4x4@72", help="version-2 tiles ROWSxWARPS[@CAP]")
    ap.add_argument("--v1", type=Path, default=None, help="source copy of a329abf (4-bit version 1) to time beside")
    ap.add_argument("--workloads", nargs="*", default=list(DEFAULT_WORKLOADS))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--launches", type=int, default=20, help="timed launches per variant and round (median taken)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown:
        raise SystemExit(f"--workloads: unknown {unknown}; known: {list(WORKLOADS)}")
    variants = parse_variants(args.variants)
    if not torch.cuda.is_available():
        raise SystemExit("four_bit_tiles.py times CUDA kernels and needs a GPU")
    v1 = load_v1(args.v1) if args.v1 else None
    env = environment()
    result = dict(
        environment=env,
        settings=dict(variants=args.variants, v1=str(args.v1), rounds=args.rounds, launches=args.launches),
        rows=[],
    )
    print(f"{env['gpu']}  torch {env['torch']}  triton {env['triton']}  commit {env['git_commit']}  {env['date']}")
    print(
        f"{'workload':26s} {'kernel':6s} {'tile':>5s} {'cap':>4s} {'ms':>8s} {'x v1':>6s} {'paired':>6s} {'regs':>5s} "
        f"{'spill':>6s} bits"
    )
    for w in args.workloads:
        rows = run_workload(w, variants, v1, args.rounds, args.launches)
        torch.cuda.empty_cache()  # the workload's tensors went with run_workload's frame
        result["rows"] += rows
        if args.out:
            args.out.write_text(json.dumps(result, indent=1))
        base = next((r["median_ms"] for r in rows if r["kernel"].startswith("version 1")), None)
        for r in rows:
            ratio = f"{r['median_ms'] / base:6.3f}" if base else "     -"
            paired = "     -" if r["paired_ratio_v1"] is None else f"{r['paired_ratio_v1']:6.3f}"
            bits = {None: "-", True: "same", False: "DIFFERENT"}[r["bits_equal_to_default_plan"]]
            print(
                f"{r['workload']:26s} {'v1' if r['kernel'].startswith('version 1') else 'v2':6s} "
                f"{r['rows']}x{r['num_warps']:<3d} {str(r['maxnreg']):>4s} {r['median_ms']:8.3f} {ratio} {paired} "
                f"{str(r['registers']):>5s} {str(r['spill_bytes']):>6s} {bits}",
                flush=True,
            )


if __name__ == "__main__":
    main()
