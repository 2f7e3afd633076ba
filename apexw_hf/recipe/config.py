"""One YAML file describes a whole fine-tune and comparison: model, LoRA, data, trainer arguments, grid.

``load_config`` reads a file (or a config shipped in ``apexw_hf/configs/`` by name), checks every key and value, and
returns a :class:`RecipeConfig` of plain dataclasses. Unknown keys are errors, so a typo cannot silently fall back
to a default. ``apply_overrides`` takes ``section.key=value`` strings (the command line's ``--set``).

Example::

    from apexw_hf.recipe.config import load_config
    cfg = load_config("offline_default")          # the embedded default
    cfg = load_config("configs/llama32_3b_t4.yaml")
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = [
    "ModelConfig",
    "LoraSettings",
    "DataConfig",
    "TrainConfig",
    "CompareConfig",
    "RecipeConfig",
    "load_config",
    "config_from_dict",
    "apply_overrides",
    "DEFAULT_CONFIG",
    "KNOWN_OPTIMIZERS",
    "PARAM_DTYPES",
    "split_optimizer_spec",
    "check_optim_name",
    "optimizer_label",
]

DEFAULT_CONFIG = "offline_default"
# Optimizer names the runner knows how to report on; any other `optim` string Trainer accepts also runs.
KNOWN_OPTIMIZERS = {
    "adamw_torch": "torch AdamW",
    "adamw_torch_fused": "torch AdamW (fused)",
    "adamw_8bit": "bitsandbytes 8-bit AdamW",
    "apexw_compact": "ApexW Compact",
    "apexw_8bit": "ApexW 8bit",
    "apexw_4bit": "ApexW 4bit",
}
_PRECISIONS = ("auto", "fp32", "fp16", "bf16")
_FINETUNING = ("lora", "full")
# dtype the trainable parameters are stored (and updated) in. fp32 with a bf16/fp16 `precision` is mixed precision:
# fp32 master weights, computation under autocast. bf16 is the model itself in bf16, no fp32 copy anywhere.
PARAM_DTYPES = ("fp32", "bf16")
_FP16_PARAMS = (
    "fp16 parameters cannot be trained with the Trainer's fp16 mixed precision (its GradScaler refuses fp16 "
    "gradients) and fp16 has too little range to train without it. Use bf16 parameters on a GPU with bf16 "
    "(Ampere or newer: `@bf16`), or keep fp32 parameters with fp16 autocast on a GPU without bf16 such as the T4 "
    "(`@fp32`, train.precision: fp16), or train LoRA adapters"
)


def split_optimizer_spec(spec: str) -> tuple[str, str | None]:
    """``"apexw_8bit@bf16"`` -> ``("apexw_8bit", "bf16")``; a name without ``@`` -> ``(name, None)``.

    The part after ``@`` is the dtype the trainable parameters are kept in for that run (see :data:`PARAM_DTYPES`);
    without it the run uses ``train.param_dtype``.
    """
    if not isinstance(spec, str) or not spec:
        raise TypeError(
            f"an optimizer must be a non-empty string such as 'apexw_8bit' or 'apexw_8bit@bf16', got {spec!r}"
        )
    name, sep, dtype = spec.partition("@")
    if not sep:
        return spec, None
    if dtype == "fp16":
        raise ValueError(f"optimizer {spec!r}: {_FP16_PARAMS}")
    if not name or dtype not in PARAM_DTYPES:
        raise ValueError(
            f"optimizer {spec!r}: expected NAME@DTYPE with DTYPE one of {', '.join(PARAM_DTYPES)} (e.g. "
            "'apexw_8bit@bf16'), or a plain optim name"
        )
    return name, dtype


def check_optim_name(name: str, where: str) -> None:
    """Raise ``ValueError`` for an ``apexw...`` name that apexw_hf does not register, naming the ones it does.

    Other names go to the Trainer unchecked (any ``optim`` it accepts runs); a misspelled ApexW name would otherwise
    fail only when its run starts, as an unknown Trainer optimizer.
    """
    from ..integrations.transformers import APEXW_OPTIMIZERS

    if not name.lower().startswith("apex") or name in APEXW_OPTIMIZERS:
        return
    close = difflib.get_close_matches(name.lower(), list(APEXW_OPTIMIZERS), n=1, cutoff=0.6)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(
        f"{where}: {name!r} is not an ApexW optimizer.{hint} The ApexW names are: "
        f"{', '.join(map(repr, APEXW_OPTIMIZERS))}"
    )


def optimizer_label(spec: str) -> str:
    """Readable label of an optimizer spec: ``"apexw_8bit@bf16"`` -> ``"ApexW 8bit, bf16 params"``."""
    name, dtype = split_optimizer_spec(spec)
    label = KNOWN_OPTIMIZERS.get(name, name)
    return label if dtype is None else f"{label}, {dtype} params"


_BACKENDS = ("auto", "unsloth", "transformers")
_SOURCES = ("auto", "hub", "shipped")
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class ModelConfig:
    """Which base model to fine-tune.

    Either ``name_or_path`` (a hub id or local directory) or ``build`` (a ``LlamaConfig`` dict: random weights made
    once with ``init_seed`` and saved under the output directory, so every run of a grid starts from the same base).
    """

    name_or_path: str | None = None
    build: dict[str, Any] | None = None
    init_seed: int = 0
    build_dtype: str = "float32"  # dtype the built weights are saved in
    load_in_4bit: bool = False
    max_seq_length: int = 2048
    tokenizer: str | None = None  # hub id/dir; None = the model's own, or (with `build`) one trained on the data
    tokenizer_vocab_size: int = 1024  # size of the BPE vocabulary trained in-process when a tokenizer is built
    gradient_checkpointing: bool | str = False  # "unsloth" selects Unsloth's offloaded checkpointing

    def validate(self) -> None:
        if (self.name_or_path is None) == (self.build is None):
            raise ValueError("model: give exactly one of `name_or_path` (hub id or local dir) or `build` (a config)")
        if self.build is not None and not isinstance(self.build, dict):
            raise TypeError(f"model.build must be a mapping of LlamaConfig fields, got {type(self.build).__name__}")
        if self.build_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"model.build_dtype={self.build_dtype!r}; allowed: float32, bfloat16, float16")
        if self.max_seq_length < 8:
            raise ValueError(f"model.max_seq_length={self.max_seq_length} is too small (need >= 8)")


@dataclass
class LoraSettings:
    """LoRA adapter settings (PEFT ``LoraConfig`` / Unsloth ``get_peft_model``)."""

    r: int = 16
    alpha: int = 16
    dropout: float = 0.0
    bias: str = "none"
    target_modules: list[str] = field(default_factory=lambda: list(_PROJECTIONS))

    def validate(self) -> None:
        if self.r <= 0 or self.alpha <= 0:
            raise ValueError(f"lora: r={self.r} and alpha={self.alpha} must be positive")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout={self.dropout} must be in [0, 1)")
        if self.bias not in ("none", "all", "lora_only"):
            raise ValueError(f"lora.bias={self.bias!r}; allowed: none, all, lora_only")
        if not self.target_modules:
            raise ValueError("lora.target_modules is empty")


@dataclass
class DataConfig:
    """Training data.

    ``source``: ``hub`` loads ``hub_dataset`` with `datasets` (FineTome-100k or alpaca-cleaned formats), ``shipped``
    uses ``apexw_hf/data/offline_*.jsonl``, ``auto`` tries the hub and falls back to the shipped set when offline
    (and says so). ``num_samples`` training samples are taken after a seeded shuffle; ``validation_samples`` are
    held out (the hub sets have no validation split, so they are cut from the rest of the shuffled set).
    """

    source: str = "auto"
    hub_dataset: str = "mlabonne/FineTome-100k"
    hub_split: str = "train"
    num_samples: int = 1000
    validation_samples: int = 200
    shuffle_seed: int = 3407
    train_on_responses_only: bool = True
    pad_to_multiple_of: int = 0  # > 0: pad batches to a multiple of this (fewer shapes for torch.compile)

    def validate(self) -> None:
        if self.pad_to_multiple_of < 0:
            raise ValueError(f"data.pad_to_multiple_of={self.pad_to_multiple_of} must be >= 0")
        if self.source not in _SOURCES:
            raise ValueError(f"data.source={self.source!r}; allowed: {', '.join(_SOURCES)}")
        if self.num_samples <= 0:
            raise ValueError(f"data.num_samples={self.num_samples} must be positive")
        if self.validation_samples < 0:
            raise ValueError(f"data.validation_samples={self.validation_samples} must be >= 0")


@dataclass
class TrainConfig:
    """Trainer arguments of one run (the grid varies ``optim``, ``learning_rate`` and ``seed``)."""

    backend: str = "auto"  # auto: Unsloth when it is installed and a CUDA GPU is present, else transformers + PEFT
    finetuning: str = "lora"  # "lora": adapters on a frozen base; "full": every parameter of the model trains
    # dtype of the trainable parameters: "auto" = fp32 (LoRA adapters, and full fine-tunes with fp32 master weights);
    # "bf16" = the model itself in bf16 (full fine-tuning only). A grid cell `optim@dtype` overrides it per run.
    param_dtype: str = "auto"
    optim: str = "adamw_8bit"
    learning_rate: float = 2e-4
    seed: int = 3407
    num_train_epochs: float = 2.0
    max_steps: int = -1  # > 0 overrides the epochs
    per_device_train_batch_size: int = 2
    gradient_accumulation_steps: int = 4
    per_device_eval_batch_size: int = 8
    warmup_steps: int = 5
    weight_decay: float = 0.001
    lr_scheduler_type: str = "linear"
    max_grad_norm: float = 1.0
    # Liger-Kernel's fused linear cross-entropy (TrainingArguments.use_liger_kernel; pip install liger-kernel, GPU):
    # the logits are never materialized, the peak of large-vocabulary full fine-tunes
    use_liger_kernel: bool = False
    # TrainingArguments(optim_args=...) ("" = none); compare.optim_args sets it per grid cell
    optim_args: str = ""
    precision: str = "auto"  # auto: bf16 where supported, else fp16 on CUDA, fp32 on the CPU
    logging_steps: int = 1
    final_loss_window: int = 10  # "final train loss" = mean of the last this many logged losses
    torch_threads: int = 0  # 0: leave torch's default

    def validate(self) -> None:
        if self.backend not in _BACKENDS:
            raise ValueError(f"train.backend={self.backend!r}; allowed: {', '.join(_BACKENDS)}")
        if self.precision not in _PRECISIONS:
            raise ValueError(f"train.precision={self.precision!r}; allowed: {', '.join(_PRECISIONS)}")
        if self.finetuning not in _FINETUNING:
            raise ValueError(f"train.finetuning={self.finetuning!r}; allowed: {', '.join(_FINETUNING)}")
        if self.param_dtype == "fp16":
            raise ValueError(f"train.param_dtype='fp16': {_FP16_PARAMS}")
        if self.param_dtype not in ("auto", *PARAM_DTYPES):
            raise ValueError(f"train.param_dtype={self.param_dtype!r}; allowed: auto, {', '.join(PARAM_DTYPES)}")
        if self.param_dtype == "bf16" and self.finetuning == "lora":
            raise ValueError(
                "train.param_dtype='bf16' applies to full fine-tuning (train.finetuning: full); LoRA adapters "
                "train in fp32 on a frozen base"
            )
        if "@" in self.optim:
            raise ValueError(
                f"train.optim={self.optim!r}: give the parameter dtype as train.param_dtype (the `optim@dtype` "
                "spelling is for compare.optimizers)"
            )
        check_optim_name(self.optim, "train.optim")
        if self.learning_rate <= 0:
            raise ValueError(f"train.learning_rate={self.learning_rate} must be positive")
        if self.max_steps <= 0 and self.num_train_epochs <= 0:
            raise ValueError("train: set max_steps > 0 or num_train_epochs > 0")
        if self.per_device_train_batch_size <= 0 or self.gradient_accumulation_steps <= 0:
            raise ValueError("train: batch size and gradient accumulation must be positive")
        if self.final_loss_window <= 0:
            raise ValueError(f"train.final_loss_window={self.final_loss_window} must be positive")


@dataclass
class CompareConfig:
    """The grid ``apexw-compare`` runs: every optimizer x learning rate x seed, one process each."""

    optimizers: list[str] = field(default_factory=lambda: ["adamw_torch", "adamw_8bit", "apexw_compact", "apexw_8bit"])
    learning_rates: list[float] = field(default_factory=lambda: [2e-4, 5e-5])
    # More learning rates per optimizer, beside the shared ones: {optimizer: [lr, ...]} (or one list for every
    # optimizer). Each optimizer is then also reported at its best learning rate (see `report.best_learning_rates`).
    lr_sweep: dict[str, list[float]] | list[float] = field(default_factory=dict)
    seeds: list[int] = field(default_factory=lambda: [3407])
    # TrainingArguments(optim_args=...) per optimizer of the grid: {optimizer: "key=value,..."} (e.g.
    # {apexw_4bit_release@bf16: tied_grad_offload=true}); the others run with train.optim_args
    optim_args: dict[str, str] = field(default_factory=dict)
    baseline: str = "adamw_torch"  # the optimizer the significance tests compare against
    output_dir: str = "runs/compare"
    jobs: int = 1  # runs at a time; with a GPU only start-ups overlap (GPU work is serialized by a file lock)
    max_minutes: float = 0.0  # > 0: launch no new run once the grid has used this long
    fail_fast: bool = True  # stop launching runs when the first run to finish has failed
    warmup_run: bool = False  # a short unreported run first, so compile caches are warm for every reported run
    # GPUs to spread runs over (CUDA device indices; empty: the one the runs see). All runs of one seed go to one
    # device, so with as many devices as seeds every device runs the same mix of optimizers.
    devices: list[int] = field(default_factory=list)
    # runs that share one GPU at a time (1: a file lock per device serializes their GPU work). Above 1, speed is
    # measured under sharing; peak memory (per process) is not affected.
    runs_per_device: int = 1

    def learning_rates_of(self, spec: str) -> list[float]:
        """Every learning rate ``spec`` runs at: the shared ones, then its sweep (duplicates dropped)."""
        extra = self.lr_sweep.get(spec, []) if isinstance(self.lr_sweep, dict) else self.lr_sweep
        return list(dict.fromkeys([*self.learning_rates, *map(float, extra)]))

    def validate(self) -> None:
        for name, seq in (
            ("optimizers", self.optimizers),
            ("learning_rates", self.learning_rates),
            ("seeds", self.seeds),
        ):
            if not seq:
                raise ValueError(f"compare.{name} is empty")
            if len(set(seq)) != len(seq):
                raise ValueError(f"compare.{name} has duplicates: {seq}")
        for spec in self.optimizers:
            check_optim_name(split_optimizer_spec(spec)[0], "compare.optimizers")
        check_optim_name(split_optimizer_spec(self.baseline)[0], "compare.baseline")
        if isinstance(self.lr_sweep, dict):
            unknown = sorted(set(self.lr_sweep) - set(self.optimizers))
            if unknown:
                raise ValueError(
                    f"compare.lr_sweep names {unknown}, which are not in compare.optimizers {self.optimizers}"
                )
            sweeps = self.lr_sweep.values()
        else:
            sweeps = [self.lr_sweep]
        for lrs in sweeps:
            if not isinstance(lrs, list) or not all(isinstance(x, (int, float)) and x > 0 for x in lrs):
                raise ValueError(f"compare.lr_sweep entries must be lists of positive learning rates, got {lrs!r}")
        unknown = sorted(set(self.optim_args) - set(self.optimizers))
        if unknown:
            raise ValueError(
                f"compare.optim_args names {unknown}, which are not in compare.optimizers {self.optimizers}"
            )
        for spec, value in self.optim_args.items():
            if not isinstance(value, str) or not value.strip():
                raise ValueError(
                    f"compare.optim_args[{spec!r}]={value!r}: expected a non-empty 'key=value,...' string (the "
                    "TrainingArguments optim_args of that optimizer's runs)"
                )
        if self.jobs < 1:
            raise ValueError(f"compare.jobs={self.jobs} must be >= 1")
        if self.runs_per_device < 1:
            raise ValueError(f"compare.runs_per_device={self.runs_per_device} must be >= 1")
        ints = all(isinstance(d, int) and not isinstance(d, bool) for d in self.devices)
        if not ints or len(set(self.devices)) != len(self.devices) or any(d < 0 for d in self.devices):
            raise ValueError(f"compare.devices={self.devices} must be distinct CUDA device indices >= 0")


@dataclass
class RecipeConfig:
    """A whole recipe: ``name`` labels results; the sections are the dataclasses above."""

    name: str = "recipe"
    description: str = ""
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraSettings = field(default_factory=LoraSettings)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    compare: CompareConfig = field(default_factory=CompareConfig)

    def validate(self) -> RecipeConfig:
        for sec in (self.model, self.lora, self.data, self.train, self.compare):
            sec.validate()
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


_SECTIONS = {
    "model": ModelConfig,
    "lora": LoraSettings,
    "data": DataConfig,
    "train": TrainConfig,
    "compare": CompareConfig,
}


def _coerce(cls: type, key: str, value: Any, where: str) -> Any:
    """Check a YAML value against the dataclass field's default type; ints are accepted for floats."""
    default = next(f for f in fields(cls) if f.name == key)
    ref = default.default if default.default is not dataclasses.MISSING else default.default_factory()
    if ref is None or value is None:
        return value
    if key == "lr_sweep":
        if isinstance(value, dict):
            return {str(k): [float(x) for x in v] if isinstance(v, list) else v for k, v in value.items()}
        if isinstance(value, list):
            return [float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else x for x in value]
        raise TypeError(f"{where}.{key}={value!r}: expected a mapping optimizer -> list of learning rates, or a list")
    if isinstance(ref, bool) or isinstance(value, bool):
        if key == "gradient_checkpointing" and isinstance(value, str | bool):
            return value
        if not (isinstance(ref, bool) and isinstance(value, bool)):
            raise TypeError(f"{where}.{key}={value!r}: expected {type(ref).__name__}")
        return value
    if isinstance(ref, float) and isinstance(value, int | float):
        return float(value)
    if isinstance(ref, list):
        if not isinstance(value, list):
            raise TypeError(f"{where}.{key}={value!r}: expected a list")
        if key == "learning_rates":
            bad = [v for v in value if isinstance(v, bool) or not isinstance(v, int | float)]
            if bad:
                raise TypeError(f"{where}.{key}={value!r}: {bad[0]!r} is not a number (learning rates, e.g. 1e-3)")
            return [float(v) for v in value]
        if key == "seeds" and not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise TypeError(f"{where}.{key}={value!r}: seeds must be integers")
        return value
    if isinstance(value, str) and isinstance(ref, int | float):  # YAML reads "2e-4" as a string
        try:
            return type(ref)(float(value)) if isinstance(ref, float) else int(value)
        except ValueError:
            raise TypeError(f"{where}.{key}={value!r}: expected {type(ref).__name__}") from None
    if not isinstance(value, type(ref)):
        raise TypeError(f"{where}.{key}={value!r}: expected {type(ref).__name__}, got {type(value).__name__}")
    return value


