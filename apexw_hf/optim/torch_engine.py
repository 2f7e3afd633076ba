"""Plain-PyTorch engine of :class:`~apexw_hf.optim.base.ApexW`: the reference's bits, a param group at a time.

``reference.adamw_step_ref_`` is the specification: per tensor, readable, and slow (about 100 tensor operations per
tensor, int64 hashing, a ``searchsorted`` per 8-bit code, ``sqrt`` corrected in fp64). This engine computes the same
bits with the work laid out for a CPU:

* The tensors of a param group that share a parameter dtype and a step count are processed as one sequence of
  *chunks* of at most :data:`CHUNK` elements. A piece of a large tensor that fills a chunk is used in place (views of
  the parameter, gradient and state); small tensors and the tails of large ones are packed into one chunk (one
  ``torch._foreach_copy_`` in, one out). 8-bit tensors start at a block boundary inside a chunk and their padding
  is zero, as in the reference's ``_blocks``. A chunk is small enough for its ~15 scratch buffers to stay in the
  CPU caches, so the many elementwise passes read cache, not memory; and large enough that the per-operation cost
  of PyTorch (a few microseconds) is small beside the work.
* Every operation writes into preallocated scratch or in place; ``torch.where`` and boolean masks (slow on the CPU)
  are replaced by exact arithmetic (a comparison written as 0.0/1.0 floats, ``copysign``, ``maximum``).
* The random words: the reference's hash of (seed, tensor index, step, stream, element index) in int32 arithmetic
  with wrapping multiplies and masked shifts (exact mod 2**32); the per-tensor keys come from
  :mod:`apexw_hf._random` on the host, once per step, and are spread over a packed chunk with one ``cumsum``.
* The correctly rounded fp32 square root comes from NumPy on the CPU (the IEEE instruction; ``torch.sqrt`` on the
  CPU is up to 1 ulp off, see ``reference.sqrt_rn``, which this engine uses on other devices).
* The 8-bit code search is an approximate root and one comparison with the next code's decoded value (the kernels'
  method, ``kernels._quant.lower_code``), which picks exactly the code of the reference's table search.
* The bit-level shortcuts for stochastic rounding to bf16 do not handle NaN; a chunk whose update has a NaN takes
  the reference's rounding functions for its state or parameters (same bits, slower; NaN is rare and poisons the
  run anyway). fp16 parameters with stochastic rounding always use the reference's ``round_to_fp16_stochastic``.

Tensors that are not contiguous (a parameter or a state tensor) are stepped by ``reference.adamw_step_ref_`` itself.
Results are bit-identical to the reference on every path (``tests/optim/test_torch_engine.py``), up to the sign and
payload of NaNs, which IEEE leaves to the hardware.

Interface with the optimizer (as :class:`~apexw_hf.optim.engine.TritonEngine`)::

    engine = TorchEngine(optimizer)
    engine.step_group(group, params, grads)   # params with a gradient, in group order; grads their .grad
    engine.invalidate()                       # after load_state_dict
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .. import _random as rnd
from .. import reference as ref
from . import dtensor as dt

CHUNK = 1 << 17  # elements per chunk: ~15 fp32/int32 scratch buffers of 512 KiB stay in a 2 MiB L2 per core pair
_BLOCK = ref.BLOCK
_TWO_POW_M16 = ref.TWO_POW_M16
_MIX1 = rnd.to_int32(rnd.MIX1)
_MIX2 = rnd.to_int32(rnd.MIX2)
# An approximate root times just under 127 (255) floors to the right code or the one below (kernels._quant).
_BELOW127 = 127.0 * (1.0 - 2.0**-16)
_BELOW255 = 255.0 * (1.0 - 2.0**-16)


class _Chunk:
    """One batch of elements: ``segs`` are (member slot, first element in the tensor, element count, offset)."""

    __slots__ = ("segs", "length", "direct", "pads", "views")

    def __init__(self, segs, length, direct, pads):
        self.segs = segs
        self.length = length
        self.direct = direct
        self.pads = pads  # (offset, count) of 8-bit padding in a packed chunk
        self.views = None  # scratch slices of a packed chunk, made on first use


def _plan_chunks(numels: list[int], blocked: bool) -> list[_Chunk]:
    """Cut tensors of ``numels`` elements into chunks; full-chunk pieces in place, the rest packed in order."""
    chunks, segs, fill = [], [], 0

    def close():
        nonlocal segs, fill
        if segs:
            pads = []
            if blocked:
                for _, _, n, off in segs:
                    end = -(-n // _BLOCK) * _BLOCK
                    if end > n:
                        pads.append((off + n, end - n))
            chunks.append(_Chunk(segs, fill, False, pads))
        segs, fill = [], 0

    for slot, n in enumerate(numels):
        start = 0
        while n - start >= CHUNK:
            chunks.append(_Chunk([(slot, start, CHUNK, 0)], CHUNK, True, []))
            start += CHUNK
        rest = n - start
        if rest:
            span = -(-rest // _BLOCK) * _BLOCK if blocked else rest
            if fill + span > CHUNK:
                close()
            segs.append((slot, start, rest, fill))
            fill += span
    close()
    return chunks


class _Scratch:
    """Preallocated buffers of one chunk, per device (fp32 ``f*``, int32 ``i*``, and the storage dtypes)."""

    F32 = ("g", "m", "v", "a", "p", "y", "q0", "q1", "u", "r")
    I32 = ("h", "t", "k")

    def __init__(self, device):
        self.device = device
        for name in self.F32:
            setattr(self, name, torch.empty(CHUNK, dtype=torch.float32, device=device))
        for name in self.I32:
            setattr(self, name, torch.empty(CHUNK, dtype=torch.int32, device=device))
        # index * GOLDEN mod 2**32 (int64 -> int32 keeps the low 32 bits)
        self.base = (torch.arange(CHUNK, dtype=torch.int64, device=device) * rnd.GOLDEN).to(torch.int32)
        self.store = {}  # (name, dtype) -> buffer of a storage dtype (bf16 moments, int8/uint8 codes, params)

    def typed(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        buf = self.store.get((name, dtype))
        if buf is None:
            buf = self.store[(name, dtype)] = torch.empty(CHUNK, dtype=dtype, device=self.device)
        return buf


def _sqrt_into(x: torch.Tensor, out: torch.Tensor) -> None:
    """Correctly rounded fp32 ``sqrt(x)`` into ``out`` (a different buffer)."""
    if x.device.type == "cpu":
        np.sqrt(x.numpy(), out=out.numpy())  # the IEEE instruction
    else:
        out.copy_(ref.sqrt_rn(x))


def _approx_sqrt_(x: torch.Tensor) -> None:
    """In place ``sqrt`` within an ulp or so (only a guess for the code search)."""
    if x.device.type == "cpu":
        np.sqrt(x.numpy(), out=x.numpy())
    else:
        x.sqrt_()


def _mix32_(h: torch.Tensor, t: torch.Tensor) -> None:
    """murmur3's finalizer in place on int32 ``h`` (bits of uint32 values); ``t`` is scratch of the same size.

    int32 multiplies wrap, which is the product mod 2**32; right shifts of int32 are arithmetic, so they are masked.
    """
    torch.bitwise_right_shift(h, 16, out=t)
    h.bitwise_xor_(t.bitwise_and_(0xFFFF))
    h.mul_(_MIX1)
    torch.bitwise_right_shift(h, 13, out=t)
    h.bitwise_xor_(t.bitwise_and_(0x7FFFF))
    h.mul_(_MIX2)
    torch.bitwise_right_shift(h, 16, out=t)
    h.bitwise_xor_(t.bitwise_and_(0xFFFF))


def _hash_into(h, sc: _Scratch, ch: _Chunk, keys: list[int], n: int) -> None:
    """``reference.hash_uniform_bits`` for every element of chunk ``ch`` (int32 bits), ``keys`` per segment.

    Element ``j`` of a tensor at chunk offset ``o`` gets ``mix32(j * GOLDEN + key) = mix32((o + j) * GOLDEN + d)``
    with ``d = key - o * GOLDEN``: the chunk's ``index * GOLDEN`` plus a constant per segment, spread with a cumsum.
    """
    base = sc.base[:n]
    if len(ch.segs) == 1:
        _, start, _, off = ch.segs[0]
        torch.add(base, rnd.to_int32((keys[0] + (start - off) * rnd.GOLDEN) & rnd.MASK32), out=h)
    else:
        k = sc.k[:n]
        k.zero_()
        prev = 0
        starts, deltas = [], []
        for (_, start, _, off), key in zip(ch.segs, keys):
            d = (key + (start - off) * rnd.GOLDEN) & rnd.MASK32
            starts.append(off)
            deltas.append(rnd.to_int32((d - prev) & rnd.MASK32))
            prev = d
        k[starts] = torch.tensor(deltas, dtype=torch.int32, device=k.device)
        t = sc.t[:n]
        torch.cumsum(k, 0, dtype=torch.int32, out=t)  # accumulates in int64, stores mod 2**32
        torch.add(base, t, out=h)
    _mix32_(h, sc.t[:n])


def _bf16_stochastic_into(x, h, t, out_bits) -> None:
    """``reference.round_to_bf16_stochastic(x, bits)`` for finite or infinite ``x``: top 16 of (bits of x + rand).

    ``t`` holds the 16 random bits (int32) on entry; ``out_bits`` is the int16 view of the bf16 destination.
    """
    t.add_(x.view(torch.int32))
    t.bitwise_right_shift_(16)
    out_bits.copy_(t)  # int32 -> int16 keeps the low 16 bits


def _code_search_(y, g, q0, q1, u, inv_n: float, below: float, top: float, q4: bool) -> None:
    """The reference's ``lo`` (largest code decoding to at most ``y``, clamped to ``top - 1``) into ``g``, and
    ``q(lo)``, ``q(lo + 1)`` into ``q0``, ``q1``; ``u`` is scratch.

    ``y`` in [0, 1]. The guess ``floor(root(y) * below)`` is ``lo`` or ``lo - 1`` (``reference._lower_code``'s
    kernel counterpart explains why); clamping it to ``top - 2`` keeps ``lo <= top - 1`` after the correction.
    """
    g.copy_(y)
    _approx_sqrt_(g)
    if q4:
        _approx_sqrt_(g)
    g.mul_(below).floor_().clamp_(max=top - 2.0)
    _decode_abs(torch.add(g, 1.0, out=q1), inv_n, q4)
    torch.ge(y, q1, out=u)
    g.add_(u)
    _decode_abs(q0.copy_(g), inv_n, q4)
    _decode_abs(torch.add(g, 1.0, out=q1), inv_n, q4)


def _decode_abs(c: torch.Tensor, inv_n: float, q4: bool) -> torch.Tensor:
    """In place ``reference._q2`` / ``_q4``: ``(c / n)**2`` or ``**4`` with the reference's fp32 operation order."""
    c.mul_(inv_n)
    c.mul_(c)
    if q4:
        c.mul_(c)
    return c


