"""Repeat the FSDP2 resume test (tests/distributed/test_fsdp_ddp.py::test_fsdp2_checkpoint_resume_is_exact) many times,
optionally under CPU load, and count where the resumed runs part from the unbroken ones (issue 44, item 4).

Each repetition is the test's own body (``resume_once``: 12 unbroken steps, 7 steps, a DCP or full-state-dict
checkpoint, a new model and optimizer loaded from it, 5 more steps, compared bit for bit at every step) on 2 gloo ranks
on the CPU. By default one pair of ranks runs every repetition (about 1 s each on 2 cores: no process start or import
per repetition); ``--fresh`` starts a new pair per repetition, as the test does (about 8 s each, most of it imports).

    python scripts/stress_fsdp_resume.py [--cases compact-sharded,compact-full] [--reps 100] [--threads 1]
        [--busy 2] [--fresh] [--log FILE.jsonl]
    python scripts/stress_fsdp_resume.py --first-tanh 400   # the cause, without FSDP2 (below)

``--threads``: intra-op threads per rank (the tests use 1; CI's one failure, at 0ef69ba, ran with the default, 2 on
a 2-core machine). ``--busy K``: K background busy loops at nice 19 for the duration (stopped at the end, by their
process ids). Every repetition appends a JSON line per rank (case, threads, equal, where, seconds, load average) to
``--log``; the summary counts the distinct ``where`` values per case. Exit status 1 when any repetition parted.

What it showed on the 2-core machine (load average 7-12 from busy loops and other test runs), at e72193a:
``--threads 2 --fresh``, compact-sharded: 1 of 87 runs parted, rank 1 with ``where="step 1: the loss"`` and rank 0
with ``"step 1: grads of parameters [0, 1, 2, 3]"`` (equal=False on both). Step 1 of the unbroken run and of the
7-step run start from the same initial parameters before any optimizer step or checkpoint, so that difference is in
the first forward of one of the two runs on rank 1 (FSDP2's all-gather on gloo, or the CPU math of the forward), not
in ApexW, DCP or the resume. Nothing parted in 300 in-process repetitions at 2 threads, 300 at 1 thread, 150
compact-full at 2 threads, 40 each of 8bit/4bit sharded/full at 1 thread, 5 x ``pytest -k resume`` (6 cases) and 16
pytest-style fresh runs at 1 thread; switching the thread count (1 to 4) between the three runs changed no bit.

The cause: the first ``torch.tanh`` of a process at 2 intra-op threads. With each forward pass recorded (every Linear
and Tanh module's input, unsharded weight and bias, and output), 2 of 400 fresh runs parted at step 1, where the
unbroken run's forward holds the process's first tanh, in the output of the Tanh module whose input was equal: 1,199
and 1,200 of its 2,400 elements, one thread's share of the rows, differed by ~800-870 ulp, and the difference was
there when the output was recorded (0 of the next 369 runs parted). Without FSDP2, gloo or ApexW, ``--first-tanh N``
starts N processes that each compare their first and second ``torch.tanh`` of the same 8 x 300 tensor at 2 threads:
2 of 400 differed (1,198 elements, the second thread's rows 4-7, the first call up to 671 ulp from tanh in float64,
the second 0.5 ulp). It is a one-time initialization racing between the threads (float ``tanh`` on the CPU goes to
MKL's vector math in torch's builds with MKL; not located further). The ranks now run
:func:`tests.distributed.workers.warm_up` (a forward and backward of the model at their thread count) before any run
that is compared, and the tests compute on one thread.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _rank(rank, world, store, tmp, cases, reps, threads, log):
    import torch
    import torch.distributed as dist

    from tests.distributed import workers as w
    from tests.distributed.test_fsdp_ddp import resume_once

    w.init(rank, world, store, threads)
    for i in range(reps):
        for case in cases:
            fmt, kind = case.split("-", 1)
            out = os.path.join(tmp, f"{case}-{i}")
            if rank == 0:
                os.makedirs(out)
            dist.barrier()
            t0 = time.perf_counter()
            r = resume_once(rank, world, out, fmt, kind == "full")
            line = dict(case=case, rep=i, rank=rank, threads=torch.get_num_threads(), **r)
            line.update(s=round(time.perf_counter() - t0, 2), load=round(os.getloadavg()[0], 2))
            with open(log, "a") as f:
                f.write(json.dumps(line) + "\n")
    w.finish()


def _spawn(cases, reps, threads, log):
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        args = (2, os.path.join(tmp, "store"), tmp, cases, reps, threads, log)
        mp.spawn(_rank, args=args, nprocs=2, join=True)


_FIRST_TANH = """
import torch
torch.set_num_threads(2)
x = torch.randn(8, 300, generator=torch.Generator().manual_seed(0)) * 2
first, second = torch.tanh(x), torch.tanh(x)
d = first.view(torch.int32) - second.view(torch.int32)
exact = torch.tanh(x.double())
ulp = float(((first.double() - exact).abs() / exact.abs().clamp_min(1e-30)).max() / 2**-23)
rows = sorted(set(d.nonzero()[:, 0].tolist()))
print(f"{int((d != 0).sum())} elements differ, rows {rows}, first call up to {ulp:.1f} ulp from float64 tanh")
"""


def _first_tanh(n: int) -> int:
    """Start ``n`` processes that each compare their first and second ``torch.tanh`` (the cause, see the docstring)."""
    counts = collections.Counter()
    for _ in range(n):
        out = subprocess.run([sys.executable, "-c", _FIRST_TANH], capture_output=True, text=True, check=True)
        counts[out.stdout.strip()] += 1
    for line, k in counts.most_common():
        print(f"{k:5d} x {line}")
    return 1 if any(not line.startswith("0 elements") for line in counts) else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="compact-sharded", help="fmt-sharded or fmt-full, comma-separated")
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--busy", type=int, default=0)
    ap.add_argument("--fresh", action="store_true", help="a new pair of ranks per repetition, as the test")
    ap.add_argument("--log", default="stress_fsdp_resume.jsonl")
    ap.add_argument("--first-tanh", type=int, default=0, metavar="N", help="only: N processes' first torch.tanh")
    a = ap.parse_args()
    if a.first_tanh:
        return _first_tanh(a.first_tanh)
    cases = a.cases.split(",")
    for case in cases:
        fmt, _, kind = case.partition("-")
        if fmt not in ("fp32", "compact", "8bit", "4bit") or kind not in ("sharded", "full"):
            ap.error(f"bad case {case!r}: fmt-sharded or fmt-full")
    log = os.path.abspath(a.log)
    start = sum(1 for _ in open(log)) if os.path.exists(log) else 0
    busy = [subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", "while True: pass"]) for _ in range(a.busy)]
    t0 = time.time()
    try:
        if a.fresh:
            for _ in range(a.reps):
                _spawn(cases, 1, a.threads, log)
        else:
            _spawn(cases, a.reps, a.threads, log)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    with open(log) as f:
        lines = [json.loads(x) for x in list(f)[start:]]
    counts = collections.Counter((x["case"], x["rank"], x["equal"], x["where"]) for x in lines)
    runs = len(lines) // 2
    took = time.time() - t0
    print(f"{runs} runs ({a.reps} x {len(cases)} cases) x 2 ranks in {took:.0f} s, threads {a.threads}, busy {a.busy}")
    for (case, rank, equal, where), n in sorted(counts.items(), key=str):
        print(f"  {case} rank {rank}: {n} x equal={equal} where={where}")
    return int(any(not x["equal"] or x["where"] is not None for x in lines))


if __name__ == "__main__":
    sys.exit(main())
