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


def _quantize_v(v, bits):
    """8-bit ``v`` codes with the scale at the block's absmax: a previous scale at or above it decayed by 1.0 would
    be kept, so a previous scale equal to the absmax gives exactly that (fresh state restarts at twice it)."""
    return ref.quantize_v(v, bits, ref._blocks(v).amax(dim=1), 1.0)


@pytest.mark.parametrize("n", [1, 255, 256, 257, 4097])
def test_8bit_codes_zero_exact_and_within_one_code(n):
    torch.manual_seed(n)
    m = torch.randn(n) * torch.logspace(-6, 0, n)
    m[::7] = 0.0
    v = m * m
    v[1::11] = 1e-30  # tiny but nonzero
    keyed = lambda s: ref.hash_uniform_bits(n, ref.stream_key(3, 0, 5, s), "cpu")
    cm, sm = ref.quantize_m(m, keyed(ref.STREAM_MV))
    cv, sv = ref.quantize_v(v, keyed(ref.STREAM_MV), torch.zeros(ref.num_blocks(n)), 0.999)
    assert cm.dtype == torch.uint8 and cv.dtype == torch.uint8 and cm.shape == m.shape
    assert sm.dtype == torch.bfloat16 and sm.shape == (ref.num_blocks(n),)
    assert sv.dtype == torch.float32 and torch.equal(sv, 2 * ref._blocks(v).amax(dim=1))  # fresh: twice the absmax
    dm, dv = ref.dequantize_m(cm, sm), ref.dequantize_v(cv, sv)
    assert torch.equal(dm[m == 0], m[m == 0]) and (cm[m == 0] == 0).all()
    assert (cv[v > 0] > 0).all(), "a nonzero v must never be stored as zero"
    assert (cm & 127 <= ref.M_CODE_MAX).all() and (cv <= ref.V8_CODE_MAX - 8).all()  # v <= scale / 2: code 240
    assert torch.equal(cm >= 128, m < 0)
    # each element decodes to one of the two code values around it: |error| below one code step there, i.e. 1/8
    # of the value in the normal range, 2**-17 (m) or 2**-33 (v) of the block scale below it (a tiny nonzero v goes
    # up to the smallest code)
    per_elem = lambda s: s.double().repeat_interleave(ref.BLOCK)[:n]
    for d, x, low, s in ((dm, m, 2.0**-17, sm), (dv, v, 2.0**-33, sv)):
        bound = torch.maximum(x.abs().double() * 2.0**-3, per_elem(s) * low) * 1.0001
        assert ((d.double() - x.double()).abs() <= bound).all()


def test_8bit_v_scale_is_an_envelope():
    """The scale decays by exactly beta2 (fp32) while the absmax stays under it, so a v that only decays keeps its
    code; it restarts at twice the absmax when the absmax outgrows it, and NaN wins."""
    beta2 = ref.StepScalars.make(lr=1.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1).beta2
    prev = torch.tensor([1.0, 1.0, 0.0, 3.0, 1.0])
    amax = torch.tensor([0.5, 1.0, 0.25, float("nan"), 0.999])
    vb = torch.zeros(5, ref.BLOCK)
    vb[:, 7] = amax
    s, inv = ref.v8_scale(vb, prev, beta2)
    env = prev * torch.tensor(beta2, dtype=torch.float32)
    assert s[0] == env[0] and s[4] == env[4]  # under (or at) the envelope: kept
    assert s[1] == 2.0 and s[2] == 0.5  # above it, or fresh: twice the absmax
    assert s[3].view(torch.int32) == 0x7FC00000  # the canonical NaN
    torch.manual_seed(0)
    v = torch.rand(2 * ref.BLOCK) * torch.logspace(-24, 0, 2 * ref.BLOCK)
    bits = ref.hash_uniform_bits(v.numel(), 9, "cpu")
    codes, scale = ref.quantize_v(v, bits, torch.zeros(2), 0.0)
    x = ref.dequantize_v(codes, scale) * beta2  # every element decays: none changes its code
    again, scale2 = ref.quantize_v(x, ref.hash_uniform_bits(v.numel(), 10, "cpu"), scale, beta2)
    assert torch.equal(again, codes) and torch.equal(scale2, scale * torch.tensor(beta2))


