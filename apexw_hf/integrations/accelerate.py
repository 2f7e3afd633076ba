"""Accelerate (and so the Trainer, TRL and Unsloth) with an ApexW that releases gradients in backward.

With ``gradient_release=True`` the gradients are gone when a training loop reaches ``clip_grad_norm_``: the
optimizer has clipped and applied each one in backward (:mod:`apexw_hf.optim.release`). Two methods of
``accelerate.Accelerator`` are wrapped so that loops written for ordinary optimizers stay right:

* ``clip_grad_norm_`` returns the optimizer's pre-clip global gradient norm (the Trainer logs it as ``grad_norm``,
  instead of the 0 of an empty gradient list), and refuses a ``max_norm`` the optimizer was not built with (the loop
  would believe it clipped at a norm that nobody applied);
* ``backward`` refuses, before the first update, what release cannot do: a GradScaler (fp16), gradient accumulation,
  DDP, FSDP version 1 and DeepSpeed; re-hooks the parameters (Accelerate's FSDP2 preparation replaces them in
  ``param_groups``); and after a backward pass that raised (out of memory, say: a notebook re-running
  ``trainer.train()``), gives up its unfinished step with a warning, as ``optimizer.zero_grad()`` would.

Loops whose Accelerator has no releasing ApexW go straight to the original methods.
"""

from __future__ import annotations

import functools
import math
import warnings

__all__ = ["patch_accelerator", "releasing_optimizers"]


def releasing_optimizers(accelerator) -> list:
    """The ApexW optimizers with gradient release among those prepared by ``accelerator``."""
    from ..optim import ApexW

    out = []
    for wrapped in getattr(accelerator, "_optimizers", ()):
        opt = getattr(wrapped, "optimizer", wrapped)
        if isinstance(opt, ApexW) and opt.gradient_release:
            out.append(opt)
    return out


def _check_backward(accelerator, optimizers) -> None:
    from accelerate.utils import DistributedType

    if getattr(accelerator, "scaler", None) is not None:
        raise RuntimeError(
            "ApexW with gradient release cannot train under fp16 mixed precision: the GradScaler would need every "
            "gradient before the update, and release applies each one in backward. Use mixed_precision='bf16' "
            "(TrainingArguments(bf16=True)), or turn gradient release off."
        )
    if getattr(accelerator, "gradient_accumulation_steps", 1) > 1:
        raise RuntimeError(
            f"ApexW with gradient release cannot accumulate gradients (gradient_accumulation_steps="
            f"{accelerator.gradient_accumulation_steps}): set it to 1 and use a larger batch, or turn release off."
        )
    kind = accelerator.distributed_type
    if kind not in (DistributedType.NO, DistributedType.FSDP):
        raise RuntimeError(
            f"ApexW with gradient release supports one process or FSDP2, not {kind.value}: under DDP the hooks would "
            "apply each rank's gradient before the all-reduce, and DeepSpeed owns the gradients. Use FSDP2 "
            "(fsdp_version: 2), or turn gradient release off."
        )
    if kind == DistributedType.FSDP and not getattr(accelerator, "is_fsdp2", False):
        raise RuntimeError(
            "ApexW with gradient release supports FSDP2 only, not FSDP version 1: FSDP1 reduce-scatters flat "
            "parameters in its own post-backward hook, so a per-parameter release hook would see an unreduced "
            "gradient (flat parameters) or none at all (use_orig_params), and the clipping norm would be this rank's. "
            'Set fsdp_version: 2 (TrainingArguments fsdp_config {"version": 2}), or turn gradient release off.'
        )
    for opt in optimizers:
        opt._release.sync_hooks()
        if opt._release.give_up_failed_backward():
            warnings.warn(
                "ApexW gradient release: the previous backward pass raised before it finished (out of memory, say); "
                "its unfinished step is given up (the tensors it had updated keep their update) and this backward "
                "pass starts a new step.",
                stacklevel=3,
            )


def patch_accelerator(module=None) -> None:
    """Wrap ``Accelerator.backward`` and ``Accelerator.clip_grad_norm_`` (idempotent)."""
    if module is None:
        import accelerate.accelerator as module
    cls = module.Accelerator
    if getattr(cls.backward, "_apexw_wrapped", False):
        return
    backward, clip = cls.backward, cls.clip_grad_norm_

    @functools.wraps(backward)
    def backward_(self, loss, **kwargs):
        optimizers = releasing_optimizers(self)
        if optimizers:
            _check_backward(self, optimizers)
            for opt in optimizers:
                opt.before_backward(loss, list(getattr(self, "_models", ())))  # tied_grad_offload's graph search
        return backward(self, loss, **kwargs)

    @functools.wraps(clip)
    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        optimizers = releasing_optimizers(self)
        if not optimizers:
            return clip(self, parameters, max_norm, norm_type)
        opt = optimizers[0]
        if float(norm_type) != 2.0:
            raise ValueError(
                f"clip_grad_norm_(norm_type={norm_type}) with an ApexW that releases gradients: it records the L2 "
                "norm only; use norm_type=2"
            )
        max_norm = float(max_norm)
        if not math.isinf(max_norm) and (opt._release.max_grad_norm is None or opt._release.max_grad_norm != max_norm):
            raise ValueError(
                f"clip_grad_norm_(max_norm={max_norm}) after backward with an ApexW that releases gradients: the "
                "gradients were applied and freed in backward, clipped at the optimizer's max_grad_norm="
                f"{opt._release.max_grad_norm}. Build the optimizer with max_grad_norm={max_norm} (the Trainer does "
                "this from TrainingArguments.max_grad_norm)."
            )
        # this step's norm (a backward pass that reached no parameter has none: zero, not the last step's)
        return opt._release.step_norm()

    backward_._apexw_wrapped = True
    clip_grad_norm_._apexw_wrapped = True
    cls.backward = backward_
    cls.clip_grad_norm_ = clip_grad_norm_
