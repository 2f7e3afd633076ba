"""Elementwise passes of the plain-PyTorch engine (:mod:`apexw_hf.optim.torch_engine`) over one chunk.

Each function is one piece of ``reference.adamw_step_ref_`` rewritten as in-place or ``out=`` passes over
preallocated scratch, with the same bits: the random words, stochastic rounding to bf16, and the 8-bit encoding. Scalar
operands are 0-dim tensors (:class:`Consts`), as a Python number costs a conversion per call.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .. import _random as rnd
from .. import reference as ref

_BLOCK = ref.BLOCK

# An approximate root times just under 127 (255) floors to the right code or the one below (kernels._quant).
_BELOW127 = 127.0 * (1.0 - 2.0**-16)
_BELOW255 = 255.0 * (1.0 - 2.0**-16)


class Consts:
    """0-dim tensors of the constants, on one device."""

    def __init__(self, device):
        def f(x):
            return torch.tensor(x, dtype=torch.float32, device=device)

        def i(x):
            return torch.tensor(rnd.to_int32(x), dtype=torch.int32, device=device)

        self.one, self.zero, self.two_m16 = f(1.0), f(0.0), f(ref.TWO_POW_M16)
        self.inv127, self.inv255 = f(ref.INV127), f(ref.INV255)
        self.below127, self.below255 = f(_BELOW127), f(_BELOW255)
        self.max_guess_m, self.max_guess_v = f(125.0), f(253.0)
        self.mix1, self.mix2 = i(rnd.MIX1), i(rnd.MIX2)
        self.s13, self.s16, self.low16, self.low19, self.bf16_up = i(13), i(16), i(0xFFFF), i(0x7FFFF), i(0xFFFF)


class Buffers:
    """The first ``n`` elements of every scratch buffer (cached per ``n``), with NumPy views where a root is taken."""

    F32 = ("g", "m", "v", "a", "p", "y", "lo", "q0", "q1", "u")
    I32 = ("h", "t", "k", "rm", "rv")

    def __init__(self, scratch, n):
        for name in self.F32 + self.I32:
            setattr(self, name, getattr(scratch, name)[:n])
        self.base = scratch.base[:n]
        self.n = n
        self.cpu = scratch.device.type == "cpu"
        if self.cpu:
            self.np = {name: getattr(self, name).numpy() for name in ("v", "a", "y", "lo")}
        self._scratch = scratch
        self._typed = {}

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
        for name in Buffers.F32:
            setattr(self, name, torch.empty(size, dtype=torch.float32, device=device))
        for name in Buffers.I32:
            setattr(self, name, torch.empty(size, dtype=torch.int32, device=device))
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

    def upto(self, n: int) -> Buffers:
        b = self._views.get(n)
        if b is None:
            b = self._views[n] = Buffers(self, n)
        return b


# ---- elementwise building blocks (all in place or into scratch) ------------------------------------------------


def sqrt_into(b: Buffers, x: torch.Tensor, x_np, out: torch.Tensor, out_np) -> None:
    """Correctly rounded fp32 ``sqrt(x)`` into ``out`` (the IEEE instruction through NumPy on the CPU)."""
    if b.cpu:
        np.sqrt(x_np if x_np is not None else x.numpy(), out=out_np)
    else:
        out.copy_(ref.sqrt_rn(x))


def hash_into(b: Buffers, c: Consts, segs, keys) -> None:
    """``reference.hash_uniform_bits`` of every element into ``b.h``, and its two 16-bit halves as the moments use
    them: ``b.rm`` = top 16 bits (rounds m), ``b.rv`` = low 16 bits (rounds v), int32 in [0, 2**16).

    Element ``j`` of a tensor piece starting at element ``a`` and at chunk offset ``o`` gets
    ``mix32((a + j) * GOLDEN + key) = mix32((o + j) * GOLDEN + d)`` with ``d = key + (a - o) * GOLDEN``: the chunk's
    ``index * GOLDEN`` plus a constant per piece, spread with one cumsum. ``b.h`` is left without mix32's last
    xor-shift, which changes only the low half (folded into ``b.rv``); :func:`full_bits` completes it.
    """
    h, t = b.h, b.t
    if len(segs) == 1:
        _, a, _, o = segs[0][:4]
        torch.add(b.base, rnd.to_int32(keys[0] + (a - o) * rnd.GOLDEN), out=h)
    else:
        k = b.k
        k.zero_()
        offs, deltas, prev = [], [], 0
        for seg, key in zip(segs, keys):
            _, a, _, o = seg[:4]
            d = (key + (a - o) * rnd.GOLDEN) & rnd.MASK32
            offs.append(o)
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
    torch.bitwise_right_shift(h, c.s16, out=t)
    torch.bitwise_and(t, c.low16, out=b.rm)
    torch.bitwise_xor(h, t, out=b.rv).bitwise_and_(c.low16)


def full_bits(b: Buffers) -> torch.Tensor:
    """The complete random words of :func:`hash_into` as the reference's int64 values in [0, 2**32)."""
    x = b.h.to(torch.int64) & rnd.MASK32
    return x ^ (x >> 16)


