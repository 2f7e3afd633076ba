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
    "nan_previous_norm_no_share": ([3.0], False, 1, None, NAN, 1.0),
    "inf_previous_norm_no_share": ([3.0], False, 1, None, INF, 1.0),
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
    else:  # a previous norm that is not finite (a skipped step's) gives no estimate
        prev = prev_norm if prev_norm is not None and math.isfinite(prev_norm) else 0.0
        norm = max(math.sqrt(s), prev)
    expected = 0.0 if math.isnan(norm) or math.isinf(norm) else min(1.0, max_norm / (norm + 1e-6))
    if not math.isfinite(s):  # a non-finite gradient so far in the step: NaN, so that the rest is skipped
        assert coef.isnan().all() and coef_lo.isnan().all()
        return
    assert coef.item() == pytest.approx(expected, rel=1e-6, abs=0)
    assert coef_lo.item() == coef.to(lo_dtype).item()


def test_random_norms_agree_to_rounding():
    g = torch.Generator().manual_seed(0)
    parts = torch.rand(1000, generator=g) * 3
    got = run(release_norm_, parts, False, 2, [5.0, 100.0, 900.0], 40.0, 1.0, torch.bfloat16)
    want = run(release_norm_torch, parts, False, 2, [5.0, 100.0, 900.0], 40.0, 1.0, torch.bfloat16)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-6, atol=0)


def plan_of(grads, fmt="4bit", steps=None):
    """A launch plan over parameters shaped like ``grads``, its gradient addresses set (0 for the tensors whose entry
    of ``steps`` is False: not stepping now)."""
    from apexw_hf.engines.triton.kernels import LaunchPlan
    from apexw_hf.formats import init_state

    params = [torch.zeros_like(g, dtype=torch.bfloat16) for g in grads]
    states = [init_state(p, fmt) for p in params]
    plan = LaunchPlan(params, states, fmt, list(range(len(params))), 0, grads[0].dtype)
    steps = steps or [True] * len(grads)
    plan.set_grad_ptrs([g.data_ptr() if on else 0 for g, on in zip(grads, steps)])
    return plan


@pytest.mark.parametrize("fmt", ["4bit", "compact"])  # chunks of 256 / 1,024 elements
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_grad_sumsq_is_the_sum_of_squares_of_the_stepping_gradients(dtype, fmt):
    from apexw_hf.engines.triton.kernels.release_norm import SUMSQ_GROUP, grad_sumsq_

    g = torch.Generator().manual_seed(1)
    # small integers: every square and partial sum is exact in fp32, so any order of summation gives the same bits;
    # sizes around the chunk and around SUMSQ_GROUP chunks, an empty tensor, one tensor not stepping
    sizes = [1, 255, 257, 0, 256 * SUMSQ_GROUP + 3, 4097, 1024 * SUMSQ_GROUP * 2 + 1, 70]
    grads = [torch.randint(-7, 8, (n,), generator=g).to(dtype).to(DEVICE) for n in sizes]
    steps = [i != 6 for i in range(len(sizes))]
    plan = plan_of(grads, fmt, steps)
    parts = grad_sumsq_([plan])
    assert parts.dtype == torch.float32 and parts.numel() == -(-plan.num_work // SUMSQ_GROUP)
    want = sum(float(x.double().square().sum()) for x, on in zip(grads, steps) if on)
    assert parts.sum().item() == want
    # the buffer is the plan's, written again by its next launch (the gradients at the same addresses)
    before = float(grads[0].double().square().sum())
    grads[0].fill_(3.0)
    again = grad_sumsq_([plan])
    assert again.data_ptr() == parts.data_ptr() and again.sum().item() == want - before + 9.0


def test_grad_sumsq_of_several_plans_and_nonfinite_values():
    from apexw_hf.engines.triton.kernels.release_norm import grad_sumsq_

    g = torch.Generator().manual_seed(2)
    a = [torch.randn(n, generator=g).to(DEVICE) for n in (300, 5000)]
    b = [torch.randn(n, generator=g).to(torch.bfloat16).to(DEVICE) for n in (1, 700)]
    parts = grad_sumsq_([plan_of(a), plan_of(b)])
    want = sum(x.double().square().sum() for x in a + b).item()
    assert parts.sum().item() == pytest.approx(want, rel=1e-6)
    b[1][5] = INF
    assert grad_sumsq_([plan_of(a), plan_of(b)]).sum().item() == INF
    a[0][7] = NAN
    assert math.isnan(grad_sumsq_([plan_of(a), plan_of(b)]).sum().item())
