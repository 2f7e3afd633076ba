"""What fits where: peak GPU memory and seconds per step of a full fine-tune through the Hugging Face Trainer.

One process per run (``--run``); the driver (default) runs every requested cell in its own subprocess, one at a
time, and writes one JSON per run plus ``results.csv`` under ``--out``. Llama shapes with random weights (no model
hub), bf16 model (``@fp32``: fp32 master weights under bf16 autocast), random tokens of ``--seq`` x ``--batch``,
gradient checkpointing, ``max_grad_norm`` 1.0 (the Trainer's default), ``--steps`` optimizer steps; s/step is the
median over the steps after ``--warmup``.

Cells are ``<optimizer>[+liger]@<dtype>``, the optimizer one of: ``torch_fused`` (torch.optim.AdamW(fused=True)),
``bnb_8bit`` (bitsandbytes AdamW8bit), ``torchao_8bit`` / ``torchao_4bit`` (torchao AdamW8bit/AdamW4bit with
``bf16_stochastic_round`` on a bf16 model), or any ApexW optim name (``apexw_8bit``, ``apexw_4bit_release``, ...),
which goes through ``TrainingArguments(optim=...)`` as a user would write it. ``+liger`` sets
``use_liger_kernel=True`` (Liger-Kernel's fused linear cross-entropy: the logits are never materialized).

    python3 scripts/bench_full_finetune_memory.py --shapes 1b --cells apexw_8bit@bf16,apexw_8bit_release+liger@bf16
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
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


def fits(reserved_gib: float) -> str:
    """The GPU sizes (GB, 10**9 bytes) whose memory holds the peak reserved bytes plus the context allowance."""
    ok = [s for s in GPU_SIZES_GB if reserved_gib + CONTEXT_GIB <= s * 1e9 / GIB]
    return ",".join(map(str, ok)) if ok else "-"


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
    if optim in APEXW_OPTIMIZERS:
        training["optim"] = optim
    elif optim == "torch_fused":
        kw["optimizer_cls_and_kwargs"] = (torch.optim.AdamW, {"lr": 1e-5, "fused": True})
    elif optim == "bnb_8bit":
        import bitsandbytes as bnb

        kw["optimizer_cls_and_kwargs"] = (bnb.optim.AdamW8bit, {"lr": 1e-5})
    elif optim in ("torchao_8bit", "torchao_4bit"):
        from torchao.optim import AdamW4bit, AdamW8bit

        cls = AdamW8bit if optim == "torchao_8bit" else AdamW4bit
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

    class Probe(TrainerCallback):
        def on_pre_optimizer_step(self, a, state, control, model=None, **k):
            grads_alive.append(sum(p.grad is not None for p in model.parameters()))

        def on_step_end(self, a, state, control, **k):
            torch.cuda.synchronize()
            times.append(time.perf_counter())
            inner_opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
            release = getattr(inner_opt, "_release", None)
            if release is not None:
                # grad_moves: bucket launches whose gradients were at new addresses (checked and copied to the GPU)
                moves = getattr(getattr(inner_opt, "_engine", None), "grad_moves", 0)
                release_marks.append((release.flushes, release.host_seconds, moves))
            if prof is not None:
                prof.step()

    torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(model=model, args=TrainingArguments(**training), train_dataset=Tokens(), callbacks=[Probe()], **kw)
    if prof is not None:
        prof.start()
    trainer.train()
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
    profile_file = None
    if prof is not None:
        prof.stop()
        name = f"{shape}_{cell.replace('@', '_at_').replace('+', '_')}.profile.txt"
        profile_file = _write_profile(prof, Path(args.out) / name, args.profile, all_steps)
    logs = [h for h in trainer.state.log_history if "grad_norm" in h]
    return {
        "shape": shape, "cell": cell, "optimizer": optim, "liger": liger, "model_dtype": dtype_name,
        "params": nparams, "seq": args.seq, "batch": args.batch, "steps": args.steps,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB,
        "s_per_step": statistics.median(steps) if steps else None,
        "step_s": [round(t, 5) for t in all_steps],
        **release,
        "profile": profile_file,
        "optimizer_state_mib": apexw_hf.optimizer_state_bytes(inner) / 2**20,
        "gradient_release": bool(getattr(inner, "gradient_release", False)),
        "grads_alive_before_step": grads_alive[-1] if grads_alive else None,
        "logged_grad_norm": logs[-1]["grad_norm"] if logs else None,
        "loss": [h["loss"] for h in trainer.state.log_history if "loss" in h],
    }


def _write_profile(prof, path: Path, steps: int, step_times: list[float]) -> str:
    """The profiled steps' operators by self CUDA and self CPU time, and the GPU's busy time per step."""
    events = prof.key_averages()
    from torch.autograd import DeviceType

    # kernels only (an operator's row repeats the time of the kernels it launched)
    device_us = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / steps
    lines = [f"profiled steps: {steps}; GPU busy (sum of self device time) per step: {device_us / 1e3:.1f} ms; "
             f"median wall time per step over the run: {1e3 * statistics.median(step_times):.1f} ms", ""]
    lines.append(events.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60))
    lines.append(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    path.write_text("\n".join(lines))
    return path.name


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
    ap.add_argument("--profile", type=int, default=0,
                    help="profile this many steps after the warm-up (torch.profiler)")
    ap.add_argument("--run", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.profile < 0:
        ap.error(f"--profile must be 0 (no profile) or a positive number of steps, got {args.profile}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.run:
        shape, cell = args.run.split(":", 1)
        row = {**run_one(cell, shape, args), **provenance()}
        (out / f"{shape}_{cell.replace('@', '_at_').replace('+', '_')}.json").write_text(json.dumps(row, indent=1))
        return
    rows = []
    for shape in args.shapes.split(","):
        for cell in args.cells.split(","):
            cmd = [sys.executable, __file__, "--run", f"{shape}:{cell}", "--out", str(out), "--seq", str(args.seq),
                   "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--profile", str(args.profile)]
            t0 = time.time()
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                err = proc.stderr[-3000:] if proc.returncode else ""
            except subprocess.TimeoutExpired:
                err = f"timeout after {args.timeout} s"
            path = out / f"{shape}_{cell.replace('@', '_at_').replace('+', '_')}.json"
            if path.exists() and not err:
                row = json.loads(path.read_text())
            else:
                oom = "OutOfMemoryError" in err or "out of memory" in err
                row = {"shape": shape, "cell": cell, "error": "OOM" if oom else err.strip().splitlines()[-1:]}
                (out / f"{shape}_{cell}.err.txt").write_text(err)
            row["wall_s"] = round(time.time() - t0, 1)
            rows.append(row)
            rel = ""
            if "release_flushes_per_step" in row:
                rel = (f"  release: {row['release_flushes_per_step']:.1f} flushes, "
                       f"{row['release_host_ms_per_step']:.1f} host ms/step")
            fit = fits(row["peak_reserved_gib"]) if "peak_reserved_gib" in row else "-"
            nan = float("nan")
            print(f"{shape:3} {cell:34} alloc {row.get('peak_allocated_gib', nan):7.2f} GiB  reserved "
                  f"{row.get('peak_reserved_gib', nan):7.2f}  s/step {row.get('s_per_step') or nan:.3f}"
                  f"  grads@step {row.get('grads_alive_before_step')}  fits {fit}{rel}  {row.get('error', '')}",
                  flush=True)
    keys = ["shape", "cell", "params", "peak_allocated_gib", "peak_reserved_gib", "s_per_step", "optimizer_state_mib",
            "gradient_release", "grads_alive_before_step", "logged_grad_norm", "gpu", "commit", "date", "error"]
    with open(out / "results.csv", "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        if f.tell() == 0:
            w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
