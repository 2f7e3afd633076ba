"""Skewed blocks (issue 45): the small elements of a block whose maximum ``v`` is 2**4 to 2**24 times theirs move as
far as with ``torch.optim.AdamW``, for every beta2 of the issue, with the block maximum held or decaying, and after a
burst of large gradients (the issue's scenario), through ``reference.adamw_step_ref_`` (every engine computes its
bits).

This is ``scripts/skew_walk.py`` (its functions) at a fifth of its steps and one block per ratio; the full tables are
in docs/skewed_blocks.md. 8-bit format version 2 failed it (its e4m4 ``v`` reached 2**-18 of the block maximum, and its
bf16 scale re-rounded every code when the maximum moved: 0.10-1.30 across the table); version 3 measures 1.00-1.03.

4-bit format version 2 failed it too (one ``v`` code per binade to 2**-14: 0.49 at 2**16, 0.025 at 2**24, and 1.2-1.4
after a burst); version 3 measures 0.87-1.12 here. Its bounds are wider than 8-bit's, 0.85-1.15: one block per ratio
scatters by several percent, and with 48 blocks per ratio the format itself measures 0.95-1.02 except after a burst
into a decaying block, 1.03-1.12 from 2**20 on (the noise of an ``m`` 2**-10 below its block's, coded as 0 or 2**-6).
"""

import pytest

from ..scripts import load_script

LOG2_RATIOS = (4, 8, 12, 16, 20, 24)
BETA2S = (0.99, 0.999, 0.9995, 0.9999)


def _check_update_sizes(fmt: str, block: int, scenario: str, burst: int, lo: float, hi: float) -> None:
    """``skew_walk``'s small elements of ``fmt`` (blocks of ``block``) against torch AdamW's, at a fifth of its steps
    and one block per ratio, for every beta2 and ratio: each update size within [lo, hi]."""
    walk = load_script("skew_walk")
    for beta2 in BETA2S:
        after = walk.AFTER[beta2] // 5
        args = (LOG2_RATIOS, 1, block, burst, after, scenario, 0)
        ratio = walk.distances(fmt, beta2, *args) / walk.distances("torch", beta2, *args)
        for k, r in zip(LOG2_RATIOS, ratio.tolist()):
            assert lo <= r <= hi, f"beta2 {beta2}, v 2**{k} below the block maximum: update size {r:.3f}"


@pytest.mark.parametrize("scenario, burst", [("held", 0), ("decaying", 0), ("held", 20)])
def test_8bit_update_size_of_skewed_elements(scenario, burst):
    _check_update_sizes("8bit", 256, scenario, burst, 0.95, 1.05)


@pytest.mark.parametrize("scenario, burst", [("held", 0), ("decaying", 0), ("held", 20), ("decaying", 20)])
def test_4bit_update_size_of_skewed_elements(scenario, burst):
    _check_update_sizes("4bit", 128, scenario, burst, 0.85, 1.15)
