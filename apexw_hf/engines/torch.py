"""Plain-PyTorch engine of :class:`~apexw_hf.optim.base.ApexW`: the reference's bits, a param group at a time.

``reference.adamw_step_ref_`` is the specification: per tensor, readable, and slow (int64 hashing, a square root
corrected in fp64, fresh tensors for every intermediate). This engine computes the same bits with the work laid out
for a CPU:

* The tensors of a param group that share a parameter dtype and a step count are processed as one sequence of
  *chunks* of at most :data:`CHUNK` elements. A piece of a large tensor that fills a chunk is used in place (views of
  the parameter, gradient and state); small tensors and the tails of large ones are packed into one chunk
  (parameters and gradients gathered by one ``torch.cat`` or ``torch._foreach_copy_`` each and the parameters
  scattered back by one ``torch._foreach_copy_``). A packed chunk keeps the moments (and 8-bit or 4-bit scales) of
  its whole tensors in buffers of its own, their state dict entries being views of them (as the step counters are
  views of one buffer), so that state is read and written where it lies; only tails and DTensor shards are copied in
  and out. In a packed 8-bit (4-bit) chunk every tensor starts at a block boundary (of 256, 128 elements) and its
  padding is zero, as in ``reference._blocks``.
  A chunk's scratch (41 bytes per element allocated, about 33 of them touched by an 8-bit chunk: buffers that are
  never live together share memory, :class:`~apexw_hf.engines.torch_passes.Scratch`) stays in the CPU caches, so the
  elementwise passes of an 8-bit step (44 operations over the chunk, about 58 chunk-lengths of elements, and the
  NumPy root; about 20 more on the per-block scales) read cache, not memory, and a chunk is large enough to amortize
  PyTorch's cost per operation (a few microseconds of Python and dispatch, serial, while the other intra-op threads
  wait). On a 2-core CPU that serial part (with the single-threaded root) is still roughly a third of an 8-bit step,
  and the barrier that ends each operation costs up to twice the step when the two threads do not run together
  (docs/performance.md).
* Every operation writes into preallocated scratch or in place, and scalar operands are 0-dim tensors made once (a
  Python number costs a conversion per call). No fused multiply-add touches the update: ``addcmul`` and
  ``add(alpha=)`` are fused in torch's CPU kernels, so the update is plain ``mul``/``add``/``div`` in the reference's
  order. The two moments sit side by side in one buffer, so ``m * beta1`` and ``v * beta2`` (and most 4-bit work) are
  one operation each, with a column of per-moment constants.
* Random words: the reference's hash of (seed, tensor index, step, stream, element index) in int32 arithmetic with
  wrapping multiplies and masked shifts (exact mod 2**32), one word per element for the moments (and, for bf16
  parameters with 8-bit or 4-bit state, for the parameter: ``reference.param_stream``). The per-tensor keys come from
  :mod:`apexw_hf._random` on the host once per step and are spread over a packed chunk per block.
* The correctly rounded fp32 square root comes from NumPy on the CPU (the IEEE instruction; ``torch.sqrt`` on the
  CPU is a polynomial that may be 1 ulp off, see ``reference.sqrt_rn``, which this engine uses on other devices).
* 8-bit (format version 3) and 4-bit state (format version 4) are decoded and encoded by the reference's own functions
  over the chunk's whole blocks (its blocks and random words are the reference's per tensor): exact, but several times
  slower than passes of their own would be, which they do not have yet; the numba path (the CPU default) and the Triton
  kernels have theirs.
* The bit-level shortcut of stochastic rounding to bf16 does not handle NaN; where a compact chunk's moments hold a
  NaN the reference's own functions encode that chunk, and a bf16 parameter chunk with a NaN goes through
  ``reference.round_param`` (same bits, slower; NaN is rare and poisons the run anyway). fp16 parameters with
  stochastic rounding always use ``reference.round_param``.
* Non-finite gradients (``reference.nonfinite_blocks``: a 256-element block whose new ``v`` holds a NaN or an
  infinity keeps its parameter, moments and scales): a sum of the gathered gradient's squares and of the decoded
  ``v``, in cache, tells whether a chunk may have any; only then are the new ``v`` of its blocks computed and the
  parameter and state elements of its bad blocks copied before the update and written back after it (the update
  itself runs as always, its NaN paths above included). The numba loop skips such blocks itself.

The elementwise passes over one chunk are in :mod:`apexw_hf.engines.torch_passes`; this module plans the chunks and
moves the data. With ``8bit`` or ``4bit`` state on the CPU (fp32 or bf16 parameters) and numba installed, each chunk
of the same plan goes instead to one fused loop compiled by numba (:mod:`apexw_hf.engines.numba`: the same bits,
one pass over the data instead of about 64 operations; docs/performance.md has the timings);
without numba that is logged once, and ``TorchEngine.numba_used`` tells whether the fused path ran. Tensors that are
not contiguous (a parameter or a state tensor) are stepped by ``reference.adamw_step_ref_`` itself.
Results are bit-identical to the reference on every path (``tests/engines/test_torch_engine.py``), except for the sign
and payload bits of NaNs, which IEEE arithmetic leaves to the hardware.

Interface (the ``Engine`` contract of :mod:`apexw_hf.engines`, as :class:`~apexw_hf.engines.triton.TritonEngine`)::

    engine = TorchEngine()
    engine.check(group, params, grads)        # before the caller creates missing state
    engine.step_group(group, params, grads, states, tensor_indices, grad_scale=None, nonfinite=None)
    engine.invalidate()                       # after load_state_dict
"""

