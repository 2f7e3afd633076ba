"""AdamW step of one chunk with 8-bit or 4-bit state as one fused loop compiled by numba: the engine's CPU path.

:mod:`apexw_hf.engines.torch` plans a param group into chunks (large tensors in place, small ones packed with
block padding) and, for ``8bit`` and ``4bit`` state on the CPU with fp32 or bf16 parameters, hands each chunk to
:func:`step_chunk` when numba is installed (``pip install "apexw_hf[cpu]"``; numba ships LLVM in its wheel, so no
compiler is needed). Each block (:data:`~apexw_hf.reference.BLOCK` or :data:`~apexw_hf.reference.BLOCK4` elements)
is then read once and written once: decode both moments, the update, the random word, the parameter's rounding, the
block scales and the new codes, in one pass over the chunk, the blocks split over ``torch.get_num_threads()``
threads. The torch passes of :mod:`apexw_hf.engines.torch_passes` (about 64 operations per 8-bit chunk, each ending in
a barrier of the threads) remain the path without numba, on CUDA, and for the other formats and fp16 parameters.

The bits are those of ``reference.adamw_step_ref_`` (``tests/engines/test_numba_engine.py``): every fp32 operation is
the reference's, one IEEE operation in fp32 at a time (constants are fp32, no ``fastmath``, so no fused multiply-add
and no reassociation), the square root is the fp32 instruction (correctly rounded), integer work is uint32 with
wraparound, and the special values follow the reference's own rules, so no chunk needs another path: a NaN in a
block makes its scale NaN and its codes those of ``y = 0`` (``reference._normalized``), an infinite scale gives
``1 / scale = 0``, a tiny bf16 scale ``1 / scale = inf``. Per block:

* decode (``reference.dequantize_m``/``dequantize_v``/``dequantize_mv4``): the code's value built on the fp32 bits,
  times the scale;
* the update in the reference's operation order (``maximize`` negates ``1 - beta1``: ``(-g) * c == g * (-c)``);
* the block maxima of ``|m|`` and ``v`` as integer maxima of their fp32 bits (a NaN has the largest bits, so it
  propagates as ``torch.amax``'s does); ``m``'s scale rounded up to bf16 (8-bit) or the exact fp32 absmax (4-bit),
  ``v``'s in fp32, the envelope of ``reference.v8_scale`` (8-bit) or ``reference.v4_scale`` (4-bit), a NaN canonical;
* the random word ``mix32(index * GOLDEN + key)``, its bits 0-5 (8-bit) or 0-7 (4-bit) rounding ``m``, 6-21 or 8-23
  ``v``, and 16-31 a bf16 parameter (``reference.param_stream``);
* the codes of ``reference.minifloat_code`` (4-bit ``v``: ``reference.v4_code``'s integer threshold), a nonzero ``v``
  never getting code 0.

A block whose new ``v`` holds a NaN or an infinity (with 4-bit state: either 128-element half of its tensor's
256-element block, ``reference.nonfinite_blocks``) is flagged in ``skip`` and not written; the host counts the flags.
A packed chunk's block padding (``blk_valid`` below the block size) holds ``m = v = 0``, as in
``reference._blocks``. Compiled on first use and cached on disk (``cache=True``), one signature per kernel.
"""

from __future__ import annotations

import os
import threading
import time

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from .. import _random as rnd
from .. import reference as ref
from ..formats import SCALE_KEYS, moment_keys

if numba.config.DISABLE_JIT:  # the kernels' bit casts (intrinsics) exist only in compiled code
    raise ImportError("numba's JIT is disabled (NUMBA_DISABLE_JIT)")

# numba's threading layer: "workqueue" unless the user chose one (NUMBA_THREADING_LAYER) or numba already started
# its threads. Its workers sleep between parallel calls; the OpenMP layer's keep spinning, which takes the cores from
# torch's own threads and from other processes: with two training processes on two cores (apexw-compare's offline
# default) the OpenMP layer made ApexW 8bit about three times slower than workqueue (docs/performance.md). workqueue
# runs one parallel call at a time per process: _LOCK.
if "NUMBA_THREADING_LAYER" not in os.environ and numba.config.THREADING_LAYER == "default":
    numba.config.THREADING_LAYER = "workqueue"
