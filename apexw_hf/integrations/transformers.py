"""``optim="apexw_8bit"`` / ``"apexw_4bit"`` / ``"apexw_compact"`` for ``transformers.TrainingArguments`` and more.

transformers has no public registry of optimizer names: ``TrainingArguments.__post_init__`` turns ``optim`` into the
closed enum ``OptimizerNames`` (an unknown string fails there, before any Trainer exists), ``HfArgumentParser`` takes
its ``--optim`` choices from that enum when a parser is built, and the Trainer resolves a name to a class through
``transformers.trainer_optimizer._OPTIMIZER_HANDLERS`` (transformers >= 5.2) or the ``if``/``elif`` chain of
``Trainer.get_optimizer_cls_and_kwargs`` (older releases). :func:`register` therefore

1. adds the members ``APEXW_8BIT = "apexw_8bit"``, ``APEXW_4BIT = "apexw_4bit"`` and
   ``APEXW_COMPACT = "apexw_compact"`` to ``OptimizerNames`` (so TRL's ``SFTConfig``, Unsloth's
   ``UnslothTrainingArguments``, JSON/YAML configs, ``--optim`` and a pickled ``training_args.bin`` accept them), and
   makes the enum's error for a misspelled ``apexw`` name list the valid ones;
2. validates ``optim_args`` and rejects a DeepSpeed config that brings its own optimizer in
   ``TrainingArguments.__post_init__``, i.e. when the arguments are built, not minutes later in ``train()``;
3. adds a handler to ``_OPTIMIZER_HANDLERS`` or, before 5.2, wraps ``Trainer.get_optimizer_cls_and_kwargs``.

4. wraps ``Trainer.create_optimizer`` so that ``optimizer_cls_and_kwargs=(ApexW8bit, {"weight_decay": ...})`` keeps
   that weight decay (the Trainer would put ``TrainingArguments.weight_decay`` into its param groups over it), or
   refuses a conflicting non-zero ``TrainingArguments.weight_decay``: see :func:`explicit_weight_decay`.

Every step is idempotent (markers live on the transformers objects themselves, so a re-imported ``apexw_hf`` does
not wrap twice). Users who prefer no patching of the optimizer names can pass
``optimizer_cls_and_kwargs=(ApexW8bit, {...})`` to the Trainer; see ``docs/integration.md``.
"""

from __future__ import annotations

import difflib
import enum
import json
import os
from typing import Any

__all__ = [
    "APEXW_OPTIMIZERS",
    "OPTIM_ARGS",
    "parse_optim_args",
    "get_optimizer_cls_and_kwargs",
    "check_model_for_training_args",
    "check_gradient_release_args",
    "uses_gradient_release",
    "register",
    "register_optimizer_names",
    "register_optimizer_handler",
    "patch_create_optimizer",
    "explicit_weight_decay",
]

# optim name -> (OptimizerNames member name, state_format). "fp32" state gets no name of its own: it is the
# reference format for A/B tests, reachable as optim_args="state_format=fp32", and plain AdamW has names already.
# The "_release" names turn on gradient release (each parameter updated inside backward, its gradient freed: see
# apexw_hf.optim.release), the same as optim_args="gradient_release=true". The "_offload" names turn on gradient
# release, state offload (the state in host memory, streamed through the GPU: apexw_hf.optim.offload) and the tied
# weights' gradient offload (apexw_hf.optim.tied_offload; a no-op for a model without tied weights), the same as
# optim_args="gradient_release=true,state_offload=true,tied_grad_offload=true" (optim_args may set it false).
APEXW_OPTIMIZERS: dict[str, tuple[str, str]] = {
    "apexw_8bit": ("APEXW_8BIT", "8bit"),
    "apexw_compact": ("APEXW_COMPACT", "compact"),
    "apexw_4bit": ("APEXW_4BIT", "4bit"),
    "apexw_8bit_release": ("APEXW_8BIT_RELEASE", "8bit"),
    "apexw_compact_release": ("APEXW_COMPACT_RELEASE", "compact"),
    "apexw_4bit_release": ("APEXW_4BIT_RELEASE", "4bit"),
    "apexw_8bit_offload": ("APEXW_8BIT_OFFLOAD", "8bit"),
    "apexw_compact_offload": ("APEXW_COMPACT_OFFLOAD", "compact"),
    "apexw_4bit_offload": ("APEXW_4BIT_OFFLOAD", "4bit"),
}
RELEASE_SUFFIX = "_release"
OFFLOAD_SUFFIX = "_offload"
_RELEASE_SUFFIXES = (RELEASE_SUFFIX, OFFLOAD_SUFFIX)  # the names that turn gradient release on