def test_minifloat_codes_round_trip_and_order():
    for mant, bias, top, nbits in ((ref.M_MANT, ref.BIAS, ref.M_CODE_MAX, 4), (ref.V8_MANT, ref.V8_BIAS, 248, 5)):
        codes = torch.arange(2 ** (nbits + mant))
        vals = ref.minifloat_value(codes, mant, bias)
        assert (vals[1:] > vals[:-1]).all() and vals[0] == 0 and vals[top] == 1.0
        assert vals[1] == 2.0 ** (1 - bias - mant) and vals[2**mant] == 2.0 ** (1 - bias)  # subnormal step, normal
        for word in (0, 0xFFFFFFFF, 0x12345678):  # exact code values never move, whatever the random bits
            w = torch.full(codes.shape, word, dtype=torch.int64)
            m = mant == ref.M_MANT
            shift, nb = (ref.M_RAND_SHIFT, ref.M_RAND_BITS) if m else (ref.V8_RAND_SHIFT, ref.V8_RAND_BITS)
            off = ref._rand_offset(w[: top + 1], shift, nb, 23 - mant)
            got = ref.minifloat_code(vals[: top + 1], off, mant, bias)
            assert torch.equal(got, codes[: top + 1])
    # format version 2's v code (read only): e4m4, 1.0 = 240
    vals = ref.minifloat_value(torch.arange(256), ref.V2_MANT)
    assert vals[ref.V2_CODE_MAX] == 1.0 and vals[1] == 2.0**-18


@pytest.mark.parametrize("moment", ["m", "v"])
def test_8bit_rounding_is_unbiased_across_the_range(moment):
    """Every level between two codes, normal and subnormal: the decoded mean over many random words is the value,
    to half a step of the random bits' resolution (2**-7 of a code for m, 2**-17 for v) plus sampling noise."""
    if moment == "m":
        mant, bias, nbits, q, dq = ref.M_MANT, ref.BIAS, ref.M_RAND_BITS, ref.quantize_m, ref.dequantize_m
    else:
        mant, bias, nbits, q, dq = ref.V8_MANT, ref.V8_BIAS, ref.V8_RAND_BITS, _quantize_v, ref.dequantize_v
    reps = 4096
    # (below the smallest code, v is not unbiased: a nonzero v is never coded 0, so it starts at 1.5 codes)
    lowest = 2.0 ** (1 - bias - mant) * (0.5 if moment == "m" else 1.5)
    sub = 2.0 ** (1 - bias)
    levels = torch.tensor([0.3, 0.7071, sub * 1.37, sub * 0.41, lowest, 1e-3, 2.0**-20 * 1.1])
    x = levels.repeat_interleave(reps)
    x = torch.cat([torch.ones(1), x])  # block scales: 1.0 in the first block, the others hold their own max
    x = torch.cat([x, torch.zeros(-x.numel() % ref.BLOCK)])
    x.view(-1, ref.BLOCK)[:, 0] = 1.0
    bits = ref.hash_uniform_bits(x.numel(), ref.stream_key(0, 0, 1, ref.STREAM_MV), "cpu")
    d = dq(*q(x, bits)).double()
    vals = ref.minifloat_value(torch.arange(2 ** (8 - 1 + (moment == "v"))), mant, bias).double()
    for lv in levels.tolist():
        sel = (x == lv) & (torch.arange(x.numel()) % ref.BLOCK != 0)
        hi = int(torch.searchsorted(vals, torch.tensor(lv, dtype=torch.float64)))
        step = (vals[hi] - vals[hi - 1]).item()
        got = d[sel].mean().item()
        assert len(d[sel].unique()) <= 2
        assert abs(got - lv) <= step * (2.0 ** -(nbits + 1) + 4 * 0.5 / sel.sum().item() ** 0.5), (lv, got)


