"""Gradient release: ApexW steps each parameter inside ``backward()`` as soon as its gradient is complete.

A full fine-tune keeps, besides the weights and the optimizer state, every gradient from the end of the backward pass
to ``optimizer.step()``: 2 bytes per parameter of a bf16 model, as much as the weights. With
``ApexW(..., gradient_release=True)`` each trainable parameter gets a ``register_post_accumulate_grad_hook``; when
autograd has finished a parameter's gradient (the sum over every use of it, so a tied embedding and output layer get
one update), the parameter joins its param group's bucket. When a bucket holds its limit of elements, it
is stepped - one kernel launch (per parameter dtype) for all its tensors, the same update ``step()`` computes for
those gradients - and the gradients are freed; when the backward pass ends (a callback queued on autograd's engine),
every bucket is. Buckets are per group because a launch serves one group's hyperparameters: a bucket that mixed the
Trainer's two groups (weight decay or not) would cost two launches, the second for a few norm weights.

The limit. With ``release_bucket_size=N`` it is ``N`` elements. By default it grows through the backward pass: 2**25
elements (64 MiB of bf16 gradients) at its start, up to 4 x 2**25 by its end, in proportion to the share of the
previous step's released elements already released in this one. Each bucket costs host time on autograd's thread (a
few launches and their Python), which a small model's GPU waits for, so fewer buckets make its step faster; and the
gradients waiting in a bucket add to the peak memory, which a checkpointed model reaches at the start of the backward
pass (every checkpointed activation still alive, the output layer's gradient just computed): later, the activations
freed by then leave room for the larger buckets. The limit depends only on element counts (a sharded parameter's count
is its global size over its shard count), so every rank of a sharded model cuts the same buckets, and from the second
step on every step cuts the same ones (the norm estimate below assumes that). The previous step's count is saved with
the state dict, so a resumed run cuts the buckets an unbroken one would.
``optimizer.step()`` then only closes the step: it steps any parameter whose gradient was set without a backward pass,
records the step's gradient norm and checks that nothing was left behind.

Gradient norm and clipping. The global norm of the gradients is only known at the end of backward, after most
tensors have been updated. With ``max_grad_norm`` set, the gradients of each bucket are multiplied by
``min(1, max_grad_norm / (N + 1e-6))`` (rounded to the gradients' dtype, as ``clip_grad_norm_`` computes it for
bf16 gradients) before its update, where ``N`` estimates this step's global norm from what has
been released so far: buckets come in the same order every step, so with ``S`` the sum of squares released so far in
this step (this bucket included) and ``S'`` / ``T'`` the same sum at the same bucket / the total of the previous step,
``N = sqrt(S * T' / S')`` (never below ``sqrt(S)``, a lower bound of the step's norm). It is exact when the buckets'
shares of the squared norm are those of the previous step, whatever the overall scale, so a step whose gradients
shrink or grow as a whole is clipped as exact clipping would; a spike in one tensor is clipped from its bucket on.
The first step uses ``N = max(sqrt(S), previous norm)``, and so does a step from its first bucket that is not the
previous step's bucket at that place (a parameter with a gradient in one step and none in the other, as an unused
expert of a mixture of experts; a model split over devices, whose devices' backward threads may complete buckets in
another order). After a checkpoint is loaded the first step assumes the saved step's buckets.
The bucket's engine call gets the norm bookkeeping as its ``grad_scale`` callable (``GradientRelease._grad_scale``;
:meth:`apexw_hf.engines.Engine.step_group`), which the engine calls once it has the bucket's gradients in hand: the
same callable whichever engine runs. Per bucket on a GPU with the Triton engine this is two small kernel launches
(``engines.triton.kernels.release_norm``): one sums the squared gradient elements, read through the address table of
the bucket's AdamW launch, the other adds that to the step's running sums and computes the coefficient, which the
update kernel multiplies each gradient by as it loads it (``LaunchPlan.launch(grad_scale=...)``: the bits of an
in-place multiply, without a pass of its own). Elsewhere (the PyTorch engine, FSDP2's DTensor gradients, a group over
several devices, the Triton interpreter) the per-tensor norms (one fused operation) replace the first launch, and the
engine multiplies by the coefficient (the torch engine in place, one fused multiply); on the CPU PyTorch operations
(:func:`release_norm_torch`) replace the second. On a small model the GPU waits for this host time, so it is kept to
a few launches.
The true pre-clip global norm of the step is recorded (:attr:`ApexW.grad_norm`), returned by Accelerate's
``clip_grad_norm_`` (so the Trainer logs it as ``grad_norm``) and saved in the state dict with the previous step's
partial sums (a resumed run clips exactly as an unbroken one). They are saved twice: under the state dict's
``"gradient_release"`` key, and as a JSON string under the key ``"gradient_release_state"`` of its first param group,
because ``torch.distributed.checkpoint``'s ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` (how Accelerate
and the Trainer checkpoint an FSDP2 optimizer) keep only ``"state"`` and ``"param_groups"``, and their full-state-dict
broadcast from rank 0 fills each leaf of the receiving rank's own state dict (a list of partial sums would keep the
receiver's length; one string is one leaf). On load the group key is taken out of the groups again (it is no
hyperparameter) and used when the top-level key is missing.

What needs every gradient at once, and what happens to it here:

* gradient accumulation over several backward passes: refused. A parameter whose gradient completes a second time
  before ``step()`` raises an error before anything of that backward pass is updated.
* fp16 with a GradScaler: refused (the scaled gradients would be applied before the scaler could unscale them or
  skip the step); train in bf16.
* skipping a whole step on inf/NaN: not possible, the buckets released before a non-finite gradient are already
  updated. What is possible is done: as in ``step()``, every engine leaves a block of 256 elements with a non-finite
  gradient un-updated (parameter, moments, scales; ``reference.nonfinite_blocks``) and counts it
  (:mod:`apexw_hf.optim.nonfinite`). With clipping, the step's running sum of squares is not finite from that bucket
  on, and the clip coefficient is then NaN: that bucket and every later one of the step are left un-updated, so a NaN
  loss (every gradient NaN) skips the step whole, and a single bad tensor skips the step from its bucket on.
  ``grad_norm`` reports the inf/NaN; the next step's clipping estimate ignores that norm (``sqrt(S)`` where the
  shares of a non-finite step are unknown, a lower bound of the norm).
* DDP: refused (the hooks would see this rank's gradient before the all-reduce). FSDP2 is supported: it calls the
  hooks of the sharded parameters after the reduce-scatter, and the norm is reduced over the mesh.
"""

