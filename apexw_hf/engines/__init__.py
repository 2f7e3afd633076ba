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
    """What :class:`~apexw_hf.optim.ApexW` calls on an engine: the contract every engine keeps.

    ``tests/engines/test_contract.py`` checks each point below once for every engine (the torch engine with and
    without its numba path, the Triton engine) and every state format, through ``ApexW(..., engine=...)``.

    An engine is created once per optimizer and keeps a reference to it. From the optimizer it uses ``state`` (the
    per-parameter state dicts), ``_init_state(p, group)`` (a missing state in the group's format:
    :func:`apexw_hf.formats.init_state`, or state offload's host copy), ``_tensor_index(p)`` (the parameter's index
    for the random streams) and ``_nonfinite`` (the counters of skipped non-finite blocks, when present).
    """

    def step_group(self, group: dict, params: list, grads: list, bucket: object = None) -> None:
        """Apply one AdamW step to ``params`` of ``group``, in place, bit for bit as :mod:`apexw_hf.reference`.

        Args:
            group: the param group. Read: ``"lr"``, ``"betas"``, ``"eps"``, ``"weight_decay"`` (through
                :func:`apexw_hf.hparams.step_hparams`, at every call: floats or 0-dim tensors a scheduler may change),
                ``"state_format"``, ``"seed"``, ``"maximize"``, ``"param_rounding"``; the Triton engine also reads
                ``"params"`` (the order of its cached launch plans). Nothing is written to it.
            params: the parameters to step: those of ``group`` whose gradient is not None (or of one ``bucket`` of
                them), in group order, all on one device (``ApexW`` splits a group that spans devices, one bucket
                ``(bucket, device)`` each). Empty: nothing happens.
            grads: their gradients, in the same order (the caller has read ``p.grad`` already; the engine does not
                read ``.grad``). Dense, shaped like their parameter. The torch engine checks only these two; the
                Triton engine also needs fp32, bf16 or fp16 gradients, contiguous, on the parameter's device.
            bucket: a hashable name of this subset of the group: ``None`` for :meth:`ApexW.step`, the bucket's key for
                gradient release, which steps a group bucket by bucket. Each ``(group, bucket)`` keeps its own cached
                plan (chunk plan, launch plan), so a call covers exactly its tensors.

        Keyword arguments of the Triton engine only (``TritonEngine.step_group``; ``TorchEngine.step_group`` does not
        accept them, and ``ApexW`` passes them to the Triton engine alone):

        - ``before_launch(plans)``: called once the launch plans hold this step's gradient addresses, before the
          launches; returns None or a 1-element fp32 tensor that the kernel multiplies each gradient by first
          (gradient release computes its bucket's norm there and returns the clip coefficient; on the torch engine
          gradient release scales the gradients itself before the call).
        - ``stager(plan, params, index)``: state offload; the state lives on the host and is staged on the device per
          launch (state offload needs the Triton engine).

        Effects, for each parameter ``p`` in ``params`` and nothing else:

        - ``state = optimizer.state[p]`` is created if missing (``optimizer._init_state``), and ``state["step"]``
          goes up by exactly 1 (a parameter of the group not in ``params`` keeps its count, its parameter and its
          state; params of one call may be at different counts). ``state["step"]`` stays a 0-dim fp32 CPU tensor,
          but both engines replace it by a view into one buffer per cached plan, so that one add moves them all;
          the torch engine may also replace the moments of small tensors by views of a packed buffer (same values).
        - ``p``, the moments and their scales are updated in place: the result is bit-identical to
          ``reference.adamw_step_ref_(p, g, state, fmt=group["state_format"], scalars=StepScalars.make(step=t,
          **step_hparams(group)), seed=group["seed"], tensor_index=optimizer._tensor_index(p), step=t,
          maximize=group["maximize"], param_rounding=group["param_rounding"])`` with ``t`` the new step count, except
          for the sign and payload bits of NaNs (IEEE leaves them to the hardware).
        - Non-finite gradients (:func:`apexw_hf.reference.nonfinite_blocks`): every 256-element block of the
          flattened gradient that holds a NaN or an infinity keeps its parameter elements, moments and scales; the
          rest of the tensor is updated and the step counter still moves. The skipped blocks are added to
          ``optimizer._nonfinite`` (which :attr:`ApexW.nonfinite_skipped` reads); on the Triton engine a
          non-finite ``before_launch`` coefficient skips every block.

        Raises (before any parameter, state tensor or step counter changes, and before any state is created):
            RuntimeError: a sparse gradient ("ApexW does not support sparse gradients"), both engines. The Triton
                engine also raises it for parameters it cannot run on (CPU parameters without the Triton
                interpreter, CUDA parameters under it).
            ValueError: a gradient whose shape is not its parameter's, both engines; the Triton engine also for a
                gradient on another device or not contiguous. A tensor hyperparameter of more than one element
                (``step_hparams``).
            TypeError: a hyperparameter that is not a number (``step_hparams``); the Triton engine also for a
                gradient dtype other than fp32, bf16 or fp16.
        """

    def invalidate(self) -> None:
        """Forget whatever was cached about the state tensors: the chunk plans (the torch engine) or launch plans
        with their state addresses (the Triton engine), all keyed by ``(id(group), bucket)``.

        To be called whenever state tensors are replaced rather than updated in place: ``ApexW.load_state_dict``
        does, after the new state is in place. The next ``step_group`` rebuilds its plans from ``optimizer.state``,
        and keeps the step counts it finds there: the next step is the one an unbroken run would take. Without it the
        Triton engine would keep stepping the old tensors' memory; the torch engine notices replaced step counters,
        moments and parameter memory by identity and rebuilds its plan anyway, so there it only frees the old plans.
        """


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
