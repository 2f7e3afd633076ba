"""Behaviour the formats promise: zero stays zero, v keeps decaying, a non-finite gradient skips its block, state
bytes."""

import warnings

import pytest
import torch

from apexw_hf import ApexW, ApexW4bit, optimizer_state_bytes
from apexw_hf import formats as st
from apexw_hf import reference as ref

from .helpers import FORMATS, lora_3b_shapes

MiB = 2**20


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_gradient_coordinates_only_decay(fmt):
    """Coordinates whose gradient is always 0 share blocks with live ones, and move only by weight decay."""
    n, steps, wd, lr = 1000, 300, 0.1, 1e-2
    p = torch.nn.Parameter(torch.randn(n))
    expected = p.detach().clone()
    dead = torch.zeros(n, dtype=torch.bool)
    dead[::3] = True
    opt = ApexW([p], lr=lr, weight_decay=wd, state_format=fmt)
    decay = ref.StepScalars.make(lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=wd, step=1).decay
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        g = torch.randn(n, generator=gen)
        g[dead] = 0.0
        p.grad = g
        opt.step()
        expected = expected * decay
    assert torch.equal(p.detach()[dead], expected[dead])
    m, v = ref.load_moments(opt.state[p], fmt, p.shape)
    assert (m[dead] == 0).all() and (v[dead] == 0).all()
    assert (v[~dead] > 0).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_second_moment_keeps_decaying_at_beta2_0999(fmt):
    """After the gradient stops, v must shrink by 0.999 per step (round-to-nearest bf16 would freeze it)."""
    n = 4096
    p = torch.nn.Parameter(torch.zeros(n))
    opt = ApexW([p], lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, state_format=fmt)
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        p.grad = torch.randn(n, generator=gen)
        opt.step()
    v0 = ref.load_moments(opt.state[p], fmt, p.shape)[1].double().sum()
    k = 500
    for _ in range(k):
        p.grad = torch.zeros(n)
        opt.step()
    v1 = ref.load_moments(opt.state[p], fmt, p.shape)[1].double().sum()
    assert abs((v1 / v0).item() / 0.999**k - 1) < 0.01


def test_round_to_nearest_bf16_would_freeze_v():
    """Why compact uses stochastic rounding: the premise, checked."""
    v = torch.tensor([1.0], dtype=torch.bfloat16)
    assert torch.equal((v.float() * 0.999).to(torch.bfloat16), v)


@pytest.mark.parametrize("fmt", FORMATS)
def test_nonfinite_gradient_skips_its_blocks_only(fmt):
    """A NaN and an inf in one 256-element block of a tensor: that block keeps its parameter, moments and scales, the
    rest of the tensor and the other tensor are updated as without them; the step is counted."""
    good, bad = torch.nn.Parameter(torch.randn(600)), torch.nn.Parameter(torch.randn(600))
    twin = torch.nn.Parameter(good.detach().clone())
    opt, ref_opt = (
        ApexW([good, bad], state_format=fmt),
        ApexW([twin, torch.nn.Parameter(torch.randn(600))], state_format=fmt),
    )
    for step in range(3):
        g = torch.randn(600)
        good.grad, twin.grad = g.clone(), g.clone()
        bad.grad = torch.randn(600)
        if step == 1:
            bad.grad[5] = float("nan")
            bad.grad[9] = float("inf")
            before = bad.detach().clone(), {k: v.clone() for k, v in opt.state[bad].items()}
        ref_opt.param_groups[0]["params"][1].grad = torch.randn(600)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        ref_opt.step()
        if step == 1:
            assert torch.equal(bad.detach()[:256], before[0][:256])  # the block was not updated
            assert not torch.equal(bad.detach()[256:], before[0][256:])  # the rest was
            for key, value in opt.state[bad].items():
                if key != "step":  # block 0's elements, or its scales (one per 256 or 128 elements)
                    k = 256 if value.numel() == 600 else 256 // ref.BLOCK4 if fmt == "4bit" else 1
                    assert torch.equal(value.reshape(-1)[:k], before[1][key].reshape(-1)[:k]), key
            message = " ".join(str(w.message) for w in caught)
            assert "non-finite gradient" in message and "param group 0, parameter 1" in message
        else:
            assert not [w for w in caught if "non-finite" in str(w.message)]
    assert torch.equal(good, twin)
    for key, value in opt.state[good].items():
        assert torch.equal(value, ref_opt.state[twin][key])
    assert torch.isfinite(bad).all() and all(torch.isfinite(v.float()).all() for v in opt.state[bad].values())
    assert opt.nonfinite_skipped == 1 and ref_opt.nonfinite_skipped == 0