from __future__ import annotations

import functools
import importlib
import itertools
import json
import operator
import threading
import time
import weakref
from collections.abc import Callable

import torch

from .. import dtensor as dt
from .tied_offload import PREFETCH_SHARE, TiedGradOffload

DEFAULT_BUCKET_SIZE = 2**25  # elements: the default limit at the start of a backward pass (64 MiB of bf16)
BUCKET_GROWTH = 4  # the default limit at the end of a backward pass, in DEFAULT_BUCKET_SIZE

STATE_KEY = "gradient_release"  # the state dict's top-level key (written by ApexW.state_dict)
GROUP_STATE_KEY = "gradient_release_state"  # the same in the first param group: survives torch.distributed.checkpoint

_ACCUMULATION_ERROR = (
    "gradient_release=True: the gradient of a parameter (shape {shape}) was completed a second time before "
    "optimizer.step(). Gradient release updates each parameter as soon as its gradient is complete, so it cannot "
    "accumulate gradients over several backward passes: call optimizer.step() after every backward pass and set "
    "gradient_accumulation_steps=1 (use a larger per-device batch instead), or turn gradient_release off. A parameter "
    "used in two reentrant checkpointed segments also completes twice: use gradient checkpointing with "
    "use_reentrant=False. If the previous backward pass raised an error (out of memory, say), call "
    "optimizer.zero_grad() before the next one: it gives up that unfinished step (the tensors it updated keep their "
    "update)."
)


_SLOT, _PARAM = operator.itemgetter(0), operator.itemgetter(1)
_GRAD = operator.attrgetter("grad")


def _fill(p: torch.Tensor) -> int:
    """How much of a bucket a parameter's gradient fills: its elements, or for a sharded parameter its global size over
    its shard count. Not the local shard's size: shards of one tensor differ in size across ranks (5 rows over two
    ranks are 3 + 2), and a bucket boundary that differed between ranks would pair different buckets in the norm's
    all-reduce (a wrong norm, or a collective mismatch)."""
    if dt.is_dtensor(p):
        return p.numel() // dt.shard_count(p)
    return p.numel()


