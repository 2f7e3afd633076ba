"""Elementwise passes of the plain-PyTorch engine (:mod:`apexw_hf.engines.torch`) over one chunk.

Each function is one piece of ``reference.adamw_step_ref_`` rewritten as in-place or ``out=`` passes over
preallocated scratch, with the same bits: the random words, stochastic rounding to bf16, and the 4-bit codes (format
version 2; 8-bit state of format version 3 is coded by the reference's own functions, :mod:`apexw_hf.engines.torch`).
Scalar operands are 0-dim tensors (:class:`Consts`): a Python number costs a conversion per call,
and for integer ops it also takes a slower, unvectorized path. No fused multiply-add anywhere: ``addcmul`` and
``add(alpha=)`` on floats are fused in torch's CPU kernels, so only plain ``mul``/``add``/``div`` touch fp32 values.
No arithmetic or shift writes an ``out=`` tensor of another dtype than its operands either (the comparisons written
as fp32 1.0/0.0, ``sign_and_abs``, are the exception, and not yet run on a GPU): the CPU computes in the operands'
dtype and casts the result, but CUDA runs many kernels (the shifts among them) in the output's dtype and casts the
operands to it, so
``bitwise_right_shift(int32, 16, out=int16)`` truncates before it shifts and gives 0 or -1 (the bf16 NaN 0xFFFF) on a
GPU. The top 16 bits of int32 words are instead shifted down in int32 and copied into int16 (a conversion keeps the
low 16 bits on every device; :func:`bf16_stochastic`), or, for the few block scales, copied from a strided int16
view of the words (:func:`high_halves`; a strided copy is about twice as slow as the shift and the copy together).

Encoding (``reference.minifloat_code``) without a select. The reference codes the fp32 bits of ``y`` for ``y`` at
or above the least normal code value ``n`` and those of ``fl(y + n)`` with the exponent lowered by one below, that is
the bits of ``fl(y + n) / 2``. For non-negative ``y`` that second value is larger than ``y`` exactly when ``y < n``,
so the coded value is ``w = max(y, fl(y + n) / 2)``. Scaled by ``2**k`` (exact), ``w * 2**k = max(y * 2**k,
fl(y * 2**(k-1) + n * 2**(k-1)))``, and the power of two is folded into the per-block factor that normalizes by the
scale: ``y * 2**k = fl(|x| * (inv * 2**k))`` whenever that product is a normal number, and when it is not, ``y`` is
so small that the other operand of the max wins with the same bits either way. ``k`` is chosen so that the exponent
offset the reference subtracts is a multiple of 256 and vanishes when the int32 result is stored as uint8 (which keeps
the low 8 bits). This needs ``inv * 2**k`` exact and ``y <= 1 + 2**-23`` without the reference's clamp: true when
every nonzero block scale is in [2**-126, 2**100] (:data:`FAST_SCALE_MIN`, :data:`FAST_SCALE_MAX`); other chunks take
the reference's clamp and NaN step first (:func:`encode_4bit`, ``exact=True``), and chunks with a NaN or an infinity
go to the reference itself. ``y * 2**(k-1)`` is taken as ``(y * 2**k) * 0.5``, exact wherever it matters (a normal
number).

4-bit state (``reference.quantize_mv4``, format version 2: an exact fp32 ``v`` scale, 16 random bits for ``v``) is
that encoding without mantissa bits, with blocks of
:data:`~apexw_hf.reference.BLOCK4`: ``code = ((bits(w * 2**k) + offset) >> 23) - (127 - bias + k)`` per moment, with
``k = -8`` for ``m`` (bias 7) and ``k = -7`` for ``v`` (bias 15), so that the byte ``m code + 16 * v code`` has the
offset ``112 + 16 * 105 = 7 * 256``, which vanishes in the uint8 store; the sign of ``m`` (bit 3) is the bits of 1.0
times -8, which adds 8 (mod 256) once shifted (``lt(m, 0)`` written as fp32 1.0/0.0). ``inv * 2**k`` is exact in
the fast range for both ``k``. Decoding goes through fp16: the ``v`` code is an fp16 exponent of bias 15 (code 0
the fp16 zero), and so is the ``m`` code, read as ``2**(c - 15)`` and multiplied by ``2**8 * scale`` (exact, as
``2**(c - 7) * scale`` in the reference) unless a block scale reaches ``2**120``, where ``2**8 * scale`` would overflow
and the codes are scaled by ``2**8`` instead.
"""