_LOCK = threading.Lock()


@intrinsic
def f32_bits(typingctx, x):
    """The uint32 bits of an fp32 scalar (a bit cast, which numba has no operation for on scalars)."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def bits_f32(typingctx, x):
    """The fp32 scalar of uint32 bits."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


# Constants are NumPy scalars, which numba types as uint32 / float32: a Python float is float64 and would carry fp32
# arithmetic into fp64 (one rounding where the reference has two), a Python int is int64, and uint32 mixed with int64
# becomes float64 in numba.
u32 = np.uint32
u64 = np.uint64
f32 = np.float32
BLOCK8, BLOCK4 = u64(ref.BLOCK), u64(ref.BLOCK4)
GOLDEN, MIX1, MIX2 = u32(rnd.GOLDEN), u32(rnd.MIX1), u32(rnd.MIX2)
S16, S13, S14 = u32(16), u32(13), u32(14)
LOW16, RNE_BIAS = u32(0xFFFF), u32(0x7FFF)
ABS = u32(0x7FFFFFFF)
INF_BITS = u32(0x7F800000)
BF16_NAN = np.uint16(0x7FC0)
ONE_BITS = u32(1)
F_ONE, F_ZERO = f32(1.0), f32(0.0)
F_INF = f32(np.inf)
MIN_NORMAL = f32(ref.MIN_NORMAL)
EXP23 = u32(1 << 23)
# 8-bit (format version 3): m's random bits are the word's bits 0-5 (to 14-19, half a unit at 13), v's 16 are its
# bits 6-21 (to 4-19: the word shifted right by two and masked, half a unit at 3)
M_HALF, V_HALF = u32(1 << 13), u32(1 << 3)
M_RMASK, V8_RMASK = u32(63), u32(0xFFFF << 4)
M_SHIFT, V_SHIFT, S2 = u32(20), u32(20), u32(2)
# a code plus M_OFF (V_OFF), shifted, is the fp32 bits of a normal code's value; encoding subtracts it again (v: e5m3
# with bias 31)
M_OFF, V_OFF = u32(112 << 3), u32((127 - ref.V8_BIAS) << 3)
M_SUB, V_SUB = u32(113 << 3), u32((128 - ref.V8_BIAS) << 3)  # ... a subnormal code's value plus the least normal
M_SUBMAX, V_SUBMAX = u32(8), u32(8)
MIN_NORMAL_V8 = f32(2.0 ** (1 - ref.V8_BIAS))
F_HEADROOM = f32(ref.V8_HEADROOM)
SIGN7, MAG7 = u32(128), u32(127)
# 4-bit: no mantissa bits; an m code c >= 1 has the fp32 exponent field c + M4_OFF (bias 7)
S4, S23 = u32(4), u32(23)
LOW4, MAG3, SIGN3 = u32(15), u32(7), u32(8)
M4_OFF = u32(127 - ref.M4_BIAS)
# 4-bit (format versions 3 and 4): m's random bits are the word's bits 0-7 (to 15-22, half a unit at 14); v's 16 are
# its bits 8-23, compared as an integer with the threshold of reference.v4_code
M4_RMASK, S15, M4_HALF = u32((1 << ref.M4V3_RAND_BITS) - 1), u32(15), u32(1 << 14)
V4_RSHIFT, V4_RMASK = u32(ref.V4V3_RAND_SHIFT), u32((1 << ref.V4V3_RAND_BITS) - 1)
V4_LEAST_BITS, V4_EXP_MIN, V4_VAL_OFF = u32(ref.V4_EXP_MIN << 23), u32(ref.V4_EXP_MIN), u32(ref.V4_EXP_MIN - 2)
V4_AQ, V4_A1 = np.int64(ref.V4_ROUND_A * ref.V4_Q), np.int64(ref.V4_ROUND_A - 128)
V4_UNIT = np.int64(9 << (52 - ref.V4V3_RAND_BITS))
F_HEADROOM4 = f32(ref.V4_HEADROOM)
F32_NAN_BITS = u32(0x7FC00000)
MANT_MASK = u32(0x7FFFFF)
MIN_NORMAL_M4 = f32(2.0 ** (1 - ref.M4_BIAS))
# 4-bit format version 4: m is coded as |m| * 2**(15 - cv) (exponent field M4_UP - cv), decoded times 2**(cv - 15)
# (exponent field cv + M4_UNIT_OFF), cv the element's v code (reference.v4_m_unit)
M4_UP, M4_UNIT_OFF = u32(127 + ref.V4_CODE_MAX), u32(127 - ref.V4_CODE_MAX)


