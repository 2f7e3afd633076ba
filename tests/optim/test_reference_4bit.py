"""The 4-bit state format of the specification (``reference.quantize_mv4`` / ``dequantize_mv4``) on its own terms.

What ``reference.py`` promises for ``4bit`` (format version 2): one byte per element (bits 0-3 the ``m`` code: sign
bit 3 and an e3m0 magnitude of bias 7; bits 4-7 the ``v`` code: e4m0 of bias 15), per 128 elements a bf16 ``m`` scale
(absmax rounded up) and an fp32 ``v`` scale (the exact absmax), exactly representable values kept for every random
word, zero kept as code 0, a nonzero ``v`` never coded 0, stochastic rounding that is unbiased to the resolution of
its random bits (6 for ``m``, 16 for ``v``), a decaying block that keeps its codes while its ``v`` scale decays by
exactly ``beta2``, and a ``v`` that keeps decaying at every ``beta2`` even when another element holds its block's
maximum. Format version 1 (``quantize_mv4_v1``) is checked where it is still used: the decay rate of its codes.
Statistical checks state their tolerance from the variance of the rounding they check (5 standard errors), plus the
documented resolution of the random bits where it applies.
"""

import math

import pytest
import torch

from apexw_hf import reference as ref
from apexw_hf.formats import init_state, state_tensor_bytes

from .helpers import lora_3b_shapes

M_VALUES = [0.0] + [2.0 ** (c - 7) for c in range(1, 8)]  # m magnitude codes 0..7
V_VALUES = [0.0] + [2.0 ** (c - 15) for c in range(1, 16)]  # v codes 0..15
# the 4-bit m's random bits (0-5 of the word); version 1's v read the 8-bit v's (0-9)
M_SHIFT, M_NBITS, V_SHIFT, V_NBITS = ref.M4_RAND_SHIFT, ref.M_RAND_BITS, ref.V_RAND_SHIFT, ref.V_RAND_BITS
V4_NBITS = ref.V4_RAND_BITS


def _words(n, seed=0):
    return ref.hash_uniform_bits(n, ref.stream_key(seed, 0, 1, ref.STREAM_MV), "cpu")


def _code_m(y, words):
    return ref.minifloat_code(y, ref._rand_offset(words, M_SHIFT, M_NBITS, 23), 0, ref.M4_BIAS)


def _code_v(y, words):
    return ref.minifloat_code(ref.v4_log_warp(y), ref.v4_rand_offset(words), 0, ref.BIAS)


def _code_v_v1(y, words):
    return ref.minifloat_code(y, ref._rand_offset(words, V_SHIFT, V_NBITS, 23), 0, ref.BIAS)


def test_every_code_decodes_to_its_documented_value():
    assert ref.minifloat_value(torch.arange(8), 0, ref.M4_BIAS).tolist() == M_VALUES
    assert ref.minifloat_value(torch.arange(16), 0, ref.BIAS).tolist() == V_VALUES
    byte = torch.arange(256, dtype=torch.uint8).repeat_interleave(2)  # 4 blocks of 128
    scale_m = torch.tensor([1.0, 0.75, 3.0, 2.0**-100], dtype=torch.bfloat16)
    scale_v = torch.tensor([2.0**-30, 0.999, 5.0, 1.5 * 2.0**-120], dtype=torch.float32)  # fp32, not bf16 values
    m, v = ref.dequantize_mv4(byte, scale_m, scale_v)
    assert m.dtype == v.dtype == torch.float32 and m.shape == v.shape == byte.shape
    c = byte.long()
    block = torch.arange(byte.numel()) // ref.BLOCK4
    mag = torch.tensor(M_VALUES, dtype=torch.float64)[c & 7]
    want_m = torch.where((c & 8) > 0, -mag, mag) * scale_m.double()[block]
    want_v = torch.tensor(V_VALUES, dtype=torch.float64)[c >> 4] * scale_v.double()[block]
    assert torch.equal(m.double(), want_m) and torch.equal(v.double(), want_v)  # exact: powers of two times scales
    assert torch.equal(torch.signbit(m), (c & 8) > 0)  # m code 8 is a negative zero


