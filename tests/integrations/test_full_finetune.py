"""Full fine-tuning of a model kept in bf16 through transformers' Trainer and TRL's SFTTrainer, on the CPU.

What a user of ``optim="apexw_8bit"`` / ``"apexw_4bit"`` / ``"apexw_compact"`` with ``bf16=True`` relies on: the
parameters stay bf16 (no stack upcasts them), the optimizer keeps no fp32 copy of them, updates smaller than half a
bf16 step still move the weights (stochastic rounding), and an fp16 model with ``fp16=True`` is refused with a message
saying what to do.
"""

from __future__ import annotations

import math

import pytest
import torch

from apexw_hf import ApexW4bit, ApexW8bit, ApexWCompact
from apexw_hf.accounting import optimizer_state_bytes, unwrap_optimizer

from .tiny import NAMES, make_model, make_trainer, text_dataset, train_kwargs

EXPECTED = {
    "apexw_8bit": (ApexW8bit, "8bit"),
    "apexw_compact": (ApexWCompact, "compact"),
    "apexw_4bit": (ApexW4bit, "4bit"),
}


def _full_model(dtype=torch.bfloat16):
    return make_model(lora=False).to(dtype)


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _check_no_master_copy(opt, model, fmt):
    params = [p for p in model.parameters() if p.requires_grad]
    sizes = {p.numel() for p in params}
    for st in opt.state.values():
        for key, v in st.items():
            if torch.is_tensor(v) and v.numel() > 1:
                # the moments and scales of the format only: an fp32 tensor of a parameter's size would be a copy
                assert not (v.dtype == torch.float32 and v.numel() in sizes), (key, v.dtype, v.shape)
    n = sum(p.numel() for p in params)
    n_blocks = sum(math.ceil(p.numel() / 256) for p in params)
    n_blocks4 = sum(math.ceil(p.numel() / 128) for p in params)
    per_tensor = 4  # the fp32 step counter
    expected = {
        "compact": 4 * n + per_tensor * len(params),
        # uint8 m + uint8 v; per block a bf16 m scale and an fp32 v scale (format version 3)
        "8bit": 2 * n + (2 + 4) * n_blocks + per_tensor * len(params),
        # one byte for m and v; per 128 elements an fp32 m scale and an fp32 v scale (format version 3)
        "4bit": n + (4 + 4) * n_blocks4 + per_tensor * len(params),
    }[fmt]
    assert opt.state_bytes() == expected


@pytest.mark.parametrize("name", NAMES)
def test_trainer_bf16_model_stays_bf16(tmp_path, name):
    model = _full_model()
    before = _snapshot(model)
    trainer = make_trainer(tmp_path, model=model, optim=name, bf16=True, max_steps=4, learning_rate=3e-3)
    trainer.train()
    cls, fmt = EXPECTED[name]
    opt = unwrap_optimizer(trainer.optimizer)
    assert type(opt) is cls and all(g["param_rounding"] == "stochastic" for g in opt.param_groups)
    after = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert set(after) == set(before) and all(p.dtype == torch.bfloat16 for p in after.values())
    assert all(not torch.equal(before[n], after[n].detach()) for n in after if "norm" not in n)
    _check_no_master_copy(opt, trainer.model, fmt)
    assert optimizer_state_bytes(trainer.optimizer) == opt.state_bytes()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 4 and all(map(math.isfinite, losses))


def _steps_with_tiny_lr(tmp_path, optim, lr, steps=3):
    """Train a bf16 model with an lr far below half a bf16 step of its weights; return (changed, counted): among the
    weights with ``|w| >= 2**-7`` (whose half bf16 step is at least 2**-15 ~ 3e-5), how many moved."""
    model = _full_model()
    before = _snapshot(model)
    trainer = make_trainer(
        tmp_path / optim,
        model=model,
        optim=optim,
        bf16=True,
        max_steps=steps,
        learning_rate=lr,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        optim_args="engine=torch" if optim.startswith("apexw") else None,
    )
    trainer.train()
    after = {n: p.detach() for n, p in trainer.model.named_parameters() if p.requires_grad}
    big = {n: before[n].abs() >= 2**-7 for n in after}
    changed = sum(int((before[n] != after[n])[big[n]].sum()) for n in after)
    return changed, sum(int(b.sum()) for b in big.values())


