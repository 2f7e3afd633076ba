"""Triton helpers of the block formats: 8-bit version 3 (``reference.quantize_m`` / ``quantize_v`` and inverses) and
4-bit version 4 (``reference.quantize_mv4`` / ``dequantize_mv4``).

A tile is ``[ROWS, 256]``: one row per quantization block, so a block's scale is a reduction along axis 1.

The 8-bit ``m`` code is a minifloat with 4 exponent bits and exponent bias 15, the bias of IEEE fp16, and its
subnormals are fp16's: the magnitude (e4m3) is the fp16 whose bits are ``code << 7``, and the sign goes to fp16's sign
bit. So decoding is a shift, the exact fp16 -> fp32 conversion and the multiplication by the block's scale:
``reference.minifloat_value`` bit for bit (both are exact values). The 8-bit ``v`` code (e5m3, bias 31) is the fp32
with bits ``code << 20`` times 2**96 (its subnormals fp32's), both exact, then times the scale.

Encoding ``m`` works on ``t = y * 2**-112`` (``y`` the normalized magnitude in [0, 1]; ``v``: ``2**-96``, see
:func:`quant_v`). For ``y >= 2**-14`` the product is
exact and its bits are those of ``y`` less ``112 << 23``, the reference's exponent offset. For smaller ``y`` it is an
fp32 subnormal, rounded to a multiple of 2**-149 = 2**-37 * 2**-112, to nearest even: exactly the reference's
``bits(y + 2**-14) - (113 << 23)`` (that sum's ulp is 2**-37, and it rounds to nearest even the same way). So one
multiplication replaces the reference's comparison, addition and selection, and the bits of ``t`` plus the random
offset, shifted, are the code. The shift is folded into the addition (``(bits(t) << s) + (offset << s)``, one LEA or
IMAD) so that the code lands in the top byte.

4-bit state (``reference.quantize_mv4``, format version 4) holds both codes in one byte: bits 0-2 the ``m`` magnitude
(e3m0, exponent bias 7), bit 3 its sign, bits 4-7 the ``v`` code (``2**(2 (c - 15))``, code 0 zero); both scales are
fp32: ``v``'s the envelope of ``reference.v4_scale``, ``m``'s the exact absmax (canonical NaN) of ``|m| * 2**(15 -
c)``, ``c`` the element's new ``v`` code (so ``v`` is coded first; the factor is the fp32 whose exponent field is
``142 - c``, an exact product). The tile stays
``[ROWS, 256]``; block scales are reductions over its ``[2 * ROWS, 128]`` reshape (a row of 256 elements, one warp,
holds two 4-bit blocks). ``m`` is encoded on ``y * 2**-120`` (bias 7: its subnormal boundary 2**-6 lands on fp32's
2**-126, and the ulp 2**-29 of the reference's ``y + 2**-6`` is 2**-149 * 2**120); with no mantissa bits its code is
the fp32 exponent field of that product once the random offset (the word's bits 0-7) is added. The ``v`` code is
``reference.v4_code``'s integer comparison, exactly, in 32-bit operations (:func:`v4_code`): no floating-point
operation, so nothing that contraction into a fused multiply-add could change. Decoding: the ``m`` code goes through
fp16 as for 8 bits (the fp16 exponent field with bias 15, moved to bias 7 by an exact fp16 multiplication by 256, two
codes at a time); the ``v`` code ``c`` is the fp32 with bits ``c << 24`` (``2**(2 c - 127)``, zero for code 0) times
2**97; ``m`` is then multiplied by ``2**(c - 15)``, the fp32 with exponent field ``c + 112``: half the ``v`` code's
bits plus a constant (:func:`_m4_units`).
"""

import triton
import triton.language as tl

from ._rounding import BF16_NAN, INTERPRETED, bf16_bits_to_f32, f32_bits

TWO_POW_M112 = tl.constexpr(2.0**-112)

