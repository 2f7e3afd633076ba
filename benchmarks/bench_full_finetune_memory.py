"""What fits where: peak GPU memory and seconds per step of a full fine-tune through the Hugging Face Trainer.

One process per run (``--run``); the driver (default) runs every requested cell in its own subprocess, one at a
time, and writes one JSON per run plus ``results.csv`` under ``--out``. Llama shapes with random weights (no model
hub), bf16 model (``@fp32``: fp32 master weights under bf16 autocast), random tokens of ``--seq`` x ``--batch``,
gradient checkpointing, ``max_grad_norm`` 1.0 (the Trainer's default), ``--steps`` optimizer steps; s/step is the
median over the steps after ``--warmup``.

A step ends when the compute stream (the one the Trainer and the kernels run on) has finished its work: copies that
side streams still run then (a state offload's last copies back to the host, its first copies in for the next step)
overlap the next step as they do in training, and where they make it wait, that step's time shows it. That is what
the Trainer itself does: nothing in its loop waits for the whole device. ``--step-sync device`` waits for every stream
at each step's end instead (the time a step would take if it had to leave the device idle). ``s_per_step_drained`` is
the measured steps' mean with the whole device drained once at the end: where it exceeds the mean of their times
(``step_s``), work was left queued on a side stream (where it exceeds the median, s/step, slow outlier steps may be
all there is).

Cells are ``<optimizer>[+liger]@<dtype>``, the optimizer one of: ``torch_fused`` (torch.optim.AdamW(fused=True)),
``bnb_8bit`` (bitsandbytes AdamW8bit), ``torchao_8bit`` / ``torchao_4bit`` (torchao AdamW8bit/AdamW4bit with
``bf16_stochastic_round`` on a bf16 model), or any ApexW optim name (``apexw_8bit``, ``apexw_4bit_release``, ...),
which goes through ``TrainingArguments(optim=...)`` as a user would write it. ``+liger`` sets
``use_liger_kernel=True`` (Liger-Kernel's fused linear cross-entropy: the logits are never materialized).
``torchao_8bit_inbwd`` / ``torchao_4bit_inbwd`` run torchao's optimizers "in backward" by PyTorch's recipe (one
optimizer per parameter, stepped in its post-accumulate-grad hook with the scheduler's lr, the gradient freed at once;
:func:`in_backward_optimizer`): the gradient memory of gradient release without ApexW, and without clipping, which
needs every gradient (those cells run with ``max_grad_norm=0``).

``--optim-args`` passes ``TrainingArguments(optim_args=...)`` to the ApexW cells (``release_bucket_size=8388608``,
...); ``--tag`` names such a variant in the output files. ``--snapshot`` records the allocator's history over the
first step after the warm-up and writes ``<run>.peak.txt``: the step's peak replayed from the trace, the bytes
allocated before the step (weights, optimizer state, ...) and the step's own allocations alive at the peak, grouped
by the Python frame that made them (:func:`peak_breakdown`). With ``--snapshot-from build`` the recording starts once
the model is built, before the Trainer exists, and runs to the end of that same step: the baseline is then the
weights alone, and the optimizer's state, the Trainer's and the libraries' buffers show up by site too.

    python3 benchmarks/bench_full_finetune_memory.py --shapes 1b --cells apexw_8bit@bf16,apexw_8bit_release+liger@bf16
    python3 benchmarks/bench_full_finetune_memory.py --shapes 3b --cells apexw_4bit_release+liger@bf16 --snapshot \
        --optim-args release_bucket_size=8388608 --tag bucket8m
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

SHAPES = {  # Llama-3.2-1B, Llama-3.2-3B, Llama-3.1-8B
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}
GIB = 2**30
GPU_SIZES_GB = (16, 24, 32, 40, 80)
CONTEXT_GIB = 0.75  # CUDA context, cuBLAS workspace and what the driver keeps: assumed, not measured per GPU


def run_name(shape: str, cell: str, tag: str = "") -> str:
    """The file name stem of one run: ``3b_apexw_4bit_release_liger_at_bf16`` (+ ``_<tag>``)."""
    return f"{shape}_{cell.replace('@', '_at_').replace('+', '_')}" + (f"_{tag}" if tag else "")


def fits(reserved_gib: float) -> str:
    """The GPU sizes (GB, 10**9 bytes) whose memory holds the peak reserved bytes plus the context allowance."""
    ok = [s for s in GPU_SIZES_GB if reserved_gib + CONTEXT_GIB <= s * 1e9 / GIB]
    return ",".join(map(str, ok)) if ok else "-"


def in_backward_optimizer(inner_cls):
    """A ``torch.optim.Optimizer`` class for the Trainer that runs ``inner_cls`` by PyTorch's optimizer-in-backward
    recipe: one ``inner_cls`` optimizer per trainable parameter, stepped in the parameter's post-accumulate-grad hook
    with the lr and weight decay its group holds then (the Trainer's scheduler sets the group's lr), and the gradient
    freed at once. ``step()`` and ``zero_grad()`` find nothing left to do. Gradient clipping cannot work with it (no
    gradient outlives its hook): run it with ``max_grad_norm=0``."""
    import torch

    class InBackward(torch.optim.Optimizer):
        gradient_release = True

        def __init__(self, params, lr, **inner_kwargs):
            wd = inner_kwargs.pop("weight_decay", 0.0)
            super().__init__(params, {"lr": lr, "weight_decay": wd})
            self.inner = {}
            for gi, group in enumerate(self.param_groups):
                for p in group["params"]:
                    if p.requires_grad:
                        opt = inner_cls([p], lr=group["lr"], weight_decay=group["weight_decay"], **inner_kwargs)
                        self.inner[p] = (opt, gi)
                        p.register_post_accumulate_grad_hook(self._hook)

        def _hook(self, p):
            # the group by index: load_state_dict (Accelerate's prepare calls it) replaces the group dicts
            opt, gi = self.inner[p]
            group = self.param_groups[gi]
            for g in opt.param_groups:
                if isinstance(g["lr"], torch.Tensor):
                    g["lr"].fill_(group["lr"])
                else:
                    g["lr"] = group["lr"]
            opt.step()
            p.grad = None

        @torch.no_grad()
        def step(self, closure=None):
            if any(p.grad is not None for p in self.inner):
                raise RuntimeError("in-backward optimizer: a gradient outlived its hook (no accumulation with it)")

    return InBackward


_SITE_HINTS = ("apexw_hf", "liger_kernel", "transformers", "accelerate", "torch/utils/checkpoint", "torchao",
               "bitsandbytes", "bench_full_finetune_memory")


def _site(frames: list[dict]) -> str:
    """Where an allocation was made: the innermost frame in a library of the stack (else the innermost frame)."""
    if not frames:
        return "(no Python frame: autograd's engine thread)"
    pick = next((f for f in frames if any(h in f.get("filename", "") for h in _SITE_HINTS)), frames[0])
    name = pick.get("filename", "?")
    for h in _SITE_HINTS:
        if h in name:
            name = name[name.index(h):]
            break
    return f"{name}:{pick.get('line', '?')} {pick.get('name', '?')}"


def peak_breakdown(events: list[dict], baseline: int, top: int = 20) -> dict:
    """Replay an allocator trace (``torch.cuda.memory._snapshot()["device_traces"][device]``) that began with
    ``baseline`` bytes allocated: the peak, when it came, and the trace's allocations alive at it by site."""
    cur = peak = baseline
    peak_at = -1
    for i, ev in enumerate(events):
        if ev["action"] == "alloc":
            cur += ev["size"]
        elif ev["action"] == "free_completed":
            cur -= ev["size"]
        else:
            continue
        if cur > peak:
            peak, peak_at = cur, i
    live: dict[int, dict] = {}
    freed_before = 0  # bytes allocated before the trace and freed by the peak
    for ev in events[: peak_at + 1]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
        elif ev["action"] == "free_completed" and live.pop(ev["addr"], None) is None:
            freed_before += ev["size"]
    sites: dict[str, list[int]] = {}
    for ev in live.values():
        entry = sites.setdefault(_site(ev.get("frames") or []), [0, 0])
        entry[0] += ev["size"]
        entry[1] += 1
    ranked = sorted(sites.items(), key=lambda kv: -kv[1][0])
    return {
        "peak_bytes": peak, "baseline_bytes": baseline, "baseline_freed_by_peak": freed_before,
        "peak_event": peak_at, "events": len(events), "new_alive_at_peak": sum(v[0] for v in sites.values()),
        "sites": [{"site": k, "bytes": v[0], "blocks": v[1]} for k, v in ranked[:top]],
        "other_sites_bytes": sum(v[0] for _, v in ranked[top:]),
    }


