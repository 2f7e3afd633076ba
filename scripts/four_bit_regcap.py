"""Register caps for the 4-bit kernel on one GPU: time each cap against the compiler's choice, check the bits.

The 4-bit kernel (format version 2) with bf16 parameters rounded stochastically takes 80 registers per thread on
sm_90 (triton 3.6, one warp per program; version 1: 70), so fewer programs fit an SM; with fp32 parameters it takes
72 (as version 1) but ~11% more instructions. A cap (``LaunchPlan(..., maxnreg=N)``, ptxas ``.maxnreg``) trades
registers for spills or recomputation; only a timing says whether that helps. For each workload this script builds
one launch plan per cap over the same tensors, checks that one step with each cap gives exactly the parameters and
state of the uncapped step, then times the caps interleaved (round after round: cap A, cap B, ... so clock and
thermal drift hit all of them alike) and prints the median launch time per cap, with the registers and spill bytes
the compiled kernel reports. Kernel launches only (no optimizer step around them): the quantity issue 27's speed
target is about.

    python3 scripts/four_bit_regcap.py --caps 72,64 --out regcap.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
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

DEFAULT_WORKLOADS = ("4x8192^2 bf16", "4x8192^2 fp32", "Llama-3.2-1B shapes bf16")


def parse_caps(text: str) -> list[int | None]:
    caps: list[int | None] = [None]
    for item in filter(None, (x.strip() for x in text.split(","))):
        if not item.isdigit() or int(item) not in MAXNREG_RANGE:
            raise SystemExit(f"--caps: {item!r} is not a register count in 24..255")
        caps.append(int(item))
    return caps


def _plan(ps, states, dtype, cap):
    return LaunchPlan(ps, states, "4bit", list(range(len(ps))), 0, dtype, maxnreg=cap)


def run_workload(name: str, caps: list[int | None], rounds: int, launches: int) -> list[dict]:
    shapes, dtype = WORKLOADS[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    ps0 = [torch.randn(s, device="cuda", dtype=dtype, generator=gen) for s in shapes]
    gs = [torch.randn(s, device="cuda", dtype=dtype, generator=gen) * 1e-3 for s in shapes]
    scal = ref.StepScalars.make(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=10)

    def launch(plan):
        plan.launch(step=10, scalars=scal, maximize=False, stochastic_param=dtype != torch.float32)

    # bits: one step from the same parameters and state (a few warm steps first, so the state is nonzero)
    base_states = [st.init_state(p, "4bit") for p in ps0]
    warm = _plan(ps0, base_states, dtype, None)
    warm.set_grad_ptrs([g.data_ptr() for g in gs])
    for _ in range(3):
        launch(warm)
    ref_out = None
    same = {}
    for cap in caps:
        ps = [p.clone() for p in ps0]
        states = [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()} for s in base_states]
        plan = _plan(ps, states, dtype, cap)
        plan.set_grad_ptrs([g.data_ptr() for g in gs])
        launch(plan)
        torch.cuda.synchronize()
        out = ps + [v for s in states for k, v in s.items() if k != "step"]
        if ref_out is None:
            ref_out = out
        same[cap] = all(
            torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)) for a, b in zip(out, ref_out)
        )
        del ps, states, plan
    # timing: one plan per cap over the same tensors (the launches overwrite them; only time matters here)
    plans = {}
    for cap in caps:
        plans[cap] = _plan(ps0, base_states, dtype, cap)
        plans[cap].set_grad_ptrs([g.data_ptr() for g in gs])
        launch(plans[cap])  # compile
    torch.cuda.synchronize()
    meds: dict = {cap: [] for cap in caps}
    for _ in range(rounds):
        for cap in caps:
            med, _ = time_launches(lambda p=plans[cap]: launch(p), launches, warmup=3)
            meds[cap].append(med)
    rows = []
    for cap in caps:
        kernels = list(plans[cap]._compiled.values())
        k = kernels[0] if kernels else None
        rows.append(
            dict(
                workload=name,
                maxnreg=cap,
                median_ms=statistics.median(meds[cap]),
                round_medians_ms=[round(x, 4) for x in meds[cap]],
                registers=getattr(k, "n_regs", None),
                spill_bytes=getattr(k, "n_spills", None),
                bits_equal_to_uncapped=same[cap],
            )
        )
    del plans, ps0, gs, base_states
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--caps", default="72,64", help="comma-separated register caps, timed against no cap")
    ap.add_argument("--workloads", nargs="*", default=list(DEFAULT_WORKLOADS))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--launches", type=int, default=20, help="timed launches per cap and round (median taken)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown:
        raise SystemExit(f"--workloads: unknown {unknown}; known: {list(WORKLOADS)}")
    caps = parse_caps(args.caps)
    if not torch.cuda.is_available():
        raise SystemExit("four_bit_regcap.py times CUDA kernels and needs a GPU")
    env = environment()
    result = dict(
        environment=env,  # GPU, versions, git commit, date
        settings=dict(caps=caps, rounds=args.rounds, launches=args.launches),
        rows=[],
    )
    for w in args.workloads:
        result["rows"] += run_workload(w, caps, args.rounds, args.launches)
        if args.out:
            args.out.write_text(json.dumps(result, indent=1))
    print(f"{env['gpu']}  torch {env['torch']}  triton {env['triton']}  commit {env['git_commit']}  {env['date']}")
    print(f"{'workload':28s} {'maxnreg':>7s} {'ms':>8s} {'x none':>7s} {'regs':>5s} {'spill':>6s} bits")
    base = {r["workload"]: r["median_ms"] for r in result["rows"] if r["maxnreg"] is None}
    for r in result["rows"]:
        print(
            f"{r['workload']:28s} {str(r['maxnreg']):>7s} {r['median_ms']:8.3f} "
            f"{r['median_ms'] / base[r['workload']]:7.3f} {str(r['registers']):>5s} {str(r['spill_bytes']):>6s} "
            f"{'same' if r['bits_equal_to_uncapped'] else 'DIFFERENT'}"
        )


if __name__ == "__main__":
    main()