# The random offsets of reference._rand_offset, pre-shifted left by 4: the code's lowest bit then is bit 24. m: bits
# 0-5 of the word, at bits 18-23, plus half a unit (bit 17). v (8-bit version 3): bits 6-21 at bits 8-23, plus bit 7.
M_RAND_MASK = tl.constexpr(0x3F << 18)
M_HALF = tl.constexpr(1 << 17)
V8_RAND_MASK = tl.constexpr(0xFFFF << 8)
V8_HALF = tl.constexpr(1 << 7)
# 8-bit v (e5m3, bias 31): encoded on the bits of y * 2**-96, decoded as the fp32 with bits code << 20 times 2**96
TWO_POW_M96 = tl.constexpr(2.0**-96)
TWO_POW_96 = tl.constexpr(2.0**96)
V8_HEADROOM = tl.constexpr(2.0)
# 4-bit (format version 3): one shift of the random word by W4_SHIFT puts bits 0-7 (m) at bits 20-27, right below the
# m code when the magnitude is added shifted left by 5, plus half a unit below them (reference._rand_offset, drop 23)
TWO_POW_M120 = tl.constexpr(2.0**-120)
W4_SHIFT = tl.constexpr(20)
M4_RAND_MASK, M4_HALF = tl.constexpr(0xFF << 20), tl.constexpr(1 << 19)
CANONICAL_NAN_F32 = tl.constexpr(0x7FC00000)
# 4-bit v (reference.v4_code): 16 random bits from bit 8 of the word; the threshold's integers in 32-bit words
# (237 * 3 * 2**23 = 2**32 + V4_AQ_LO, 9 * 2**36 = V4_UNIT_HI * 2**32); (e - 99) // 2 + 1 for the exponent field e
# is (bits - V4_CODE_OFF) >> 24; the fp32 with bits c << 24, times TWO_POW_97, is code c's value
V4_RAND_SHIFT, V4_RAND_MASK = tl.constexpr(8), tl.constexpr(0xFFFF)
V4_AQ_LO, V4_A1, V4_UNIT_HI = tl.constexpr(237 * 3 * 2**23 - 2**32), tl.constexpr(237 - 128), tl.constexpr(9 << 4)
V4_CODE_OFF = tl.constexpr((49 << 24) - (1 << 23))
TWO_POW_97 = tl.constexpr(2.0**97)
V4_HEADROOM = tl.constexpr(4.0)
# 4-bit m (format version 4): coded as |m| * 2**(15 - cv), the fp32 with exponent field 142 - cv (M4_FACTOR_BITS less
# cv << 23, one IMAD); decoded times 2**(cv - 15), exponent field cv + 112 (M4_UNIT_BITS added to cv << 23)
M4_UNIT_BITS = tl.constexpr((127 - 15) << 23)
M4_FACTOR_BITS = tl.constexpr((127 + 15) << 23)
_INTERPRETED = tl.constexpr(INTERPRETED)


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
def dequant_v(codes, scale):
    """uint8 e5m3 codes [R, B] and fp32 scales [R] -> fp32 second moment (``reference.dequantize_v``, 8-bit format
    version 3): the fp32 with bits ``code << 20`` is the code's value times 2**-96 (its exponent field the code's,
    subnormal codes fp32 subnormals), exact; times 2**96, exact; times the scale, the reference's one rounding."""
    return ((codes.to(tl.uint32) << 20).to(tl.float32, bitcast=True) * TWO_POW_96) * scale[:, None]


@triton.jit
def _halves_to_f32(h2):
    """uint32 words holding two fp16 bit patterns [R, W] -> fp32 [R, W, 2] (low half first)."""
    h = tl.join(h2.to(tl.uint16), (h2 >> 16).to(tl.uint16))
    return h.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _halves_to_f16(h2):
    """uint32 words holding two fp16 bit patterns [R, W] -> fp16 [R, W, 2] (low half first)."""
    h = tl.join(h2.to(tl.uint16), (h2 >> 16).to(tl.uint16))
    return h.to(tl.float16, bitcast=True)


@triton.jit
def _decode_words(w):
    """[R, W] words of four sign + e4m3 ``m`` codes -> fp32 code values [R, 4 * W] in memory order.

    Two codes per 32-bit operation: bytes 0 and 2 go to the low and high halves of one word, bytes 1 and 3 to those
    of another, as fp16 bit patterns (``sign << 15 | magnitude << 7``). Each thread's words become its consecutive
    elements, so the joins and the reshape move no data.
    """
    even = ((w << 7) & 0x3F803F80) | ((w << 8) & 0x80008000)
    odd = ((w >> 1) & 0x3F803F80) | (w & 0x80008000)
    x = tl.join(_halves_to_f32(even), _halves_to_f32(odd))  # [R, W, 2 (bytes 0|1, 2|3), 2 (even, odd)]
    return tl.reshape(x, (w.shape[0], 4 * w.shape[1]))


