"""The one-launch AdamW kernel against the plain-PyTorch reference, bit for bit."""

import pytest
import torch

from apexw_hf import reference as ref
from apexw_hf.kernels import adamw_step_
from apexw_hf.optim import state as st

from .helpers import DEVICE, DTYPES, SHAPES, mismatch, same_bits

HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def _run_both(params, grads_per_step, fmt, *, param_rounding="stochastic", maximize=False, seed=3, first_index=5):
    """Step copies of ``params`` with the kernel (one launch per step) and with the reference; compare everything."""
    kp = [p.clone() for p in params]
    rp = [p.clone() for p in params]
    ks = [st.init_state(p, fmt) for p in params]
    rs = [{k: v.clone() for k, v in s.items()} for s in ks]
    indices = [first_index + i for i in range(len(params))]
    for step, grads in enumerate(grads_per_step, start=1):
        scalars = ref.StepScalars.make(step=step, **HP)
        adamw_step_(
            kp,
            grads,
            ks,
            fmt=fmt,
            scalars=scalars,
            seed=seed,
            tensor_indices=indices,
            step=step,
            maximize=maximize,
            param_rounding=param_rounding,
        )
        for p, g, s, i in zip(rp, grads, rs, indices):
            ref.adamw_step_ref_(
                p,
                g,
                s,
                fmt=fmt,
                scalars=scalars,
                seed=seed,
                tensor_index=i,
                step=step,
                maximize=maximize,
                param_rounding=param_rounding,
            )
    for i, (a, b, sa, sb) in enumerate(zip(kp, rp, ks, rs)):
        assert same_bits(a, b), f"param {i} {tuple(a.shape)}: {mismatch(a, b)}"
        for key in sa:
            if key != "step":
                assert same_bits(sa[key], sb[key]), (
                    f"{key} of param {i} {tuple(a.shape)}: {mismatch(sa[key], sb[key])}"
                )


def _randn(shape, dtype, gen, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(DEVICE)


CASES = [(fmt, p, g) for fmt in ("fp32", "compact", "8bit") for p in DTYPES for g in DTYPES if g in ("fp32", p)]


@pytest.mark.parametrize("fmt,pdt,gdt", CASES)
def test_shapes_and_dtypes_bit_exact(fmt, pdt, gdt):
    gen = torch.Generator().manual_seed(0)
    params = [_randn(s, DTYPES[pdt], gen) for s in SHAPES]
    grads = [[_randn(s, DTYPES[gdt], gen, scale=1 + k) for s in SHAPES] for k in range(3)]
    _run_both(params, grads, fmt)


@pytest.mark.parametrize("fmt", ["compact", "8bit"])
@pytest.mark.parametrize("pdt", ["bf16", "fp16"])
def test_nearest_rounding_and_maximize(fmt, pdt):
    gen = torch.Generator().manual_seed(1)
    shapes = [(257,), (33, 65)]
    params = [_randn(s, DTYPES[pdt], gen) for s in shapes]
    grads = [[_randn(s, torch.float32, gen) for s in shapes] for _ in range(2)]
    _run_both(params, grads, fmt, param_rounding="nearest", maximize=True)


def _special_tensors(dtype):
    """Tensors full of edge cases; the NaN/inf ones must not disturb the others (same launch)."""
    f32 = torch.float32
    tiny = torch.finfo(dtype).tiny
    specials = torch.tensor(
        [0.0, -0.0, float("inf"), -float("inf"), float("nan"), tiny / 4, -tiny / 2, 1e-30, 3e38], dtype=f32
    )
    n = 600
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(n, generator=gen)
    with_specials = base.clone()
    with_specials[::67][: len(specials)] = specials[: len(with_specials[::67])]
    huge = base.clone()
    huge[300] = 1e30
    zero_block = base.clone()
    zero_block[256:512] = 0
    subnormal = torch.full((300,), tiny / 8, dtype=f32) * torch.randn(300, generator=gen).sign()
    return [with_specials, huge, zero_block, subnormal, base.clone()]


@pytest.mark.parametrize("fmt", ["fp32", "compact", "8bit"])
@pytest.mark.parametrize("pdt", ["fp32", "bf16", "fp16"])
def test_special_values(fmt, pdt):
    dtype = DTYPES[pdt]
    gen = torch.Generator().manual_seed(3)
    params = [t.to(dtype).to(DEVICE) for t in _special_tensors(dtype)]
    grads = []
    for k in range(3):
        gs = [t.roll(k * 7).to(DEVICE) for t in _special_tensors(dtype)]
        gs[4] = torch.zeros_like(gs[4])  # zero gradient everywhere: must not drift
        gs[2] = _randn(gs[2].shape, torch.float32, gen) * (gs[2] != 0)
        grads.append(gs)
    _run_both(params, grads, fmt)


def test_many_steps_8bit_zero_gradient_exact():
    gen = torch.Generator().manual_seed(4)
    p = _randn((513,), torch.float32, gen)
    grads = [
        [torch.where(torch.arange(513, device=DEVICE) < 256, _randn((513,), torch.float32, gen), 0.0)]
        for _ in range(6)
    ]
    _run_both([p], grads, "8bit")


def test_large_tensor_index_and_seed():
    """Random keys depend on the tensor index and seed exactly as in the reference (high bits included)."""
    gen = torch.Generator().manual_seed(5)
    params = [_randn((300,), torch.bfloat16, gen) for _ in range(2)]
    grads = [[_randn((300,), torch.float32, gen) for _ in range(2)]]
    _run_both(params, grads, "compact", seed=2**32 - 1, first_index=123457)


@pytest.mark.parametrize("fmt", ["compact", "8bit"])
def test_program_lookup_over_many_tensors(fmt):
    """Each program finds its tensor by a search that starts from one table entry per 64 programs: tensors of one,
    none and many chunks, group boundaries falling inside and between tensors, all step exactly as the reference."""
    gen = torch.Generator().manual_seed(6)
    sizes = [256] * 70 + [0, 0] + [256 * 130 + 7] + [1, 0, 300] * 10 + [256 * 64] + [0] + [5]
    params = [_randn((n,), torch.float32, gen) for n in sizes]
    grads = [[_randn((n,), torch.float32, gen) for n in sizes]]
    _run_both(params, grads, fmt)
