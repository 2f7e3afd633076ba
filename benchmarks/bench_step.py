"""Optimizer-step benchmark on one GPU: ApexW (compact, 8-bit, 4-bit; auto and forced kernel) against every baseline.

Optimizer step only: gradients are random and fixed across steps; each step is timed with CUDA events after
warm-up, and the median of ``--steps`` steps is reported, with state bytes per parameter and the bandwidth floor
(bytes the step must move / measured device copy bandwidth) beside it. All optimizers of a workload run in the same
process, one after the other, so ratios are comparable. Results (with GPU, versions, git commit, date) go to one JSON
file; ``scripts/ledger.py add step`` adds it to the ledger and ``scripts/make_step_report.py`` turns the ledger
into docs/step_benchmark.md and a plot.

Usage (on the GPU host)::

    python benchmarks/bench_step.py --out step.json   # then: python scripts/ledger.py add step step.json
    python benchmarks/bench_step.py --tune          # kernel tile variants on the large workloads, no baselines
    # what the kernel's non-finite gradient check costs: each format with and without it, interleaved, twice
    python benchmarks/bench_step.py --optimizers apexw_8bit_triton apexw_8bit_nocheck apexw_8bit_triton \
        apexw_8bit_nocheck --out nonfinite_check.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from apexw_hf.provenance import source_commit  # noqa: E402

HP = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
T0 = time.perf_counter()
CLOCKS = None  # ClockSampler of the run (main)


# ---- workloads (FACTS.md) --------------------------------------------------------------------------------------


def lora_3b_shapes():
    dims = [(3072, 3072), (3072, 1024), (3072, 1024), (3072, 3072), (3072, 8192), (3072, 8192), (8192, 3072)]
    return [s for _ in range(28) for fi, fo in dims for s in ((16, fi), (fo, 16))]


def llama_1b_shapes():
    layer = [
        (2048, 2048),
        (512, 2048),
        (512, 2048),
        (2048, 2048),
        (8192, 2048),
        (8192, 2048),
        (2048, 8192),
        (2048,),
        (2048,),
    ]
    return [(128256, 2048), (2048,)] + layer * 16


WORKLOADS = {
    "4x8192^2 fp32": ([(8192, 8192)] * 4, torch.float32),
    "4x8192^2 bf16": ([(8192, 8192)] * 4, torch.bfloat16),
    "LoRA Llama-3.2-3B (392 fp32)": (lora_3b_shapes(), torch.float32),
    "Llama-3.2-1B shapes fp32": (llama_1b_shapes(), torch.float32),
    "Llama-3.2-1B shapes bf16": (llama_1b_shapes(), torch.bfloat16),
    "5000x4096 fp32": ([(4096,)] * 5000, torch.float32),
}


# ---- optimizers ------------------------------------------------------------------------------------------------


def _apexw(fmt, engine, param_rounding="stochastic"):
    def make(params):
        from apexw_hf.optim import ApexW

        return ApexW(params, state_format=fmt, engine=engine, param_rounding=param_rounding, **HP)

    return make


def _nocheck(fmt):
    """An ApexW whose Triton engine leaves out the kernel's non-finite gradient check
    (``TritonEngine(check_nonfinite=False)``): what the check costs is its row's time minus the same format's
    ``_triton`` row, timed in one process (``--optimizers apexw_8bit_triton apexw_8bit_nocheck ...``; name them twice,
    interleaved, to see the run-to-run spread). Not in the default list: not a configuration anyone trains with."""

    def make(params):
        from apexw_hf.engines import triton_engine

        opt = _apexw(fmt, "triton")(params)
        triton_engine(opt).check_nonfinite = False
        return opt

    return make


def _torch(**kw):
    return lambda params: torch.optim.AdamW(params, **HP, **kw)


def _torch_fused_bf16_state(params):
    opt = torch.optim.AdamW(params, fused=True, **HP)
    for p in params:
        opt.state[p] = {
            "step": torch.tensor(0.0, device=p.device),  # the fused kernel wants its step counters on the device
            "exp_avg": torch.zeros_like(p, dtype=torch.bfloat16),
            "exp_avg_sq": torch.zeros_like(p, dtype=torch.bfloat16),
        }
    return opt


class _Compiled:
    """torch.compile of the torch AdamW step (foreach implementation, lr as a tensor: no recompiles per value)."""

    def __init__(self, params):
        hp = dict(HP)
        hp["lr"] = torch.tensor(hp["lr"], device=params[0].device)
        self.opt = torch.optim.AdamW(params, foreach=True, capturable=True, **hp)
        self.state = self.opt.state
        self._step = torch.compile(self.opt.step)

    def step(self):
        self._step()


def _bnb(params):
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(params, **HP)


def _torchao(bits):
    def make(params):
        from torchao.optim import AdamW4bit, AdamW8bit

        return (AdamW8bit if bits == 8 else AdamW4bit)(params, **HP)

    return make


OPTIMIZERS = {
    "apexw_compact_auto": _apexw("compact", "auto"),
    "apexw_compact_triton": _apexw("compact", "triton"),
    "apexw_8bit_auto": _apexw("8bit", "auto"),
    "apexw_8bit_triton": _apexw("8bit", "triton"),
    "apexw_4bit_auto": _apexw("4bit", "auto"),
    "apexw_4bit_triton": _apexw("4bit", "triton"),
    # bf16 parameters rounded to nearest, as torch fused rounds them (the default rounds stochastically)
    "apexw_compact_nearest": _apexw("compact", "triton", "nearest"),
    "apexw_8bit_nearest": _apexw("8bit", "triton", "nearest"),
    "apexw_4bit_nearest": _apexw("4bit", "triton", "nearest"),
    "torch_fused": _torch(fused=True),
    "torch_foreach": _torch(foreach=True),
    "torch_fused_bf16_state": _torch_fused_bf16_state,
    "bnb_adamw8bit": _bnb,
    "torch_compile": _Compiled,
    "torchao_adamw8bit": _torchao(8),
    "torchao_adamw4bit": _torchao(4),
    # the kernel without its non-finite gradient check (see _NoCheck; asked for by name only)
    "apexw_compact_nocheck": _nocheck("compact"),
    "apexw_8bit_nocheck": _nocheck("8bit"),
    "apexw_4bit_nocheck": _nocheck("4bit"),
}
ON_REQUEST = ("apexw_compact_nocheck", "apexw_8bit_nocheck", "apexw_4bit_nocheck")  # not in the default list
# Baselines with long warm-up (compilation): a run past its --deadline skips these, and says so.
SLOW = ("torch_compile", "torchao_adamw8bit", "torchao_adamw4bit")

# Rows that would repeat another row (param_rounding has no effect on fp32 parameters).
NOT_APPLICABLE = {
    (f"apexw_{fmt}_nearest", w): "param_rounding applies to bf16/fp16 parameters only: with fp32 parameters "
    f"this is apexw_{fmt}_triton"
    for fmt in ("compact", "8bit", "4bit")
    for w, (_, dtype) in WORKLOADS.items()
    if dtype == torch.float32
}
# What a run on a budget leaves out, and why (stored with the results; nothing is left out silently);
# --no-budget-skips times them anyway.
BUDGET_SKIP = {
    ("torch_compile", "5000x4096 fp32"): "compiling a 5000-tensor step takes many minutes; outside the device budget",
    (
        "torch_compile",
        "LoRA Llama-3.2-3B (392 fp32)",
    ): "compile time (minutes for 392 tensors) outside this run's device "
    "budget; FACTS.md anchor: 5.30 ms vs fused 2.05 ms",
    (
        "torch_compile",
        "Llama-3.2-1B shapes fp32",
    ): "compile time outside this run's device budget; measured on the bf16 variant of the same shapes",
    ("torchao_adamw4bit", "5000x4096 fp32"): "torchao skips 4096-element tensors (< its size threshold) "
    "and one step of 5000 tensors takes seconds (FACTS.md: 2.5 s for 8-bit); outside the device budget",
    ("torchao_adamw8bit", "5000x4096 fp32"): "one step takes ~2.5 s (FACTS.md); outside the device budget",
}


# ---- measurement -----------------------------------------------------------------------------------------------


def copy_bandwidth(nbytes=4 << 30):
    a = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    return 2 * nbytes / statistics.median(times)


def state_bytes(opt):
    total = 0
    for st in opt.state.values():
        for v in st.values():
            if (
                hasattr(v, "__tensor_flatten__")
                and type(v) is not torch.Tensor
                and not isinstance(v, torch.nn.Parameter)
            ):  # torchao's quantized state is a tensor subclass: count its inner tensors
                names, _ = v.__tensor_flatten__()
                total += sum(getattr(v, n).numel() * getattr(v, n).element_size() for n in names)
            elif isinstance(v, torch.Tensor) and v.device.type == "cuda":
                total += v.numel() * v.element_size()
    return total


def bytes_moved(params, grads, opt) -> int:
    """Bytes one step must move: parameters read and written, gradients read, optimizer state read and written."""
    moved = sum(p.numel() * p.element_size() * 2 + g.numel() * g.element_size() for p, g in zip(params, grads))
    return moved + 2 * state_bytes(opt)


def time_steps(opt, steps, warmup, time_budget_s, warmup_s=0.25, min_window_s=0.5, before_step=None):
    """Median of CUDA-event step times after at least ``warmup`` steps and ``warmup_s`` seconds of warm-up.

    The time floor matters for host-bound steps (a fraction of a millisecond): right after compiles or idle, the
    first optimizer of a workload was slower than an identical one timed later in the same run.

    At least ``steps`` steps are timed, and more until they cover ``min_window_s`` seconds: 30 steps of a 0.2 ms
    host-bound step span 6 ms, so one pause of the host process of a few milliseconds (a garbage collection, another
    process on the core) moved the median of a whole row; over half a second it cannot. Steps so slow that ``steps``
    of them exceed ``time_budget_s`` stop after 3.

    ``before_step``: called before every step, outside the timed span (``--moving-grads`` swaps the gradients there).
    """
    before = before_step or (lambda: None)
    t0 = time.perf_counter()
    done = 0
    while done < warmup or (time.perf_counter() - t0 < warmup_s and done < 100 * max(1, warmup)):
        before()
        opt.step()
        done += 1
        if done == warmup:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    # Three timed steps decide how many to time.
    events = []
    t1 = time.perf_counter()
    n = steps
    i = 0
    while i < n:
        before()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        opt.step()
        e.record()
        events.append((s, e))
        if i == 2:
            torch.cuda.synchronize()
            per = (time.perf_counter() - t1) / 3
            if per * steps > time_budget_s:
                break
            n = max(steps, min(math.ceil(min_window_s / per), int(time_budget_s / per)))
        i += 1
    torch.cuda.synchronize()
    ms = [s.elapsed_time(e) for s, e in events]
    return statistics.median(ms), len(ms), warm_s, ms


class ClockSampler:
    """SM clock, power and clock-event (throttle) reasons of the benchmark's GPU, sampled every 100 ms by a background
    ``nvidia-smi`` while the benchmark runs, so each row can say at which clocks it was timed.

    The issue-bound kernels (8-bit) follow the SM clock, the memory-bound ones do not: without the clock beside the
    time, a slower row on another machine cannot be told apart from slower code. ``summary(t0, t1)`` gives the samples
    taken between two ``time.perf_counter()`` readings. Where ``nvidia-smi`` is missing or rejects the query, rows say
    the clocks were not recorded (``self.error``).
    """

    FIELDS = ("clocks.sm", "power.draw", "temperature.gpu")

    def __init__(self, interval_ms: int = 100):
        self.samples: list[tuple[float, float, float, float, str]] = []
        self.error = None
        self.proc = None
        uuid = str(getattr(torch.cuda.get_device_properties(0), "uuid", "") or "")
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
        targets = ([["-i", uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"]] if uuid else []) + [["-i", visible]]
        fields = ",".join(self.FIELDS)
        for target, reasons in itertools.product(
            targets, ("clocks_event_reasons.active", "clocks_throttle_reasons.active")
        ):
            query = ["nvidia-smi", f"--query-gpu={fields},{reasons}", "--format=csv,noheader,nounits", *target]
            try:
                probe = subprocess.run(query, capture_output=True, text=True, timeout=20)
            except (OSError, subprocess.TimeoutExpired) as e:
                self.error = f"nvidia-smi not usable: {e}"
                return
            lines = probe.stdout.strip().splitlines()
            if probe.returncode == 0 and len(lines) == 1 and self._parse(lines[0]) is not None:
                break
            self.error = f"nvidia-smi query failed: {(probe.stderr or probe.stdout).strip()[:200]}"
        else:
            return
        self.error = None
        self.proc = subprocess.Popen(
            query + ["-lms", str(interval_ms)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        threading.Thread(target=self._read, daemon=True).start()

    @staticmethod
    def _parse(line: str):
        parts = [x.strip() for x in line.split(",")]
        try:
            return float(parts[0]), float(parts[1]), float(parts[2]), parts[3]
        except (IndexError, ValueError):
            return None

    def _read(self) -> None:
        for line in self.proc.stdout:
            got = self._parse(line)
            if got is not None:
                self.samples.append((time.perf_counter(), *got))

    def summary(self, t0: float, t1: float) -> dict:
        if self.error:
            return {"clocks": f"not recorded ({self.error})"}
        got = [x for x in self.samples if t0 <= x[0] <= t1]
        if not got:
            return {"clocks": "no sample in this window"}
        sm = [x[1] for x in got]
        return {
            "sm_clock_mhz_min": min(sm),
            "sm_clock_mhz_median": statistics.median(sm),
            "power_w_max": max(x[2] for x in got),
            "temperature_c_max": max(x[3] for x in got),
            "clock_event_reasons": sorted({x[4] for x in got}),
            "clock_samples": len(got),
        }

    def close(self) -> None:
        if self.proc is not None:
            self.proc.terminate()


class _GradSwapper:
    """Two gradient sets of equal values at different addresses, swapped into ``.grad`` before every step: what a
    training loop whose ``zero_grad`` frees the gradients can hand the optimizer (new allocations each step)."""

    def __init__(self, params, grads):
        self.params, self.sets, self.turn = params, [grads, [g.clone() for g in grads]], 0

    def __call__(self):
        self.turn ^= 1
        for p, g in zip(self.params, self.sets[self.turn]):
            p.grad = g


def bench_workload(name, shapes, dtype, optimizers, args, bw):
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=dtype, generator=gen) * 0.02) for s in shapes]
    grads = [torch.randn(s, device="cuda", dtype=dtype, generator=gen) * 1e-3 for s in shapes]
    numel = sum(p.numel() for p in params)
    rows = []
    for opt_name in optimizers:
        row = dict(workload=name, optimizer=opt_name, num_tensors=len(shapes), numel=numel, dtype=str(dtype))
        if opt_name in SLOW and time.perf_counter() - T0 > args.deadline:
            row["status"] = "skipped: this run's device-time deadline was reached"
            rows.append(row)
            print(f"  {opt_name:24s} {row['status']}", flush=True)
            continue
        skip = NOT_APPLICABLE.get((opt_name, name)) or (
            None if args.no_budget_skips else BUDGET_SKIP.get((opt_name, name))
        )
        if skip:
            row["status"] = "skipped: " + skip
            rows.append(row)
            print(f"  {opt_name:24s} {row['status']}", flush=True)
            continue
        # Fresh copies of the parameters so every optimizer starts from the same values.
        ps = [torch.nn.Parameter(p.detach().clone()) for p in params]
        for p, g in zip(ps, grads):
            p.grad = g
        swap = _GradSwapper(ps, grads) if args.moving_grads else None
        if swap:
            row["gradients"] = "two sets at different addresses, alternating every step"
        try:
            opt = OPTIMIZERS[opt_name](ps)
            t_start = time.perf_counter()
            med, n, warm_s, ms = time_steps(
                opt, args.steps, args.warmup, args.time_budget, args.warmup_seconds, args.min_window, swap
            )
            row.update(CLOCKS.summary(t_start, time.perf_counter()) if CLOCKS else {})
            sb = state_bytes(opt)
            moved = bytes_moved(ps, grads, opt)
            row.update(
                status="ok",
                median_ms=med,
                steps_timed=n,
                warmup_s=warm_s,
                min_ms=min(ms),
                p90_ms=statistics.quantiles(ms, n=10)[-1] if len(ms) > 1 else ms[0],
                state_bytes=sb,
                state_bytes_per_param=sb / numel,
                bytes_moved=moved,
                floor_ms=moved / bw * 1e3,
                floor_fraction=moved / bw * 1e3 / med,
            )
            clk = f", SM {row['sm_clock_mhz_median']:.0f} MHz" if "sm_clock_mhz_median" in row else ""
            print(
                f"  {opt_name:24s} {med:9.3f} ms  (n={n}, floor {row['floor_ms']:.3f} ms, "
                f"{row['floor_fraction'] * 100:5.1f}% of floor, {sb / numel:.2f} B/param{clk})",
                flush=True,
            )
        except Exception as e:  # a refusal is a result too (e.g. torch fused with bf16 states)
            row["status"] = f"refused: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
            print(f"  {opt_name:24s} {row['status']}", flush=True)
            if args.verbose:
                traceback.print_exc()
        rows.append(row)
        del ps
        opt = swap = None
        gc.collect()
        torch.cuda.empty_cache()
    del params, grads
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def environment():
    def version(mod):
        try:
            return __import__(mod).__version__
        except Exception:
            return None

    commit, dirty = source_commit()
    return dict(
        gpu=torch.cuda.get_device_name(),
        capability=".".join(map(str, torch.cuda.get_device_capability())),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        triton=version("triton"),
        bitsandbytes=version("bitsandbytes"),
        torchao=version("torchao"),
        python=platform.python_version(),
        git_commit=commit,
        git_dirty=dirty,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )


def time_launches(fn, launches: int, warmup: int = 5) -> tuple[float, float]:
    """Median and minimum (ms, CUDA events) of ``launches`` back-to-back calls of ``fn`` after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ev = []
    for _ in range(launches):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        ev.append((s, e))
    torch.cuda.synchronize()
    ms = [s.elapsed_time(e) for s, e in ev]
    return statistics.median(ms), min(ms)


