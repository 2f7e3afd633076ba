"""8-bit AdamW step of one chunk as one fused loop compiled by numba: the CPU path of the plain-PyTorch engine.

:mod:`apexw_hf.optim.torch_engine` plans a param group into chunks (large tensors in place, small ones packed with
block padding) and, for ``8bit`` state on the CPU with fp32 or bf16 parameters, hands each chunk to
:func:`step_chunk_8bit` when numba is installed (``pip install "apexw_hf[cpu]"``; numba ships LLVM in its wheel, so
no compiler is needed). Each block of :data:`~apexw_hf.reference.BLOCK` elements is then read once and written once:
decode both moments, the update, the random word, the parameter's rounding, the block scales and the new codes, in
one pass over the chunk, split over ``torch.get_num_threads()`` threads. The torch passes of
:mod:`apexw_hf.optim.torch_passes` (about 64 operations per chunk, each ending in a barrier of the threads) remain
the path without numba and for the other formats and dtypes.

The bits are those of ``reference.adamw_step_ref_`` (``tests/optim/test_numba_engine.py``): every fp32 operation is
the reference's, one IEEE operation in fp32 at a time (constants are fp32, no ``fastmath``, so no fused multiply-add
and no reassociation), the square root is the fp32 instruction (correctly rounded), integer work is uint32 with
wraparound, and the special values follow the reference's own rules, so no chunk needs another path: a NaN in a
block makes its scale NaN and its codes those of ``y = 0`` (``reference._normalized``), an infinite scale gives
``1 / scale = 0``, a tiny bf16 scale ``1 / scale = inf``. Per block:

* decode (``reference.dequantize_m``/``dequantize_v``): the code's value built on the fp32 bits, times the scale;
* the update in the reference's operation order (``maximize`` negates ``1 - beta1``: ``(-g) * c == g * (-c)``);
* the block maxima of ``|m|`` and ``v`` as integer maxima of their fp32 bits (a NaN has the largest bits, so it
  propagates as ``torch.amax``'s does), rounded up to bf16;
* the random word ``mix32(index * GOLDEN + key)``, its bits 10-15 rounding ``m``, 0-9 ``v`` and 16-31 a bf16
  parameter (``reference.param_stream``);
* the codes of ``reference.minifloat_code``, a nonzero ``v`` never getting code 0.

A packed chunk's block padding (``blk_valid`` below 256) holds ``m = v = 0``, as in ``reference._blocks``.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from .. import _random as rnd
from .. import reference as ref
from .state import SCALE_KEYS

_BLOCK = ref.BLOCK


@intrinsic
def f32_bits(typingctx, x):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def bits_f32(typingctx, x):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


u32 = np.uint32
u64 = np.uint64
BLK = u64(_BLOCK)
f32 = np.float32
GOLDEN, MIX1, MIX2 = u32(rnd.GOLDEN), u32(rnd.MIX1), u32(rnd.MIX2)
S16, S13, S10, S9, S14 = u32(16), u32(13), u32(10), u32(9), u32(14)
LOW16, RNE_BIAS = u32(0xFFFF), u32(0x7FFF)
ABS = u32(0x7FFFFFFF)
INF_BITS = u32(0x7F800000)
BF16_NAN = np.uint16(0x7FC0)
ONE_BITS = u32(1)
F_ONE, F_ZERO = f32(1.0), f32(0.0)
MIN_NORMAL = f32(ref.MIN_NORMAL)
EXP23 = u32(1 << 23)
M_HALF, V_HALF = u32(1 << 13), u32(1 << 8)
M_RMASK, V_RMASK = u32(63), u32(1023)
M_SHIFT, V_SHIFT = u32(20), u32(19)
# a code plus M_OFF (V_OFF), shifted, is the fp32 bits of a normal code's value; encoding subtracts it again
M_OFF, V_OFF = u32(112 << 3), u32(112 << 4)
M_SUB, V_SUB = u32(113 << 3), u32(113 << 4)  # ... a subnormal code's value plus 2**-14
M_SUBMAX, V_SUBMAX = u32(8), u32(16)
SIGN7, MAG7 = u32(128), u32(127)


@njit(inline="always")
def mix32(x):
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
    s = bits_f32(u32(scale16) << S16)
    if s == F_ZERO:
        return F_ZERO
    return F_ONE / s


@njit(parallel=True, cache=True, nogil=True)
def step_8bit(p32, p16, g32, g16, m_codes, v_codes, m_scale, v_scale, blk_seg, blk_valid, seg_key, hp, p_mode, ntasks):
    """One chunk. ``p_mode``: 0 fp32 parameters (``p32``), 1 bf16 rounded to nearest, 2 bf16 stochastically
    (``p16``, the bf16 bits); gradients in ``g32`` (fp32) or, when it is empty, ``g16`` (bf16 bits)."""
    beta1, omb1, beta2, omb2, inv_bc2, eps, step_size, decay = (
        hp[0],
        hp[1],
        hp[2],
        hp[3],
        hp[4],
        hp[5],
        hp[6],
        hp[7],
    )
    nb = blk_seg.shape[0]
    g_bf16 = g32.shape[0] == 0
    for task in prange(ntasks):
        gbuf = np.empty(_BLOCK, np.float32)
        pbuf = np.empty(_BLOCK, np.float32)
        mbuf = np.empty(_BLOCK, np.float32)
        vbuf = np.empty(_BLOCK, np.float32)
        wbuf = np.empty(_BLOCK, np.uint32)
        # unsigned indices: numba then drops its negative-index wraparound, which would stop vectorization
        for b in range(u64(task * nb // ntasks), u64((task + 1) * nb // ntasks)):
            base = b * BLK
            nv = u64(blk_valid[b])
            key = seg_key[blk_seg[b]]
            # ---- gradient and parameter in fp32 (zero past the valid elements of a padded block)
            if g_bf16:
                for j in range(nv):
                    gbuf[j] = bits_f32(u32(g16[base + j]) << S16)
            else:
                for j in range(nv):
                    gbuf[j] = g32[base + j]
            for j in range(nv, BLK):
                gbuf[j] = F_ZERO
            if p_mode == 0:
                for j in range(nv):
                    pbuf[j] = p32[base + j]
            else:
                for j in range(nv):
                    pbuf[j] = bits_f32(u32(p16[base + j]) << S16)
            for j in range(nv, BLK):
                pbuf[j] = F_ZERO
            # ---- decode, update (reference order, fp32), the new parameter
            sm = bits_f32(u32(m_scale[b]) << S16)
            sv = bits_f32(u32(v_scale[b]) << S16)
            for j in range(BLK):
                cm = u32(m_codes[base + j])
                mag = cm & MAG7
                am = bits_f32(u32((mag + M_OFF) << M_SHIFT))
                am_sub = bits_f32(u32((mag + M_SUB) << M_SHIFT)) - MIN_NORMAL
                a = am if mag >= M_SUBMAX else am_sub
                m = (-a if cm >= SIGN7 else a) * sm
                cv = u32(v_codes[base + j])
                av = bits_f32(u32((cv + V_OFF) << V_SHIFT))
                av_sub = bits_f32(u32((cv + V_SUB) << V_SHIFT)) - MIN_NORMAL
                v = (av if cv >= V_SUBMAX else av_sub) * sv
                g = gbuf[j]
                m = m * beta1 + g * omb1
                v = v * beta2 + (g * g) * omb2
                denom = np.sqrt(v) * inv_bc2 + eps
                pbuf[j] = pbuf[j] * decay - (m / denom) * step_size
                mbuf[j] = m
                vbuf[j] = v
            for j in range(nv, BLK):
                mbuf[j] = F_ZERO
                vbuf[j] = F_ZERO
            # ---- random words: mix32(index * GOLDEN + key), index counted from the piece's start
            for j in range(BLK):
                wbuf[j] = mix32(u32(u32(base + j) * GOLDEN + key))
            # ---- parameter out
            if p_mode == 0:
                for j in range(nv):
                    p32[base + j] = pbuf[j]
            elif p_mode == 1:
                for j in range(nv):
                    x = pbuf[j]
                    bits = f32_bits(x)
                    r = u32(bits + RNE_BIAS + ((bits >> S16) & ONE_BITS)) >> S16
                    p16[base + j] = BF16_NAN if x != x else np.uint16(r)
            else:
                for j in range(nv):
                    x = pbuf[j]
                    r = u32(f32_bits(x) + (wbuf[j] >> S16)) >> S16
                    p16[base + j] = BF16_NAN if x != x else np.uint16(r)
            # ---- block scales: the bits' maxima (NaN above inf above every finite value)
            amax_m = u32(0)
            amax_v = u32(0)
            for j in range(BLK):
                amax_m = max(amax_m, f32_bits(mbuf[j]) & ABS)
                amax_v = max(amax_v, f32_bits(vbuf[j]) & ABS)
            s16m = round_up_bf16(amax_m)
            s16v = round_up_bf16(amax_v)
            m_scale[b] = s16m
            v_scale[b] = s16v
            inv_m = inverse(s16m)
            inv_v = inverse(s16v)
            # ---- codes
            for j in range(BLK):
                w = wbuf[j]
                m = mbuf[j]
                y = abs(m) * inv_m
                y = F_ONE if y > F_ONE else y
                y = y if y == y else F_ZERO
                x = f32_bits(y) if y >= MIN_NORMAL else u32(f32_bits(y + MIN_NORMAL) - EXP23)
                r = (((w >> S10) & M_RMASK) << S14) | M_HALF
                c = u32(u32(x + r) >> M_SHIFT) - M_OFF
                c = c | SIGN7 if m < F_ZERO else c
                m_codes[base + j] = np.uint8(c)
                v = vbuf[j]
                y = v * inv_v
                y = F_ONE if y > F_ONE else y
                y = y if y == y else F_ZERO
                x = f32_bits(y) if y >= MIN_NORMAL else u32(f32_bits(y + MIN_NORMAL) - EXP23)
                r = ((w & V_RMASK) << S9) | V_HALF
                c = u32(u32(x + r) >> V_SHIFT) - V_OFF
                c = ONE_BITS if (c == u32(0)) and (v > F_ZERO) else c
                v_codes[base + j] = np.uint8(c)


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

    __slots__ = ("blk_seg", "blk_valid", "deltas", "arrays")

    def __init__(self, layout, ch):
        blk = _BLOCK
        nb = ch.length // blk
        self.blk_seg = np.zeros(nb, np.int32)
        self.blk_valid = np.full(nb, blk, np.int32)
        for j, (_, _, k, o, _) in enumerate(ch.segs):
            first, end = o // blk, -(-(o + k) // blk)
            self.blk_seg[first:end] = j
            if (o + k) % blk:
                self.blk_valid[end - 1] = (o + k) % blk
        # the offset of each piece's element indices against the chunk's: (a - o) * GOLDEN, added to its key
        self.deltas = np.array([((a - o) * rnd.GOLDEN) & rnd.MASK32 for _, a, _, o, _ in ch.segs], np.uint64)
        io = ch.io
        if ch.direct:
            self.arrays = [_np(io[k].reshape(-1)) for k in ("p", "exp_avg", "exp_avg_sq")]
            self.arrays += [_np(io[k]) for k in SCALE_KEYS]
        else:
            self.arrays = None


def step_chunk_8bit(layout, ch, scratch, grads, s: ref.StepScalars, keys_mv, maximize: bool, rounding: str) -> None:
    """One chunk of ``torch_engine``'s plan (8-bit state, fp32 or bf16 parameters, CPU): gather what a packed chunk
    needs into scratch, one kernel call, scatter back. ``keys_mv``: the moments' stream key per tensor slot."""
    tables = ch.fused
    if tables is None:
        tables = ch.fused = _ChunkTables(layout, ch)
    io, n = ch.io, ch.length
    b = scratch.upto(n, _BLOCK)
    bf16 = layout.dtype == torch.bfloat16
    p_mode = 0 if not bf16 else (2 if rounding == "stochastic" else 1)
    if ch.direct:
        slot, a = ch.segs[0][:2]
        g = grads[slot].reshape(-1)[a : a + n]
        p, mc, vc, ms, vs = tables.arrays
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
        mc, vc, ms, vs = (_np(io[k]) for k in ("mom_m", "mom_v", "scl_m", "scl_v"))
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
    ntasks = set_threads()
    step_8bit(p32, p16, g32, g16, mc, vc, ms, vs, tables.blk_seg, tables.blk_valid, seg_key, hp, p_mode, ntasks)
    if not ch.direct:
        torch._foreach_copy_(io["p_src"], io["p_out"])
        if io["moments_out"][0]:
            torch._foreach_copy_(*io["moments_out"])


def set_threads() -> int:
    """numba's thread count set to torch's (at most numba's pool size), so that both run at the same count."""
    n = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    if numba.get_num_threads() != n:
        numba.set_num_threads(n)
    return n