def test_8bit_v2_codes_still_decode():
    """Format version 2 (read only, for old checkpoints): e4m4 v codes over a bf16 scale."""
    cv = torch.tensor([0, 240, 1, 16, 17, 239], dtype=torch.uint8)
    s = torch.tensor([2.0], dtype=torch.bfloat16)
    want = [0.0, 2.0, 2 * 2.0**-18, 2 * 2.0**-14, 2 * 2.0**-14 * (1 + 1 / 16), 2 * (1 - 1 / 32)]
    assert torch.equal(ref.dequantize_v_v2(cv, s).double(), torch.tensor(want, dtype=torch.float64))


def test_8bit_v1_codes_still_decode():
    """Format version 1 (read only, for old checkpoints): int8 m codes (c/127)**2, uint8 v codes (c/255)**4."""
    cm = torch.tensor([0, 127, -127, 64, -1], dtype=torch.int8)
    cv = torch.tensor([0, 255, 1, 128, 17], dtype=torch.uint8)
    s = torch.tensor([2.0], dtype=torch.bfloat16)
    dm, dv = ref.dequantize_m_v1(cm, s), ref.dequantize_v_v1(cv, s)
    want_m = [0.0, 2.0, -2.0, 2 * (64 * ref.INV127) ** 2, -2 * ref.INV127**2]
    want_v = [0.0, 2.0, 2 * ref.INV255**4, 2 * (128 * ref.INV255) ** 4, 2 * (17 * ref.INV255) ** 4]
    assert torch.allclose(dm.double(), torch.tensor(want_m, dtype=torch.float64), rtol=1e-6, atol=0)
    assert torch.allclose(dv.double(), torch.tensor(want_v, dtype=torch.float64), rtol=1e-6, atol=0)


def test_bf16_params_with_8bit_state_share_the_moments_word():
    """bf16 parameters with 8-bit state round with the top 16 bits of the moments' word (no second hash); other
    combinations keep the parameter's own stream."""
    assert ref.param_stream("8bit", torch.bfloat16) == ref.STREAM_MV
    for fmt, dtype in (("8bit", torch.float16), ("compact", torch.bfloat16), ("fp32", torch.bfloat16)):
        assert ref.param_stream(fmt, dtype) == ref.STREAM_P
    torch.manual_seed(0)
    p = torch.randn(300).to(torch.bfloat16)
    g = torch.randn(300) * 1e-3
    s = ref.StepScalars.make(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    state = {
        "exp_avg": torch.zeros(300, dtype=torch.uint8),
        "exp_avg_sq": torch.zeros(300, dtype=torch.uint8),
        "exp_avg_scale": torch.zeros(2, dtype=torch.bfloat16),
        "exp_avg_sq_scale": torch.zeros(2, dtype=torch.float32),
    }
    out = p.clone()
    ref.adamw_step_ref_(out, g, state, fmt="8bit", scalars=s, seed=5, tensor_index=2, step=1)
    # the same update rounded with the moments' word by hand
    m = g * s.one_minus_beta1
    v = (g * g) * s.one_minus_beta2
    x = p.float() * s.decay - (m / (ref.sqrt_rn(v) * s.inv_bc2_sqrt + s.eps)) * s.step_size
    word = ref.hash_uniform_bits(300, ref.stream_key(5, 2, 1, ref.STREAM_MV), "cpu")
    assert torch.equal(out.view(torch.int16), ref.round_to_bf16_stochastic(x, word).view(torch.int16))
    other = ref.hash_uniform_bits(300, ref.stream_key(5, 2, 1, ref.STREAM_P), "cpu")
    assert not torch.equal(out.view(torch.int16), ref.round_to_bf16_stochastic(x, other).view(torch.int16))


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