_STATE_FORMATS = ("compact", "8bit", "4bit", "fp32")
_ENGINES = ("auto", "triton", "torch")
_PARAM_ROUNDINGS = ("stochastic", "nearest")
_NONFINITE = ("skip", "raise")
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")

# optim_args key -> help text (allowed values). Hyperparameters that TrainingArguments already owns are refused
# with a pointer to their field, so there is one place for each setting.
# (state_format overrides the format the optim name selects; seed seeds the stochastic-rounding streams.)
OPTIM_ARGS: dict[str, str] = {
    "state_format": "compact|8bit|4bit|fp32",
    "seed": "<int in [0, 2**32)>",
    "engine": "auto|triton|torch",
    "param_rounding": "stochastic|nearest",
    "maximize": "true|false",
    "gradient_release": "true|false",
    "release_bucket_size": "<int >= 1, gradient elements per launch>",
    "tied_grad_offload": "true|false",
    "state_offload": "true|false",
    "offload_piece_mib": "<int >= 1, MiB of state per launch with state_offload>",
    "nonfinite": "skip|raise",
}
_OWNED_BY_TRAINING_ARGS = {
    "lr": "learning_rate",
    "learning_rate": "learning_rate",
    "betas": "adam_beta1 / adam_beta2",
    "beta1": "adam_beta1",
    "beta2": "adam_beta2",
    "eps": "adam_epsilon",
    "weight_decay": "weight_decay",
}


def _is_apexw(optim: Any) -> bool:
    return isinstance(optim, str) and str(getattr(optim, "value", optim)) in APEXW_OPTIMIZERS


def _name_of(optim: Any) -> str:
    return str(getattr(optim, "value", optim))


def _convert(key: str, raw: str) -> Any:
    low = raw.strip().lower()
    if key in ("state_format", "engine", "param_rounding", "nonfinite"):
        allowed = {
            "state_format": _STATE_FORMATS,
            "engine": _ENGINES,
            "param_rounding": _PARAM_ROUNDINGS,
            "nonfinite": _NONFINITE,
        }[key]
        if low not in allowed:
            raise ValueError(f"optim_args: {key}={raw!r} is not allowed; {key} must be one of {', '.join(allowed)}")
        return low
    if key == "seed":
        try:
            seed = int(low, 0)
        except ValueError:
            seed = -1
        if not 0 <= seed < 2**32:
            raise ValueError(f"optim_args: seed={raw!r} is not allowed; seed must be an int in [0, 2**32)")
        return seed
    if key in ("maximize", "gradient_release", "tied_grad_offload", "state_offload"):
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ValueError(f"optim_args: {key}={raw!r} is not allowed; {key} must be true or false")
    if key in ("release_bucket_size", "offload_piece_mib"):
        try:
            size = int(low, 0)
        except ValueError:
            size = 0
        if size < 1:
            raise ValueError(f"optim_args: {key}={raw!r} is not allowed; it must be an int >= 1")
        return size
    raise AssertionError(key)


