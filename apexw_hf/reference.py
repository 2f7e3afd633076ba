"""Plain-PyTorch reference of every ApexW numeric: the AdamW update, bf16/fp16 rounding, 8-bit block quantization.

This module is the specification, written per tensor to be read. The Triton kernels (``apexw_hf.kernels``) and the
plain-PyTorch engine that ApexW runs on the CPU (``apexw_hf.optim.torch_engine``, a param group at a time) compute
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
* ``8bit``: blocks of :data:`BLOCK` elements along the flattened tensor, one bf16 scale per block and moment (the
  block's absolute maximum rounded up to bf16). ``m`` is an int8 code ``c`` in [-127, 127] decoding to
  ``sign(c) * (|c|/127)**2 * scale``; ``v`` is a uint8 code in [0, 255] decoding to ``(c/255)**4 * scale``. A value
  ``y`` (normalized by the scale) lies between the decoded values of two neighbouring codes: ``lo``, the largest
  code decoding to at most ``y``, and ``lo + 1``. The code is chosen between them by stochastic rounding with
  probabilities that make the decoded value unbiased. Zero encodes to code 0 exactly, and a nonzero ``v`` never
  encodes to 0 (it would turn the next update into ``m / eps``).

Stochastic rounding of both moments draws on one 32-bit random word per element: its top 16 bits round ``m``, its
low 16 bits round ``v``.

Parameters in bf16 or fp16 receive the fp32 update rounded stochastically by default (``param_rounding="nearest"``
switches to round-to-nearest-even).
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
    "num_blocks",
    "load_moments",
    "store_moments",
    "adamw_step_ref_",
]

BLOCK = 256
STATE_FORMATS = ("fp32", "compact", "8bit")
PARAM_ROUNDINGS = ("stochastic", "nearest")

TWO_POW_M16 = 2.0**-16

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


def _uniform16(half: torch.Tensor) -> torch.Tensor:
    """Uniform fp32 in [0, 1) from 16 random bits (values in [0, 2**16)), exact in fp32."""
    return half.to(torch.float32) * TWO_POW_M16


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


def num_blocks(numel: int) -> int:
    return (numel + BLOCK - 1) // BLOCK


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """Flattened fp32 values padded with zeros to whole blocks: shape (num_blocks, BLOCK)."""
    flat = x.reshape(-1)
    pad = num_blocks(flat.numel()) * BLOCK - flat.numel()
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, BLOCK)


def _scale(x_abs_blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block scale (bf16, absmax rounded up) and its fp32 reciprocal (0 where the scale is 0)."""
    scale = bf16_round_up(x_abs_blocks.amax(dim=1))
    s32 = scale.float()
    inv = torch.where(s32 == 0, torch.zeros_like(s32), 1.0 / s32)
    return scale, inv


