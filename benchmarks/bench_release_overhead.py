"""What gradient release costs per step, measured in one process: blocks without and with release alternate.

The 1B release target (s/step with release <= 1.05x the same optimizer without it) is a few percent on steps where
the GPU waits for the host, and the Trainer runs of ``bench_full_finetune_memory.py`` (one process per cell) move by
up to 30% between processes of one device call. Here one process builds the model once and runs ``--rounds`` rounds
of two blocks of ``--steps`` steps, without and with release, in the order A B, B A, A B, ... (a drift within the
process falls on both arms), each block with a fresh optimizer of the same format. The step is the Trainer's: bf16
autocast, gradient checkpointing, Liger's kernels (``--liger``), ``max_grad_norm`` 1.0 (``clip_grad_norm_`` before
an ordinary step; the optimizer's own clipping with release), a linear lr schedule, weight decay on the matrices
(the Trainer's two param groups), random tokens of ``--seq`` x ``--batch``. It leaves out the Trainer's own per-step
Python, the same in both arms, so the ratio here is a little larger than through the Trainer. ``--offload``: the
release arm also keeps its state in host memory (``state_offload=True``), against the same plain arm.

Printed and written to ``--out`` (JSON, with GPU, versions, commit and date): each round's median step time per
arm and their ratio, the median of the rounds' ratios, each arm's median and fastest step over all rounds, and the
release arm's flushes and host milliseconds per step.

    python3 benchmarks/bench_release_overhead.py --shape 1b --format 4bit --liger --rounds 6 --steps 25 \
        --out runs/release_overhead/1b_4bit.json
    python3 benchmarks/bench_release_overhead.py --shape 1b --format 4bit --liger --offload --out runs/ro/off.json
    python3 benchmarks/bench_release_overhead.py --shape tiny --device cpu --rounds 2 --steps 3 --warmup 1  # smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_full_finetune_memory import SHAPES, provenance  # noqa: E402

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    tie_word_embeddings=True,
)


def build(args):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = TINY if args.shape == "tiny" else SHAPES[args.shape]
    vocab = 512 if args.shape == "tiny" else 128256
    cfg = LlamaConfig(
        vocab_size=vocab, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=args.seq, **shape
    )
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(args.device):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    if args.liger:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
    # as the Trainer's gradient_checkpointing=True (renamed activation checkpointing in later transformers)
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    model.train()
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(args.device) for _ in range(8)]
    return model, batches


def run_block(model, batches, release: bool, args, step0: int) -> dict:
    """``--steps`` steps with a fresh optimizer: per-step seconds, and the release arm's flushes and host time."""
    import torch

    from apexw_hf import ApexW

    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    kw = dict(lr=1e-5, state_format=args.format, gradient_release=release)
    if release:
        kw.update(max_grad_norm=1.0, **({"release_bucket_size": args.bucket} if args.bucket else {}))
        if args.offload:
            kw.update(state_offload=True)
    opt = ApexW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}], **kw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / (2 * args.steps))
    params = decay + rest
    cuda = args.device == "cuda"
    times, losses, marks = [], [], []
    t_prev = time.perf_counter()
    for i in range(args.steps):
        ids = batches[(step0 + i) % len(batches)]
        with torch.autocast(args.device, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if not release:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        times.append(now - t_prev)
        t_prev = now
        losses.append(loss.item())
        if release:
            marks.append((opt._release.flushes, opt._release.host_seconds))
    out = {"step_s": times, "timed": times[args.warmup :], "loss_last": losses[-1]}
    if release:
        (f0, h0), (f1, h1) = marks[args.warmup - 1] if args.warmup else (0, 0.0), marks[-1]
        n = args.steps - args.warmup
        out.update(flushes_per_step=(f1 - f0) / n, host_ms_per_step=1e3 * (h1 - h0) / n)
        opt.remove_release_hooks()
    del opt, sched
    gc.collect()
    return out


def summarize(rounds: list[dict]) -> dict:
    plain = [t for r in rounds for t in r["plain"]["timed"]]
    rel = [t for r in rounds for t in r["release"]["timed"]]
    ratios = [statistics.median(r["release"]["timed"]) / statistics.median(r["plain"]["timed"]) for r in rounds]
    return {
        "median_s": {"plain": statistics.median(plain), "release": statistics.median(rel)},
        "fastest_s": {"plain": min(plain), "release": min(rel)},
        "round_ratios": ratios,
        "median_ratio": statistics.median(ratios),
        "ratio_of_medians": statistics.median(rel) / statistics.median(plain),
        "flushes_per_step": statistics.mean(r["release"]["flushes_per_step"] for r in rounds),
        "release_host_ms_per_step": statistics.mean(r["release"]["host_ms_per_step"] for r in rounds),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1b", choices=[*SHAPES, "tiny"])
    ap.add_argument("--format", default="4bit", help="ApexW state_format (4bit, 8bit, compact, fp32)")
    ap.add_argument("--liger", action="store_true", help="Liger-Kernel's kernels, as use_liger_kernel=True")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=25, help="steps per block")
    ap.add_argument("--warmup", type=int, default=5, help="steps of each block left out of its times")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--bucket", type=int, default=0, help="release_bucket_size (elements); 0: the default")
    ap.add_argument(
        "--offload", action="store_true", help="the release arm keeps its state in host memory (state_offload=True)"
    )
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if not 0 <= args.warmup < args.steps:
        ap.error(f"--warmup must be at least 0 and below --steps ({args.steps}), got {args.warmup}")
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    model, batches = build(args)
    rounds = []
    for r in range(args.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        blocks = {"first": "release" if order[0] else "plain"}
        for release in order:
            blocks["release" if release else "plain"] = run_block(model, batches, release, args, r * args.steps)
        rounds.append(blocks)
        ratio = statistics.median(blocks["release"]["timed"]) / statistics.median(blocks["plain"]["timed"])
        print(
            f"round {r}: plain {statistics.median(blocks['plain']['timed']):.4f} s  release "
            f"{statistics.median(blocks['release']['timed']):.4f} s  ratio {ratio:.3f}  "
            f"({blocks['release']['flushes_per_step']:.1f} flushes, "
            f"{blocks['release']['host_ms_per_step']:.1f} host ms/step)",
            flush=True,
        )
    summary = summarize(rounds)
    row = {
        "shape": args.shape,
        "format": args.format,
        "liger": args.liger,
        "seq": args.seq,
        "batch": args.batch,
        "bucket": args.bucket or None,
        "offload": args.offload,
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup": args.warmup,
        "device": args.device,
        **summary,
        "blocks": rounds,
        **provenance(),
    }
    print(
        f"{args.shape} {args.format}{' + liger' if args.liger else ''}: median s/step plain "
        f"{summary['median_s']['plain']:.4f}, release{' + offload' if args.offload else ''} "
        f"{summary['median_s']['release']:.4f}; ratio: median of "
        f"rounds {summary['median_ratio']:.3f} (min {min(summary['round_ratios']):.3f}, max "
        f"{max(summary['round_ratios']):.3f}), of medians {summary['ratio_of_medians']:.3f}; fastest "
        f"{summary['fastest_s']['plain']:.4f} / {summary['fastest_s']['release']:.4f}"
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(row, indent=1))
    return row


if __name__ == "__main__":
    main()