def _queue_end_of_backward(fn: Callable[[], None]) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(fn)


class GradientRelease:
    """The hooks, buckets and norm bookkeeping of one optimizer with ``gradient_release=True``.

    The optimizer is held through a weak reference, so a hook left on a parameter keeps no optimizer alive.
    """

    def __init__(
        self, optimizer, bucket_size: int | None, max_grad_norm: float | None, tied_grad_offload: bool = False
    ):
        self._opt_ref = weakref.ref(optimizer)
        # the output layer's part of a tied weight's gradient, held in host memory until the rest arrives
        self.offload = TiedGradOffload(optimizer._offload) if tied_grad_offload else None
        self.bucket_size = bucket_size  # None: the default limit, growing through each backward pass
        # elements released in this step so far, and in the last finished step (the default limit grows with their
        # ratio); counted as _fill counts them
        self._released = 0
        self._prev_released = 0
        self.max_grad_norm = max_grad_norm
        self._handles: dict[int, tuple[weakref.ref, object]] = {}
        self._hooked_ids: list[int] | None = None
        self._hooked_trainable: list[bool] | None = None
        # param group index -> its bucket: ((group index, index in the group), parameter) in completion order
        self._pending: dict[int, list[tuple[tuple[int, int], torch.Tensor]]] = {}
        self._pending_numel: dict[int, int] = {}
        self._queued = False
        self._stepped: set[int] = set()
        # this step's running sum of squares after each of its first _k buckets (fp32 on the gradients' device; a
        # buffer reused every other step), and the same of the last finished step (its first _prev_k entries)
        self._cum: torch.Tensor | None = None
        self._k = 0
        self._prev_cum: torch.Tensor | None = None
        self._prev_k = 0
        # the buckets (their parameters' ids) of this step and of the last, in order: the share estimate holds while
        # this step's buckets so far are the last step's (None: not known, after a checkpoint was loaded)
        self._keys: list[tuple] = []
        self._prev_keys: list[tuple] | None = None
        self._same_buckets = True
        # (device, gradient dtype) -> the clip coefficient's buffers (fp32, that dtype) and their 0-d views by dtype
        self._coef: dict[tuple, tuple[torch.Tensor, torch.Tensor, dict]] = {}
        self._prev_norm: torch.Tensor | None = None  # grad_norm as a 1-element tensor on the gradients' device
        # the last finished step's global norm: reported, and the next step's clipping estimate uses it
        self.grad_norm: torch.Tensor | None = None
        # autograd runs the backward of each device on its own thread, so the hooks of a model split over devices
        # can run at once: the buckets and the step's running sums take turns
        self._lock = threading.RLock()
        self.flushes = 0  # bucket launches since construction (a diagnostic)
        self.host_seconds = 0.0  # host time spent in flushes since construction (a diagnostic: it runs in backward)
        ref = weakref.ref(self)
        self._state_dict_hooks = [
            optimizer.register_state_dict_post_hook(functools.partial(_state_dict_post_hook, ref)),
            optimizer.register_load_state_dict_pre_hook(_load_state_dict_pre_hook),
        ]

    # ---- hooks -------------------------------------------------------------------------------------------------

    def sync_hooks(self) -> None:
        """Hook every trainable parameter of the param groups, and unhook those no longer there.

        Called at construction, by ``step()`` and before each backward pass under Accelerate: wrappers may replace the
        parameter objects in ``param_groups`` (Accelerate's FSDP2 preparation swaps in the sharded parameters). A
        parameter unfrozen since the last call gets its hook here; until then its gradient waits for ``step()``, which
        updates it as an optimizer without release would.
        """
        opt = self._opt_ref()
        params = [p for group in opt.param_groups for p in group["params"]]
        ids = [id(p) for p in params]
        trainable = [p.requires_grad for p in params]  # a parameter unfrozen since (gradual unfreezing) gets its hook
        if ids == self._hooked_ids and trainable == self._hooked_trainable:
            return
        keep = set(ids)
        for pid in [pid for pid in self._handles if pid not in keep]:
            self._handles.pop(pid)[1].remove()
        for p in params:
            entry = self._handles.get(id(p))
            if entry is not None and entry[0]() is p:
                continue
            if entry is not None:
                entry[1].remove()
            if p.requires_grad:
                self._handles[id(p)] = (weakref.ref(p), p.register_post_accumulate_grad_hook(self._make_hook()))
        self._hooked_ids, self._hooked_trainable = ids, trainable

    def remove_hooks(self) -> None:
        for _, handle in self._handles.values():
            handle.remove()
        self._handles.clear()
        self._hooked_ids = None
        for handle in self._state_dict_hooks:
            handle.remove()
        self._state_dict_hooks = []

    def _make_hook(self):
        ref = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            release = ref()
            if release is not None and release._opt_ref() is not None:
                release.on_grad_ready(p)

        return hook

    def on_grad_ready(self, p: torch.Tensor) -> None:
        with self._lock:
            self._on_grad_ready(p)

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if id(p) in self._stepped:
            p.grad = None  # the second gradient is not applied; the parameter keeps its one update of this step
            raise RuntimeError(_ACCUMULATION_ERROR.format(shape=tuple(p.shape)))
        if self.offload is not None:
            part = self.offload.take(p)
            if part is not None:  # the tied weight's offloaded part: autograd's sum of the two, in place
                p.grad = part.contiguous() if p.grad is None else p.grad.add_(part)
        if not self._stepped and not self._pending:
            self._check_setup(p)
            if self.offload is not None:
                self.offload.check_prepared()
        slot = self._opt_ref()._group_slot(p)
        gi = slot[0]
        bucket = self._pending.get(gi)
        if bucket is None:
            bucket = self._pending[gi] = []
        bucket.append((slot, p))
        numel = self._pending_numel.get(gi, 0) + _fill(p)
        self._pending_numel[gi] = numel
        if self.offload is not None and self._prev_released:
            if self._released + numel >= PREFETCH_SHARE * self._prev_released:
                self.offload.prefetch()
        if not self._queued:
            self._queued = True
            _queue_end_of_backward(self._on_backward_end)
        if numel >= (self.bucket_size or self._default_limit()):
            self._flush(None, gi)

    def _default_limit(self) -> int:
        """The default bucket limit now: DEFAULT_BUCKET_SIZE, growing to BUCKET_GROWTH times that with the share of the
        last step's released elements released in this step so far."""
        if not self._prev_released:
            return DEFAULT_BUCKET_SIZE
        done = min(self._released / self._prev_released, 1.0)
        return int(DEFAULT_BUCKET_SIZE * (1.0 + (BUCKET_GROWTH - 1) * done))

    def _on_backward_end(self) -> None:
        self._queued = False
        with self._lock:
            if self.offload is not None:
                # a tied weight whose gradient never completed in this pass: its offloaded part alone
                for p in self.offload.pending():
                    self._on_grad_ready(p)
                self.offload.prepared = False  # the next pass needs before_backward again
            self._flush(None, None)

    def prepare_backward(self, loss: torch.Tensor, models) -> int:
        """Before a backward pass (``ApexW.before_backward``): hook the first use of each tied weight of ``models``
        in the graph of ``loss`` for the offload (among the parameters hooked at construction or the last
        ``step()``, or before this pass by Accelerate's ``backward``)."""
        with self._lock:
            return self.offload.prepare(loss, models, set(self._handles))

    @staticmethod
    def _check_setup(p: torch.Tensor) -> None:
        """At the first gradient of a step: refuse DDP (a plain parameter in a process group of several ranks)."""
        if dt.is_dtensor(p) or not torch.distributed.is_available() or not torch.distributed.is_initialized():
            return
        if torch.distributed.get_world_size() > 1:
            raise RuntimeError(
                "gradient_release=True under data parallelism with plain (replicated) parameters, i.e. DDP: the "
                "optimizer would update each rank's parameters with that rank's gradient before the all-reduce. Use "
                "FSDP2 (fully_shard; Accelerate's fsdp_version: 2), whose sharded parameters are released after the "
                "reduce-scatter, or turn gradient_release off under DDP."
            )

    # ---- buckets -------------------------------------------------------------------------------------------------

    def flush(self, extra: list[torch.Tensor] | None = None, group: int | None = None) -> None:
        """Step the pending parameters of every group, or of param group ``group`` alone (and ``extra``), then free
        their gradients."""
        with self._lock:
            self._flush(extra, group)

    def _flush(self, extra: list[torch.Tensor] | None, group: int | None) -> None:
        if group is None:
            entries = [e for bucket in self._pending.values() for e in bucket]
            self._released += sum(self._pending_numel.values())
            self._pending, self._pending_numel = {}, {}
        else:
            entries = self._pending.pop(group, [])
            self._released += self._pending_numel.pop(group, 0)
        if not entries and not extra:
            return
        t0 = time.perf_counter()
        opt = self._opt_ref()
        entries += [(opt._group_slot(p), p) for p in extra or []]
        # In param-group order: each bucket's tensors then come in the order of the engine's cached launch plan for
        # them (its fast path), whatever order backward completed them in.
        entries.sort(key=_SLOT)
        params = list(map(_PARAM, entries))
        grads = list(map(_GRAD, params))
        key = tuple(map(id, params))
        first, last = entries[0][0][0], entries[-1][0][0]
        grad_scale = self._grad_scale(grads, key)
        if first == last:  # a bucket inside backward: one param group
            opt._step_params(opt.param_groups[first], params, grads, bucket=key, grad_scale=grad_scale)
        else:
            # the end-of-step flush over several groups: one norm for all of them, one factor for every engine call
            scale = grad_scale(None)
            start = 0
            for gi, run in itertools.groupby(slot[0] for slot, _ in entries):
                end = start + sum(1 for _ in run)
                group_params, group_grads = params[start:end], grads[start:end]
                opt._step_params(opt.param_groups[gi], group_params, group_grads, bucket=key, grad_scale=scale)
                start = end
        for p in params:
            p.grad = None
        self._stepped.update(key)
        self.flushes += 1
        self.host_seconds += time.perf_counter() - t0

    def _grad_scale(self, grads: list[torch.Tensor], key: tuple) -> Callable[[list | None], torch.Tensor | None]:
        """The ``grad_scale`` a bucket's engine call gets (:meth:`apexw_hf.engines.Engine.step_group`): called once,
        it adds the bucket's squared norm to the step's and returns the clip coefficient (fp32, one element, on the
        gradients' device; None without clipping: the norm is recorded all the same, the Trainer logs it). Given the
        Triton engine's launch plans, with plain gradients on a GPU where the kernels run, it reads the sum of squares
        through their address tables (``engines.triton.kernels.release_norm.grad_sumsq_``: no pass over the gradients
        of its own); else (``None`` from the torch engine, DTensor gradients whose norm is reduced over the mesh, no
        kernels) it takes the per-tensor norms (:func:`_norm_parts`). Either engine multiplies each gradient by the
        coefficient rounded to its dtype, the bits of ``clip_grad_norm_``'s in-place multiply."""
        device = dt.local(grads[0]).device

        def grad_scale(plans: list | None) -> torch.Tensor | None:
            sumsq = None if plans is None or dt.is_dtensor(grads[0]) else _sumsq_impl(device)
            if sumsq is None:
                coefs = self._account(grads, key)
            else:
                coefs = self._account_parts(sumsq(plans), True, grads[0].dtype, key)
            # (the running sums, and so the coefficient, may sit on another GPU of the model)
            return None if coefs is None else _on(coefs[torch.float32], device).reshape(1)

        return grad_scale

    def _account(self, grads: list[torch.Tensor], key: tuple) -> dict[torch.dtype, torch.Tensor] | None:
        """Add this bucket's squared norm to the step's; its clip coefficient by gradient dtype (None without
        clipping), from the per-tensor norms (:func:`_norm_parts`)."""
        parts, squared = _norm_parts(grads)
        return self._account_parts(parts, squared, dt.local(grads[0]).dtype, key)

    def _account_parts(
        self, parts: torch.Tensor, squared: bool, lo: torch.dtype, key: tuple
    ) -> dict[torch.dtype, torch.Tensor] | None:
        """``_account`` of a bucket whose norms are ``parts`` (fp32 norms, or sums of squares where ``squared``) and
        whose first gradient has dtype ``lo``. One kernel launch on a GPU
        (:mod:`..engines.triton.kernels.release_norm`), else PyTorch operations (:func:`release_norm_torch`)."""
        k = self._k
        if self._cum is None or (k == 0 and self._cum.device != parts.device):
            self._cum = torch.empty(max(64, 2 * self._prev_k), dtype=torch.float32, device=parts.device)
        # a step's running sums stay on the device of its first bucket (a model split over devices has buckets on
        # several devices)
        device = self._cum.device
        parts = _on(parts, device)
        if k >= self._cum.numel():
            grown = torch.empty(max(64, 2 * k), dtype=torch.float32, device=device)
            grown[:k] = self._cum[:k]
            self._cum = grown
        self._keys.append(key)
        prev_cum = None
        if self._prev_cum is not None and k < self._prev_k:
            if self._prev_keys is not None:
                self._same_buckets = self._same_buckets and self._prev_keys[k] == key
            if self._same_buckets:
                prev_cum = _on(self._prev_cum, device)
        prev_norm = None
        if self.grad_norm is not None:
            if self._prev_norm is None or self._prev_norm.device != device:
                self._prev_norm = _on(self.grad_norm, device).reshape(1)
            prev_norm = self._prev_norm
        coef = self._coef.get((device, lo))
        if coef is None:
            c32 = torch.empty(1, dtype=torch.float32, device=device)
            c_lo = torch.empty(1, dtype=lo, device=device)
            # the buffers the kernel writes, and the 0-d views the gradients are multiplied by
            coef = self._coef[(device, lo)] = (c32, c_lo, {torch.float32: c32.reshape(()), lo: c_lo.reshape(())})
        _norm_impl(device)(parts, squared, self._cum, k, prev_cum, prev_norm, self.max_grad_norm, coef[0], coef[1])
        self._k = k + 1
        return None if self.max_grad_norm is None else coef[2]

    # ---- the step boundary ---------------------------------------------------------------------------------------

    def current_norm(self) -> torch.Tensor | None:
        """This step's global gradient norm once its backward has run (before ``step()``), else the last step's."""
        return self.step_norm() if self._k else self.grad_norm

    def step_norm(self) -> torch.Tensor:
        """This step's global gradient norm, after its backward pass: zero when the backward pass released no gradient
        (as ``clip_grad_norm_`` over no gradients), not the last step's."""
        if self._k:
            return self._cum[self._k - 1].sqrt()
        return torch.zeros(())

    def finish_step(self) -> None:
        """End of ``optimizer.step()``: step what was not released, record the norm, start a new step."""
        opt = self._opt_ref()
        extra = []
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if id(p) in self._stepped:
                    raise RuntimeError(
                        f"gradient_release=True: a parameter (shape {tuple(p.shape)}) has a gradient again after it "
                        "was updated in this step's backward pass; stepping it again would update it twice. Do not "
                        "set .grad between backward() and step() with gradient release."
                    )
                if not any(q is p for bucket in self._pending.values() for _, q in bucket):
                    extra.append(p)  # a gradient set without backward, or a parameter without a hook
        self.flush(extra)
        if self._k:
            self.grad_norm = self.step_norm()
            self._prev_norm = None
            # the two buffers swap: the next step writes into the one this step read
            self._prev_cum, self._cum = self._cum, self._prev_cum
            self._prev_k = self._k
            self._prev_keys = self._keys
            self._prev_released = self._released
        self._begin_step()

    def _begin_step(self) -> None:
        """Forget this step's buckets and updated parameters: the next gradient starts a new step."""
        self._k, self._keys, self._same_buckets = 0, [], True
        self._stepped = set()
        self._released = 0
        self._queued = False  # a backward pass that raised never ran its end-of-backward callback

    def abandon_step(self) -> None:
        """``zero_grad()`` before ``step()``: give up the step of a backward pass that did not reach ``step()`` (it
        raised, and its end-of-backward callback never ran). The gradients waiting in buckets are dropped, the tensors
        it already updated keep their update, its running sums are discarded (the last finished step's stay for the
        clipping estimate), and the next backward pass starts a new step. Nothing to do after a finished step."""
        with self._lock:
            if self.offload is not None:
                self.offload.drop()
            if not (self._pending or self._stepped or self._k or self._queued):
                return
            self._pending, self._pending_numel = {}, {}
            self._begin_step()

    def give_up_failed_backward(self) -> bool:
        """Before a backward pass (Accelerate's ``backward``): if the last one raised (its end-of-backward callback
        never ran, which a finished backward pass or a ``step()`` would have cleared), give up its step as
        ``zero_grad()`` does. Whether there was one."""
        with self._lock:
            if not self._queued:
                return False
            self.abandon_step()
            return True

    # ---- checkpoints ---------------------------------------------------------------------------------------------

    def state(self) -> dict:
        norm = None if self.grad_norm is None else float(self.grad_norm)
        partial = [] if self._prev_cum is None else self._prev_cum[: self._prev_k].tolist()
        return {"prev_grad_norm": norm, "prev_partial_sumsq": partial, "prev_released_numel": self._prev_released}

    @staticmethod
    def check_saved(saved: dict | None) -> tuple[float | None, list, int]:
        """The saved clipping state's fields (``prev_grad_norm``, ``prev_partial_sumsq``, ``prev_released_numel``),
        checked: a ValueError that names the bad one. Called before anything of a state dict is loaded."""
        norm = (saved or {}).get("prev_grad_norm")
        if norm is not None and not isinstance(norm, (int, float)):
            raise ValueError(f"gradient_release state: prev_grad_norm must be a float or None, got {norm!r}")
        partial = (saved or {}).get("prev_partial_sumsq", [])
        if not isinstance(partial, (list, tuple)) or not all(isinstance(x, (int, float)) for x in partial):
            raise ValueError(f"gradient_release state: prev_partial_sumsq must be a list of floats, got {partial!r}")
        # absent from checkpoints written before the default bucket limit grew: the next step starts from the base
        released = (saved or {}).get("prev_released_numel", 0)
        if isinstance(released, bool) or not isinstance(released, int) or released < 0:
            raise ValueError(f"gradient_release state: prev_released_numel must be an int >= 0, got {released!r}")
        return norm, list(partial), released

    def load(self, saved: dict | None, device: torch.device | None) -> None:
        norm, partial, released = self.check_saved(saved)
        if norm is None:
            self.grad_norm = None
        else:
            t = torch.tensor(float(norm), dtype=torch.float32, device=device)
            self.grad_norm = t
        self._prev_cum = torch.tensor([float(x) for x in partial], dtype=torch.float32, device=device)
        self._prev_k = len(partial)
        self._prev_released, self._released = released, 0
        self._cum, self._k, self._prev_norm = None, 0, None
        self._keys, self._prev_keys, self._same_buckets = [], None, True  # parameter ids do not outlive a process


