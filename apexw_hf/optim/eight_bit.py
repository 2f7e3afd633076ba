"""``ApexW8bit``: AdamW with block-quantized 8-bit moments (about 2.03 bytes of state per parameter)."""

from __future__ import annotations

from .base import ApexW


class ApexW8bit(ApexW):
    """:class:`~apexw_hf.ApexW` with ``state_format="8bit"``.

    Each moment is one byte per element plus one scale per block of 256 elements: the value divided by its block's
    scale is stored as a small floating-point code, ``m`` as sign + 4 exponent + 3 mantissa bits over a bf16 scale
    (down to 2**-17 of the block maximum), ``v`` as 5 exponent + 3 mantissa bits over an fp32 scale that decays by
    exactly ``beta2`` while the block maximum stays under it (down to 2**-29 of the maximum: elements far below their
    block's largest ``v`` keep AdamW's update size), chosen by unbiased stochastic rounding. Zero is stored exactly
    and a nonzero ``v`` is never stored as zero. Block-wise quantization of Adam states follows Dettmers et al.
    (2022), "8-bit Optimizers via Block-wise Quantization"; the codes, their integer encoding, the ``v`` scale and
    the unbiased rounding are this project's format, version 3 (see :mod:`apexw_hf.reference`; state dicts of
    versions 1 and 2 are converted on loading).

    Example:
        >>> import torch
        >>> from apexw_hf import ApexW8bit
        >>> opt = ApexW8bit(torch.nn.Linear(8, 8).parameters(), lr=2e-4)
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, **kwargs):
        kwargs.setdefault("state_format", "8bit")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kwargs)
