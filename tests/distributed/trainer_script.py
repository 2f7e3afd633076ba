"""A tiny Llama trained by the Trainer under `accelerate launch` (tests/distributed/test_trainer_launch.py)."""

import json
import sys

import torch
import transformers

from apexw_hf import ApexW
from tests.distributed import workers  # the test puts the repository root on PYTHONPATH


def main(out_dir, fmt, resume):
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    gen = torch.Generator().manual_seed(0)
    data = (torch.randint(0, 64, (64, 1), generator=gen) + torch.arange(16)) % 64
    dataset = [{"input_ids": row, "labels": row} for row in data]
    args = transformers.TrainingArguments(
        output_dir=out_dir, per_device_train_batch_size=4, max_steps=6, logging_steps=1, save_steps=3,
        report_to=[], learning_rate=3e-3, seed=0, data_seed=0, use_cpu=not torch.cuda.is_available(),
    )  # fmt: skip
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=dataset,
        optimizer_cls_and_kwargs=(ApexW, {"lr": 3e-3, "state_format": fmt}),
    )  # fmt: skip
    trainer.train(resume_from_checkpoint=resume or None)
    if trainer.accelerator.is_main_process:
        opt = trainer.optimizer.optimizer
        losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
        report = {
            "losses": losses,
            "world": trainer.accelerator.num_processes,
            "state_dtypes": {k: str(v.dtype) for k, v in next(iter(opt.state.values())).items()},
        }
        with open(f"{out_dir}/report{'_resumed' if resume else ''}.json", "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "")
    # Leave like the spawned ranks do: a rank aborting in the interpreter's teardown would fail the launch.
    workers.finish()
