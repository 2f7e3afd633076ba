"""``ApexW4bit``: AdamW with block-quantized 4-bit moments (about 1.06 bytes of state per parameter)."""

from __future__ import annotations

from .base import ApexW


class ApexW4bit(ApexW):
    """:class:`~apexw_hf.ApexW` with ``state_format="4bit"`` (format version 3).

    One byte per element holds both moments' 4-bit codes; per block of 128 elements, ``m`` and ``v`` each have an fp32
    scale: ``m`` divided by its block's maximum is stored as sign + 3 exponent bits (a power of two from 2**-6 to 1,
    and zero), ``v`` as a power of four from 2**-28 to 1 of its scale (and zero), chosen by stochastic rounding
    (unbiased for ``m``; for ``v`` with a probability that keeps ``1/sqrt(v)`` near its true value). Zero is stored
    exactly and a nonzero ``v`` is never stored as zero. ``v``'s scale follows its block's maximum from above and
    decays by exactly ``beta2`` while the maximum stays under it, so a ``v`` that only decays keeps its code: the
    update keeps AdamW's size, also for elements far below their block's maximum (2**4 to 2**24 below it: 0.95-1.02x
    AdamW's in ``scripts/skew_walk.py``, 1.03-1.12x from 2**20 on after a burst into a decaying block). Checkpoints
    of format versions 1 and 2 are converted on load. Li et al. (2023), "Memory Efficient Optimizers with 4-bit
    States", showed 4-bit moments reaching AdamW's quality with blocks of 128 and a ``v`` code without a zero point;
    the codes and their encoding are this project's (see :mod:`apexw_hf.reference`). About half the state of
    :class:`~apexw_hf.ApexW8bit`, and the coarsest format here, so check the loss of your task against ``"8bit"``
    before relying on it.

    Example:
        >>> import torch
        >>> from apexw_hf import ApexW4bit
        >>> opt = ApexW4bit(torch.nn.Linear(8, 8).parameters(), lr=2e-4)
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, **kwargs):
        kwargs.setdefault("state_format", "4bit")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kwargs)