from __future__ import annotations

import math
import sys

import numpy as np
import torch

from .. import _random as rnd
from .. import reference as ref

_BLOCK = ref.BLOCK
FAST_SCALE_MIN = 2.0**-126  # nonzero block absmax at least this ... (see the module docstring)
FAST_SCALE_MAX = 2.0**100  # ... and at most this: the 8-bit encoding's fast path
# 4-bit: no mantissa bits, so the code is what the random offset carries into bit 23 (module docstring)
M4_K, V4_K = -8, -7
M4_OFFSET, V4_OFFSET = 127 - ref.M4_BIAS + M4_K, 127 - ref.BIAS + V4_K  # 112, 105: exponent field of code 0
# m: the word's bits 0-5 to 17-22; v (16 random bits, reference.v4_rand_offset): bits 6-21 to 7-22
M4_RAND_UP = 23 - ref.M_RAND_BITS - ref.M4_RAND_SHIFT  # 17
V4_RAND_UP = 23 - ref.V4_RAND_BITS - ref.V4_RAND_SHIFT  # 1
M4_RAND_MASK, V4_RAND_MASK = ((1 << ref.M_RAND_BITS) - 1) << 17, ((1 << ref.V4_RAND_BITS) - 1) << 7
M4_RAND_HALF, V4_RAND_HALF = 1 << 16, 1 << 6
M4_SIGN_ALPHA = -8  # 127 * -8 = 8 (mod 256): the bits of 1.0 times this set the sign bit of the m code
M4_DECODE_SCALE_MAX = 2.0**120  # below this, 2**8 * scale is finite (and exact)
_HIGH_HALF = 1 if sys.byteorder == "little" else 0  # the int16 of an int32 that holds its top 16 bits
assert (M4_OFFSET + 16 * V4_OFFSET) % 256 == 0 and (127 * M4_SIGN_ALPHA) % 256 == ref.M4_SIGN


class Consts:
    """0-dim tensors of the constants, on one device (and a few per-moment columns: row 0 m, row 1 v)."""

    def __init__(self, device):
        def f(x):
            return torch.tensor(x, dtype=torch.float32, device=device)

        def i(x):
            return torch.tensor(rnd.to_int32(x), dtype=torch.int32, device=device)

        def col(xs, dtype):
            return torch.tensor(xs, dtype=dtype, device=device)[:, None]

        self.one, self.zero = f(1.0), f(0.0)
        self.mix1, self.mix2 = i(rnd.MIX1), i(rnd.MIX2)
        self.s13, self.s16, self.low16, self.low19 = i(13), i(16), i(0xFFFF), i(0x7FFFF)
        self.bf16_up, self.high16 = i(0xFFFF), i(~0xFFFF)
        self.u8_one = torch.tensor(1, dtype=torch.uint8, device=device)
        self.i_one = i(1)
        self.key = i(0)  # a chunk's hash constant (hash_into): an int32 0-dim tensor, not a slower Python int
        # 4-bit encoding, per moment (as above); the exponent field of v code 0, and v code 1's value times 2**k
        self.k4_col = col([2.0**M4_K, 2.0**V4_K], torch.float32)
        self.add4_col = col([2.0 ** (M4_K - ref.M4_BIAS), 2.0 ** (V4_K - ref.BIAS)], torch.float32)
        self.up4_col = col([M4_RAND_UP, V4_RAND_UP], torch.int32)
        self.mask4_col = col([M4_RAND_MASK, V4_RAND_MASK], torch.int32)
        self.half4_col = col([M4_RAND_HALF, V4_RAND_HALF], torch.int32)
        self.s23, self.v4_zero, self.v4_least = i(23), i(V4_OFFSET), f(2.0 ** (V4_K + 1 - ref.BIAS))
        # reference.v4_log_warp
        self.exp_mask, self.mant_mask, self.one_bits = i(0x7F800000), i(0x7FFFFF), i(0x3F800000)
        self.log_x = [f(x) for x in ref.V4_LOG_X]
        # 4-bit decoding: the byte in both rows, m's nibble to bits 12-15 and v's to 12-15, then an arithmetic shift
        # by 2 puts each code in the fp16 exponent (m's sign also lands on bits 13-15: kept in 15, cleared in 13-14)
        self.dec4_shift_col = col([12, 8], torch.int16)
        self.s2_16 = torch.tensor(2, dtype=torch.int16, device=device)
        self.dec4_mask_col = col([0x9C00 - (1 << 16), 0x3C00], torch.int16)  # int16 bits 0x9C00
        self.f256 = f(256.0)


