"""The kernels' 8-bit codes (format version 3) and 4-bit codes against the reference, bit for bit.

Encoding: every code value, its fp32 neighbours, the midpoints between codes, the subnormal/normal boundary (2**-14
for ``m``, 2**-30 for ``v``) and the values around it, the exact thresholds where a random offset carries into the
next code, 0 and -0, NaN and inf blocks, blocks whose scale is subnormal or whose reciprocal overflows, with random
words of all-0 bits, all-1 bits, hashed words and words that set only the bits of one moment; ``v``'s envelope scale
from a previous scale at the absmax (kept: ``y`` is the value itself), from none (a restart at twice the absmax) and
from one above the absmax (kept, decayed by beta2). Decoding: all 256 codes under ordinary and special scales, one
code at a time and four to a word. The 4-bit codes (both moments in one byte, 128-element blocks) get the same
treatment at the end of the module (format version 3: fp32 scales, the exact absmax for ``m`` and the envelope for
``v``; 8 random bits for ``m``, the word's bits 0-7, and 16 for ``v``, bits 8-23, compared with an integer threshold).
"""

import pytest
import torch
import triton
import triton.language as tl

from apexw_hf import reference as ref
from apexw_hf.engines.triton.kernels._quant import (
    dequant_m,
    dequant_m_words,
    dequant_mv4,
    dequant_mv4_words,
    dequant_v,
    dequant_v_words,
    quant_m,
    quant_mv4,
    quant_v,
    row_max_bits,
)

from .helpers import DEVICE, mismatch, same_bits

MANT = {"m": ref.M_MANT, "v": ref.V8_MANT}
BIAS = {"m": ref.BIAS, "v": ref.V8_BIAS}
CODE_MAX = {"m": ref.M_CODE_MAX, "v": ref.V8_CODE_MAX}
RAND = {"m": (ref.M_RAND_SHIFT, ref.M_RAND_BITS), "v": (ref.V8_RAND_SHIFT, ref.V8_RAND_BITS)}
BETA2 = 0.9990000128746033  # fp32 0.999
# v's previous scale: "amax" (kept as it is: beta2 1.0), "none" (zeros: a restart), "above" (1.5 x absmax, decayed)
PREV = ("amax", "none", "above")


@triton.jit
def _encode_kernel(x_ptr, bits_ptr, code_ptr, scale_ptr, prev_ptr, n, beta2, V: tl.constexpr):
    row = tl.program_id(0)
    offs = row * 256 + tl.arange(0, 256)[None, :]
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    bits = tl.load(bits_ptr + offs, mask=mask, other=0).to(tl.uint32, bitcast=True)
    one = (n > 0).to(tl.uint32)
    if V:
        prev = tl.load(prev_ptr + row + tl.arange(0, 1))
        c, s = quant_v(x, row_max_bits(x, mask), bits, one, prev, beta2)
    else:
        c, s = quant_m(x, mask, bits, one)
    tl.store(code_ptr + offs, c, mask=mask)
    tl.store(scale_ptr + row + tl.arange(0, 1), s)


@triton.jit
def _decode_kernel(code_ptr, scale_ptr, out_ptr, V: tl.constexpr, WORDS: tl.constexpr):
    row = tl.program_id(0)
    if V:
        scale = tl.load(scale_ptr.to(tl.pointer_type(tl.float32), bitcast=True) + row + tl.arange(0, 1))
    else:
        scale = tl.load(scale_ptr + row + tl.arange(0, 1)).to(tl.uint16, bitcast=True)
    offs = row * 256 + tl.arange(0, 256)[None, :]
    if WORDS:
        w = tl.load(code_ptr.to(tl.pointer_type(tl.uint32), bitcast=True) + row * 64 + tl.arange(0, 64)[None, :])
        x = dequant_v_words(w, scale) if V else dequant_m_words(w, scale)
    else:
        c = tl.load(code_ptr + offs)
        x = dequant_v(c, scale) if V else dequant_m(c, scale)
    tl.store(out_ptr + offs, x)


def _int32(bits: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) -> int32 tensor with the same bits."""
    return (bits - (bits >= 2**31).long() * 2**32).to(torch.int32)


def _f32_bits(bits) -> torch.Tensor:
    return _int32(torch.as_tensor(bits, dtype=torch.int64)).view(torch.float32)


def _prev(x: torch.Tensor, prev: str) -> tuple[torch.Tensor, float]:
    """v's previous block scales and beta2 for the kind ``prev`` (see PREV)."""
    amax = ref._blocks(x).amax(dim=1)
    if prev == "amax":
        return amax, 1.0
    if prev == "none":
        return torch.zeros_like(amax), BETA2
    return amax * 1.5, BETA2


