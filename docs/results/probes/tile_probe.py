"""Kernel time of one launch over a workload, by state format, kernel variant and tile: the GPU's share of a step.

``scripts/bench_step.py`` times ``optimizer.step()`` (host work included); this times the single launch itself, through
a :class:`~apexw_hf.engines.triton.kernels.LaunchPlan` built once, ``--launches`` launches back to back (CUDA events
around each, median), so a row is the kernel's time whatever the host costs. It answers which tile (rows of 256
elements per program x warps) and which probe variant (``docs/results/probes/kernel_variants.py``: same bits with
another memory access pattern, or wrong numerics for timing only) is fastest on which workload; small-tensor sets such
as the LoRA one are bound by each program's latency, not by bandwidth, and can prefer other tiles than the large
tensors.

    python docs/results/probes/tile_probe.py --out tile.json                              # the default cases
    python docs/results/probes/tile_probe.py --workloads "4x8192^2 bf16" --cases 4bit:shipped:1x1,8bit:shipped:1x1
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "docs" / "results" / "probes"))

import kernel_variants  # noqa: E402
from bench_step import WORKLOADS, copy_bandwidth, environment, lora_3b_shapes, time_launches  # noqa: E402

from apexw_hf import reference as ref  # noqa: E402
from apexw_hf.engines.triton.kernels import launch  # noqa: E402
from apexw_hf.optim import state as st  # noqa: E402

WORKLOADS = {**WORKLOADS, "LoRA Llama-3.2-3B (392 bf16)": (lora_3b_shapes(), torch.bfloat16)}
TILES = ("1x1", "2x1", "1x2", "2x2", "4x4", "4x2")
DEFAULT_CASES = [f"{f}:shipped:1x1" for f in ("compact", "8bit")] + [f"4bit:shipped:{t}" for t in TILES]
DEFAULT_CASES += ["4bit:plain_store:1x1", "4bit:row_scale4:1x1", "8bit:runs_store:1x1", "8bit:shipped:2x1"]
DEFAULT_WORKLOADS = ["LoRA Llama-3.2-3B (392 fp32)", "LoRA Llama-3.2-3B (392 bf16)", "4x8192^2 fp32"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS), help="comma-separated bench_step workloads")
    ap.add_argument("--cases", default=",".join(DEFAULT_CASES), help="fmt:variant:ROWSxWARPS, comma-separated")
    ap.add_argument("--launches", type=int, default=60)
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds after which remaining cases are skipped")
    a = ap.parse_args()
    t0 = time.perf_counter()
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    scal = ref.StepScalars.make(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=10)
    rows = []
    shipped = launch._adamw_kernel
    for wname in a.workloads.split(","):
        shapes, dtype = WORKLOADS[wname]
        gen = torch.Generator(device="cuda").manual_seed(0)
        ps = [torch.randn(s, device="cuda", dtype=dtype, generator=gen) * 0.02 for s in shapes]
        gs = [torch.randn(s, device="cuda", dtype=dtype, generator=gen) * 1e-3 for s in shapes]
        states = {}
        for case in a.cases.split(","):
            if time.perf_counter() - t0 > a.deadline:
                rows.append(dict(workload=wname, case=case, status="skipped: deadline"))
                continue
            fmt, variant, tile = case.split(":")
            r, w = (int(x) for x in tile.split("x"))
            if fmt not in states:
                states[fmt] = [st.init_state(p, fmt) for p in ps]
                for s in states[fmt]:  # a state that is not all zeros: blocks with real scales
                    for k, x in s.items():
                        if isinstance(x, torch.Tensor) and x.dtype == torch.uint8 and x.numel() > 1:
                            x.random_(0, 256, generator=gen)
                        elif k.endswith("_scale"):
                            x.fill_(1e-3)
            sb = sum(st.state_tensor_bytes(s) - 4 for s in states[fmt])
            moved = sum(p.numel() * p.element_size() * 3 for p in ps) + 2 * sb
            try:
                launch._adamw_kernel = kernel_variants.load(variant)
                plan = launch.LaunchPlan(ps, states[fmt], fmt, list(range(len(ps))), 0, dtype, rows=r, num_warps=w)
                plan.set_grad_ptrs([g.data_ptr() for g in gs])
                tc = time.perf_counter()
                plan.launch(step=10, scalars=scal, maximize=False, stochastic_param=True)  # compiles
                torch.cuda.synchronize()
                compile_s = time.perf_counter() - tc
                med, low = time_launches(
                    lambda plan=plan: plan.launch(step=10, scalars=scal, maximize=False, stochastic_param=True),
                    a.launches,
                )
            finally:
                launch._adamw_kernel = shipped
            floor = moved / bw * 1e3
            rows.append(
                dict(
                    workload=wname,
                    case=case,
                    fmt=fmt,
                    variant=variant,
                    rows=r,
                    warps=w,
                    median_ms=med,
                    min_ms=low,
                    floor_ms=floor,
                    programs=plan.num_work,
                    compile_s=compile_s,
                )
            )
            print(
                f"{wname:30s} {case:24s} {med:8.4f} ms (min {low:.4f})  floor {floor:.4f} ({floor / med:4.0%})  "
                f"{plan.num_work} programs  compile {compile_s:.1f} s",
                flush=True,
            )
        del ps, gs, states
        torch.cuda.empty_cache()
    result = dict(environment=environment(), copy_bandwidth_Bps=bw, launches=a.launches, rows=rows)
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
