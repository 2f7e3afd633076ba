"""Triton helpers of the 8-bit block format, version 2 (``reference.quantize_m`` / ``quantize_v`` and inverses).

A tile is ``[ROWS, 256]``: one row per quantization block, so a block's scale is a reduction along axis 1.

Both codes are minifloats with 4 exponent bits and exponent bias 15, the bias of IEEE fp16, and their subnormals are
fp16's: the ``m`` magnitude (e4m3) is the fp16 whose bits are ``code << 7``, the ``v`` code (e4m4) the fp16 with bits
``code << 6``, and the ``m`` sign goes to fp16's sign bit. So decoding is a shift, the exact fp16 -> fp32 conversion
and the multiplication by the block's scale: ``reference.minifloat_value`` bit for bit (both are exact values).

Encoding works on ``t = y * 2**-112`` (``y`` the normalized magnitude in [0, 1]). For ``y >= 2**-14`` the product is
exact and its bits are those of ``y`` less ``112 << 23``, the reference's exponent offset. For smaller ``y`` it is an
fp32 subnormal, rounded to a multiple of 2**-149 = 2**-37 * 2**-112, to nearest even: exactly the reference's
``bits(y + 2**-14) - (113 << 23)`` (that sum's ulp is 2**-37, and it rounds to nearest even the same way). So one
multiplication replaces the reference's comparison, addition and selection, and the bits of ``t`` plus the random
offset, shifted, are the code. The shift is folded into the addition (``(bits(t) << s) + (offset << s)``, one LEA or
IMAD) so that the code lands in the top byte.
"""

import triton
import triton.language as tl

from ._rounding import BF16_NAN, bf16_bits_to_f32, f32_bits

TWO_POW_M112 = tl.constexpr(2.0**-112)

# The random offsets of reference._rand_offset, pre-shifted left by 4 (m) and 5 (v): the code's lowest bit then is bit
# 24. m: bits 10-15 of the word, at bits 18-23, plus half a unit (bit 17). v: bits 0-9 at bits 14-23, plus bit 13.
M_RAND_MASK = tl.constexpr(0x3F << 18)
M_HALF = tl.constexpr(1 << 17)
V_RAND_MASK = tl.constexpr(0x3FF << 14)
V_HALF = tl.constexpr(1 << 13)


@triton.jit
def _f16_bits_to_f32(h):
    """fp16 bits (uint16) -> fp32, exact (subnormals included)."""
    return h.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def dequant_m(codes, scale_bits):
    """uint8 sign + e4m3 codes [R, B] and bf16 scale bits [R] -> fp32 first moment (``reference.dequantize_m``).

    The code's sign bit becomes fp16's (bit 15), its magnitude the fp16 bits ``mag << 7``; the product with the
    scale is the reference's ``(-a if negative else a) * scale`` (IEEE products are symmetric in sign).
    """
    c = codes.to(tl.uint16)
    h = ((c << 7) & 0x3F80) | ((c << 8) & 0x8000)
    return _f16_bits_to_f32(h) * bf16_bits_to_f32(scale_bits)[:, None]


@triton.jit
def dequant_v(codes, scale_bits):
    """uint8 e4m4 codes [R, B] and bf16 scale bits [R] -> fp32 second moment (``reference.dequantize_v``)."""
    return _f16_bits_to_f32(codes.to(tl.uint16) << 6) * bf16_bits_to_f32(scale_bits)[:, None]


@triton.jit
def _halves_to_f32(h2):
    """uint32 words holding two fp16 bit patterns [R, W] -> fp32 [R, W, 2] (low half first)."""
    h = tl.join(h2.to(tl.uint16), (h2 >> 16).to(tl.uint16))
    return h.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _decode_words(w, M: tl.constexpr):
    """[R, W] words of four codes -> fp32 code values [R, 4 * W] in memory order (``M``: sign + e4m3, else e4m4).

    Two codes per 32-bit operation: bytes 0 and 2 go to the low and high halves of one word, bytes 1 and 3 to those
    of another, as fp16 bit patterns (m: ``sign << 15 | magnitude << 7``; v: ``code << 6``). Each thread's words
    become its consecutive elements, so the joins and the reshape move no data.
    """
    if M:
        even = ((w << 7) & 0x3F803F80) | ((w << 8) & 0x80008000)
        odd = ((w >> 1) & 0x3F803F80) | (w & 0x80008000)
    else:
        even = (w << 6) & 0x3FC03FC0
        odd = (w >> 2) & 0x3FC03FC0
    x = tl.join(_halves_to_f32(even), _halves_to_f32(odd))  # [R, W, 2 (bytes 0|1, 2|3), 2 (even, odd)]
    return tl.reshape(x, (w.shape[0], 4 * w.shape[1]))


