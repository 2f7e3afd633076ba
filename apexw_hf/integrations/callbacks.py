"""``OptimizerStateCallback``: optimizer-state memory (and peak GPU memory) in every training log.

Values (added to the Trainer's training logs):

* ``optimizer_state_mib``: bytes of every tensor in ``optimizer.state`` / 2**20
  (:func:`apexw_hf.accounting.optimizer_state_bytes`, the same accounting for torch, bitsandbytes, torchao and ApexW);
* ``optimizer_state_bytes_per_param``: the same bytes / the number of elements of the parameters being optimized;
* ``optimizer_state_device_mib`` / ``optimizer_state_host_mib``: where those bytes are: on the GPU (plus the device
  buffers an optimizer with ``state_offload=True`` streams its host state through) and in host memory
  (:func:`apexw_hf.accounting.optimizer_state_placement`);
* ``state_offload``: 1 if the optimizer keeps its state in host memory and streams it through the GPU (an ApexW built
  with ``state_offload=True``, e.g. ``optim_args="state_offload=true"``), else 0;
* ``gradient_release``: 1 if the optimizer updates parameters inside ``backward()`` and frees their gradients (an ApexW
  built with ``gradient_release=True``, e.g. ``optim="apexw_8bit_release"``), else 0;
* ``kept_bytes_per_param``: what training keeps per optimized parameter element between backward and the optimizer
  step, ``(P + G + S) / N``: ``P`` the bytes of the optimized parameters, ``G`` the bytes of their gradients held at
  the optimizer step (a gradient of every parameter that requires grad, in the gradient's dtype if one is there when
  the log is written, else the parameter's; 0 with gradient release, which frees each gradient in backward), ``S``
  the optimizer-state bytes above and ``N`` the elements of the optimized parameters. A bf16 full fine-tune with
  ``apexw_4bit`` keeps about 2 + 2 + 1.05 = 5.05 bytes, with release 2 + 0 + 1.05 = 3.05; an fp32 model with torch
  AdamW 4 + 4 + 8 = 16. Not counted: activations, frozen (not optimized) weights, and the one bucket of gradients
  that a release holds at a time. Under FSDP2, ``P``, ``G`` and ``N`` count this rank's shards (as ``S`` does), so
  the value is per rank;
* ``nonfinite_skipped`` (ApexW only): the optimizer steps in which at least one block of 256 elements was not updated
  because its gradient held a NaN or an infinity (``ApexW.nonfinite_skipped``), since the optimizer was built; per
  rank under FSDP2. Reading it waits for the GPU, as logging the loss does. When blocks were skipped since the last
  log, a warning names the first parameter that had a non-finite gradient (by its name in the model);
* ``peak_gpu_memory_gib``: ``torch.cuda.max_memory_allocated() / 2**30``, only when CUDA has been used.

A key added to ``logs`` in ``on_log`` reaches the console, TensorBoard or W&B only if this callback runs before the
reporting callbacks, and the Trainer appends user callbacks after them. Importing this module therefore makes
``CallbackHandler.add_callback`` put callbacks that set ``run_first = True`` at the front of the list (a small,
idempotent patch that changes nothing for other callbacks), so ``Trainer(callbacks=[OptimizerStateCallback()])``
and ``trainer.add_callback(OptimizerStateCallback())`` both work. ``Trainer.log`` has already copied the logs into
``state.log_history`` when ``on_log`` runs, so the callback adds its values to that entry as well.
"""

from __future__ import annotations

import torch
from transformers import TrainerCallback
from transformers import trainer_callback as _trainer_callback

from ..accounting import optimizer_param_count, optimizer_state_bytes, optimizer_state_placement, unwrap_optimizer

__all__ = ["OptimizerStateCallback", "optimizer_state_metrics", "kept_bytes", "uses_gradient_release"]

MIB = 2**20
GIB = 2**30


