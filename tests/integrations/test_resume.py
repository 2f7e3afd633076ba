"""Resuming with ``trainer.train(resume_from_checkpoint=...)`` restores ApexW exactly: equal to an unbroken run."""

from __future__ import annotations

import pytest
import torch

from apexw_hf.accounting import unwrap_optimizer

from .tiny import NAMES, make_trainer

EXPECTED_DTYPES = {
    "apexw_8bit": {"exp_avg": torch.uint8, "exp_avg_sq": torch.uint8},
    "apexw_compact": {"exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16},
    "apexw_4bit": {"exp_avg_mv": torch.uint8, "exp_avg_scale": torch.float32, "exp_avg_sq_scale": torch.float32},
}


def _run(out_dir, name, resume_from=None):
    trainer = make_trainer(out_dir, optim=name, max_steps=6, save_strategy="steps", save_steps=3, weight_decay=0.01)
    trainer.train(resume_from_checkpoint=resume_from)
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    return trainer, losses


def _state_tensors(opt):
    return [
        (key, value)
        for group in opt.param_groups
        for p in group["params"]
        for key, value in sorted(opt.state[p].items())
        if isinstance(value, torch.Tensor)
    ]


@pytest.mark.parametrize("name", NAMES)
def test_resume_equals_unbroken_run(tmp_path, name):
    unbroken, losses = _run(tmp_path / "a", name)
    checkpoint = tmp_path / "a" / "checkpoint-3"

    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    saved_dtypes = {k: v.dtype for s in saved["state"].values() for k, v in s.items() if isinstance(v, torch.Tensor)}
    for key, dtype in EXPECTED_DTYPES[name].items():
        assert saved_dtypes[key] == dtype

    resumed, resumed_losses = _run(tmp_path / "b", name, resume_from=str(checkpoint))
    # the resumed log history starts with the checkpoint's entries (steps 1-3) and continues with its own
    assert sorted(resumed_losses) == sorted(losses) == [1, 2, 3, 4, 5, 6]
    assert all(resumed_losses[s] == losses[s] for s in (4, 5, 6)), (resumed_losses, losses)

    a = dict(unbroken.model.named_parameters())
    b = dict(resumed.model.named_parameters())
    trainable = [n for n, p in a.items() if p.requires_grad]
    assert trainable and all(torch.equal(a[n], b[n]) for n in trainable)

    sa, sb = _state_tensors(unwrap_optimizer(unbroken.optimizer)), _state_tensors(unwrap_optimizer(resumed.optimizer))
    assert [k for k, _ in sa] == [k for k, _ in sb]
    for (key, x), (_, y) in zip(sa, sb):
        assert x.dtype == y.dtype, key
        assert torch.equal(x, y), key
    for key, dtype in EXPECTED_DTYPES[name].items():
        assert all(v.dtype == dtype for k, v in sb if k == key)