def _peak_text(b: dict, run_peak: int, start: str = "step") -> str:
    mib = 2**20
    before, during = {
        "step": ("before the step (weights, optimizer state, ...)", "during the step"),
        "build": ("before the trace (the model's weights)", "from the Trainer's creation to the traced step's end"),
    }[start]
    lines = [
        f"peak of the recorded {'step' if start == 'step' else 'steps'}, replayed: {b['peak_bytes'] / GIB:.3f} GiB "
        f"(the run's max_memory_allocated: {run_peak / GIB:.3f} GiB; at trace event {b['peak_event']} of "
        f"{b['events']})",
        f"allocated {before}: {b['baseline_bytes'] / GIB:.3f} GiB, of which "
        f"{b['baseline_freed_by_peak'] / mib:.1f} MiB freed by the peak",
        f"allocated {during} and alive at the peak: {b['new_alive_at_peak'] / GIB:.3f} GiB, by site:", "",
    ]
    for s in b["sites"]:
        lines.append(f"{s['bytes'] / mib:10.1f} MiB {s['blocks']:6d} blocks  {s['site']}")
    lines.append(f"{b['other_sites_bytes'] / mib:10.1f} MiB in other sites")
    return "\n".join(lines) + "\n"


def run_one(cell: str, shape: str, args) -> dict:
    import torch
    from torch.utils.data import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    import apexw_hf
    from apexw_hf.integrations.transformers import APEXW_OPTIMIZERS

    spec, dtype_name = cell.split("@")
    optim, _, extra = spec.partition("+")
    liger = extra == "liger"
    model_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    cfg = LlamaConfig(vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=args.seq,
                      **SHAPES[shape])
    torch.manual_seed(0)
    torch.set_default_dtype(model_dtype)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    nparams = sum(p.numel() for p in model.parameters())

    class Tokens(Dataset):
        def __len__(self):
            return args.batch * (args.steps + 1)

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            ids = torch.randint(0, cfg.vocab_size, (args.seq,), generator=g)
            return {"input_ids": ids, "labels": ids}

    kw = {}
    training = dict(output_dir=str(Path(args.out) / "trainer" / f"{shape}_{cell}"), max_steps=args.steps,
                    per_device_train_batch_size=args.batch, learning_rate=1e-5, bf16=True, gradient_checkpointing=True,
                    logging_steps=max(1, args.steps // 2), save_strategy="no", report_to=[], max_grad_norm=1.0,
                    dataloader_num_workers=0, use_liger_kernel=liger, weight_decay=0.01)
    if args.optim_args and optim not in APEXW_OPTIMIZERS:
        raise SystemExit(f"--optim-args is for the ApexW cells; {cell!r} is not one")
    if optim in APEXW_OPTIMIZERS:
        training["optim"] = optim
        if args.optim_args:
            training["optim_args"] = args.optim_args
    elif optim == "torch_fused":
        kw["optimizer_cls_and_kwargs"] = (torch.optim.AdamW, {"lr": 1e-5, "fused": True})
    elif optim == "bnb_8bit":
        import bitsandbytes as bnb

        kw["optimizer_cls_and_kwargs"] = (bnb.optim.AdamW8bit, {"lr": 1e-5})
    elif optim in ("torchao_8bit", "torchao_4bit", "torchao_8bit_inbwd", "torchao_4bit_inbwd"):
        from torchao.optim import AdamW4bit, AdamW8bit

        cls = AdamW8bit if optim.startswith("torchao_8bit") else AdamW4bit
        if optim.endswith("_inbwd"):
            cls = in_backward_optimizer(cls)
            training["max_grad_norm"] = 0.0  # no gradient outlives its hook: nothing to clip
        kw["optimizer_cls_and_kwargs"] = (cls, {"lr": 1e-5, "bf16_stochastic_round": model_dtype == torch.bfloat16})
    else:
        raise SystemExit(f"unknown optimizer {optim!r}")

    times, grads_alive, release_marks = [], [], []
    prof = None
    if args.profile:
        # a few steps after the warm-up: where the host and the GPU spend each step (the release flushes run on the
        # autograd thread inside backward; a GPU waiting on them shows as device time well under the step's wall time)
        from torch.profiler import ProfilerActivity, profile, schedule

        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                       schedule=schedule(wait=args.warmup, warmup=2, active=args.profile, repeat=1))

    snapshot = {}
    call_totals = install_call_timers() if args.time_calls else None
    host_profile = install_host_profile() if args.host_profile else None
    call_marks = []

    # the forward pass's GPU time per step (CUDA events at the model's outermost forward; the recomputation of
    # checkpointed layers runs in backward and is not in it): what a step would take without backward, the part of a
    # state offload's link-bound step that its copies cannot hide behind
    forward_events, forward_steps, drained = [], [], []

    def _forward_start(module, inputs):
        if module.training:
            forward_events.append([torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)])
            forward_events[-1][0].record()

    def _forward_end(module, inputs, output):
        if module.training and forward_events:
            forward_events[-1][1].record()

    model.register_forward_pre_hook(_forward_start)
    model.register_forward_hook(_forward_end)

    class Probe(TrainerCallback):
        def on_step_begin(self, a, state, control, **k):
            if host_profile is not None and state.global_step == args.warmup:
                host_profile["on"] = True
            if args.snapshot and args.snapshot_from == "step" and state.global_step == args.warmup:
                torch.cuda.synchronize()
                snapshot["baseline"] = torch.cuda.memory_allocated()
                torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")

        def on_pre_optimizer_step(self, a, state, control, model=None, **k):
            grads_alive.append(sum(p.grad is not None for p in model.parameters()))

        def on_step_end(self, a, state, control, **k):
            if "baseline" in snapshot and "trace" not in snapshot and state.global_step > args.warmup:
                # the recorded step's time includes the recording and this read-out (one step of the median's)
                trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
                torch.cuda.memory._record_memory_history(enabled=None)
                snapshot["trace"] = trace
            if args.step_sync == "device":
                torch.cuda.synchronize()
            else:
                torch.cuda.current_stream().synchronize()
            times.append(time.perf_counter())
            if state.global_step == args.steps:  # the last step: what the side streams still had queued
                torch.cuda.synchronize()
                drained.append(time.perf_counter())
            forward_steps.append(forward_events[:])  # read at the end, once every stream's work is done
            forward_events.clear()
            if call_totals is not None:
                call_marks.append({k: tuple(v) for k, v in call_totals.items()})
            inner_opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
            release = getattr(inner_opt, "_release", None)
            if release is not None:
                # grad_moves: bucket launches whose gradients were at new addresses (checked and copied to the GPU)
                moves = getattr(getattr(inner_opt, "_engine", None), "grad_moves", 0)
                release_marks.append((release.flushes, release.host_seconds, moves))
            if prof is not None:
                prof.step()

    torch.cuda.reset_peak_memory_stats()
    if args.snapshot and args.snapshot_from == "build":
        torch.cuda.synchronize()
        snapshot["baseline"] = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    trainer = Trainer(model=model, args=TrainingArguments(**training), train_dataset=Tokens(), callbacks=[Probe()],
                      **kw)
    if prof is not None:
        prof.start()
    trainer.train()
    torch.cuda.synchronize()
    forward_s = [sum(start.elapsed_time(end) for start, end in events) / 1e3 for events in forward_steps]
    opt = trainer.optimizer
    inner = getattr(opt, "optimizer", opt)
    all_steps = [b - a for a, b in zip(times, times[1:])]
    steps = all_steps[args.warmup - 1:]
    release = {}
    if len(release_marks) > args.warmup:
        (f0, h0, m0), (f1, h1, m1) = release_marks[args.warmup - 1], release_marks[-1]
        n = len(release_marks) - args.warmup
        release = {"release_flushes_per_step": (f1 - f0) / n, "release_host_ms_per_step": 1e3 * (h1 - h0) / n,
                   "release_grad_moves_per_step": (m1 - m0) / n}
        offload = getattr(inner._release, "offload", None)
        if offload is not None:  # tied_grad_offload: gradient parts offloaded over the whole run
            release["tied_grad_parts_offloaded"] = offload.offloaded
    if getattr(inner, "state_offload", False):  # state_offload: the copies and prefetch hits over the whole run
        off = inner._offload
        n = max(len(times), 1)
        release.update(offload_gb_in_per_step=off.bytes_in / 1e9 / n, offload_gb_out_per_step=off.bytes_out / 1e9 / n,
                       offload_hits=off.hits, offload_misses=off.misses, offload_launches_per_step=len(off._order),
                       offload_staging_gib=inner.staging_bytes() / GIB,
                       state_host_gib=apexw_hf.optimizer_state_placement(inner)["host"] / GIB)
    calls = {}
    if len(call_marks) > args.warmup:
        first, last = call_marks[args.warmup - 1], call_marks[-1]
        n = len(call_marks) - args.warmup
        calls = {"host_calls_per_step": {k: {"calls": (last[k][0] - first[k][0]) / n,
                                            "ms": round(1e3 * (last[k][1] - first[k][1]) / n, 3)} for k in last}}
    name = run_name(shape, cell, args.tag)
    if host_profile is not None:
        out_file = Path(args.out) / f"{name}.host_profile.txt"
        host_profile = _write_host_profile(host_profile["prof"], out_file, len(steps))
    profile_file = None
    if prof is not None:
        prof.stop()
        profile_file = _write_profile(prof, Path(args.out) / f"{name}.profile.txt", args.profile, all_steps)
    peak_file, peak = None, None
    if "trace" in snapshot:
        peak = peak_breakdown(snapshot["trace"], snapshot["baseline"])
        peak_file = f"{name}.peak.txt"
        text = _peak_text(peak, torch.cuda.max_memory_allocated(), args.snapshot_from)
        (Path(args.out) / peak_file).write_text(text)
    if hasattr(inner, "inner"):  # the in-backward wrapper: its per-parameter optimizers hold the state
        state_bytes = sum(apexw_hf.optimizer_state_bytes(o) for o, _ in inner.inner.values())
    else:
        state_bytes = apexw_hf.optimizer_state_bytes(inner)
    logs = [h for h in trainer.state.log_history if "grad_norm" in h]
    return {
        "shape": shape, "cell": cell, "optimizer": optim, "liger": liger, "model_dtype": dtype_name,
        "params": nparams, "seq": args.seq, "batch": args.batch, "steps": args.steps,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB,
        "host_pinned_gib": _host_pinned_gib(),
        "s_per_step": statistics.median(steps) if steps else None,
        "s_per_step_drained": (drained[0] - times[args.warmup - 1]) / len(steps) if steps and drained else None,
        "step_sync": args.step_sync,
        "forward_s": statistics.median(forward_s[args.warmup:]) if len(forward_s) > args.warmup else None,
        "step_s": [round(t, 5) for t in all_steps],
        **release,
        **calls,
        "profile": profile_file,
        **({"host_profile": host_profile} if host_profile is not None else {}),
        "optimizer_state_mib": state_bytes / 2**20,
        "optim_args": args.optim_args or None, "tag": args.tag or None,
        "max_grad_norm": training["max_grad_norm"],
        "peak_breakdown": peak, "peak_file": peak_file, "snapshot_step": args.warmup + 1 if args.snapshot else None,
        "snapshot_from": args.snapshot_from if args.snapshot else None,
        "gradient_release": bool(getattr(inner, "gradient_release", False)),
        "grads_alive_before_step": grads_alive[-1] if grads_alive else None,
        "logged_grad_norm": logs[-1]["grad_norm"] if logs else None,
        "loss": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        # a run whose weights went non-finite still has a peak and a speed, which must not be read as a result
        "finite": all(math.isfinite(h.get("grad_norm", 0.0)) and math.isfinite(h.get("loss", 0.0)) for h in logs)
        and all(bool(torch.isfinite(p).all()) for p in model.parameters()),
    }