from __future__ import annotations

import logging
import math
import operator

import numpy as np
import torch

from .. import _random as rnd
from .. import dtensor as dt
from .. import reference as ref
from ..formats import MOMENT_DTYPES, MV4_KEY, SCALE_BLOCKS, SCALE_DTYPES, SCALE_KEYS, STATE_KEYS, moment_keys
from ..hparams import step_hparams
from .torch_passes import (
    Scratch,
    bf16_stochastic,
    full_bits,
    hash_into,
    sqrt_into,
)

logger = logging.getLogger(__name__)

# Elements per chunk: 2 MiB per fp32 buffer, about 20 MiB of scratch in all (about 16 MiB touched by an 8-bit chunk).
# On a 2-core CPU, 2**19 and 2**18 tie when the machine is quiet, and 2**19 is faster when an OpenMP barrier per
# operation costs more (fewer operations per element); 2**17 and 2**20 are slower (benchmarks/bench_cpu_step.py).
CHUNK = 1 << 19


# On a CUDA device an int32 shift written into an int16 tensor (bf16 rounding, block scales) is computed in int16, not
# in int32 as on the CPU: the passes keep such shifts in int32 (torch_passes' docstring; test_torch_engine.py
# emulates the CUDA rule on the CPU). With that, every format with fp32, bf16 and fp16 parameters gives the
# reference's bits on CUDA too (tests/engines/test_torch_engine_cuda.py, GPU only), so no combination is refused there.


_NUMBA_ENGINE = None  # apexw_hf.engines.numba once imported; False when numba cannot be imported


def numba_engine():
    """The fused CPU path (:mod:`apexw_hf.engines.numba`), or None when numba cannot be imported; the first
    time that happens it is logged (WARNING), with how to install numba."""
    global _NUMBA_ENGINE
    if _NUMBA_ENGINE is None:
        try:
            from . import numba as module

            _NUMBA_ENGINE = module
        except ImportError as e:
            _NUMBA_ENGINE = False
            logger.warning(
                "ApexW: numba is not available (%s), so 8-bit and 4-bit optimizer steps on the CPU run as many "
                "separate PyTorch operations, several times slower than with it; install it with: pip install "
                "'apexw_hf[cpu]' (or pip install numba)",
                e,
            )
    return _NUMBA_ENGINE or None


# ---- plans ------------------------------------------------------------------------------------------------------


class _Chunk:
    """One batch of elements. ``segs``: (slot, first element in the tensor, count, chunk offset, whole tensor)."""

    __slots__ = ("segs", "length", "direct", "pads", "io", "flat", "fused")

    def __init__(self, segs, length, direct, pads):
        self.segs = segs
        self.length = length
        self.direct = direct
        self.pads = pads  # (offset, count) of block padding (8-bit, 4-bit) in a packed chunk
        self.io = None  # persistent views (see _Layout._bind)
        self.flat = None  # a packed chunk's own moment buffers (see _Layout._flatten)
        self.fused = None  # the numba path's tables of this chunk (numba._ChunkTables)


