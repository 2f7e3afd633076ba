"""``ApexW4bit``: AdamW with block-quantized 4-bit moments (about 1.05 bytes of state per parameter)."""

from __future__ import annotations

from .base import ApexW


class ApexW4bit(ApexW):
    """:class:`~apexw_hf.ApexW` with ``state_format="4bit"`` (format version 2).

    One byte per element holds both moments' 4-bit codes; per block of 128 elements, ``m`` has a bf16 scale and ``v``
    an fp32 one: the value divided by its block's scale is stored as a power of two, ``m`` as sign + 3 exponent bits
    (2**-6 to 1 of the block maximum, and zero), ``v`` as 4 exponent bits (2**-14 to 1), chosen by stochastic
    rounding (unbiased for ``m``, unbiased in ``log2(v)`` for ``v``). Zero is stored exactly and a nonzero ``v`` is
    never stored as zero. ``v``'s scale is its block's exact maximum, so when a block's gradients shrink its codes
    stay and the scale decays by exactly ``beta2``: the update keeps AdamW's size (format version 1 rounded that
    decay into the codes, a random walk that made updates about 2x too large). Version-1 checkpoints are
    converted on load. Li et al. (2023), "Memory Efficient Optimizers with 4-bit States", showed 4-bit moments
    reaching AdamW's quality with blocks of 128 and a ``v`` code without a zero point; the codes and their encoding
    are this project's (see :mod:`apexw_hf.reference`). About half the state of :class:`~apexw_hf.ApexW8bit`, with
    one code per binade: the coarsest format here (an element whose ``v`` falls while its block's maximum stays
    still walks in ``log2(v)``), so check the loss of your task against ``"8bit"`` before relying on it.

    Example:
        >>> import torch
        >>> from apexw_hf import ApexW4bit
        >>> opt = ApexW4bit(torch.nn.Linear(8, 8).parameters(), lr=2e-4)
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, **kwargs):
        kwargs.setdefault("state_format", "4bit")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kwargs)