def config_from_dict(raw: dict[str, Any]) -> RecipeConfig:
    """Build and validate a :class:`RecipeConfig` from a plain dict (a parsed YAML file)."""
    if not isinstance(raw, dict):
        raise TypeError(f"a recipe config must be a mapping, got {type(raw).__name__}")
    top = {"name", "description", *_SECTIONS}
    unknown = set(raw) - top
    if unknown:
        raise ValueError(f"unknown top-level config keys {sorted(unknown)}; allowed: {sorted(top)}")
    kwargs: dict[str, Any] = {k: raw[k] for k in ("name", "description") if k in raw}
    for sec, cls in _SECTIONS.items():
        body = raw.get(sec) or {}
        if not isinstance(body, dict):
            raise TypeError(f"config section {sec!r} must be a mapping, got {type(body).__name__}")
        allowed = {f.name for f in fields(cls)}
        bad = set(body) - allowed
        if bad:
            raise ValueError(f"unknown keys {sorted(bad)} in section {sec!r}; allowed: {sorted(allowed)}")
        kwargs[sec] = cls(**{k: _coerce(cls, k, v, sec) for k, v in body.items()})
    return RecipeConfig(**kwargs).validate()


def resolve_config_path(name_or_path: str | Path) -> Path:
    """A path to a YAML file, or the name of one shipped in ``apexw_hf/configs`` (with or without ``.yaml``)."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    shipped = resources.files("apexw_hf") / "configs"
    repo_configs = Path(__file__).resolve().parents[2] / "configs"  # the repo's configs/ in a source checkout
    for cand in (str(name_or_path), f"{name_or_path}.yaml"):
        for folder in (shipped, repo_configs):
            q = folder / cand
            if q.is_file():
                return Path(str(q))
    names = sorted(x.name for x in shipped.iterdir() if x.name.endswith(".yaml"))
    raise FileNotFoundError(
        f"config {str(name_or_path)!r} is neither a file nor a shipped config; "
        f"shipped configs: {names}; the published set-up is configs/llama32_3b_t4.yaml in the repo"
    )


def load_config(name_or_path: str | Path = DEFAULT_CONFIG, overrides: list[str] | None = None) -> RecipeConfig:
    """Load a YAML recipe (a path, or a shipped config's name) and apply ``section.key=value`` overrides."""
    import yaml

    path = resolve_config_path(name_or_path)
    with open(path, encoding="utf-8") as fh:
        # JSON (the runner's resolved config) is read as JSON: YAML 1.1 reads "1e-05" as a string
        try:
            raw = (json.load(fh) if path.suffix == ".json" else _fix_floats(yaml.safe_load(fh))) or {}
        except (yaml.YAMLError, json.JSONDecodeError, UnicodeDecodeError) as exc:
            where = getattr(exc, "problem_mark", None)
            at = f" (line {where.line + 1}, column {where.column + 1})" if where is not None else ""
            what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ValueError(
                f"config {str(path)!r} is not a valid {'JSON' if path.suffix == '.json' else 'YAML'} file{at}: "
                f"{what}. A recipe config is a YAML mapping of sections (model, lora, data, train, compare); "
                "see apexw_hf/configs/offline_default.yaml"
            ) from None
    if not isinstance(raw, dict):
        raise TypeError(
            f"config {str(path)!r} must be a YAML mapping of sections (model, lora, data, train, compare), "
            f"got a {type(raw).__name__}; see apexw_hf/configs/offline_default.yaml"
        )
    if overrides:
        apply_overrides(raw, overrides)
    return config_from_dict(raw)


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` strings to a raw config dict in place; values are parsed as YAML."""
    for item in overrides:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ValueError(f"override {item!r} must look like section.key=value, e.g. train.max_steps=20")
        lhs, rhs = item.split("=", 1)
        sec, key = lhs.split(".", 1)
        raw.setdefault(sec, {})
        if not isinstance(raw[sec], dict):
            raise ValueError(f"override {item!r}: {sec!r} is not a config section")
        raw[sec][key] = _parse_value(rhs)
    return raw


_SCI = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def _fix_floats(value: Any) -> Any:
    """YAML 1.1 reads "1e-5" (no dot) as a string; turn such strings back into floats, recursively."""
    if isinstance(value, str) and _SCI.match(value.strip()):
        return float(value)
    if isinstance(value, list):
        return [_fix_floats(v) for v in value]
    if isinstance(value, dict):
        return {k: _fix_floats(v) for k, v in value.items()}
    return value


def _parse_value(text: str) -> Any:
    """A YAML value with scientific-notation floats fixed (see :func:`_fix_floats`)."""
    import yaml

    return _fix_floats(yaml.safe_load(text))
