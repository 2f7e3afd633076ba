"""Elementwise passes of the plain-PyTorch engine (:mod:`apexw_hf.engines.torch`) over one chunk.

Each function is one piece of ``reference.adamw_step_ref_`` rewritten as in-place or ``out=`` passes over
preallocated scratch, with the same bits: the random words and stochastic rounding to bf16 (8-bit and 4-bit state,
format version 3, is coded by the reference's own functions, :mod:`apexw_hf.engines.torch`).
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

"""

from __future__ import annotations

import sys

import numpy as np
import torch

from .. import _random as rnd
from .. import reference as ref

_BLOCK = ref.BLOCK
_HIGH_HALF = 1 if sys.byteorder == "little" else 0  # the int16 of an int32 that holds its top 16 bits


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