def parse_optim_args(optim_args: str | dict | None, optim: str = "apexw_8bit") -> dict[str, Any]:
    """Parse and validate ``optim_args`` for an ApexW optim name.

    Args:
        optim_args: ``"key=value,key=value"`` (the ``TrainingArguments.optim_args`` format), a dict, or ``None``.
        optim: the optim name, for error messages.

    Returns:
        Keyword arguments for the ApexW constructor, with typed values.

    Raises:
        ValueError: naming the malformed item or the unknown key, and listing the allowed keys and values.

    Example:
        >>> parse_optim_args("engine=torch, seed=3")
        {'engine': 'torch', 'seed': 3}
    """
    allowed = ", ".join(f"{k}={v}" for k, v in OPTIM_ARGS.items())
    if optim_args is None or optim_args == "":
        return {}
    if isinstance(optim_args, dict):
        items = [(str(k), str(v)) for k, v in optim_args.items()]
    elif isinstance(optim_args, str):
        items = []
        for item in optim_args.split(","):
            if not item.strip():
                continue
            if item.count("=") != 1 or not item.split("=")[0].strip():
                raise ValueError(
                    f"optim_args for optim={optim!r}: cannot parse {item.strip()!r}; expected 'key=value' items "
                    f"separated by commas, e.g. 'engine=torch,seed=1'. Allowed keys: {allowed}"
                )
            key, value = item.split("=")
            items.append((key.strip(), value.strip()))
    else:
        raise TypeError(f"optim_args must be a 'key=value,...' string or a dict, got {type(optim_args).__name__}")
    out: dict[str, Any] = {}
    for key, value in items:
        if key in _OWNED_BY_TRAINING_ARGS:
            raise ValueError(
                f"optim_args for optim={optim!r}: {key!r} is set through TrainingArguments "
                f"({_OWNED_BY_TRAINING_ARGS[key]}), not optim_args. Allowed keys: {allowed}"
            )
        if key not in OPTIM_ARGS:
            close = difflib.get_close_matches(key, list(OPTIM_ARGS), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"optim_args for optim={optim!r}: unknown key {key!r}.{hint} Allowed keys: {allowed}")
        if key in out:
            raise ValueError(f"optim_args for optim={optim!r}: {key!r} is given twice")
        out[key] = _convert(key, value)
    return out


def _optimizer_class(name: str):
    from ..optim import ApexW4bit, ApexW8bit, ApexWCompact

    base = _base_name(name)
    return {"apexw_8bit": ApexW8bit, "apexw_compact": ApexWCompact, "apexw_4bit": ApexW4bit}[base]


def _base_name(name: str) -> str:
    """The optim name without its ``_release`` / ``_offload`` suffix."""
    return name.removesuffix(RELEASE_SUFFIX).removesuffix(OFFLOAD_SUFFIX)


def uses_gradient_release(args) -> bool:
    """Whether these ``TrainingArguments`` select ApexW with gradient release (a ``_release`` name or optim_args).

    Raises:
        ValueError: a ``_release`` name with ``optim_args`` ``gradient_release=false`` (the two contradict).
    """
    if not _is_apexw(args.optim):
        return False
    name = _name_of(args.optim)
    requested = parse_optim_args(args.optim_args, name).get("gradient_release")
    if name.endswith(_RELEASE_SUFFIXES) and requested is False:
        raise ValueError(
            f"optim={name!r} turns gradient release on, and optim_args sets gradient_release=false: use "
            f"{_without_release(name)} for the optimizer without release, or drop gradient_release from optim_args"
        )
    return name.endswith(_RELEASE_SUFFIXES) or bool(requested)


def _without_release(name: str) -> str:
    """How to turn release off for ``optim=name``: the name without ``_release``, or the optim_args item to drop."""
    if name.endswith(RELEASE_SUFFIX):
        return f"optim={name.removesuffix(RELEASE_SUFFIX)!r}"
    if name.endswith(OFFLOAD_SUFFIX):  # the state offload works without release too
        return f"optim={_base_name(name)!r} with optim_args='state_offload=true'"
    return "drop gradient_release=true from optim_args"


