"""``ApexWCompact``: AdamW with both moments in bf16 (stochastic rounding), exactly half the state of fp32 AdamW."""

from __future__ import annotations

from .base import ApexW


class ApexWCompact(ApexW):
    """:class:`~apexw_hf.ApexW` with ``state_format="compact"``: 4 bytes of state per parameter.

    Both moments are stored in bf16 and written with stochastic rounding, so the second moment keeps decaying at
    ``beta2 = 0.999`` (its 0.1% per-step decay is below half a bf16 ulp, so round-to-nearest would freeze it).

    Example:
        >>> import torch
        >>> from apexw_hf import ApexWCompact
        >>> opt = ApexWCompact(torch.nn.Linear(8, 8).parameters(), lr=2e-4, weight_decay=0.001)
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, **kwargs):
        kwargs.setdefault("state_format", "compact")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kwargs)
