"""How skewed real blocks of ``v`` are: the distribution of (block max / element) of ``v`` in a fine-tune's state.

Trains a recipe config (default ``offline_full``: the CPU full fine-tune of the small random-weight Llama on the
shipped instruction set) with ``torch.optim.AdamW`` in fp32, whose ``exp_avg_sq`` is exact, and at the chosen steps
cuts every parameter's ``v`` into blocks along the flattened tensor as the 8-bit (256) and 4-bit (128) formats do;
for every element with ``v > 0`` it takes ``log2(block max / v)``. The table gives, per step and block size, the
share of elements past 2**k below their block's maximum and the quantiles of that skew; all-zero ``v`` (untouched
embedding rows) are counted apart.

    python scripts/block_skew.py [--config offline_full] [--steps 10,50,125,250] [--lr 3e-3] [--out FILE.md]
        [--set section.key=value ...]
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from apexw_hf.provenance import describe_source  # noqa: E402

THRESHOLDS = (4, 8, 12, 14, 16, 18, 20, 24)  # log2 of the skew: 14 and 18 are the 4-bit and 8-bit code floors
QUANTILES = (0.5, 0.9, 0.99, 0.999)
BLOCKS = (256, 128)


def skew_log2(v: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    """``log2(block max / v)`` of every element with ``v > 0`` (blocks along the flattened tensor, the last one
    short), and the number of elements with ``v == 0``."""
    flat = v.detach().reshape(-1).double()
    pad = (-flat.numel()) % block
    b = torch.cat([flat, flat.new_zeros(pad)]).view(-1, block)
    amax = b.amax(dim=1, keepdim=True).expand_as(b).reshape(-1)[: flat.numel()]
    pos = flat > 0
    return torch.log2(amax[pos] / flat[pos]), int((~pos).sum())


def summarize(vs: list[torch.Tensor], block: int) -> dict:
    parts, zeros = zip(*(skew_log2(v, block) for v in vs))
    s = torch.cat(parts)
    n = s.numel() + sum(zeros)
    return {
        "elements": n,
        "zero": sum(zeros) / n,
        "past": {k: (s > k).double().sum().item() / n for k in THRESHOLDS},
        "quantiles": {q: torch.quantile(s[torch.randperm(s.numel())[: 1 << 24]], q).item() for q in QUANTILES},
    }


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="offline_full")
    ap.add_argument("--steps", default="10,50,125,250", help="comma-separated optimizer steps to look at")
    ap.add_argument("--lr", type=float, default=3e-3, help="learning rate (offline_full's best for torch AdamW)")
    ap.add_argument("--set", action="append", default=[], help="config override section.key=value")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    steps = sorted({int(x) for x in args.steps.split(",")})
    if steps[0] < 1:
        raise ValueError(f"--steps {args.steps}: steps count from 1")

    from transformers import Trainer, TrainerCallback

    from apexw_hf.recipe.config import load_config
    from apexw_hf.recipe.data import PadCollator, load_chat_data, tokenize_chat
    from apexw_hf.recipe.finetune import build_training_arguments
    from apexw_hf.recipe.model import load_model_and_tokenizer, prepare_base, resolve_precision

    overrides = [
        "train.optim=adamw_torch",
        f"train.learning_rate={args.lr}",
        f"train.max_steps={steps[-1]}",
        *args.set,
    ]
    cfg = load_config(args.config, overrides)
    if cfg.train.torch_threads > 0:
        torch.set_num_threads(cfg.train.torch_threads)
    rows: list[dict] = []

    class Snapshot(TrainerCallback):
        def on_step_end(self, targs, state, control, optimizer=None, **kw):
            if state.global_step in steps:
                opt = getattr(optimizer, "optimizer", optimizer)
                vs = [s["exp_avg_sq"] for s in opt.state.values() if "exp_avg_sq" in s]
                for block in BLOCKS:
                    rows.append({"step": state.global_step, "block": block, **summarize(vs, block)})

    commit = describe_source()  # before the run: the tree it ran
    t0 = time.time()
    with tempfile.TemporaryDirectory() as out:
        prepared = prepare_base(cfg, out, verbose=False)
        precision = resolve_precision(cfg)
        model, tok = load_model_and_tokenizer(cfg, prepared, "transformers", precision, cfg.train.seed)
        model = model.float()
        data = load_chat_data(cfg.data, verbose=False)
        train_ds = tokenize_chat(data.train, tok, cfg.model.max_seq_length, cfg.data.train_on_responses_only)
        targs = build_training_arguments(cfg, out, precision)
        targs.eval_strategy = "no"
        trainer = Trainer(
            model=model,
            args=targs,
            train_dataset=train_ds,
            data_collator=PadCollator(tok.pad_token_id, cfg.data.pad_to_multiple_of),
            callbacks=[Snapshot()],
        )
        trainer.train()
    n_params = sum(p.numel() for p in model.parameters())
    cmd = "python scripts/block_skew.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        f"commit {commit}, torch {torch.__version__}, {datetime.date.today().isoformat()}, {time.time() - t0:.0f} s; "
        f"config {cfg.name}, torch AdamW fp32, lr {args.lr}, {n_params:,} parameters; command: `{cmd.strip()}`",
        "",
        "Share of all elements whose `v` is more than 2^k below their block's maximum (`zero`: `v == 0`), and "
        "quantiles of log2(block max / v) over the elements with `v > 0`.",
        "",
        "| step | block | zero | "
        + " | ".join(f"> 2^{k}" for k in THRESHOLDS)
        + " | "
        + " | ".join(f"q{q}" for q in QUANTILES)
        + " |",
        "|---:|---:|---:|" + "---:|" * (len(THRESHOLDS) + len(QUANTILES)),
    ]
    for r in rows:
        lines.append(
            f"| {r['step']} | {r['block']} | {r['zero']:.2e} | "
            + " | ".join(f"{r['past'][k]:.2e}" for k in THRESHOLDS)
            + " | "
            + " | ".join(f"{r['quantiles'][q]:.1f}" for q in QUANTILES)
            + " |"
        )
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return rows


if __name__ == "__main__":
    main()
