"""``OptimizerStateCallback``: optimizer-state memory (and peak GPU memory) in every training log.

Values (added to the Trainer's training logs):

* ``optimizer_state_mib``: bytes of every tensor in ``optimizer.state`` / 2**20
  (:func:`apexw_hf.accounting.optimizer_state_bytes`, the same accounting for torch, bitsandbytes, torchao and ApexW);
* ``optimizer_state_bytes_per_param``: the same bytes / the number of elements of the parameters being optimized;
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

from ..accounting import optimizer_param_count, optimizer_state_bytes

__all__ = ["OptimizerStateCallback", "optimizer_state_metrics"]

MIB = 2**20
GIB = 2**30


def optimizer_state_metrics(optimizer, *, unique: bool = False, peak_memory: bool = True) -> dict[str, float]:
    """The values :class:`OptimizerStateCallback` logs, for any optimizer (or accelerate's wrapper of one)."""
    nbytes = optimizer_state_bytes(optimizer, unique=unique)
    nparams = optimizer_param_count(optimizer)
    out = {
        "optimizer_state_mib": nbytes / MIB,
        "optimizer_state_bytes_per_param": nbytes / nparams if nparams else 0.0,
    }
    if peak_memory and torch.cuda.is_available() and torch.cuda.is_initialized():
        out["peak_gpu_memory_gib"] = torch.cuda.max_memory_allocated() / GIB
    return out


class OptimizerStateCallback(TrainerCallback):
    """Log optimizer-state MiB, state bytes per optimized parameter and peak GPU memory with every training log.

    Args:
        unique: count tensors shared between parameters' states once (actual memory) instead of once per reference
            (the accounting of the published ApexW / bitsandbytes table, the default).
        peak_memory: also log ``peak_gpu_memory_gib`` when CUDA is in use.

    Example:
        >>> from apexw_hf.integrations.callbacks import OptimizerStateCallback
        >>> trainer = Trainer(model, args, train_dataset=ds, callbacks=[OptimizerStateCallback()])  # doctest: +SKIP
        >>> trainer.train()  # doctest: +SKIP
        {'loss': 2.31, ..., 'optimizer_state_mib': 47.1, 'optimizer_state_bytes_per_param': 2.03}
    """

    run_first = True  # see the module docstring: must run before TensorBoard/W&B/console callbacks

    def __init__(self, unique: bool = False, peak_memory: bool = True):
        _install_run_first()
        self.unique = unique
        self.peak_memory = peak_memory

    def on_log(self, args, state, control, logs=None, optimizer=None, **kwargs):
        if logs is None or optimizer is None:
            return
        if logs and all(k.startswith(("eval_", "test_")) or k == "epoch" for k in logs):
            return  # evaluation metrics: the optimizer has not changed since the last training log
        values = optimizer_state_metrics(optimizer, unique=self.unique, peak_memory=self.peak_memory)
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
