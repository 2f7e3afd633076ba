"""OptimizerStateCallback's ``gradient_release`` and ``kept_bytes_per_param``: parameters + gradients held at the step
(none with release) + optimizer state, per optimized parameter element."""

from __future__ import annotations

import pytest
import torch

from apexw_hf import ApexW8bit
from apexw_hf.accounting import unwrap_optimizer
from apexw_hf.integrations.callbacks import OptimizerStateCallback, optimizer_state_metrics

from .tiny import make_model, make_trainer


def _state_bytes_8bit(sizes):
    # codes, a bf16 m scale and an fp32 v scale per 256 (format version 3), an fp32 step
    return sum(2 * n + (2 + 4) * -(-n // 256) + 4 for n in sizes)


@pytest.mark.parametrize("name", ["apexw_8bit", "apexw_8bit_release"])
def test_callback_logs_kept_bytes_with_and_without_release(tmp_path, name):
    """A full fine-tune of the fp32 tiny Llama: 4 bytes of parameter per element, 4 of gradient without release."""
    trainer = make_trainer(
        tmp_path,
        model=make_model(lora=False),
        rows=8,
        trainer_kwargs={"callbacks": [OptimizerStateCallback()]},
        optim=name,
        max_steps=2,
    )
    trainer.train()
    release = name.endswith("_release")
    assert unwrap_optimizer(trainer.optimizer).gradient_release == release
    sizes = [p.numel() for p in trainer.model.parameters()]  # every parameter is trained (the tied one once)
    n = sum(sizes)
    state = _state_bytes_8bit(sizes)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2
    for h in logs:
        assert h["gradient_release"] == int(release)
        assert h["kept_bytes_per_param"] == pytest.approx((4 * n + (0 if release else 4 * n) + state) / n, rel=1e-12)
        assert h["optimizer_state_bytes_per_param"] == pytest.approx(state / n, rel=1e-12)


def test_kept_bytes_of_a_bf16_model_frozen_tensors_and_torch_adamw():
    """bf16 parameters and gradients (2 + 2 bytes), a frozen parameter in the groups (no gradient), and an optimizer
    without release (torch AdamW: fp32 moments of a bf16 parameter in its dtype)."""
    trained = torch.nn.Parameter(torch.randn(1000, dtype=torch.bfloat16))
    frozen = torch.nn.Parameter(torch.randn(24, dtype=torch.bfloat16), requires_grad=False)
    release = ApexW8bit([trained, frozen], engine="torch", gradient_release=True)
    (trained.float() ** 2).sum().backward()
    release.step()
    m = optimizer_state_metrics(release, peak_memory=False)
    state = _state_bytes_8bit([1000])
    assert m["gradient_release"] == 1
    assert m["kept_bytes_per_param"] == pytest.approx((2 * 1024 + state) / 1024, rel=1e-12)

    release.remove_release_hooks()  # else its hooks would step `trained` in the next backward
    plain = ApexW8bit([trained, frozen], engine="torch")
    (trained.float() ** 2).sum().backward()
    plain.step()
    m = optimizer_state_metrics(plain, peak_memory=False)
    assert m["gradient_release"] == 0
    assert m["kept_bytes_per_param"] == pytest.approx((2 * 1024 + 2 * 1000 + state) / 1024, rel=1e-12)

    adamw = torch.optim.AdamW([trained])
    adamw.step()
    m = optimizer_state_metrics(adamw, peak_memory=False)
    assert m["gradient_release"] == 0
    assert m["kept_bytes_per_param"] == pytest.approx((2 + 2 + 2 * 2) + 4 / 1000, rel=1e-12)
