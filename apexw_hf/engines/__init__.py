"""The engines that compute ApexW's update, behind the one interface that :class:`~apexw_hf.optim.ApexW` calls.

An engine steps one param group's parameters (or a gradient-release bucket of them) in place, bit for bit as
:mod:`apexw_hf.reference` specifies. It is given everything it needs as arguments and holds no reference to the
optimizer::

    engine = engine_for(optimizer, group, params)   # chosen by group["engine"] and the parameters' device
    engine.check(group, params, grads)              # before the caller creates missing state
    engine.step_group(group, params, grads, states, tensor_indices, bucket=None, grad_scale=None, stager=None,
                      nonfinite=None)
    engine.invalidate()                              # after load_state_dict or any replacement of state tensors

The engines, each created lazily, once per optimizer, and kept on it (``optimizer._engine``,
``optimizer._cpu_engine``; :attr:`ApexW.engine_stats` tells which ran):

- ``triton/``: :class:`~apexw_hf.engines.triton.engine.TritonEngine`, one kernel launch per (param group, param
  dtype, grad dtype), and its Triton kernels (``triton/kernels/``: the update kernel, the launch table, quantization
  and rounding helpers). Needs triton; CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``.
- ``torch.py``: :class:`~apexw_hf.engines.torch.TorchEngine`, plain PyTorch on any device, a param group in
  cache-sized chunks; the elementwise passes over one chunk are in ``torch_passes.py``.
- ``numba.py``: the fused CPU loop that ``torch.py`` sends 8-bit and 4-bit chunks to when numba is installed.

``engine="auto"`` takes the Triton engine for CUDA parameters when it can run there, and the torch engine otherwise,
saying once why when triton is missing or the interpreter is selected; ``"triton"`` and ``"torch"`` force one.

This module imports nothing but the standard library at load time: importing the optimizer does not import triton
or numba, and no engine imports the optimizer (``tests/test_imports.py`` checks the layers and circles). It
binds no global named ``torch`` or ``triton`` either: those names are this package's submodules once imported.
"""

from __future__ import annotations

import warnings
from typing import Any, Protocol


class NonfiniteCounters(Protocol):
    """The counters an engine adds the blocks it skipped for non-finite gradients to (``step_group(nonfinite=...)``;
    the optimizer's are :class:`apexw_hf.optim.nonfinite.NonfiniteGuard`, whose module describes the layout).

    The Triton kernel counts on the device itself, into ``counts(device)`` with ``serial``; the torch engine counts
    on the host and hands its counts to ``add``.
    """

    serial: int  # the number of the step in progress: the kernel swaps it into ``counts(device)[0]``

    def counts(self, device: Any) -> Any:
        """The int32 counters on ``device``: ``[0]`` the last step that skipped a block, ``[1]`` the steps that
        skipped any, ``[2 + i]`` the blocks skipped of the tensor of index ``i`` (at least ``3 +`` the largest tensor
        index given to the engine elements)."""

    def add(self, device: Any, skipped: dict[int, int]) -> None:
        """Add ``skipped`` (tensor index -> blocks skipped in this step) to the counters on ``device``, counting the
        step once."""


