"""``ApexW4bit``: AdamW with block-quantized 4-bit moments (about 1.03 bytes of state per parameter)."""

from __future__ import annotations

from .base import ApexW


class ApexW4bit(ApexW):
    """:class:`~apexw_hf.ApexW` with ``state_format="4bit"``.

    One byte per element holds both moments' 4-bit codes, plus one bf16 scale per block of 128 elements and moment:
    the value divided by its block's scale is stored as a power of two, ``m`` as sign + 3 exponent bits (2**-6 to 1
    of the block maximum, and zero), ``v`` as 4 exponent bits (2**-14 to 1), chosen by unbiased stochastic rounding
    (the 8-bit format's codes without mantissa bits). Zero is stored exactly and a nonzero ``v`` is never stored as
    zero. Li et al. (2023), "Memory Efficient Optimizers with 4-bit States", showed 4-bit moments reaching AdamW's
    quality with blocks of 128 and a ``v`` code without a zero point; the codes and their encoding are this project's
    (see :mod:`apexw_hf.reference`). Half the state of :class:`~apexw_hf.ApexW8bit`, with one code per binade: the
    coarsest format here, so check the loss of your task against ``"8bit"`` before relying on it.

    Example:
        >>> import torch
        >>> from apexw_hf import ApexW4bit
        >>> opt = ApexW4bit(torch.nn.Linear(8, 8).parameters(), lr=2e-4)
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, **kwargs):
        kwargs.setdefault("state_format", "4bit")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kwargs)
