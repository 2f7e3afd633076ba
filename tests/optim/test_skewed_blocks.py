"""Skewed blocks (issue 45): the small elements of a block whose maximum ``v`` is 2**4 to 2**24 times theirs move as
far as with ``torch.optim.AdamW``, for every beta2 of the issue, with the block maximum held or decaying, and after a
burst of large gradients (the issue's scenario), through ``reference.adamw_step_ref_`` (every engine computes its
bits).

This is ``scripts/skew_walk.py`` (its functions) at a fifth of its steps and one block per ratio; the full tables are
in docs/skewed_blocks.md. 8-bit format version 2 failed it (its e4m4 ``v`` reached 2**-18 of the block maximum, and its
bf16 scale re-rounded every code when the maximum moved: 0.10-1.30 across the table); version 3 measures 1.00-1.03.

4-bit format version 2 failed it too (one ``v`` code per binade to 2**-14: 0.49 at 2**16, 0.025 at 2**24, and 1.2-1.4
after a burst). 4-bit runs 32 blocks per ratio (one block scattered by up to 0.15 around the format's own value:
version 3 passed with 0.87-1.12 there and version 4, whose ``m`` codes draw other roundings, measured 0.84-1.18) and
its bounds are 0.90-1.17: at a fifth of the steps a burst's effect has not decayed yet, and versions 3 and 4 both
measure 0.93-1.15 here (with 48 blocks and all the steps, version 4 0.94-1.00 without a burst and up to 1.106 after
one, docs/skewed_blocks.md).
"""

import pytest

from ..scripts import load_script

LOG2_RATIOS = (4, 8, 12, 16, 20, 24)
BETA2S = (0.99, 0.999, 0.9995, 0.9999)


def _check_update_sizes(
    fmt: str, block: int, scenario: str, burst: int, lo: float, hi: float, blocks: int = 1
) -> None:
    """``skew_walk``'s small elements of ``fmt`` (blocks of ``block``) against torch AdamW's, at a fifth of its steps
    and ``blocks`` blocks per ratio, for every beta2 and ratio: each update size within [lo, hi]."""
    walk = load_script("skew_walk")
    for beta2 in BETA2S:
        after = walk.AFTER[beta2] // 5
        args = (LOG2_RATIOS, blocks, block, burst, after, scenario, 0)
        ratio = walk.distances(fmt, beta2, *args) / walk.distances("torch", beta2, *args)
        for k, r in zip(LOG2_RATIOS, ratio.tolist()):
            assert lo <= r <= hi, f"beta2 {beta2}, v 2**{k} below the block maximum: update size {r:.3f}"


@pytest.mark.parametrize("scenario, burst", [("held", 0), ("decaying", 0), ("held", 20)])
def test_8bit_update_size_of_skewed_elements(scenario, burst):
    _check_update_sizes("8bit", 256, scenario, burst, 0.95, 1.05)


@pytest.mark.parametrize("scenario, burst", [("held", 0), ("decaying", 0), ("held", 20), ("decaying", 20)])
def test_4bit_update_size_of_skewed_elements(scenario, burst):
    _check_update_sizes("4bit", 128, scenario, burst, 0.90, 1.17, blocks=32)