def _pick_(y, g, q0, q1, u, rand_i32) -> None:
    """``reference._stochastic_code``: ``g += (rand * 2**-16 * (q1 - q0) < y - q0)``; clobbers q0, q1, u."""
    q1.sub_(q0)
    torch.sub(y, q0, out=q0)
    u.copy_(rand_i32).mul_(_TWO_POW_M16).mul_(q1)
    torch.lt(u, q0, out=u)
    g.add_(u)


def _quantize_(x, blocks, sc, n, h, rand_bits, codes_out, scale_out, is_v: bool) -> None:
    """``reference.quantize_m`` / ``quantize_v`` of the fp32 chunk ``x`` into ``codes_out`` (int8 / uint8 view)
    and ``scale_out`` (bf16, one per block)."""
    y, g, q0, q1, u = sc.y[:n], sc.q0[:n], sc.q1[:n], sc.u[:n], sc.r[:n]
    if is_v:
        y.copy_(x)
    else:
        torch.abs(x, out=y)
    yb = y.view(blocks, _BLOCK)
    scale, inv = ref._scale(yb)
    scale_out.copy_(scale)
    yb.mul_(inv[:, None]).clamp_(max=1.0)
    if not bool(torch.isfinite(scale).all()):
        y.nan_to_num_(nan=0.0)  # as reference._normalized: only a NaN or infinite scale makes NaN here
    if is_v:
        _code_search_(y, g, q0, q1, u, ref.INV255, _BELOW255, 255.0, True)
    else:
        _code_search_(y, g, q0, q1, u, ref.INV127, _BELOW127, 127.0, False)
    _pick_(y, g, q0, q1, u, rand_bits)
    if is_v:
        torch.gt(x, 0.0, out=u)
        torch.maximum(g, u, out=g)  # a nonzero v never gets code 0
    else:
        torch.copysign(g, x, out=g)  # -c where m < 0; where m is -0 or NaN the code is 0 either way
    codes_out.copy_(g)