@njit(inline="always")
def mix32(x):
    """murmur3's 32-bit finalizer (``_random.mix32``); the products are taken mod 2**32 by the uint32 cast."""
    x = x ^ (x >> S16)
    x = u32(x * MIX1)
    x = x ^ (x >> S13)
    x = u32(x * MIX2)
    return x ^ (x >> S16)


@njit(inline="always")
def round_up_bf16(amax_bits):
    """bf16 bits of ``reference.bf16_round_up`` of a non-negative fp32 (its bits; NaN stays NaN)."""
    if amax_bits > INF_BITS:
        return BF16_NAN
    return np.uint16(u32(amax_bits + LOW16) >> S16)


@njit(inline="always")
def inverse(scale16):
    """``reference._scale``'s reciprocal of a bf16 scale (its bits): ``1 / scale`` in fp32, 0 for a zero scale."""
    s = bits_f32(u32(scale16) << S16)
    if s == F_ZERO:
        return F_ZERO
    return F_ONE / s


@njit(inline="always")
def inverse_f32(scale_bits):
    """``reference._scale_exact``'s reciprocal of an fp32 scale (its bits): ``1 / scale``, 0 for a zero scale."""
    s = bits_f32(scale_bits)
    if s == F_ZERO:
        return F_ZERO
    return F_ONE / s


@njit(inline="always")
def v4_decoded(byte, scale):
    """The 4-bit ``v`` of a codes byte (its high nibble ``c``): ``2**(2 c - 30)`` times ``scale``, 0 for code 0."""
    cv = u32(byte) >> S4
    av = bits_f32(u32((cv + cv + V4_VAL_OFF) << S23))
    return (av if cv >= ONE_BITS else F_ZERO) * scale


@njit(inline="always")
def v4_code(y, w):
    """``reference.v4_code`` of one fp32 ``y`` in [0, 1] with the random word ``w``: 0 below 2**-28."""
    b = f32_bits(y)
    if b < V4_LEAST_BITS:
        return u32(0)
    d = u32((b >> S23) - V4_EXP_MIN)
    odd = d & ONE_BITS
    q = np.int64(u32((odd << S23) + ((b & MANT_MASK) << odd)))
    r = np.int64((w >> V4_RSHIFT) & V4_RMASK)
    up = u32(1) if (2 * r + 1) * V4_UNIT < q * (V4_AQ - V4_A1 * q) else u32(0)
    return u32((d >> ONE_BITS) + ONE_BITS + up)


@njit(inline="always")
def load_block(gbuf, pbuf, p32, p16, g32, g16, base, nv, blk, p_mode):
    """The block's gradient and parameter in fp32; zero past its ``nv`` valid elements (block padding)."""
    if g32.shape[0] == 0:
        for j in range(nv):
            gbuf[j] = bits_f32(u32(g16[base + j]) << S16)
    else:
        for j in range(nv):
            gbuf[j] = g32[base + j]
    if p_mode == 0:
        for j in range(nv):
            pbuf[j] = p32[base + j]
    else:
        for j in range(nv):
            pbuf[j] = bits_f32(u32(p16[base + j]) << S16)
    for j in range(nv, blk):
        gbuf[j] = F_ZERO
        pbuf[j] = F_ZERO


@njit(inline="always")
def nonfinite(vbuf, nv):
    """How many of the first ``nv`` values of the block's new ``v`` (fp32, >= 0 or NaN) are a NaN or an infinity."""
    bad = 0
    for j in range(nv):
        bad += 0 if vbuf[j] < F_INF else 1
    return bad