@pytest.mark.parametrize(
    "fmt, expected",
    [
        ("fp32", 24_313_856 * 8 + 392 * 4),
        ("compact", 24_313_856 * 4 + 392 * 4),
        ("8bit", 24_313_856 * 2 + (2 + 4) * (24_313_856 // 256) + 392 * 4),  # bf16 m, fp32 v scales
        ("4bit", 24_313_856 * 1 + (4 + 4) * (24_313_856 // 128) + 392 * 4),  # fp32 m and v scales
    ],
)
def test_state_bytes_on_lora_llama_3b_set(fmt, expected):
    params = [torch.nn.Parameter(torch.empty(s, device="meta")) for s in lora_3b_shapes()]
    assert len(params) == 392 and sum(p.numel() for p in params) == 24_313_856
    opt = ApexW(params, state_format=fmt)
    for p in params:
        opt._init_state(p, opt.param_groups[0])
    assert opt.state_bytes() == expected
    assert opt.state_bytes() == sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())
    mib = opt.state_bytes() / MiB
    if fmt == "compact":
        assert round(mib, 2) == 92.75
    if fmt == "8bit":
        assert round(mib, 2) == 46.92  # format version 3; published ApexW 8bit: 47.101 MiB; bitsandbytes: 47.865
    if fmt == "4bit":
        assert round(mib, 2) == 24.64  # 1.0625 bytes per parameter (format version 3; version 2: 24.28, 1.047)
    if fmt == "fp32":
        assert round(mib, 2) == 185.50


def test_8bit_state_of_tiny_tensors_is_quantized():
    p = torch.nn.Parameter(torch.randn(3))
    s = st.init_state(p, "8bit")
    assert s["exp_avg"].dtype == torch.uint8 and s["exp_avg_scale"].numel() == 1
    assert st.state_tensor_bytes(s) == 4 + 3 + 3 + 2 + 4  # step, codes, bf16 m scale, fp32 v scale


def test_4bit_state_of_tiny_tensors_is_quantized():
    p = torch.nn.Parameter(torch.randn(3))
    s = st.init_state(p, "4bit")
    assert set(s) == {"step", "exp_avg_mv", "exp_avg_scale", "exp_avg_sq_scale"}
    assert s["exp_avg_mv"].dtype == torch.uint8 and s["exp_avg_mv"].shape == (3,) and s["exp_avg_scale"].numel() == 1
    assert st.state_tensor_bytes(s) == 4 + 3 + 4 + 4  # fp32 m and v scales


@pytest.mark.parametrize("shape", [(1,), (127,), (128,), (129,), (33, 65)])
def test_4bit_state_bytes_are_exact(shape):
    """1 byte per element for both moments' codes, two fp32 scales per 128 elements, a 4-byte step: exact, and
    the same through the accounting module that measures every optimizer."""
    p = torch.nn.Parameter(torch.randn(shape))
    opt = ApexW4bit([p])
    opt._init_state(p, opt.param_groups[0])
    n = p.numel()
    expected = n + (4 + 4) * -(-n // 128) + 4
    assert opt.state_bytes() == optimizer_state_bytes(opt) == expected
    assert optimizer_state_bytes(opt, unique=True) == expected