def check_gradient_release_args(args) -> None:
    """Refuse, with what to set instead, the Trainer settings that gradient release cannot honour."""
    if not uses_gradient_release(args):
        return
    name = _name_of(args.optim)
    if getattr(args, "gradient_accumulation_steps", 1) > 1:
        raise ValueError(
            f"optim={name!r} with gradient release cannot accumulate gradients "
            f"(gradient_accumulation_steps={args.gradient_accumulation_steps}): each parameter is updated as soon as "
            "its gradient is complete, in every backward pass. Set gradient_accumulation_steps=1 and raise "
            f"per_device_train_batch_size instead, or use the optimizer without release ({_without_release(name)})."
        )
    if getattr(args, "fp16", False):
        raise ValueError(
            f"optim={name!r} with gradient release cannot train with fp16=True: the GradScaler would need every "
            "gradient before the update (to unscale it and skip steps with inf/NaN), and release applies each one in "
            f"backward. Use bf16=True (Ampere or newer), or the optimizer without release ({_without_release(name)})."
        )
    if getattr(args, "deepspeed", None):
        raise ValueError(
            f"optim={name!r} with gradient release cannot run under DeepSpeed, which owns the gradients; use FSDP2 "
            f"(fsdp_version 2) or one GPU, or the optimizer without release ({_without_release(name)})."
        )
    fsdp_config = getattr(args, "fsdp_config", None)
    if getattr(args, "fsdp", None) and isinstance(fsdp_config, dict):
        version = fsdp_config.get("version", fsdp_config.get("fsdp_version"))
        if version is not None and str(version) != "2":
            raise ValueError(
                f"optim={name!r} with gradient release supports FSDP2 only, and fsdp_config sets version {version}: "
                "FSDP1 reduce-scatters flat parameters in its own post-backward hook, outside the per-parameter hooks "
                'that release uses. Set fsdp_config {"version": 2}, or use the optimizer without release '
                f"({_without_release(name)})."
            )


def check_model_for_training_args(args, model) -> None:
    """Raise a clear error for a model whose trainable parameters cannot train with these arguments.

    fp16 parameters with ``fp16=True``: the Trainer's GradScaler refuses fp16 gradients ("Attempting to unscale FP16
    gradients") at the first optimizer step, after the model has been loaded and the first batches computed. ApexW can
    update fp16 parameters, but fp16 training needs the scaler's loss scaling, so the fix is in the set-up: this error
    says which one to choose, before training starts.
    """
    if model is None or not getattr(args, "fp16", False):
        return
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    half = [p for p in params if p.dtype == torch.float16]
    if not half:
        return
    raise ValueError(
        f"optim={_name_of(args.optim)!r} with fp16=True: {len(half)} of the model's {len(params)} trainable parameter "
        "tensors are float16, and the Trainer's fp16 GradScaler refuses fp16 gradients. Choose one: (1) on a GPU "
        "without bf16 (e.g. a T4), load the model in float32 (dtype=torch.float32) and keep fp16=True: fp32 master "
        "weights with fp16 autocast, and ApexW's 8-bit state keeps the optimizer at ~2 bytes per parameter; (2) on a "
        "GPU with bf16 (Ampere or newer), load the model in bfloat16 and set bf16=True instead of fp16=True: the "
        "model trains in bf16 with stochastic rounding and no fp32 copy; (3) train LoRA adapters (fp32) on the fp16 "
        "model."
    )


