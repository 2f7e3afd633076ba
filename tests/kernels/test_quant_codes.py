"""The kernels' 8-bit codes (format version 2) against the reference, bit for bit.

Encoding: every code value, its fp32 neighbours, the midpoints between codes, the subnormal/normal boundary 2**-14
and the values around it, the exact thresholds where a random offset carries into the next code, 0 and -0, NaN and
inf blocks, blocks whose scale is subnormal or whose reciprocal overflows, with random words of all-0 bits, all-1
bits, hashed words and words that set only the bits of one moment. Decoding: all 256 codes under ordinary and special
scales, one code at a time and four to a word.
"""

import pytest
import torch
import triton
import triton.language as tl

from apexw_hf import reference as ref
from apexw_hf.kernels._quant import dequant_m, dequant_m_words, dequant_v, dequant_v_words, quant_m, quant_v

from .helpers import DEVICE, mismatch, same_bits

MANT = {"m": ref.M_MANT, "v": ref.V_MANT}
CODE_MAX = {"m": ref.M_CODE_MAX, "v": ref.V_CODE_MAX}
RAND = {"m": (ref.M_RAND_SHIFT, ref.M_RAND_BITS), "v": (ref.V_RAND_SHIFT, ref.V_RAND_BITS)}


@triton.jit
def _encode_kernel(x_ptr, bits_ptr, code_ptr, scale_ptr, n, V: tl.constexpr):
    row = tl.program_id(0)
    offs = row * 256 + tl.arange(0, 256)[None, :]
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    bits = tl.load(bits_ptr + offs, mask=mask, other=0).to(tl.uint32, bitcast=True)
    one = (n > 0).to(tl.uint32)
    if V:
        c, s = quant_v(x, mask, bits, one)
    else:
        c, s = quant_m(x, mask, bits, one)
    tl.store(code_ptr + offs, c, mask=mask)
    tl.store(scale_ptr + row + tl.arange(0, 1), s)


@triton.jit
def _decode_kernel(code_ptr, scale_ptr, out_ptr, V: tl.constexpr, WORDS: tl.constexpr):
    row = tl.program_id(0)
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


def _encode(moment: str, x: torch.Tensor, bits: torch.Tensor):
    n = x.numel()
    codes = torch.empty(n, dtype=torch.uint8, device=DEVICE)
    scale = torch.empty(ref.num_blocks(n), dtype=torch.int16, device=DEVICE)
    _encode_kernel[(ref.num_blocks(n),)](
        x.to(DEVICE), _int32(bits).to(DEVICE), codes, scale, n, V=moment == "v", num_warps=1, enable_fp_fusion=False
    )
    return codes.cpu(), scale.cpu().view(torch.bfloat16)


def _check_encode(moment: str, x: torch.Tensor, bits: torch.Tensor) -> None:
    want_codes, want_scale = (ref.quantize_v if moment == "v" else ref.quantize_m)(x, bits)
    codes, scale = _encode(moment, x, bits)
    assert same_bits(scale, want_scale), f"scales: {mismatch(scale, want_scale)}"
    bad = (codes != want_codes).nonzero().flatten()
    assert bad.numel() == 0, (
        f"{bad.numel()} of {x.numel()} codes differ; first at y={x[bad[0]].item()!r} "
        f"(bits {x[bad[0]].view(torch.int32).item() & 0xFFFFFFFF:#010x}), word {bits[bad[0]].item():#010x}: "
        f"kernel {codes[bad[0]].item()}, reference {want_codes[bad[0]].item()}"
    )


def _code_values(moment: str) -> torch.Tensor:
    return ref.minifloat_value(torch.arange(CODE_MAX[moment] + 1), MANT[moment])


def _boundary_values(moment: str) -> torch.Tensor:
    """Magnitudes in [0, 1]: the code values, 1 and 2 ulps either side, the midpoints between codes, and the
    subnormal/normal boundary with its neighbourhood (ties of y + 2**-14 included)."""
    c = _code_values(moment)
    zero, one = torch.zeros_like(c), torch.ones_like(c)
    dn1, up1 = torch.nextafter(c, zero), torch.nextafter(c, one)
    dn2, up2 = torch.nextafter(dn1, zero), torch.nextafter(up1, one)
    mid = (c[1:] + c[:-1]) / 2
    b = ref.MIN_NORMAL
    near = torch.tensor(
        [
            b,
            b * (1 - 2**-24),
            b * (1 + 2**-23),
            b - 2**-38,
            b - 3 * 2**-38,
            b - 2**-37,
            2**-38,
            3 * 2**-38,
            2**-37,
            2**-149,
            2**-130,
            2**-127,
            2**-126,
            2**-18,
            2**-17,
            2**-19,
            0.5 * 2**-18,
            1.5 * 2**-18,
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
    _check_encode(moment, x, _words(x.numel(), words, moment))


SCALES = [1.0, 3.0, 0.0, 2.0**-133, 2.0**-126, 1e-30, 3.3e38, float("inf"), float("nan"), 2.0**100]


@pytest.mark.parametrize("words", [False, True], ids=["bytes", "words"])
@pytest.mark.parametrize("moment", ["m", "v"])
def test_decode_every_code(moment, words):
    gen = torch.Generator().manual_seed(1)
    codes = torch.stack([torch.randperm(256, generator=gen) for _ in SCALES]).to(torch.uint8).reshape(-1)
    scale = torch.tensor(SCALES, dtype=torch.float32).to(torch.bfloat16)
    want = (ref.dequantize_v if moment == "v" else ref.dequantize_m)(codes, scale)
    out = torch.empty(codes.numel(), dtype=torch.float32, device=DEVICE)
    _decode_kernel[(len(SCALES),)](
        codes.to(DEVICE),
        scale.view(torch.int16).to(DEVICE),
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
    mag = ref.minifloat_value(c & 127 if moment == "m" else c, MANT[moment])
    assert torch.equal(one.abs(), mag) and torch.unique(one).numel() >= 240
