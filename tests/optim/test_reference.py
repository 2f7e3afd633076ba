"""The building blocks of the reference numerics: random streams, rounding, 8-bit codes."""

import pytest
import torch

from apexw_hf import reference as ref


def test_hash_matches_python_scalar_mix():
    key = ref.stream_key(1234, 7, 99, ref.STREAM_MV)
    bits = ref.hash_uniform_bits(1000, key, "cpu")
    expected = [ref._mix32((i * ref.GOLDEN + key) & ref.MASK32) for i in range(1000)]
    assert bits.tolist() == expected
    assert bits.min() >= 0 and bits.max() < 2**32


def test_streams_differ_and_are_uniform():
    keys = {ref.stream_key(s, t, k, st) for s in (0, 1) for t in (0, 1) for k in (1, 2) for st in (1, 2, 3)}
    assert len(keys) == 24
    u = (ref.hash_uniform_bits(100_000, keys.pop(), "cpu") >> 8).to(torch.float32) * 2.0**-24  # top 24 bits
    assert 0.0 <= u.min() and u.max() < 1.0
    assert abs(u.mean().item() - 0.5) < 0.005
    assert abs(u.var().item() - 1 / 12) < 0.002


def _bits(n, seed=0):
    return ref.hash_uniform_bits(n, ref.stream_key(seed, 0, 1, ref.STREAM_P), "cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stochastic_rounding_is_unbiased_and_brackets(dtype):
    n = 200_000
    x = torch.full((n,), 1.0 + 1.0 / 3.0)
    rounder = ref.round_to_bf16_stochastic if dtype == torch.bfloat16 else ref.round_to_fp16_stochastic
    y = rounder(x, _bits(n))
    assert y.dtype == dtype
    lo, hi = y.float().min().item(), y.float().max().item()
    assert lo <= x[0].item() <= hi and len(y.unique()) == 2  # exactly the two neighbours
    assert abs(y.double().mean().item() - x[0].item()) < (hi - lo) * 0.01


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stochastic_rounding_keeps_representable_and_special_values(dtype):
    vals = torch.tensor([0.0, -0.0, 1.0, -2.5, float("inf"), float("-inf"), 65504.0, 2.0**-14, -(2.0**-20)])
    if dtype == torch.bfloat16:
        vals = torch.cat([vals, torch.tensor([2.0**-130, 3.0e38])])
    vals = vals.to(dtype).float()  # representable in the target dtype
    rounder = ref.round_to_bf16_stochastic if dtype == torch.bfloat16 else ref.round_to_fp16_stochastic
    out = rounder(vals, _bits(vals.numel()))
    assert torch.equal(out.float(), vals)
    assert torch.equal(torch.signbit(out.float()), torch.signbit(vals))
    nan = rounder(torch.tensor([float("nan")]), _bits(1))
    assert torch.isnan(nan).all()


def test_fp16_stochastic_rounding_of_subnormals_is_unbiased():
    n = 100_000
    x = torch.full((n,), 2.5 * 2.0**-24)  # between fp16 subnormals 2*2^-24 and 3*2^-24
    y = ref.round_to_fp16_stochastic(x, _bits(n)).float()
    assert set(y.unique().tolist()) == {2 * 2.0**-24, 3 * 2.0**-24}
    assert abs(y.double().mean().item() / x[0].item() - 1) < 0.01


def test_bf16_round_up():
    x = torch.tensor([0.0, 1.0, 1.0 + 2**-20, 3.0e-40, 1e30, float("inf")])
    up = ref.bf16_round_up(x).float()
    assert (up >= x).all()
    assert up[0] == 0 and up[1] == 1 and up[2] == 1 + 2**-7 and up[-1] == float("inf")
    assert torch.equal(up.to(torch.bfloat16).float(), up)


@pytest.mark.parametrize("n", [1, 255, 256, 257, 4097])
def test_8bit_codes_zero_exact_and_unbiased(n):
    torch.manual_seed(n)
    m = torch.randn(n) * torch.logspace(-6, 0, n)
    m[::7] = 0.0
    v = m * m
    v[1::11] = 1e-30  # tiny but nonzero
    keyed = lambda s: ref.hash_uniform_bits(n, ref.stream_key(3, 0, 5, s), "cpu")
    cm, sm = ref.quantize_m(m, keyed(ref.STREAM_MV))
    cv, sv = ref.quantize_v(v, keyed(ref.STREAM_MV))
    assert cm.dtype == torch.int8 and cv.dtype == torch.uint8 and cm.shape == m.shape
    assert sm.dtype == torch.bfloat16 and sm.shape == (ref.num_blocks(n),)
    dm, dv = ref.dequantize_m(cm, sm), ref.dequantize_v(cv, sv)
    assert torch.equal(dm[m == 0], m[m == 0]) and (cm[m == 0] == 0).all()
    assert (cv[v > 0] > 0).all(), "a nonzero v must never be stored as zero"
    assert (cm.abs() <= 127).all()
    assert (torch.sign(dm) * torch.sign(m) >= 0).all()
    # each element decodes to one of its two neighbouring code values: error below one code step of the block max
    blk_max = lambda x: ref._blocks(x.abs()).amax(1).repeat_interleave(ref.BLOCK)[:n]
    assert ((dm - m).abs() <= blk_max(m) * (2 / 127) + 1e-30).all()
    assert ((dv - v).abs() <= blk_max(v) * (4 / 255) + 1e-30).all()


def test_8bit_rounding_is_unbiased_on_average():
    n = 256 * 400
    m = torch.full((n,), 0.3)
    m[::256] = 1.0  # block max 1.0, so 0.3 falls between two codes
    v = m * m
    bits = lambda s: ref.hash_uniform_bits(n, ref.stream_key(0, 0, 1, s), "cpu")
    dm = ref.dequantize_m(*ref.quantize_m(m, bits(ref.STREAM_MV)))
    dv = ref.dequantize_v(*ref.quantize_v(v, bits(ref.STREAM_MV)))
    sel = m == 0.3
    assert len(dm[sel].unique()) == 2
    assert abs(dm[sel].double().mean().item() / 0.3 - 1) < 2e-3
    assert abs(dv[sel].double().mean().item() / 0.09 - 1) < 2e-3


def test_8bit_nan_scale_stays_in_its_block():
    n = 512
    m = torch.ones(n)
    m[3] = float("nan")
    cm, sm = ref.quantize_m(m, ref.hash_uniform_bits(n, 1, "cpu"))
    dm = ref.dequantize_m(cm, sm)
    assert torch.isnan(dm[:256]).all() and torch.isfinite(dm[256:]).all()


def test_step_scalars_are_fp32_values():
    s = ref.StepScalars.make(lr=2e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=3)
    for value in vars(s).values():
        assert torch.tensor(value, dtype=torch.float32).item() == value
    assert s.decay == torch.tensor(1 - 2e-6, dtype=torch.float32).item()


def test_f32_rounding_matches_the_cast_torch_uses():
    import math

    gen = torch.Generator().manual_seed(0)
    xs = torch.randn(20000, generator=gen, dtype=torch.float64) * torch.logspace(-45, 39, 20000, dtype=torch.float64)
    halfway = [1.0 + 2.0**-24, 1.0 + 3 * 2.0**-24, -(1.0 + 2.0**-24)]  # ties to even, both ways
    edge = [0.0, -0.0, 1e-46, -1e-46, 2.0**-149, 2.0**-150, 3.4028235e38, 3.40282357e38, 3.5e38, -3.5e38, 1e300]
    for x in xs.tolist() + halfway + edge + [math.inf, -math.inf]:
        want = torch.tensor(x, dtype=torch.float64).to(torch.float32).item()
        got = ref._f32(x)
        assert got == want and math.copysign(1, got) == math.copysign(1, want), (x, got, want)
    assert math.isnan(ref._f32(math.nan))
