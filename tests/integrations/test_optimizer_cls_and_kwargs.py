"""The route without optim names, ``Trainer(optimizer_cls_and_kwargs=(ApexW8bit, {...}))`` (docs/integration.md):
the hyperparameters given there are the ones that train, or a conflict with TrainingArguments is refused by name."""

from __future__ import annotations

import pytest
import torch

from apexw_hf import ApexW8bit
from apexw_hf.accounting import unwrap_optimizer

from .tiny import make_model, make_trainer

KWARGS = {"lr": 3e-3, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.05, "seed": 1, "engine": "torch"}


def _trainer(tmp_path, optimizer_kwargs, cls=ApexW8bit, **args):
    model = make_model(lora=False)  # a full model: weights decay, biases-free Llama has norms in the 0.0 group
    return make_trainer(
        tmp_path,
        model=model,
        trainer_kwargs={"optimizer_cls_and_kwargs": (cls, dict(optimizer_kwargs))},
        optim_args=None,
        max_steps=3,
        **args,
    )


def _groups(trainer):
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    return [({names[id(p)] for p in g["params"]}, g) for g in unwrap_optimizer(trainer.optimizer).param_groups]


def test_the_users_hyperparameters_train(tmp_path):
    trainer = _trainer(tmp_path, KWARGS)  # TrainingArguments.weight_decay left at its default, 0.0
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    groups = _groups(trainer)
    assert len(groups) == 2
    (decay_names, decay), (plain_names, plain) = groups
    assert "model.layers.0.self_attn.q_proj.weight" in decay_names and "model.norm.weight" in plain_names
    assert decay["weight_decay"] == 0.05  # the keyword, not TrainingArguments.weight_decay
    assert plain["weight_decay"] == 0.0  # norms and biases: the Trainer's rule for every optimizer
    for g in (decay, plain):
        assert g["initial_lr"] == 3e-3 and g["betas"] == (0.8, 0.99) and g["eps"] == 1e-6 and g["seed"] == 1
    assert trainer.args.weight_decay == 0.0  # the arguments themselves are left as given
    changed = sum(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    assert changed == len(before)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3


def test_the_same_weight_decay_in_both_places_is_fine(tmp_path):
    trainer = _trainer(tmp_path, KWARGS, weight_decay=0.05)
    trainer.create_optimizer()
    assert [g["weight_decay"] for _, g in _groups(trainer)] == [0.05, 0.0]


def test_without_the_keyword_training_arguments_decide(tmp_path):
    kwargs = {k: v for k, v in KWARGS.items() if k != "weight_decay"}
    trainer = _trainer(tmp_path, kwargs, weight_decay=0.02)
    trainer.create_optimizer()
    assert [g["weight_decay"] for _, g in _groups(trainer)] == [0.02, 0.0]


def test_two_different_weight_decays_are_refused_by_name(tmp_path):
    trainer = _trainer(tmp_path, KWARGS, weight_decay=0.01)
    with pytest.raises(ValueError, match=r"weight_decay is set twice.*0\.05.*TrainingArguments\(weight_decay=0\.01\)"):
        trainer.train()


def test_other_optimizer_classes_keep_the_trainers_behaviour(tmp_path):
    """apexw_hf changes the route for its own classes only."""
    trainer = _trainer(tmp_path, {"lr": 3e-3, "weight_decay": 0.05}, cls=torch.optim.AdamW)
    trainer.create_optimizer()
    assert [g["weight_decay"] for _, g in _groups(trainer)] == [0.0, 0.0]
