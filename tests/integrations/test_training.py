"""A tiny Llama + LoRA trained a few steps through transformers' Trainer and TRL's SFTTrainer with each ApexW name."""

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
# upper bounds of state bytes per trainable element (the formats hold 4, ~2.03 and ~1.06), plus 8 per tensor
BYTES_PER_PARAM = {"compact": 4.5, "8bit": 2.6, "4bit": 1.3}


def _trainable(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _check_run(trainer, name, before):
    cls, fmt = EXPECTED[name]
    opt = unwrap_optimizer(trainer.optimizer)
    assert type(opt) is cls
    assert all(g["state_format"] == fmt and g["engine"] == "torch" for g in opt.param_groups)
    lr0 = trainer.args.learning_rate
    assert {g["weight_decay"] for g in opt.param_groups} <= {trainer.args.weight_decay, 0.0}
    assert all(g["betas"] == (trainer.args.adam_beta1, trainer.args.adam_beta2) for g in opt.param_groups)
    assert all(math.isclose(g.get("initial_lr", lr0), lr0) for g in opt.param_groups)
    after = {n: p.detach() for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert set(after) == set(before) and len(after) == 2 * 7 * 2  # lora_A and lora_B of 7 projections, 2 layers
    assert sum(not torch.equal(before[n], after[n]) for n in after) == len(after)
    n_params = sum(p.numel() for p in after.values())
    state = optimizer_state_bytes(trainer.optimizer)
    assert state == opt.state_bytes()
    assert state < BYTES_PER_PARAM[fmt] * n_params + 8 * len(after)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == trainer.args.max_steps and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("name", NAMES)
def test_trainer_lora(tmp_path, name):
    model = make_model()
    before = _trainable(model)
    trainer = make_trainer(tmp_path, model=model, optim=name, weight_decay=0.01, max_steps=5)
    trainer.train()
    _check_run(trainer, name, before)


@pytest.mark.parametrize("name", NAMES)
def test_sft_trainer_lora(tmp_path, tokenizer, name):
    # TRL's SFTTrainer computes its loss with a Triton kernel (run by the interpreter on CPU, see conftest.py)
    pytest.importorskip("triton", reason="TRL's SFTTrainer loss needs Triton")
    from trl import SFTConfig, SFTTrainer

    model = make_model()
    before = _trainable(model)
    config = SFTConfig(
        **train_kwargs(tmp_path, optim=name, max_steps=5, optim_args="engine=torch,seed=7"),
        max_length=32,
        dataset_text_field="text",
        packing=False,
    )
    trainer = SFTTrainer(model=model, args=config, train_dataset=text_dataset(), processing_class=tokenizer)
    trainer.train()
    _check_run(trainer, name, before)
    assert unwrap_optimizer(trainer.optimizer).defaults["seed"] == 7


def test_optim_args_reach_the_optimizer(tmp_path):
    trainer = make_trainer(
        tmp_path,
        rows=8,
        optim="apexw_compact",
        optim_args="state_format=fp32, param_rounding=nearest, seed=11, engine=torch",
        adam_beta1=0.8,
        adam_beta2=0.95,
        adam_epsilon=1e-6,
        weight_decay=0.05,
    )
    trainer.create_optimizer()
    opt = unwrap_optimizer(trainer.optimizer)
    assert opt.defaults["state_format"] == "fp32" and opt.defaults["param_rounding"] == "nearest"
    assert opt.defaults["seed"] == 11 and opt.defaults["eps"] == 1e-6 and opt.defaults["betas"] == (0.8, 0.95)
    decay = {g["weight_decay"] for g in opt.param_groups}
    assert 0.05 in decay


def test_weight_decay_groups_of_a_full_model(tmp_path):
    """Without LoRA the Trainer splits norms (no decay) from matrices (decay); ApexW keeps both groups."""
    model = make_model(lora=False)
    trainer = make_trainer(tmp_path, model=model, rows=8, optim="apexw_8bit", weight_decay=0.1, max_steps=2)
    trainer.train()
    opt = unwrap_optimizer(trainer.optimizer)
    by_wd = {g["weight_decay"]: g for g in opt.param_groups}
    assert set(by_wd) == {0.1, 0.0}
    norm_ids = {id(p) for n, p in model.named_parameters() if "norm" in n}
    assert norm_ids and norm_ids <= {id(p) for p in by_wd[0.0]["params"]}
    assert not norm_ids & {id(p) for p in by_wd[0.1]["params"]}