def _encode(moment: str, x: torch.Tensor, bits: torch.Tensor, prev: str = "amax"):
    n = x.numel()
    nb = ref.num_blocks(n)
    codes = torch.empty(n, dtype=torch.uint8, device=DEVICE)
    scale = torch.empty(nb, dtype=torch.int32 if moment == "v" else torch.int16, device=DEVICE)
    p, beta2 = _prev(x, prev)
    _encode_kernel[(nb,)](
        x.to(DEVICE),
        _int32(bits).to(DEVICE),
        codes,
        scale,
        p.to(DEVICE),
        n,
        beta2,
        V=moment == "v",
        num_warps=1,
        enable_fp_fusion=False,
    )
    return codes.cpu(), scale.cpu().view(torch.float32 if moment == "v" else torch.bfloat16)


def _check_encode(moment: str, x: torch.Tensor, bits: torch.Tensor, prev: str = "amax") -> None:
    if moment == "v":
        want_codes, want_scale = ref.quantize_v(x, bits, *_prev(x, prev))
    else:
        want_codes, want_scale = ref.quantize_m(x, bits)
    codes, scale = _encode(moment, x, bits, prev)
    assert same_bits(scale, want_scale), f"scales: {mismatch(scale, want_scale)}"
    bad = (codes != want_codes).nonzero().flatten()
    assert bad.numel() == 0, (
        f"{bad.numel()} of {x.numel()} codes differ; first at y={x[bad[0]].item()!r} "
        f"(bits {x[bad[0]].view(torch.int32).item() & 0xFFFFFFFF:#010x}), word {bits[bad[0]].item():#010x}: "
        f"kernel {codes[bad[0]].item()}, reference {want_codes[bad[0]].item()}"
    )


def _code_values(moment: str) -> torch.Tensor:
    return ref.minifloat_value(torch.arange(CODE_MAX[moment] + 1), MANT[moment], BIAS[moment])


def _boundary_values(moment: str) -> torch.Tensor:
    """Magnitudes in [0, 1]: the code values, 1 and 2 ulps either side, the midpoints between codes, and the
    subnormal/normal boundary ``b`` with its neighbourhood (ties of y + b included)."""
    c = _code_values(moment)
    zero, one = torch.zeros_like(c), torch.ones_like(c)
    dn1, up1 = torch.nextafter(c, zero), torch.nextafter(c, one)
    dn2, up2 = torch.nextafter(dn1, zero), torch.nextafter(up1, one)
    mid = (c[1:] + c[:-1]) / 2
    e = 1 - BIAS[moment]  # b = 2**e; the ulp of y + b is 2**(e - 23), the smallest code 2**(e - mant)
    b, lo = 2.0**e, 2.0 ** (e - MANT[moment])
    near = torch.tensor(
        [
            b,
            b * (1 - 2**-24),
            b * (1 + 2**-23),
            b - 2.0 ** (e - 24),
            b - 3 * 2.0 ** (e - 24),
            b - 2.0 ** (e - 23),
            2.0 ** (e - 24),
            3 * 2.0 ** (e - 24),
            2.0 ** (e - 23),
            2**-149,
            2**-130,
            2**-127,
            2**-126,
            lo,
            2 * lo,
            lo / 2,
            0.5 * lo,
            1.5 * lo,
            0.0,
            1.0,
        ],
        dtype=torch.float32,
    )
    near = torch.cat(
        [near, torch.nextafter(near, zero[:1].expand_as(near)), torch.nextafter(near, one[:1].expand_as(near))]
    )
    vals = torch.cat([c, dn1, up1, dn2, up2, mid, near])
    return vals[(vals >= 0) & (vals <= 1)]


def _blocks_led_by_one(vals: torch.Tensor, signs: bool) -> torch.Tensor:
    """Blocks of 255 values, each led by 1.0: the scale is 1 and ``y`` is the value itself. With ``signs`` every
    other value is negated (and 0 becomes -0 there)."""
    if signs:
        vals = vals.clone()
        vals[1::2] = -vals[1::2]
    return torch.cat([torch.cat([torch.ones(1), b]) for b in vals.split(255)])


def _words(n: int, kind: str, moment: str) -> torch.Tensor:
    shift, nbits = RAND[moment]
    if kind == "zeros":
        return torch.zeros(n, dtype=torch.int64)
    if kind == "ones":
        return torch.full((n,), 0xFFFFFFFF, dtype=torch.int64)
    if kind == "own_bits":  # only this moment's random bits set, all of them
        return torch.full((n,), ((1 << nbits) - 1) << shift, dtype=torch.int64)
    if kind == "other_bits":  # every bit but this moment's
        return torch.full((n,), 0xFFFFFFFF ^ (((1 << nbits) - 1) << shift), dtype=torch.int64)
    return ref.hash_uniform_bits(n, ref.stream_key(11, 2, 7, ref.STREAM_MV), "cpu")


@pytest.mark.parametrize("words", ["zeros", "ones", "own_bits", "other_bits", "hashed"])
@pytest.mark.parametrize("moment", ["m", "v"])
def test_code_boundaries(moment, words):
    x = _blocks_led_by_one(_boundary_values(moment), signs=moment == "m")
    _check_encode(moment, x, _words(x.numel(), words, moment))