class Buffers:
    """Views of the scratch for a chunk of ``n`` elements in blocks of ``block`` (cached per ``(n, block)``), NumPy
    views where a root is taken.

    ``m`` and ``v`` are adjacent (``mv``, shape (2, n) as ``mv2``), and so is every 8-bit (4-bit) buffer of the two
    moments (block maxima, scales, random offsets): their quantization work is one operation over both, with a column
    of per-moment constants where they differ.
    """

    F32 = ("g", "a", "p")
    I32 = ("h", "t", "z")

    def __init__(self, scratch, n, block=_BLOCK):
        self.n, self.block = n, block
        self.cpu = scratch.device.type == "cpu"
        self._scratch = scratch
        self._typed = {}
        for name in self.F32 + self.I32:
            setattr(self, name, getattr(scratch, name)[:n])
        self.base = scratch.base[:n]
        self._counts = {}
        self.mv = scratch.mv[: 2 * n]
        self.mv2 = self.mv.view(2, n)
        self.m, self.v = self.mv[:n], self.mv[n:]
        self.mv_i = self.mv.view(torch.int32)
        self.u = scratch.u[: 2 * n]
        self.u2, self.u_m, self.u_v = self.u.view(2, n), self.u[:n], self.u[n:]
        self.a_i = self.a.view(torch.int32)
        self.r = scratch.r[: 2 * n]
        self.r2, self.rm, self.rv = self.r.view(2, n), self.r[:n], self.r[n:]
        if self.cpu:
            self.np = {"v": self.v.numpy(), "a": self.a.numpy()}
        nb = -(-n // block)
        self.blocks = nb
        if n % block == 0:
            self.mv_b = self.mv.view(2 * nb, block)
            self.base_b, self.h_b = self.base.view(nb, block), self.h.view(nb, block)
        self.x16 = scratch.x16[: 2 * n]
        self.x16_2, self.x16_f16 = self.x16.view(2, n), self.x16.view(torch.float16)
        self.x16_m, self.x16_v = self.x16[:n], self.x16[n:]
        self.nz = scratch.nz[:n]
        # per block (m rows, then v rows): absmax, scale (fp32 bits, bf16 bits), 1 / scale, factor, decoded scale
        self.amax = scratch.amax[: 2 * nb]
        self.amax_i = self.amax.view(torch.int32)
        self.s_i = scratch.s_i[: 2 * nb]
        self.s_f = self.s_i.view(torch.float32)
        self.scale16 = scratch.scale16[: 2 * nb]
        self.scales = self.scale16.view(torch.bfloat16)
        self.m_scale, self.v_scale = self.scales[:nb], self.scales[nb:]
        self.inv = scratch.inv[: 2 * nb]
        self.inv2 = self.inv.view(2, nb)
        self.zero_blocks = scratch.zero_blocks[: 2 * nb]
        self.fac = scratch.fac[: 2 * nb]
        self.fac2, self.fac_col = self.fac.view(2, nb), self.fac[:, None]
        self.sdec = scratch.sdec[: 2 * nb]
        self.sdec_col, self.sdec_mv = self.sdec[:, None], self.sdec.view(2, nb)

    def block_counts(self, offsets: tuple):
        """Blocks per piece of a packed chunk whose pieces start at these offsets, or None unless every piece
        starts at a block (an int64 tensor, cached)."""
        if offsets not in self._counts:
            blk = self.block
            ok = self.n % blk == 0 and all(o % blk == 0 for o in offsets)
            ends = offsets[1:] + (self.n,)
            self._counts[offsets] = (
                torch.tensor([(e - o) // blk for o, e in zip(offsets, ends)], device=self.base.device) if ok else None
            )
        return self._counts[offsets]

    def typed(self, name, dtype):
        key = (name, dtype)
        buf = self._typed.get(key)
        if buf is None:
            buf = self._typed[key] = self._scratch.typed(name, dtype)[: self.n]
        return buf


class Scratch:
    """Preallocated chunk buffers of one device: fp32, int32, and storage dtypes on demand."""

    def __init__(self, device, size: int):
        self.device, self.size = device, size

        def e(k, dtype):
            return torch.empty(k, dtype=dtype, device=device)

        for name in Buffers.F32:
            setattr(self, name, e(size, torch.float32))
        self.t, self.z = e(size, torch.int32), e(size, torch.int32)
        self.mv, self.u = e(2 * size, torch.float32), e(2 * size, torch.float32)
        # Buffers that share u's memory, for a smaller footprint in the caches (an 8-bit chunk touches about 33 bytes
        # of scratch per element, base included): the decoded fp16 bits (before the update writes u), the hash word h
        # (after the update; read again only by full_bits, before any encoding writes u), and the integer codes r.
        self.x16 = self.u.view(torch.int16)[: 2 * size]
        self.h, self.r = self.u.view(torch.int32)[:size], self.u.view(torch.int32)
        self.nz = e(size, torch.uint8)
        nb = -(-size // min(_BLOCK, ref.BLOCK4))  # per-block buffers for the smaller block
        self.amax, self.s_i, self.scale16 = e(2 * nb, torch.float32), e(2 * nb, torch.int32), e(2 * nb, torch.int16)
        self.inv, self.fac, self.sdec = e(2 * nb, torch.float32), e(2 * nb, torch.float32), e(2 * nb, torch.float32)
        self.zero_blocks = e(2 * nb, torch.bool)
        # index * GOLDEN mod 2**32 (int64 -> int32 keeps the low 32 bits)
        self.base = (torch.arange(size, dtype=torch.int64, device=device) * rnd.GOLDEN).to(torch.int32)
        self.c = Consts(device)
        self._typed = {}
        self._views = {}

    def typed(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        buf = self._typed.get((name, dtype))
        if buf is None:
            buf = self._typed[(name, dtype)] = torch.empty(self.size, dtype=dtype, device=self.device)
        return buf

    def upto(self, n: int, block: int = _BLOCK) -> Buffers:
        b = self._views.get((n, block))
        if b is None:
            b = self._views[(n, block)] = Buffers(self, n, block)
        return b


# ---- elementwise building blocks (all in place or into scratch) ------------------------------------------------


def sqrt_into(b: Buffers, x: torch.Tensor, x_np, out: torch.Tensor, out_np) -> None:
    """Correctly rounded fp32 ``sqrt(x)`` into ``out`` (the IEEE instruction through NumPy on the CPU)."""
    if b.cpu:
        np.sqrt(x_np if x_np is not None else x.numpy(), out=out_np)
    else:
        out.copy_(ref.sqrt_rn(x))


def hash_into(b: Buffers, c: Consts, segs, keys, *, top: bool = True, low: bool = True) -> None:
    """``reference.hash_uniform_bits`` of every element, in pieces (int32 bit patterns):

    * ``b.h``: the word before mix32's last xor-shift, whose top 16 bits are already final (:func:`full_bits`
      completes it);
    * ``b.t`` (``top``): the final word's top 16 bits, in [0, 2**16);
    * ``b.z`` (``low``): the final word's low 16 bits in its low 16 bits; with ``top`` it is the whole final word.

    Element ``j`` of a tensor piece starting at element ``a`` and at chunk offset ``o`` gets
    ``mix32((a + j) * GOLDEN + key) = mix32((o + j) * GOLDEN + d)`` with ``d = key + (a - o) * GOLDEN``: the chunk's
    ``index * GOLDEN`` plus a constant per piece: per block when every piece starts at a block (8-bit chunks
    always), else spread with a cumsum.
    """
    h, t = b.h, b.t
    if len(segs) == 1:
        _, a, _, o = segs[0][:4]
        torch.add(b.base, c.key.fill_(rnd.to_int32(keys[0] + (a - o) * rnd.GOLDEN)), out=h)
    else:
        ds = [(key + (seg[1] - seg[3]) * rnd.GOLDEN) & rnd.MASK32 for seg, key in zip(segs, keys)]
        counts = b.block_counts(tuple(seg[3] for seg in segs))
        if counts is not None:  # every piece starts at a block: one constant per block, broadcast
            d = torch.tensor([rnd.to_int32(x) for x in ds], dtype=torch.int32, device=h.device)
            d = torch.repeat_interleave(d, counts, output_size=b.blocks)
            torch.add(b.base_b, d[:, None], out=b.h_b)
        else:
            k = b.z
            k.zero_()
            offs, deltas, prev = [], [], 0
            for seg, d in zip(segs, ds):
                offs.append(seg[3])
                deltas.append(rnd.to_int32(d - prev))
                prev = d
            k[offs] = torch.tensor(deltas, dtype=torch.int32, device=k.device)
            torch.cumsum(k, 0, dtype=torch.int32, out=t)  # accumulates in int64, stores mod 2**32
            torch.add(b.base, t, out=h)
    # murmur3 fmix32; int32 multiplies wrap (the product mod 2**32), right shifts of int32 are arithmetic: masked
    torch.bitwise_right_shift(h, c.s16, out=t)
    h.bitwise_xor_(t.bitwise_and_(c.low16))
    h.mul_(c.mix1)
    torch.bitwise_right_shift(h, c.s13, out=t)
    h.bitwise_xor_(t.bitwise_and_(c.low19))
    h.mul_(c.mix2)
    if not (top or low):
        return
    torch.bitwise_right_shift(h, c.s16, out=t)  # the low 16 bits of t are the top 16 of h
    if top:
        t.bitwise_and_(c.low16)
    if low:
        torch.bitwise_xor(h, t, out=b.z)


def full_bits(b: Buffers) -> torch.Tensor:
    """The complete random words of :func:`hash_into` as the reference's int64 values in [0, 2**32)."""
    x = b.h.to(torch.int64) & rnd.MASK32
    return x ^ (x >> 16)


def bf16_stochastic(x: torch.Tensor, rand: torch.Tensor, t: torch.Tensor, out: torch.Tensor, c: Consts) -> None:
    """``reference.round_to_bf16_stochastic`` of non-NaN ``x``: the top 16 bits of (bits of x + 16 random bits).

    ``rand``: int32 in [0, 2**16); ``t`` (overwritten) may be ``rand``. The sum shifted down by 16 in int32 (an
    arithmetic shift: its low 16 bits are the sum's top 16) and converted to int16, which keeps the low 16 bits.
    """
    torch.add(x.view(torch.int32), rand, out=t)
    out.view(torch.int16).copy_(t.bitwise_right_shift_(c.s16))


def high_halves(words: torch.Tensor) -> torch.Tensor:
    """The top 16 bits of each word of the contiguous 1-D int32 ``words``: an int16 view of them (stride 2).

    Copied into an int16 tensor, these are ``words >> 16`` stored as int16 on every device; the shift with an int16
    ``out=`` is not (module docstring: CUDA casts the words to int16 first).
    """
    return words.view(torch.int16)[_HIGH_HALF::2]


# ---- block scales ------------------------------------------------------------------------------------------------


def block_scales(b: Buffers, c: Consts, m_scale_out, v_scale_out) -> str:
    """4-bit block scales of both moments (from ``b.m = |m|`` and ``b.v``, in blocks of ``b.block``): the bf16 ``m``
    scale (absmax rounded up) into ``m_scale_out``, the exact fp32 ``v`` absmax (format version 2) into
    ``v_scale_out``, ``1 / scale`` into ``b.inv`` and the normalizing factors of the encoding into ``b.fac``.

    Returns the encoding path: ``"fast"``, ``"exact"`` (finite, but a nonzero scale outside the fast range), or
    ``"ref"`` (a NaN or an infinity: the reference encodes the chunk, and nothing is written here).
    """
    torch.amax(b.mv_b, 1, out=b.amax)
    hi = float(b.amax.max())  # NaN propagates
    if not math.isfinite(hi):
        return "ref"
    # round up to bf16 on the bits (finite, non-negative): the fp32 bits of the scale, then its bf16 bits
    torch.add(b.amax_i, c.bf16_up, out=b.s_i).bitwise_and_(c.high16)
    nb = b.blocks
    b.s_i[nb:].copy_(b.amax_i[nb:])  # v: the exact absmax
    b.scale16[:nb].copy_(high_halves(b.s_i[:nb]))
    m_scale_out.copy_(b.m_scale)
    v_scale_out.copy_(b.amax[nb:])
    torch.reciprocal(b.s_f, out=b.inv)
    torch.eq(b.amax, c.zero, out=b.zero_blocks)
    b.inv.masked_fill_(b.zero_blocks, 0.0)  # 1/s may still be inf for a tiny s, as in the reference
    fast = hi <= FAST_SCALE_MAX and float(b.inv.max()) <= 1.0 / FAST_SCALE_MIN
    if fast:
        torch.mul(b.inv2, c.k4_col, out=b.fac2)
    return "fast" if fast else "exact"


def sign_and_abs(b: Buffers, c: Consts) -> None:
    """``b.a`` = 1.0 where ``b.m < 0`` (not -0), 0.0 elsewhere; then ``b.m`` = ``|b.m|``."""
    torch.lt(b.m, c.zero, out=b.a)
    b.m.abs_()


# ---- 4-bit state ------------------------------------------------------------------------------------------------


def decode_4bit(b: Buffers, c: Consts, codes, m_scale, v_scale, scales2=None) -> None:
    """``reference.dequantize_mv4`` into ``b.m`` and ``b.v`` (whole blocks of ``b.block``).

    Both codes of a byte become fp16 bit patterns with the code as exponent (``m``'s sign in bit 15): ``2**(c - 15)``
    and zero for code 0, exactly the ``v`` value and ``2**-8`` times the ``m`` value, so the ``m`` scales are taken
    times ``2**8`` (module docstring). ``scales2``: both moments' scales side by side, when they are (a packed chunk).
    """
    if scales2 is not None:
        b.sdec.copy_(scales2)
    else:
        b.sdec_mv[0].copy_(m_scale)
        b.sdec_mv[1].copy_(v_scale)
    b.x16_2.copy_(codes.view(1, -1))  # the byte in both rows, zero-extended
    b.x16_2.bitwise_left_shift_(c.dec4_shift_col)
    b.x16.bitwise_right_shift_(c.s2_16)
    b.x16_2.bitwise_and_(c.dec4_mask_col)
    b.mv.copy_(b.x16_f16)
    if float(b.sdec_mv[0].max()) < M4_DECODE_SCALE_MAX:  # NaN: not taken
        b.sdec_mv[0].mul_(c.f256)
    else:
        b.m.mul_(c.f256)
    b.mv_b.mul_(b.sdec_col)


def log_warp_(b: Buffers, c: Consts, x: torch.Tensor) -> None:
    """``reference.v4_log_warp`` of the non-negative fp32 ``x`` (``b.n`` elements), in place."""
    e = b.typed("warp_e", torch.int32)
    f = b.typed("warp_f", torch.float32)
    xi = x.view(torch.int32)
    torch.bitwise_and(xi, c.exp_mask, out=e)
    fi = f.view(torch.int32)
    torch.bitwise_and(xi, c.mant_mask, out=fi).bitwise_or_(c.one_bits)  # 1 + f
    # fma(x, fma(x, fma(x, X3, X2), X1), X0): each fused multiply-add in fp64 (exact there) and rounded once to fp32
    d = b.typed("warp_d", torch.float64)
    t = b.typed("warp_t", torch.float64)
    d.copy_(f)
    x3, x2, x1, x0 = c.log_x
    torch.mul(d, x3, out=t).add_(x2)
    x.copy_(t)  # x is free now: its bits are in e and f
    for coef in (x1, x0):
        t.copy_(x).mul_(d).add_(coef)
        x.copy_(t)
    xi.sub_(c.one_bits).add_(e)


def encode_4bit(b: Buffers, c: Consts, codes_out, exact: bool) -> None:
    """``reference.quantize_mv4`` codes of ``b.m`` and ``b.v`` (``b.m`` holding ``|m|`` and ``b.a`` the sign of m,
    1.0 where ``m < 0``) into the uint8 tensor ``codes_out``, with the factors of :func:`block_scales`
    and the random words of :func:`hash_into` (``b.z``). Overwrites ``b.mv``, ``b.u``, ``b.r``, ``b.t``.

    ``exact``: the reference's clamp and NaN step first (any finite scale).
    """
    some_zero = not float(b.v.min()) > 0.0  # v >= 0 (finite here); a nonzero v never gets code 0
    if some_zero:
        torch.clamp(b.v.view(torch.int32), max=c.i_one, out=b.t).add_(c.v4_zero)  # the least v code field
    if exact:
        b.mv_b.mul_(b.inv[:, None]).clamp_(max=c.one).nan_to_num_(nan=0.0)  # reference._normalized: y in [0, 1]
        b.mv2.mul_(c.k4_col)
    else:
        b.mv_b.mul_(b.fac_col)  # y * 2**k
    log_warp_(b, c, b.v)  # v rounds in the log domain; the warp keeps exponents, so it commutes with the 2**k
    if some_zero:  # max(y, fl(y + min normal) / 2) * 2**k (module docstring)
        torch.add(c.add4_col, b.mv2, alpha=0.5, out=b.u2)
        torch.maximum(b.mv, b.u, out=b.mv)
    else:  # v: a nonzero v below the least code gets the least code, and so does max(y, 2**-14) * 2**k
        torch.add(c.add4_col[0], b.m, alpha=0.5, out=b.u_m)
        torch.maximum(b.m, b.u_m, out=b.m)
        b.v.clamp_(min=c.v4_least)
    torch.bitwise_left_shift(b.z, c.up4_col, out=b.r2).bitwise_and_(c.mask4_col).add_(c.half4_col)
    b.r.add_(b.mv_i)
    b.rm.add_(b.a_i, alpha=M4_SIGN_ALPHA)
    b.r.bitwise_right_shift_(c.s23)  # the codes' exponent fields (m's plus 8 where m < 0, mod 256)
    if some_zero:
        torch.maximum(b.rv, b.t, out=b.rv)
    b.rm.add_(b.rv, alpha=16)
    codes_out.copy_(b.rm)  # the low 8 bits: the offsets are a multiple of 256
