"""Two-GPU FSDP2 fine-tune of the recipe model (Llama-3.2-3B shapes, LoRA r=16 on all 7 projections): apexw_8bit
against torch AdamW, each launched through the Trainer with configs/accelerate_fsdp2.yaml.

    python benchmarks/fsdp2_compare.py --out results_dir [--steps 30] [--optims adamw_torch apexw_8bit]

Needs 2 CUDA GPUs; no downloads: the model is built from Llama-3.2-3B's config with random weights (bf16 base,
fp32 LoRA adapters, as PEFT makes them), and the data are synthetic token sequences with a learnable rule (each
token is the previous one plus a per-sequence stride, modulo the vocabulary), so the loss falls from ln(128256).
Writes one JSON per optimizer and fsdp2_compare.md, and prints the table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def worker(args) -> None:
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    import apexw_hf  # noqa: F401  (registers optim="apexw_8bit")
    from apexw_hf import optimizer_state_bytes
    from apexw_hf.provenance import source_commit

    cfg = transformers.LlamaConfig(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
        head_dim=128, vocab_size=128256, tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=2048,
    )  # fmt: skip
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.manual_seed(0)
    with torch.device(f"cuda:{local_rank}"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora = LoraConfig(
        r=16, lora_alpha=16, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", target_modules=projections
    )
    model = get_peft_model(model, lora)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)

    gen = torch.Generator().manual_seed(1)
    n, length = 4000, args.seq_len
    start = torch.randint(0, cfg.vocab_size, (n, 1), generator=gen)
    stride = torch.randint(1, 8, (n, 1), generator=gen)
    rows = (start + stride * torch.arange(length)) % cfg.vocab_size
    dataset = [{"input_ids": r, "labels": r} for r in rows]

    targs = transformers.TrainingArguments(
        output_dir=args.out / f"run_{args.optim}", optim=args.optim, learning_rate=2e-4, weight_decay=0.001,
        per_device_train_batch_size=2, gradient_accumulation_steps=4, max_steps=args.steps, warmup_steps=5,
        lr_scheduler_type="linear", bf16=True, logging_steps=1, report_to=[], save_strategy="no", seed=3407,
        gradient_checkpointing=True, ddp_find_unused_parameters=False,
    )  # fmt: skip
    trainer = transformers.Trainer(model=model, args=targs, train_dataset=dataset)
    torch.cuda.reset_peak_memory_stats()
    out = trainer.train()
    opt = trainer.optimizer
    local = optimizer_state_bytes(opt)
    p0 = next(p for p in trainer.model.parameters() if p.requires_grad)
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, {"state_bytes": local, "peak": torch.cuda.max_memory_allocated()})
    if trainer.accelerator.is_main_process:
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        result = {
            "optim": args.optim,
            "world_size": torch.distributed.get_world_size(),
            "param_type": type(p0).__name__,
            "optimizer_class": type(getattr(opt, "optimizer", opt)).__name__,
            "trainable_params": trainable,
            "state_bytes_per_gpu": [g["state_bytes"] for g in gathered],
            "peak_allocated_per_gpu": [g["peak"] for g in gathered],
            "steps_per_s": out.metrics["train_steps_per_second"],
            "losses": losses,
            "gpu": torch.cuda.get_device_name(0),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
            "commit": source_commit()[0] or "unknown",
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        (args.out / f"fsdp2_{args.optim}.json").write_text(json.dumps(result, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--optims", nargs="+", default=["adamw_torch", "apexw_8bit"])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--optim", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.worker:
        worker(args)
        return
    for optim in args.optims:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "configs" / "accelerate_fsdp2.yaml"), __file__, "--worker", "--optim", optim,
               "--out", str(args.out), "--steps", str(args.steps), "--seq-len", str(args.seq_len)]  # fmt: skip
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    rows = ["| optimizer | params | optimizer state per GPU (MiB) | peak allocated per GPU (GiB) | steps/s | "
            "first loss | last loss |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for optim in args.optims:
        r = json.loads((args.out / f"fsdp2_{optim}.json").read_text())
        state = " / ".join(f"{b / 2**20:.2f}" for b in r["state_bytes_per_gpu"])
        peak = " / ".join(f"{b / 2**30:.2f}" for b in r["peak_allocated_per_gpu"])
        rows.append(f"| {optim} ({r['optimizer_class']}) | {r['param_type']} | {state} | {peak} | "
                    f"{r['steps_per_s']:.3f} | {r['losses'][0]:.4f} | {r['losses'][-1]:.4f} |")  # fmt: skip
    table = "\n".join(rows)
    (args.out / "fsdp2_compare.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