@pytest.mark.parametrize("prev", PREV[1:])
def test_v_envelope_scale(prev):
    """v's scale restarts at twice the absmax from a zero scale, and keeps a previous one above the absmax decayed
    by beta2 (codes and scales bit for bit, over the boundary values and hashed words)."""
    x = _blocks_led_by_one(_boundary_values("v"), signs=False)
    _check_encode("v", x, _words(x.numel(), "hashed", "v"), prev)


@pytest.mark.parametrize("moment", ["m", "v"])
def test_every_code_is_exact(moment):
    """Exactly representable values keep their code whatever the random bits (here all 0 and all 1)."""
    c = _code_values(moment)
    x = _blocks_led_by_one(c, signs=False)
    for kind in ("zeros", "ones"):
        codes, _ = _encode(moment, x, _words(x.numel(), kind, moment))
        got = torch.cat([b[1:] for b in codes.split(256)])[: c.numel()]
        assert torch.equal(got.long(), torch.arange(c.numel())), f"{moment}, words {kind}"


@pytest.mark.parametrize("moment", ["m", "v"])
def test_rounding_thresholds(moment):
    """For each code step and several random values ``r``: the value whose dropped bits plus the offset reach the
    next code exactly, and its neighbours one fp32 ulp either side (the word carries exactly those random bits)."""
    mant = MANT[moment]
    drop = 23 - mant
    shift, nbits = RAND[moment]
    ys, ws = [], []
    base = _code_values(moment)[1 << mant : CODE_MAX[moment]]  # normal codes below 1.0
    for r in (0, 1, (1 << (nbits - 1)) - 1, 1 << (nbits - 1), (1 << nbits) - 2, (1 << nbits) - 1):
        offset = (r << (drop - nbits)) | (1 << (drop - nbits - 1))
        for delta in (-1, 0, 1):
            bits = base.view(torch.int32).long() + ((1 << drop) - offset) + delta
            ys.append(_f32_bits(bits))
            ws.append(torch.full((base.numel(),), r << shift, dtype=torch.int64))
    y, w = torch.cat(ys), torch.cat(ws)
    x = _blocks_led_by_one(y, signs=moment == "m")
    bits = torch.cat([torch.cat([torch.zeros(1, dtype=torch.int64), b]) for b in w.split(255)])
    _check_encode(moment, x, bits)
    # and the thresholds do decide: the three values around each threshold do not all get the same code
    codes, _ = _encode(moment, x, bits)
    assert codes.unique().numel() > base.numel()


def _special_blocks(moment: str) -> torch.Tensor:
    """Blocks whose scale is special, and a tail that is not a whole block (v: the magnitudes, v is never negative)."""
    gen = torch.Generator().manual_seed(0)
    blocks = []

    def block(*lead, scale=1.0):
        b = torch.rand(256, generator=gen) * scale
        if moment == "m":
            b = b * torch.randn(256, generator=gen).sign()
        for i, x in enumerate(lead):
            b[i] = x if moment == "m" or x != x else abs(x)  # v >= 0 (or NaN)
        blocks.append(b)

    nan, inf = float("nan"), float("inf")
    block(nan, -0.0, 0.0, 1e-30, 2.0**-149)  # NaN scale
    block(-nan if moment == "m" else _f32_bits(0xFFC00000).item(), 5.0)  # a NaN with its sign bit set
    block(_f32_bits(0x7FFFFFFF).item(), 5.0)  # the NaN of CUDA arithmetic (rounding its bits up would overflow)
    block(inf, 0.0, 3e38, -1.0, 2.0**-149)  # inf scale: inv 0, inf * 0 is NaN -> 0
    block(3.3e38, 2.0, 1e-38)  # absmax rounds up to inf in bf16
    block(3.0, 1.0, 2.0, 3.0 * (1 - 2**-24))  # inexact reciprocal: 3 * RN(1/3) may exceed 1
    block(1.0001, 1.0, 0.5)  # absmax rounded up to bf16
    block(2.0**-140, 0.0, 2.0**-149, scale=2.0**-141)  # subnormal bf16 scale: 1/scale overflows to inf
    block(2.0**-127, 0.0, 2.0**-149, 2.0**-140, scale=2.0**-128)  # subnormal scale with a finite reciprocal
    block(2.0**126, 2.0**100, scale=2.0**100)  # reciprocal subnormal
    block(0.0, scale=0.0)  # all zeros: scale 0, reciprocal 0
    if moment == "m":
        block(-0.0, -1e-30, -(2.0**-149), 0.0, 1e-30, scale=0.0)  # signed zeros and tiny negatives
        block(-1.0, -(2.0**-18), -(2.0**-19), 2.0**-19, -0.0)
    tail = torch.rand(77, generator=gen)
    return torch.cat(blocks + [tail * (torch.randn(77, generator=gen).sign() if moment == "m" else 1)])