def _host_pinned_gib() -> float | None:
    """Pinned host memory the caching host allocator holds (GiB; it rounds a block up to a power of two), where this
    torch reports it."""
    import torch

    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None:
        return None
    value = stats().get("reserved_bytes.current", stats().get("allocated_bytes.current"))
    return None if value is None else value / GIB


# --time-calls: the optimizer's host-side functions, timed by wrappers (they run on autograd's thread inside backward
# with gradient release, where cProfile, bound to the thread that enabled it, does not see them)
TIMED_CALLS = (
    "apexw_hf.optim.release:GradientRelease.on_grad_ready",
    "apexw_hf.optim.release:GradientRelease.flush",
    "apexw_hf.optim.release:GradientRelease._account",
    "apexw_hf.optim.release:GradientRelease._account_parts",
    "apexw_hf.optim.release:_norm_parts",
    "apexw_hf.engines.triton.kernels.release_norm:grad_sumsq_",
    "apexw_hf.engines.triton.kernels.release_norm:release_norm_",
    "apexw_hf.engines.torch:_scale_grads_",
    "apexw_hf.engines.triton.engine:TritonEngine.step_group",
    "apexw_hf.engines.triton.engine:TritonEngine._check_grads",
    "apexw_hf.engines.triton.kernels.launch:LaunchPlan.set_grad_ptrs",
    "apexw_hf.engines.triton.kernels.launch:LaunchPlan.launch",
    "apexw_hf.engines.triton.kernels.launch:LaunchPlan.state_table",
    "apexw_hf.optim.offload:StateOffload._stage",
    "apexw_hf.optim.offload:StateOffload._done",
    "apexw_hf.optim.offload:StateOffload._copy_in",
    "apexw_hf.optim.offload:StateOffload._prefetch",
    "apexw_hf.optim.offload:StateOffload._copies",
    "apexw_hf.optim.offload:StateOffload._ready_events",
    "apexw_hf.optim.offload:StateOffload._drop_overlaps",
    "apexw_hf.optim.offload:StateOffload._pump",
    "apexw_hf.optim.offload:StateOffload.host_state",
    "apexw_hf.optim.offload:StateOffload._cut",
)