@triton.jit
def dequant_m_words(w, scale_bits):
    """``dequant_m`` on the codes packed four to a little-endian uint32 word [R, W] -> [R, 4 * W]."""
    return _decode_words(w) * bf16_bits_to_f32(scale_bits)[:, None]


@triton.jit
def dequant_v_words(w, scale):
    """``dequant_v`` on the codes packed four to a little-endian uint32 word [R, W] -> [R, 4 * W]: each byte moved to
    bits 20-27 of a word of its own (one shift and one mask each)."""
    b0 = ((w << 20) & 0x0FF00000).to(tl.float32, bitcast=True)
    b1 = ((w << 12) & 0x0FF00000).to(tl.float32, bitcast=True)
    b2 = ((w << 4) & 0x0FF00000).to(tl.float32, bitcast=True)
    b3 = ((w >> 4) & 0x0FF00000).to(tl.float32, bitcast=True)
    x = tl.join(tl.join(b0, b2), tl.join(b1, b3))  # [R, W, 2 (bytes 0|1, 2|3), 2 (even, odd)], as _decode_words
    return (tl.reshape(x, (w.shape[0], 4 * w.shape[1])) * TWO_POW_96) * scale[:, None]


@triton.jit
def rcp_rn(x):
    """``1 / x`` correctly rounded (fp32, subnormals kept): the block scales' reciprocals. PTX ``rcp.rn.f32`` is the
    IEEE reciprocal, the same value as ``div_rn(1, x)`` for every ``x`` (+-0, +-inf and NaN included), but ptxas
    expands it with fewer instructions and, for 4-bit, fewer registers live across its slow-path branch (sm_90,
    counted in the compiled kernel: 2.6% fewer instructions per 8-bit program; 1% fewer per 4-bit program and, at 64
    registers, 24 fewer bytes of spill). The interpreter has no PTX: ``div_rn`` there."""
    if _INTERPRETED:
        return tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), x)
    else:
        return tl.inline_asm_elementwise("rcp.rn.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def block_scale(a, mask, MASKED: tl.constexpr = True):
    """Per-row absmax of ``a >= 0`` (NaN wins) rounded up to bf16: (bf16 bits [R], fp32 reciprocal [R]).

    Non-negative fp32 values order like their bit patterns, and NaN's pattern is above inf's, so the absmax is an
    integer max that propagates NaN. The reciprocal of a zero scale is inf here, where the reference takes 0: such a
    block is all zeros, and ``0 * inf`` is NaN, which :func:`scaled_bits` maps to 0 like ``0 * 0``. Without ``MASKED``
    the elements outside ``mask`` must be zeros already (the whole rows past the end of a launch of whole blocks,
    loaded as zeros with zero scales).
    """
    if MASKED:
        amax = tl.max(tl.where(mask, f32_bits(a), 0), axis=1)
    else:
        amax = tl.max(f32_bits(a), axis=1)
    up = (amax + 0xFFFF) >> 16
    sbits = tl.where(amax > 0x7F800000, BF16_NAN, up)
    s = (sbits << 16).to(tl.float32, bitcast=True)
    return sbits.to(tl.uint16), rcp_rn(s)


@triton.jit
def block_scale_f32(a, mask, MASKED: tl.constexpr = True):
    """Per-row absmax of ``a >= 0`` (NaN wins, as the canonical NaN) in fp32: (its bits [R], fp32 reciprocal [R]).

    ``reference._scale_exact``; the integer max as in :func:`block_scale`, with no rounding up, and the reciprocal of
    a zero scale inf (see there).
    """
    if MASKED:
        amax = tl.max(tl.where(mask, f32_bits(a), 0), axis=1)
    else:
        amax = tl.max(f32_bits(a), axis=1)
    sbits = tl.where(amax > 0x7F800000, CANONICAL_NAN_F32, amax)
    s = sbits.to(tl.float32, bitcast=True)
    return sbits, rcp_rn(s)


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
    """fp32 first moment [R, B] -> (uint8 sign + e4m3 codes, bf16 scale bits [R]); bits 0-5 of the 32 random
    ``bits`` round it (``reference.quantize_m``).

    ``one``: uint32 1 (broadcast against [R, B]; 0 is allowed in rows that are not stored), a value that the compiler
    cannot see as a constant. The half-unit offset is formed from it: a constant would be moved out of the masking of
    the random bits (one OR) into an add of its own.
    """
    a = tl.abs(m)
    sbits, inv = block_scale(a, mask)
    x = (scaled_bits(a, inv) << 4) + (((bits << 18) & M_RAND_MASK) | (one * M_HALF))
    c = x >> 24
    return tl.where(m < after(inv), c | 0x80, c).to(tl.uint8), sbits


@triton.jit
def row_max_bits(v, mask):
    """Per row of ``v >= 0`` [R, B] (NaN allowed), the integer maximum of its fp32 bits over ``mask`` (uint32 [R]):
    the absmax, a NaN above inf above every finite value. What :func:`v8_scale` and :func:`v4_scale` take, and what
    the update kernel compares with inf's bits to skip a row whose ``v`` is not finite."""
    return tl.max(tl.where(mask, f32_bits(v), 0), axis=1)


@triton.jit
def _envelope_scale(amax, prev, beta2, headroom: tl.constexpr):
    """``reference._envelope_scale``: :func:`v8_scale` and :func:`v4_scale`, whose restarts put the scale at
    ``headroom`` times the absmax."""
    a = amax.to(tl.float32, bitcast=True)
    env = prev * beta2
    s = tl.where(a <= env, env, a * headroom)
    sbits = tl.where(amax > 0x7F800000, CANONICAL_NAN_F32, f32_bits(s))
    s = sbits.to(tl.float32, bitcast=True)
    return sbits, rcp_rn(s)


@triton.jit
def v8_scale(vmax, prev, beta2):
    """``reference.v8_scale`` of the rows of ``v >= 0`` (NaN allowed) whose absmax bits are ``vmax`` [R]
    (:func:`row_max_bits`): (fp32 scale bits [R], fp32 reciprocal [R]). ``prev``: the fp32 scales stored before this
    step [R]; ``beta2``: the step's fp32 beta2.

    The absmax is an integer max of the bits, as in :func:`block_scale` (NaN wins, made canonical); the envelope
    ``prev * beta2`` is kept while the absmax is at or below it, else the scale restarts at twice the absmax. The
    reciprocal of a zero scale is inf (see :func:`block_scale`).
    """
    return _envelope_scale(vmax, prev, beta2, V8_HEADROOM)


@triton.jit
def quant_v(v, vmax, bits, one, prev, beta2):
    """fp32 second moment [R, B] -> (uint8 e5m3 codes, fp32 scale bits [R]); nonzero v never gets code 0. Bits 6-21
    of the 32 random ``bits`` round it (``reference.quantize_v``, 8-bit format version 3). ``vmax``, ``prev`` and
    ``beta2`` as in :func:`v8_scale`, ``one`` as in :func:`quant_m`.

    The code is that of the bits of ``y * 2**-96`` (``y`` the normalized ``v``), as for ``m`` with ``2**-112`` (module
    docstring): for ``y >= 2**-30`` the product is exact and its bits are ``y``'s less ``96 << 23``, the reference's
    exponent offset; below, an fp32 subnormal rounded to a multiple of 2**-149 = 2**-53 * 2**-96, to nearest even,
    exactly the reference's ``bits(y + 2**-30) - (97 << 23)``.
    """
    sbits, inv = v8_scale(vmax, prev, beta2)
    y = tl.minimum(tl.maximum(v * inv[:, None], 0.0), 1.0)
    x = (f32_bits(y * TWO_POW_M96) << 4) + (((bits << 2) & V8_RAND_MASK) | (one * V8_HALF))
    c = x >> 24
    return tl.where(v > after(inv), tl.maximum(c, 1), c).to(tl.uint8), sbits


@triton.jit
def _m4_halves(h):
    """Bias 15 -> 7 on fp16 bit patterns holding a 4-bit ``m`` code (sign at bit 15, magnitude ``c`` at bits
    10-12), one or two to a word: a nonzero magnitude gets the exponent field ``c + 8 = c | 8`` (``c + 7`` has bit 3
    set exactly when ``c >= 1``), 0 stays zero. No carry leaves a half (``h + 0x1C00 < 0xBC00``). The integer form of
    the fp16 multiplication by 256 in :func:`dequant_mv4_words`, for the byte path."""
    return h | ((h + 0x1C001C00) & 0x20002000)


@triton.jit
def _by_block4(x, s):
    """[R, 256] values times the scales [2 * R] of their 128-element blocks."""
    R: tl.constexpr = x.shape[0]
    return tl.reshape(tl.reshape(x, (2 * R, 128)) * s[:, None], (R, 256))


@triton.jit
def _v4_values(hi):
    """fp32 values of 4-bit ``v`` codes held at bits 24-27 of uint32 ``hi`` (the rest zero): ``2**(2 c - 30)``, 0 for
    code 0 (``reference.v4_value``). As bits, ``hi`` is the fp32 with exponent field ``2 c`` and no mantissa, ``2**(2 c
    - 127)``, and zero for code 0; one exact multiplication by 2**97 moves it to the code's value."""
    return hi.to(tl.float32, bitcast=True) * TWO_POW_97


@triton.jit
def _m4_units(hi):
    """The factor ``2**(c - 15)`` of format version 4's ``m`` (``reference.v4_m_unit``) of 4-bit ``v`` codes ``c``
    held at bits 24-27 of uint32 ``hi``: the fp32 with exponent field ``c + 112``, exact."""
    return ((hi >> 1) + M4_UNIT_BITS).to(tl.float32, bitcast=True)


@triton.jit
def dequant_mv4(codes, m_scale, v_scale):
    """uint8 4-bit codes [R, 256] and fp32 ``m`` and ``v`` scales [2 * R] -> fp32 (m, v) (``reference.dequantize_mv4``,
    format version 4).

    ``m``: the fp16 ``sign << 15 | c << 10`` moved to bias 7 is ``+-2**(c - 7)`` (``+-0`` for ``c = 0``), times its
    block's scale, then times :func:`_m4_units`; ``v``: see :func:`_v4_values`, times its block's scale: the
    reference's products in its order.
    """
    c = codes.to(tl.uint32)
    hm = _m4_halves(((c << 10) & 0x1C00) | ((c << 12) & 0x8000))  # the high half stays 0
    hv = (c << 20) & 0x0F000000
    m = _by_block4(_f16_bits_to_f32(hm.to(tl.uint16)), m_scale) * _m4_units(hv)
    v = _by_block4(_v4_values(hv), v_scale)
    return m, v


@triton.jit
def dequant_mv4_words(w, m_scale, v_scale):
    """``dequant_mv4`` on the codes packed four to a little-endian uint32 word [R, 64] -> (m, v) [R, 256].

    As :func:`_decode_words`: two codes per 32-bit operation, bytes 0 and 2 in one word, bytes 1 and 3 in another.
    The ``m`` codes are decoded with bias 15 and multiplied by 256 in fp16, exactly, two at a time.
    """
    m_even = ((w << 10) & 0x1C001C00) | ((w << 12) & 0x80008000)
    m_odd = ((w << 2) & 0x1C001C00) | ((w << 4) & 0x80008000)
    x = tl.join(_halves_to_f16(m_even), _halves_to_f16(m_odd)) * 256.0  # [R, W, 2 (bytes 0|1, 2|3), 2 (even, odd)]
    m = tl.reshape(x.to(tl.float32), (w.shape[0], 4 * w.shape[1]))
    # v: each byte's high nibble moved to bits 24-27 of a word of its own, joined as in dequant_v_words
    b0 = (w << 20) & 0x0F000000
    b1 = (w << 12) & 0x0F000000
    b2 = (w << 4) & 0x0F000000
    b3 = (w >> 4) & 0x0F000000
    hv = tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), (w.shape[0], 4 * w.shape[1]))
    return _by_block4(m, m_scale) * _m4_units(hv), _by_block4(_v4_values(hv), v_scale)


