"""Triton engine of :class:`~apexw_hf.optim.base.ApexW`: one kernel launch per (param group, param dtype, grad dtype).

Interface (the ``Engine`` contract of :mod:`apexw_hf.engines`; ``ApexW`` calls it through
:func:`apexw_hf.engines.engine_for`)::

    engine = TritonEngine()                  # one per optimizer, created lazily on the first Triton step
                                             # (check_nonfinite=False: only to time what that check costs)
    engine.check(group, params, grads)       # before the caller creates missing state
    engine.step_group(group, params, grads, states, tensor_indices, bucket=None, grad_scale=None, stager=None,
                      nonfinite=None)        # params: the group's params whose .grad is not None, in group order
    engine.invalidate()                      # after load_state_dict or any replacement of state tensors

``step_group`` does everything the plain-PyTorch engine does for those params: it increments ``state["step"]`` of
exactly those params and applies the update to the state dicts it is given (the caller creates them). The random
streams use the given tensor indices and ``group["seed"]``, as the reference does.

What is cached per group (rebuilt only when the set of stepping params, their grad dtypes, the group's format or
seed change, or after :meth:`TritonEngine.invalidate`): the address and program-to-tensor tables on the device
(:class:`~.kernels.LaunchPlan`), per-tensor random keys, the state dicts and tensor indices the plan was built from
(read only then: the ``states`` and ``tensor_indices`` of a call that finds its plan cost no host time, and state
tensors replaced since need :meth:`TritonEngine.invalidate`), and the step counters: ``state["step"]`` of every param
in the cache is a 0-dim view into one CPU fp32 buffer, so one in-place add increments them all (the tensors stay
plain 0-dim fp32 CPU tensors for ``state_dict``).

Host work per step that remains, and why:

* reading ``p.grad`` (one C-level pass in ``ApexW.step``) and the gradients' addresses (another): autograd may hand
  out new gradient tensors every step, and the kernel needs their addresses. The address table is copied to the device
  (pinned memory, non-blocking) only when an address changed; when one did, dtype, shape, device and contiguity of
  every gradient are checked again, in a few C-level passes over the list (an unchanged address list means the same
  allocations as the checked ones). Gradients at new addresses every step are common (``zero_grad`` frees them, and
  the allocator need not hand back the same blocks): on 392 LoRA tensors such a step cost ~0.7 ms of host time with a
  Python check per gradient, ~0.3 ms with the passes (this project's 2-core CPU, launch stubbed). ``grad_moves``
  counts the steps that paid it (the recipe records it per run).
* comparing the list of stepping params with the cached one (``id`` list, C speed), to notice params whose
  gradient is ``None`` this step; those are skipped in the kernel (address 0) and keep their step count.
* one fp32 rounding of the hyperparameters (:class:`~apexw_hf.reference.StepScalars`) per group, or, when params of
  a group are at different step counts, one per distinct step count, copied as a small per-tensor table.

No host-device synchronization happens in a step.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import numpy as np
import torch

from ... import dtensor as dt
from ... import reference as ref
from ...hparams import step_hparams

_SHAPE = operator.attrgetter("shape")
_DEVICE = operator.attrgetter("device")
_DTYPE = operator.attrgetter("dtype")
_GRAD_DTYPES = frozenset((torch.float32, torch.bfloat16, torch.float16))


def _shapes_devices(params: list[torch.Tensor]) -> tuple[list, list]:
    return list(map(_SHAPE, params)), list(map(_DEVICE, params))


class _GroupCache:
    """Launch plans and step counters of the stepping params of one param group."""

    def __init__(
        self,
        group: dict,
        members: list[torch.Tensor],
        states: list[dict],
        indices: list[int],
        grads: list[torch.Tensor],
        streamed=False,
    ):
        from .kernels import LaunchPlan

        self.members = members
        self.states = states  # the members' state dicts and tensor indices (a later rebuild keeps those not stepping)
        self.indices = indices
        self.given_states = None  # the list object ``states`` of the step_group call that built it, where members
        # are exactly that call's params
        self.member_ids = [id(p) for p in members]
        self.slot_of = {id(p): i for i, p in enumerate(members)}
        self.fmt = group["state_format"]
        self.seed = group["seed"]
        self.streamed = streamed  # the plans take their state addresses per launch (state offload)
        # Step counters: views into one buffer (values copied from whatever the states held).
        self.steps = torch.tensor([float(s["step"]) for s in states], dtype=torch.float32)
        self.steps_np = self.steps.numpy()
        for i, s in enumerate(states):
            s["step"] = self.steps[i]
        by_kind: dict[tuple, list[int]] = {}
        for i, (p, g) in enumerate(zip(members, grads)):
            by_kind.setdefault((p.dtype, g.dtype), []).append(i)
        self.grad_dtypes = [g.dtype for g in grads]
        self.shapes, self.devices = _shapes_devices(members)  # for the gradient checks (TritonEngine._check_grads)
        self.plans = []
        for (_, gdt), slots in by_kind.items():
            # FSDP2 DTensor params: the kernel steps the local shards (block scales cut to the local block count).
            plan = LaunchPlan(
                [dt.local(members[i]) for i in slots],
                None
                if streamed
                else [dt.local_view(states[i], members[i]) if dt.is_dtensor(members[i]) else states[i] for i in slots],
                self.fmt,
                [indices[i] for i in slots],
                self.seed,
                gdt,
            )
            self.plans.append((plan, slots, np.asarray(slots, dtype=np.int64)))
        self.plan_members = [[members[i] for i in slots] for _, slots, _ in self.plans]
        self.grad_ptrs: list[int] | None = None


class TritonEngine:
    """Runs :meth:`ApexW.step` for param groups on the Triton kernels (see the module docstring for the contract)."""

    def __init__(self, check_nonfinite: bool = True):
        try:
            from . import kernels  # noqa: F401
        except ImportError as e:
            raise RuntimeError(f"engine='triton' needs the triton package ({e}); install apexw_hf[triton]") from e

        # Keyed by (id(group), bucket): ``step()`` uses bucket None (the group's params with a gradient); gradient
        # release steps a group in buckets of the tensors whose gradients became ready together, one cache each.
        self._cache: dict[tuple[int, object], _GroupCache] = {}
        # Group steps whose gradients were at new addresses (all checked again, the address table copied): a
        # diagnostic for host time (the recipe records it), ~0.2-0.4 ms each on 392 LoRA tensors.
        self.grad_moves = 0
        self._scalars_key: tuple | None = None  # (step, lr, betas, eps, weight_decay) of the last uniform step
        self._scalars = None
        self._hp_memo: dict[int, tuple[tuple, dict[str, float]]] = {}  # id(group) -> (its raw values, step_hparams)
        # Blocks whose new v is not finite (a NaN or inf gradient, or a square that overflows) are left un-updated
        # and counted (reference.nonfinite_blocks). Off only to time what that check costs (benchmarks/bench_step.py's
        # _nocheck rows): the update then differs from the reference's on non-finite gradients.
        self.check_nonfinite = bool(check_nonfinite)

    def _hparams(self, group: dict) -> dict[str, float]:
        """``step_hparams(group)``, read again only when one of the group's values is another object than at its last
        read (a scheduler sets a new float; gradient release reads a group once per bucket). Tensor values are read
        every time: a scheduler may change them in place."""
        raw = (group["lr"], *group["betas"], group["eps"], group["weight_decay"])  # betas unpacked: a list may change
        memo = self._hp_memo.get(id(group))
        if memo is not None and len(raw) == len(memo[0]) and all(map(operator.is_, memo[0], raw)):
            return memo[1]
        hp = step_hparams(group)
        if not any(isinstance(v, torch.Tensor) for v in raw):
            self._hp_memo[id(group)] = (raw, hp)
        return hp

    def invalidate(self) -> None:
        """Forget all cached launch metadata (state tensors were replaced)."""
        self._cache.clear()

    @staticmethod
    def _check_device(p: torch.Tensor) -> None:
        from .kernels import INTERPRETED

        p = dt.local(p)
        if p.device.type == "cuda" and INTERPRETED:
            # The interpreter runs the kernel on the host and would dereference device addresses there (a crash).
            raise RuntimeError(
                "engine='triton' cannot step CUDA parameters while TRITON_INTERPRET=1: the Triton interpreter runs "
                "the kernels on CPU tensors only. Unset TRITON_INTERPRET before apexw_hf.engines.triton.kernels is "
                "imported, or use engine='auto' or 'torch' (the plain-PyTorch path, same results, slower)."
            )
        if p.device.type == "cuda" or (p.device.type == "cpu" and INTERPRETED):
            return
        if p.device.type == "cpu":
            raise RuntimeError(
                "engine='triton' needs CUDA parameters; CPU parameters run on the kernels only under the Triton "
                "interpreter (set TRITON_INTERPRET=1 before apexw_hf.engines.triton.kernels is imported). Use "
                "engine='torch' or 'auto' for CPU training."
            )
        raise RuntimeError(f"engine='triton' supports CUDA parameters only, got device {p.device}")

    def check(self, group: dict, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """The errors of :meth:`step_group` that ``group``, ``params`` and ``grads`` decide (the ``Engine`` contract):
        a hyperparameter :func:`~apexw_hf.hparams.step_hparams` refuses, parameters this engine cannot run on, a
        gradient that is sparse, of another shape, device or dtype, or not contiguous. Changes nothing."""
        if not params:
            return
        self._hparams(group)
        self._check_device(params[0])
        self._check_grads(params, grads)

    def _rebuild(
        self,
        group: dict,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        states: list[dict],
        indices: list[int],
        bucket: object = None,
        streamed: bool = False,
    ) -> _GroupCache:
        self._check_device(params[0])
        old = self._cache.get((id(group), bucket))
        same = old is not None and old.fmt == group["state_format"] and old.seed == group["seed"]
        stepping = {id(p): i for i, p in enumerate(params)}
        # Members: params stepping now plus those cached before (their counters stay in the new buffer, their states
        # and indices are those the old plan was built from).
        members, member_grads, member_states, member_indices = [], [], [], []
        for p in group["params"]:
            i = stepping.get(id(p))
            if i is not None:
                members.append(p)
                member_grads.append(grads[i])
                member_states.append(states[i])
                member_indices.append(indices[i])
            elif same and id(p) in old.slot_of:
                j = old.slot_of[id(p)]
                members.append(p)
                member_grads.append(p.grad if p.grad is not None else p)  # a stand-in of its dtype for the plan key
                member_states.append(old.states[j])
                member_indices.append(old.indices[j])
        for p, g in zip(params, grads):  # every gradient before any change
            self._check_grad(p, g)
        cache = _GroupCache(group, members, member_states, member_indices, member_grads, streamed)
        if cache.member_ids == list(map(id, params)):  # ``states`` then names exactly the members (_cache_for)
            cache.given_states = states
        # A param's step counter is a view into the buffer of the cache built last for it: other caches of this group
        # that hold it would count on a stale buffer, so they go (gradient release may regroup tensors into buckets).
        for key in [k for k, c in self._cache.items() if k[0] == id(group) and k[1] != bucket]:
            if not self._cache[key].slot_of.keys().isdisjoint(cache.slot_of):
                del self._cache[key]
        self._cache[(id(group), bucket)] = cache
        return cache

    @staticmethod
    def _check_grad(p: torch.Tensor, g: torch.Tensor) -> None:
        p, g = dt.local(p), dt.local(g)
        if g.is_sparse:
            raise RuntimeError("ApexW does not support sparse gradients; use torch.optim.SparseAdam")
        if g.shape != p.shape or g.device != p.device or not g.is_contiguous() or g.is_sparse:
            raise ValueError(
                f"the Triton engine needs dense contiguous gradients shaped like their parameter on its device; got "
                f"shape {tuple(g.shape)}, strides {g.stride()}, device {g.device} for a parameter of shape "
                f"{tuple(p.shape)} on {p.device}"
            )
        if g.dtype not in _GRAD_DTYPES:
            raise TypeError(f"unsupported gradient dtype {g.dtype}; allowed: float32, bfloat16, float16")

    def _check_grads(
        self, params: list[torch.Tensor], grads: list[torch.Tensor], cache: _GroupCache | None = None
    ) -> list[torch.dtype]:
        """``_check_grad`` of every pair, as a few C-level passes over the lists (autograd may hand out gradients at
        new addresses every step, and then all of them are checked: a Python call per gradient cost a LoRA step of 392
        tensors ~0.7 ms of host time); the gradients' dtypes, in order. ``cache``: when ``params`` are its members in
        order, their shapes and devices come from it. The first bad pair raises ``_check_grad``'s error."""
        dtypes = list(map(_DTYPE, grads))
        if not dt.is_dtensor(params[0]):
            shapes, devices = (cache.shapes, cache.devices) if cache is not None else _shapes_devices(params)
            if (
                all(map(torch.Tensor.is_contiguous, grads))  # False for sparse layouts too
                and list(map(_SHAPE, grads)) == shapes
                and list(map(_DEVICE, grads)) == devices
                and _GRAD_DTYPES.issuperset(dtypes)
            ):
                return dtypes
        for p, g in zip(params, grads):
            self._check_grad(p, g)
        return dtypes

    def step_group(
        self,
        group: dict,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        states: list[dict],
        tensor_indices: list[int],
        bucket: object = None,
        grad_scale: torch.Tensor | Callable[[list], torch.Tensor | None] | None = None,
        stager: Callable | None = None,
        nonfinite=None,
    ) -> None:
        """Increment the step of ``params`` (the group's params with a gradient) and apply one AdamW update to them.

        ``grads``: their ``.grad`` tensors, in the same order (the caller has read them already). ``states``,
        ``tensor_indices``: their state dicts and random-stream indices, read only when a launch plan is (re)built.
        ``bucket``: a hashable name of this subset of the group (gradient release steps a group bucket by bucket);
        each bucket keeps its own launch plan, so one launch covers exactly its tensors. ``grad_scale``: None, an fp32
        tensor of one element, or a callable ``grad_scale(plans)`` called with the launch plans once their gradient
        addresses are set, before their launches (gradient release computes the bucket's norm from their address
        tables there), returning such a tensor or None: the factor the kernels multiply each gradient by as they load
        it (gradient release's clip coefficient), moved to the plans' device if it is elsewhere. ``nonfinite``: the
        counters (``counts(device)``, ``serial``) the kernels count skipped non-finite blocks into. ``stager``: the
        state lives elsewhere and is staged on the device per launch (state offload): ``stager(plan, params, index)``
        of each launch plan (its params in plan order, its index in the bucket) yields ``(programs, state table)``,
        the plan is launched over those work items with the state addresses of that table
        (``LaunchPlan.state_table``), and the stager resumes once the launch is queued.

        Host time here is on the critical path (once per bucket under gradient release; LoRA steps of hundreds of
        small tensors are host-bound): the parts below are C-level passes over lists wherever the list is long.
        """
        if not params:
            return
        hp = self._hparams(group)  # before any step counter moves: a bad value then changes nothing
        try:
            if dt.is_dtensor(params[0]):  # FSDP2: the local shard of each gradient
                ptrs = [g.to_local().data_ptr() for g in grads]
            else:
                ptrs = list(map(torch.Tensor.data_ptr, grads))
        except RuntimeError:  # a gradient without storage (sparse): say which and why, as the torch engine does
            self._check_grads(params, grads)
            raise
        cache, ids = self._cache_for(group, params, grads, states, tensor_indices, bucket, stager is not None, ptrs)
        step, scalars, uniform = self._step(cache, ids, hp)
        device = cache.plans[0][0].device
        if callable(grad_scale):
            grad_scale = grad_scale([entry[0] for entry in cache.plans])
        if grad_scale is not None and grad_scale.device != device:  # (ordered on the device's stream, not waited for)
            grad_scale = grad_scale.to(device, non_blocking=device.type != "cpu")
        flags = {
            "nonfinite": None if nonfinite is None else (nonfinite.counts(device), nonfinite.serial),
            "step": step,
            "scalars": scalars,
            "maximize": group["maximize"],
            "stochastic_param": group["param_rounding"] == "stochastic",
            "per_tensor_step": not uniform,
            "grad_scale": grad_scale,
            "check_nonfinite": self.check_nonfinite,
        }
        for i, (plan, _, _) in enumerate(cache.plans):
            if stager is None:
                plan.launch(**flags)
                continue
            for programs, table in stager(plan, cache.plan_members[i], i):
                plan.launch(**flags, programs=programs, state_table=table)

    def _cache_for(
        self,
        group: dict,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        states: list[dict],
        tensor_indices: list[int],
        bucket: object,
        streamed: bool,
        ptrs: list[int],
    ) -> tuple[_GroupCache, list[int] | None]:
        """The cache entry of (group, bucket), rebuilt when its params, format, seed, streaming or gradient dtypes
        changed, with its plans' gradient addresses set to ``ptrs`` (new addresses are checked first). Also returns
        the ids of ``params`` when they are not exactly the cached members in order (None when they are)."""

        def rebuild():
            return self._rebuild(group, params, grads, states, tensor_indices, bucket, streamed)

        cache = self._cache.get((id(group), bucket))
        full = cache is not None and (
            states is cache.given_states  # the caller's list of the build: the same params (Engine.step_group)
            or (len(params) == len(cache.members) and all(map(operator.is_, params, cache.members)))
        )
        ids = None
        if not full:
            ids = [id(p) for p in params]
            if cache is None or not all(i in cache.slot_of for i in ids):
                cache = rebuild()
                full = ids == cache.member_ids
        if group["state_format"] != cache.fmt or group["seed"] != cache.seed or cache.streamed != streamed:
            cache = rebuild()
            full = [id(p) for p in params] == cache.member_ids
        slot_ptrs = ptrs if full else self._slot_ptrs(cache, ids, ptrs)
        if slot_ptrs == cache.grad_ptrs:
            return cache, None if full else ids
        # New allocations: check them (dtype, shape, layout) before handing their addresses to the kernel.
        ids = ids or (cache.member_ids if full else [id(p) for p in params])
        got = self._check_grads(params, grads, cache if full else None)
        if full:
            dtypes = got
        else:
            dtypes = list(cache.grad_dtypes)
            for i, d in zip(ids, got):
                dtypes[cache.slot_of[i]] = d
        if dtypes != cache.grad_dtypes:
            cache = rebuild()
            full = ids == cache.member_ids
            slot_ptrs = ptrs if full else self._slot_ptrs(cache, ids, ptrs)
        cache.grad_ptrs = slot_ptrs
        self.grad_moves += 1
        for plan, slots, _ in cache.plans:
            plan.set_grad_ptrs(slot_ptrs if len(cache.plans) == 1 else [slot_ptrs[i] for i in slots])
        return cache, None if full else ids

    def _step(self, cache: _GroupCache, ids: list[int] | None, hp: dict[str, float]):
        """Increment the step counters of the stepping params (all cached ones when ``ids`` is None) and return the
        lowest step count among them, its scalars, and whether every stepping param is at that step. When they are
        not, each plan gets a per-tensor table of step sizes (Python float math per distinct step count, exactly as
        the reference)."""
        # All cached params in one add (on the numpy view of the counters' buffer: a fraction of the host time of a
        # tensor operation), or only the stepping ones.
        if ids is None:
            cache.steps_np += 1
            stepping = cache.steps_np
        else:
            active = torch.tensor([cache.slot_of[i] for i in ids], dtype=torch.int64)
            cache.steps.index_add_(0, active, torch.ones(len(ids), dtype=torch.float32))
            stepping = cache.steps_np[active.numpy()]
        if len(stepping) <= 64:  # a bucket of gradient release: Python's min/max of a short list beat numpy's
            counts = stepping.tolist()
            lo, hi = int(min(counts)), int(max(counts))
        else:
            lo, hi = int(stepping.min()), int(stepping.max())
        if lo == hi:
            # gradient release steps a group bucket by bucket: the buckets of one step share their scalars
            key = (lo, *hp.values())
            if self._scalars_key != key:
                self._scalars_key, self._scalars = key, ref.StepScalars.make(step=lo, **hp)
            return lo, self._scalars, True
        table = {int(t): ref.StepScalars.make(step=int(t), **hp) for t in np.unique(stepping)}
        for plan, _, slots_np in cache.plans:
            t = cache.steps_np[slots_np].astype(np.int64)
            known = [table.get(int(x)) for x in t]  # None: not stepping now (its kernel programs exit early)
            plan.set_tensor_steps(
                t,
                [k.step_size if k else 0.0 for k in known],
                [k.inv_bc2_sqrt if k else 0.0 for k in known],
            )
        return lo, table[lo], False

    @staticmethod
    def _slot_ptrs(cache: _GroupCache, ids: list[int], ptrs: list[int]) -> list[int]:
        slot_ptrs = [0] * len(cache.members)
        for i, a in zip(ids, ptrs):
            slot_ptrs[cache.slot_of[i]] = a
        return slot_ptrs