class Engine(Protocol):
    """What :class:`~apexw_hf.optim.ApexW` calls on an engine: the contract every engine keeps.

    ``tests/engines/test_contract.py`` checks each point below once for every engine (the torch engine with and
    without its numba path, the Triton engine) and every state format, through ``ApexW(..., engine=...)`` and by
    calling the engines directly.

    An engine is created without the optimizer (``TritonEngine()``, ``TorchEngine()``) and calls nothing on it:
    what it needs comes as arguments (the state dicts, the tensor indices, the non-finite counters). It keeps caches
    of its own, keyed by ``(id(group), bucket)``.
    """

    def check(self, group: dict, params: list, grads: list) -> None:
        """Raise the errors of :meth:`step_group` that its arguments ``group``, ``params`` and ``grads`` alone decide,
        changing nothing. ``ApexW`` calls it before it creates the missing state of ``params`` (for a ``(group,
        bucket)`` and parameter list it has not handed to the engine before), so a bad gradient creates no state.

        Raises: what :meth:`step_group` lists under Raises.
        """

    def step_group(
        self,
        group: dict,
        params: list,
        grads: list,
        states: list,
        tensor_indices: list,
        bucket: object = None,
        grad_scale: object = None,
        stager: object = None,
        nonfinite: NonfiniteCounters | None = None,
    ) -> None:
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
            states: the state dicts of ``params``, in the same order, created by the caller (in the group's format:
                :func:`apexw_hf.formats.init_state`, or host copies with ``stager``); the engine updates their tensors
                in place. The torch engine reads them at every call (and notices replaced step counters and moments
                by identity); the Triton engine only when it (re)builds a launch plan: it keeps the plan's state
                addresses until :meth:`invalidate`, so its per-step host time does not grow with the list. Passing
                the very list object of an earlier call again says that ``params`` are that call's tensors in the
                same order (``ApexW`` reuses its lists only then): the Triton engine then skips its own identity
                pass over ``params``, the largest per-tensor cost of a step of hundreds of small tensors.
            tensor_indices: the parameters' indices for the random streams (ints, in the same order; ``ApexW``
                numbers the parameters of its param groups in order). Two parameters with the same index and the
                same shape get the same random bits; the non-finite counts go to these indices. Read when a plan is
                built, like ``states``.
            bucket: a hashable name of this subset of the group: ``None`` for :meth:`ApexW.step`, the bucket's key for
                gradient release, which steps a group bucket by bucket. Each ``(group, bucket)`` keeps its own cached
                plan (chunk plan, launch plan), so a call covers exactly its tensors.
            grad_scale: ``None``; a 1-element fp32 tensor ``c``: every gradient ``g`` is used as
                ``g * c.to(g.dtype)`` (the product rounded to the gradient's dtype, as ``g.mul_(c.to(g.dtype))``
                computes it); or a callable that returns such a tensor or None, called exactly once per call (when
                ``params`` is not empty), after the checks, before any parameter is updated, with the Triton
                engine's launch plans once they hold this step's gradient addresses (gradient release reads its
                bucket's norm through their address tables) and with ``None`` on the torch engine. A callable lets
                the caller compute the factor from the gradients where the engine has them in hand, without knowing
                which engine runs. The Triton kernel multiplies each gradient as it loads it (no pass of its own, the
                gradients unchanged); the torch engine, which has no such load, multiplies ``grads`` in place (a
                copy would hold a second set of gradients). A non-finite factor makes every block non-finite: nothing
                is updated, and every block is counted.
            stager: state offload: the state lives in host memory and is staged on the device per launch;
                ``stager(plan, params, index)`` of each launch plan (its params in plan order, its index in the
                bucket) yields ``(programs, state table)`` (``TritonEngine.step_group``). Only the Triton engine can
                stage; the torch engine raises ValueError for one.
            nonfinite: the counters of skipped non-finite blocks (:class:`NonfiniteCounters`), or None: then they are
                not counted anywhere the caller can read (the Triton kernel counts into a buffer of its plan).

        Effects, for each parameter ``p`` in ``params`` and nothing else:

        - ``state["step"]`` goes up by exactly 1 (a parameter of the group not in ``params`` keeps its count, its
          parameter and its state; params of one call may be at different counts). ``state["step"]`` stays a 0-dim
          fp32 CPU tensor, but both engines replace it by a view into one buffer per cached plan, so that one add
          moves them all; the torch engine may also replace the moments of small tensors by views of a packed buffer
          (same values).
        - ``p``, the moments and their scales are updated in place: the result is bit-identical to
          ``reference.adamw_step_ref_(p, g, state, fmt=group["state_format"], scalars=StepScalars.make(step=t,
          **step_hparams(group)), seed=group["seed"], tensor_index=i, step=t, maximize=group["maximize"],
          param_rounding=group["param_rounding"])`` with ``t`` the new step count, ``i`` the tensor index given and
          ``g`` the gradient times ``grad_scale`` as above, except for the sign and payload bits of NaNs (IEEE leaves
          them to the hardware).
        - Non-finite gradients (:func:`apexw_hf.reference.nonfinite_blocks`): every 256-element block of the
          flattened gradient that holds a NaN or an infinity keeps its parameter elements, moments and scales; the
          rest of the tensor is updated and the step counter still moves. The skipped blocks are counted in
          ``nonfinite`` (which :attr:`ApexW.nonfinite_skipped` reads).

        Raises (before any parameter, state tensor or step counter changes; :meth:`check` raises the same before any
        state is created):
            RuntimeError: a sparse gradient ("ApexW does not support sparse gradients"), both engines. The Triton
                engine also raises it for parameters it cannot run on (CPU parameters without the Triton
                interpreter, CUDA parameters under it).
            ValueError: a gradient whose shape is not its parameter's, both engines; the Triton engine also for a
                gradient on another device or not contiguous. A tensor hyperparameter of more than one element
                (``step_hparams``). A ``stager`` on the torch engine.
            TypeError: a hyperparameter that is not a number (``step_hparams``); the Triton engine also for a
                gradient dtype other than fp32, bf16 or fp16.
        """

    def invalidate(self) -> None:
        """Forget whatever was cached about the state tensors: the chunk plans (the torch engine) or launch plans
        with their state addresses (the Triton engine), all keyed by ``(id(group), bucket)``.

        To be called whenever state tensors are replaced rather than updated in place: ``ApexW.load_state_dict``
        does, after the new state is in place. The next ``step_group`` rebuilds its plans from the ``states`` it is
        given, and keeps the step counts it finds there: the next step is the one an unbroken run would take. Without
        it the Triton engine would keep stepping the old tensors' memory; the torch engine notices replaced step
        counters, moments and parameter memory by identity and rebuilds its plan anyway, so there it only frees the
        old plans.
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

        optimizer._engine = TritonEngine()
    return optimizer._engine


def torch_engine(optimizer) -> Engine:
    """``optimizer``'s plain-PyTorch engine."""
    if optimizer._cpu_engine is None:
        from .torch import TorchEngine

        optimizer._cpu_engine = TorchEngine()
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


__all__ = ["Engine", "NonfiniteCounters", "engine_for", "engines_of", "torch_engine", "triton_engine", "uses_triton"]
