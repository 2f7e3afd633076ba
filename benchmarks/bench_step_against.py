"""This tree's optimizer step against an older commit's, in one process on one GPU.

A format or kernel change is judged by its step time against the code before it, on the same GPU and in the same
process (METHOD: baselines in the same run). The older commit's package is imported under another name: extract it
first, then point ``--old`` at the folder that holds its ``apexw_hf``::

    mkdir -p /tmp/old && git archive 745d1b6 apexw_hf | tar x -C /tmp/old
    python benchmarks/bench_step_against.py --old /tmp/old --old-commit 745d1b6 --out against.json

(the package imports itself relatively, so a copy under another name is a second, independent package). Per workload
(``bench_step.WORKLOADS``) and optimizer class, three optimizers step equal copies of the parameters and gradients:
this tree's, the old commit's, and this tree's with the Triton kernel's non-finite gradient check off (what the check
costs, and this tree's time without it against an old commit that had none). Each is timed ``--steps`` steps with CUDA
events in ``--rounds`` interleaved rounds; the median step of each round, and the median over rounds, are reported.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_step import HP, WORKLOADS  # noqa: E402

import apexw_hf  # noqa: E402
from apexw_hf.engines import triton_engine  # noqa: E402
from apexw_hf.provenance import source_commit  # noqa: E402

DEFAULT_WORKLOADS = ["4x8192^2 fp32", "4x8192^2 bf16", "Llama-3.2-1B shapes bf16", "LoRA Llama-3.2-3B (392 fp32)"]


def import_old(folder: Path, tmp: Path):
    """The ``apexw_hf`` package under ``folder`` imported as ``apexw_old`` (a copy in ``tmp``)."""
    src = folder / "apexw_hf"
    if not (src / "__init__.py").is_file():
        raise SystemExit(f"--old {folder}: no apexw_hf package there (extract one: git archive <commit> apexw_hf)")
    shutil.copytree(src, tmp / "apexw_old")
    sys.path.insert(0, str(tmp))
    return importlib.import_module("apexw_old")


def make(pkg, cls: str, shapes, dtype, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=dtype, generator=g) * 0.02) for s in shapes]
    for p in ps:
        p.grad = torch.randn(p.shape, device="cuda", dtype=dtype, generator=g) * 1e-3
    return ps, getattr(pkg, cls)(ps, **HP)


def timed(opt, n: int) -> float:
    """The median of ``n`` steps of ``opt`` in ms (CUDA events between steps)."""
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    ev[0].record()
    for i in range(n):
        opt.step()
        ev[i + 1].record()
    torch.cuda.synchronize()
    return statistics.median(ev[i].elapsed_time(ev[i + 1]) for i in range(n))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", type=Path, required=True, help="a folder holding the older commit's apexw_hf")
    ap.add_argument("--old-commit", required=True, help="its commit, recorded with the results")
    ap.add_argument("--workloads", nargs="+", default=DEFAULT_WORKLOADS, choices=list(WORKLOADS))
    ap.add_argument("--classes", nargs="+", default=["ApexW8bit", "ApexW4bit"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_step_against.py times CUDA kernels: run it on a GPU host")
    t0 = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        old = import_old(args.old, Path(tmp))
        for name in args.workloads:
            shapes, dtype = WORKLOADS[name]
            for cls in args.classes:
                new, prev, nocheck = (make(pkg, cls, shapes, dtype) for pkg in (apexw_hf, old, apexw_hf))
                triton_engine(nocheck[1]).check_nonfinite = False
                for _, opt in (new, prev, nocheck):
                    for _ in range(args.warmup):
                        opt.step()
                torch.cuda.synchronize()
                times = {"new": [], "old": [], "new_nocheck": []}
                for _ in range(args.rounds):
                    for key, (_, opt) in zip(times, (new, prev, nocheck)):
                        times[key].append(timed(opt, args.steps))
                med = {k: statistics.median(v) for k, v in times.items()}
                row = dict(workload=name, optimizer=cls, ms=med, rounds_ms=times,
                           new_over_old=med["new"] / med["old"], check=med["new"] / med["new_nocheck"],
                           nocheck_over_old=med["new_nocheck"] / med["old"])
                rows.append(row)
                print(f"{name:30s} {cls:10s} new {med['new']:.3f} ms  old {med['old']:.3f}  "
                      f"new/old {row['new_over_old']:.3f}  check {row['check']:.3f}x  "
                      f"new without check / old {row['nocheck_over_old']:.3f}", flush=True)
                del new, prev, nocheck
                torch.cuda.empty_cache()
    out = dict(gpu=torch.cuda.get_device_name(), commit=source_commit(), old_commit=args.old_commit,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               versions={"torch": torch.__version__},
               command=" ".join(["python benchmarks/bench_step_against.py", *(argv or sys.argv[1:])]),
               seconds=round(time.perf_counter() - t0, 1), rows=rows)
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