@triton.jit
def v4_scale(vmax, prev, beta2):
    """``reference.v4_scale`` of the rows whose absmax bits are ``vmax``: :func:`v8_scale` with 4x headroom."""
    return _envelope_scale(vmax, prev, beta2, V4_HEADROOM)


@triton.jit
def v4_code(y, bits):
    """``reference.v4_code`` of fp32 ``y`` in [0, 1] with the random words ``bits`` (uint32) where ``y >= 2**-28``;
    below it an int32 of at most 1 (:func:`quant_mv4` takes the maximum with ``v > 0``, which is the reference's code
    there). Integer work only, in 32-bit words.

    The reference rounds up iff ``(2 r + 1) * 9 * 2**36 < q * t`` with ``t = 237 * 3 * 2**23 - 109 q`` and ``q < 3 *
    2**23`` (``q * t`` below 2**58). With ``t = 2**32 + t_s``, ``t_s`` an int32, ``q * t + 2**32 - 1`` is ``q * t_s``
    plus the 64-bit word ``q << 32 | 0xFFFFFFFF``: one wide multiply-add. The left side is ``M * 2**32`` with ``M =
    144 (2 r + 1)``, below ``q * t`` iff the high word of that sum exceeds ``M``: the same comparison, exactly. The
    lower code is ``(e - 99) // 2 + 1`` for the exponent field ``e``, the bits minus V4_CODE_OFF shifted right by 24;
    rounding up adds 1 << 24 before the shift (both in one add: int32 addition wraps, so the sum is the same bits).
    """
    b = f32_bits(y)
    z = b & 0xFFFFFF  # bit 23: e & 1; below it the mantissa
    q = tl.where(z >= 0x800000, z - 0x800000, 2 * z + 0x800000).to(tl.int32)  # the mantissa, or 2**23 + 2 x it
    r = ((bits >> V4_RAND_SHIFT) & V4_RAND_MASK).to(tl.int32)
    t_s = V4_AQ_LO - q * V4_A1
    q64 = q.to(tl.int64)
    w = q64 * t_s.to(tl.int64) + ((q64 << 32) | 0xFFFFFFFF)
    up = (w >> 32).to(tl.int32) > r * (2 * V4_UNIT_HI) + V4_UNIT_HI
    return (b.to(tl.int32) + tl.where(up, (1 << 24) - V4_CODE_OFF, -V4_CODE_OFF)) >> 24  # the offset in the select