@pytest.mark.parametrize("words", ["zeros", "ones", "hashed"])
@pytest.mark.parametrize("moment", ["m", "v"])
def test_special_blocks_and_tail(moment, words):
    x = _special_blocks(moment)
    assert x.numel() % 256 != 0
    for prev in PREV if moment == "v" else PREV[:1]:
        _check_encode(moment, x, _words(x.numel(), words, moment), prev)


SCALES = [1.0, 3.0, 0.0, 2.0**-133, 2.0**-126, 1e-30, 3.3e38, float("inf"), float("nan"), 2.0**100]


@pytest.mark.parametrize("words", [False, True], ids=["bytes", "words"])
@pytest.mark.parametrize("moment", ["m", "v"])
def test_decode_every_code(moment, words):
    gen = torch.Generator().manual_seed(1)
    codes = torch.stack([torch.randperm(256, generator=gen) for _ in SCALES]).to(torch.uint8).reshape(-1)
    scale = torch.tensor(SCALES, dtype=torch.float32)
    scale = scale if moment == "v" else scale.to(torch.bfloat16)  # v: fp32 scales (format version 3)
    want = (ref.dequantize_v if moment == "v" else ref.dequantize_m)(codes, scale)
    out = torch.empty(codes.numel(), dtype=torch.float32, device=DEVICE)
    _decode_kernel[(len(SCALES),)](
        codes.to(DEVICE),
        scale.view(torch.int32 if moment == "v" else torch.int16).to(DEVICE),
        out,
        V=moment == "v",
        WORDS=words,
        num_warps=1,
        enable_fp_fusion=False,
    )
    assert same_bits(out.cpu(), want), mismatch(out.cpu(), want)
    # the decoded values of scale 1 are the code values (signed for m): a wrong decoder cannot match by accident
    one = want[:256]
    c = codes[:256].long()
    mag = ref.minifloat_value(c & 127 if moment == "m" else c, MANT[moment], BIAS[moment])
    assert torch.equal(one.abs(), mag) and torch.unique(one).numel() >= 240


# ---- 4-bit (format version 3): sign + e3m0 m (bias 7) and two-binade v codes in one byte, 128-element blocks -------

# the word's bits that round a 4-bit m (0-7) and v (8-23)
WORD_MASK4 = {
    "m": ((1 << ref.M4V3_RAND_BITS) - 1) << ref.M4_RAND_SHIFT,
    "v": ((1 << ref.V4V3_RAND_BITS) - 1) << ref.V4V3_RAND_SHIFT,
}
CODE_MAX4 = {"m": ref.M4_CODE_MAX, "v": ref.V4_CODE_MAX}


def _words4(n: int, kind: str, moment: str) -> torch.Tensor:
    """``_words`` for the 4-bit codes, whose m reads the word's bits 0-7 and v its bits 8-23."""
    if kind == "own_bits":
        return torch.full((n,), WORD_MASK4[moment], dtype=torch.int64)
    if kind == "other_bits":
        return torch.full((n,), 0xFFFFFFFF ^ WORD_MASK4[moment], dtype=torch.int64)
    return _words(n, kind, moment)


def _prev4(v: torch.Tensor, prev: str) -> tuple[torch.Tensor, float]:
    """v's previous 4-bit block scales and beta2 for the kind ``prev`` (see PREV): "amax" keeps a scale of the
    absmax itself (``y`` is then ``v / absmax``), "none" restarts at 4x the absmax, "above" keeps 1.5x it decayed."""
    amax = ref._blocks(v, ref.BLOCK4).amax(dim=1)
    if prev == "amax":
        return amax, 1.0
    if prev == "none":
        return torch.zeros_like(amax), BETA2
    return amax * 1.5, BETA2


@triton.jit
def _encode4_kernel(m_ptr, v_ptr, bits_ptr, code_ptr, ms_ptr, vs_ptr, prev_ptr, n, beta2, EVEN: tl.constexpr):
    row = tl.program_id(0)
    offs = row * 256 + tl.arange(0, 256)[None, :]
    mask = offs < n
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    bits = tl.load(bits_ptr + offs, mask=mask, other=0).to(tl.uint32, bitcast=True)
    one = (n > 0).to(tl.uint32)
    blk = row * 2 + tl.arange(0, 2)
    prev = tl.load(prev_ptr + blk, mask=blk * 128 < n, other=0.0)
    vmax = row_max_bits(tl.reshape(v, (2, 128)), tl.reshape(mask, (2, 128)))
    c, sm, sv = quant_mv4(m, v, vmax, mask, bits, one, prev, beta2, EVEN)
    tl.store(code_ptr + offs, c, mask=mask)
    tl.store(ms_ptr + blk, sm, mask=blk * 128 < n)
    tl.store(vs_ptr + blk, sv, mask=blk * 128 < n)