@njit(inline="always")
def nonfinite_v4(codes, v_scale, g32, g16, b, nv, beta2, omb2):
    """:func:`nonfinite` of the new ``v`` of 4-bit block ``b`` (its ``nv`` valid elements), computed from its codes,
    its ``v`` scale and its gradient (fp32, or bf16 bits) without writing anything: the second half of a 256-element
    block, before the same task updates it."""
    sv = bits_f32(v_scale[b])
    base = b * BLOCK4
    bad = 0
    for j in range(nv):
        g = g32[base + j] if g32.shape[0] else bits_f32(u32(g16[base + j]) << S16)
        v = v4_decoded(codes[base + j], sv) * beta2 + (g * g) * omb2
        bad += 0 if v < F_INF else 1
    return bad


@njit(inline="always")
def update(m, v, g, p, beta1, omb1, beta2, omb2, inv_bc2, eps, step_size, decay):
    """The reference's update, one fp32 operation at a time: (m, v, p)."""
    m = m * beta1 + g * omb1
    v = v * beta2 + (g * g) * omb2
    denom = np.sqrt(v) * inv_bc2 + eps
    return m, v, p * decay - (m / denom) * step_size


@njit(inline="always")
def finish_block(mbuf, vbuf, wbuf, pbuf, p32, p16, base, nv, blk, key, p_mode):
    """Zero moments in the padding, the random words, the parameter out; returns the block maxima of ``|m|`` and
    ``v`` (their fp32 bits; a NaN above inf above every finite value)."""
    for j in range(nv, blk):
        mbuf[j] = F_ZERO
        vbuf[j] = F_ZERO
    # the random words: mix32(index * GOLDEN + key), the index counted from the chunk's start (key adjusted per piece)
    for j in range(blk):
        wbuf[j] = mix32(u32(u32(base + j) * GOLDEN + key))
    if p_mode == 0:
        for j in range(nv):
            p32[base + j] = pbuf[j]
    elif p_mode == 1:  # bf16, round to nearest even
        for j in range(nv):
            x = pbuf[j]
            bits = f32_bits(x)
            r = u32(bits + RNE_BIAS + ((bits >> S16) & ONE_BITS)) >> S16
            p16[base + j] = BF16_NAN if x != x else np.uint16(r)
    else:  # bf16, stochastic: the word's top 16 bits (reference.param_stream)
        for j in range(nv):
            x = pbuf[j]
            r = u32(f32_bits(x) + (wbuf[j] >> S16)) >> S16
            p16[base + j] = BF16_NAN if x != x else np.uint16(r)
    # block maxima on the bits (NaN above inf above every finite value)
    amax_m = u32(0)
    amax_v = u32(0)
    for j in range(blk):
        amax_m = max(amax_m, u32(f32_bits(mbuf[j]) & ABS))
        amax_v = max(amax_v, u32(f32_bits(vbuf[j]) & ABS))
    return amax_m, amax_v


@njit(inline="always")
def normalized(a, inv):
    """``reference._normalized``: ``a * inv`` clamped to 1, NaN to 0."""
    y = a * inv
    y = F_ONE if y > F_ONE else y
    return y if y == y else F_ZERO


@njit(inline="always")
def code_bits(y, min_normal):
    """``reference.minifloat_code``'s integer before the offset is added: the bits of ``y``, or of ``y + min_normal``
    with the exponent lowered by one below ``min_normal``."""
    return f32_bits(y) if y >= min_normal else u32(f32_bits(y + min_normal) - EXP23)


