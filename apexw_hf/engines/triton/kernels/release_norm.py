"""One launch per gradient-release bucket for the step's running gradient norm and the bucket's clip coefficient.

Gradient release (:mod:`apexw_hf.optim.release`) adds each bucket's sum of squares to the step's running sum and,
with clipping, turns it into the coefficient its gradients are multiplied by before their update. Written as PyTorch
operations on 0-d tensors that is about a dozen small operations per bucket, each a few tens of microseconds of host
time on autograd's thread, where the GPU of a small model waits for them. This kernel does the same arithmetic in
one launch; :func:`apexw_hf.optim.release.release_norm_torch` is the same computation in PyTorch operations (CPU
tensors, and the reference the kernel is tested against). Divisions and square roots are the correctly rounded
``div_rn`` / ``sqrt_rn``, as PyTorch computes them, no multiply-add is fused, and the bf16 coefficient is rounded
to nearest even on the bits.

On a GPU the bucket's sum of squares comes from :func:`grad_sumsq_`: one launch that reads the gradients through the
address table of the bucket's AdamW launch plan (the table its update launch reads next), so a bucket's norm costs
two small launches and no per-tensor PyTorch operation (a fused per-tensor norm and a stack of its results took
~0.2 ms of host time per bucket).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._rounding import f32_to_bf16_bits_nearest
from .adamw import ADDR_GRAD, QBLOCK, _base, _find_chunk, _load_f32
from .launch import _TL_DTYPES, INTERPRETED, device_guard

BLOCK = 128
SUMSQ_GROUP = 16  # chunks of the launch plan per program of the sum-of-squares kernel (4,096 elements at 1 x 256)


@triton.jit(do_not_specialize=["n", "k"])
def _release_norm_kernel(
    parts_ptr,  # fp32 [n]: the bucket's per-tensor norms, or (SQUARED) their sums of squares
    n,
    cum_ptr,  # fp32 [>= k + 1]: this step's running sum of squares after each bucket; [k] is written
    k,  # this bucket's index in the step
    prev_cum_ptr,  # fp32: the previous step's running sums (USE_SHARE)
    prev_norm_ptr,  # fp32 [1]: the previous step's global norm (HAS_PREV)
    max_norm,
    coef_ptr,  # fp32 [1]: the clip coefficient (CLIP)
    coef_lo_ptr,  # [1] in the gradients' dtype: the same, rounded to nearest even (CLIP)
    SQUARED: tl.constexpr,
    USE_SHARE: tl.constexpr,
    HAS_PREV: tl.constexpr,
    CLIP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n, BLOCK):
        x = tl.load(parts_ptr + start + offs, mask=start + offs < n, other=0.0)
        if SQUARED:
            acc += x
        else:
            acc += x * x
    sq = tl.sum(acc, axis=0)
    before = tl.load(cum_ptr + tl.maximum(k - 1, 0))
    s = tl.where(k > 0, before + sq, sq)
    tl.store(cum_ptr + k, s)
    if CLIP:
        if USE_SHARE:
            prev_norm = tl.load(prev_norm_ptr)
            share = tl.math.div_rn(tl.load(prev_cum_ptr + k), prev_norm * prev_norm)
            scaled = tl.maximum(tl.math.div_rn(s, share), s, propagate_nan=tl.PropagateNan.ALL)
            norm = tl.sqrt_rn(tl.where(share > 0, scaled, s))
        else:
            norm = tl.sqrt_rn(s)
            if HAS_PREV:
                prev_norm = tl.load(prev_norm_ptr)
                prev_norm = tl.where(prev_norm < float("inf"), prev_norm, 0.0)  # a skipped step's NaN: no estimate
                norm = tl.maximum(norm, prev_norm, propagate_nan=tl.PropagateNan.ALL)
        coef = tl.math.div_rn(max_norm + tl.zeros_like(norm), norm + 1e-6)
        coef = tl.where(coef > 1.0, 1.0, coef)
        coef = tl.where(coef == coef, coef, 0.0)
        # a non-finite gradient so far in this step: every later gradient becomes NaN, so its block is not updated
        coef = tl.where(s < float("inf"), coef, float("nan"))
        tl.store(coef_ptr, coef)
        if coef_lo_ptr.dtype.element_ty == tl.bfloat16:  # on the bits: the interpreter truncates on .to(bf16)
            tl.store(coef_lo_ptr.to(tl.pointer_type(tl.uint16)), f32_to_bf16_bits_nearest(coef))
        else:
            tl.store(coef_lo_ptr, coef.to(coef_lo_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=["num_work", "num_tensors"])
def _grad_sumsq_kernel(
    cstart_ptr,  # the launch plan's tables (see adamw._adamw_kernel)
    gfirst_ptr,
    addr_ptr,
    numel_ptr,
    num_work,
    num_tensors,
    out_ptr,  # fp32 [cdiv(num_work, GROUP)]: each program's sum of squares
    G_DTYPE: tl.constexpr,
    ROWS: tl.constexpr,
    ALIGNED: tl.constexpr,
    GROUP: tl.constexpr,
):
    """Sum of the squared gradient elements of ``GROUP`` consecutive chunks of the plan (the AdamW kernel's
    ``ROWS * 256``-element chunks, each found as that kernel finds it); a gradient address of 0 (a tensor not
    stepping now) adds nothing."""
    pid = tl.program_id(0)
    rows = tl.arange(0, ROWS)
    offs = rows[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :]
    acc = tl.zeros([ROWS, QBLOCK], tl.float32)
    for j in range(GROUP):
        w = pid * GROUP + j
        if w < num_work:
            t, chunk = _find_chunk(w, cstart_ptr, gfirst_ptr, num_tensors)
            g_addr = tl.load(addr_ptr + ADDR_GRAD * num_tensors + t)
            if g_addr != 0:
                start = chunk.to(tl.int64) * (ROWS * QBLOCK)
                rest = tl.minimum(tl.load(numel_ptr + t) - start, ROWS * QBLOCK).to(tl.int32)
                mask = offs < rest
                g = _load_f32(_base(g_addr, start, G_DTYPE, ALIGNED), offs, mask, G_DTYPE, False, ALIGNED, offs, mask)
                acc += g * g
    tl.store(out_ptr + pid, tl.sum(tl.sum(acc, axis=1), axis=0))


_compiled: dict[tuple, object] = {}


def _launch(kernel, key: tuple, grid: int, args: tuple, constexprs: dict, device: torch.device, num_warps: int):
    """Launch ``kernel`` on ``grid`` programs: through Triton's JIT the first time for ``key`` (the specialization:
    device, ``constexprs`` in signature order, whatever else selects it), which compiles or finds the kernel, then
    that compiled kernel directly, without the JIT's per-call binding and hashing (host time on autograd's thread,
    where a small model's GPU waits for it). The interpreter has no compiled kernel: every launch goes through it."""
    key = (kernel, *key)
    compiled = _compiled.get(key)
    with device_guard(device):
        if compiled is not None:
            compiled[(grid, 1, 1)](*args, *constexprs.values())
            return
        compiled = kernel[(grid,)](*args, **constexprs, num_warps=num_warps, enable_fp_fusion=False)
    if not INTERPRETED:
        _compiled[key] = compiled