@triton.jit
def _decode4_kernel(code_ptr, ms_ptr, vs_ptr, m_ptr, v_ptr, WORDS: tl.constexpr):
    row = tl.program_id(0)
    blk = row * 2 + tl.arange(0, 2)
    ms = tl.load(ms_ptr + blk).to(tl.float32, bitcast=True)  # fp32 scales (format version 3), int32 bits
    vs = tl.load(vs_ptr + blk).to(tl.float32, bitcast=True)
    offs = row * 256 + tl.arange(0, 256)[None, :]
    if WORDS:
        w = tl.load(code_ptr.to(tl.pointer_type(tl.uint32), bitcast=True) + row * 64 + tl.arange(0, 64)[None, :])
        m, v = dequant_mv4_words(w, ms, vs)
    else:
        m, v = dequant_mv4(tl.load(code_ptr + offs), ms, vs)
    tl.store(m_ptr + offs, m)
    tl.store(v_ptr + offs, v)


def _encode4(m, v, bits, prev: str = "amax", even: bool = False):
    n = m.numel()
    assert v.numel() == n and (n % 256 == 0 or not even)
    codes = torch.empty(n, dtype=torch.uint8, device=DEVICE)
    nb = ref.num_blocks(n, ref.BLOCK4)
    ms = torch.empty(nb, dtype=torch.int32, device=DEVICE)
    vs = torch.empty(nb, dtype=torch.int32, device=DEVICE)
    p, beta2 = _prev4(v, prev)
    _encode4_kernel[(ref.num_blocks(n),)](
        m.to(DEVICE),
        v.to(DEVICE),
        _int32(bits).to(DEVICE),
        codes,
        ms,
        vs,
        p.to(DEVICE),
        n,
        beta2,
        EVEN=even,
        num_warps=1,
        enable_fp_fusion=False,
    )
    return codes.cpu(), ms.cpu().view(torch.float32), vs.cpu().view(torch.float32)


def _check_encode4(m, v, bits, prev: str = "amax", even: bool = False) -> None:
    want, want_ms, want_vs = ref.quantize_mv4(m, v, bits, *_prev4(v, prev))
    codes, ms, vs = _encode4(m, v, bits, prev, even)
    assert same_bits(ms, want_ms), f"m scales: {mismatch(ms, want_ms)}"
    assert same_bits(vs, want_vs), f"v scales: {mismatch(vs, want_vs)}"
    bad = (codes != want).nonzero().flatten()
    if bad.numel():
        i = bad[0].item()
        raise AssertionError(
            f"{bad.numel()} of {m.numel()} bytes differ; first at m={m[i].item()!r} v={v[i].item()!r}, word "
            f"{bits[i].item():#010x}: kernel {codes[i].item():#04x}, reference {want[i].item():#04x}"
        )


def _code_values4(moment: str) -> torch.Tensor:
    c = torch.arange(CODE_MAX4[moment] + 1)
    return ref.minifloat_value(c, 0, ref.M4_BIAS) if moment == "m" else ref.v4_value(c)


def _boundary_values4(moment: str) -> torch.Tensor:
    """Magnitudes in [0, 1]: the code values, 1 and 2 ulps either side, the midpoints between codes, for ``v`` the
    binade boundary inside each code's interval (where ``q`` jumps from ``2**23 - 1`` to ``2**23``), for ``m`` its
    subnormal/normal boundary 2**-6 and ties of ``y + 2**-6``, and tiny values (a nonzero v must not get code 0)."""
    c = _code_values4(moment)
    zero, one = torch.zeros_like(c), torch.ones_like(c)
    dn1, up1 = torch.nextafter(c, zero), torch.nextafter(c, one)
    dn2, up2 = torch.nextafter(dn1, zero), torch.nextafter(up1, one)
    mid = (c[1:] + c[:-1]) / 2
    if moment == "m":
        b = 2.0**-6
        ulp = b * 2.0**-23  # of y + b
        extra = [b, b / 2, b / 4, b * 0.75, b - ulp, b - ulp / 2, b - 3 * ulp / 2, ulp, ulp / 2, 3 * ulp / 2, ulp / 4]
    else:
        extra = [2.0 ** (2 * k - 29) for k in range(15)] + [2.0**-28 * 0.75, 2.0**-29, 2.0**-40]
    near = torch.tensor(extra + [2.0**-149, 2.0**-130, 2.0**-127, 2.0**-126, 0.0, 1.0], dtype=torch.float32)
    near = torch.cat(
        [near, torch.nextafter(near, zero[:1].expand_as(near)), torch.nextafter(near, one[:1].expand_as(near))]
    )
    vals = torch.cat([c, dn1, up1, dn2, up2, mid, near])
    return vals[(vals >= 0) & (vals <= 1)]


def _blocks4_led_by_one(vals: torch.Tensor, signs: bool) -> torch.Tensor:
    """128-element blocks of 127 values, each led by 1.0 (m scale 1, and v scale 1 with the "amax" previous scale:
    ``y`` the value itself); with ``signs`` every other value is negated (0 becomes -0 there)."""
    if signs:
        vals = vals.clone()
        vals[1::2] = -vals[1::2]
    return torch.cat([torch.cat([torch.ones(1), b]) for b in vals.split(127)])