def tune(args, bw):
    """Kernel tile variants (rows of 256 per program, warps, alignment hints) on the large workloads."""
    from apexw_hf import formats as st
    from apexw_hf import reference as ref
    from apexw_hf.engines.triton.kernels import LaunchPlan

    out = []
    scal = ref.StepScalars.make(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=10)
    for wname in ("4x8192^2 fp32", "4x8192^2 bf16"):
        shapes, dtype = WORKLOADS[wname]
        ps = [torch.randn(s, device="cuda", dtype=dtype) for s in shapes]
        gs = [torch.randn(s, device="cuda", dtype=dtype) for s in shapes]
        for fmt in ("compact", "8bit", "4bit"):
            states = [st.init_state(p, fmt) for p in ps]
            sb = sum(st.state_tensor_bytes(s) - 4 for s in states)
            moved = sum(p.numel() * p.element_size() * 3 for p in ps) + 2 * sb
            for rows, warps, aligned in args.tune_configs[fmt]:
                plan = LaunchPlan(ps, states, fmt, list(range(len(ps))), 0, dtype, rows=rows, num_warps=warps)
                plan.set_grad_ptrs([g.data_ptr() for g in gs])
                plan.static_aligned = aligned
                fn = lambda plan=plan: plan.launch(step=10, scalars=scal, maximize=False, stochastic_param=True)  # noqa: E731
                med, _ = time_launches(fn, 30, warmup=1)
                floor = moved / bw * 1e3
                out.append(
                    dict(
                        workload=wname, fmt=fmt, rows=rows, warps=warps, aligned=aligned, median_ms=med, floor_ms=floor
                    )
                )
                print(
                    f"  tune {wname:16s} {fmt:8s} rows={rows:2d} warps={warps} aligned={aligned!s:5s} "
                    f"{med:7.3f} ms  floor {floor:.3f} ({floor / med * 100:.0f}%)",
                    flush=True,
                )
            del states
        del ps, gs
        torch.cuda.empty_cache()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="results JSON (default: print only)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument(
        "--warmup-seconds", type=float, default=0.25, help="warm up at least this long (at most 100x --warmup steps)"
    )
    ap.add_argument(
        "--min-window", type=float, default=0.5, help="time steps until they cover at least this many seconds"
    )
    ap.add_argument("--time-budget", type=float, default=20.0, help="seconds of timed steps per optimizer at most")
    ap.add_argument("--workloads", nargs="*", default=list(WORKLOADS))
    ap.add_argument(
        "--optimizers",
        nargs="*",
        default=[o for o in OPTIMIZERS if o not in ON_REQUEST],
        help="optimizer names, in the order they run (a name may repeat); besides the default ones: "
        + ", ".join(ON_REQUEST),
    )
    ap.add_argument("--skip", nargs="*", default=[], help="optimizer names to leave out (recorded as skipped)")
    ap.add_argument(
        "--no-budget-skips", action="store_true", help="time the baselines a full run skips for device time"
    )
    ap.add_argument("--tune", action="store_true", help="time kernel tile variants first")
    ap.add_argument("--bench", action="store_true", help="with --tune: then benchmark with the fastest tiles")
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds after which remaining entries are skipped")
    ap.add_argument(
        "--moving-grads",
        action="store_true",
        help="gradients at new addresses every step (two sets of equal values, swapped outside the timed span), as "
        "in training loops whose zero_grad frees them",
    )
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    args.tune_configs = {
        "compact": [(2, 4, True), (2, 2, True), (1, 1, True), (4, 4, True), (1, 2, True)],
        "8bit": [(2, 4, True), (2, 2, True), (1, 4, True), (1, 2, True), (1, 1, True), (2, 1, True)],
        "4bit": [(1, 1, True), (2, 2, True), (4, 4, True), (2, 1, True), (1, 2, True)],
    }

    global CLOCKS
    env = environment()
    CLOCKS = ClockSampler()
    env["clock_sampling"] = CLOCKS.error or "nvidia-smi every 100 ms: each row's SM clock, power, temperature, reasons"
    bw = copy_bandwidth()
    env["copy_bandwidth_GBps"] = bw / 1e9
    print(
        f"{env['gpu']}  torch {env['torch']}  triton {env['triton']}  bnb {env['bitsandbytes']}  "
        f"torchao {env['torchao']}  copy bandwidth {bw / 1e12:.2f} TB/s",
        flush=True,
    )
    settings = dict(
        steps=args.steps,
        warmup=args.warmup,
        warmup_seconds=args.warmup_seconds,
        min_window_seconds=args.min_window,
        hyperparameters=HP,
        moving_grads=args.moving_grads,  # gradients at new addresses every step (two sets swapped), or fixed
    )
    result = dict(environment=env, settings=settings, rows=[])
    if args.tune:
        result["tune"] = tune(args, bw)
        from apexw_hf.engines.triton.kernels import launch

        for fmt in ("compact", "8bit", "4bit"):
            for size, wname in ((4, "4x8192^2 fp32"), (2, "4x8192^2 bf16")):
                cands = [t for t in result["tune"] if t["fmt"] == fmt and t["workload"] == wname and t["aligned"]]
                best = min(cands, key=lambda t: t["median_ms"])
                launch.LAUNCH_CONFIG[fmt][size] = (best["rows"], best["warps"])
                if fmt == "compact":
                    launch.LAUNCH_CONFIG["fp32"][size] = (best["rows"], best["warps"])
        result["launch_config"] = {f: {str(k): v for k, v in c.items()} for f, c in launch.LAUNCH_CONFIG.items()}
        print("launch config:", result["launch_config"], flush=True)
    if not args.tune or args.bench:
        for w in args.workloads:
            shapes, dtype = WORKLOADS[w]
            print(
                f"{w}: {len(shapes)} tensors, {sum(torch.Size(s).numel() for s in shapes) / 1e6:.1f}M params",
                flush=True,
            )
            opts = [o for o in args.optimizers if o not in args.skip]
            result["rows"] += bench_workload(w, shapes, dtype, opts, args, bw)
            for o in args.skip:
                result["rows"].append(dict(workload=w, optimizer=o, status="skipped: left out of this run (--skip)"))
            if args.out:  # partial results survive a timeout
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(result, indent=1))
    CLOCKS.close()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    # Short table last: ratios to torch fused.
    fused = {r["workload"]: r.get("median_ms") for r in result["rows"] if r["optimizer"] == "torch_fused"}
    print(f"\n{'workload':32s} {'optimizer':24s} {'ms':>9s} {'x fused':>8s} {'%floor':>7s}")
    for r in result["rows"]:
        if r.get("status") == "ok":
            f = fused.get(r["workload"])
            ratio = f / r["median_ms"] if f else float("nan")
            print(
                f"{r['workload']:32s} {r['optimizer']:24s} {r['median_ms']:9.3f} {ratio:8.2f} "
                f"{r['floor_fraction'] * 100:6.0f}%"
            )


if __name__ == "__main__":
    main()
