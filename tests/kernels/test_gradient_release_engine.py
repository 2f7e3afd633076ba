"""Gradient release on the Triton engine (GPU, or the interpreter on CPU): the same bits as step(), bucket plans."""

import pytest
import torch

from apexw_hf.optim import ApexW

from ..optim.release_model import groups, make, train
from .helpers import DEVICE


def _released(fmt: str, clip: float | None):
    """A model trained 3 steps by the Triton engine with gradient release in buckets of 700 elements, clipped to
    ``clip``: (model, optimizer)."""
    model = make().to(DEVICE)
    opt = ApexW(
        groups(model),
        lr=2e-2,
        state_format=fmt,
        engine="triton",
        gradient_release=True,
        max_grad_norm=clip,
        release_bucket_size=700,
    )
    train(model, opt, 3)
    return model, opt


@pytest.mark.parametrize("fmt", ["compact", "8bit", "4bit"])
def test_release_on_the_triton_engine_is_bit_identical(fmt):
    a, b = make().to(DEVICE), make().to(DEVICE)
    oa = ApexW(groups(a), lr=2e-2, state_format=fmt, engine="triton")
    ob = ApexW(groups(b), lr=2e-2, state_format=fmt, engine="triton", gradient_release=True, release_bucket_size=700)
    train(a, oa, 3)
    train(b, ob, 3)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    # one launch plan per (group, bucket), no plan holding a tensor of another bucket (their step counters would go
    # stale)
    caches = list(ob._triton_engine()._cache.values())
    members = [i for c in caches for i in c.member_ids]
    assert len(caches) > 2 and len(members) == len(set(members))


@pytest.mark.parametrize("fmt", ["8bit", "4bit"])
def test_release_with_clipping_through_the_norm_kernel(fmt, monkeypatch):
    """Release with clipping and several buckets: the norm kernel (forced on CPU under the interpreter) gives the
    parameters, norms and checkpointed partial sums of the PyTorch operations."""
    from apexw_hf.engines.triton.kernels.release_norm import release_norm_
    from apexw_hf.optim import release

    runs = []
    for impl in (release.release_norm_torch, release_norm_):
        monkeypatch.setattr(release, "_norm_impl", lambda device, impl=impl: impl)
        runs.append(_released(fmt, 0.05))
    (a, oa), (b, ob) = runs
    assert oa._release.flushes > 6 and oa.grad_norm.item() > 0.05  # clipping acted
    torch.testing.assert_close(oa.grad_norm, ob.grad_norm, rtol=1e-6, atol=0)
    sa, sb = oa.state_dict()["gradient_release"], ob.state_dict()["gradient_release"]
    assert len(sa["prev_partial_sumsq"]) == len(sb["prev_partial_sumsq"]) > 2
    torch.testing.assert_close(
        torch.tensor(sa["prev_partial_sumsq"]), torch.tensor(sb["prev_partial_sumsq"]), rtol=1e-6, atol=0
    )
    for p, q in zip(a.parameters(), b.parameters()):
        # the per-tensor norms are summed in a different order (a tree in the kernel): equal up to rounding
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fmt", ["compact", "4bit"])
def test_release_norm_through_the_launch_plans(fmt, monkeypatch):
    """The GPU path of a bucket's norm (forced on CPU under the interpreter): the sum of squares read through the
    bucket's launch plans, then the norm kernel, and the clip in the update kernel. Without clipping the parameters
    are those of step(); with clipping the norms, partial sums and parameters are those of the per-tensor norms up to
    rounding, and exactly those of the same norms with the gradients multiplied in place."""
    from apexw_hf.engines.triton.kernels.release_norm import grad_sumsq_, release_norm_
    from apexw_hf.optim import release

    calls = []

    def counted(plans):
        calls.append(len(plans))
        return grad_sumsq_(plans)

    monkeypatch.setattr(release, "_norm_impl", lambda device: release_norm_)
    plain = make().to(DEVICE)
    train(plain, ApexW(groups(plain), lr=2e-2, state_format=fmt, engine="triton"), 3)
    runs = []
    for impl in (None, counted):
        monkeypatch.setattr(release, "_sumsq_impl", lambda device, impl=impl: impl)
        for clip in (None, 0.05):
            runs.append(_released(fmt, clip))
    (a, oa), (ac, oac), (b, ob), (bc, obc) = runs
    # every bucket inside backward took the plans (one plan each: one dtype), the end-of-backward flush of both groups
    # the per-tensor norms
    assert len(calls) == 2 * 3 * (ob._release.flushes // 3 - 1) and set(calls) == {1}
    for p, q, r in zip(plain.parameters(), a.parameters(), b.parameters()):
        assert torch.equal(p, q) and torch.equal(p, r)
    torch.testing.assert_close(oa.grad_norm, ob.grad_norm, rtol=1e-6, atol=0)
    assert oac.grad_norm.item() > 0.05  # clipping acted
    torch.testing.assert_close(oac.grad_norm, obc.grad_norm, rtol=1e-6, atol=0)
    sa, sb = oac.state_dict()["gradient_release"], obc.state_dict()["gradient_release"]
    assert len(sa["prev_partial_sumsq"]) == len(sb["prev_partial_sumsq"]) > 2
    torch.testing.assert_close(
        torch.tensor(sa["prev_partial_sumsq"]), torch.tensor(sb["prev_partial_sumsq"]), rtol=1e-6, atol=0
    )
    for p, q in zip(ac.parameters(), bc.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    # the clip there went to the update kernel (its gradient load); multiplying the gradients in place first, as the
    # torch engine does, and handing the kernel no factor gives the same bits
    from apexw_hf.engines.triton.engine import TritonEngine

    step_group = TritonEngine.step_group

    def in_place(self, group, params, grads, states, tensor_indices, bucket=None, grad_scale=None, **kw):
        if callable(grad_scale):
            inner = grad_scale

            def grad_scale(plans):
                coef = inner(plans)
                if coef is not None:
                    for g in grads:
                        g.mul_(coef.to(g.dtype))

        return step_group(self, group, params, grads, states, tensor_indices, bucket, grad_scale, **kw)

    monkeypatch.setattr(TritonEngine, "step_group", in_place)
    model, opt = _released(fmt, 0.05)
    assert torch.equal(opt.grad_norm, obc.grad_norm)
    for p, q in zip(model.parameters(), bc.parameters()):
        assert torch.equal(p, q)
