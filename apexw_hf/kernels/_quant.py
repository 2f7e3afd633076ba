"""Triton helpers of the 8-bit block format (``reference.quantize_m`` / ``quantize_v`` and their inverses).

A tile is ``[ROWS, 256]``: one row per quantization block, so a block's scale is a reduction along axis 1.
"""

import triton
import triton.language as tl

from ._rounding import BF16_NAN, bf16_bits_to_f32, f32_bits

INV127 = tl.constexpr(0.007874015718698502)  # fp32(1/127), as reference.INV127
INV255 = tl.constexpr(0.003921568859368563)  # fp32(1/255), as reference.INV255


@triton.jit
def q2(c):
    t = c * INV127
    return t * t


@triton.jit
def q4(c):
    t = c * INV255
    t2 = t * t
    return t2 * t2


@triton.jit
def dequant_m(codes, scale_bits):
    """int8 codes [R, B] and bf16 scale bits [R] -> fp32 first moment."""
    t = codes.to(tl.float32) * INV127
    # t * |t| is sign(c) * q2(|c|), bit for bit: IEEE products are symmetric in sign
    return (t * tl.abs(t)) * bf16_bits_to_f32(scale_bits)[:, None]


@triton.jit
def dequant_v(codes, scale_bits):
    """uint8 codes [R, B] and bf16 scale bits [R] -> fp32 second moment."""
    return q4(codes.to(tl.float32)) * bf16_bits_to_f32(scale_bits)[:, None]


@triton.jit
def block_scale(a, mask):
    """Per-row absmax of ``a >= 0`` (NaN wins) rounded up to bf16: (bf16 bits [R], fp32 scale, fp32 reciprocal).

    Non-negative fp32 values order like their bit patterns, and NaN's pattern is above inf's, so the absmax is an
    integer max that propagates NaN.
    """
    amax = tl.max(tl.where(mask, f32_bits(a), 0), axis=1)
    up = (amax + 0xFFFF) >> 16
    sbits = tl.where(amax > 0x7F800000, BF16_NAN, up)
    s = (sbits << 16).to(tl.float32, bitcast=True)
    inv = tl.where(s == 0.0, 0.0, tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s))
    return sbits.to(tl.uint16), inv


@triton.jit
def normalized(a, inv):
    """``clamp(a * inv, max=1)`` with NaN -> 0, as ``reference._normalized``."""
    y = a * inv[:, None]
    y = tl.where(y > 1.0, 1.0, y)
    return tl.where(y == y, y, 0.0)


# Just below 127 and 255: an approximate root times these never lands above the right code (see lower_code).
BELOW127 = tl.constexpr(127.0 * (1.0 - 2.0**-16))
BELOW255 = tl.constexpr(255.0 * (1.0 - 2.0**-16))
TWO_POW_M16 = tl.constexpr(2.0**-16)


@triton.jit
def _q(c, Q4: tl.constexpr):
    if Q4:
        return q4(c)
    else:
        return q2(c)


@triton.jit
def lower_code(y, root_times_n, top: tl.constexpr, Q4: tl.constexpr):
    """``reference._lower_code`` without an IEEE root: (lo, q(lo), q(lo + 1)) for ``y`` in [0, 1].

    ``root_times_n`` is y's square (Q4: fourth) root from the approximate hardware instruction, times just under 127
    (255). Its floor is the right code or the one below it: the approximate root is within 2**-21 of the true one and
    the decoded code values within a few ulps of (c/127)**2, so the 2**-16 shortfall keeps the guess at or below the
    code and is too small to fall a whole code below it. One comparison with the next code's value settles it, bit
    for bit as the reference's table search.
    """
    lo = tl.minimum(tl.floor(root_times_n), top - 1.0)
    q1 = _q(lo + 1.0, Q4)
    up = (y >= q1) & (lo < top - 1.0)
    qlo = tl.where(up, q1, _q(lo, Q4))
    qhi = tl.where(up, _q(lo + 2.0, Q4), q1)
    return lo + up.to(tl.float32), qlo, qhi


@triton.jit
def _pick(y, lo, qlo, qhi, half):
    """``reference._stochastic_code`` with 16 random bits ``half``."""
    u = half.to(tl.float32) * TWO_POW_M16
    return lo + ((u * (qhi - qlo)) < (y - qlo)).to(tl.float32)


@triton.jit
def m_root(y):
    return tl.sqrt(y) * BELOW127


@triton.jit
def v_root(y):
    return tl.sqrt(tl.sqrt(y)) * BELOW255


@triton.jit
def quant_m(m, mask, bits):
    """fp32 first moment [R, B] -> (int8 codes, bf16 scale bits [R]); rounds with the top 16 of the 32 ``bits``."""
    a = tl.abs(m)
    sbits, inv = block_scale(a, mask)
    y = normalized(a, inv)
    lo, qlo, qhi = lower_code(y, m_root(y), 127.0, False)
    c = _pick(y, lo, qlo, qhi, bits >> 16)
    c = tl.where(m < 0, -c, c)
    return c.to(tl.int8), sbits


@triton.jit
def quant_v(v, mask, bits):
    """fp32 second moment [R, B] -> (uint8 codes, bf16 scale bits [R]); nonzero v never gets code 0. Rounds with the
    low 16 of the 32 ``bits``."""
    sbits, inv = block_scale(v, mask)
    y = normalized(v, inv)
    lo, qlo, qhi = lower_code(y, v_root(y), 255.0, True)
    c = _pick(y, lo, qlo, qhi, bits & 0xFFFF)
    c = tl.where((v > 0) & (c == 0.0), 1.0, c)
    return c.to(tl.uint8), sbits