@njit(parallel=True, cache=True, nogil=True)
def step_8bit(
    p32, p16, g32, g16, m_codes, v_codes, m_scale, v_scale, blk_seg, blk_valid, seg_key, hp, p_mode, ntasks, skip
):
    """One chunk with 8-bit state. ``p_mode``: 0 fp32 parameters (``p32``), 1 bf16 rounded to nearest, 2 bf16
    stochastically (``p16``, the bf16 bits); gradients in ``g32`` (fp32) or, when it is empty, ``g16`` (bf16
    bits). ``hp``: beta1, 1 - beta1 (negated for ``maximize``), beta2, 1 - beta2, 1 / sqrt(1 - beta2**t), eps,
    step size, decay. ``skip[b]`` is set to 1 for a block whose new ``v`` is not finite, which is left as it was
    (``reference.nonfinite_blocks``), else 0."""
    beta1, omb1, beta2, omb2 = hp[0], hp[1], hp[2], hp[3]
    inv_bc2, eps, step_size, decay = hp[4], hp[5], hp[6], hp[7]
    nb = blk_seg.shape[0]
    for task in prange(ntasks):
        gbuf = np.empty(BLOCK8, np.float32)
        pbuf = np.empty(BLOCK8, np.float32)
        mbuf = np.empty(BLOCK8, np.float32)
        vbuf = np.empty(BLOCK8, np.float32)
        wbuf = np.empty(BLOCK8, np.uint32)
        # unsigned indices: numba then drops its negative-index wraparound, which would stop vectorization
        for b in range(u64(task * nb // ntasks), u64((task + 1) * nb // ntasks)):
            base = b * BLOCK8
            nv = u64(blk_valid[b])
            load_block(gbuf, pbuf, p32, p16, g32, g16, base, nv, BLOCK8, p_mode)
            sm = bits_f32(u32(m_scale[b]) << S16)
            sv = bits_f32(v_scale[b])
            for j in range(BLOCK8):
                # decode: the code's value on the fp32 bits (subnormal codes: plus 2**-14, then minus it), times scale
                cm = u32(m_codes[base + j])
                mag = cm & MAG7
                a = bits_f32(u32((mag + M_OFF) << M_SHIFT))
                a_sub = bits_f32(u32((mag + M_SUB) << M_SHIFT)) - MIN_NORMAL
                a = a if mag >= M_SUBMAX else a_sub
                m = (-a if cm >= SIGN7 else a) * sm
                cv = u32(v_codes[base + j])
                av = bits_f32(u32((cv + V_OFF) << V_SHIFT))
                av_sub = bits_f32(u32((cv + V_SUB) << V_SHIFT)) - MIN_NORMAL_V8
                v = (av if cv >= V_SUBMAX else av_sub) * sv
                m, v, p = update(m, v, gbuf[j], pbuf[j], beta1, omb1, beta2, omb2, inv_bc2, eps, step_size, decay)
                pbuf[j] = p
                mbuf[j] = m
                vbuf[j] = v
            # nothing is written before this: a block whose new v is not finite keeps everything it had
            bad = nonfinite(vbuf, nv)
            skip[b] = 1 if bad else 0
            if bad:
                continue
            key = seg_key[blk_seg[b]]
            amax_m, amax_v = finish_block(mbuf, vbuf, wbuf, pbuf, p32, p16, base, nv, BLOCK8, key, p_mode)
            s16m = round_up_bf16(amax_m)
            # v: reference.v8_scale, the envelope (the previous scale times beta2 unless the absmax outgrows it)
            env = sv * beta2
            av = bits_f32(amax_v)
            s32v = F32_NAN_BITS if amax_v > INF_BITS else f32_bits(env if av <= env else av * F_HEADROOM)
            m_scale[b] = s16m
            v_scale[b] = s32v
            inv_m = inverse(s16m)
            inv_v = inverse_f32(s32v)
            for j in range(BLOCK8):
                w = wbuf[j]
                m = mbuf[j]
                x = code_bits(normalized(abs(m), inv_m), MIN_NORMAL)
                r = ((w & M_RMASK) << S14) | M_HALF
                c = u32(u32(x + r) >> M_SHIFT) - M_OFF
                c = c | SIGN7 if m < F_ZERO else c
                m_codes[base + j] = np.uint8(c)
                v = vbuf[j]
                x = code_bits(normalized(v, inv_v), MIN_NORMAL_V8)
                r = ((w >> S2) & V8_RMASK) | V_HALF
                c = u32(u32(x + r) >> V_SHIFT) - V_OFF
                c = ONE_BITS if (c == u32(0)) and (v > F_ZERO) else c
                v_codes[base + j] = np.uint8(c)


@njit(parallel=True, cache=True, nogil=True)
def step_4bit(
    p32, p16, g32, g16, codes, m_scale, v_scale, blk_seg, blk_valid, seg_key, hp, p_mode, ntasks, skip, blk_pair
):
    """One chunk with 4-bit state, format version 4 (``codes``: both moments per byte, ``reference.quantize_mv4``;
    ``m_scale``, ``v_scale``: the fp32 scales' bits as uint32); the other arguments as :func:`step_8bit`'s. A block
    of 128 elements is left as it was when its new ``v`` or that of ``blk_pair[b]`` (the other half of its tensor's
    256-element block, -1 where the tensor ends first) has a non-finite value."""
    beta1, omb1, beta2, omb2 = hp[0], hp[1], hp[2], hp[3]
    inv_bc2, eps, step_size, decay = hp[4], hp[5], hp[6], hp[7]
    nb = blk_seg.shape[0]
    for task in prange(ntasks):
        gbuf = np.empty(BLOCK4, np.float32)
        pbuf = np.empty(BLOCK4, np.float32)
        mbuf = np.empty(BLOCK4, np.float32)
        vbuf = np.empty(BLOCK4, np.float32)
        wbuf = np.empty(BLOCK4, np.uint32)
        abuf = np.empty(BLOCK4, np.float32)
        cbuf = np.empty(BLOCK4, np.uint32)
        # both halves of a 256-element block in one task, the first half first: it decides the skip of both, from
        # its own new v and the second half's (computed from that half's state before this task writes it)
        lo, hi = task * nb // ntasks, (task + 1) * nb // ntasks
        lo += 1 if 0 < lo < nb and blk_pair[lo] == lo - 1 else 0
        hi += 1 if 0 < hi < nb and blk_pair[hi] == hi - 1 else 0
        for b in range(u64(lo), u64(hi)):
            base = b * BLOCK4
            nv = u64(blk_valid[b])
            pair = blk_pair[b]
            second = pair >= 0 and pair < b
            if second:
                skip[b] = skip[pair]
                if skip[b]:
                    continue
            load_block(gbuf, pbuf, p32, p16, g32, g16, base, nv, BLOCK4, p_mode)
            sm = bits_f32(m_scale[b])
            sv = bits_f32(v_scale[b])
            for j in range(BLOCK4):
                # decode: m code c >= 1 is 2**(c - 7) (sign in bit 3) of the scale, times 2**(cv - 15); v code
                # cv >= 1 is 2**(2 cv - 30); code 0 is zero
                byte = u32(codes[base + j])
                cm = byte & LOW4
                mag = cm & MAG3
                a = bits_f32(u32((mag + M4_OFF) << S23))
                a = a if mag >= ONE_BITS else F_ZERO
                m = ((-a if cm >= SIGN3 else a) * sm) * bits_f32(u32(((byte >> S4) + M4_UNIT_OFF) << S23))
                v = v4_decoded(byte, sv)
                m, v, p = update(m, v, gbuf[j], pbuf[j], beta1, omb1, beta2, omb2, inv_bc2, eps, step_size, decay)
                pbuf[j] = p
                mbuf[j] = m
                vbuf[j] = v
            if not second:
                # nothing is written before this: a block whose new v (or its pair's) is not finite keeps everything
                bad = nonfinite(vbuf, nv)
                if pair >= 0:
                    bad += nonfinite_v4(codes, v_scale, g32, g16, u64(pair), u64(blk_valid[pair]), beta2, omb2)
                skip[b] = 1 if bad else 0
                if bad:
                    continue
            key = seg_key[blk_seg[b]]
            amax_v = finish_block(mbuf, vbuf, wbuf, pbuf, p32, p16, base, nv, BLOCK4, key, p_mode)[1]
            # v: reference.v4_scale, the envelope with 4x headroom, and the codes first (m is coded relative to them)
            env = sv * beta2
            av = bits_f32(amax_v)
            s32v = F32_NAN_BITS if amax_v > INF_BITS else f32_bits(env if av <= env else av * F_HEADROOM4)
            v_scale[b] = s32v
            inv_v = inverse_f32(s32v)
            amax_m = u32(0)
            for j in range(BLOCK4):
                v = vbuf[j]
                cv = v4_code(normalized(v, inv_v), wbuf[j])
                cv = ONE_BITS if (cv == u32(0)) and (v > F_ZERO) else cv
                cbuf[j] = cv
                a = abs(mbuf[j]) * bits_f32(u32((M4_UP - cv) << S23))  # |m| * 2**(15 - cv), exact
                abuf[j] = a
                amax_m = max(amax_m, u32(f32_bits(a) & ABS))
            s32m = F32_NAN_BITS if amax_m > INF_BITS else amax_m  # m: the exact fp32 absmax of |m| * 2**(15 - cv)
            m_scale[b] = s32m
            inv_m = inverse_f32(s32m)
            for j in range(BLOCK4):
                x = code_bits(normalized(abuf[j], inv_m), MIN_NORMAL_M4)
                r = ((wbuf[j] & M4_RMASK) << S15) | M4_HALF
                cm = u32(u32(x + r) >> S23) - M4_OFF
                cm = cm | SIGN3 if mbuf[j] < F_ZERO else cm
                codes[base + j] = np.uint8(cm | (cbuf[j] << S4))


# ---- host side ----------------------------------------------------------------------------------------------------

_EMPTY_F32 = np.empty(0, np.float32)
_EMPTY_U16 = np.empty(0, np.uint16)


def _np(t: torch.Tensor) -> np.ndarray:
    """A NumPy view of a contiguous CPU tensor; bf16 as its uint16 bits."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


class _ChunkTables:
    """What a chunk's kernel call needs besides the step's values: per block, its piece (segment) and how many of
    its elements are valid (the rest is block padding), and NumPy views of the tensors that persist between steps."""

    __slots__ = ("blk_seg", "blk_valid", "deltas", "arrays", "skip", "blk_pair", "blk_unit")

    def __init__(self, layout, ch):
        blk = layout.block
        nb = ch.length // blk
        self.blk_seg = np.zeros(nb, np.int32)
        self.blk_valid = np.full(nb, blk, np.int32)
        for j, (_, _, k, o, _) in enumerate(ch.segs):
            first, end = o // blk, -(-(o + k) // blk)
            self.blk_seg[first:end] = j
            if (o + k) % blk:
                self.blk_valid[end - 1] = (o + k) % blk
        # the non-finite check: the kernel's flag per block, and each block's 256-element block of its tensor (a piece
        # starts at a multiple of 256 of its tensor, at a multiple of blk of the chunk); 4-bit pairs the two halves
        self.skip = np.zeros(nb, np.uint8)
        self.blk_unit = np.zeros(nb, np.int64)
        self.blk_pair = np.full(nb, -1, np.int64)
        for _, a, k, o, _ in ch.segs:
            for b in range(o // blk, -(-(o + k) // blk)):
                e = b * blk - o + a  # the block's first element in its tensor
                self.blk_unit[b] = e // ref.BLOCK
                if blk < ref.BLOCK:
                    if e % ref.BLOCK == 0:
                        self.blk_pair[b] = b + 1 if (b + 1) * blk < o + k else -1
                    else:
                        self.blk_pair[b] = b - 1
        # the offset of each piece's element indices against the chunk's: (a - o) * GOLDEN, added to its key
        self.deltas = np.array([((a - o) * rnd.GOLDEN) & rnd.MASK32 for _, a, _, o, _ in ch.segs], np.uint64)
        io = ch.io
        if ch.direct:
            self.arrays = [_np(io[k].reshape(-1)) for k in ("p", *moment_keys(layout.fmt), *SCALE_KEYS)]
        else:
            self.arrays = None


FORMATS = ("8bit", "4bit")  # the state formats of this path (with fp32 or bf16 parameters)


def step_chunk(layout, ch, scratch, grads, s: ref.StepScalars, keys_mv, maximize: bool, rounding: str) -> dict:
    """One chunk of ``torch_engine``'s plan (8-bit or 4-bit state, fp32 or bf16 parameters, CPU): gather what a
    packed chunk needs into scratch, one kernel call, scatter back. ``keys_mv``: the moments' stream key per tensor
    slot. Returns ``{slot: blocks}``: the 256-element blocks left as they were for a non-finite new ``v``."""
    tables = ch.fused
    if tables is None:
        tables = ch.fused = _ChunkTables(layout, ch)
    io, n = ch.io, ch.length
    b = scratch.upto(n, layout.block)
    four = layout.fmt == "4bit"
    bf16 = layout.dtype == torch.bfloat16
    p_mode = 0 if not bf16 else (2 if rounding == "stochastic" else 1)
    if ch.direct:
        slot, a = ch.segs[0][:2]
        g = grads[slot].reshape(-1)[a : a + n]
        p, *codes, ms, vs = tables.arrays
    else:
        srcs = [grads[seg[0]] if seg[4] else grads[seg[0]].reshape(-1)[seg[1] : seg[1] + seg[2]] for seg in ch.segs]
        torch._foreach_copy_(io["g_dst"], srcs)
        g = b.g
        if bf16:  # gathered as bf16 into the chunk's bf16 buffer, stepped there, copied back below
            torch._foreach_copy_(io["p_out"], io["p_src"])
            p = _np(b.typed("p_store", torch.bfloat16))
        else:
            torch.cat(io["gather"][0][2], out=b.p)
            p = _np(b.p)
        if io["moments_in"][0]:
            torch._foreach_copy_(*io["moments_in"])
        codes = [_np(io["mom"])] if four else [_np(io["mom_m"]), _np(io["mom_v"])]
        ms, vs = _np(io["scl_m"]), _np(io["scl_v"])
    vs = vs.view(np.uint32)  # the fp32 v scales (8-bit version 3, 4-bit version 4) as their bits
    if four:
        ms = ms.view(np.uint32)  # 4-bit version 4: fp32 m scales too
    if g.dtype == torch.float32:
        g32, g16 = _np(g), _EMPTY_U16
    elif g.dtype == torch.bfloat16:
        g32, g16 = _EMPTY_F32, _np(g)
    else:  # fp16 gradients: widened into the scratch first (exact)
        b.g.copy_(g)
        g32, g16 = _np(b.g), _EMPTY_U16
    p32, p16 = (_EMPTY_F32, p) if bf16 else (p, _EMPTY_U16)
    seg_key = np.array([keys_mv[seg[0]] for seg in ch.segs], np.uint64)
    seg_key = ((seg_key + tables.deltas) & np.uint64(rnd.MASK32)).astype(np.uint32)
    hp = np.array(
        [
            s.beta1,
            -s.one_minus_beta1 if maximize else s.one_minus_beta1,
            s.beta2,
            s.one_minus_beta2,
            s.inv_bc2_sqrt,
            s.eps,
            s.step_size,
            s.decay,
        ],
        np.float32,
    )
    args = (tables.blk_seg, tables.blk_valid, seg_key, hp, p_mode)
    with _LOCK:
        ntasks = set_threads()
        if four:
            step_4bit(p32, p16, g32, g16, *codes, ms, vs, *args, ntasks, tables.skip, tables.blk_pair)
        else:
            step_8bit(p32, p16, g32, g16, *codes, ms, vs, *args, ntasks, tables.skip)
    if not ch.direct:
        torch._foreach_copy_(io["p_src"], io["p_out"])
        if io["moments_out"][0]:
            torch._foreach_copy_(*io["moments_out"])
    if not tables.skip.any():
        return {}
    skipped: dict[int, set] = {}
    for b in np.flatnonzero(tables.skip):
        skipped.setdefault(ch.segs[tables.blk_seg[b]][0], set()).add(int(tables.blk_unit[b]))
    return {slot: len(units) for slot, units in skipped.items()}


def set_threads() -> int:
    """numba's thread count set to torch's (at most numba's pool size), so that both run at the same count."""
    n = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    if numba.get_num_threads() != n:
        numba.set_num_threads(n)
    return n


def warm_up(optimizer_cls) -> float:
    """Compile both kernels, or load them from numba's disk cache, so that no training run's first step does; the
    seconds it took. The comparison runner calls it once before a CPU grid's runs (each run is a new process).

    Args:
        optimizer_cls: the optimizer class whose step compiles them (``apexw_hf.optim.ApexW``), passed in so that
            this module, which the optimizer's engine imports, does not import the optimizer back.
    """
    t0 = time.perf_counter()
    for fmt in FORMATS:
        p = torch.nn.Parameter(torch.zeros(300))
        p.grad = torch.zeros(300)
        optimizer_cls([p], state_format=fmt, engine="torch").step()
    return time.perf_counter() - t0
