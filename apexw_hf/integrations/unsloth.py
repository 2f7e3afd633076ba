"""Keep ``optim="apexw_8bit"`` (and every other ApexW name) intact under Unsloth's CPU mode.

When ``import unsloth`` finds no accelerator it installs CPU training defaults
(``unsloth_zoo.cpu.trainer.install_cpu_training_defaults``): ``TrainingArguments.__post_init__`` and the TRL
configs' ``__post_init__`` then call ``normalize_cpu_training_arguments``, which replaces every ``optim`` whose name
contains "8bit", "paged", "bnb", "npu" or "xla" with ``adamw_torch_fused`` (bitsandbytes has no CPU kernels). The
substring test also catches ``apexw_8bit``, which does run on the CPU (ApexW's plain-PyTorch engine), so the run
would silently train with torch AdamW instead. ``apexw_4bit`` and ``apexw_compact`` pass that test in Unsloth
2026.10, but a test widened to bitsandbytes' 4-bit names would catch ``apexw_4bit`` the same way.

:func:`patch_unsloth_cpu` wraps that function so every ApexW name (``APEXW_OPTIMIZERS``) passes through unchanged
(every other CPU default still applies). It runs automatically right after ``unsloth_zoo.cpu.trainer`` is imported (see
:mod:`apexw_hf.integrations`). If a future Unsloth moves the rewrite elsewhere, :func:`check_unsloth_cpu` fails
loudly instead of letting the optimizer be swapped: it is called after the patch, and it warns at import with a
``RuntimeWarning``; call it yourself to get the ``RuntimeError``.

Unsloth patches transformers and TRL globally, so tests of this module run in a subprocess.
"""

from __future__ import annotations

import sys
import types
import warnings

from .transformers import APEXW_OPTIMIZERS

__all__ = ["patch_unsloth_cpu", "check_unsloth_cpu"]

CPU_TRAINER_MODULE = "unsloth_zoo.cpu.trainer"
_FUNCTION = "normalize_cpu_training_arguments"
_NEUTRAL_OPTIM = "sgd"  # a name Unsloth's CPU normaliser neither rewrites nor comments on


def _optim_value(optim) -> str:
    return str(getattr(optim, "value", optim))


def patch_unsloth_cpu(module: types.ModuleType | None = None) -> bool:
    """Make Unsloth's CPU-mode argument normalisation keep ApexW optim names (idempotent).

    Args:
        module: ``unsloth_zoo.cpu.trainer``; by default taken from ``sys.modules``.

    Returns:
        ``True`` if the CPU normaliser is (now) wrapped, ``False`` if Unsloth's CPU mode is not loaded.

    Raises:
        RuntimeError: the CPU trainer module is loaded but has no ``normalize_cpu_training_arguments`` (an Unsloth
            version this code does not know; the ApexW names could be rewritten).
    """
    if module is None:
        module = sys.modules.get(CPU_TRAINER_MODULE)
        if module is None:
            return False
    original = getattr(module, _FUNCTION, None)
    if original is None:
        raise RuntimeError(
            f"apexw_hf: {module.__name__} has no {_FUNCTION}(); this Unsloth version's CPU mode may replace "
            "optim='apexw_8bit' with 'adamw_torch_fused'. Pass the optimizer explicitly with "
            "Trainer(optimizer_cls_and_kwargs=(apexw_hf.ApexW8bit, {...})) and please report this."
        )
    if getattr(original, "_apexw_wrapped", False):
        return True

    def normalize_cpu_training_arguments(args, *a, **kw):
        optim = getattr(args, "optim", None)
        if _optim_value(optim) not in APEXW_OPTIMIZERS:
            return original(args, *a, **kw)
        # ApexW runs on the CPU (its plain-PyTorch engine); the rewrite is meant for bitsandbytes' GPU-only
        # optimizers. Show Unsloth a name it leaves alone (so it neither rewrites nor prints "needs a GPU"), apply
        # every other CPU default, then put the ApexW name back.
        args.optim = _NEUTRAL_OPTIM
        try:
            return original(args, *a, **kw)
        finally:
            args.optim = optim

    normalize_cpu_training_arguments._apexw_wrapped = True
    normalize_cpu_training_arguments.__wrapped__ = original
    normalize_cpu_training_arguments.__doc__ = original.__doc__
    setattr(module, _FUNCTION, normalize_cpu_training_arguments)
    package = sys.modules.get(module.__name__.rpartition(".")[0])
    if package is not None and getattr(package, _FUNCTION, None) is original:
        setattr(package, _FUNCTION, normalize_cpu_training_arguments)
    return True


def check_unsloth_cpu() -> None:
    """Raise ``RuntimeError`` if Unsloth's CPU mode, as loaded in this process, would rewrite an ApexW name."""
    module = sys.modules.get(CPU_TRAINER_MODULE)
    if module is None:
        return
    patch_unsloth_cpu(module)
    for name in APEXW_OPTIMIZERS:
        probe = types.SimpleNamespace(optim=name, fp16=False, bf16=False)
        getattr(module, _FUNCTION)(probe)
        if _optim_value(probe.optim) != name:
            raise RuntimeError(
                f"apexw_hf: Unsloth's CPU mode still rewrites optim={name!r} to {_optim_value(probe.optim)!r}. "
                "Pass the optimizer explicitly with Trainer(optimizer_cls_and_kwargs=(apexw_hf.ApexW8bit, {...})) "
                "and please report this."
            )


def on_cpu_trainer_imported(module: types.ModuleType) -> None:
    """Import hook for ``unsloth_zoo.cpu.trainer``: patch, verify, and warn loudly if that fails."""
    try:
        patch_unsloth_cpu(module)
        check_unsloth_cpu()
    except RuntimeError as exc:
        warnings.warn(str(exc), RuntimeWarning, stacklevel=2)