def get_optimizer_cls_and_kwargs(args, model=None) -> tuple[type, dict[str, Any]]:
    """The ``(optimizer class, kwargs)`` pair the Trainer builds for an ApexW ``optim`` name.

    ``lr``, ``betas``, ``eps`` and ``weight_decay`` come from the ``TrainingArguments`` (the Trainer's param groups
    then set ``weight_decay=0`` for biases and norms, as for every optimizer); ``optim_args`` add the ApexW options.
    With ``model`` given, a set-up that cannot train is refused first (:func:`check_model_for_training_args`).
    """
    name = _name_of(args.optim)
    if name not in APEXW_OPTIMIZERS:
        raise ValueError(f"{name!r} is not an ApexW optim name; ApexW names: {', '.join(APEXW_OPTIMIZERS)}")
    check_model_for_training_args(args, model)
    kwargs: dict[str, Any] = {
        "lr": args.learning_rate,
        "betas": (args.adam_beta1, args.adam_beta2),
        "eps": args.adam_epsilon,
        "weight_decay": args.weight_decay,
        "state_format": APEXW_OPTIMIZERS[name][1],
    }
    kwargs.update(parse_optim_args(args.optim_args, name))
    if name.endswith(OFFLOAD_SUFFIX):
        if kwargs.get("state_offload") is False:
            raise ValueError(
                f"optim={name!r} turns state offload on, and optim_args sets state_offload=false: use "
                f"optim={_base_name(name) + RELEASE_SUFFIX!r} for gradient release without offload, or drop "
                "state_offload from optim_args"
            )
        kwargs["state_offload"] = True
        kwargs.setdefault("tied_grad_offload", True)  # what can wait in host memory does: the tied gradient part too
    if uses_gradient_release(args):
        kwargs["gradient_release"] = True
    if kwargs.get("gradient_release"):
        check_gradient_release_args(args)
        # The Trainer's clip_grad_norm_ finds no gradients after backward: the optimizer clips in backward instead
        # (and Accelerate's clip_grad_norm_ returns its pre-clip norm, which the Trainer logs as grad_norm).
        max_norm = getattr(args, "max_grad_norm", None)
        kwargs["max_grad_norm"] = float(max_norm) if max_norm and max_norm > 0 else None
    else:
        for key in ("release_bucket_size", "tied_grad_offload"):
            if kwargs.get(key):
                raise ValueError(
                    f"optim_args for optim={name!r}: {key} is for gradient release; add gradient_release=true or use "
                    f"optim={name + RELEASE_SUFFIX!r}"
                )
        kwargs.pop("tied_grad_offload", None)  # =false
    return _optimizer_class(name), kwargs


# ---- checks at TrainingArguments time ------------------------------------------------------------------------


def _deepspeed_optimizer(ds: Any) -> str | None:
    """The ``optimizer.type`` of a DeepSpeed config (dict, JSON string or path), or None if it has none."""
    if ds is None or ds == "":
        return None
    config = ds
    if not isinstance(ds, dict):
        cfg = getattr(ds, "config", None)  # an HfDeepSpeedConfig object
        if isinstance(cfg, dict):
            config = cfg
        elif isinstance(ds, str) and os.path.isfile(ds):
            with open(ds, encoding="utf-8") as f:
                config = json.load(f)
        elif isinstance(ds, str) and ds.lstrip().startswith("{"):
            config = json.loads(ds)
        else:
            return None  # let transformers report a config it cannot read
    opt = config.get("optimizer") if isinstance(config, dict) else None
    if not opt:
        return None
    return str(opt.get("type", "?")) if isinstance(opt, dict) else str(opt)


def check_training_args(args) -> None:
    """Raise a clear error for ApexW settings that cannot work; called from ``TrainingArguments.__post_init__``."""
    if not _is_apexw(args.optim):
        return
    name = _name_of(args.optim)
    parse_optim_args(args.optim_args, name)
    check_gradient_release_args(args)
    ds_type = _deepspeed_optimizer(getattr(args, "deepspeed", None))
    if ds_type is not None:
        raise ValueError(
            f"optim={name!r} cannot be used with this DeepSpeed config: it defines its own optimizer "
            f"(optimizer.type={ds_type!r}), and DeepSpeed then builds that optimizer and ignores `optim`. Remove the "
            "'optimizer' section from the DeepSpeed config so that the Trainer builds ApexW and hands it to DeepSpeed "
            "as a client optimizer (not tested by apexw_hf), or drop `optim` to use DeepSpeed's optimizer."
        )


# ---- registration --------------------------------------------------------------------------------------------


