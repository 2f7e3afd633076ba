"""Plain-PyTorch reference of every ApexW numeric: the AdamW update, bf16/fp16 rounding, 8-bit block quantization.

This module is the specification, written per tensor to be read. The Triton kernels (``apexw_hf.engines.triton``) and
the plain-PyTorch engine that ApexW runs on the CPU (``apexw_hf.engines.torch``, a param group at a time) compute
exactly the same bits, and the tests compare them with it bit for bit. It ships with the package as their oracle.

To be bit-reproducible across CPU, CUDA and the Triton interpreter, the math uses only operations that IEEE 754
rounds exactly once (``+ - * /`` and ``sqrt`` on fp32, never fused multiply-add), hyperparameters are rounded to
fp32 once on the host (:class:`StepScalars`), and all randomness comes from a counter-based hash of
(seed, tensor index, step, stream, element index): no generator state to save, and the same seed gives the same run.

Update, per element, in fp32 (``g`` negated when ``maximize``)::

    m = m * beta1 + g * (1 - beta1)
    v = v * beta2 + (g * g) * (1 - beta2)
    p = p * (1 - lr * wd) - (m / (sqrt(v) * (1 / sqrt(1 - beta2**t)) + eps)) * (lr / (1 - beta1**t))

State formats (the moments ``m`` and ``v`` as stored between steps):

* ``fp32``: exact.
* ``compact``: bf16, written with stochastic rounding (16 random bits added below the bf16 mantissa, then
  truncated), so ``v`` keeps decaying at ``beta2 = 0.999``, where round-to-nearest would freeze it.
* ``8bit`` (format version 3): blocks of :data:`BLOCK` elements along the flattened tensor. ``m``: one bf16 scale per
  block (the block's absolute maximum rounded up to bf16); each element's magnitude, normalized by the scale to ``y``
  in [0, 1], is stored as sign + an unsigned e4m3 minifloat (4 exponent bits, bias 15, no infinities; uint8: bit 7 the
  sign, bits 0-6 the magnitude code, largest used 120 = 1.0). ``v``: an e5m3 minifloat (5 exponent bits, bias 31;
  largest used 248 = 1.0, normal codes down to 2**-30, subnormals to 2**-33) of ``v`` over an fp32 scale per block
  that is an envelope of the block's maximum (:func:`v8_scale`): it decays by exactly ``beta2`` each step, so a ``v``
  that only decays keeps its code, and restarts at twice the maximum when the maximum outgrows it. Codes below
  ``2**mant`` are the subnormals ``code * 2**(1 - bias - mant)``, the others ``2**(e - bias) * (1 + f / 2**mant)``.
  Encoding is integer work on the fp32 bits of ``y`` (of ``y + 2**(1 - bias)`` for subnormals): add random bits below
  the kept mantissa, shift, subtract the exponent offset. That rounds stochastically and unbiased (to the resolution
  of the random bits; a half unit is added below them, so the leftover error is at most half a step of that
  resolution and averages out), keeps exactly representable values exact, encodes zero as code 0, and a nonzero ``v``
  never gets code 0 (it would turn the next update into ``m / eps``). Decoding builds the fp32 bits of the code value
  and multiplies by the scale. Why version 3 (issue 45): an element whose ``v`` sits far below its block's maximum
  (outlier features and columns) reached only 2**-18 of it in version 2's e4m4 ``v`` (its smaller ``v`` read as
  that, so it stepped up to 8x too short), and version 2's bf16 scale, re-rounding the whole block whenever the
  maximum moved, made it walk (up to 1.3x too far); version 3 covers 2**-29 of the maximum and keeps the update size
  within 2% of AdamW's from 2**4 to 2**24 below it (``docs/skewed_blocks.md``). Format version 2 (e4m4 ``v``, bf16
  ``v`` scale, :func:`dequantize_v_v2`) and version 1 (int8 codes ``(c/127)**2``, uint8 ``(c/255)**4``) are read only
  to convert old checkpoints (:func:`dequantize_m_v1`, :func:`dequantize_v_v1`).
* ``4bit`` (format version 4): blocks of :data:`BLOCK4` elements, one byte per element holding both moments' 4-bit
  codes (``exp_avg_mv``: bits 0-3 ``m``, bits 4-7 ``v``) and two fp32 scales per block, 1.0625 bytes per parameter.
  ``v``'s code ``c >= 1`` is ``2**(2 (c - 15))``, two binades a code, 2**-28 .. 1, and code 0 only zero (a nonzero
  ``v`` never gets it), of an fp32 envelope scale (:func:`v4_scale`: :func:`v8_scale` with 4x headroom, so that a
  restart puts the maximum on a code); it rounds up with probability ``A u + (1 - A) u**2`` of its position ``u`` in
  the code's interval (:func:`v4_code`, integer work, 16 random bits, ``A`` = 1.85), which keeps ``E[1/sqrt(v)]``,
  what the update divides by, near ``1/sqrt(v)`` with codes this coarse. ``m`` is coded relative to the square root
  of its element's ``v`` code: ``|m| * 2**(15 - c)`` (exact) as sign + e3m0 (bit 3 the sign, bits 0-2 a power of two:
  code ``k >= 1`` is ``2**(k - 7)``, so 2**-6 .. 1, and code 0 is zero) of the block's exact fp32 absmax of those
  values, encoded by the minifloat integer work of ``8bit`` and rounded unbiased with 8 random bits; decoded, it is
  multiplied back by ``2**(c - 15)`` (:func:`v4_m_unit`). Since ``v``'s code value is a power of four of the block
  scale, that codes ``m / sqrt(v)``, the update's own quotient, over its block maximum, with no square root. Why
  version 4 (issue 45): version 3 coded ``m`` over the block's absmax of ``|m|``, so an element whose gradients are
  far smaller than its block's largest (outlier columns) rounded between 0 and 2**-6 of that maximum, unbiased but
  noisy, which made the mean update of such elements 1.2-1.7x AdamW's on noise-dominated gradients; ``m / sqrt(v)`` is
  of one order across such a block (the update's size), and version 4 keeps it at 1.03x (``scripts/update_size.py``,
  ``docs/skewed_blocks.md``). Why version 3 (its ``v``, which version 4 keeps): version 2's ``v`` (e4m0, one code per
  binade down to 2**-14 of the block's exact absmax, rounded unbiased in ``log2(v)`` by :func:`v4_log_warp`, with a
  bf16 ``m`` scale) read an element further below its block's maximum as 2**-14 of it (0.49x AdamW's update at 2**16,
  0.025x at 2**24), and after a burst of large gradients its codes, re-rounded whenever the maximum moved, walked
  (1.2-1.4x); the envelope and the codes of two binades reach 2**-28 of the envelope and keep the update size at
  0.95-1.02 of AdamW's up to 2**24 below the maximum, except after a burst into a decaying block (1.03-1.12 from 2**20
  on). Versions 3 and 4 have the same tensors; a state dict says which it holds (:mod:`apexw_hf.formats`). Versions 3
  (:func:`quantize_mv4_v3`, :func:`dequantize_mv4_v3`), 2 (:func:`quantize_mv4_v2`, :func:`dequantize_mv4_v2`) and 1
  (a bf16 ``v`` scale, :func:`quantize_mv4_v1`) are read to convert their checkpoints. The one byte per element keeps
  the state shaped like the parameter (so ``DTensor`` shards it like the parameter) and lets a kernel read and write
  both moments with one byte access. Li et al. (2023), "Memory Efficient Optimizers with 4-bit States", showed 4-bit
  moments at AdamW quality with blocks of 128 and a ``v`` code without a zero point.

Stochastic rounding of both moments draws on one 32-bit random word per element (the ``STREAM_MV`` stream). In
``compact``, its top 16 bits round ``m`` and its low 16 bits round ``v``. ``8bit`` rounds ``m`` with bits 0-5 (6
bits: with ``beta1 = 0.9`` it moves by about a code per step) and ``v`` with bits 6-21 (16 bits: with ``beta2 =
0.9999`` each step moves a decaying ``v`` by a small fraction of a code; the top six are shared with a bf16
parameter's least significant ones; two contiguous fields cost the kernel fewer operations and registers than split
ones). ``4bit`` rounds ``m`` with bits 0-7 (an ``m`` far below its block's maximum rounds to 0 or the least code with
a small probability, which 6 bits resolved too coarsely) and ``v`` with bits 8-23 (16 bits; 14, bits 8-21, measured
worse at 2**24 below the block maximum; the top eight are a bf16 parameter's least significant). The top 16 bits round
a bf16 parameter, so these kernels hash one word per element instead of two.

Non-finite gradients. A *block* of 256 consecutive elements of the flattened tensor (:data:`BLOCK`, the ``8bit``
scale block, two ``4bit`` ones, one row of the kernel's tile) whose new second moment ``v * beta2 + g * g * (1 -
beta2)`` holds a NaN or an infinity is not updated: its parameter elements, its moments and its block scales keep
their values, bit for bit (:func:`adamw_step_ref_`). That is a block whose gradient holds a NaN or an infinity (after
``maximize``'s negation and any clip coefficient the gradient was multiplied by), or a finite element whose square
overflows fp32 (``|g| >= 2**64``, about 1.8e19), which would otherwise store an infinite ``v`` and, in the block
formats, an infinite scale. Why ``v`` and not the gradient: a non-finite gradient always makes ``v`` non-finite, and
the ``8bit`` and ``4bit`` kernels already take the block maximum of ``v``'s bits for its scale, so the test is one
comparison there instead of a reduction of its own. Not less than a
scale block: part of a block cannot keep its old values while the rest is written, since they share the scale. The
tensor's step counter still advances (it numbers the optimizer's steps and selects the random streams); a block that
skipped a step then has its bias correction one step ahead, which only matters in the first few steps. Why per block
and not per tensor or per step: knowing that a whole tensor (or every gradient) is finite before writing any of it
needs a pass over the gradients before the update, a quarter or more of the update's own memory traffic, while a
block is decided where the update loads it (a reduction over a row already in registers). One bad batch is still
skipped whole in practice: a NaN loss makes every gradient NaN, and clipping (``clip_grad_norm_``, the Trainer's
default, or gradient release's ``max_grad_norm``) multiplies every gradient by a NaN coefficient when the norm is NaN.

Parameters in bf16 or fp16 receive the fp32 update rounded stochastically by default (``param_rounding="nearest"``
switches to round-to-nearest-even), with the ``STREAM_P`` stream's word, except bf16 parameters with ``8bit`` state
and ``4bit`` state (the moments' word, above).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

# The random streams are specified once, in _random (the kernels use the same module).
from ._random import GOLDEN, MASK32, MIX1, MIX2, STREAM_MV, STREAM_P, stream_key
from ._random import mix32 as _mix32  # noqa: F401  (the scalar form, kept here for the tests' oracle)

__all__ = [
    "BLOCK",
    "STATE_FORMATS",
    "PARAM_ROUNDINGS",
    "StepScalars",
    "stream_key",
    "hash_uniform_bits",
    "sqrt_rn",
    "round_to_bf16_stochastic",
    "round_to_fp16_stochastic",
    "round_param",
    "bf16_round_up",
    "quantize_m",
    "dequantize_m",
    "quantize_v",
    "dequantize_v",
    "dequantize_v_v2",
    "v8_scale",
    "num_blocks",
    "minifloat_code",
    "minifloat_value",
    "dequantize_m_v1",
    "dequantize_v_v1",
    "BLOCK4",
    "quantize_mv4",
    "quantize_mv4_v3",
    "quantize_mv4_v2",
    "quantize_mv4_v1",
    "v4_scale",
    "v4_code",
    "v4_value",
    "v4_rand_offset",
    "v4_log_warp",
    "dequantize_mv4",
    "dequantize_mv4_v3",
    "dequantize_mv4_v2",
    "v4_m_unit",
    "param_stream",
    "load_moments",
    "store_moments",
    "nonfinite_blocks",
    "adamw_step_ref_",
]

BLOCK = 256  # elements per 8-bit scale
BLOCK4 = 128  # elements per 4-bit scale
STATE_FORMATS = ("fp32", "compact", "8bit", "4bit")
PARAM_ROUNDINGS = ("stochastic", "nearest")

# fp32 constants shared with the kernels; written as float32-exact Python floats.
INV127 = torch.tensor(1.0 / 127.0, dtype=torch.float32).item()
INV255 = torch.tensor(1.0 / 255.0, dtype=torch.float32).item()


_F32 = struct.Struct("f")


def _f32(x: float) -> float:
    """Round a Python float to the nearest fp32 value (kept as a Python float, exactly representable in fp32).

    ``struct``'s "f" packing is the C double -> float cast (round to nearest even), the one torch applies to
    scalars; it raises where that cast overflows, and the value then is the signed infinity. About 0.3 us, no
    tensor and no numpy call: this runs 8 times in every optimizer step.
    """
    try:
        return _F32.unpack(_F32.pack(x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


@dataclass(frozen=True)
class StepScalars:
    """Per-tensor step constants, each rounded to fp32 once on the host. The kernels receive these same values.

    Attributes:
        beta1, beta2, one_minus_beta1, one_minus_beta2: moment coefficients.
        decay: ``1 - lr * weight_decay`` (decoupled weight decay).
        step_size: ``lr / (1 - beta1**step)``.
        inv_bc2_sqrt: ``1 / sqrt(1 - beta2**step)``.
        eps: added outside the square root.
    """

    beta1: float
    beta2: float
    one_minus_beta1: float
    one_minus_beta2: float
    decay: float
    step_size: float
    inv_bc2_sqrt: float
    eps: float

    @classmethod
    def make(cls, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int):
        bc1 = 1.0 - beta1**step
        bc2 = 1.0 - beta2**step
        return cls(
            beta1=_f32(beta1),
            beta2=_f32(beta2),
            one_minus_beta1=_f32(1.0 - beta1),
            one_minus_beta2=_f32(1.0 - beta2),
            decay=_f32(1.0 - lr * weight_decay),
            step_size=_f32(lr / bc1),
            inv_bc2_sqrt=_f32(1.0 / math.sqrt(bc2)),
            eps=_f32(eps),
        )


# ---------------------------------------------------------------------------------------------------------------
# Counter-based random bits
# ---------------------------------------------------------------------------------------------------------------


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 tensors holding values in [0, 2**32), without int64 overflow."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & MASK32


def _mix32_t(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, MIX1)
    x = x ^ (x >> 13)
    x = _mul32(x, MIX2)
    return x ^ (x >> 16)


def hash_uniform_bits(numel: int, key: int, device) -> torch.Tensor:
    """32 random bits per element (int64 tensor in [0, 2**32)): ``mix32(index * GOLDEN + key)``."""
    idx = torch.arange(numel, device=device, dtype=torch.int64) & MASK32
    return _mix32_t((_mul32(idx, GOLDEN) + key) & MASK32)


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 square root (IEEE ``sqrt``), on every device.

    ``torch.sqrt`` on the CPU is vectorized with a SLEEF routine that is up to 1 ulp off (about 19% of random fp32
    inputs differ from IEEE ``sqrt`` with torch 2.13, in fp64 too), while CUDA's and Triton's ``sqrt_rn`` are exact.
    So take ``torch.sqrt`` and fix it up: ``r`` is the rounded root iff ``x`` lies between the squares of the
    midpoints to its neighbours; those midpoints have 25 significant bits, so their squares are exact in fp64.
    """
    r = torch.sqrt(x)
    fix = (x > 0) & (r < float("inf"))
    up = torch.nextafter(r, torch.full_like(r, float("inf")))
    dn = torch.nextafter(r, torch.zeros_like(r))
    xd, rd = x.double(), r.double()
    hi = (rd + up.double()) * 0.5
    lo = (rd + dn.double()) * 0.5
    r = torch.where(fix & (xd > hi * hi), up, r)
    return torch.where(fix & (xd < lo * lo), dn, r)


