"""A param group's hyperparameters as Python floats: read when a group is checked and by each engine every step.

One reader for both, so a value that passes the check is read the same way at every step, and a value a scheduler
changes later (a tensor lr resized, say) gets the same clear error in the step as at construction.
"""

from __future__ import annotations

import torch


def as_float(name: str, value) -> float:
    """``value`` (a number or a 1-element tensor) as a float; a clear error naming ``name`` otherwise.

    A 1-element CUDA tensor synchronizes here; the optimizer documents lr as read once per step.
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            # torch.optim.AdamW's wording, so code written against torch's errors matches ours too
            raise ValueError(f"Tensor {name} must be 1-element, got a tensor of shape {tuple(value.shape)}")
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    return float(value)


def step_hparams(group: dict) -> dict[str, float]:
    """The keyword arguments of :meth:`apexw_hf.reference.StepScalars.make` but ``step``, from a param group."""
    return dict(
        lr=as_float("lr", group["lr"]),
        beta1=as_float("betas[0]", group["betas"][0]),
        beta2=as_float("betas[1]", group["betas"][1]),
        eps=as_float("eps", group["eps"]),
        weight_decay=as_float("weight_decay", group["weight_decay"]),
    )
