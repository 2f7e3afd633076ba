"""The engines that compute ApexW's update, behind the one interface that :class:`~apexw_hf.optim.ApexW` calls.

An engine steps one param group's parameters (or a gradient-release bucket of them) in place, bit for bit as
:mod:`apexw_hf.reference` specifies::

    engine = engine_for(optimizer, group, params)   # chosen by group["engine"] and the parameters' device
    engine.step_group(group, params, grads, bucket=None)
    engine.invalidate()                              # after load_state_dict or any replacement of state tensors

The engines, each created lazily, once per optimizer, and kept on it (``optimizer._engine``,
``optimizer._cpu_engine``, which the recipe's reports read):

- ``triton/``: :class:`~apexw_hf.engines.triton.engine.TritonEngine`, one kernel launch per (param group, param
  dtype, grad dtype), and its Triton kernels (``triton/kernels/``: the update kernel, the launch table, quantization
  and rounding helpers). Needs triton; CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``.
- ``torch.py``: :class:`~apexw_hf.engines.torch.TorchEngine`, plain PyTorch on any device, a param group in
  cache-sized chunks; the elementwise passes over one chunk are in ``torch_passes.py``.
- ``numba.py``: the fused CPU loop that ``torch.py`` sends 8-bit and 4-bit chunks to when numba is installed.

``engine="auto"`` takes the Triton engine for CUDA parameters when it can run there, and the torch engine otherwise,
saying once why when triton is missing or the interpreter is selected; ``"triton"`` and ``"torch"`` force one.

This module imports nothing but the standard library at load time: importing the optimizer does not import triton
or numba, and importing an engine does not import the optimizer (``tests/test_imports.py`` checks for circles). It
binds no global named ``torch`` or ``triton`` either: those names are this package's submodules once imported.
"""

from __future__ import annotations

import warnings
from typing import Protocol


class Engine(Protocol):
    """What :class:`~apexw_hf.optim.ApexW` calls on an engine."""

    def step_group(self, group: dict, params: list, grads: list, bucket: object = None) -> None:
        """Update ``params`` (all of ``group``'s, or one gradient-release ``bucket`` of them) with ``grads``."""

    def invalidate(self) -> None:
        """Forget whatever was cached about the state tensors (they were replaced, e.g. by ``load_state_dict``)."""


def engine_for(optimizer, group: dict, params: list) -> Engine:
    """The engine that steps ``params`` of ``group`` for ``optimizer`` (created on first use and kept on it)."""
    if uses_triton(group["engine"], params):
        return triton_engine(optimizer)
    return torch_engine(optimizer)


def engines_of(optimizer) -> list[Engine]:
    """The engines ``optimizer`` has created so far."""
    return [e for e in (getattr(optimizer, "_engine", None), getattr(optimizer, "_cpu_engine", None)) if e is not None]


def triton_engine(optimizer) -> Engine:
    """``optimizer``'s Triton engine."""
    if optimizer._engine is None:
        from .triton import TritonEngine

        optimizer._engine = TritonEngine(optimizer)
    return optimizer._engine


def torch_engine(optimizer) -> Engine:
    """``optimizer``'s plain-PyTorch engine."""
    if optimizer._cpu_engine is None:
        from .torch import TorchEngine

        optimizer._cpu_engine = TorchEngine(optimizer)
    return optimizer._cpu_engine


def uses_triton(engine: str, params: list) -> bool:
    """Whether a group with ``engine`` ("auto", "triton" or "torch") and these parameters goes to the Triton engine."""
    if engine == "torch" or not params:
        return False
    if engine == "auto":
        return _auto_uses_triton(params[0].is_cuda)
    return True  # "triton": the engine raises a clear error if it cannot run


_TRITON_OK: bool | None = None
_WARNED_NO_TRITON = False
_WARNED_INTERPRETER = False


def _auto_uses_triton(on_cuda: bool) -> bool:
    """engine="auto": the kernels for CUDA parameters; says so once when triton is missing there, or when the Triton
    interpreter is selected (it runs kernels on CPU tensors only)."""
    global _WARNED_NO_TRITON, _WARNED_INTERPRETER
    if not on_cuda:
        return False
    if _triton_available():
        from .triton.kernels import INTERPRETED

        if not INTERPRETED:
            return True
        if not _WARNED_INTERPRETER:
            _WARNED_INTERPRETER = True
            warnings.warn(
                "ApexW: TRITON_INTERPRET=1 is set, and the Triton interpreter cannot run kernels on CUDA tensors, "
                "so CUDA parameters go to the plain-PyTorch path (the same results, many times slower). Unset "
                "TRITON_INTERPRET before apexw_hf is imported to use the kernels.",
                RuntimeWarning,
                stacklevel=5,
            )
        return False
    if not _WARNED_NO_TRITON:
        _WARNED_NO_TRITON = True
        warnings.warn(
            "ApexW: triton is not installed, so CUDA parameters go to the plain-PyTorch path, which is many times "
            "slower than the Triton kernels. Install triton (pip install 'apexw_hf[triton]'), or pass "
            "engine='torch' to choose this path explicitly.",
            RuntimeWarning,
            stacklevel=5,
        )
    return False


def _triton_available() -> bool:
    global _TRITON_OK
    if _TRITON_OK is None:
        try:
            import triton  # noqa: F401  (absolute: the installed package, not this package's triton/)

            _TRITON_OK = True
        except ImportError:
            _TRITON_OK = False
    return _TRITON_OK


__all__ = ["Engine", "engine_for", "engines_of", "torch_engine", "triton_engine", "uses_triton"]