def test_representable_values_encode_to_themselves_for_every_word():
    """0, 2**-6 .. 1 (m) and 0, 2**-14 .. 1 (v): every low 16-bit word under four top halves (v also reads bits
    16-21), in the codec; then through quantize/dequantize with a block scale, for every m random pattern and every
    pattern of v's ten high random bits."""
    low = torch.arange(1 << 16, dtype=torch.int64)
    for top in (0, 0x3F, 0x2A, 0xFFFF):
        words = low | (top << 16)
        for c, y in enumerate(M_VALUES):
            assert (_code_m(torch.full((1 << 16,), y), words) == c).all(), (c, top)
        for c, y in enumerate(V_VALUES):
            assert (_code_v(torch.full((1 << 16,), y), words) == c).all(), (c, top)
    # one block of 128 per word pattern: 1024 blocks give every m pattern (bits 0-5) and every pattern of v's ten high
    # random bits (12-21), the word's other bits hashed
    i = torch.arange(1024, dtype=torch.int64)
    words = ((i & 63) | (i << 12) | (_words(1024) & 0xFFC00FC0)).repeat_interleave(ref.BLOCK4)
    row_m = torch.tensor(M_VALUES + [-x for x in M_VALUES[1:]] + [1.0] * (128 - 15))
    row_v = torch.tensor(V_VALUES + V_VALUES[1:] + [1.0] * (128 - 31))
    for s in (1.0, 0.375, 2.0**-60, 2.0**100, 0.999):
        m, v = (row.repeat(1024) * s for row in (row_m, row_v))
        mv, sm, sv = ref.quantize_mv4(m, v, words)
        assert torch.equal(sv, torch.full((1024,), s))  # the v scale is the exact absmax, bf16 or not
        if s == 0.999:  # not a bf16 value: m's scale is rounded up, and its codes move; v's do not
            _, dv = ref.dequantize_mv4(mv, sm, sv)
            assert torch.equal(dv, v)
            continue
        assert torch.equal(sm.float(), torch.full((1024,), s))
        dm, dv = ref.dequantize_mv4(mv, sm, sv)
        assert torch.equal(dm, m) and torch.equal(dv, v)


def test_zero_encodes_to_code_0():
    n = 4 * ref.BLOCK4
    words = _words(n, 3)
    for m in (torch.zeros(n), -torch.zeros(n)):  # -0 is not negative: no sign bit
        mv, sm, sv = ref.quantize_mv4(m, torch.zeros(n), words)
        assert (mv == 0).all() and (sm.float() == 0).all() and (sv.float() == 0).all()
    # zeros among nonzero values: both nibbles 0, whatever the word
    x = torch.rand(n) + 0.5
    x[::3] = 0.0
    mv, _, _ = ref.quantize_mv4(x.neg(), x, words)
    assert (mv[x == 0] == 0).all() and (mv[x > 0] & 7 > 0).all() and (mv[x > 0] >> 4 > 0).all()


