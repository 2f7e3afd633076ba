"""The gradient-release norm kernel (one launch per bucket) computes what release_norm_torch computes."""

import math

import pytest
import torch

from apexw_hf.engines.triton.kernels.release_norm import release_norm_
from apexw_hf.optim.release import release_norm_torch

from .helpers import DEVICE, mismatch

NAN, INF = float("nan"), float("inf")


def run(fn, parts, squared, k, prev_cum, prev_norm, max_norm, lo_dtype):
    cum = torch.full((8,), -7.0, device=DEVICE)
    cum[:k] = torch.arange(1, k + 1, dtype=torch.float32) * 4.0  # the running sums of the earlier buckets
    coef = torch.full((1,), -1.0, device=DEVICE)
    coef_lo = torch.full((1,), -1.0, dtype=lo_dtype, device=DEVICE)
    fn(
        parts.to(DEVICE),
        squared,
        cum,
        k,
        None if prev_cum is None else torch.tensor(prev_cum, device=DEVICE),
        None if prev_norm is None else torch.tensor([prev_norm], device=DEVICE),
        max_norm,
        coef,
        coef_lo,
    )
    return cum, coef, coef_lo


# (parts, squared, k, previous step's running sums, previous norm, max_norm): integer parts, so that every sum is exact
CASES = {
    "no_clip": ([3.0, 4.0], False, 0, None, None, None),
    "first_step": ([3.0, 4.0], False, 0, None, None, 1.0),
    "first_step_later_bucket": ([1.0, 2.0, 2.0], False, 2, None, None, 0.5),
    "fallback_to_previous_norm": ([1.0], False, 1, None, 30.0, 2.0),
    "share": ([3.0, 4.0], False, 1, [10.0, 40.0, 90.0], 12.0, 1.0),
    "share_below_own_norm": ([30.0, 40.0], False, 0, [100.0, 400.0], 20.0, 7.0),
    "zero_share": ([3.0, 4.0], False, 1, [0.0, 0.0, 9.0], 3.0, 1.0),
    "squared_part": ([25.0], True, 1, [10.0, 40.0], 12.0, 3.0),
    "no_clip_needed": ([0.5], False, 0, [1.0], 1.0, 100.0),
    "nan_gradient": ([3.0, NAN], False, 1, [10.0, 40.0], 12.0, 1.0),
    "inf_gradient": ([INF, 1.0], False, 0, None, 5.0, 1.0),
    "nan_previous_norm": ([3.0], False, 0, [1.0], NAN, 1.0),
    "many_tensors": ([float(i % 7) for i in range(300)], False, 3, [1.0] * 5, 2.0, 10.0),
}


@pytest.mark.parametrize("lo_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_the_pytorch_operations(case, lo_dtype):
    values, squared, k, prev_cum, prev_norm, max_norm = CASES[case]
    parts = torch.tensor(values, dtype=torch.float32)
    got = run(release_norm_, parts, squared, k, prev_cum, prev_norm, max_norm, lo_dtype)
    want = run(release_norm_torch, parts, squared, k, prev_cum, prev_norm, max_norm, lo_dtype)
    for name, a, b in zip(("cum", "coef", "coef_lo"), got, want):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()), (
            f"{name}: {mismatch(a, b)}"
        )
    cum, coef, coef_lo = want
    sq = sum(values) if squared else sum(v * v for v in values)
    s = sq + (4.0 * k if k else 0.0)
    assert math.isnan(s) and cum[k].isnan() or cum[k].item() == s
    assert torch.equal(cum[k + 1 :], torch.full((7 - k,), -7.0, device=DEVICE))  # nothing else written
    if max_norm is None:
        assert coef.item() == -1.0  # untouched without clipping
        return
    if prev_cum is not None and prev_norm is not None:
        share = prev_cum[k] / prev_norm**2
        norm = math.sqrt(max(s / share, s)) if share > 0 else math.sqrt(s)
    else:
        norm = math.sqrt(s) if prev_norm is None else max(math.sqrt(s), prev_norm)
    expected = 0.0 if math.isnan(norm) or math.isinf(norm) else min(1.0, max_norm / (norm + 1e-6))
    assert coef.item() == pytest.approx(expected, rel=1e-6, abs=0)
    assert coef_lo.item() == coef.to(lo_dtype).item()


def test_random_norms_agree_to_rounding():
    g = torch.Generator().manual_seed(0)
    parts = torch.rand(1000, generator=g) * 3
    got = run(release_norm_, parts, False, 2, [5.0, 100.0, 900.0], 40.0, 1.0, torch.bfloat16)
    want = run(release_norm_torch, parts, False, 2, [5.0, 100.0, 900.0], 40.0, 1.0, torch.bfloat16)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-6, atol=0)