def _normalized(x_abs_blocks: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    y = torch.clamp(x_abs_blocks * inv[:, None], max=1.0)
    return torch.where(torch.isnan(y), torch.zeros_like(y), y)


def _q2(c: torch.Tensor) -> torch.Tensor:
    t = c * INV127
    return t * t


def _q4(c: torch.Tensor) -> torch.Tensor:
    t = c * INV255
    t2 = t * t
    return t2 * t2


_Q2_TABLE = _q2(torch.arange(128, dtype=torch.float32))  # decoded |m| of every code, increasing
_Q4_TABLE = _q4(torch.arange(256, dtype=torch.float32))


def _lower_code(y: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The largest code whose decoded value is ``<= y``, at most the second-largest code (as fp32).

    The kernels find it with an approximate root and one comparison (``kernels._quant.lower_code``).
    """
    lo = torch.searchsorted(table.to(y.device), y.contiguous(), right=True) - 1
    return torch.clamp(lo, 0, table.numel() - 2).to(torch.float32)


def _stochastic_code(y: torch.Tensor, lo: torch.Tensor, q, u: torch.Tensor) -> torch.Tensor:
    """Pick lo or lo+1 so that the decoded value is y on average."""
    qlo = q(lo)
    qhi = q(lo + 1.0)
    return lo + ((u * (qhi - qlo)) < (y - qlo)).to(torch.float32)


def quantize_m(m: torch.Tensor, bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 first moment -> (int8 codes shaped like ``m``, bf16 scales of shape (num_blocks,)).

    ``bits``: 32 random bits per element, of which the top 16 are used.
    """
    n = m.numel()
    mb = _blocks(m)
    a = mb.abs()
    scale, inv = _scale(a)
    y = _normalized(a, inv)
    c = _stochastic_code(y, _lower_code(y, _Q2_TABLE), _q2, _uniform16(_blocks(bits) >> 16))
    c = torch.where(mb < 0, -c, c)
    return c.reshape(-1)[:n].to(torch.int8).view(m.shape), scale


def dequantize_m(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    c = _blocks(codes.to(torch.float32))
    m = _q2(c.abs()) * scale.float()[:, None]
    m = torch.where(c < 0, -m, m)
    return m.reshape(-1)[: codes.numel()].view(codes.shape)


def quantize_v(v: torch.Tensor, bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 second moment (>= 0) -> (uint8 codes shaped like ``v``, bf16 scales of shape (num_blocks,)).

    ``bits``: 32 random bits per element, of which the low 16 are used.
    """
    n = v.numel()
    vb = _blocks(v)
    scale, inv = _scale(vb)
    y = _normalized(vb, inv)
    c = _stochastic_code(y, _lower_code(y, _Q4_TABLE), _q4, _uniform16(_blocks(bits) & 0xFFFF))
    c = torch.where((vb > 0) & (c == 0), torch.ones_like(c), c)
    return c.reshape(-1)[:n].to(torch.uint8).view(v.shape), scale


def dequantize_v(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    c = _blocks(codes.to(torch.float32))
    v = _q4(c) * scale.float()[:, None]
    return v.reshape(-1)[: codes.numel()].view(codes.shape)


# ---------------------------------------------------------------------------------------------------------------
# One AdamW step on one tensor
# ---------------------------------------------------------------------------------------------------------------


def load_moments(state: dict, fmt: str, shape) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode the stored moments of format ``fmt`` (or any float moments) to fp32 tensors of ``shape``."""
    if fmt == "8bit":
        m = dequantize_m(state["exp_avg"], state["exp_avg_scale"])
        v = dequantize_v(state["exp_avg_sq"], state["exp_avg_sq_scale"])
        return m.view(shape), v.view(shape)
    return state["exp_avg"].float(), state["exp_avg_sq"].float()


def store_moments(state: dict, fmt: str, m, v, key: int) -> None:
    """Encode fp32 moments into the (preallocated) state tensors of format ``fmt``, in place.

    ``key``: the moments' random stream (``stream_key(..., STREAM_MV)``); the top 16 bits of each element's random
    word round ``m``, the low 16 bits round ``v``.
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
    cm, sm = quantize_m(m, bits)
    cv, sv = quantize_v(v, bits)
    state["exp_avg"].copy_(cm)
    state["exp_avg_scale"].copy_(sm)
    state["exp_avg_sq"].copy_(cv)
    state["exp_avg_sq_scale"].copy_(sv)


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
) -> None:
    """Apply one AdamW step to ``param`` in place and update its ``state`` (the format's tensors) in place.

    Args:
        param: the parameter (fp32, bf16 or fp16), updated in place.
        grad: its gradient, same shape; any float dtype.
        state: the moment tensors of format ``fmt`` (see :mod:`apexw_hf.optim.state`).
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
    denom = sqrt_rn(v) * s.inv_bc2_sqrt + s.eps
    p = param.float() * s.decay - (m / denom) * s.step_size
    bits_p = None
    if param.dtype != torch.float32 and param_rounding == "stochastic":
        bits_p = hash_uniform_bits(p.numel(), stream_key(seed, tensor_index, step, STREAM_P), p.device).view(p.shape)
    param.copy_(round_param(p, param.dtype, bits_p))
    store_moments(state, fmt, m, v, stream_key(seed, tensor_index, step, STREAM_MV))