def _add_enum_member(cls: type[enum.Enum], name: str, value: str) -> None:
    """Add a member to an existing ``str`` Enum in place (what ``aenum.extend_enum`` does), Python 3.10-3.14."""
    if value in cls._value2member_map_:
        return
    member = str.__new__(cls, value)
    member._name_ = name
    member._value_ = value
    member.__objclass__ = cls
    member._sort_order_ = len(cls._member_names_)
    add = getattr(cls, "_add_member_", None)  # Python >= 3.13
    if add is not None:
        add(name, member)
    else:
        cls._member_names_.append(name)
        cls._member_map_[name] = member
        type.__setattr__(cls, name, member)
    if name not in cls._member_names_:
        cls._member_names_.append(name)
    cls._value2member_map_[value] = member


def _already_wrapped(fn) -> bool:
    """Whether apexw_hf's wrapper is anywhere in ``fn``'s ``__wrapped__`` chain (others may have wrapped ours)."""
    for _ in range(32):
        fn = getattr(fn, "__func__", fn)
        if fn is None:
            return False
        if getattr(fn, "_apexw_wrapped", False):
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def _make_missing(original):
    def _missing_(cls, value):
        if isinstance(value, str):
            close = difflib.get_close_matches(value.lower(), list(APEXW_OPTIMIZERS), n=1, cutoff=0.6)
            if close or value.lower().startswith(("apex", "apexw")):
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise ValueError(
                    f"{value!r} is not a valid {cls.__name__}.{hint} The ApexW optimizers registered by apexw_hf "
                    f"are: {', '.join(repr(n) for n in APEXW_OPTIMIZERS)}."
                )
        return original(cls, value)

    _missing_._apexw_original = original
    return classmethod(_missing_)


def register_optimizer_names(training_args_module=None) -> None:
    """Add the ApexW names to ``OptimizerNames`` and the ApexW checks to ``TrainingArguments.__post_init__``."""
    if training_args_module is None:
        import transformers.training_args as training_args_module
    OptimizerNames = training_args_module.OptimizerNames
    TrainingArguments = training_args_module.TrainingArguments
    for value, (member, _) in APEXW_OPTIMIZERS.items():
        _add_enum_member(OptimizerNames, member, value)
    if not getattr(OptimizerNames._missing_, "_apexw_original", None):
        type.__setattr__(OptimizerNames, "_missing_", _make_missing(OptimizerNames._missing_.__func__))

    post_init = TrainingArguments.__post_init__
    if not _already_wrapped(post_init):

        def __post_init__(self, *a, **kw):
            check_training_args(self)
            return post_init(self, *a, **kw)

        __post_init__._apexw_wrapped = True
        __post_init__.__wrapped__ = post_init
        __post_init__.__doc__ = post_init.__doc__
        TrainingArguments.__post_init__ = __post_init__


def _handler(ctx):
    """``_OPTIMIZER_HANDLERS`` entry (transformers >= 5.2)."""
    return get_optimizer_cls_and_kwargs(ctx.args, getattr(ctx, "model", None))


def register_optimizer_handler(trainer_optimizer_module=None, trainer_module=None) -> None:
    """Make the Trainer resolve the ApexW names: a handler (>= 5.2) or a wrapped ``get_optimizer_cls_and_kwargs``."""
    import transformers.training_args as training_args

    register_optimizer_names(training_args)
    handlers = None
    if trainer_optimizer_module is None and trainer_module is None:
        try:
            import transformers.trainer_optimizer as trainer_optimizer_module
        except ImportError:
            trainer_optimizer_module = None
    if trainer_optimizer_module is not None:
        handlers = getattr(trainer_optimizer_module, "_OPTIMIZER_HANDLERS", None)
    if isinstance(handlers, dict):
        for value in APEXW_OPTIMIZERS:
            handlers[training_args.OptimizerNames(value)] = _handler
        return
    if trainer_module is None:
        import transformers.trainer as trainer_module
    Trainer = trainer_module.Trainer
    original = Trainer.__dict__["get_optimizer_cls_and_kwargs"]
    if _already_wrapped(original):
        return
    original_fn = original.__func__ if isinstance(original, staticmethod) else original

    def get_optimizer_cls_and_kwargs_(args, model=None):
        if _is_apexw(args.optim):
            return get_optimizer_cls_and_kwargs(args, model)
        return original_fn(args, model)

    get_optimizer_cls_and_kwargs_._apexw_wrapped = True
    get_optimizer_cls_and_kwargs_.__wrapped__ = original_fn
    get_optimizer_cls_and_kwargs_.__doc__ = original_fn.__doc__
    Trainer.get_optimizer_cls_and_kwargs = staticmethod(get_optimizer_cls_and_kwargs_)


