"""Triton helpers for the counter-based random bits and the bf16/fp16 roundings of :mod:`apexw_hf.reference`.

All rounding is done on the fp32 bit pattern with integer instructions: no ``cvt.rn.bf16.f32`` (absent before sm_80,
and the Triton interpreter truncates on ``.to(tl.bfloat16)``), so the result is the same bits on every GPU and on CPU.
bf16 values travel as their 16 bits (``uint16``).
"""

import os

import triton
import triton.language as tl

from .... import _random

# The hash's constants come from the one definition of the random streams (apexw_hf/_random.py).
GOLDEN = tl.constexpr(_random.GOLDEN)
MIX1 = tl.constexpr(_random.MIX1)
MIX2 = tl.constexpr(_random.MIX2)
STREAM_MUL = tl.constexpr(_random.STREAM_MUL)
STREAM_MV = tl.constexpr(_random.STREAM_MV)
STREAM_P = tl.constexpr(_random.STREAM_P)
BF16_NAN = tl.constexpr(0x7FC0)
# Triton's interpreter runs the kernels on CPU tensors (set before triton is imported)
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def mix32(x):
    """murmur3 fmix32 on uint32 values (wrapping multiplies)."""
    x = x ^ (x >> 16)
    x = x * MIX1
    x = x ^ (x >> 13)
    x = x * MIX2
    return x ^ (x >> 16)


@triton.jit
def stream_key(tensor_key, mixed_step, stream: tl.constexpr):
    """``reference.stream_key`` given ``tensor_key = mix32(seed + GOLDEN * (tensor_index + 1))`` and
    ``mixed_step = mix32(step)`` (uint32)."""
    k = mix32(tensor_key ^ mixed_step)
    stream_add: tl.constexpr = (stream * STREAM_MUL) & 0xFFFFFFFF
    return mix32(k + stream_add)


@triton.jit
def uniform_bits(idx_golden, key):
    """32 random bits per element: ``mix32(index * GOLDEN + key)``, with ``idx_golden = index * GOLDEN`` (uint32)."""
    return mix32(idx_golden + key)


@triton.jit
def f32_bits(x):
    return x.to(tl.uint32, bitcast=True)


@triton.jit
def bf16_bits_to_f32(h):
    """bf16 bits (uint16) -> fp32, exact."""
    return (h.to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_bf16_bits_stochastic(x, bits):
    """fp32 -> bf16 bits, stochastic: add the top 16 random bits below the bf16 mantissa, truncate. NaN -> 0x7FC0."""
    r = (f32_bits(x) + (bits >> 16)) >> 16
    return tl.where(x != x, BF16_NAN, r).to(tl.uint16)


@triton.jit
def f32_to_bf16_bits_nearest(x):
    """fp32 -> bf16 bits, round to nearest even (as ``Tensor.to(torch.bfloat16)``). NaN -> 0x7FC0."""
    b = f32_bits(x)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return tl.where(x != x, BF16_NAN, r).to(tl.uint16)


@triton.jit
def f32_to_bf16_hi_stochastic(x, bits):
    """``f32_to_bf16_bits_stochastic`` with the bf16 bits in the high half of a uint32 (the low half is not cleared):
    the form that :func:`pack_bf16_hi` stores two to a word. A NaN becomes 0x7FC00000 first, which the rounding leaves
    at 0x7FC0 (the random bits stay below the high half)."""
    return tl.where(x != x, BF16_NAN << 16, f32_bits(x)) + (bits >> 16)


@triton.jit
def f32_to_bf16_hi_nearest(x):
    """``f32_to_bf16_bits_nearest`` with the bf16 bits in the high half of a uint32 (see f32_to_bf16_hi_stochastic)."""
    b = tl.where(x != x, BF16_NAN << 16, f32_bits(x))
    return b + 0x7FFF + ((b >> 16) & 1)


@triton.jit
def pack_bf16_hi(r):
    """uint32 [R, B] holding bf16 bits in their high halves -> [R, B // 2] words of two (element 2k in the low
    half)."""
    lo, hi = tl.split(tl.reshape(r, (r.shape[0], r.shape[1] // 2, 2)))
    return (lo >> 16) | (hi & 0xFFFF0000)


@triton.jit
def unpack_bf16(w):
    """[R, W] words of two bf16 values (low half first) -> fp32 [R, 2 * W], exact."""
    x = tl.join(w << 16, w & 0xFFFF0000)
    return tl.reshape(x, (x.shape[0], 2 * x.shape[1])).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_f16_stochastic(x, bits):
    """fp32 -> fp16 with stochastic rounding (``reference.round_to_fp16_stochastic``)."""
    b = f32_bits(x)
    e = ((b >> 23) & 0xFF).to(tl.int32) - 127
    drop = 13 + tl.minimum(tl.maximum(-14 - e, 0), 10)
    mask = (tl.full(drop.shape, 1, tl.uint32) << drop.to(tl.uint32)) - 1
    r = ((b + ((bits >> 9) & mask)) & ~mask).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, r).to(tl.float16)
