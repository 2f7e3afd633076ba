"""Optimizer-state byte accounting that is the same for every optimizer (torch, bitsandbytes, torchao, ApexW).

The number is the sum of ``numel * element_size`` over every tensor held in ``optimizer.state``: moments, scales,
quantization maps and step counters alike. It is the accounting of the published ApexW / bitsandbytes comparison
(185.50 MiB for ``torch.optim.AdamW`` and 47.87 MiB for bitsandbytes 0.50.2 on 24.3M LoRA parameters), so numbers
logged here can be compared with that table. Tensor subclasses (torchao's quantized states, ``DTensor`` shards)
are measured through ``__tensor_flatten__``, i.e. by the bytes of the plain tensors they are made of, not by the
dtype they pretend to have.

By default a tensor referenced from several state entries is counted once per reference (bitsandbytes keeps one
256-entry quantization map per optimizer but references it from every parameter's state; the published numbers
count it each time). ``unique=True`` counts each distinct piece of memory once instead, which is what the
allocator actually holds.

This module imports only torch.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

__all__ = ["optimizer_state_bytes", "optimizer_state_placement", "optimizer_param_count", "unwrap_optimizer"]

_MAX_UNWRAP = 8


def unwrap_optimizer(optimizer):
    """Return the real optimizer inside wrappers such as accelerate's ``AcceleratedOptimizer``.

    Wrappers that keep the wrapped optimizer in ``.optimizer`` (accelerate, Unsloth, Lightning) are peeled off
    until an object without a nested optimizer remains.
    """
    opt = optimizer
    for _ in range(_MAX_UNWRAP):
        inner = getattr(opt, "optimizer", None)
        if inner is None or inner is opt:
            break
        opt = inner
    if not hasattr(opt, "state") or not hasattr(opt, "param_groups"):
        raise TypeError(
            f"{type(optimizer).__name__} is not an optimizer: it has no 'state' and 'param_groups' "
            "(expected a torch.optim.Optimizer or a wrapper with the optimizer in '.optimizer')"
        )
    return opt


def _plain_tensors(obj, depth: int = 0) -> Iterator[torch.Tensor]:
    """Yield the plain tensors inside ``obj`` (nested dicts, lists, tuples and tensor subclasses)."""
    if depth > 16:
        return
    if isinstance(obj, torch.Tensor):
        flatten = getattr(type(obj), "__tensor_flatten__", None)
        if type(obj) is not torch.Tensor and type(obj) is not torch.nn.Parameter and flatten is not None:
            names, _ = obj.__tensor_flatten__()
            for name in names:
                yield from _plain_tensors(getattr(obj, name), depth + 1)
        else:
            yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _plain_tensors(value, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _plain_tensors(value, depth + 1)


def optimizer_state_bytes(optimizer, *, unique: bool = False) -> int:
    """Exact bytes of every tensor held in ``optimizer.state``, for any optimizer.

    Args:
        optimizer: a ``torch.optim.Optimizer`` (torch, bitsandbytes, torchao, ApexW, ...) or a wrapper that keeps
            it in ``.optimizer`` (accelerate's ``AcceleratedOptimizer``, which the Trainer's callbacks receive).
        unique: count every distinct piece of memory once (tensors referenced from several parameters' state,
            such as bitsandbytes' quantization maps, are then counted once) instead of once per reference.

    Returns:
        The number of bytes, an ``int``.

    Example:
        >>> import torch
        >>> from apexw_hf import optimizer_state_bytes
        >>> p = torch.nn.Parameter(torch.zeros(10))
        >>> opt = torch.optim.AdamW([p]); p.grad = torch.ones(10); opt.step()
        >>> optimizer_state_bytes(opt)  # exp_avg + exp_avg_sq (2 x 40 bytes) + the fp32 step counter (4 bytes)
        84
    """
    opt = unwrap_optimizer(optimizer)
    total = 0
    seen: set[tuple] = set()
    for t in _plain_tensors(list(opt.state.values())):
        nbytes = t.numel() * t.element_size()
        if unique:
            if t.device.type == "meta" or nbytes == 0:
                key = ("id", id(t))
            else:
                key = (t.device, t.data_ptr(), nbytes)
            if key in seen:
                continue
            seen.add(key)
        total += nbytes
    return total


def optimizer_state_placement(optimizer) -> dict[str, int]:
    """Where the optimizer state lives: ``{"host": bytes, "device": bytes}``.

    ``host`` is the bytes of the tensors in ``optimizer.state`` that sit in CPU memory (pinned or not), ``device``
    those on an accelerator plus, for an optimizer that streams host state through device buffers (ApexW with
    ``state_offload=True``), those buffers (its ``staging_bytes()``). Each tensor is counted once per reference, as
    :func:`optimizer_state_bytes` counts by default, so ``host + device`` is that number plus the buffers.
    """
    opt = unwrap_optimizer(optimizer)
    out = {"host": 0, "device": 0}
    for t in _plain_tensors(list(opt.state.values())):
        out["host" if t.device.type == "cpu" else "device"] += t.numel() * t.element_size()
    staging = getattr(opt, "staging_bytes", None)
    if callable(staging):
        out["device"] += int(staging())
    return out


def optimizer_param_count(optimizer) -> int:
    """Number of elements of the distinct parameters an optimizer updates (its param groups)."""
    opt = unwrap_optimizer(optimizer)
    seen: set[int] = set()
    total = 0
    for group in opt.param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
    return total
