"""Run by test_unsloth.py in a fresh interpreter (Unsloth patches transformers and TRL globally when imported).

Usage: python unsloth_cpu_check.py OUT_DIR {apexw_first|unsloth_first} [full_bf16] [release] [optim=NAME]. Prints one
JSON line starting with RESULT. ``full_bf16``: instead of the LoRA run, a full fine-tune of the model kept in bf16
through UnslothTrainer. ``release`` (with ``full_bf16``): three more full fine-tunes in the same interpreter, with
``optim + "_release"`` (gradient release) at max_grad_norm=1.0, and without clipping both with and without release.
``optim``: the ApexW name the run trains with (default ``apexw_8bit``).
"""

from __future__ import annotations

import importlib
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

out_dir, order = sys.argv[1], sys.argv[2]
full_bf16 = "full_bf16" in sys.argv[3:]
release = "release" in sys.argv[3:]
optim = next((a.split("=", 1)[1] for a in sys.argv[3:] if a.startswith("optim=")), "apexw_8bit")
# The import order is what is tested, so it is spelled out with importlib (an import sorter cannot reorder it).
for module in ("apexw_hf", "unsloth") if order == "apexw_first" else ("unsloth", "apexw_hf"):
    importlib.import_module(module)

from transformers import TrainingArguments  # noqa: E402
from trl import SFTConfig  # noqa: E402
from unsloth import UnslothTrainer, UnslothTrainingArguments  # noqa: E402

from apexw_hf.accounting import unwrap_optimizer  # noqa: E402
from tests.integrations.tiny import make_model, make_tokenizer, text_dataset  # noqa: E402

result: dict = {"cuda": __import__("torch").cuda.is_available()}
common = {"output_dir": out_dir, "report_to": [], "use_cpu": True}
# Control: Unsloth's CPU mode is active iff it rewrites bitsandbytes' adamw_8bit.
result["control"] = str(SFTConfig(**common, optim="adamw_8bit").optim.value)
result["names"] = {}
for name in ("apexw_8bit", "apexw_compact", "apexw_4bit"):
    for cls in (TrainingArguments, SFTConfig, UnslothTrainingArguments):
        result["names"][f"{cls.__name__}:{name}"] = str(cls(**common, optim=name).optim.value)


def train(model, name=optim, optim_args="engine=torch", **extra):
    """A 3-step run of ``model`` through Unsloth's trainer with ``name``; returns (trainer, the real optimizer)."""
    config = UnslothTrainingArguments(
        **common,
        optim=name,
        optim_args=optim_args,
        max_steps=3,
        per_device_train_batch_size=4,
        logging_steps=1,
        learning_rate=1e-2,
        max_length=32,
        dataset_text_field="text",
        disable_tqdm=True,
        **extra,
    )
    trainer = UnslothTrainer(model=model, args=config, train_dataset=text_dataset(), processing_class=make_tokenizer())
    trainer.train()
    return trainer, unwrap_optimizer(trainer.optimizer)


if full_bf16:
    import torch

    trainer, opt = train(make_model(lora=False).to(torch.bfloat16), bf16=True)
    result["optimizer"] = type(opt).__name__
    result["param_dtypes"] = sorted({str(p.dtype) for p in trainer.model.parameters()})
    result["param_rounding"] = sorted({g["param_rounding"] for g in opt.param_groups})
    result["state_bytes_per_param"] = opt.state_bytes() / sum(p.numel() for p in trainer.model.parameters())
    result["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if release:
        trainer, opt = train(make_model(lora=False).to(torch.bfloat16), name=optim + "_release", bf16=True)
        result["release"] = {
            "optimizer": type(opt).__name__,
            "gradient_release": opt.gradient_release,
            "max_grad_norm": opt._release.max_grad_norm,
            "param_dtypes": sorted({str(p.dtype) for p in trainer.model.parameters()}),
            "grads_freed": all(p.grad is None for p in trainer.model.parameters()),
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "grad_norms": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h],
        }
        # without clipping, release and ordinary steps give the same bits (the same seed and data)
        runs = [
            train(make_model(lora=False).to(torch.bfloat16), name=n, bf16=True, max_grad_norm=0)[0]
            for n in (optim, optim + "_release")
        ]
        params = [list(t.model.parameters()) for t in runs]
        result["release"]["bit_identical"] = all(torch.equal(a, b) for a, b in zip(*params))
        result["release"]["trained"] = all(
            not torch.equal(a, b) for a, b in zip(params[1], make_model(lora=False).to(torch.bfloat16).parameters())
        )
        # tied_grad_offload through Unsloth's trainer (its backward goes through Accelerate's, which hands the loss
        # and the model to the optimizer); on the CPU a copy stands in for the pinned host buffer
        from apexw_hf.optim import tied_offload

        tied_offload._offloadable = lambda t: t.is_contiguous()
        trainer, opt = train(
            make_model(lora=False).to(torch.bfloat16),
            name=optim + "_release",
            bf16=True,
            max_grad_norm=0,
            optim_args="engine=torch,tied_grad_offload=true",
        )
        result["release"]["offloaded"] = opt._release.offload.offloaded
        result["release"]["offload_bit_identical"] = all(
            torch.equal(a, b) for a, b in zip(params[0], trainer.model.parameters())
        )
    print("RESULT " + json.dumps(result))
    sys.exit(0)

# A short run through Unsloth's trainer, with embedding_learning_rate so UnslothTrainer builds its own param groups
# (a trained copy of the embeddings gets the embedding learning rate).
trainer, opt = train(
    make_model(modules_to_save=["embed_tokens"]),
    embedding_learning_rate=1e-3,
    lr_scheduler_type="constant",
    weight_decay=0.01,
)
result["optimizer"] = type(opt).__name__
result["groups"] = sorted((g["lr"], g["weight_decay"], len(g["params"])) for g in opt.param_groups)
result["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
result["state_dtypes"] = sorted({str(v.dtype) for s in opt.state.values() for v in s.values()})
result["state_keys"] = sorted({k for s in opt.state.values() for k in s})
result["state_bytes"] = opt.state_bytes()
result["trained_sizes"] = sorted(p.numel() for p in opt.state)
print("RESULT " + json.dumps(result))
