"""Hugging Face / TRL / Unsloth integration: optim names, the optimizer-state callback, Unsloth's CPU mode.

``import apexw_hf`` calls :func:`register`, which makes ``optim="apexw_8bit"``, ``"apexw_4bit"`` and
``"apexw_compact"`` valid everywhere transformers reads ``optim``, without importing transformers itself (that import
takes seconds):

* if transformers' modules are already imported, they are patched at once;
* otherwise a ``sys.meta_path`` finder waits for ``transformers.training_args`` (and ``trainer_optimizer`` /
  ``trainer``) to be imported and patches each right after its code has run, before the importer sees it;
* it wraps ``Trainer.create_optimizer``, so that ``optimizer_cls_and_kwargs=(ApexW8bit, {"weight_decay": ...})``
  keeps that weight decay (:func:`apexw_hf.integrations.transformers.explicit_weight_decay`);
* it wraps two methods of ``accelerate.Accelerator`` for optimizers with gradient release
  (:mod:`apexw_hf.integrations.accelerate`: the pre-clip ``grad_norm``, refusals before the first update);
* the same finder patches Unsloth's CPU mode (``unsloth_zoo.cpu.trainer``), which would otherwise rewrite
  ``optim="apexw_8bit"`` to ``adamw_torch_fused`` (see :mod:`apexw_hf.integrations.unsloth`).

Nothing here imports transformers, TRL, PEFT or Unsloth at module level, so the optimizers work with torch alone.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
import warnings

__all__ = ["register", "OptimizerStateCallback"]

_TRAINING_ARGS = "transformers.training_args"
_TRAINER_OPTIMIZER = "transformers.trainer_optimizer"
_TRAINER = "transformers.trainer"
_lock = threading.RLock()


def _on_training_args(module) -> None:
    from .transformers import register_optimizer_names

    register_optimizer_names(module)


def _on_trainer_optimizer(module) -> None:
    from .transformers import register_optimizer_handler

    register_optimizer_handler(trainer_optimizer_module=module)


def _on_trainer(module) -> None:
    from .transformers import patch_create_optimizer, register_optimizer_handler

    register_optimizer_handler(trainer_optimizer_module=sys.modules.get(_TRAINER_OPTIMIZER), trainer_module=module)
    patch_create_optimizer(module)


def _on_accelerator(module) -> None:
    from .accelerate import patch_accelerator

    patch_accelerator(module)


def _on_unsloth_cpu_trainer(module) -> None:
    from .unsloth import on_cpu_trainer_imported

    on_cpu_trainer_imported(module)


_UNSLOTH_CPU_TRAINER = "unsloth_zoo.cpu.trainer"
_ACCELERATOR = "accelerate.accelerator"
_HOOKS = {
    _TRAINING_ARGS: _on_training_args,
    _TRAINER_OPTIMIZER: _on_trainer_optimizer,
    _TRAINER: _on_trainer,
    _UNSLOTH_CPU_TRAINER: _on_unsloth_cpu_trainer,
    _ACCELERATOR: _on_accelerator,
}


def _run_hook(name: str, module) -> None:
    try:
        _HOOKS[name](module)
    except Exception as exc:  # never break `import transformers`; say loudly what did not happen
        if name == _ACCELERATOR:
            warnings.warn(
                f"apexw_hf could not wrap accelerate.Accelerator ({type(exc).__name__}: {exc}); ApexW with gradient "
                "release under Accelerate or the Trainer will log grad_norm 0 and is not checked for fp16, gradient "
                "accumulation or DDP. Please report this.",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        warnings.warn(
            f"apexw_hf could not register its optimizer names with {name} ({type(exc).__name__}: {exc}); "
            "optim='apexw_8bit'/'apexw_4bit'/'apexw_compact' will not be accepted. Use "
            "Trainer(optimizer_cls_and_kwargs=(apexw_hf.ApexW8bit, {...})) instead, and please report this.",
            RuntimeWarning,
            stacklevel=2,
        )


class _PostImportLoader(importlib.abc.Loader):
    """Wraps a module's loader: runs the original ``exec_module``, then the apexw_hf hook for that module."""

    def __init__(self, loader, name: str):
        self._loader = loader
        self._name = name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _run_hook(self._name, module)

    def __getattr__(self, attr):  # get_source, is_package, get_resource_reader, ...: the original loader's
        return getattr(self._loader, attr)


class _TransformersImportHook(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for the watched transformers modules it asks the other finders and wraps the loader."""

    def __init__(self):
        self._busy = threading.local()

    def find_spec(self, fullname, path, target=None):
        if fullname not in _HOOKS or getattr(self._busy, "on", False):
            return None
        self._busy.on = True
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._busy.on = False
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _PostImportLoader(spec.loader, fullname)
        return spec


def _loaded(name: str):
    """The module if it is imported and has finished executing, else None."""
    module = sys.modules.get(name)
    if module is None:
        return None
    spec = getattr(module, "__spec__", None)
    if spec is not None and getattr(spec, "_initializing", False):
        return None
    return module


def _hook_installed() -> bool:
    return any(isinstance(f, _TransformersImportHook) for f in sys.meta_path)


def register(*, eager: bool = False) -> None:
    """Make the ApexW optim names known to transformers in this process (idempotent).

    Args:
        eager: import transformers now and register at once (raises if that fails). By default, modules already
            imported are patched now and the rest right after they are imported.
    """
    with _lock:
        if eager:
            from .transformers import register as register_now

            register_now()
            return
        pending = False
        for name in _HOOKS:
            module = _loaded(name)
            if module is not None:
                _run_hook(name, module)
            else:
                pending = True
        if pending and not _hook_installed():
            sys.meta_path.insert(0, _TransformersImportHook())


def __getattr__(name):
    if name == "OptimizerStateCallback":
        from .callbacks import OptimizerStateCallback

        return OptimizerStateCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
