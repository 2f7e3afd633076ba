"""Host time of one ApexW kernel launch: through Triton's JIT vs the compiled kernel called directly (on a GPU).

The step of many small tensors (LoRA adapters) is host-bound: the GPU finishes the one kernel in ~0.1 ms, so the host
work before the launch shows up in the step time. ``LaunchPlan.launch`` goes through Triton's JIT for the first launch
of a specialization and calls the compiled kernel directly afterwards; this measures both ways of launching the same
plan (same arguments, no synchronization inside the timed loop), and ``ApexW.step``'s whole host time, on the LoRA
Llama-3.2-3B set (392 fp32 tensors) of scripts/bench_step.py.

    python docs/results/probes/launch_overhead.py [--calls 200] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_step import environment, lora_3b_shapes  # noqa: E402

from apexw_hf import ApexW  # noqa: E402
from apexw_hf.reference import StepScalars  # noqa: E402


def _host_us(fn, calls: int, repeats: int = 15) -> float:
    """Median over ``repeats`` of the mean host microseconds per call. The GPU queue is drained before each repeat and
    ``calls`` is kept small (launches queue without blocking), so this is host time, not kernel time."""
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=200, help="calls per timed repeat (15 repeats)")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=gen) * 0.02) for s in lora_3b_shapes()]
    for p in ps:
        p.grad = torch.randn(p.shape, device="cuda", generator=gen) * 1e-3
    rows = {}
    for fmt in ("compact", "8bit"):
        opt = ApexW(ps, lr=1e-4, state_format=fmt, engine="triton")
        for _ in range(3):
            opt.step()
        (plan, _, _), *_ = opt._engine._cache[id(opt.param_groups[0])].plans
        scalars = StepScalars.make(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=4)
        kw = dict(step=4, scalars=scalars, maximize=False, stochastic_param=True)

        def direct(plan=plan, kw=kw):
            plan.launch(**kw)

        def through_jit(plan=plan, kw=kw):
            plan._compiled.clear()  # every launch takes the JIT path (which finds the kernel in its cache)
            plan.launch(**kw)

        rows[fmt] = {
            "launch_direct_us": _host_us(direct, a.calls),
            "launch_through_jit_us": _host_us(through_jit, a.calls),
            "apexw_step_host_us": _host_us(opt.step, a.calls),
        }
        print(fmt, {k: round(v, 2) for k, v in rows[fmt].items()}, flush=True)
        del opt
    if a.out:
        res = {"environment": environment(), "tensors": len(ps), "calls": a.calls, "rows": rows}
        a.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