def bf16_stochastic(x: torch.Tensor, rand: torch.Tensor, t: torch.Tensor, c: Consts, out: torch.Tensor) -> None:
    """``reference.round_to_bf16_stochastic`` of non-NaN ``x``: the top 16 bits of (bits of x + 16 random bits)."""
    torch.add(x.view(torch.int32), rand, out=t)
    torch.bitwise_right_shift(t, c.s16, out=out.view(torch.int16))  # int32 -> int16 keeps the low 16 bits


def square_(t: torch.Tensor, q4: bool) -> torch.Tensor:
    """In place ``t * t`` (``q4``: squared again): with ``t = c * (1/n)`` this is ``reference._q2`` / ``_q4``."""
    t.mul_(t)
    if q4:
        t.mul_(t)
    return t


def encode(b: Buffers, c: Consts, x: torch.Tensor, blocks: int, codes_out, scale_out, is_v: bool) -> bool:
    """``reference.quantize_m`` / ``quantize_v`` of the fp32 chunk ``x`` into ``codes_out`` (int8 / uint8) and
    ``scale_out`` (bf16 per block), with the random halves in ``b.rm`` / ``b.rv``.

    Returns False, having written nothing, if a block holds a NaN or an infinity (the caller then uses the
    reference). ``v`` is normalized in place (it is not needed afterwards); ``b.a`` must be free.
    """
    lo, q0, q1, u = b.lo, b.q0, b.q1, b.u
    if is_v:
        y, y_np = x, x.numpy() if b.cpu else None
    else:
        y, y_np = torch.abs(x, out=b.y), b.np["y"] if b.cpu else None
    yb = y.view(blocks, _BLOCK)
    amax = yb.amax(dim=1)
    if not math.isfinite(float(amax.sum())):
        return False
    if is_v:
        torch.gt(x, c.zero, out=b.a)  # where v is nonzero, before v is overwritten
    # The block scale: the absmax rounded up to bf16 on its bits (finite, so no NaN case), and 1/scale or 0.
    up = torch.add(amax.view(torch.int32), c.bf16_up)
    torch.bitwise_right_shift(up, c.s16, out=scale_out.view(torch.int16))
    inv = torch.reciprocal(scale_out.float()).nan_to_num_(nan=math.nan, posinf=0.0, neginf=0.0)
    yb.mul_(inv[:, None]).clamp_(max=c.one)
    # lo: floor(root(y) * just under n) is lo or lo - 1; clamped to n - 2 it stays <= n - 1 after the correction.
    # NumPy's root is the IEEE instruction, faster than torch's (a polynomial on the CPU) even on one thread.
    if b.cpu:
        np.sqrt(y_np, out=b.np["lo"])
        if is_v:
            np.sqrt(b.np["lo"], out=b.np["lo"])
    else:
        torch.sqrt(y, out=lo)
        if is_v:
            lo.sqrt_()
    inv_n = c.inv255 if is_v else c.inv127
    lo.mul_(c.below255 if is_v else c.below127).floor_().clamp_(max=c.max_guess_v if is_v else c.max_guess_m)
    square_(torch.add(lo, c.one, out=q1).mul_(inv_n), is_v)
    lo.add_(torch.ge(y, q1, out=u))
    square_(torch.mul(lo, inv_n, out=q0), is_v)
    square_(torch.add(lo, c.one, out=q1).mul_(inv_n), is_v)
    # reference._stochastic_code: lo + (u * (q(lo+1) - q(lo)) < y - q(lo)), u = rand * 2**-16
    q1.sub_(q0)
    torch.sub(y, q0, out=q0)
    u.copy_(b.rv if is_v else b.rm).mul_(c.two_m16).mul_(q1)
    lo.add_(torch.lt(u, q0, out=u))
    if is_v:
        torch.maximum(lo, b.a, out=lo)  # a nonzero v never gets code 0
    else:
        torch.copysign(lo, x, out=lo)  # -c where m < 0; where m is -0 the code is 0 either way
    codes_out.copy_(lo)
    return True
