"""The host link's bandwidth: pinned host <-> GPU copies, each direction alone and both at once.

What state offload can move per second at best (its copies are pinned, non-blocking, on two side streams). Median
of ``--repeats`` copies of ``--gib`` GiB each, timed with CUDA events; both-at-once runs one copy each way on two
streams and reports each direction's rate over the pair's wall time. Also the host's time per CUDA call that the
offload makes per piece (events, stream switches, small copies), which varies between hosts as the link does not.

    python3 benchmarks/bench_host_link.py --gib 1 --repeats 7 --out runs/host_link.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch


def _timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` runs (after one warm-up), timed with events on the device."""
    out = []
    for i in range(repeats + 1):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i:
            out.append(start.elapsed_time(end) / 1e3)
    return statistics.median(out)


def host_calls_us(n: int = 2000) -> dict[str, float]:
    """Host microseconds of each CUDA call a piece of state offload makes (median of five rounds of ``n`` calls): what
    the link's copies cost the host that queues them, beside what they take on the link."""
    import time

    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    host = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    hs, ds = [host[i << 20 : (i + 1) << 20] for i in range(64)], [dev[i << 20 : (i + 1) << 20] for i in range(64)]
    event = torch.cuda.Event()
    event.record()
    state = {"i": 0}

    def stream_context():
        with torch.cuda.stream(s1):
            pass

    def copy(direction):
        def run():
            state["i"] = i = (state["i"] + 1) % 64
            with torch.cuda.stream(s1 if direction == "in" else s2):
                if direction == "in":
                    ds[i].copy_(hs[i], non_blocking=True)
                else:
                    hs[i].copy_(ds[i], non_blocking=True)
        return run

    calls = {
        "torch.cuda.Event()": torch.cuda.Event,
        "Event() and record": lambda: torch.cuda.Event().record(s1),
        "record of an existing event": lambda: event.record(s1),
        "stream.wait_event": lambda: s2.wait_event(event),
        "torch.cuda.current_stream()": torch.cuda.current_stream,
        "with torch.cuda.stream(s)": stream_context,
        "stream context + 1 MiB copy in": copy("in"),
        "stream context + 1 MiB copy out": copy("out"),
    }
    out = {}
    for name, fn in calls.items():
        rounds = []
        for _ in range(5):
            for _ in range(50):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            rounds.append((time.perf_counter() - t0) / n * 1e6)
            torch.cuda.synchronize()
        out[name] = round(statistics.median(rounds), 2)
    return out


def measure(gib: float, repeats: int) -> dict:
    n = int(gib * 2**30)
    host_a = torch.empty(n, dtype=torch.uint8, pin_memory=True).fill_(1)
    host_b = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev_a = torch.empty(n, dtype=torch.uint8, device="cuda").fill_(2)
    dev_b = torch.empty(n, dtype=torch.uint8, device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def both():
        cur = torch.cuda.current_stream()
        s1.wait_stream(cur)
        s2.wait_stream(cur)
        with torch.cuda.stream(s1):
            dev_b.copy_(host_a, non_blocking=True)
        with torch.cuda.stream(s2):
            host_b.copy_(dev_a, non_blocking=True)
        cur.wait_stream(s1)
        cur.wait_stream(s2)

    h2d = _timed(lambda: dev_b.copy_(host_a, non_blocking=True), repeats)
    d2h = _timed(lambda: host_b.copy_(dev_a, non_blocking=True), repeats)
    pair = _timed(both, repeats)
    assert bool((dev_b == 1).all()) and bool((host_b == 2).all())
    from apexw_hf.provenance import source_commit

    commit, dirty = source_commit()
    return {
        "gpu": torch.cuda.get_device_name(),
        "commit": commit,
        "dirty": dirty,  # tracked files differ from that commit (a copy of a working tree: set APEXW_COMMIT)
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "bytes": n,
        "h2d_gb_s": n / h2d / 1e9,
        "d2h_gb_s": n / d2h / 1e9,
        "both_each_gb_s": n / pair / 1e9,
        "host_calls_us": host_calls_us(),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_host_link.py needs a CUDA GPU", file=sys.stderr)
        return 2
    row = measure(args.gib, args.repeats)
    print(f"{row['gpu']}: host->device {row['h2d_gb_s']:.1f} GB/s, device->host {row['d2h_gb_s']:.1f} GB/s, "
          f"both at once {row['both_each_gb_s']:.1f} GB/s each way")
    for name, us in row["host_calls_us"].items():
        print(f"  host time of {name:34} {us:6.2f} us")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(row, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