# ---------------------------------------------------------------------------------------------------------------
# Rounding
# ---------------------------------------------------------------------------------------------------------------


def _drop_low_bits(x: torch.Tensor, rand: torch.Tensor, drop: torch.Tensor | int) -> torch.Tensor:
    """Add ``rand`` (already < 2**drop) to the fp32 bit pattern of ``x`` and clear the low ``drop`` bits.

    On the magnitude this is stochastic rounding to a grid with ``23 - drop`` mantissa bits; NaN passes through.
    """
    bits = x.view(torch.int32).to(torch.int64)
    mask = (1 << drop) - 1 if isinstance(drop, int) else (torch.ones_like(drop) << drop) - 1
    out = ((bits + rand) & ~mask).to(torch.int32).view(torch.float32)
    return torch.where(torch.isnan(x), x, out)


def round_to_bf16_stochastic(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 with stochastic rounding, using the top 16 of 32 random ``bits`` per element."""
    return _drop_low_bits(x, bits >> 16, 16).to(torch.bfloat16)


def round_to_fp16_stochastic(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """fp32 -> fp16 with stochastic rounding.

    fp16 keeps 10 mantissa bits for normal values (|x| >= 2**-14) and fewer below, so 13 fp32 bits are dropped,
    plus one per binade below 2**-14, at most 23. Values under fp16's smallest subnormal then round to nearest in
    the final conversion; values past 65504 overflow to inf as in any fp16 conversion.
    """
    exp = ((x.view(torch.int32).to(torch.int64) >> 23) & 0xFF) - 127
    drop = 13 + torch.clamp(-14 - exp, 0, 10)
    rand = (bits >> 9) & ((torch.ones_like(drop) << drop) - 1)
    return _drop_low_bits(x, rand, drop).to(torch.float16)


def round_param(x: torch.Tensor, dtype: torch.dtype, bits: torch.Tensor | None) -> torch.Tensor:
    """Round the fp32 update result to the parameter dtype (stochastically when ``bits`` is given)."""
    if dtype == torch.float32:
        return x
    if bits is None:
        return x.to(dtype)
    if dtype == torch.bfloat16:
        return round_to_bf16_stochastic(x, bits)
    if dtype == torch.float16:
        return round_to_fp16_stochastic(x, bits)
    raise TypeError(f"unsupported parameter dtype {dtype}; allowed: float32, bfloat16, float16")


def bf16_round_up(x: torch.Tensor) -> torch.Tensor:
    """Round non-negative fp32 values up to the next bf16 value (exact bf16 values stay); returns bf16."""
    bits = x.view(torch.int32).to(torch.int64)
    up = ((bits + 0xFFFF) & ~0xFFFF).to(torch.int32).view(torch.float32)
    return torch.where(torch.isnan(x), x, up).to(torch.bfloat16)


# ---------------------------------------------------------------------------------------------------------------
# 8-bit block quantization
# ---------------------------------------------------------------------------------------------------------------


def num_blocks(numel: int, block: int = BLOCK) -> int:
    return (numel + block - 1) // block


def _blocks(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Flattened values padded with zeros to whole blocks: shape (num_blocks, block)."""
    flat = x.reshape(-1)
    pad = num_blocks(flat.numel(), block) * block - flat.numel()
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, block)