@triton.jit
def quant_mv4(m, v, vmax, mask, bits, one, prev, beta2, EVEN: tl.constexpr):
    """fp32 moments [R, 256] -> (uint8 4-bit codes of both [R, 256], m scale bits [2 * R], v scale bits [2 * R], both
    fp32): scales of 128-element blocks; bits 0-7 of the 32 random ``bits`` round ``m``, bits 8-23 round ``v``
    (:func:`v4_code`), nonzero ``v`` never gets code 0 (``reference.quantize_mv4``, format version 4: ``m`` is coded
    as ``|m| * 2**(15 - cv)``, after ``v``). ``vmax``: the absmax bits of ``v``'s 128-element blocks [2 * R]
    (:func:`row_max_bits`); ``one``: [2 * R, 1], as in
    :func:`quant_m`; ``prev``: the fp32 ``v`` scales stored before this step [2 * R]; ``beta2``: the step's fp32 beta2.
    ``EVEN``: the launch is whole 256-element rows (masked rows hold zeros).

    The ``m`` code lands in bits 28-30 of ``xm`` (module docstring); the sign is set after the codes are joined.
    """
    R: tl.constexpr = m.shape[0]
    m = tl.reshape(m, (2 * R, 128))
    v = tl.reshape(v, (2 * R, 128))
    mask = tl.reshape(mask, (2 * R, 128))
    bits = tl.reshape(bits, (2 * R, 128))
    vsb, vinv = v4_scale(vmax, prev, beta2)
    yv = tl.minimum(tl.maximum(v * vinv[:, None], 0.0), 1.0)
    cv = tl.maximum(v4_code(yv, bits), (v > after(vinv)).to(tl.int32)).to(tl.uint32)
    # |m| * 2**(15 - cv), exact (the constant on the right: the interpreter keeps constexpr - tensor a constexpr)
    a = tl.abs(m) * (-(cv << 23) + M4_FACTOR_BITS).to(tl.float32, bitcast=True)
    msb, minv = block_scale_f32(a, mask, not EVEN)
    ym = tl.minimum(tl.maximum(a * minv[:, None], 0.0), 1.0)
    xm = (f32_bits(ym * TWO_POW_M120) << 5) + (((bits << W4_SHIFT) & M4_RAND_MASK) | (one * M4_HALF))
    x = (xm >> 28) | (cv << 4)
    x = tl.where(m < after(minv), x | 8, x)
    return tl.reshape(x.to(tl.uint8), (R, 256)), msb, vsb