def _plan_chunks(numels: list[int], block: int | None) -> list[_Chunk]:
    """Cut tensors of ``numels`` elements into chunks; full-chunk pieces in place, the rest packed in order (each
    piece at a multiple of ``block``, when given)."""
    chunks, segs, fill = [], [], 0

    def close():
        nonlocal segs, fill
        if segs:
            pads = []
            if block:
                for _, _, n, off, _ in segs:
                    end = -(-n // block) * block
                    if end > n:
                        pads.append((off + n, end - n))
            chunks.append(_Chunk(segs, fill, False, pads))
        segs, fill = [], 0

    for slot, n in enumerate(numels):
        start = 0
        while n - start >= CHUNK:
            chunks.append(_Chunk([(slot, start, CHUNK, 0, start == 0 and n == CHUNK)], CHUNK, True, []))
            start += CHUNK
        rest = n - start
        if rest:
            span = -(-rest // block) * block if block else rest
            if fill + span > CHUNK:
                close()
            segs.append((slot, start, rest, fill, start == 0))
            fill += span
    close()
    return chunks


class _Layout:
    """Chunks of the members of one param group that share a parameter dtype and a step count."""

    def __init__(self, group, members, states, indices: list[int], scratch: Scratch):
        self.members = members
        self.indices = indices  # tensor indices of the members (the random streams, the non-finite counters)
        self.fmt = group["state_format"]
        self.block = SCALE_BLOCKS.get(self.fmt)  # None for unquantized moments
        self.dtype = members[0].dtype
        self.local_states = [dt.local_view(s, p) if dt.is_dtensor(p) else s for p, s in zip(members, states)]
        self.fast, self.slow = [], []
        for i, (p, s) in enumerate(zip(members, self.local_states)):
            tensors = [dt.local(p)] + [s[k] for k in STATE_KEYS if k in s]
            (self.fast if all(t.is_contiguous() for t in tensors) else self.slow).append(i)
        self.tindex = [indices[i] for i in self.fast]  # by slot
        self.tkeys = [rnd.tensor_key(group["seed"], i) for i in self.tindex]
        self.tkeys_np = np.array(self.tkeys, dtype=np.uint64)
        self.locals = [dt.local(members[i]) for i in self.fast]
        self.shapes = [p.shape for p in self.locals]
        self.chunks = _plan_chunks([p.numel() for p in self.locals], self.block)
        for ch in self.chunks:
            if not ch.direct:
                ch.flat = self._flatten(ch)
            ch.io = self._bind(ch, scratch)

    def _flatten(self, ch: _Chunk):
        """A packed chunk's own moment buffers: both moments side by side (4-bit: the one tensor of both moments'
        codes), and for 8-bit and 4-bit both moments' block scales side by side, zero where nothing lies (block
        padding). The state of each whole tensor of the chunk (not a
        DTensor) moves into them, its state dict entries becoming views (values kept; still plain tensors for
        ``state_dict``), so the chunk reads and writes that state where it lies instead of gathering and scattering
        it; tails of large tensors and DTensor shards are still copied in and out.

        Returns ``(moments, (both scales in one buffer or None, (m scales, v scales) or None), indices of the segments
        that live there)``.
        """
        n, fmt, blk = ch.length, self.fmt, self.block
        dev = self.locals[0].device
        mdtype = MOMENT_DTYPES[fmt][0]
        keys = moment_keys(fmt)
        mom = torch.zeros(len(keys) * n, dtype=mdtype, device=dev)
        nb = n // blk if blk else 0
        scl, parts = None, None
        if blk:
            sdt = SCALE_DTYPES[fmt]
            if sdt[0] == sdt[1]:  # 4-bit (format version 4): both fp32, in one buffer
                scl = torch.zeros(2 * nb, dtype=sdt[0], device=dev)
                parts = (scl[:nb], scl[nb:])
            else:  # 8-bit (format version 3): bf16 m scales, fp32 v scales
                parts = tuple(torch.zeros(nb, dtype=d, device=dev) for d in sdt)
        moved = set()
        for j, (slot, _, k, o, whole) in enumerate(ch.segs):
            i = self.fast[slot]
            if not whole or dt.is_dtensor(self.members[i]):
                continue
            state = self.local_states[i]  # the state dict itself
            for key, at in zip(keys, (o, n + o)):
                view = mom[at : at + k].view(state[key].shape)
                view.copy_(state[key])
                state[key] = view
            if parts is not None:
                kb = -(-k // blk)
                for key, part in zip(SCALE_KEYS, parts):
                    view = part[o // blk : o // blk + kb]
                    view.copy_(state[key])
                    state[key] = view
            moved.add(j)
        return mom, (scl, parts), moved

    def _bind(self, ch: _Chunk, scratch: Scratch) -> dict:
        """The persistent tensors a chunk reads and writes: (source, scratch slice) pairs of the same shape for a
        packed chunk, flat views for an in-place chunk."""
        fmt, blk = self.fmt, self.block
        b = scratch.upto(ch.length, blk or ref.BLOCK)
        st = [self.local_states[i] for i in self.fast]
        io = {}

        def piece(t, seg, scale=False):
            slot, a, k, _, whole = seg
            if scale:
                return t if whole else t[a // blk : -(-(a + k) // blk)]
            return t if whole else t.view(-1)[a : a + k]

        def slices(buf):
            out = []
            for seg in ch.segs:
                slot, a, k, o, whole = seg
                out.append(buf[o : o + k].view(self.shapes[slot]) if whole else buf[o : o + k])
            return out

        p_kind = "p" if self.dtype == torch.float32 else "p_store"
        p_buf = b.p if self.dtype == torch.float32 else b.typed("p_store", self.dtype)
        if ch.direct:
            seg = ch.segs[0]
            io["p"] = piece(self.locals[seg[0]], (*seg[:4], False))
            for key in STATE_KEYS:
                if key in st[seg[0]]:
                    io[key] = piece(st[seg[0]][key], (*seg[:4], False), scale=key.endswith("_scale"))
            return io
        io["p_src"] = [piece(self.locals[s[0]], s) for s in ch.segs]
        io["p_in"] = slices(b.p)
        io["p_out"] = slices(p_buf) if p_kind == "p_store" else io["p_in"]
        io["g_dst"] = slices(b.g)
        pad_at = dict(ch.pads)

        def cat_list(pieces, dtype):
            """Flat pieces with zeros for the block padding (a same-dtype gather is one torch.cat, cheaper per
            tensor than _foreach_copy_, which converts dtypes (bf16 parameters, compact moments) and does the
            gradients)."""
            out = []
            for seg, t in zip(ch.segs, pieces):
                out.append(t.reshape(-1))
                pad = pad_at.get(seg[3] + seg[2])
                if pad:
                    out.append(torch.zeros(pad, dtype=dtype, device=t.device))
            return out

        gather, pads_in = [], [b.g[o : o + k] for o, k in ch.pads]
        if self.dtype == torch.float32:
            gather.append(("cat", b.p, cat_list(io["p_src"], torch.float32)))
        else:
            gather.append(("copy", io["p_in"], io["p_src"]))
            pads_in += [b.p[o : o + k] for o, k in ch.pads]
        # moments: the chunk's own buffers (_flatten); copied in and out only for segments that do not live there
        mom, (scl, parts), moved = ch.flat
        rest = [seg for j, seg in enumerate(ch.segs) if j not in moved]
        n = ch.length
        dst, src = [], []
        for key, at in zip(moment_keys(fmt), (0, n)):
            for seg in rest:
                slot, a, k, o, whole = seg
                dst.append(mom[at + o : at + o + k])
                src.append(piece(st[slot][key], seg).reshape(-1))
        if blk:
            for key, part in zip(SCALE_KEYS, parts):
                for seg in rest:
                    slot, a, k, o, whole = seg
                    dst.append(part[o // blk : o // blk + -(-k // blk)])
                    src.append(piece(st[slot][key], seg, scale=True))
            io["pads_mv"] = [x[o : o + k] for x in (b.m, b.v) for o, k in ch.pads]
        io["moments_in"], io["moments_out"] = (dst, src), (src, dst)
        io["mom"], io["mom_m"], io["mom_v"] = mom, mom[:n], mom[n:]
        if parts is not None:
            io["scl"], (io["scl_m"], io["scl_v"]) = scl, parts
        io["gather"], io["pads_in"] = gather, pads_in
        return io


class _GroupPlan:
    """The layouts of the stepping params of one param group, and their step counters.

    ``state["step"]`` of each of those params becomes a 0-dim view of one CPU fp32 buffer (values kept; still a plain
    0-dim fp32 tensor for ``state_dict``), so one in-place add increments them all while the same params step.
    """

    def __init__(self, group, params, states, indices, steps, scratch):
        self.fmt, self.seed = group["state_format"], group["seed"]
        self.steps = torch.tensor(steps, dtype=torch.float32)
        self.step_views = list(self.steps.unbind())
        for s, view in zip(states, self.step_views):
            s["step"] = view
        by_kind: dict[tuple, list[int]] = {}
        for i, (p, t) in enumerate(zip(params, steps)):
            by_kind.setdefault((p.dtype, t - steps[0]), []).append(i)
        self.layouts = [
            (
                _Layout(group, [params[i] for i in idx], [states[i] for i in idx], [indices[i] for i in idx], scratch),
                idx,
            )
            for idx in by_kind.values()
        ]
        # after the layouts, which may move state (_flatten); a state tensor replaced since makes a new plan
        self.moments = [s.get(key) for s in states for key in STATE_KEYS]
        # the chunks hold views of the parameters' memory: a parameter given other memory since makes a new plan
        self.addresses = _addresses(params)


def _addresses(params: list) -> list[int]:
    """Where each parameter's (local shard's) elements are. ``p.data = ...``, ``torch.utils.swap_tensors`` (which
    ``Module._apply`` uses for ``DTensor`` parameters) and FSDP2 re-padding a shard keep the parameter object but move
    its elements; the views a plan took of the old memory would then be stepped instead."""
    return [dt.local(p).data_ptr() for p in params]


class TorchEngine:
    """Runs :meth:`ApexW.step` for param groups in plain PyTorch (see the module docstring)."""

    # 8-bit and 4-bit state on the CPU with fp32 or bf16 parameters run on the fused numba path when numba is
    # installed (numba_engine); False (per engine or on the class) keeps every chunk on the torch passes.
    use_numba = True

    def __init__(self):
        # Keyed by (id(group), bucket): bucket None for step(), one plan per bucket of gradient release. A plan whose
        # step counters were replaced by another's fails the identity check below and is rebuilt.
        self._layouts: dict[tuple[int, object], _GroupPlan] = {}
        self._scratch: dict = {}
        self.numba_used = False  # whether any chunk ran on the fused numba path (see use_numba)

    def invalidate(self) -> None:
        """Forget the cached chunk plans (state tensors were replaced)."""
        self._layouts.clear()

    def _scratch_for(self, device) -> Scratch:
        sc = self._scratch.get(device)
        if sc is None:
            sc = self._scratch[device] = Scratch(device, CHUNK)
        return sc

    def check(self, group: dict, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """The errors of :meth:`step_group` that ``group``, ``params`` and ``grads`` decide (the ``Engine`` contract):
        a hyperparameter :func:`~apexw_hf.hparams.step_hparams` refuses, a sparse gradient, a gradient of another
        shape than its parameter's. Changes nothing."""
        if params:
            step_hparams(group)
            _check_grads(params, grads)

    def step_group(
        self,
        group: dict,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        states: list[dict],
        tensor_indices: list[int],
        bucket: object = None,
        grad_scale=None,
        stager=None,
        nonfinite=None,
    ) -> None:
        """Increment the step of ``params`` (the group's params with a gradient) and apply one AdamW update (the
        ``Engine`` contract of :mod:`apexw_hf.engines` says what each argument means).

        ``states`` are read at every call: a plan whose step counters, moments or parameter memory are not those it
        was built on is rebuilt. ``grad_scale`` (a tensor, or a callable called with ``None`` once the checks have
        passed) multiplies ``grads`` in place, one fused multiply per gradient dtype, before the update: the chunks'
        passes and the numba loop then read gradients as they would any other, and no second copy of the gradients
        is held. ``stager`` (state offload) raises ValueError: the state is stepped where it lies. ``nonfinite``
        receives the blocks skipped for non-finite gradients (``add``), counted on the host.
        """
        if not params:
            return
        if stager is not None:
            raise ValueError(
                "state offload streams the state through the Triton kernels; the plain-PyTorch engine steps the state "
                "where it lies (use engine='triton' on a GPU, or turn state_offload off)"
            )
        hp = step_hparams(group)  # before any step counter moves: a bad value then changes nothing
        _check_grads(params, grads)
        if callable(grad_scale):
            grad_scale = grad_scale(None)
        if grad_scale is not None:
            _scale_grads_(grads, grad_scale)
        step_tensors = [s["step"] for s in states]
        cached = self._layouts.get((id(group), bucket))
        if (
            cached is not None
            and cached.fmt == group["state_format"]
            and cached.seed == group["seed"]
            and len(step_tensors) == len(cached.step_views)
            and all(map(operator.is_, step_tensors, cached.step_views))
            and all(map(operator.is_, (s.get(key) for s in states for key in STATE_KEYS), cached.moments))
            and _addresses(params) == cached.addresses
        ):
            # The same params step again, in the same memory, with the same state: their step counters are views of
            # one buffer.
            cached.steps.add_(1.0)
            steps = [int(t) for t in cached.steps.tolist()]
        else:
            for t in step_tensors:
                t.add_(1.0)
            steps = [int(t.item()) for t in step_tensors]
            cached = _GroupPlan(
                group, params, states, tensor_indices, steps, self._scratch_for(dt.local(params[0]).device)
            )
            self._layouts[(id(group), bucket)] = cached
        for layout, idx in cached.layouts:
            t = steps[idx[0]]
            self._step_layout(group, layout, [grads[i] for i in idx], t, ref.StepScalars.make(step=t, **hp), nonfinite)

    def _fused(self, layout: _Layout):
        """The numba module when this layout runs on it: 8-bit or 4-bit state, fp32 or bf16 parameters, CPU."""
        if not (self.use_numba and layout.fmt in ("8bit", "4bit") and layout.dtype in (torch.float32, torch.bfloat16)):
            return None
        if layout.locals[0].device.type != "cpu":
            return None
        return numba_engine()

    def _step_layout(self, group, layout: _Layout, grads, t: int, s: ref.StepScalars, nonfinite=None) -> None:
        maximize = group["maximize"]
        rounding = group["param_rounding"]
        skipped: dict[int, int] = {}  # tensor index -> blocks left un-updated (non-finite gradients)
        for i in layout.slow:
            p = layout.members[i]
            skipped[layout.indices[i]] = ref.adamw_step_ref_(
                dt.local(p),
                dt.local(grads[i]),
                layout.local_states[i],
                fmt=layout.fmt,
                scalars=s,
                seed=group["seed"],
                tensor_index=layout.indices[i],
                step=t,
                maximize=maximize,
                param_rounding=rounding,
            )
        if layout.fast:
            self._step_fast(group, layout, grads, t, s, skipped)
        if nonfinite is not None and any(skipped.values()):
            nonfinite.add(layout.locals[0].device if layout.fast else dt.local(layout.members[0]).device, skipped)

    def _step_fast(self, group, layout: _Layout, grads, t: int, s: ref.StepScalars, skipped: dict) -> None:
        """The chunks of ``layout`` (its contiguous tensors); the blocks skipped for non-finite gradients are added to
        ``skipped`` by tensor index."""
        maximize = group["maximize"]
        rounding = group["param_rounding"]
        grads = [dt.local(grads[i]) for i in layout.fast]
        sc = self._scratch_for(layout.locals[0].device)
        fused = self._fused(layout)
        if fused is not None:
            keys_mv = _stream_keys(layout.tkeys_np, rnd.mix32(t), rnd.STREAM_MV)
            for ch in layout.chunks:
                for slot, n in fused.step_chunk(layout, ch, sc, grads, s, keys_mv, maximize, rounding).items():
                    skipped[layout.tindex[slot]] = skipped.get(layout.tindex[slot], 0) + n
            self.numba_used = True
            return
        # The step's scalars as 0-dim fp32 tensors, one host-to-tensor conversion for all of them.
        k = torch.tensor(
            [
                s.beta1,
                s.one_minus_beta1,
                s.beta2,
                s.one_minus_beta2,
                s.inv_bc2_sqrt,
                s.eps,
                s.step_size,
                s.decay,
                -s.one_minus_beta1,
                s.beta1,
                s.beta2,
            ],
            dtype=torch.float32,
            device=sc.device,
        )
        k = (*k[:9].unbind(), k[9:].view(2, 1))  # the last: (beta1, beta2) as a column, for both moments at once
        mixed = rnd.mix32(t)
        stochastic_p = layout.dtype != torch.float32 and rounding == "stochastic"
        keys_mv = _stream_keys(layout.tkeys_np, mixed, rnd.STREAM_MV) if layout.fmt != "fp32" else None
        # bf16 parameters with 8-bit state are rounded with the moments' word (reference.param_stream)
        own_p = stochastic_p and ref.param_stream(layout.fmt, layout.dtype) == rnd.STREAM_P
        keys_p = _stream_keys(layout.tkeys_np, mixed, rnd.STREAM_P) if own_p else None
        for ch in layout.chunks:
            for slot, n in _step_chunk(layout, ch, sc, grads, k, keys_mv, keys_p, maximize, stochastic_p):
                skipped[layout.tindex[slot]] = skipped.get(layout.tindex[slot], 0) + n


def _check_grads(params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    for p, g in zip(params, grads):
        if g.is_sparse:
            raise RuntimeError("ApexW does not support sparse gradients; use torch.optim.SparseAdam")
        if g.shape != p.shape:
            raise ValueError(
                f"a gradient of shape {tuple(g.shape)} for a parameter of shape {tuple(p.shape)}; gradients must "
                "have their parameter's shape"
            )


def _scale_grads_(grads: list[torch.Tensor], grad_scale: torch.Tensor) -> None:
    """``g.mul_(grad_scale.to(g.dtype))`` for every gradient (the local shard of a DTensor), one fused multiply per
    device and dtype: the bits the Triton kernel's gradient load computes for its ``grad_scale``."""
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        g = dt.local(g)
        by_kind.setdefault((g.device, g.dtype), []).append(g)
    for (device, dtype), same in by_kind.items():
        # a 0-dim factor in the gradients' dtype (CUDA's fused path wants it so); the copy to the device is ordered on
        # its stream, not waited for
        factor = grad_scale.reshape(()).to(device=device, dtype=dtype, non_blocking=device.type != "cpu")
        torch._foreach_mul_(same, factor)


def _mix32_np(x: np.ndarray) -> np.ndarray:
    """``_random.mix32`` of a uint64 array of values in [0, 2**32)."""
    x = x ^ (x >> np.uint64(16))
    x = (x * np.uint64(rnd.MIX1)) & np.uint64(rnd.MASK32)
    x = x ^ (x >> np.uint64(13))
    x = (x * np.uint64(rnd.MIX2)) & np.uint64(rnd.MASK32)
    return x ^ (x >> np.uint64(16))


def _stream_keys(tkeys: np.ndarray, mixed_step: int, stream: int) -> list[int]:
    """``[_random.stream_key_from(tk, mixed_step, stream) for tk in tkeys]`` in a few array operations (products of
    two 32-bit values fit in uint64)."""
    x = _mix32_np(tkeys ^ np.uint64(mixed_step))
    x = (x + np.uint64(stream * rnd.STREAM_MUL)) & np.uint64(rnd.MASK32)
    return _mix32_np(x).tolist()


def _kept_blocks(layout: _Layout, ch: _Chunk, o: _Operands, scalars) -> list[tuple[int, int, list]]:
    """Before the update of a chunk whose new ``v`` may not be finite: for each of its pieces with blocks of
    ``reference.BLOCK`` elements whose new ``v`` holds a NaN or an infinity (``reference.nonfinite_blocks``, computed
    from the gathered gradient and decoded ``v`` as the update will), ``(slot, blocks, [(tensor, selection, copy)])``:
    the parameter's and the state's elements of those blocks as they are, in the tensors that keep them between steps,
    which :func:`_restore_blocks` writes back after the chunk. A piece starts at a block boundary of its tensor (a
    multiple of CHUNK, or 0)."""
    beta2, one_minus_beta2 = scalars[2], scalars[3]
    kept = []
    for slot, a, k, off, _ in ch.segs:
        g = o.G[off : off + k]
        bad = ref.nonfinite_blocks(o.V[off : off + k] * beta2 + (g * g) * one_minus_beta2)
        count = int(bad.sum())
        if not count:
            continue
        elems = bad.repeat_interleave(ref.BLOCK)[:k]
        p = layout.locals[slot].detach().reshape(-1)[a : a + k]
        saved = [(p, elems, p[elems].clone())]
        state = layout.local_states[layout.fast[slot]]
        for key in STATE_KEYS:
            x = state.get(key)
            if x is None:
                continue
            if key in SCALE_KEYS:  # one scale per 8-bit block, two per block with 4-bit state
                blk = layout.block
                x = x.reshape(-1)[a // blk : -(-(a + k) // blk)]
                sel = bad.repeat_interleave(ref.BLOCK // blk)[: x.numel()]
            else:
                x, sel = x.reshape(-1)[a : a + k], elems
            saved.append((x, sel, x[sel].clone()))
        kept.append((slot, count, saved))
    return kept


def _restore_blocks(kept: list) -> list[tuple[int, int]]:
    """Write back what :func:`_kept_blocks` kept; ``(slot, blocks)`` of each piece."""
    for _, _, saved in kept:
        for x, sel, old in saved:
            x[sel] = old
    return [(slot, count) for slot, count, _ in kept]


class _Operands:
    """A chunk's operands after the gather: the gradient ``G`` and parameter ``P`` (fp32), the moments ``M`` and ``V``
    (fp32; ``MV`` both side by side, or None), and where the stored state is (``m_state``, ``v_state``, ``m_scale``,
    ``v_scale``; ``scales2``: both moments' scales side by side, where they are)."""

    __slots__ = ("G", "P", "M", "V", "MV", "m_state", "v_state", "m_scale", "v_scale", "scales2")

    def __init__(self, b):
        self.G, self.M, self.V, self.P, self.MV = b.g, b.m, b.v, b.p, b.mv
        self.m_state = self.v_state = self.m_scale = self.v_scale = self.scales2 = None


def _step_chunk(layout: _Layout, ch: _Chunk, sc: Scratch, grads, k, keys_mv, keys_p, maximize, stochastic_p):
    """One chunk: gather, the reference's update in its operation order, rounding and encoding, scatter. Returns
    ``(slot, blocks)`` of the pieces whose blocks with a non-finite new ``v`` were left as they were (usually none:
    a sum of the gathered gradient's squares and of the decoded ``v``, in cache, tells whether any new ``v`` may not
    be finite)."""
    b = sc.upto(ch.length, layout.block or ref.BLOCK)
    o = _gather(layout, ch, b, grads)
    if layout.fmt == "8bit":  # format version 3: the reference's decoding (module docstring)
        b.m.copy_(ref.dequantize_m(o.m_state, o.m_scale).reshape(-1))
        b.v.copy_(ref.dequantize_v(o.v_state, o.v_scale).reshape(-1))
    elif layout.fmt == "4bit":  # format version 4: the reference's decoding (m_state: both moments' codes)
        m, v = ref.dequantize_mv4(o.m_state, o.m_scale, o.v_scale)
        b.m.copy_(m.reshape(-1))
        b.v.copy_(v.reshape(-1))
    # Every new v = v * beta2 + g * g * (1 - beta2) is finite when the squared gradient and the decoded v (both >= 0)
    # sum to less than 2**127: each term is then below half the fp32 maximum. Otherwise (a NaN, an infinity, a stored
    # v that decodes to one, or sums that large) each block's new v is looked at.
    total = float(torch.dot(o.G, o.G)) + float(o.V[: ch.length].sum())
    kept = None if total < 2.0**127 else _kept_blocks(layout, ch, o, k)
    moments_nan = _update(layout, ch, b, o, k, maximize)
    _round_and_encode(layout, ch, sc.c, b, o, k, keys_mv, keys_p, stochastic_p, moments_nan)
    return _restore_blocks(kept) if kept else ()


def _gather(layout: _Layout, ch: _Chunk, b, grads) -> _Operands:
    """The chunk's gradient, parameter and stored state into the scratch ``b`` (or views of them, for a chunk of one
    contiguous piece: ``ch.direct``)."""
    fmt, dtype, io, n = layout.fmt, layout.dtype, ch.io, ch.length
    four = fmt == "4bit"
    o = _Operands(b)
    if ch.direct:
        slot, a, _, _, _ = ch.segs[0]
        g = grads[slot].reshape(-1)[a : a + n]
        if g.dtype == torch.float32:
            o.G = g  # maximize negates (1 - beta1) instead: (-g) * c == g * (-c) and (-g) * (-g) == g * g, bit for bit
        else:
            o.G.copy_(g)
        if dtype == torch.float32:
            o.P = io["p"]
        else:
            o.P.copy_(io["p"])
        o.m_state, o.v_state = (io[MV4_KEY], None) if four else (io["exp_avg"], io["exp_avg_sq"])
        if fmt == "fp32":
            o.M, o.V, o.MV = o.m_state, o.v_state, None
        elif fmt == "compact":
            o.M.copy_(o.m_state)
            o.V.copy_(o.v_state)
        else:
            o.m_scale, o.v_scale = io["exp_avg_scale"], io["exp_avg_sq_scale"]
        return o
    srcs = [grads[seg[0]] if seg[4] else grads[seg[0]].reshape(-1)[seg[1] : seg[1] + seg[2]] for seg in ch.segs]
    torch._foreach_copy_(io["g_dst"], srcs)
    for kind, dst, src in io["gather"]:
        if kind == "cat":
            torch.cat(src, out=dst)
        else:
            torch._foreach_copy_(dst, src)
    if io["pads_in"]:
        torch._foreach_zero_(io["pads_in"])
    if io["moments_in"][0]:
        torch._foreach_copy_(*io["moments_in"])
    o.m_state, o.v_state = (io["mom"], None) if four else (io["mom_m"], io["mom_v"])
    if fmt == "fp32":
        o.M, o.V, o.MV = o.m_state, o.v_state, io["mom"]
    elif fmt == "compact":
        b.mv.copy_(io["mom"])
    else:
        o.m_scale, o.v_scale, o.scales2 = io["scl_m"], io["scl_v"], io["scl"]
    return o


def _update(layout: _Layout, ch: _Chunk, b, o: _Operands, k, maximize) -> bool:
    """The reference's update of the moments and the fp32 parameter, in its operation order. Returns whether a
    compact chunk's moments hold a NaN (m or v NaN, or inf / inf), which its bit-level encoding does not handle."""
    beta1, one_minus_beta1, beta2, one_minus_beta2, inv_bc2_sqrt, eps, step_size, decay, neg_one_minus_beta1, betas = k
    G, M, V, MV, P, A, n = o.G, o.M, o.V, o.MV, o.P, b.a, ch.length
    v_np = b.np["v"] if b.cpu and V is b.v else None
    g_coef = neg_one_minus_beta1 if maximize else one_minus_beta1
    if MV is not None:  # m * beta1 and v * beta2 in one operation, and the two sums in one
        MV.view(2, n).mul_(betas)
        torch.mul(G, g_coef, out=b.u_m)
        torch.mul(G, G, out=b.u_v).mul_(one_minus_beta2)
        MV.add_(b.u)
    else:
        M.mul_(beta1).add_(torch.mul(G, g_coef, out=A))
        torch.mul(G, G, out=A).mul_(one_minus_beta2)
        V.mul_(beta2).add_(A)
    if ch.pads:
        torch._foreach_zero_(ch.io["pads_mv"])  # the reference pads m and v with zeros
    sqrt_into(b, V, v_np, A, b.np["a"] if b.cpu else None)
    A.mul_(inv_bc2_sqrt).add_(eps)
    torch.div(M, A, out=A)
    moments_nan = layout.fmt == "compact" and math.isnan(float(A.sum()))
    A.mul_(step_size)
    P.mul_(decay).sub_(A)
    return moments_nan


def _round_and_encode(layout: _Layout, ch: _Chunk, c, b, o: _Operands, k, keys_mv, keys_p, stochastic_p, moments_nan):
    """Round the parameter to its dtype and encode the moments into their format (both with the reference's random
    words), then scatter a gathered chunk back."""
    fmt, dtype, io = layout.fmt, layout.dtype, ch.io
    P, M, V, m_state, v_state, m_scale, v_scale = o.P, o.M, o.V, o.m_state, o.v_state, o.m_scale, o.v_scale
    p_out = None
    if dtype != torch.float32:
        p_out = io["p"] if ch.direct else b.typed("p_store", dtype)
        if not stochastic_p:
            p_out.copy_(P)
        elif keys_p is not None:  # a random stream of its own
            hash_into(b, c, ch.segs, [keys_p[seg[0]] for seg in ch.segs], low=False)
            _round_param(P, dtype, b, c, p_out)
            p_out = None
    if fmt != "fp32":
        # the whole word for compact, 8-bit and 4-bit (their v reads bits 6-21) and a bf16 parameter
        top = fmt in ("compact", "8bit", "4bit") or p_out is not None
        hash_into(b, c, ch.segs, [keys_mv[seg[0]] for seg in ch.segs], top=top)
    if p_out is not None and stochastic_p:  # bf16 with 8-bit or 4-bit state: the top 16 bits of the moments' word
        _round_param(P, dtype, b, c, p_out)
    if not ch.direct:
        torch._foreach_copy_(io["p_src"], io["p_out"])
    if fmt == "compact":
        if moments_nan:
            bits = full_bits(b)
            m_state.copy_(ref.round_to_bf16_stochastic(M, bits))
            v_state.copy_(ref.round_to_bf16_stochastic(V, (bits & 0xFFFF) << 16))
        else:
            bf16_stochastic(M, b.t, b.t, m_state, c)
            bf16_stochastic(V, b.z.bitwise_and_(c.low16), b.z, v_state, c)
    elif fmt == "8bit":  # format version 3: the reference's encoding over the chunk's whole blocks
        bits = full_bits(b)
        qm, qms = ref.quantize_m(M, bits)
        qv, qvs = ref.quantize_v(V, bits, v_scale, float(k[2]))  # k[2]: beta2
        for dst, x in ((m_state, qm), (m_scale, qms), (v_state, qv), (v_scale, qvs)):
            dst.copy_(x.view(dst.shape))
    elif fmt == "4bit":  # format version 4: the reference's encoding over the chunk's whole blocks
        qmv, qms, qvs = ref.quantize_mv4(M, V, full_bits(b), v_scale, float(k[2]))  # k[2]: beta2
        for dst, x in ((m_state, qmv), (m_scale, qms), (v_scale, qvs)):
            dst.copy_(x.view(dst.shape))
    if not ch.direct and io["moments_out"][0]:
        torch._foreach_copy_(*io["moments_out"])


def _round_param(P, dtype, b, c, p_out) -> None:
    """Stochastic rounding of the fp32 update ``P`` into ``p_out`` with the random words of the last hash."""
    if dtype == torch.bfloat16 and not math.isnan(float(P.sum())):
        bf16_stochastic(P, b.t, b.t, p_out, c)
    else:
        p_out.copy_(ref.round_param(P, dtype, full_bits(b)))
