"""ApexW's step on the LoRA-3B shapes in a small autograd loop, alone and with other processes time-sharing the GPU.

The recipe grid (10 training processes on one GPU) timed `apexw_compact`'s `optimizer.step()` at 7-11 ms while
`apexw_8bit` and `apexw_4bit` showed only their ~0.11 ms kernel. This probe asks the same in a controlled set-up:
a training-like loop (a matmul "model", gradients made by autograd, ``zero_grad(set_to_none=True)``: gradients at
allocator-chosen addresses every step, as in a Trainer) for each format, first alone, then with ``--background``
processes running matmul loops on the same GPU. Per format and set-up it reports the median span of CUDA events
around ``optimizer.step()`` (as the recipe measures it), the median host time of the call, and how many steps found
their gradients at new addresses (``TritonEngine.grad_moves``).

    python docs/results/probes/shared_gpu_step.py --background 6 --out results.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
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


def _busy(stop_at: float) -> None:
    """A process that keeps submitting GPU work (bf16 matmuls) until ``stop_at`` (time.time())."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    while time.time() < stop_at:
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()


def _run(fmt: str, steps: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = lora_3b_shapes()
    ps = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=gen) * 0.02) for s in shapes]
    ws = [torch.randn(s, device="cuda", generator=gen) for s in shapes]
    x = torch.randn(2048, 2048, device="cuda", generator=gen)
    opt = ApexW(ps, lr=1e-4, state_format=fmt, engine="triton")
    spans, host = [], []
    for _ in range(steps):
        y = x
        for _ in range(8):  # the "model": GPU work queued ahead of the step
            y = torch.tanh(y @ x) * 0.5
        loss = y.mean() + sum((p * w).sum() for p, w in zip(ps, ws))
        loss.backward()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t = time.perf_counter()
        opt.step()
        host.append((time.perf_counter() - t) * 1e3)
        end.record()
        spans.append((start, end))
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    ms = [s.elapsed_time(e) for s, e in spans][steps // 5 :]
    host = host[steps // 5 :]
    return {
        "format": fmt,
        "steps": steps,
        "event_span_ms_median": statistics.median(ms),
        "event_span_ms_p90": sorted(ms)[int(0.9 * (len(ms) - 1))],
        "host_ms_median": statistics.median(host),
        "grad_moves": opt._engine.grad_moves,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--background", type=int, default=6, help="processes time-sharing the GPU in the second pass")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--formats", nargs="*", default=["compact", "8bit", "4bit"])
    ap.add_argument("--seconds", type=float, default=60.0, help="how long the background processes run at most")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    rows = []
    for fmt in a.formats:
        rows.append({"background": 0, **_run(fmt, a.steps)})
        print(rows[-1], flush=True)
    ctx = mp.get_context("spawn")
    stop_at = time.time() + a.seconds
    procs = [ctx.Process(target=_busy, args=(stop_at,)) for _ in range(a.background)]
    for p in procs:
        p.start()
    time.sleep(8)  # let them start submitting
    for fmt in a.formats:
        rows.append({"background": a.background, **_run(fmt, a.steps)})
        print(rows[-1], flush=True)
    for p in procs:
        p.terminate()
        p.join()
    result = {"environment": environment(), "rows": rows}
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))
    print(f"{'format':8s} {'bg':>3s} {'span ms':>8s} {'p90':>7s} {'host ms':>8s} moves/steps")
    for r in rows:
        print(
            f"{r['format']:8s} {r['background']:3d} {r['event_span_ms_median']:8.3f} {r['event_span_ms_p90']:7.3f} "
            f"{r['host_ms_median']:8.3f} {r['grad_moves']}/{r['steps']}"
        )


if __name__ == "__main__":
    main()