def release_norm_(
    parts: torch.Tensor,
    squared: bool,
    cum: torch.Tensor,
    k: int,
    prev_cum: torch.Tensor | None,
    prev_norm: torch.Tensor | None,
    max_norm: float | None,
    coef: torch.Tensor,
    coef_lo: torch.Tensor,
) -> None:
    """Write ``cum[k]`` (and, with ``max_norm``, ``coef`` / ``coef_lo``) from ``parts``, as
    :func:`apexw_hf.optim.release.release_norm_torch` computes them. ``prev_cum`` (the previous step's running
    sums, holding an entry ``k``) selects the share estimate; ``prev_norm`` alone the fallback."""
    use_share = max_norm is not None and prev_cum is not None and prev_norm is not None
    constexprs = dict(
        SQUARED=bool(squared),
        USE_SHARE=use_share,
        HAS_PREV=prev_norm is not None,
        CLIP=max_norm is not None,
        BLOCK=BLOCK,
    )
    args = (
        parts,
        parts.numel(),
        cum,
        int(k),
        prev_cum if prev_cum is not None else cum,
        prev_norm if prev_norm is not None else cum,
        float(max_norm or 0.0),
        coef,
        coef_lo,
    )
    key = (parts.device, coef_lo.dtype, *constexprs.values())
    _launch(_release_norm_kernel, key, 1, args, constexprs, parts.device, num_warps=1)


def grad_sumsq_(plans) -> torch.Tensor:
    """The sums of squares of the gradients in the address tables of ``plans`` (:class:`.launch.LaunchPlan`, their
    gradient addresses set), as fp32 partial sums: one launch per plan, ``release_norm_(parts, squared=True, ...)``
    adds them up. Each plan keeps its buffer of partial sums (``plan.sumsq_parts``), written again by its next
    bucket's launch: read it before then (the release norm kernel, on the same stream, does)."""
    parts = []
    for plan in plans:
        programs = -(-plan.num_work // SUMSQ_GROUP)
        out = plan.sumsq_parts
        if out is None or out.numel() != programs:
            out = plan.sumsq_parts = torch.zeros(programs, dtype=torch.float32, device=plan.device)
        parts.append(out)
        if programs == 0:
            continue
        constexprs = dict(
            G_DTYPE=_TL_DTYPES[plan.grad_dtype], ROWS=plan.rows, ALIGNED=plan.grads_aligned, GROUP=SUMSQ_GROUP
        )
        args = (plan.cstart, plan.gfirst, plan.addr, plan.numel, plan.num_work, plan.num_tensors, out)
        key = (plan.device, *constexprs.values())
        _launch(_grad_sumsq_kernel, key, programs, args, constexprs, plan.device, num_warps=plan.rows)
    return parts[0] if len(parts) == 1 else torch.cat(parts)
