"""Model side of the recipe: which backend, the shared random-weight base, loading with LoRA adapters.

* :func:`select_backend`: Unsloth when it is installed and a CUDA GPU is present (or when the config says so), else
  transformers + PEFT.
* :func:`prepare_base`: for ``model.build`` configs, random weights (seeded by ``model.init_seed``) and, without a hub
  tokenizer, a BPE tokenizer trained on the training split, saved once under ``<output_dir>/base`` so that every run
  of a grid starts from the same base.
* :func:`load_model_and_tokenizer`: the base model (4-bit where configured) with LoRA adapters initialised from a seed,
  or, for ``train.finetuning: full``, the whole model in the run's parameter dtype (:func:`resolve_param_dtype`).
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from typing import Any

from .config import RecipeConfig

__all__ = ["select_backend", "prepare_base", "resolve_precision", "resolve_param_dtype", "load_model_and_tokenizer"]


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def select_backend(cfg: RecipeConfig) -> tuple[str, str]:
    """Return (backend, why): 'unsloth' or 'transformers'."""
    has_unsloth = importlib.util.find_spec("unsloth") is not None
    cuda = _cuda()
    want = cfg.train.backend
    if want == "unsloth":
        if not (has_unsloth and cuda):
            raise RuntimeError(
                "train.backend=unsloth needs Unsloth installed (pip install unsloth) and a CUDA GPU; "
                f"found unsloth={'yes' if has_unsloth else 'no'}, cuda={'yes' if cuda else 'no'}. "
                "Set train.backend: auto to use transformers + PEFT instead"
            )
        return "unsloth", "requested in the config"
    if want == "transformers":
        return "transformers", "requested in the config"
    if has_unsloth and cuda:
        return "unsloth", "auto: Unsloth is installed and a CUDA GPU is present"
    return "transformers", (f"auto: {'no CUDA GPU' if not cuda else 'Unsloth not installed'}, so transformers + PEFT")


def _missing_model_error(name: str, exc: Exception) -> RuntimeError:
    return RuntimeError(
        f"could not load model {name!r} ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). "
        "If it is a Hub id, download it while online (`huggingface-cli download NAME`) or check the spelling; if it "
        "is a directory, check the path. With no internet, run the offline default instead: `apexw-compare` with no "
        "arguments builds a small Llama from a config."
    )


def prepare_base(cfg: RecipeConfig, output_dir: str | Path, verbose: bool = True) -> dict[str, Any]:
    """Create (or reuse) what all runs share; return ``{"model": path_or_id, "tokenizer": path_or_id, ...}``."""
    m = cfg.model
    if m.build is None:
        return {"model": m.name_or_path, "tokenizer": m.tokenizer or m.name_or_path, "built": False}
    base = Path(output_dir).resolve() / "base"
    marker = base / "prepared.json"
    key = json.dumps({"model": dict(vars(m)), "data": dict(vars(cfg.data))}, sort_keys=True, default=str)
    if marker.is_file() and json.loads(marker.read_text()).get("key") == key:
        return json.loads(marker.read_text())["prepared"]
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from .data import load_chat_data, train_tokenizer

    t0 = time.time()
    if m.tokenizer:
        tok = AutoTokenizer.from_pretrained(m.tokenizer)
    else:
        data = load_chat_data(cfg.data, verbose=verbose)
        tok = train_tokenizer(data.train, m.tokenizer_vocab_size, m.max_seq_length)
    fields = dict(m.build)
    fields.setdefault("vocab_size", len(tok))
    if fields["vocab_size"] < len(tok):
        raise ValueError(f"model.build.vocab_size={fields['vocab_size']} is smaller than the tokenizer ({len(tok)})")
    fields.setdefault("max_position_embeddings", m.max_seq_length)
    for name in ("bos", "eos", "pad"):
        tid = getattr(tok, f"{name}_token_id")
        if tid is not None:
            fields.setdefault(f"{name}_token_id", tid)
    config = LlamaConfig(**fields)
    dtype = getattr(torch, m.build_dtype)
    torch.manual_seed(m.init_seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # random init of billions of weights is slow on a CPU
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    model_dir = base / "model"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    n_params = sum(p.numel() for p in model.parameters())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    prepared = {
        "model": str(model_dir),
        "tokenizer": str(model_dir),
        "built": True,
        "base_params": n_params,
        "tokenizer_vocab": len(tok),
        "seconds": round(time.time() - t0, 2),
    }
    marker.write_text(json.dumps({"key": key, "prepared": prepared}, indent=1))
    if verbose:
        print(
            f"[apexw recipe] built a random-weight Llama ({n_params / 1e6:.2f}M params, {m.build_dtype}, seed "
            f"{m.init_seed}) and a {len(tok)}-token tokenizer in {model_dir} ({prepared['seconds']} s)",
            flush=True,
        )
    return prepared


def resolve_param_dtype(cfg: RecipeConfig) -> str:
    """'fp32' or 'bf16': the dtype the trainable parameters are kept in (``train.param_dtype: auto`` = fp32)."""
    return "fp32" if cfg.train.param_dtype == "auto" else cfg.train.param_dtype


def resolve_precision(cfg: RecipeConfig) -> str:
    """'fp32', 'fp16' or 'bf16' for this machine (``train.precision: auto`` picks bf16 where supported)."""
    import torch

    p = cfg.train.precision
    if p != "auto":
        if p in ("fp16", "bf16") and not torch.cuda.is_available():
            raise RuntimeError(f"train.precision={p} needs a CUDA GPU; use precision: auto or fp32 on the CPU")
        return p
    if not torch.cuda.is_available():
        return "fp32"
    if resolve_param_dtype(cfg) == "bf16" and not torch.cuda.is_bf16_supported():
        raise RuntimeError(
            f"bf16 parameters need a GPU with bf16 ({torch.cuda.get_device_name(0)} has none, e.g. a T4): keep fp32 "
            "parameters (`@fp32`, fp16 autocast) or train LoRA adapters"
        )
    return "bf16" if torch.cuda.is_bf16_supported() else "fp16"


def _torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def _load_unsloth(cfg: RecipeConfig, prepared: dict, seed: int):
    from unsloth import FastLanguageModel  # noqa: I001 - Unsloth must patch transformers before it is used

    full = cfg.train.finetuning == "full"
    extra: dict[str, Any] = {}
    if full:  # the whole model trains, in the run's parameter dtype
        extra = dict(
            dtype=_torch_dtype(resolve_param_dtype(cfg)),
            full_finetuning=True,
            use_gradient_checkpointing=cfg.model.gradient_checkpointing,
        )
    try:
        model, tok = FastLanguageModel.from_pretrained(
            model_name=prepared["model"],
            max_seq_length=cfg.model.max_seq_length,
            load_in_4bit=cfg.model.load_in_4bit,
            **{"dtype": None, **extra},
        )
    except (OSError, ValueError) as exc:  # ValueError: huggingface_hub rejects a bad repo id / path
        raise _missing_model_error(prepared["model"], exc) from exc
    if full:
        return model, tok
    lc = cfg.lora
    model = FastLanguageModel.get_peft_model(
        model,
        r=lc.r,
        target_modules=lc.target_modules,
        lora_alpha=lc.alpha,
        lora_dropout=lc.dropout,
        bias=lc.bias,
        use_gradient_checkpointing=cfg.model.gradient_checkpointing,
        random_state=seed,
    )
    return model, tok


def _load_transformers(cfg: RecipeConfig, prepared: dict, precision: str):
    import torch
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {}
    if cfg.model.load_in_4bit:
        if not torch.cuda.is_available() or importlib.util.find_spec("bitsandbytes") is None:
            raise RuntimeError(
                "model.load_in_4bit needs a CUDA GPU and bitsandbytes; on this machine use a config "
                "with load_in_4bit: false (the offline default)"
            )
        from transformers import BitsAndBytesConfig

        compute = torch.bfloat16 if precision == "bf16" else torch.float16
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute,
        )
    full = cfg.train.finetuning == "full"
    if full:
        if cfg.model.load_in_4bit:
            raise ValueError(
                "model.load_in_4bit is for LoRA on a quantized base; full fine-tuning trains every weight"
            )
        kwargs["dtype"] = _torch_dtype(resolve_param_dtype(cfg))
    else:
        kwargs["dtype"] = {"bf16": torch.bfloat16, "fp16": torch.float32, "fp32": torch.float32}[precision]
    try:
        tok = AutoTokenizer.from_pretrained(prepared["tokenizer"])
        model = AutoModelForCausalLM.from_pretrained(prepared["model"], **kwargs)
    except (OSError, ValueError) as exc:  # ValueError: huggingface_hub rejects a bad repo id / path
        raise _missing_model_error(prepared["model"], exc) from exc
    if torch.cuda.is_available() and not cfg.model.load_in_4bit:
        model = model.to("cuda")
    gc = bool(cfg.model.gradient_checkpointing)
    if cfg.model.load_in_4bit:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=gc)
    elif gc:
        model.gradient_checkpointing_enable()
        if not full:
            model.enable_input_require_grads()
    if full:
        return model, tok
    lc = cfg.lora
    model = get_peft_model(
        model,
        LoraConfig(
            r=lc.r,
            lora_alpha=lc.alpha,
            lora_dropout=lc.dropout,
            bias=lc.bias,
            target_modules=lc.target_modules,
            task_type="CAUSAL_LM",
        ),
    )
    return model, tok


def load_model_and_tokenizer(cfg: RecipeConfig, prepared: dict, backend: str, precision: str, seed: int):
    """Load the base model and tokenizer and add LoRA adapters (initialised from ``seed``); return (model, tok)."""
    from transformers import set_seed

    set_seed(seed)
    if backend == "unsloth":
        model, tok = _load_unsloth(cfg, prepared, seed)
    else:
        model, tok = _load_transformers(cfg, prepared, precision)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if tok.chat_template is None:
        from .data import LLAMA3_STYLE_TEMPLATE

        print("[apexw data] the tokenizer has no chat template; using a Llama-3-style one", flush=True)
        tok.chat_template = LLAMA3_STYLE_TEMPLATE
    return model, tok