def _state_dict_post_hook(ref: weakref.ref, optimizer, state_dict: dict) -> None:
    """Copy the clipping state into the first param group, where ``torch.distributed.checkpoint`` keeps it."""
    release = ref()
    if release is not None and state_dict.get("param_groups"):
        state_dict["param_groups"][0][GROUP_STATE_KEY] = json.dumps(release.state())


def _load_state_dict_pre_hook(optimizer, state_dict: dict) -> dict:
    """Take the group copy of the clipping state out of the param groups; use it if the top-level key is missing."""
    saved = None
    groups = []
    for group in state_dict.get("param_groups", []):
        if GROUP_STATE_KEY in group:
            group = dict(group)  # the caller's state dict stays as it was
            value = group.pop(GROUP_STATE_KEY)
            saved = value if saved is None else saved
        groups.append(group)
    out = dict(state_dict)
    out["param_groups"] = groups
    if saved is not None and out.get(STATE_KEY) is None:
        if isinstance(saved, str):
            try:
                saved = json.loads(saved)
            except ValueError as e:
                raise ValueError(f"gradient_release state: {GROUP_STATE_KEY} is not JSON ({e}): {saved!r}") from e
        if not isinstance(saved, dict):
            raise ValueError(f"gradient_release state: {GROUP_STATE_KEY} must be a JSON object, got {saved!r}")
        out[STATE_KEY] = saved
    return out


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``: a copy only where it is elsewhere (``.to`` costs host time even when not), not waited for
    on a GPU (ordered on its stream); one to the CPU waits, since CPU operations read it at once."""
    if t.device == device:
        return t
    return t.to(device, non_blocking=device.type != "cpu")


def _norm_parts(grads: list[torch.Tensor]) -> tuple[torch.Tensor, bool]:
    """``(parts, squared)``: the per-tensor norms of a bucket on one device (fp32, ``squared`` False), or its sum of
    squares as one element (``squared`` True) for DTensor gradients (reduced over the mesh) and several devices."""
    if dt.is_dtensor(grads[0]):
        return _dtensor_sum_of_squares(grads).reshape(1), True
    device = grads[0].device
    if all(g.device == device for g in grads):
        return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)), False
    return _sum_of_squares(grads).reshape(1), True


def release_norm_torch(
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
    """A bucket's norm bookkeeping in PyTorch operations (the kernel of ``release_norm`` computes the same).

    ``cum[k]`` = ``cum[k - 1]`` (0 for the first bucket) + the bucket's sum of squares. With ``max_norm``, the step's
    norm estimate ``N``: with the previous step's running sums ``prev_cum`` (holding entry ``k``) and norm, the share
    ``s = prev_cum[k] / prev_norm**2`` and ``N = sqrt(max(S / s, S))`` (``sqrt(S)`` where ``s`` is not positive);
    without them ``N = max(sqrt(S), prev_norm)`` (``sqrt(S)`` on the first step, or after a step whose norm was not
    finite). ``coef`` = ``min(1, max_norm / (N + 1e-6))``, 0 where that is NaN, and NaN where ``S`` is not finite (a
    non-finite gradient in this step so far: the gradients it multiplies become NaN, so the engines leave their blocks
    un-updated); ``coef_lo`` the same rounded to its dtype."""
    sq = parts.sum() if squared else parts.square().sum()
    s = sq if k == 0 else cum[k - 1] + sq
    cum[k] = s
    if max_norm is None:
        return
    if prev_cum is not None and prev_norm is not None:
        share = prev_cum[k] / prev_norm[0].square()
        norm = torch.where(share > 0, torch.maximum(s / share, s), s).sqrt()
    else:
        norm = s.sqrt()
        if prev_norm is not None:
            prev = prev_norm[0]
            norm = torch.maximum(norm, torch.where(prev < float("inf"), prev, 0.0))
    value = torch.div(torch.full_like(norm, max_norm), norm + 1e-6)
    value = torch.nan_to_num(torch.where(value > 1.0, 1.0, value), nan=0.0)
    value = torch.where(s < float("inf"), value, float("nan"))
    coef.copy_(value.reshape(1))
    coef_lo.copy_(value.reshape(1))


_CUDA_KERNELS: list = []  # engines.triton.kernels.release_norm where it runs on CUDA tensors, else None; at first use


def _cuda_kernels(device: torch.device):
    """The release norm kernels' module for gradients on ``device``, or None: off CUDA, without triton
    (``engine="torch"`` needs none) or under the Triton interpreter (which runs kernels on CPU tensors only)."""
    if device.type != "cuda":
        return None
    if not _CUDA_KERNELS:
        try:
            kernel = importlib.import_module("apexw_hf.engines.triton.kernels.release_norm")
        except ImportError:
            _CUDA_KERNELS.append(None)
        else:
            _CUDA_KERNELS.append(None if kernel.INTERPRETED else kernel)
    return _CUDA_KERNELS[0]


def _sumsq_impl(device: torch.device) -> Callable | None:
    """``grad_sumsq_`` for CUDA gradients where the Triton kernels run; None elsewhere."""
    kernels = _cuda_kernels(device)
    return None if kernels is None else kernels.grad_sumsq_


def _norm_impl(device: torch.device) -> Callable:
    """The bucket norm bookkeeping for gradients on ``device``: one kernel launch on a GPU where the Triton kernels
    run, PyTorch operations elsewhere."""
    kernels = _cuda_kernels(device)
    return release_norm_torch if kernels is None else kernels.release_norm_


def _sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """Sum of the squared elements of ``grads`` in fp32 (one norm per tensor, as ``clip_grad_norm_`` takes them)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    total = None
    for device_grads in by_device.values():
        norms = torch._foreach_norm(device_grads, 2, dtype=torch.float32)
        sq = torch.stack(norms).square().sum()
        total = sq if total is None else total + sq.to(total.device)
    return total


def _dtensor_sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """``_sum_of_squares`` of DTensor gradients: local shards, then summed over the mesh dimensions they are sharded
    on (replicated dimensions, as in HSDP, hold copies and are not summed)."""
    by_layout: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        by_layout.setdefault((id(g.device_mesh), tuple(g.placements)), []).append(g)
    total = None
    for layout_grads in by_layout.values():
        sq = _sum_of_squares([g.to_local() for g in layout_grads])
        mesh, placements = layout_grads[0].device_mesh, layout_grads[0].placements
        for dim, placement in enumerate(placements):
            if placement.is_shard():
                torch.distributed.all_reduce(sq, group=mesh.get_group(dim))
        total = sq if total is None else total + sq.to(total.device)
    return total
