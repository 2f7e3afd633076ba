"""What limits the AdamW kernel on large tensors: time probe variants and tiles against torch fused, on a GPU.

The compact kernel with bf16 parameters and the 8-bit kernel sit between two limits, instruction issue and memory
bandwidth (docs/results/step_benchmark/step_h200_2026-11-30.notes.md). This times, on 4 x 8192^2 tensors in one
process: torch fused AdamW; ApexW with the shipped kernel; probe variants of it (``docs/results/probes/kernel_variants.py``,
e.g. the approximate square root and division, which drop the IEEE contract: timing only); the bf16 parameters rounded
to nearest instead of stochastically; and other tiles (rows x warps) of the shipped kernel. If a variant with fewer
instructions is no faster, the kernel is bound by memory, not issue, and cutting instructions cannot help.

    python docs/results/probes/issue_probe.py [--out probe.json] [--steps 40]
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

import kernel_variants  # noqa: E402
from bench_step import HP, ClockSampler, bytes_moved, copy_bandwidth, environment, time_steps  # noqa: E402

from apexw_hf.engines.triton.kernels import launch  # noqa: E402
from apexw_hf.optim import ApexW  # noqa: E402

SHIPPED_KERNEL = launch._adamw_kernel
SHIPPED_CONFIG = {k: dict(v) for k, v in launch.LAUNCH_CONFIG.items()}


def cases(dtype):
    size = 4 if dtype == torch.float32 else 2
    out = []
    for fmt in ("compact", "8bit"):
        out.append((fmt, "shipped", None, True))
        out.append((fmt, "approx_math", None, True))
        if size == 2:
            out.append((fmt, "shipped", None, False))
            out.append((fmt, "approx_math", None, False))
        for tile in ((1, 1), (2, 1), (2, 2), (4, 4), (4, 2), (8, 4), (8, 8)):
            if tile != SHIPPED_CONFIG[fmt][size]:
                out.append((fmt, "shipped", tile, True))
    return out


def run(label, opt, params, dname, bw, steps, clocks, rows):
    t0 = time.perf_counter()
    med, n, _, ms = time_steps(opt, steps, 5, 30.0)
    row = dict(
        dtype=dname,
        case=label,
        median_ms=med,
        min_ms=min(ms),
        steps=n,
        floor_ms=bytes_moved(params, [p.grad for p in params], opt) / bw * 1e3,
        **clocks.summary(t0, time.perf_counter()),
    )
    rows.append(row)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--dtypes", default="bf16,fp32")
    a = ap.parse_args()
    bw = copy_bandwidth()
    clocks = ClockSampler()
    rows = []
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s")
    for dname in a.dtypes.split(","):
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dname]
        size = 4 if dtype == torch.float32 else 2
        gen = torch.Generator(device="cuda").manual_seed(0)
        params = [
            torch.nn.Parameter(torch.randn(8192, 8192, device="cuda", dtype=dtype, generator=gen) * 0.02)
            for _ in range(4)
        ]
        for p in params:
            p.grad = torch.randn(p.shape, device="cuda", dtype=dtype, generator=gen) * 1e-3
        common = dict(params=params, dname=dname, bw=bw, steps=a.steps, clocks=clocks, rows=rows)
        fused = torch.optim.AdamW(params, fused=True, **HP)
        base = run("torch_fused", fused, **common)
        del fused
        print(f"{dname} torch_fused {base['median_ms']:.3f} ms")
        for fmt, variant, tile, stochastic in cases(dtype):
            launch._adamw_kernel = kernel_variants.load(variant)
            if tile is not None:
                launch.LAUNCH_CONFIG[fmt][size] = tile
            label = f"{fmt} {variant}" + (f" tile {tile[0]}x{tile[1]}" if tile else "")
            label += "" if stochastic or size == 4 else " nearest-p"
            rounding = "stochastic" if stochastic else "nearest"
            try:
                opt = ApexW(params, state_format=fmt, engine="triton", param_rounding=rounding, **HP)
                row = run(label, opt, **common)
                del opt
            finally:
                launch._adamw_kernel = SHIPPED_KERNEL
                launch.LAUNCH_CONFIG[fmt][size] = SHIPPED_CONFIG[fmt][size]
            torch.cuda.empty_cache()
            row["speedup_vs_fused"] = base["median_ms"] / row["median_ms"]
            print(
                f"{dname} {label:40s} {row['median_ms']:.3f} ms (min {row['min_ms']:.3f}) "
                f"{row['speedup_vs_fused']:.2f}x fused, {row['floor_ms'] / row['median_ms']:.0%} of floor, "
                f"SM {row.get('sm_clock_mhz_median', '?')} MHz",
                flush=True,
            )
        del params
        torch.cuda.empty_cache()
    clocks.close()
    result = dict(environment=environment(), copy_bandwidth_Bps=bw, rows=rows)
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