def test_nonzero_v_never_gets_code_0():
    """However small relative to its block maximum (1e-38 of it, an fp32 subnormal, or a y that underflows to 0)."""
    n = 8 * ref.BLOCK4
    v = torch.tensor([1e-38, 1e-45, 3e-39, 2.0**-15, 2.0**-14 * 0.49, 1e-10, 1e-30]).repeat(-(-n // 7))[:n]
    blocks = v.view(-1, ref.BLOCK4)
    blocks[:, 0] = torch.tensor([1.0, 1.0, 1e38, 3e38, 1.0, 2.0**-100, 1e-30, 1.0])  # the block maxima
    for seed in range(4):
        mv, _, sv = ref.quantize_mv4(torch.zeros(n), v, _words(n, seed))
        assert ((mv >> 4) >= 1).all()
        _, dv = ref.dequantize_mv4(mv, torch.zeros_like(sv), sv)
        assert (dv > 0).all()
        s = sv.float().repeat_interleave(ref.BLOCK4)
        tiny = v < s * 2.0**-15  # always rounded up to the smallest code, 2**-14 of the scale
        assert tiny.sum() > n // 2 and torch.equal(dv[tiny], s[tiny] * 2.0**-14)


def _check_unbiased(values, codes_of, n_rand_bits, exact_levels, reps=1 << 14, warp=lambda y: y):
    """Stochastic rounding of each level of ``exact_levels`` (a multiple of 2**-bits of its code step: the expected
    value is then exact) and of other levels (within half a unit of the random bits' resolution of the step), over
    ``reps`` random words: the mean lies within 5 standard errors of the Bernoulli rounding's variance."""
    vals = torch.tensor(values, dtype=torch.float64)
    for y0, exact in exact_levels:
        words = _words(reps, seed=int(y0 * 2**30) % 1000)
        codes = codes_of(torch.full((reps,), y0, dtype=torch.float32), words)
        y = warp(torch.tensor([y0], dtype=torch.float32)).item()  # the value whose rounding is unbiased
        got = vals[codes]
        hi = int(torch.searchsorted(vals, torch.tensor(y, dtype=torch.float64)))
        lo_v, hi_v = vals[hi - 1].item(), vals[hi].item()
        step = hi_v - lo_v
        assert set(got.unique().tolist()) <= {lo_v, hi_v}
        p = (y - lo_v) / step
        sigma = step * math.sqrt(p * (1 - p))
        bias = 0.0 if exact else step * 2.0 ** -(n_rand_bits + 1)
        assert abs(got.mean().item() - y) <= bias + 5 * sigma / math.sqrt(reps), (y, got.mean().item())


def test_m_rounding_is_unbiased():
    """m, 6 random bits: levels in the normal binades and below 2**-6 (between 0 and the smallest code), and their
    negatives through the full quantize/dequantize."""
    levels = [(2.0**-6 * (1 + 13 / 64), True), (0.5 * (1 + 37 / 64), True), (2.0**-6 * 17 / 64, True)]
    levels += [(0.3, False), (0.7071, False), (2.0**-6 * 0.41, False), (2.0**-8, False), (0.999, False)]
    _check_unbiased(M_VALUES, _code_m, M_NBITS, levels)
    # signed, with a block scale, through the byte
    reps = 1 << 14
    n = reps + ref.BLOCK4
    m = torch.full((n,), -0.3 * 0.75)
    m[:: ref.BLOCK4] = -0.75  # every block's maximum
    mv, sm, sv = ref.quantize_mv4(m, torch.zeros(n), _words(n, 9))
    d = ref.dequantize_mv4(mv, sm, sv)[0].double()
    sel = torch.arange(n) % ref.BLOCK4 != 0
    step, p = 0.25 * 0.75, (0.3 - 0.25) / 0.25
    tol = step * (2.0**-7 + 5 * math.sqrt(p * (1 - p)) / math.sqrt(sel.sum().item()))
    assert abs(d[sel].mean().item() + 0.3 * 0.75) <= tol


def test_v_rounding_is_unbiased_in_the_log_domain():
    """v, 16 random bits, in the log domain: the mean code value is ``v4_log_warp(y)`` (levels in the normal binades;
    below 2**-14 a nonzero v is rounded up to 2**-14, by the zero-point rule), and ``log2`` of the codes averages to
    ``log2(y)`` within the warp's accuracy (0.006 of a binade), where rounding unbiased in ``v`` is off by up
    to 0.086 (at 1.44 of a binade's bottom)."""
    levels = [(0.5 * (1 + 301 / 1024), False), (2.0**-14 * (1 + 5 / 65536), False), (2.0**-9 * 1.999, False)]
    levels += [(0.3, False), (0.7071, False), (2.0**-13 * 1.37, False), (0.999, False), (1e-3, False)]
    levels += [(0.5 * (1 + 0.9999), False), (0.5 * (2 - 3 / 65536), False), (0.25, True), (2.0**-14, True)]
    _check_unbiased(V_VALUES, _code_v, V4_NBITS, levels, warp=ref.v4_log_warp)
    reps = 1 << 14
    for y in (0.3, 0.7071, 2.0**-9 * 1.44, 0.6, 0.999):
        codes = _code_v(torch.full((reps,), y), _words(reps, 3))
        mean_log = torch.tensor(V_VALUES, dtype=torch.float64)[codes].log2().mean().item()
        assert abs(mean_log - math.log2(y)) < 0.012 + 5 * 0.5 / math.sqrt(reps), (y, mean_log)


def test_log_warp_keeps_exponents_codes_and_order():
    """``v4_log_warp``: powers of two, 0 and subnormals' signs stay; the exponent field never changes except where
    the top of a binade rounds up to the next power of two; monotone to one ulp; commutes with powers of two."""
    x = torch.rand(100_000, generator=torch.Generator().manual_seed(0)) * 2.0 ** torch.randint(-140, 1, (100_000,))
    x = torch.cat([x, torch.tensor([0.0, 1.0, 0.5, 2.0**-14, 2.0**-149, 1e-40, 1 - 2**-24, 0.75])]).sort().values
    w = ref.v4_log_warp(x)
    wb = w.view(torch.int32)  # non-negative fp32 values order as their bits, one ulp apart where bits differ by 1
    assert (wb[1:] - wb[:-1] >= -1).all() and (w[x > 0] > 0).all() and w[x == 0].eq(0).all()
    pow2 = torch.tensor([1.0, 0.5, 2.0**-14, 2.0**-126])
    assert torch.equal(ref.v4_log_warp(pow2), pow2)
    normal = (x >= 2.0**-100) & (x < 2.0**-1)
    assert torch.equal(ref.v4_log_warp(x[normal] * 4.0), w[normal] * 4.0)
    nz = x >= 2.0**-126  # fp32 normals (a subnormal's bits are no 1.f mantissa: it only stays positive)
    same_binade = torch.floor(torch.log2(w[nz].double())) == torch.floor(torch.log2(x[nz].double()))
    assert same_binade.float().mean() > 0.9999
    f = x[normal] / 2.0 ** torch.floor(torch.log2(x[normal].double())).float() - 1
    g = w[normal] / 2.0 ** torch.floor(torch.log2(x[normal].double())).float() - 1
    assert ((g - torch.log2(1 + f.double()).float()).abs() < 0.006).all()


def test_log_warp_every_mantissa_against_the_cubic_in_f():
    """Over every mantissa of a binade, the warp as specified (the cubic in ``x = 1 + f``, fused multiply-adds) is
    within 3 ulps of the same cubic evaluated in ``f`` (``A, B, C``, each step rounded once), which is monotone; it
    falls by one ulp, never more, from one mantissa to the next at 421,523 of the 2**23; the probability that the 16
    random bits round it up (``(mantissa + 64) >> 7`` of 2**16 words) falls, by one word, at 3,341 steps only; 1 stays
    1 and the top of the binade reaches 2 at most. The counts are of the specification, so they are exact."""
    x = (torch.arange(1 << 23, dtype=torch.int32) | 0x3F800000).view(torch.float32)  # [1, 2)
    wb = ref.v4_log_warp(x).view(torch.int32).long()

    def fma(a, b, c):  # fp32 a * b + c rounded once (exact in fp64 for these operands)
        return (a.double() * b.double() + c).float()

    f = x - 1.0
    in_f = fma(f, fma(f, fma(f, torch.tensor(ref.V4_LOG_C), ref.V4_LOG_B), ref.V4_LOG_A), 1.0).view(torch.int32).long()
    assert (in_f.diff() >= 0).all()
    assert (wb - in_f).abs().max() <= 3
    steps = wb.diff()
    assert steps.min() == -1 and int((steps < 0).sum()) == 421_523
    assert wb[0] == 0x3F800000 and wb.max() <= 0x40000000
    up = (wb - 0x3F800000 + 64) >> 7  # words of 2**16 that round up (the mantissa plus the offset's half unit)
    assert up.diff().min() == -1 and int((up.diff() < 0).sum()) == 3_341
    words = ref.v4_rand_offset(torch.arange(1 << 16, dtype=torch.int64) << ref.V4_RAND_SHIFT)
    for i in (0, 1, 12_345, (1 << 23) - 1):  # the count against the reference's rounding of y = x / 2, word by word
        y = (x[i] / 2).expand(1 << 16)
        codes = ref.minifloat_code(ref.v4_log_warp(y), words, 0, ref.BIAS)
        assert int((codes == ref.BIAS).sum()) == int(up[i])


def test_byte_layout_and_scales_per_128_elements():
    """m in bits 0-3 (sign bit 3), v in bits 4-7; per 128 elements one bf16 m scale (absmax rounded up) and one fp32
    v scale (the exact absmax), a partial last block with its own; ``exp_avg_mv`` keeps the parameter's shape."""
    shape = (3, 100)  # 300 elements: blocks of 128, 128 and 44
    gen = torch.Generator().manual_seed(0)
    m = torch.randn(shape, generator=gen)
    v = torch.rand(shape, generator=gen)
    m.view(-1)[256 + 7] = -9.0  # the tail block's maximum
    v.view(-1)[256 + 40] = 7.0
    words = _words(300, 4).view(shape)
    mv, sm, sv = ref.quantize_mv4(m, v, words)
    assert mv.dtype == torch.uint8 and mv.shape == shape
    assert sm.dtype == torch.bfloat16 and sv.dtype == torch.float32 and sm.shape == sv.shape == (3,)
    blocks = [m.abs().reshape(-1)[a : a + 128] for a in (0, 128, 256)]
    assert torch.equal(sm, torch.stack([ref.bf16_round_up(b.amax()) for b in blocks]))
    assert torch.equal(sv, torch.stack([v.reshape(-1)[a : a + 128].amax() for a in (0, 128, 256)]))
    assert sm[2].float() == 9.0 and sv[2].float() == 7.0
    # the nibbles are the codes of each moment on its own (the other moment does not change them)
    mv_m, _, _ = ref.quantize_mv4(m, torch.zeros(shape), words)
    mv_v, _, _ = ref.quantize_mv4(torch.zeros(shape), v, words)
    assert torch.equal(mv & 15, mv_m) and torch.equal(mv >> 4, mv_v >> 4) and (mv_v & 15 == 0).all()
    assert torch.equal((mv & 8) > 0, m < 0)
    y = (m.abs().reshape(-1) / sm.float().repeat_interleave(128)[:300]).clamp(max=1.0)
    assert torch.equal((mv_m.reshape(-1) & 7).long(), _code_m(y, words.reshape(-1)))
    # a change in one block changes only that block's scale and bytes
    m2 = m.clone()
    m2.view(-1)[130] = 50.0
    mv2, sm2, _ = ref.quantize_mv4(m2, v, words)
    assert torch.equal(sm2[[0, 2]], sm[[0, 2]]) and sm2[1] == 50.0
    same = torch.ones(300, dtype=torch.bool)
    same[128:256] = False
    assert torch.equal(mv2.reshape(-1)[same], mv.reshape(-1)[same])


def test_bf16_params_with_4bit_state_share_the_moments_word():
    assert ref.param_stream("4bit", torch.bfloat16) == ref.STREAM_MV
    assert ref.param_stream("4bit", torch.float16) == ref.STREAM_P
    assert ref.param_stream("4bit", torch.float32) == ref.STREAM_P


def _step(p, g, state, t, **kw):
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    hp.update(kw)
    s = ref.StepScalars.make(step=t, **hp)
    ref.adamw_step_ref_(p, g, state, fmt="4bit", scalars=s, seed=1, tensor_index=0, step=t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_zero_gradients_from_zero_state_leave_parameters_put(dtype):
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(300, generator=gen).to(dtype)
    p[:3] = torch.tensor([0.0, -0.0, 1e-7])
    start = p.clone()
    state = init_state(p, "4bit")
    for t in range(1, 31):
        _step(p, torch.zeros(300), state, t)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(p.view(bits), start.view(bits))  # bit for bit, signed zeros included
    assert (state["exp_avg_mv"] == 0).all() and (state["exp_avg_scale"].float() == 0).all()
    assert (state["exp_avg_sq_scale"].float() == 0).all()


def _beta2_f32(beta2):
    return ref.StepScalars.make(lr=1e-3, beta1=0.9, beta2=beta2, eps=1e-8, weight_decay=0.0, step=1).beta2


@pytest.mark.parametrize("beta2", [0.99, 0.999, 0.9999, 1 - 2**-20])
def test_a_decaying_block_keeps_its_codes_and_its_scale_decays_exactly(beta2):
    """Zero gradients, v on codes 15 .. 1 in every block: no code ever moves (the update cannot random-walk), and the
    v scale is the fp32 product ``scale * beta2`` of each step, so v decays at every beta2 < 1."""
    n, steps = 4 * ref.BLOCK4, 300
    p = torch.randn(n)
    state = init_state(p, "4bit")
    codes = torch.arange(15, 0, -1).repeat(-(-n // 15))[:n].to(torch.uint8) << 4
    state["exp_avg_mv"].copy_(codes)
    state["exp_avg_sq_scale"].copy_(torch.tensor([1.0, 3e-5, 0.7, 2.0**-90]))
    want = state["exp_avg_sq_scale"].clone()
    b2 = torch.tensor(_beta2_f32(beta2), dtype=torch.float32)
    for t in range(1, steps + 1):
        _step(p, torch.zeros(n), state, t, beta2=beta2)
        want = want * b2
        assert torch.equal(state["exp_avg_mv"], codes) and torch.equal(state["exp_avg_sq_scale"], want), t
    assert (want < state["exp_avg_sq_scale"].new_tensor([1.0, 3e-5, 0.7, 2.0**-90])).all()


@pytest.mark.parametrize("beta2", [0.999, 0.9999])
def test_v_keeps_decaying_when_another_element_holds_the_block_maximum(beta2):
    """Element 0 of each block keeps v = 1 (the block maximum), the others start on code 12 with zero gradients:
    each step each of them stays or halves (one code per binade) with the probability ``p`` that 16 random bits give
    in the log domain, ``p ~ -log2(beta2)``, so ``log2(v)`` decays on average by ``log2(beta2)`` a step, as the exact
    ``v``'s does (within the warp's accuracy; version 1, with 10 bits, did not decay at all at 0.9999). The mean of
    ``log2(v_t / v_0)`` is within 5 standard errors of ``-p * t``."""
    n, steps = 64 * ref.BLOCK4, 1000
    b = _beta2_f32(beta2)
    # the codec reads bits 6-21: every 16-bit pattern there
    words = torch.arange(1 << 16, dtype=torch.int64) << ref.V4_RAND_SHIFT
    p = (_code_v(torch.full((1 << 16,), b * 2.0**-3), words) == 11).double().mean().item()
    assert abs(p + math.log2(b)) < 0.01 * -math.log2(b) + 2.0**-16  # to the resolution of 16 random bits
    v = torch.full((n,), 2.0**-3)
    v[:: ref.BLOCK4] = 1.0
    keep = torch.arange(n) % ref.BLOCK4 == 0
    v0 = v.clone()
    b32 = torch.tensor(b, dtype=torch.float32)
    for t in range(1, steps + 1):
        bits = ref.hash_uniform_bits(n, ref.stream_key(5, 0, t, ref.STREAM_MV), "cpu")
        x = torch.where(keep, v0, v * b32)
        mv, _, sv = ref.quantize_mv4(torch.zeros(n), x, bits)
        v = ref.dequantize_mv4(mv, torch.zeros_like(sv, dtype=torch.bfloat16), sv)[1]
        assert torch.equal(sv, torch.ones_like(sv))
    steps_down = (v0[~keep] / v[~keep]).double().log2()
    se = math.sqrt(steps * p * (1 - p)) / math.sqrt(steps_down.numel())
    assert abs(steps_down.mean().item() - p * steps) <= 5 * se, (steps_down.mean().item(), p * steps)
    assert steps_down.mean().item() > 0.5 * -math.log2(b) * steps


def test_v1_decay_per_step_follows_the_codes():
    """Format version 1: ``v4_decay_per_step`` is the halving probability of its codes (10 random bits), close to
    beta2 at 0.999, a multiple of 2**-11 below 1, and 1 (no decay) from beta2 = 1 - 2**-12 on."""
    for beta2 in (0.99, 0.999, 0.9995, 0.9997, 1 - 2**-12, 0.9999):
        b = float(torch.tensor(beta2, dtype=torch.float32))
        stay = (_code_v_v1(torch.full((1024,), b), torch.arange(1024)) == 15).double().mean().item()
        assert ref.v4_decay_per_step(beta2) == 1 - (1 - stay) / 2
        assert (1 - ref.v4_decay_per_step(beta2)) * 2**11 == round((1 - ref.v4_decay_per_step(beta2)) * 2**11)
    assert abs(ref.v4_decay_per_step(0.999) - 0.999) < 3e-5
    assert ref.v4_decay_per_step(0.99975) == 1 - 2**-11
    assert ref.v4_decay_per_step(1 - 2**-12) == 1.0
    assert ref.v4_decay_per_step(0.9999) == 1.0


def test_state_bytes():
    """1 byte per parameter plus 2 + 4 bytes per block of 128 (and the 4-byte step counter), exactly; the LoRA
    Llama-3.2-3B tensor set (392 tensors) in at most 25.0 MiB."""
    for shape in [(1,), (127,), (128,), (129,), (300,), (33, 65), (16, 3072)]:
        p = torch.empty(shape, device="meta")
        n = p.numel()
        assert state_tensor_bytes(init_state(p, "4bit")) == n + 6 * -(-n // 128) + 4
    shapes = lora_3b_shapes()
    assert len(shapes) == 392
    total = sum(state_tensor_bytes(init_state(torch.empty(s, device="meta"), "4bit")) for s in shapes)
    params = sum(math.prod(s) for s in shapes)
    assert params == 24_313_856
    assert total == params + 6 * params // 128 + 4 * 392  # every LoRA tensor is whole blocks
    assert total / 2**20 <= 25.0