def explicit_weight_decay(args, optimizer_cls: type, optimizer_kwargs: dict[str, Any]) -> float | None:
    """The weight decay the Trainer's decay param group must get for ``optimizer_cls_and_kwargs``, or None.

    The Trainer builds two param groups, ``{"weight_decay": args.weight_decay}`` for weights and ``0.0`` for biases
    and norms, and passes them with the user's keyword arguments; a param group's value wins over a keyword, so a
    ``weight_decay`` given in ``optimizer_cls_and_kwargs`` would be replaced by ``TrainingArguments.weight_decay``
    (0.0 by default) without a word. For an ApexW class the keyword wins instead (biases and norms keep 0.0, as for
    every optimizer in the Trainer); ``lr``, ``betas`` and ``eps`` need nothing, the Trainer sets no group value for
    them.

    Returns:
        The keyword's weight decay, or None when there is nothing to change (not ApexW, no ``weight_decay`` keyword,
        or the same value in both places).

    Raises:
        ValueError: ``TrainingArguments.weight_decay`` is non-zero (so set on purpose) and differs from the keyword.
    """
    from ..optim import ApexW

    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, ApexW)):
        return None
    if "weight_decay" not in optimizer_kwargs:
        return None
    wd, from_args = optimizer_kwargs["weight_decay"], getattr(args, "weight_decay", 0.0)
    if wd == from_args:
        return None
    if from_args:
        raise ValueError(
            f"weight_decay is set twice, to different values: optimizer_cls_and_kwargs=({optimizer_cls.__name__}, "
            f"{{'weight_decay': {wd!r}, ...}}) and TrainingArguments(weight_decay={from_args!r}). Give it in one "
            "place (the Trainer's decay param group takes TrainingArguments.weight_decay; apexw_hf makes the "
            "optimizer keyword win when TrainingArguments.weight_decay is left at 0.0)"
        )
    return wd


def patch_create_optimizer(trainer_module=None) -> None:
    """Wrap ``Trainer.create_optimizer`` so that an ApexW ``optimizer_cls_and_kwargs`` keeps its ``weight_decay``."""
    if trainer_module is None:
        import transformers.trainer as trainer_module
    Trainer = trainer_module.Trainer
    original = Trainer.__dict__.get("create_optimizer")
    if original is None or _already_wrapped(original):
        return

    def create_optimizer(self, *a, **kw):
        pair = getattr(self, "optimizer_cls_and_kwargs", None)
        if getattr(self, "optimizer", None) is not None or not pair:
            return original(self, *a, **kw)
        wd = explicit_weight_decay(self.args, pair[0], pair[1])
        if wd is None:
            return original(self, *a, **kw)
        # the Trainer reads args.weight_decay for its decay group while it builds the optimizer, and nowhere else
        saved = self.args.weight_decay
        self.args.weight_decay = wd
        try:
            return original(self, *a, **kw)
        finally:
            self.args.weight_decay = saved

    create_optimizer._apexw_wrapped = True
    create_optimizer.__wrapped__ = original
    create_optimizer.__doc__ = original.__doc__
    Trainer.create_optimizer = create_optimizer


def register() -> None:
    """Register the ApexW optim names with transformers now (imports transformers; idempotent)."""
    import transformers.training_args as training_args

    register_optimizer_names(training_args)
    register_optimizer_handler()
    patch_create_optimizer()


def is_registered() -> bool:
    """Whether ``OptimizerNames`` knows the ApexW names in this process (does not import transformers)."""
    import sys

    mod = sys.modules.get("transformers.training_args")
    if mod is None:
        return False
    return all(v in mod.OptimizerNames._value2member_map_ for v in APEXW_OPTIMIZERS)