def _other_moment(moment: str, n: int) -> torch.Tensor:
    """Ordinary values for the moment not under test (v >= 0)."""
    x = torch.rand(n, generator=torch.Generator().manual_seed(n))
    return x if moment == "m" else x * torch.randn(n, generator=torch.Generator().manual_seed(n + 1)).sign()


def _both(moment: str, x: torch.Tensor):
    """(m, v) with ``x`` as the moment under test."""
    y = _other_moment(moment, x.numel())
    return (x, y) if moment == "m" else (y, x)


@pytest.mark.parametrize("words", ["zeros", "ones", "own_bits", "other_bits", "hashed"])
@pytest.mark.parametrize("moment", ["m", "v"])
def test_4bit_code_boundaries(moment, words):
    x = _blocks4_led_by_one(_boundary_values4(moment), signs=moment == "m")
    _check_encode4(*_both(moment, x), _words4(x.numel(), words, moment))
    # the same under a block scale that is not a power of two, and for v under each kind of previous scale
    m, v = _both(moment, x * 0.999)
    for prev in PREV if moment == "v" else PREV[:1]:
        _check_encode4(m, v, _words4(x.numel(), words, moment), prev)


@pytest.mark.parametrize("moment", ["m", "v"])
def test_4bit_every_code_is_exact(moment):
    """Exactly representable values keep their code whatever the random bits (all 0 and all 1). For ``m`` every
    element's ``v`` is the same (so is its ``v`` code, and ``m``'s unit ``2**(cv - 15)`` with it): ``m`` is coded
    relative to its own ``v`` code."""
    c = _code_values4(moment)
    x = _blocks4_led_by_one(c, signs=False)
    x = torch.cat([x, torch.zeros(256 - x.numel())])
    m, v = (x, torch.ones_like(x)) if moment == "m" else _both(moment, x)
    shift = 0 if moment == "m" else 4
    for kind in ("zeros", "ones"):
        codes, _, _ = _encode4(m, v, _words4(x.numel(), kind, moment))
        got = (codes[1 : c.numel() + 1].long() >> shift) & 15
        assert torch.equal(got, torch.arange(c.numel())), f"{moment}, words {kind}"
        _check_encode4(m, v, _words4(x.numel(), kind, moment), even=True)