def _scale(x_abs_blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block scale (bf16, absmax rounded up) and its fp32 reciprocal (0 where the scale is 0)."""
    scale = bf16_round_up(x_abs_blocks.amax(dim=1))
    s32 = scale.float()
    inv = torch.where(s32 == 0, torch.zeros_like(s32), 1.0 / s32)
    return scale, inv


def _normalized(x_abs_blocks: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    y = torch.clamp(x_abs_blocks * inv[:, None], max=1.0)
    return torch.where(torch.isnan(y), torch.zeros_like(y), y)


# Minifloat codes. The 8-bit m code has 4 exponent bits with bias 15, so 1.0 (the block maximum) is the code of
# exponent 15 and mantissa 0, and the subnormals (exponent 0) continue the lowest binade [2**-14, 2**-13) linearly down
# to zero; the 8-bit v code (version 3) has 5 exponent bits with bias 31, the same way.
M_MANT = 3  # mantissa bits of the m code (sign + e4m3)
M_SIGN = 128  # the sign bit of an m code
M_CODE_MAX = 120  # the code of 1.0
BIAS = 15  # exponent bias of the 8-bit codes and of the 4-bit v code
MIN_NORMAL = 2.0**-14
_EXP_OFFSET = 127 - 15  # fp32 exponent field of code exponent 0
# 4-bit: m sign + e3m0 (bias 7), v e4m0 (bias 15); one byte per element, m in bits 0-3, v in bits 4-7
M4_BIAS = 7
M4_SIGN = 8  # the sign bit of a 4-bit m code
M4_CODE_MAX, V4_CODE_MAX = 7, 15  # the codes of 1.0
M_RAND_SHIFT, M_RAND_BITS = 0, 6  # bits 0-5 of the moments' random word round m (8-bit and 4-bit)
V_RAND_SHIFT, V_RAND_BITS = 0, 10  # 4-bit version 1's v: bits 0-9
# 8-bit v (format version 3): e5m3, exponent bias 31, so 1.0 is code 248 and the normal codes reach 2**-30 (the
# subnormals 2**-33); 16 random bits, bits 6-21 of the word (as 4-bit v)
V8_MANT, V8_BIAS, V8_CODE_MAX = 3, 31, 248
V8_RAND_SHIFT, V8_RAND_BITS = 6, 16
V8_HEADROOM = 2.0  # a v scale that restarts is this times the block's absmax
# 8-bit v of format version 2 (read only): e4m4, bias 15, 1.0 = code 240, bf16 scale
V2_MANT, V2_CODE_MAX = 4, 240
V4_RAND_SHIFT, V4_RAND_BITS = 6, 16  # 4-bit v (version 2): bits 6-21 of the word, see v4_rand_offset
M4_RAND_SHIFT = 0  # 4-bit m (version 2): bits 0-5 of the word (M_RAND_BITS of them)
# 4-bit format versions 3 and 4: m rounds with bits 0-7 of the word, v with bits 8-23; v codes c >= 1 are
# 2**(2 (c - 15)) of the block's fp32 envelope scale (two binades a code, down to 2**-28), which restarts at 4x the
# block maximum
M4V3_RAND_BITS = 8
V4V3_RAND_SHIFT, V4V3_RAND_BITS = 8, 16
V4_HEADROOM = 4.0
V4_EXP_MIN = 127 - 28  # the fp32 exponent field of the least v code's value, 2**-28
V4_ROUND_A = 237  # the rounding probability's slope at the bottom of a code's interval, in 128ths (A = 1.8515625)
V4_Q = 3 << 23  # a code's interval [2**(2k), 2**(2k + 2)) in units of 2**(2k - 23)
# 4-bit v (version 2): f * (A + f * (B + C * f)) ~ log2(1 + f), exact dyadic coefficients with A + B + C = 1, see
# v4_log_warp; 1 + f * (A + ...) as the cubic in x = 1 + f that v4_log_warp evaluates (X3..X0, exact in fp64)
V4_LOG_A, V4_LOG_B, V4_LOG_C = 1477 / 1024, -621 / 1024, 168 / 1024
V4_LOG_X3, V4_LOG_X2 = V4_LOG_C, V4_LOG_B - 3 * V4_LOG_C  # 168, -1125 / 1024
V4_LOG_X1, V4_LOG_X0 = V4_LOG_A - 2 * V4_LOG_B + 3 * V4_LOG_C, 1 - V4_LOG_A + V4_LOG_B - V4_LOG_C  # 3223, -1242 / 1024
V4_LOG_X = (V4_LOG_X3, V4_LOG_X2, V4_LOG_X1, V4_LOG_X0)  # highest power first, as the engines take them


def _rand_offset(bits: torch.Tensor, shift: int, nbits: int, drop: int) -> torch.Tensor:
    """``nbits`` random bits (``bits >> shift``) placed at the top of the ``drop`` low bits, plus half a unit below
    them: added before the ``drop`` bits are cut, the code rounds up with probability equal to the dropped fraction
    rounded to ``nbits`` bits (so exactly representable values never move)."""
    r = (bits >> shift) & ((1 << nbits) - 1)
    return (r << (drop - nbits)) | (1 << (drop - nbits - 1))


def minifloat_code(y: torch.Tensor, rand_offset: torch.Tensor, mant: int, bias: int = BIAS) -> torch.Tensor:
    """Stochastically rounded unsigned minifloat code (int64) of ``y`` in [0, 1] (fp32, no NaN); ``mant`` mantissa
    bits, exponent bias ``bias`` (1.0 is the code of exponent ``bias``), ``rand_offset`` from :func:`_rand_offset`
    with ``drop = 23 - mant``.

    Normal values (``y >= 2**(1 - bias)``, 2**-14 for bias 15) are coded on their own fp32 bits: add the offset, cut
    the low ``23 - mant`` bits (a carry steps into the next binade), subtract the exponent offset. A subnormal ``y``
    is first moved to ``y + 2**(1 - bias)`` (an exact fp32 addition up to its bits below 2**(-22 - bias)) and its
    exponent lowered by one, which puts its multiple of ``2**(1 - bias - mant)`` in the kept mantissa bits (with no
    mantissa bits, the subnormal range is zero alone and ``y`` rounds to 0 or ``2**(1 - bias)``).
    """
    drop = 23 - mant
    min_normal = 2.0 ** (1 - bias)
    x = y.view(torch.int32).to(torch.int64)
    sub = (y + min_normal).view(torch.int32).to(torch.int64) - (1 << 23)
    x = torch.where(y >= min_normal, x, sub)
    return ((x + rand_offset) >> drop) - ((127 - bias) << mant)


def minifloat_value(code: torch.Tensor, mant: int, bias: int = BIAS) -> torch.Tensor:
    """fp32 value of unsigned minifloat codes (integer tensor, any code up to the one of 1.0)."""
    drop = 23 - mant
    offset = 127 - bias
    c = code.to(torch.int64)
    normal = ((c + (offset << mant)) << drop).to(torch.int32).view(torch.float32)
    # a subnormal code c is (2**(1 - bias) + c * 2**(1 - bias - mant)) - 2**(1 - bias), both steps exact
    sub = (((c + ((offset + 1) << mant)) << drop).to(torch.int32).view(torch.float32)) - 2.0 ** (1 - bias)
    return torch.where(c >= (1 << mant), normal, sub)


def quantize_m(m: torch.Tensor, bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 first moment -> (uint8 sign + e4m3 codes shaped like ``m``, bf16 scales of shape (num_blocks,)).

    ``bits``: the 32-bit random word per element; bits 0-5 round ``m`` (bits 10-15 in format version 2, whose codes
    are otherwise the same).
    """
    n = m.numel()
    mb = _blocks(m)
    a = mb.abs()
    scale, inv = _scale(a)
    y = _normalized(a, inv)
    r = _rand_offset(_blocks(bits), M_RAND_SHIFT, M_RAND_BITS, 23 - M_MANT)
    c = minifloat_code(y, r, M_MANT) | torch.where(mb < 0, M_SIGN, 0)
    return c.reshape(-1)[:n].to(torch.uint8).view(m.shape), scale


def dequantize_m(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    c = _blocks(codes.to(torch.int64))
    a = minifloat_value(c & (M_SIGN - 1), M_MANT)
    m = torch.where(c >= M_SIGN, -a, a) * scale.float()[:, None]
    return m.reshape(-1)[: codes.numel()].view(codes.shape)


def v8_scale(v_blocks: torch.Tensor, prev_scale: torch.Tensor, beta2: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8-bit ``v`` scale of format version 3 (fp32, per block) and its fp32 reciprocal (0 where it is 0).

    An envelope of the block's absmax: the previous scale times ``beta2`` (one fp32 product) while the absmax stays at
    or below that, else :data:`V8_HEADROOM` (2) times the absmax (a NaN absmax: the canonical NaN).

    Why: an element whose ``v`` only decays (``v * beta2``, its gradients now small) keeps ``v / scale``, hence its
    code, exactly, whatever the block's largest element does meanwhile, as long as the absmax stays under the envelope
    (it cannot fall below it: ``v`` never shrinks faster than ``beta2``). A scale that follows the absmax instead (the
    bf16 absmax of version 2, or the exact one) moves with every fluctuation of the largest ``v``, and each move
    re-rounds every code of the block: a random walk of ``log2(v)`` that nothing pulls back while ``v`` decays, which
    made small elements of skewed blocks step up to 1.3x as far as AdamW (``scripts/skew_walk.py``). The headroom
    makes restarts rare: the absmax has to double against the envelope's decay. A scale of 0 (fresh state, and the
    re-encoding of a conversion, which passes ``beta2 = 0``) restarts at once.
    """
    return _envelope_scale(v_blocks, prev_scale, beta2, V8_HEADROOM)


def _envelope_scale(v_blocks, prev_scale, beta2: float, headroom: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`v8_scale` and :func:`v4_scale` with their ``headroom``."""
    amax = v_blocks.amax(dim=1)
    env = prev_scale.float() * torch.tensor(beta2, dtype=torch.float32)
    s = torch.where(amax <= env, env, amax * headroom)
    s = torch.where(torch.isnan(amax), torch.full_like(s, float("nan")), s)
    inv = torch.where(s == 0, torch.zeros_like(s), 1.0 / s)
    return s, inv


def quantize_v(
    v: torch.Tensor, bits: torch.Tensor, prev_scale: torch.Tensor, beta2: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 second moment (>= 0) -> (uint8 e5m3 codes shaped like ``v``, fp32 scales of shape (num_blocks,)): 8-bit
    format version 3.

    ``prev_scale``: the block scales stored before this step (zeros for fresh state); ``beta2``: the step's fp32
    ``beta2`` (:func:`v8_scale`). ``bits``: the 32-bit random word per element; bits 6-21 round ``v`` (16 bits: at
    ``beta2 = 0.9999`` a decaying ``v`` moves by 2**-10 of a code per step, which 10 bits rounded to 0 or 2**-10, a
    decay up to 25% off). A nonzero ``v`` never gets code 0.
    """
    n = v.numel()
    vb = _blocks(v)
    scale, inv = v8_scale(vb, prev_scale, beta2)
    y = _normalized(vb, inv)
    r = _rand_offset(_blocks(bits), V8_RAND_SHIFT, V8_RAND_BITS, 23 - V8_MANT)
    c = minifloat_code(y, r, V8_MANT, V8_BIAS)
    c = torch.where((vb > 0) & (c == 0), torch.ones_like(c), c)
    return c.reshape(-1)[:n].to(torch.uint8).view(v.shape), scale


def dequantize_v(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 second moment of 8-bit format version 3 (e5m3 codes, fp32 scales)."""
    c = _blocks(codes.to(torch.int64))
    v = minifloat_value(c, V8_MANT, V8_BIAS) * scale.float()[:, None]
    return v.reshape(-1)[: codes.numel()].view(codes.shape)


def dequantize_v_v2(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 second moment of 8-bit format version 2 (e4m4 codes, bf16 scales), read only to convert checkpoints."""
    c = _blocks(codes.to(torch.int64))
    v = minifloat_value(c, V2_MANT) * scale.float()[:, None]
    return v.reshape(-1)[: codes.numel()].view(codes.shape)


def _scale_exact(x_blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block scale of non-negative values (NaN allowed) as the exact fp32 absmax (a NaN block: the canonical NaN
    ``0x7FC00000``), and its fp32 reciprocal (0 where the scale is 0)."""
    amax = x_blocks.amax(dim=1)
    s = torch.where(torch.isnan(amax), torch.full_like(amax, float("nan")), amax)
    inv = torch.where(s == 0, torch.zeros_like(s), 1.0 / s)
    return s, inv


def v4_rand_offset(bits: torch.Tensor) -> torch.Tensor:
    """The random offset that rounds a 4-bit ``v`` code (format version 2): 16 random bits, bits 6-21 of the moments'
    word (``m`` takes bits 0-5), placed below the code, plus half a unit. Where a bf16 parameter shares the word
    (its rounding takes bits 16-31), the six bits both read are the parameter's least significant: they move its
    rounding probability by at most 2**-10 whatever ``v`` did. One mask of the word in the kernel."""
    r = (bits >> V4_RAND_SHIFT) & ((1 << V4_RAND_BITS) - 1)
    return (r << (23 - V4_RAND_BITS)) | (1 << (22 - V4_RAND_BITS))


def _fma32(a: torch.Tensor, b: torch.Tensor, c: float) -> torch.Tensor:
    """fp32 ``a * b + c`` rounded once (a fused multiply-add), for the operands of :func:`v4_log_warp`: in fp64 the
    product of two fp32 values is exact, and there the sum is too (its terms' bits span fewer than 53), so the one
    rounding is the conversion to fp32."""
    return (a.double() * b.double() + c).float()


def v4_log_warp(y: torch.Tensor) -> torch.Tensor:
    """Map each non-negative fp32 ``y`` within its binade so that stochastic rounding of the result between the two
    powers of two around it is unbiased in ``log2(y)`` (to a quadratic's accuracy), not in ``y``: with ``y = 2**e *
    x``, ``x = 1 + f`` in [1, 2), the result is ``2**e * w``, ``w`` the cubic ``1 + f * (A + f * (B + C * f))`` with
    ``A, B, C = 1477, -621, 168 / 1024``, written in ``x`` (``X3, X2, X1, X0 = 168, -1125, 3223, -1242 / 1024``) and
    computed in fp32 as three fused multiply-adds, each rounded once: ``w = fma(x, fma(x, fma(x, X3, X2), X1), X0)``.
    ``w - 1`` is ``log2(1 + f)`` exactly at ``f = 0`` and 1, within 0.006 between, with the slopes of ``log2`` at both
    ends (within 0.3%: the rates at which a ``v`` just below or above a code leaves it, hence the rate of decay).
    Powers of two (the codes) and 0 stay.

    Why: rounding unbiased in ``v`` leaves ``E[1/sqrt(v)]`` too large by Jensen's inequality (the update 11% too
    large after a burst of large gradients, whose rounding noise the codes then keep), rounding unbiased in
    ``1/sqrt(v)`` inflates ``v``'s average instead (5% too small); unbiased in ``log2(v)`` sits between (2-3% too
    small, ``tests/optim/test_update_scale.py``). Integer work on the bits: the exponent field is kept, the mantissa
    replaced, so it commutes with scaling by powers of two and maps subnormals to subnormals (> 0 stays > 0).

    The form in ``x`` (rather than the same cubic in ``f``) is what the kernels compute cheapest: the
    mantissa with 1.0's exponent is ``x`` itself, with no subtraction of 1.0. Its last fused multiply-add cancels
    (``X0`` against a product from 2.2 to 3.2), so ``w`` is within 3 ulps of the form in ``f`` and, from one of the
    2**23 mantissas to the next, falls by one ulp at 421,523 of them (5%): monotone to one ulp (2**-23 of a binade).
    The rounding reads ``w`` to 16 bits, so the probability of rounding up falls, by 2**-16, at 3,341 of those steps
    (``tests/optim/test_reference_4bit.py``).
    """
    bits = y.view(torch.int32).to(torch.int64)
    x = ((bits & 0x7FFFFF) | 0x3F800000).to(torch.int32).view(torch.float32)
    w = _fma32(x, _fma32(x, _fma32(x, torch.tensor(V4_LOG_X3, dtype=torch.float32), V4_LOG_X2), V4_LOG_X1), V4_LOG_X0)
    out = (bits & 0x7F800000) + (w.view(torch.int32).to(torch.int64) - 0x3F800000)
    return out.to(torch.int32).view(torch.float32)


def _quantize_m4(m: torch.Tensor, rb: torch.Tensor):
    mb = _blocks(m, BLOCK4)
    a = mb.abs()
    sm, inv = _scale(a)
    y = _normalized(a, inv)
    cm = minifloat_code(y, _rand_offset(rb, M4_RAND_SHIFT, M_RAND_BITS, 23), 0, M4_BIAS)
    return cm | torch.where(mb < 0, M4_SIGN, 0), sm


def quantize_mv4_v2(m: torch.Tensor, v: torch.Tensor, bits: torch.Tensor):
    """fp32 moments -> (uint8 ``exp_avg_mv`` shaped like ``m``: bits 0-3 the sign + e3m0 code of ``m``, bits 4-7 the
    e4m0 code of ``v``; bf16 ``m`` scales; fp32 ``v`` scales), scales of shape ``(num_blocks(numel, BLOCK4),)``.
    4-bit format version 2 (kept to convert its checkpoints and to test that version 3's ``v`` fixes its skewed
    blocks).

    The ``v`` scale is the block's exact absmax in fp32, so the element holding it gets code 15 (the scale itself)
    and a block whose ``v`` only decays keeps all its codes while the scale decays by exactly ``beta2``: no rounding
    event, so no random walk of ``log2(v)`` (version 1's bf16 scale, rounded up, cannot follow a 0.1% decay, and
    every code then moved by whole binades at random).

    ``v`` rounds stochastically in the log domain (:func:`v4_log_warp`), so that its code's error in ``1/sqrt(v)``,
    what the update divides by, is nearly unbiased.

    ``bits``: the 32-bit random word per element; bits 0-5 round ``m``, bits 6-21 round ``v``
    (:func:`v4_rand_offset`).
    """
    n = m.numel()
    rb = _blocks(bits, BLOCK4)
    cm, sm = _quantize_m4(m, rb)
    vb = _blocks(v, BLOCK4)
    sv, inv = _scale_exact(vb)
    y = v4_log_warp(_normalized(vb, inv))
    cv = minifloat_code(y, v4_rand_offset(rb), 0, BIAS)
    cv = torch.where((vb > 0) & (cv == 0), torch.ones_like(cv), cv)
    mv = (cm | (cv << 4)).reshape(-1)[:n].to(torch.uint8).view(m.shape)
    return mv, sm, sv


def quantize_mv4_v1(m: torch.Tensor, v: torch.Tensor, bits: torch.Tensor):
    """4-bit format version 1 (kept to test that version 2 fixes it): as
    :func:`quantize_mv4_v2`, but the ``v`` scale is bf16, the absmax rounded up, and bits 0-9 alone round ``v``."""
    n = m.numel()
    rb = _blocks(bits, BLOCK4)
    cm, sm = _quantize_m4(m, rb)
    vb = _blocks(v, BLOCK4)
    sv, inv = _scale(vb)
    y = _normalized(vb, inv)
    cv = minifloat_code(y, _rand_offset(rb, V_RAND_SHIFT, V_RAND_BITS, 23), 0, BIAS)
    cv = torch.where((vb > 0) & (cv == 0), torch.ones_like(cv), cv)
    mv = (cm | (cv << 4)).reshape(-1)[:n].to(torch.uint8).view(m.shape)
    return mv, sm, sv


def v4_decay_per_step(beta2: float) -> float:
    """Format version 1: expected decay factor per step of a 4-bit ``v`` that sits on a code below its block's maximum
    and gets zero gradients: ``v * beta2`` (fp32) keeps its code or moves one binade down, with the probability that
    :func:`quantize_mv4_v1`'s 10 random bits give it, so ``v`` shrinks on average by ``1 - P(down) / 2`` a step, where
    torch AdamW's shrinks by ``beta2``. ``P(down)`` is a multiple of 2**-10: at ``beta2 = 0.999`` 2**-9 (``1 -
    2**-10`` a step, 0.99902), from ``1 - 2**-12`` on 0 (no decay)."""
    y = torch.full((1 << V_RAND_BITS,), float(torch.tensor(beta2, dtype=torch.float32)))
    words = torch.arange(1 << V_RAND_BITS, dtype=torch.int64) << V_RAND_SHIFT
    codes = minifloat_code(y, _rand_offset(words, V_RAND_SHIFT, V_RAND_BITS, 23), 0, BIAS)
    return 1.0 - (codes < V4_CODE_MAX).double().mean().item() / 2


def dequantize_mv4_v2(mv: torch.Tensor, m_scale: torch.Tensor, v_scale: torch.Tensor):
    """fp32 (m, v) of 4-bit codes ``mv`` of format version 2 or 1 (uint8, both moments per byte) and their block
    scales (bf16 for ``m``; fp32 for ``v`` in version 2, bf16 in version 1: the same decoding), read only to convert
    checkpoints."""
    c = _blocks(mv.to(torch.int64), BLOCK4)
    cm = c & 15
    a = minifloat_value(cm & (M4_SIGN - 1), 0, M4_BIAS)
    m = torch.where(cm >= M4_SIGN, -a, a) * m_scale.float()[:, None]
    v = minifloat_value(c >> 4, 0, BIAS) * v_scale.float()[:, None]
    n = mv.numel()
    return m.reshape(-1)[:n].view(mv.shape), v.reshape(-1)[:n].view(mv.shape)


def v4_scale(v_blocks: torch.Tensor, prev_scale: torch.Tensor, beta2: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The 4-bit ``v`` scale of format versions 3 and 4 (fp32, per block of :data:`BLOCK4`) and its fp32 reciprocal:
    the envelope of :func:`v8_scale` with :data:`V4_HEADROOM` (4) instead of 2, so that a restart puts the block
    maximum on a code (2**-2 of the scale; a factor 2 would put it between two)."""
    return _envelope_scale(v_blocks, prev_scale, beta2, V4_HEADROOM)


def v4_code(y: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """The 4-bit ``v`` code (int64) of format versions 3 and 4 of each fp32 ``y`` in [0, 1] (no NaN), rounded with the
    moments' random word ``bits`` (its bits 8-23, 16 bits).

    Codes ``c >= 1`` stand for ``2**(2 (c - 15))``: 1, 2**-2, ..., 2**-28; code 0 for zero only, and a ``y`` in
    (0, 2**-28) gets code 1 (a nonzero ``v`` decoding to 0 would turn the update into ``m / eps``). A ``y`` in
    ``[2**(2 (c - 15)), 2**(2 (c - 14)))`` gets ``c`` or ``c + 1``, the upper one with probability ``P(u) = A u + (1 -
    A) u**2``, ``u = (y / 2**(2 (c - 15)) - 1) / 3`` its position in the interval and ``A`` = :data:`V4_ROUND_A` / 128
    (1.85): ``P`` is concave, ``P(0) = 0``, ``P(1) = 1``, slope ``A`` at the bottom and ``2 - A`` at the top.

    Why not ``P(u) = u`` (unbiased in ``v``): with two binades a code ``E[1/sqrt(v)]`` of the rounded ``v``, what the
    update divides by, is far from ``1/sqrt(v)`` (Jensen), and a ``v`` that decays leaves a code at the rate the slope
    at the top of the interval below it sets. The slope at the top sets that rate, the ratio of the slopes where a
    stationary ``v`` sits between two codes; ``A = 1.85`` was the best of 1.46, 1.7, 1.85 and 2.0 simulated
    (``scripts/skew_candidates.py``, ``docs/skewed_blocks.md``).

    Integer work on the fp32 bits, exact in every engine: with ``e`` the exponent field of ``y`` and ``f`` its 23
    mantissa bits, ``d = e - (127 - 28)``, the lower code is ``d // 2 + 1`` and the position ``u = q / Q`` with ``q =
    f`` (``d`` even) or ``2**23 + 2 f`` (``d`` odd) and ``Q = 3 * 2**23``. With ``r`` the 16 random bits, the code
    rounds up iff ``(r + 1/2) / 2**16 < P(u)``, that is iff ``(2 r + 1) * 9 * 2**36 < q * (a Q - (a - 128) q)``, ``a``
    = 237: both sides below 2**59, so int64 products, no rounding anywhere.
    """
    b = y.view(torch.int32).to(torch.int64)
    d = (b >> 23) - V4_EXP_MIN
    odd = d & 1
    q = (odd << 23) + ((b & 0x7FFFFF) << odd)
    r = (bits >> V4V3_RAND_SHIFT) & ((1 << V4V3_RAND_BITS) - 1)
    up = ((2 * r + 1) * (9 << (52 - V4V3_RAND_BITS))) < q * (V4_ROUND_A * V4_Q - (V4_ROUND_A - 128) * q)
    c = (d >> 1) + 1 + up.to(torch.int64)
    least = (y > 0).to(torch.int64)
    return torch.where(y >= 2.0**-28, c, least)


def v4_value(code: torch.Tensor) -> torch.Tensor:
    """fp32 value of 4-bit ``v`` codes of format versions 3 and 4: ``2**(2 (c - 15))``, and 0 for code 0."""
    c = code.to(torch.int64)
    val = ((2 * c + (V4_EXP_MIN - 2)) << 23).to(torch.int32).view(torch.float32)
    return torch.where(c > 0, val, torch.zeros_like(val))


def v4_m_unit(cv: torch.Tensor) -> torch.Tensor:
    """The fp32 factor ``2**(c - 15)`` of 4-bit ``v`` codes ``c`` (0 .. 15) that format version 4 codes ``m`` in:
    ``sqrt`` of the code's value over its scale, 2**-15 for code 0. Built on the fp32 bits (exponent field ``112 +
    c``), exact."""
    return ((cv.to(torch.int64) + (127 - V4_CODE_MAX)) << 23).to(torch.int32).view(torch.float32)


def _code_v4(vb: torch.Tensor, rb: torch.Tensor, prev_v_scale: torch.Tensor, beta2: float):
    """Blocks of fp32 ``v`` -> (its codes of versions 3 and 4, int64; the fp32 ``v`` scales): :func:`v4_code` over
    :func:`v4_scale`, a nonzero ``v`` never code 0 (also where ``v * (1 / scale)`` underflows to 0)."""
    sv, inv = v4_scale(vb, prev_v_scale, beta2)
    cv = v4_code(_normalized(vb, inv), rb)
    return torch.where((vb > 0) & (cv == 0), torch.ones_like(cv), cv), sv


def _code_m4(mb: torch.Tensor, a: torch.Tensor, rb: torch.Tensor):
    """Blocks of magnitudes ``a`` (of ``mb``'s elements) -> (sign + e3m0 codes of ``a`` over the block's exact fp32
    absmax of ``a``, the sign ``mb``'s, rounded with the word's bits 0-7; the fp32 scales)."""
    sm, inv = _scale_exact(a)
    cm = minifloat_code(_normalized(a, inv), _rand_offset(rb, M4_RAND_SHIFT, M4V3_RAND_BITS, 23), 0, M4_BIAS)
    return cm | torch.where(mb < 0, M4_SIGN, 0), sm


def _pack4(cm: torch.Tensor, cv: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Both codes in one uint8 per element (``m`` bits 0-3, ``v`` bits 4-7), shaped like ``like``."""
    return (cm | (cv << 4)).reshape(-1)[: like.numel()].to(torch.uint8).view(like.shape)


def _decode_mv4(mv: torch.Tensor, m_scale: torch.Tensor, v_scale: torch.Tensor, m_unit: bool):
    """fp32 (m, v) of 4-bit codes of versions 3 and 4: ``m = +-2**(cm - 7) * m_scale``, times :func:`v4_m_unit` of
    the byte's ``v`` code with ``m_unit`` (version 4); ``v = v4_value(cv) * v_scale``; each product rounded once in
    that order."""
    c = _blocks(mv.to(torch.int64), BLOCK4)
    cm = c & 15
    a = minifloat_value(cm & (M4_SIGN - 1), 0, M4_BIAS)
    m = torch.where(cm >= M4_SIGN, -a, a) * m_scale.float()[:, None]
    if m_unit:
        m = m * v4_m_unit(c >> 4)
    v = v4_value(c >> 4) * v_scale.float()[:, None]
    n = mv.numel()
    return m.reshape(-1)[:n].view(mv.shape), v.reshape(-1)[:n].view(mv.shape)


def quantize_mv4(m: torch.Tensor, v: torch.Tensor, bits: torch.Tensor, prev_v_scale: torch.Tensor, beta2: float):
    """fp32 moments -> (uint8 ``exp_avg_mv`` shaped like ``m``: bits 0-3 the sign + e3m0 code of ``m``, bits 4-7 the
    ``v`` code; fp32 ``m`` scales; fp32 ``v`` scales), scales of shape ``(num_blocks(numel, BLOCK4),)``. 4-bit format
    version 4.

    ``v`` first, as in version 3: :func:`v4_code` over :func:`v4_scale` (the envelope of the block maximum;
    ``prev_v_scale`` the scales stored before this step, ``beta2`` the step's fp32 ``beta2``, 0 for a conversion,
    which restarts every block), its code ``cv``. ``m`` is then coded relative to ``sqrt`` of that code: ``t = |m| *
    2**(15 - cv)`` (an exact fp32 product, the reciprocal of :func:`v4_m_unit`), sign + e3m0 (``2**(c - 7)``, code 0
    zero) of ``t`` over the block's exact fp32 absmax of ``t``, rounded with 8 random bits (the word's bits 0-7).

    Why (version 4, issue 45): the update divides ``m`` by ``sqrt(v)``. Version 3 coded ``m`` over its block's
    absmax of ``|m|``, so in a block whose columns differ in gradient scale an element far below the block's largest
    ``m`` rounded between 0 and 2**-6 of it, noise that made the mean update of those elements 1.2-1.7x AdamW's on
    noise-dominated gradients (``scripts/update_size.py``). ``m / sqrt(v)`` is of the same order across such a block
    (below 1, about 0.23 for pure noise at ``beta1 = 0.9``), so its code keeps every element's precision; since the
    ``v`` code's value is a power of four times the block scale, ``m / sqrt(v_hat)`` is ``t`` times a constant of the
    block, which the block scale of ``t`` takes in: no square root.
    """
    rb = _blocks(bits, BLOCK4)
    cv, sv = _code_v4(_blocks(v, BLOCK4), rb, prev_v_scale, beta2)
    mb = _blocks(m, BLOCK4)
    up = ((127 + V4_CODE_MAX - cv) << 23).to(torch.int32).view(torch.float32)  # 2**(15 - cv): 1 / v4_m_unit(cv)
    cm, sm = _code_m4(mb, mb.abs() * up, rb)
    return _pack4(cm, cv, m), sm, sv


def dequantize_mv4(mv: torch.Tensor, m_scale: torch.Tensor, v_scale: torch.Tensor):
    """fp32 (m, v) of 4-bit codes ``mv`` of format version 4 (uint8, both moments per byte) and their fp32 block
    scales: ``m = (+-2**(cm - 7) * m_scale) * v4_m_unit(cv)``, ``v = v4_value(cv) * v_scale``, each product rounded
    once in that order."""
    return _decode_mv4(mv, m_scale, v_scale, m_unit=True)


def quantize_mv4_v3(m: torch.Tensor, v: torch.Tensor, bits: torch.Tensor, prev_v_scale: torch.Tensor, beta2: float):
    """4-bit format version 3 (read only: kept to convert its checkpoints and to test that version 4 fixes it): as
    :func:`quantize_mv4`, but ``m`` is coded over its block's absmax of ``|m|`` itself."""
    rb = _blocks(bits, BLOCK4)
    mb = _blocks(m, BLOCK4)
    cm, sm = _code_m4(mb, mb.abs(), rb)
    cv, sv = _code_v4(_blocks(v, BLOCK4), rb, prev_v_scale, beta2)
    return _pack4(cm, cv, m), sm, sv


def dequantize_mv4_v3(mv: torch.Tensor, m_scale: torch.Tensor, v_scale: torch.Tensor):
    """fp32 (m, v) of 4-bit codes of format version 3 (read only, to convert checkpoints): ``m = +-2**(cm - 7) *
    m_scale``, ``v`` as in version 4."""
    return _decode_mv4(mv, m_scale, v_scale, m_unit=False)


# Format version 1 (read only, to convert checkpoints written before version 2): int8 m codes c in [-127, 127]
# decoding to sign(c) * (|c|/127)**2 * scale, uint8 v codes to (c/255)**4 * scale.
def _q2(c: torch.Tensor) -> torch.Tensor:
    t = c * INV127
    return t * t


def _q4(c: torch.Tensor) -> torch.Tensor:
    t = c * INV255
    t2 = t * t
    return t2 * t2


def dequantize_m_v1(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 first moment of format version 1 (int8 codes)."""
    c = _blocks(codes.to(torch.float32))
    m = _q2(c.abs()) * scale.float()[:, None]
    m = torch.where(c < 0, -m, m)
    return m.reshape(-1)[: codes.numel()].view(codes.shape)


def dequantize_v_v1(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 second moment of format version 1 (uint8 codes)."""
    c = _blocks(codes.to(torch.float32))
    v = _q4(c) * scale.float()[:, None]
    return v.reshape(-1)[: codes.numel()].view(codes.shape)


# ---------------------------------------------------------------------------------------------------------------
# One AdamW step on one tensor
# ---------------------------------------------------------------------------------------------------------------


def load_moments(state: dict, fmt: str, shape) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode the stored moments of format ``fmt`` (or any float moments) to fp32 tensors of ``shape``.

    ``fmt`` may also be ``"8bit_v1"`` or ``"8bit_v2"``, the 8-bit codes of format version 1 or 2 (read only), or
    ``"4bit_v3"``, ``"4bit_v2"``, ``"4bit_v1"``, the 4-bit codes of format version 3, 2 or 1.
    """
    if fmt in ("8bit", "8bit_v2"):
        m = dequantize_m(state["exp_avg"], state["exp_avg_scale"])
        dq = dequantize_v if fmt == "8bit" else dequantize_v_v2
        v = dq(state["exp_avg_sq"], state["exp_avg_sq_scale"])
        return m.view(shape), v.view(shape)
    if fmt in ("4bit", "4bit_v3", "4bit_v2", "4bit_v1"):
        dq = {"4bit": dequantize_mv4, "4bit_v3": dequantize_mv4_v3}.get(fmt, dequantize_mv4_v2)
        m, v = dq(state["exp_avg_mv"], state["exp_avg_scale"], state["exp_avg_sq_scale"])
        return m.view(shape), v.view(shape)
    if fmt == "8bit_v1":
        m = dequantize_m_v1(state["exp_avg"], state["exp_avg_scale"])
        v = dequantize_v_v1(state["exp_avg_sq"], state["exp_avg_sq_scale"])
        return m.view(shape), v.view(shape)
    return state["exp_avg"].float(), state["exp_avg_sq"].float()


def store_moments(state: dict, fmt: str, m, v, key: int, beta2: float = 0.0) -> None:
    """Encode fp32 moments into the (preallocated) state tensors of format ``fmt``, in place.

    ``key``: the moments' random stream (``stream_key(..., STREAM_MV)``); which bits of each element's random word
    round ``m`` and ``v`` depends on the format (see the module's docstring). ``beta2``: the step's fp32 ``beta2``, by
    which the ``8bit`` ``v`` scale stored in ``state`` decays (:func:`v8_scale`); a conversion passes 0.
    """
    if fmt == "fp32":
        state["exp_avg"].copy_(m)
        state["exp_avg_sq"].copy_(v)
        return
    bits = hash_uniform_bits(m.numel(), key, m.device).view(m.shape)
    if fmt == "compact":
        state["exp_avg"].copy_(round_to_bf16_stochastic(m, bits))
        state["exp_avg_sq"].copy_(round_to_bf16_stochastic(v, (bits & 0xFFFF) << 16))
        return
    if fmt in ("4bit", "4bit_v3", "4bit_v2", "4bit_v1"):
        if fmt in ("4bit", "4bit_v3"):
            quantize = quantize_mv4 if fmt == "4bit" else quantize_mv4_v3
            mv, sm, sv = quantize(m, v, bits, state["exp_avg_sq_scale"], beta2)
        else:
            mv, sm, sv = (quantize_mv4_v2 if fmt == "4bit_v2" else quantize_mv4_v1)(m, v, bits)
        state["exp_avg_mv"].copy_(mv)
        state["exp_avg_scale"].copy_(sm)
        state["exp_avg_sq_scale"].copy_(sv)
        return
    if fmt != "8bit":
        allowed = ", ".join((*STATE_FORMATS, "4bit_v3", "4bit_v2", "4bit_v1"))
        raise ValueError(f"cannot encode state format {fmt!r}; allowed: {allowed}")
    cm, sm = quantize_m(m, bits)
    cv, sv = quantize_v(v, bits, state["exp_avg_sq_scale"], beta2)
    state["exp_avg"].copy_(cm)
    state["exp_avg_scale"].copy_(sm)
    state["exp_avg_sq"].copy_(cv)
    state["exp_avg_sq_scale"].copy_(sv)


def param_stream(fmt: str, param_dtype: torch.dtype) -> int:
    """The random stream that rounds a 16-bit parameter: the moments' word for bf16 with ``8bit`` or ``4bit`` state
    (its top 16 bits, which their codes leave unused), else a stream of its own."""
    shared = fmt in ("8bit", "4bit", "4bit_v3", "4bit_v2", "4bit_v1") and param_dtype == torch.bfloat16
    return STREAM_MV if shared else STREAM_P


def nonfinite_blocks(v: torch.Tensor) -> torch.Tensor:
    """Per block of :data:`BLOCK` elements of the flattened ``v`` (a step's new fp32 second moment, before it is
    rounded or encoded), whether it holds a NaN or an infinity (a bool tensor of ``num_blocks(v.numel())`` elements):
    the blocks a step leaves un-updated (the module docstring says which and why)."""
    return ~torch.isfinite(_blocks(v.float())).all(dim=1)


def adamw_step_ref_(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict,
    *,
    fmt: str,
    scalars: StepScalars,
    seed: int,
    tensor_index: int,
    step: int,
    maximize: bool = False,
    param_rounding: str = "stochastic",
) -> int:
    """Apply one AdamW step to ``param`` in place and update its ``state`` (the format's tensors) in place, except in
    the blocks whose new ``v`` is not finite (:func:`nonfinite_blocks`: a NaN or infinite gradient, or one whose
    square overflows), which keep their parameter, moments and scales.
    Returns the number of such blocks.

    Args:
        param: the parameter (fp32, bf16 or fp16), updated in place.
        grad: its gradient, same shape; any float dtype.
        state: the moment tensors of format ``fmt`` (see :mod:`apexw_hf.formats`).
        fmt: one of :data:`STATE_FORMATS`.
        scalars: the step's fp32-rounded constants.
        seed, tensor_index, step: select the random streams for stochastic rounding.
        maximize: ascend instead of descend.
        param_rounding: ``"stochastic"`` or ``"nearest"`` for bf16/fp16 parameters.
    """
    s = scalars
    g = grad.float()
    if maximize:
        g = -g
    m, v = load_moments(state, fmt, param.shape)
    m = m * s.beta1 + g * s.one_minus_beta1
    v = v * s.beta2 + (g * g) * s.one_minus_beta2
    bad = nonfinite_blocks(v)
    skipped = int(bad.sum())
    if skipped:
        kept = (param.detach().clone(), {k: x.clone() for k, x in state.items() if isinstance(x, torch.Tensor)})
    denom = sqrt_rn(v) * s.inv_bc2_sqrt + s.eps
    p = param.float() * s.decay - (m / denom) * s.step_size
    bits_p = None
    if param.dtype != torch.float32 and param_rounding == "stochastic":
        key_p = stream_key(seed, tensor_index, step, param_stream(fmt, param.dtype))
        bits_p = hash_uniform_bits(p.numel(), key_p, p.device).view(p.shape)
    param.copy_(round_param(p, param.dtype, bits_p))
    store_moments(state, fmt, m, v, stream_key(seed, tensor_index, step, STREAM_MV), s.beta2)
    if skipped:
        _restore_blocks(param, state, kept, bad)
    return skipped


def _restore_blocks(param: torch.Tensor, state: dict, kept: tuple, bad: torch.Tensor) -> None:
    """Put back the values ``kept`` (the parameter and the state tensors before the step) in the ``bad`` blocks of
    :data:`BLOCK` elements: their elements in the parameter and the per-element state, their entries in the block
    scales (one per 256-element block for ``8bit``, two for ``4bit``)."""
    old_p, old_state = kept
    n = param.numel()
    per_elem = bad.repeat_interleave(BLOCK)[:n]
    with torch.no_grad():
        mask = per_elem.view(param.shape)
        param[mask] = old_p[mask]
        for key, old in old_state.items():
            cur = state[key]
            if cur.dim() == 0:
                continue  # the step counter advances
            if cur.numel() == n:
                mask = per_elem
            else:  # block scales: one per 8-bit block, two per block with 4-bit state
                per_block = 1 if cur.numel() == num_blocks(n, BLOCK) else BLOCK // BLOCK4
                mask = bad.repeat_interleave(per_block)[: cur.numel()]
            mask = mask.view(cur.shape)
            cur[mask] = old[mask]