@triton.jit
def dequant_m_words(w, scale_bits):
    """``dequant_m`` on the codes packed four to a little-endian uint32 word [R, W] -> [R, 4 * W]."""
    return _decode_words(w, True) * bf16_bits_to_f32(scale_bits)[:, None]


@triton.jit
def dequant_v_words(w, scale_bits):
    """``dequant_v`` on the codes packed four to a little-endian uint32 word [R, W] -> [R, 4 * W]."""
    return _decode_words(w, False) * bf16_bits_to_f32(scale_bits)[:, None]


@triton.jit
def block_scale(a, mask):
    """Per-row absmax of ``a >= 0`` (NaN wins) rounded up to bf16: (bf16 bits [R], fp32 reciprocal [R]).

    Non-negative fp32 values order like their bit patterns, and NaN's pattern is above inf's, so the absmax is an
    integer max that propagates NaN. The reciprocal of a zero scale is inf here, where the reference takes 0: such a
    block is all zeros, and ``0 * inf`` is NaN, which :func:`scaled_bits` maps to 0 like ``0 * 0``.
    """
    amax = tl.max(tl.where(mask, f32_bits(a), 0), axis=1)
    up = (amax + 0xFFFF) >> 16
    sbits = tl.where(amax > 0x7F800000, BF16_NAN, up)
    s = (sbits << 16).to(tl.float32, bitcast=True)
    return sbits.to(tl.uint16), tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)


@triton.jit
def scaled_bits(a, inv):
    """The fp32 bits of ``reference._normalized(a) * 2**-112`` (uint32), see the module docstring.

    ``_normalized`` clamps ``a * inv`` to at most 1 and maps NaN to 0: ``maximum``/``minimum`` without NaN propagation
    return the other operand for a NaN (PTX ``max.f32``/``min.f32``, numpy's ``fmax``/``fmin`` in the interpreter),
    so max(NaN, 0) = 0; ``a * inv`` is never -0 or negative.
    """
    y = tl.minimum(tl.maximum(a * inv[:, None], 0.0), 1.0)
    return f32_bits(y * TWO_POW_M112)


@triton.jit
def after(inv):
    """+0.0 per row, computed from the row's reciprocal ``inv`` (>= 0 or NaN; a NaN-ignoring minimum with 0 is +0).

    Comparing with it instead of the literal 0 makes the comparison wait for the reciprocal, whose IEEE division
    ptxas expands into a branch: a predicate computed before a branch and used after it is saved to a register and
    restored (P2R, ISETP), two more instructions per element.
    """
    return tl.minimum(inv, 0.0)[:, None]


@triton.jit
def quant_m(m, mask, bits, one):
    """fp32 first moment [R, B] -> (uint8 sign + e4m3 codes, bf16 scale bits [R]); bits 10-15 of the 32 random
    ``bits`` round it (``reference.quantize_m``).

    ``one``: uint32 1 (broadcast against [R, B]; 0 is allowed in rows that are not stored), a value that the compiler
    cannot see as a constant. The half-unit offset is formed from it: a constant would be moved out of the masking of
    the random bits (one OR) into an add of its own.
    """
    a = tl.abs(m)
    sbits, inv = block_scale(a, mask)
    x = (scaled_bits(a, inv) << 4) + (((bits << 8) & M_RAND_MASK) | (one * M_HALF))
    c = x >> 24
    return tl.where(m < after(inv), c | 0x80, c).to(tl.uint8), sbits


@triton.jit
def quant_v(v, mask, bits, one):
    """fp32 second moment [R, B] -> (uint8 e4m4 codes, bf16 scale bits [R]); nonzero v never gets code 0. Bits 0-9
    of the 32 random ``bits`` round it (``reference.quantize_v``). ``one`` as in :func:`quant_m`."""
    sbits, inv = block_scale(v, mask)
    x = (scaled_bits(v, inv) << 5) + (((bits << 14) & V_RAND_MASK) | (one * V_HALF))
    c = x >> 24
    return tl.where(v > after(inv), tl.maximum(c, 1), c).to(tl.uint8), sbits