def _v4_threshold(r: int) -> int:
    """The least position ``q`` (``reference.v4_code``) at which the random value ``r`` rounds a v code up."""
    unit, lo, hi = (2 * r + 1) * (9 << (52 - ref.V4V3_RAND_BITS)), 0, ref.V4_Q
    while lo < hi:  # q * (a Q - (a - 128) q) increases with q below Q
        mid = (lo + hi) // 2
        if unit < mid * (ref.V4_ROUND_A * ref.V4_Q - (ref.V4_ROUND_A - 128) * mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _v4_of_q(k: int, q: int) -> float | None:
    """The fp32 ``y`` in code interval ``k`` (lower code ``k + 1``) at position ``q``, None where none has it (an odd
    ``q`` in the interval's upper binade)."""
    if q < 1 << 23:
        return _f32_bits(((ref.V4_EXP_MIN + 2 * k) << 23) | q).item()
    if (q - (1 << 23)) % 2:
        return None
    return _f32_bits(((ref.V4_EXP_MIN + 2 * k + 1) << 23) | ((q - (1 << 23)) // 2)).item()


@pytest.mark.parametrize("moment", ["m", "v"])
def test_4bit_rounding_thresholds(moment):
    """For several random values ``r``: the values where the code turns from rounding down to rounding up, and their
    neighbours one ulp either side (the word carries exactly those random bits). ``m``: where the dropped bits plus
    the offset reach the next code, in the normal range and below the subnormal boundary; ``v``: the least position
    ``q`` that passes ``reference.v4_code``'s threshold, in every code interval."""
    nbits = ref.M4V3_RAND_BITS if moment == "m" else ref.V4V3_RAND_BITS
    shift = ref.M4_RAND_SHIFT if moment == "m" else ref.V4V3_RAND_SHIFT
    ys, ws = [], []
    for r in (0, 1, 77, (1 << (nbits - 1)) - 1, 1 << (nbits - 1), (1 << nbits) - 2, (1 << nbits) - 1):
        if moment == "m":
            base = _code_values4("m")[1 : CODE_MAX4["m"]]  # normal codes below 1.0
            ulp = 2.0**-6 * 2.0**-23
            offset = (r << (23 - nbits)) | (1 << (22 - nbits))
            y = []
            for delta in (-1, 0, 1):
                y.append(_f32_bits(base.view(torch.int32).long() + ((1 << 23) - offset) + delta))
                y.append(torch.tensor([((1 << 23) - offset + delta) * ulp], dtype=torch.float32))
            y = torch.cat(y)
        else:
            q0 = _v4_threshold(r)
            y = [_v4_of_q(k, q) for k in range(15) for q in (q0 - 2, q0 - 1, q0, q0 + 1, q0 + 2) if 0 <= q < ref.V4_Q]
            y = torch.tensor([x for x in y if x is not None and x <= 1.0], dtype=torch.float32)
        ys.append(y)
        ws.append(torch.full((y.numel(),), r << shift, dtype=torch.int64))
    y, w = torch.cat(ys), torch.cat(ws)
    x = _blocks4_led_by_one(y, signs=moment == "m")
    bits = torch.cat([torch.cat([torch.zeros(1, dtype=torch.int64), b]) for b in w.split(127)])
    _check_encode4(*_both(moment, x), bits)
    codes, _, _ = _encode4(*_both(moment, x), bits)
    assert codes.unique().numel() > 14  # the thresholds do decide


def _v4_up(q: int, r: int) -> bool:
    """``reference.v4_code``'s rounding decision at position ``q`` with the random value ``r``, in Python integers."""
    a, big_q = ref.V4_ROUND_A, ref.V4_Q
    return (2 * r + 1) * (9 << (52 - ref.V4V3_RAND_BITS)) < q * (a * big_q - (a - 128) * q)


def test_4bit_v_threshold_edges_of_the_32_bit_words():
    """The kernel compares ``q * t`` (below 2**58) with the random side in 32-bit words: ``t - 2**32`` either sign
    (it changes at q = 15314982), positions up to the interval's top (3 * 2**23), a product that equals the random
    side exactly (q = 3 * 2**18, r = 3737: rounds down, the reference's comparison being strict) or exceeds it by less
    than 2**32 (equal high words), each with the random values either side of the decision, in several code
    intervals."""
    qb = 199 * 2**23 // 109
    cases = [(3 * 2**18, r) for r in (3736, 3737, 3738)]
    assert 3 * 2**18 * (237 * 3 * 2**23 - 109 * 3 * 2**18) == (2 * 3737 + 1) * 9 * 2**36  # the exact tie
    for q in [*range(qb - 3, qb + 4), 3 * 2**23 - 2, 3 * 2**23 - 1]:
        n = next((r for r in range(1 << 16) if not _v4_up(q, r)), 1 << 16)  # r < n rounds up
        cases += [(q, r) for r in (n - 2, n - 1, n, n + 1) if r < 1 << 16]
    # products less than 2**32 above the random side: the high words are equal, the low word decides
    close = []
    for q in range(5 << 20, 24 << 20, 9973):
        p = q * (ref.V4_ROUND_A * ref.V4_Q - (ref.V4_ROUND_A - 128) * q)
        r = (p // (9 << 36) - 1) // 2  # the largest r with (2 r + 1) * 9 * 2**36 <= p
        if 0 <= r < 1 << 16 and 0 < p - (2 * r + 1) * (9 << 36) < 2**32:
            close += [(q, r), (q, r + 1)]
    assert len(close) >= 8
    cases += close
    assert {_v4_up(q, r) for q, r in cases} == {True, False}
    ys, ws = [], []
    for k in (0, 7, 13):
        for q, r in cases:
            y = _v4_of_q(k, q)
            if y is not None:
                ys.append(y)
                ws.append(r << ref.V4V3_RAND_SHIFT)
    y = torch.tensor(ys, dtype=torch.float32)
    x = _blocks4_led_by_one(y, signs=False)
    w = torch.tensor(ws, dtype=torch.int64)
    bits = torch.cat([torch.cat([torch.zeros(1, dtype=torch.int64), b]) for b in w.split(127)])
    _check_encode4(*_both("v", x), bits)


def test_4bit_v_rounding_probability():
    """Over all 2**16 random values, ``v`` in a code's interval rounds up with probability ``A u + (1 - A) u**2`` to
    within 2**-16 (``reference.v4_code``), at both binades of the interval."""
    r = torch.arange(1 << 16, dtype=torch.int64) << ref.V4V3_RAND_SHIFT
    a = ref.V4_ROUND_A / 128
    for t in (1.0, 1.25, 1.9, 2.0, 3.0, 3.999):  # y = t * 2**-10: interval [2**-10, 2**-8), lower code 10
        y = torch.full((r.numel(),), t * 2.0**-10)
        p = (ref.v4_code(y, r) == 11).double().mean().item()
        u = (t - 1) / 3
        assert abs(p - (a * u + (1 - a) * u * u)) <= 2.0**-16, t
    x = _blocks4_led_by_one(torch.full((127 * 4,), 1.37 * 2.0**-10), signs=False)
    _check_encode4(*_both("v", x), _words4(x.numel(), "hashed", "v"))


def _special_blocks4(moment: str) -> torch.Tensor:
    """128-element blocks whose scale is special (as for 8 bits), then a tail."""
    gen = torch.Generator().manual_seed(0)
    blocks = []

    def block(*lead, scale=1.0):
        b = torch.rand(128, generator=gen) * scale
        if moment == "m":
            b = b * torch.randn(128, generator=gen).sign()
        for i, x in enumerate(lead):
            b[i] = x if moment == "m" or x != x else abs(x)
        blocks.append(b)

    nan, inf = float("nan"), float("inf")
    block(nan, -0.0, 0.0, 1e-30, 2.0**-149)
    block(-nan if moment == "m" else _f32_bits(0xFFC00000).item(), 5.0)
    block(_f32_bits(0x7FFFFFFF).item(), 5.0)
    block(inf, 0.0, 3e38, -1.0, 2.0**-149)
    block(3.3e38, 2.0, 1e-38)
    block(3.0, 1.0, 2.0, 3.0 * (1 - 2**-24))
    block(1.0001, 1.0, 0.5)
    block(2.0**-140, 0.0, 2.0**-149, scale=2.0**-141)
    block(2.0**-127, 0.0, 2.0**-149, 2.0**-140, scale=2.0**-128)
    block(2.0**126, 2.0**100, scale=2.0**100)
    block(2.0**122, 2.0**121, 1.0, scale=2.0**120)  # m decodes past 2**120 (the fp16 path's factor 256)
    block(0.0, scale=0.0)
    if moment == "m":
        block(-0.0, -1e-30, -(2.0**-149), 0.0, 1e-30, scale=0.0)
        block(-1.0, -(2.0**-6), -(2.0**-7), 2.0**-7, -0.0)
    else:
        block(1.0, 2.0**-28, 2.0**-29, 2.0**-40, 2.0**-149)  # nonzero v far below the smallest code
        block(1e30, 1e-20, 2.0**-149)  # v / scale underflows to 0: still code 1
    return torch.cat(blocks)


@pytest.mark.parametrize("tail", [0, 77, 128, 128 + 77], ids=["none", "77", "128", "205"])
@pytest.mark.parametrize("words", ["zeros", "ones", "hashed"])
@pytest.mark.parametrize("moment", ["m", "v"])
def test_4bit_special_blocks_and_tail(moment, words, tail):
    """Special scales, and a tail that ends inside a row's first block, at its end (the row's second block empty)
    or inside its second block; v under each kind of previous scale."""
    x = _special_blocks4(moment)
    x = torch.cat([x, x[: 256 - x.numel() % 256]]) if x.numel() % 256 else x  # whole rows, then the tail
    gen = torch.Generator().manual_seed(tail)
    x = torch.cat(
        [x, torch.rand(tail, generator=gen) * (torch.randn(tail, generator=gen).sign() if moment == "m" else 1)]
    )
    for prev in PREV if moment == "v" else PREV[:1]:
        _check_encode4(*_both(moment, x), _words4(x.numel(), words, moment), prev, even=tail == 0)


SCALES4 = SCALES + [2.0**120, 2.0**121, 3.3e38 / 2]


@pytest.mark.parametrize("words", [False, True], ids=["bytes", "words"])
def test_4bit_decode_every_byte(words):
    """All 256 bytes (every m code with every v code) under every pair of ordinary and special fp32 scales."""
    gen = torch.Generator().manual_seed(1)
    k = len(SCALES4)
    codes = torch.stack([torch.randperm(256, generator=gen) for _ in range(k)]).to(torch.uint8).reshape(-1)
    ms = torch.tensor([SCALES4[i % k] for i in range(2 * k)], dtype=torch.float32)
    vs = torch.tensor([SCALES4[(i + 3) % k] for i in range(2 * k)], dtype=torch.float32)
    ms[3], vs[1] = 0.999, 0.999  # not bf16 values
    want_m, want_v = ref.dequantize_mv4(codes, ms, vs)
    m = torch.empty(codes.numel(), dtype=torch.float32, device=DEVICE)
    v = torch.empty_like(m)
    _decode4_kernel[(k,)](
        codes.to(DEVICE),
        ms.view(torch.int32).to(DEVICE),
        vs.view(torch.int32).to(DEVICE),
        m,
        v,
        WORDS=words,
        num_warps=1,
        enable_fp_fusion=False,
    )
    assert same_bits(m.cpu(), want_m), mismatch(m.cpu(), want_m)
    assert same_bits(v.cpu(), want_v), mismatch(v.cpu(), want_v)
    # the values under scale 1 are the code values (signed for m): a wrong decoder cannot match by accident
    bm, bv = slice(0, 128), slice(128 * (2 * k - 3), 128 * (2 * k - 2))  # blocks with m scale 1, with v scale 1
    assert float(ms[0]) == 1.0 and float(vs[2 * k - 3]) == 1.0
    cb = codes[bm].long()  # m: the code's value times its v code's unit 2**(cv - 15) (format version 4)
    assert torch.equal(want_m[bm].abs(), ref.minifloat_value(cb & 7, 0, ref.M4_BIAS) * 2.0 ** ((cb >> 4) - 15.0))
    assert torch.equal(want_v[bv], 2.0 ** (2.0 * (codes[bv].long() >> 4) - 30) * (codes[bv] >= 16))
    assert torch.unique(want_m[bm]).numel() > 15 and torch.unique(want_v[bv]).numel() == 16