class _Layout:
    """Chunks of the members of one param group that share a parameter dtype and a step count."""

    def __init__(self, opt, group, members, states):
        self.members = members
        self.fmt = group["state_format"]
        self.dtype = members[0].dtype
        self.device = dt.local(members[0]).device
        self.tkeys = [rnd.tensor_key(group["seed"], opt._tensor_index(p)) for p in members]
        local_states = [dt.local_view(s, p) if dt.is_dtensor(p) else s for p, s in zip(members, states)]
        self.p_flat, self.state_flat, self.slow = [], [], []
        fast = []
        for i, (p, s) in enumerate(zip(members, local_states)):
            lp = dt.local(p)
            tensors = [s[k] for k in ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale") if k in s]
            if lp.is_contiguous() and all(t.is_contiguous() for t in tensors):
                fast.append(i)
            else:
                self.slow.append(i)
        self.fast = fast
        self.local_states = local_states
        for i in fast:
            s = local_states[i]
            self.p_flat.append(dt.local(members[i]).view(-1))
            self.state_flat.append({k: (v.view(-1) if isinstance(v, torch.Tensor) else v) for k, v in s.items()})
        self.chunks = _plan_chunks([t.numel() for t in self.p_flat], self.fmt == "8bit")


class TorchEngine:
    """Runs :meth:`ApexW.step` for param groups in plain PyTorch (see the module docstring)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self._layouts: dict[int, tuple] = {}
        self._scratch: dict = {}

    def invalidate(self) -> None:
        """Forget the cached chunk plans (state tensors were replaced)."""
        self._layouts.clear()

    def _scratch_for(self, device) -> _Scratch:
        sc = self._scratch.get(device)
        if sc is None:
            sc = self._scratch[device] = _Scratch(device)
        return sc

    def step_group(self, group: dict, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """Increment the step of ``params`` (the group's params with a gradient) and apply one AdamW update."""
        if not params:
            return
        opt = self.optimizer
        for g in grads:
            if g.is_sparse:
                raise RuntimeError("ApexW does not support sparse gradients; use torch.optim.SparseAdam")
        states = [opt._init_state(p, group) for p in params]
        step_tensors = [s["step"] for s in states]
        torch._foreach_add_(step_tensors, 1.0)
        steps = [int(t.item()) for t in step_tensors]
        key = (
            group["state_format"],
            group["seed"],
            tuple(map(id, params)),
            tuple(t - steps[0] for t in steps),
            tuple(id(s.get("exp_avg")) for s in states),
        )
        cached = self._layouts.get(id(group))
        if cached is None or cached[0] != key:
            by_kind: dict[tuple, list[int]] = {}
            for i, (p, t) in enumerate(zip(params, steps)):
                by_kind.setdefault((p.dtype, t - steps[0]), []).append(i)
            layouts = [
                (_Layout(opt, group, [params[i] for i in idx], [states[i] for i in idx]), idx)
                for idx in by_kind.values()
            ]
            cached = (key, layouts)
            self._layouts[id(group)] = cached
        hp = dict(
            lr=float(group["lr"].item()) if isinstance(group["lr"], torch.Tensor) else float(group["lr"]),
            beta1=float(group["betas"][0]),
            beta2=float(group["betas"][1]),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
        )
        for layout, idx in cached[1]:
            t = steps[idx[0]]
            self._step_layout(group, layout, [grads[i] for i in idx], t, ref.StepScalars.make(step=t, **hp))

    def _step_layout(self, group, layout: _Layout, grads, t: int, s: ref.StepScalars) -> None:
        maximize = group["maximize"]
        stochastic_p = layout.dtype != torch.float32 and group["param_rounding"] == "stochastic"
        seed = group["seed"]
        for i in layout.slow:
            p = layout.members[i]
            ref.adamw_step_ref_(
                dt.local(p),
                dt.local(grads[i]),
                layout.local_states[i],
                fmt=layout.fmt,
                scalars=s,
                seed=seed,
                tensor_index=self.optimizer._tensor_index(p),
                step=t,
                maximize=maximize,
                param_rounding=group["param_rounding"],
            )
        if not layout.fast:
            return
        g_flat = []
        for i, p_flat in zip(layout.fast, layout.p_flat):
            g = dt.local(grads[i])
            if g.numel() != p_flat.numel():
                raise ValueError(
                    f"a gradient of shape {tuple(g.shape)} for a parameter of shape {tuple(layout.members[i].shape)}; "
                    "gradients must have their parameter's shape"
                )
            g_flat.append(g.reshape(-1))
        mix_t = rnd.mix32(t)
        keys_mv = [rnd.stream_key_from(layout.tkeys[i], mix_t, rnd.STREAM_MV) for i in layout.fast]
        keys_p = [rnd.stream_key_from(layout.tkeys[i], mix_t, rnd.STREAM_P) for i in layout.fast] if stochastic_p else None
        sc = self._scratch_for(layout.device)
        for ch in layout.chunks:
            _step_chunk(layout, ch, sc, g_flat, keys_mv, keys_p, s, maximize, stochastic_p)


def _views(ch: _Chunk, sc: _Scratch, layout: _Layout):
    """Scratch slices of a packed chunk, one per segment, for each buffer it gathers into or scatters from."""
    if ch.views is None:
        fmt, dtype = layout.fmt, layout.dtype
        names = [("g", torch.float32), ("p", torch.float32)]
        if dtype != torch.float32:
            names.append(("p_store", dtype))
        if fmt == "fp32":
            names += [("m", torch.float32), ("v", torch.float32)]
        elif fmt == "compact":
            names += [("m", torch.float32), ("v", torch.float32), ("m_store", torch.bfloat16)]
            names += [("v_store", torch.bfloat16)]
        else:
            names += [("m_store", torch.int8), ("v_store", torch.uint8)]
        out = {}
        for name, dt_ in names:
            buf = getattr(sc, name) if name in _Scratch.F32 else sc.typed(name, dt_)
            out[name] = [buf[off : off + n] for _, _, n, off in ch.segs]
        if fmt == "8bit":
            for name in ("m_scale", "v_scale"):
                buf = sc.typed(name, torch.bfloat16)
                out[name] = [buf[off // _BLOCK : (off + n + _BLOCK - 1) // _BLOCK] for _, _, n, off in ch.segs]
            out["pads"] = {name: [getattr(sc, name)[o : o + k] for o, k in ch.pads] for name in ("g", "p", "m", "v")}
        ch.views = out
    return ch.views


def _step_chunk(layout, ch, sc, g_flat, keys_mv, keys_p, s, maximize, stochastic_p) -> None:
    fmt, dtype = layout.fmt, layout.dtype
    n = ch.length
    G, M, V, A, P = sc.g[:n], sc.m[:n], sc.v[:n], sc.a[:n], sc.p[:n]
    H, T = sc.h[:n], sc.t[:n]
    segs = ch.segs
    fast_slots = layout.fast
    # ---- gather -------------------------------------------------------------------------------------------------
    if ch.direct:
        slot, start, _, _ = segs[0]
        sl = slice(start, start + n)
        st_ = layout.state_flat[slot]
        g_src = g_flat[slot][sl]
        if g_src.dtype == torch.float32 and not maximize:
            G = g_src
        else:
            G.copy_(g_src)
            if maximize:
                G.neg_()
        p_dst = layout.p_flat[slot][sl]
        if dtype == torch.float32:
            P = p_dst
        else:
            P.copy_(p_dst)
        if fmt == "fp32":
            M, V = st_["exp_avg"][sl], st_["exp_avg_sq"][sl]
        elif fmt == "compact":
            M.copy_(st_["exp_avg"][sl])
            V.copy_(st_["exp_avg_sq"][sl])
        else:
            bsl = slice(start // _BLOCK, (start + n) // _BLOCK)
            m_codes, v_codes = st_["exp_avg"][sl], st_["exp_avg_sq"][sl]
            m_scale, v_scale = st_["exp_avg_scale"][bsl], st_["exp_avg_sq_scale"][bsl]
        views = None
    else:
        views = _views(ch, sc, layout)
        srcs = [g_flat[slot][a : a + k] for slot, a, k, _ in segs]
        torch._foreach_copy_(views["g"], srcs)
        if maximize:
            G.neg_()
        p_srcs = [layout.p_flat[slot][a : a + k] for slot, a, k, _ in segs]
        torch._foreach_copy_(views["p"], p_srcs)
        st_srcs = [layout.state_flat[slot] for slot, _, _, _ in segs]
        if fmt == "8bit":
            torch._foreach_zero_(views["pads"]["g"] + views["pads"]["p"])
            m_codes, v_codes = sc.typed("m_store", torch.int8)[:n], sc.typed("v_store", torch.uint8)[:n]
            torch._foreach_copy_(views["m_store"], [d["exp_avg"][a : a + k] for d, (_, a, k, _) in zip(st_srcs, segs)])
            torch._foreach_copy_(
                views["v_store"], [d["exp_avg_sq"][a : a + k] for d, (_, a, k, _) in zip(st_srcs, segs)]
            )
            bl = [(a // _BLOCK, (a + k + _BLOCK - 1) // _BLOCK) for _, a, k, _ in segs]
            torch._foreach_copy_(views["m_scale"], [d["exp_avg_scale"][b0:b1] for d, (b0, b1) in zip(st_srcs, bl)])
            torch._foreach_copy_(
                views["v_scale"], [d["exp_avg_sq_scale"][b0:b1] for d, (b0, b1) in zip(st_srcs, bl)]
            )
            nb = n // _BLOCK
            m_scale = sc.typed("m_scale", torch.bfloat16)[:nb]
            v_scale = sc.typed("v_scale", torch.bfloat16)[:nb]
        else:
            m_dst = [d["exp_avg"][a : a + k] for d, (_, a, k, _) in zip(st_srcs, segs)]
            v_dst = [d["exp_avg_sq"][a : a + k] for d, (_, a, k, _) in zip(st_srcs, segs)]
            torch._foreach_copy_(views["m"], m_dst)
            torch._foreach_copy_(views["v"], v_dst)
    blocks = n // _BLOCK
    if fmt == "8bit":  # dequantize: t * |t| is sign(c) * q2(|c|) bit for bit (IEEE products are sign-symmetric)
        M.copy_(m_codes).mul_(ref.INV127)
        M.mul_(torch.abs(M, out=A))
        M.view(blocks, _BLOCK).mul_(m_scale.float()[:, None])
        _decode_abs(V.copy_(v_codes), ref.INV255, True).view(blocks, _BLOCK).mul_(v_scale.float()[:, None])
    # ---- the update, in the reference's operation order -------------------------------------------------------
    M.mul_(s.beta1).add_(torch.mul(G, s.one_minus_beta1, out=A))
    torch.mul(G, G, out=A).mul_(s.one_minus_beta2)
    V.mul_(s.beta2).add_(A)
    if views is not None and fmt == "8bit":
        torch._foreach_zero_(views["pads"]["m"] + views["pads"]["v"])  # the reference pads m and v with zeros
    _sqrt_into(V, A)
    A.mul_(s.inv_bc2_sqrt).add_(s.eps)
    torch.div(M, A, out=A)
    state_nan = fmt != "fp32" and math.isnan(float(A.sum()))  # NaN in m or v (or inf / inf)
    A.mul_(s.step_size)
    P.mul_(s.decay).sub_(A)
    # ---- parameters ---------------------------------------------------------------------------------------------
    if dtype != torch.float32:
        p_out = p_dst if ch.direct else sc.typed("p_store", dtype)[:n]
        if stochastic_p:
            _hash_into(H, sc, ch, [keys_p[slot] for slot, _, _, _ in segs], n)
            if dtype == torch.bfloat16 and not math.isnan(float(P.sum())):
                torch.bitwise_right_shift(H, 16, out=T).bitwise_and_(0xFFFF)
                _bf16_stochastic_into(P, H, T, p_out.view(torch.int16))
            else:
                p_out.copy_(ref.round_param(P, dtype, H.to(torch.int64) & rnd.MASK32))
        else:
            p_out.copy_(P)
        if not ch.direct:
            torch._foreach_copy_(p_srcs, views["p_store"])
    elif not ch.direct:
        torch._foreach_copy_(p_srcs, views["p"])
    # ---- moments ------------------------------------------------------------------------------------------------
    if fmt == "fp32":
        if not ch.direct:
            torch._foreach_copy_(m_dst, views["m"])
            torch._foreach_copy_(v_dst, views["v"])
        return
    _hash_into(H, sc, ch, [keys_mv[slot] for slot, _, _, _ in segs], n)
    if fmt == "compact":
        m_out = st_["exp_avg"][sl] if ch.direct else sc.typed("m_store", torch.bfloat16)[:n]
        v_out = st_["exp_avg_sq"][sl] if ch.direct else sc.typed("v_store", torch.bfloat16)[:n]
        if state_nan:
            bits = H.to(torch.int64) & rnd.MASK32
            m_out.copy_(ref.round_to_bf16_stochastic(M, bits))
            v_out.copy_(ref.round_to_bf16_stochastic(V, (bits & 0xFFFF) << 16))
        else:
            torch.bitwise_right_shift(H, 16, out=T).bitwise_and_(0xFFFF)
            _bf16_stochastic_into(M, H, T, m_out.view(torch.int16))
            torch.bitwise_and(H, 0xFFFF, out=T)
            _bf16_stochastic_into(V, H, T, v_out.view(torch.int16))
        if not ch.direct:
            torch._foreach_copy_(m_dst, views["m_store"])
            torch._foreach_copy_(v_dst, views["v_store"])
        return
    torch.bitwise_right_shift(H, 16, out=T).bitwise_and_(0xFFFF)
    _quantize_(M, blocks, sc, n, H, T, m_codes, m_scale, False)
    torch.bitwise_and(H, 0xFFFF, out=T)
    _quantize_(V, blocks, sc, n, H, T, v_codes, v_scale, True)
    if not ch.direct:
        torch._foreach_copy_([d["exp_avg"][a : a + k] for d, (_, a, k, _) in zip(st_srcs, segs)], views["m_store"])
        torch._foreach_copy_([d["exp_avg_sq"][a : a + k] for d, (_, a, k, _) in zip(st_srcs, segs)], views["v_store"])
        torch._foreach_copy_([d["exp_avg_scale"][b0:b1] for d, (b0, b1) in zip(st_srcs, bl)], views["m_scale"])
        torch._foreach_copy_([d["exp_avg_sq_scale"][b0:b1] for d, (b0, b1) in zip(st_srcs, bl)], views["v_scale"])