def install_call_timers() -> dict[str, list]:
    """Wrap each of ``TIMED_CALLS`` with a timer: name -> [calls, seconds] (nested calls count in both)."""
    import functools
    import importlib

    totals = {}
    for spec in TIMED_CALLS:
        module_name, qual = spec.split(":")
        owner = importlib.import_module(module_name)
        *path, attr = qual.split(".")
        for part in path:
            owner = getattr(owner, part)
        fn = getattr(owner, attr)
        totals[qual] = acc = [0, 0.0]

        def timed(*a, _fn=fn, _acc=acc, **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                _acc[0] += 1
                _acc[1] += time.perf_counter() - t0

        setattr(owner, attr, functools.wraps(fn)(timed))
    return totals


def install_host_profile() -> dict:
    """--host-profile: a cProfile of gradient release's ``on_grad_ready`` (backward's hooks, on autograd's thread,
    where a profiler enabled on the main thread does not look), enabled inside each call once ``["on"]`` is set."""
    import cProfile

    from apexw_hf.optim import release

    fn = release.GradientRelease.on_grad_ready
    state = {"on": False, "prof": cProfile.Profile()}

    def profiled(*a, **k):
        if not state["on"]:
            return fn(*a, **k)
        state["prof"].enable()
        try:
            return fn(*a, **k)
        finally:
            state["prof"].disable()

    release.GradientRelease.on_grad_ready = profiled
    return state


def _write_host_profile(prof, path: Path, steps: int) -> str:
    """The profiled calls' functions by their own time (cProfile's overhead included), written to ``path`` and
    returned (the run's JSON keeps it as ``host_profile``)."""
    import io
    import pstats

    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(45)
    text = f"cProfile of GradientRelease.on_grad_ready over {steps} steps after the warm-up\n{buf.getvalue()}"
    path.write_text(text)
    return text


def _write_profile(prof, path: Path, steps: int, step_times: list[float]) -> str:
    """The profiled steps' operators by self CUDA and self CPU time, and the GPU's busy time per step."""
    events = prof.key_averages()
    from torch.autograd import DeviceType

    # kernels only (an operator's row repeats the time of the kernels it launched; the "ProfilerStep#N" rows are the
    # steps' own GPU-side annotations, spanning them whole, and would count the step's time once more)
    device_us = sum(
        e.self_device_time_total
        for e in events
        if e.device_type == DeviceType.CUDA and not e.key.startswith("ProfilerStep")
    ) / steps
    lines = [f"profiled steps: {steps}; GPU busy (sum of self device time) per step: {device_us / 1e3:.1f} ms; "
             f"median wall time per step over the run: {1e3 * statistics.median(step_times):.1f} ms", ""]
    lines += _compute_stream_idle(prof, steps, path.with_name(path.name.replace(".profile.txt", ".timeline.json.gz")))
    lines.append(events.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60))
    lines.append(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    path.write_text("\n".join(lines))
    return path.name


def _compute_stream_idle(prof, steps: int, timeline: Path) -> list[str]:
    """Where the compute stream (the one with the most kernels) stood idle in the profiled steps, per step: while a
    host -> device copy ran on another stream (most likely waiting for it: a state offload's piece, a tied gradient's
    part), while only device -> host copies ran, or while no copy ran (waiting for the host to queue work). The
    device's spans (kernels, copies, the steps' annotations; microseconds from the first, with the time the host queued
    each) go to ``timeline``, gzipped JSON, for a look at when in the step each of these happens and whether the device
    waited for the host or for a copy."""
    import bisect
    import gzip
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        trace_path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(trace_path))
        trace = json.loads(trace_path.read_text())
    spans: dict = {}
    queued: dict = {}  # stream -> when the host queued each span (the runtime call of the same correlation id)
    calls = {e["args"]["correlation"]: e["ts"] for e in trace.get("traceEvents", [])
             if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            args = e.get("args", {})
            name = e.get("name", "") + (f" {args['bytes']}" if "bytes" in args else "")  # a copy: its bytes last
            spans.setdefault(args.get("stream"), []).append((e["ts"], e["ts"] + e["dur"], e["cat"], name))
            queued.setdefault(args.get("stream"), []).append(calls.get(args.get("correlation")))
    if not spans:
        return ["compute stream idle: no device events in the trace", ""]
    compute = max(spans, key=lambda k: sum(c == "kernel" for _, _, c, _ in spans[k]))
    t0 = min(a for v in spans.values() for a, _, _, _ in v)
    marks = [(e["ts"] - t0, e["ts"] + e["dur"] - t0, e.get("name", "")) for e in trace.get("traceEvents", [])
             if e.get("ph") == "X" and e.get("cat") == "gpu_user_annotation"]
    with gzip.open(timeline, "wt") as f:
        streams = {str(k): [(a - t0, b - t0, c, n if len(n) < 56 else n[:40] + n[-15:], q if q is None else q - t0)
                            for (a, b, c, n), q in zip(v, queued[k])] for k, v in spans.items()}
        json.dump({"compute_stream": compute, "annotations": marks, "streams": streams}, f)

    def union(intervals):
        out = []
        for a, b in sorted(intervals):
            if out and a <= out[-1][1]:
                out[-1][1] = max(out[-1][1], b)
            else:
                out.append([a, b])
        return out

    def covered(a, b, merged):  # time of [a, b] under the sorted, disjoint intervals ``merged``
        i = max(bisect.bisect_right(merged, [a]) - 1, 0)
        total = 0.0
        while i < len(merged) and merged[i][0] < b:
            total += max(0.0, min(b, merged[i][1]) - max(a, merged[i][0]))
            i += 1
        return total

    busy = union((a, b) for a, b, _, _ in spans[compute])
    others = [x for k, v in spans.items() if k != compute for x in v]
    h2d = union((a, b) for a, b, c, n in others if c == "gpu_memcpy" and "HtoD" in n)
    d2h = union((a, b) for a, b, c, n in others if c == "gpu_memcpy" and "DtoH" in n)
    copies = union(h2d + d2h)
    idle = link = out_only = 0.0
    for (_, a), (b, _) in zip(busy, busy[1:]):
        idle += b - a
        on_h2d = covered(a, b, h2d)
        link += on_h2d
        out_only += covered(a, b, copies) - on_h2d  # under device -> host copies and under no copy in
    per = 1e-3 / steps
    return [f"compute stream (stream {compute}) per step: busy {sum(b - a for a, b in busy) * per:.1f} ms, idle "
            f"{idle * per:.1f} ms: {link * per:.1f} ms while a host -> device copy ran, {out_only * per:.1f} ms while "
            f"only device -> host copies ran, {(idle - link - out_only) * per:.1f} ms with no copy running", ""]


def provenance() -> dict:
    import torch

    versions = {}
    for name in ("torch", "triton", "transformers", "accelerate", "bitsandbytes", "torchao", "liger_kernel"):
        try:
            versions[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - a missing baseline is recorded as such
            versions[name] = None
    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "versions": versions, "python": platform.python_version(),
        "commit": os.environ.get("APEXW_COMMIT") or _git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1b")
    ap.add_argument("--cells", default="", help="comma-separated <optimizer>[+liger]@<bf16|fp32>")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--out", default="runs/full_memory")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per run")
    ap.add_argument("--step-sync", choices=("stream", "device"), default="stream",
                    help="a step ends when the compute stream is done (stream) or every stream (device)")
    ap.add_argument("--profile", type=int, default=0,
                    help="profile this many steps after the warm-up (torch.profiler)")
    ap.add_argument("--time-calls", action="store_true",
                    help="host time per step of the optimizer's functions (TIMED_CALLS), in each run's JSON")
    ap.add_argument("--optim-args", default="", help="TrainingArguments(optim_args=...) of the ApexW cells")
    ap.add_argument("--tag", default="", help="a name for this variant, added to the output files' names")
    ap.add_argument("--snapshot", action="store_true",
                    help="record the allocator's history over the first step after the warm-up: <run>.peak.txt")
    ap.add_argument("--snapshot-from", choices=("step", "build"), default="step",
                    help="with --snapshot: start recording at that step (default) or once the model is built")
    ap.add_argument("--host-profile", action="store_true",
                    help="a cProfile of the release hooks (autograd's thread) after the warm-up: "
                    "<run>.host_profile.txt")
    ap.add_argument("--run", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.profile < 0:
        ap.error(f"--profile must be 0 (no profile) or a positive number of steps, got {args.profile}")
    if args.tag and not all(c.isalnum() or c in "-_." for c in args.tag):
        ap.error(f"--tag must be letters, digits, '-', '_' or '.', got {args.tag!r}")
    if args.step_sync == "device" and not args.tag:
        ap.error("--step-sync device changes what s/step measures: name the variant with --tag")
    if args.host_profile and (args.time_calls or not args.tag):
        ap.error("--host-profile slows the hooks it profiles: name the variant with --tag, without --time-calls")
    if args.optim_args and not args.tag:
        ap.error("--optim-args changes what a cell measures: name the variant with --tag")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.run:
        shape, cell = args.run.split(":", 1)
        row = {**run_one(cell, shape, args), **provenance()}
        (out / f"{run_name(shape, cell, args.tag)}.json").write_text(json.dumps(row, indent=1))
        return
    rows = []
    for shape in args.shapes.split(","):
        for cell in args.cells.split(","):
            cmd = [sys.executable, __file__, "--run", f"{shape}:{cell}", "--out", str(out), "--seq", str(args.seq),
                   "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--profile", str(args.profile), "--optim-args", args.optim_args, "--tag", args.tag,
                   "--step-sync", args.step_sync]
            cmd += ["--snapshot", "--snapshot-from", args.snapshot_from] if args.snapshot else []
            cmd += ["--time-calls"] if args.time_calls else []
            cmd += ["--host-profile"] if args.host_profile else []
            t0 = time.time()
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                err = proc.stderr[-3000:] if proc.returncode else ""
            except subprocess.TimeoutExpired:
                err = f"timeout after {args.timeout} s"
            path = out / f"{run_name(shape, cell, args.tag)}.json"
            if path.exists() and not err:
                row = json.loads(path.read_text())
            else:
                oom = "OutOfMemoryError" in err or "out of memory" in err
                row = {"shape": shape, "cell": cell, "error": "OOM" if oom else err.strip().splitlines()[-1:]}
                (out / f"{run_name(shape, cell, args.tag)}.err.txt").write_text(err)
            row["wall_s"] = round(time.time() - t0, 1)
            rows.append(row)
            rel = ""
            if "release_flushes_per_step" in row:
                rel = (f"  release: {row['release_flushes_per_step']:.1f} flushes, "
                       f"{row['release_host_ms_per_step']:.1f} host ms/step")
                if "tied_grad_parts_offloaded" in row:
                    rel += f", {row['tied_grad_parts_offloaded']} tied parts offloaded"
            for k, v in row.get("host_calls_per_step", {}).items():
                rel += f"\n      {k:40} {v['calls']:6.1f} calls {v['ms']:8.3f} ms/step"
            fit = fits(row["peak_reserved_gib"]) if "peak_reserved_gib" in row else "-"
            nan = float("nan")
            bad = "  NOT FINITE: the weights or the logged loss / grad_norm" if row.get("finite") is False else ""
            print(f"{shape:3} {cell:34} alloc {row.get('peak_allocated_gib', nan):7.2f} GiB  reserved "
                  f"{row.get('peak_reserved_gib', nan):7.2f}  s/step {row.get('s_per_step') or nan:.3f}"
                  f" (drained {row.get('s_per_step_drained') or nan:.3f})"
                  f"  grads@step {row.get('grads_alive_before_step')}  fits {fit}{rel}  {row.get('error', '')}"
                  f"{bad}",
                  flush=True)
    keys = ["shape", "cell", "tag", "optim_args", "params", "peak_allocated_gib", "peak_reserved_gib", "s_per_step",
            "s_per_step_drained", "step_sync", "optimizer_state_mib", "gradient_release", "grads_alive_before_step",
            "logged_grad_norm", "gpu", "commit", "date", "error"]
    with open(out / "results.csv", "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        if f.tell() == 0:
            w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