def test_small_updates_survive_in_bf16_with_apexw_only(tmp_path):
    # Adam's first steps move each weight by at most a few lr. Half a bf16 step of a weight with |w| >= 2**-7 is at
    # least 2**-15 ~ 3e-5, so with lr = 1e-6 round-to-nearest (torch AdamW on a bf16 model) leaves every such weight
    # where it was, while stochastic rounding moves each one a whole step with probability ~ |update| / step (~1%).
    changed_torch, n = _steps_with_tiny_lr(tmp_path, "adamw_torch", 1e-6)
    changed_apexw, n2 = _steps_with_tiny_lr(tmp_path, "apexw_8bit", 1e-6)
    assert n == n2 and n > 10_000
    assert changed_torch == 0
    assert changed_apexw > 0.002 * n


@pytest.mark.parametrize("name", NAMES)
def test_sft_trainer_bf16_model_object(tmp_path, tokenizer, name):
    pytest.importorskip("triton", reason="TRL's SFTTrainer loss needs Triton")
    from trl import SFTConfig, SFTTrainer

    model = _full_model()
    config = SFTConfig(
        **train_kwargs(tmp_path, optim=name, bf16=True, max_steps=3),
        max_length=32,
        dataset_text_field="text",
        packing=False,
    )
    trainer = SFTTrainer(model=model, args=config, train_dataset=text_dataset(), processing_class=tokenizer)
    trainer.train()
    opt = unwrap_optimizer(trainer.optimizer)
    assert all(p.dtype == torch.bfloat16 for p in trainer.model.parameters() if p.requires_grad)
    _check_no_master_copy(opt, trainer.model, EXPECTED[name][1])


def test_sft_trainer_loads_a_path_in_fp32_unless_told(tmp_path, tokenizer):
    """TRL loads ``SFTTrainer(model=<path>)`` in float32 unless ``model_init_kwargs`` names a dtype (docs say so)."""
    pytest.importorskip("triton", reason="TRL's SFTTrainer loss needs Triton")
    from trl import SFTConfig, SFTTrainer

    path = tmp_path / "model"
    _full_model().save_pretrained(path)
    tokenizer.save_pretrained(path)
    dtypes = {}
    for label, extra in (("default", {}), ("bf16", {"model_init_kwargs": {"dtype": "bfloat16"}})):
        config = SFTConfig(
            **train_kwargs(tmp_path / label, optim="apexw_8bit", bf16=True, max_steps=1),
            max_length=32,
            dataset_text_field="text",
            packing=False,
            **extra,
        )
        trainer = SFTTrainer(model=str(path), args=config, train_dataset=text_dataset(), processing_class=tokenizer)
        dtypes[label] = {p.dtype for p in trainer.model.parameters()}
    assert dtypes == {"default": {torch.float32}, "bf16": {torch.bfloat16}}


@pytest.mark.parametrize("name", NAMES)
def test_fp16_model_with_fp16_is_refused_with_what_to_do(tmp_path, name):
    model = _full_model(torch.float16)
    before = _snapshot(model)
    trainer = make_trainer(tmp_path, model=model, optim=name, fp16=True, max_steps=2)
    with pytest.raises(ValueError) as info:
        trainer.train()
    msg = str(info.value)
    assert f"optim={name!r} with fp16=True" in msg and "float16" in msg and "GradScaler" in msg
    assert "dtype=torch.float32" in msg and "bf16=True" in msg and "LoRA" in msg
    after = _snapshot(trainer.model)
    assert all(torch.equal(before[n], after[n]) for n in before)  # refused before any step


def test_fp32_model_with_fp16_autocast_is_allowed(tmp_path):
    # the T4 set-up: fp32 master weights under fp16 autocast; nothing to refuse
    from apexw_hf.integrations.transformers import check_model_for_training_args

    class Args:
        fp16 = True
        optim = "apexw_8bit"

    check_model_for_training_args(Args(), _full_model(torch.float32))
    check_model_for_training_args(Args(), None)
    frozen = _full_model(torch.float16)
    frozen.requires_grad_(False)
    check_model_for_training_args(Args(), frozen)  # a frozen fp16 base (LoRA adapters carry the training)