def optimizer_state_metrics(
    optimizer, *, unique: bool = False, peak_memory: bool = True, model=None
) -> dict[str, float]:
    """The values :class:`OptimizerStateCallback` logs, for any optimizer (or accelerate's wrapper of one). ``model``:
    where the warning about non-finite gradients finds the parameter's name."""
    nbytes = optimizer_state_bytes(optimizer, unique=unique)
    nparams = optimizer_param_count(optimizer)
    release = uses_gradient_release(optimizer)
    kept, local_params = kept_bytes(optimizer, nbytes, release)
    placement = optimizer_state_placement(optimizer)
    out = {
        "optimizer_state_mib": nbytes / MIB,
        "optimizer_state_bytes_per_param": nbytes / nparams if nparams else 0.0,
        "optimizer_state_device_mib": placement["device"] / MIB,
        "optimizer_state_host_mib": placement["host"] / MIB,
        "state_offload": int(bool(getattr(unwrap_optimizer(optimizer), "state_offload", False))),
        "gradient_release": int(release),
        "kept_bytes_per_param": kept / local_params if local_params else 0.0,
    }
    report = getattr(unwrap_optimizer(optimizer), "nonfinite_report", None)
    if report is not None:
        out["nonfinite_skipped"] = report(None if model is None else lambda: _param_names(model))
    if peak_memory and torch.cuda.is_available() and torch.cuda.is_initialized():
        out["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated() / GIB
    return out


def _param_names(model) -> dict[int, str]:
    """``id(parameter) -> name`` over ``model.named_parameters()`` (a wrapper's prefixes kept)."""
    try:
        return {id(p): name for name, p in model.named_parameters()}
    except (AttributeError, TypeError, RuntimeError):
        return {}


def uses_gradient_release(optimizer) -> bool:
    """Whether ``optimizer`` (or the optimizer inside accelerate's wrapper) releases gradients in backward."""
    return bool(getattr(unwrap_optimizer(optimizer), "gradient_release", False))


def kept_bytes(optimizer, state_bytes: int, release: bool) -> tuple[int, int]:
    """``(P + G + S, N)`` of ``kept_bytes_per_param`` (see the module docstring), on this rank's shards."""
    opt = unwrap_optimizer(optimizer)
    seen: set[int] = set()
    total, count = state_bytes, 0
    for group in opt.param_groups:
        for p in group["params"]:
            if id(p) in seen:
                continue
            seen.add(id(p))
            local = p.to_local() if hasattr(p, "to_local") else p  # FSDP2 DTensor: this rank's shard
            count += local.numel()
            total += local.numel() * local.element_size()
            if p.requires_grad and not release:
                grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                total += local.numel() * (local.element_size() if grad is None else grad.element_size())
    return total, count


class OptimizerStateCallback(TrainerCallback):
    """Log optimizer-state MiB, state bytes and kept bytes per optimized parameter, whether gradients are released,
    ApexW's count of steps with skipped non-finite gradients, and peak GPU memory with every training log.

    Args:
        unique: count tensors shared between parameters' states once (actual memory) instead of once per reference
            (the accounting of the published ApexW / bitsandbytes table, the default).
        peak_memory: also log ``peak_gpu_memory_gib`` when CUDA is in use.

    Example:
        >>> from apexw_hf.integrations.callbacks import OptimizerStateCallback
        >>> trainer = Trainer(model, args, train_dataset=ds, callbacks=[OptimizerStateCallback()])  # doctest: +SKIP
        >>> trainer.train()  # doctest: +SKIP
        {'loss': 2.31, ..., 'optimizer_state_mib': 47.1, 'optimizer_state_bytes_per_param': 2.03,
        'gradient_release': 0, 'kept_bytes_per_param': 10.03}
    """

    run_first = True  # see the module docstring: must run before TensorBoard/W&B/console callbacks

    def __init__(self, unique: bool = False, peak_memory: bool = True):
        _install_run_first()
        self.unique = unique
        self.peak_memory = peak_memory

    def on_train_begin(self, args, state, control, optimizer=None, model=None, **kwargs):
        # ApexW's warning about a non-finite gradient, at the step it happens, then names the parameter as the model
        # does
        name = getattr(unwrap_optimizer(optimizer), "set_parameter_names", None) if optimizer is not None else None
        if name is not None and model is not None:
            name(model)

    def on_log(self, args, state, control, logs=None, optimizer=None, **kwargs):
        if logs is None or optimizer is None:
            return
        if logs and all(k.startswith(("eval_", "test_")) or k == "epoch" for k in logs):
            return  # evaluation metrics: the optimizer has not changed since the last training log
        values = optimizer_state_metrics(
            optimizer, unique=self.unique, peak_memory=self.peak_memory, model=kwargs.get("model")
        )
        if state.log_history:
            last = state.log_history[-1]
            same = last.get("step") == state.global_step and all(
                k in last and (last[k] is v or last[k] == v) for k, v in logs.items()
            )
            if same:
                last.update(values)
        logs.update(values)


def _install_run_first() -> None:
    """Make ``CallbackHandler.add_callback`` put callbacks with ``run_first = True`` before all others (idempotent)."""
    handler_cls = _trainer_callback.CallbackHandler
    add_callback = handler_cls.add_callback
    fn = add_callback
    while fn is not None:  # ours may have been wrapped by someone else since
        if getattr(fn, "_apexw_wrapped", False):
            return
        fn = getattr(fn, "__wrapped__", None)

    def add_callback_(self, callback):
        add_callback(self, callback)
        cb = self.callbacks[-1] if self.callbacks else None
        if cb is not None and getattr(cb, "run_first", False) is True:
            self.callbacks.insert(0, self.callbacks.pop())

    add_callback_._apexw_wrapped = True
    add_callback_.__wrapped__ = add_callback
    add_callback_.__doc__ = add_callback.__doc__
    handler_cls.add_callback = add_callback_


_install_run_first()
