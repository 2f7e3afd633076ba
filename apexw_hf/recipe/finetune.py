"""One fine-tune driven by one config (LoRA adapters, or every parameter with ``train.finetuning: full``): Unsloth
when it is installed and a CUDA GPU is present, else transformers (+ PEFT for LoRA). Writes a result JSON with the
numbers the comparison table needs.

Steps: (1) ``prepare_base`` makes what every run of a grid shares: for a model built from a config, random weights
(seeded by ``model.init_seed``) and, without a hub tokenizer, a BPE tokenizer trained on the training split; both
are saved under ``<output_dir>/base``. (2) ``run_finetune`` loads the base, adds LoRA adapters (seeded by
``train.seed``), trains with ``TrainingArguments(optim=...)`` (the ``apexw_*`` names resolve through
``apexw_hf.integrations`` once ``apexw_hf`` is imported), evaluates the held-out loss and measures optimizer-state
bytes, peak memory and steps/s.

Command line (one run; ``apexw-compare`` calls this once per grid cell, each in a fresh process)::

    python -m apexw_hf.recipe.finetune --config offline_default --set train.max_steps=20
    python -m apexw_hf.recipe.finetune --config configs/llama32_3b_t4.yaml --optim apexw_8bit --lr 2e-4 --seed 1
    python -m apexw_hf.recipe.finetune --config offline_full --optim apexw_8bit@bf16 --set train.max_steps=20
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import os
import platform
import resource
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from ..provenance import source_commit
from .config import RecipeConfig, load_config, optimizer_label, split_optimizer_spec
from .model import (
    _cuda,
    load_model_and_tokenizer,
    prepare_base,
    resolve_param_dtype,
    resolve_precision,
    select_backend,
)

__all__ = [
    "select_backend",
    "prepare_base",
    "probe_optimizer",
    "resolve_precision",
    "load_model_and_tokenizer",
    "build_training_arguments",
    "run_finetune",
    "SkipRun",
    "main",
]

_T0 = float(os.environ.get("APEXW_LAUNCH_TIME", time.time()))  # set by the runner: counts interpreter start-up too
# Module (prefix) and class each optimizer name must produce; a mismatch means something rewrote the name.
_EXPECTED_CLASS = {
    "adamw_torch": ("torch.optim", "AdamW"),
    "adamw_torch_fused": ("torch.optim", "AdamW"),
    "adamw_8bit": ("bitsandbytes", None),
    "apexw_compact": ("apexw_hf", "ApexWCompact"),
    "apexw_8bit": ("apexw_hf", "ApexW8bit"),
    "apexw_4bit": ("apexw_hf", "ApexW4bit"),
}


class SkipRun(Exception):
    """The run cannot happen on this machine for a stated reason (reported as 'skipped', not as a failure)."""


def _source_digest() -> str:
    """sha256 (first 12 hex digits) of the package's .py files: identifies the code when there is no commit."""
    import hashlib

    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def probe_optimizer(name: str) -> None:
    """Raise :class:`SkipRun` when an optimizer cannot run here (bitsandbytes missing, or no kernel for the CPU)."""
    if name != "adamw_8bit":
        return
    if importlib.util.find_spec("bitsandbytes") is None:
        raise SkipRun("bitsandbytes is not installed (pip install bitsandbytes)")
    import torch

    if torch.cuda.is_available():
        return
    try:
        import bitsandbytes as bnb

        p = torch.nn.Parameter(torch.ones(4096))
        opt = bnb.optim.AdamW8bit([p], lr=1e-3)
        p.grad = torch.full_like(p, 0.5)
        opt.step()
        if not torch.isfinite(p).all() or torch.equal(p.detach(), torch.ones(4096)):
            raise RuntimeError("the 8-bit step did not update the parameter")
    except Exception as exc:  # noqa: BLE001 - reported verbatim as the reason for skipping
        raise SkipRun(
            f"bitsandbytes 8-bit AdamW does not run on CPU tensors here: {type(exc).__name__}: {exc}"
        ) from exc


def _acquire_gpu_lock(result: dict[str, Any]):
    """With ``APEXW_GPU_LOCK`` set (by the runner, when runs overlap), hold that file lock for all GPU work, so only
    interpreter start-up and imports overlap and memory and speed are measured with the GPU to this run alone."""
    path = os.environ.get("APEXW_GPU_LOCK")
    if not path or not _cuda():
        return None
    import fcntl

    t0 = time.time()
    fh = open(path, "a")  # noqa: SIM115 - held until this process exits
    fcntl.flock(fh, fcntl.LOCK_EX)
    result["gpu_lock_wait_s"] = round(time.time() - t0, 2)
    return fh


def _check_optimizer_class(name: str, opt: Any) -> str:
    cls = type(opt)
    where = f"{cls.__module__}.{cls.__qualname__}"
    exp = _EXPECTED_CLASS.get(name)
    if exp and (not cls.__module__.startswith(exp[0]) or (exp[1] and cls.__name__ != exp[1])):
        raise RuntimeError(
            f"optim={name!r} built {where}, expected {exp[0]}...{exp[1] or ''}: something rewrote the "
            "optimizer name (Unsloth's CPU mode does this for names containing '8bit')"
        )
    return where


def build_training_arguments(cfg: RecipeConfig, out_dir: str | Path, precision: str):
    """``TrainingArguments`` from ``cfg.train`` (``optim`` is passed as a string: the apexw names need
    ``import apexw_hf``); no checkpoints, no reporting, loss-only evaluation."""
    from transformers import TrainingArguments

    t = cfg.train
    try:
        return TrainingArguments(
            output_dir=str(Path(out_dir) / "trainer"),
            per_device_train_batch_size=t.per_device_train_batch_size,
            gradient_accumulation_steps=t.gradient_accumulation_steps,
            per_device_eval_batch_size=t.per_device_eval_batch_size,
            warmup_steps=t.warmup_steps,
            num_train_epochs=t.num_train_epochs,
            max_steps=t.max_steps,
            learning_rate=t.learning_rate,
            fp16=precision == "fp16",
            bf16=precision == "bf16",
            logging_steps=t.logging_steps,
            optim=t.optim,
            weight_decay=t.weight_decay,
            lr_scheduler_type=t.lr_scheduler_type,
            max_grad_norm=t.max_grad_norm,
            use_liger_kernel=t.use_liger_kernel,
            optim_args=t.optim_args or None,
            seed=t.seed,
            data_seed=t.seed,
            report_to="none",
            save_strategy="no",
            eval_strategy="no",
            prediction_loss_only=True,
            dataloader_num_workers=0,
            disable_tqdm=True,
            use_cpu=not _cuda(),
            remove_unused_columns=False,
        )
    except ValueError as exc:
        if "OptimizerNames" in str(exc) and t.optim.startswith("apexw"):
            raise RuntimeError(
                f"optim={t.optim!r} is not a known Trainer optimizer: the apexw_hf Hugging Face "
                "integration did not register it (is `apexw_hf.integrations` installed and was "
                "`import apexw_hf` successful?)"
            ) from exc
        raise


class _StepTimer:
    """Trainer callback recording wall time at each optimizer step (for a steady-state steps/s), and the time of
    ``optimizer.step()`` itself: CUDA events around it on a GPU (read once training is over, so nothing waits for the
    device during training), wall clock on the CPU."""

    def __new__(cls):
        import torch
        from transformers import TrainerCallback

        class _Impl(TrainerCallback):
            def __init__(self):
                self.times: list[float] = []
                self.opt_spans: list = []
                self._start = None

            def on_step_end(self, args, state, control, **kwargs):
                self.times.append(time.perf_counter())

            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                if torch.cuda.is_available():
                    self._start = torch.cuda.Event(enable_timing=True)
                    self._start.record()
                else:
                    self._start = time.perf_counter()

            def on_optimizer_step(self, args, state, control, **kwargs):
                if self._start is None:
                    return
                if isinstance(self._start, float):
                    self.opt_spans.append((time.perf_counter() - self._start) * 1e3)
                else:
                    end = torch.cuda.Event(enable_timing=True)
                    end.record()
                    self.opt_spans.append((self._start, end))
                self._start = None

            def optimizer_step_ms(self) -> float | None:
                """Median ms of ``optimizer.step()``, the first 10% of steps (compiles, allocations) left out."""
                if not self.opt_spans:
                    return None
                if not isinstance(self.opt_spans[0], float):
                    torch.cuda.synchronize()
                ms = [s if isinstance(s, float) else s[0].elapsed_time(s[1]) for s in self.opt_spans]
                ms = ms[len(ms) // 10 :]
                return float(statistics.median(ms))

        return _Impl()


def _steady_steps_per_s(times: list[float]) -> float | None:
    if len(times) < 6:
        return None
    k = max(1, len(times) // 10)  # leave out the first 10% (allocator warm-up, kernel compiles)
    return (len(times) - 1 - k) / (times[-1] - times[k])


def _environment(backend: str) -> dict[str, Any]:
    import torch
    import transformers

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "git_commit": source_commit()[0],
        "source_sha256": _source_digest(),
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "backend": backend,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
    }
    for mod in ("peft", "trl", "bitsandbytes", "unsloth", "triton"):
        if importlib.util.find_spec(mod) is not None and (mod != "unsloth" or backend == "unsloth"):
            try:
                env[mod] = __import__(mod).__version__
            except Exception:  # noqa: BLE001 - a version string is optional metadata
                env[mod] = "?"
    return env


def _run_key(cfg: RecipeConfig) -> str:
    """The name a run is reported under: ``optim``, with ``@dtype`` when the parameter dtype was chosen."""
    t = cfg.train
    return t.optim if t.param_dtype == "auto" else f"{t.optim}@{t.param_dtype}"


def check_trainable_dtypes(model, param_dtype: str, backend: str) -> dict | None:
    """After training: every trainable parameter must still have the run's dtype (``param_dtype``: ``"fp32"`` or
    ``"bf16"``), or the training stack cast it and the run does not measure what it says.

    One exception: Unsloth's full fine-tuning loads the RMSNorm weights in fp32 (Unsloth's choice), the
    model's own small fp32 parameters, stepped in fp32, not a master copy. With ``backend == "unsloth"`` fp32
    ``*norm.weight`` parameters are accepted and returned as ``{"tensors": n, "elements": n}`` for the run's record;
    None when every trainable parameter has the run's dtype. Anything else raises.
    """
    import torch

    want = {"fp32": torch.float32, "bf16": torch.bfloat16}[param_dtype]
    other = [(n, p) for n, p in model.named_parameters() if p.requires_grad and p.dtype != want]
    if not other:
        return None
    fp32_norms = all(n.endswith("norm.weight") and p.dtype == torch.float32 for n, p in other)
    if backend != "unsloth" or not fp32_norms:
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for n, p in model.named_parameters() if p.requires_grad})
        raise RuntimeError(
            f"the run asked for {param_dtype} parameters, but after training the trainable parameters are {dtypes}: "
            f"something in the training stack cast them (e.g. {', '.join(f'{n} {p.dtype}' for n, p in other[:3])})"
        )
    return {"tensors": len(other), "elements": sum(p.numel() for _, p in other)}


def training_memory(model: Any, opt: Any) -> dict[str, Any]:
    """Bytes of what training keeps per trainable parameter: the parameters, their gradients (same dtype as the
    parameter in PyTorch; none with ApexW's gradient release, which frees each one in backward) and the optimizer
    state, each counted once (tied weights once)."""
    import apexw_hf
    from apexw_hf.accounting import unwrap_optimizer

    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    n_train = sum(p.numel() for p in trainable)
    param_b = sum(p.numel() * p.element_size() for p in trainable)
    state_b = int(apexw_hf.optimizer_state_bytes(opt))
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in trainable})
    release = bool(getattr(unwrap_optimizer(opt), "gradient_release", False))
    grad_b = 0 if release else param_b
    return {
        "total_params": sum(p.numel() for p in params),
        "trainable_param_dtypes": dtypes,
        "trainable_param_bytes": param_b,
        "gradient_release": release,
        "grad_bytes": grad_b,
        "train_bytes_per_param": (param_b + grad_b + state_b) / max(1, n_train),
    }


def _result_header(cfg: RecipeConfig) -> dict[str, Any]:
    """What a run is: optimizer, fine-tuning kind, parameter dtype, learning rate, seed, config."""
    t = cfg.train
    result: dict[str, Any] = {
        "status": "ok",
        "optimizer": _run_key(cfg),
        "optim": t.optim,
        "optimizer_label": optimizer_label(_run_key(cfg)),
        "finetuning": t.finetuning,
        "param_dtype": resolve_param_dtype(cfg),
        "learning_rate": t.learning_rate,
        "seed": t.seed,
        "config_name": cfg.name,
    }
    if t.optim_args:
        result["optim_args"] = t.optim_args
    return result


def _optimizer_facts(cfg: RecipeConfig, opt, model, result: dict[str, Any]) -> dict[str, Any]:
    """The optimizer's class, state bytes, the training memory and, for ApexW, the engines that ran (into
    ``result``); returns :func:`training_memory`'s dict."""
    import apexw_hf

    real_opt = getattr(opt, "optimizer", opt)
    result["optimizer_class"] = _check_optimizer_class(cfg.train.optim, real_opt)
    result["optimizer_state_bytes"] = int(apexw_hf.optimizer_state_bytes(opt))
    result["optimizer_state_mib"] = result["optimizer_state_bytes"] / 2**20
    mem = training_memory(model, real_opt)
    result.update(mem)
    norms = check_trainable_dtypes(model, result["param_dtype"], cfg.train.backend)
    if norms is not None:
        result["fp32_norm_params"] = norms
    engines = sorted({str(g["engine"]) for g in real_opt.param_groups if "engine" in g})
    if engines:  # ApexW: the requested engine, and whether its Triton engine actually ran
        result["optimizer_engine"] = ",".join(engines)
        ran = getattr(real_opt, "engine_stats", {})
        result["optimizer_triton_engine_used"] = "triton" in ran
        if "triton" in ran:  # steps that found the gradients at new addresses (host time; engines/triton/engine.py)
            result["optimizer_grad_moves"] = ran["triton"]["grad_moves"]
        result["optimizer_torch_engine_used"] = "torch" in ran  # the plain-PyTorch engine, and its fused numba path
        result["optimizer_numba_used"] = ran.get("torch", {}).get("numba_used", False)
    return mem


def _process_facts() -> dict[str, Any]:
    """Peak GPU memory (where there is a GPU), peak RSS and CPU seconds of this process so far."""
    import torch

    out = {}
    if torch.cuda.is_available():
        out["peak_gpu_mem_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["peak_gpu_mem_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out["peak_rss_gib"] = usage.ru_maxrss / 2**20  # Linux: KiB
    out["cpu_seconds"] = round(usage.ru_utime + usage.ru_stime, 2)  # this process, up to the end of training
    return out


def _training_facts(cfg: RecipeConfig, trainer, train_out, timer, release: bool) -> dict[str, Any]:
    """Steps, speed, the optimizer step's time and the losses the Trainer logged."""
    metrics = train_out.metrics
    losses = [(h["step"], h["loss"]) for h in trainer.state.log_history if "loss" in h]
    if not losses:
        raise RuntimeError("the trainer logged no training loss; set train.logging_steps to a small value")
    window = [loss for _, loss in losses[-cfg.train.final_loss_window :]]
    return {
        "global_steps": trainer.state.global_step,
        "train_runtime_s": metrics.get("train_runtime"),
        "steps_per_s": metrics.get("train_steps_per_second"),
        "steps_per_s_steady": _steady_steps_per_s(timer.times),
        # with gradient release the update runs inside backward: step() only closes the step, so its time would
        # not be the optimizer's (the update's time is in steps/s)
        "optimizer_step_ms": None if release else timer.optimizer_step_ms(),
        "train_loss_mean": metrics.get("train_loss"),
        "initial_train_loss": losses[0][1],
        "final_train_loss": sum(window) / len(window),
        "last_train_loss": losses[-1][1],
        "loss_curve": [[s, loss] for s, loss in losses],
    }


def _make_trainer(cfg: RecipeConfig, model, tok, train_ds, val_ds, out_dir: Path, precision: str, timer, result: dict):
    """The Trainer of a run, with the step timer and ApexW's state callback (None, and the reason in ``result``,
    where the callback cannot be imported)."""
    from transformers import Trainer

    from .data import PadCollator

    callbacks = [timer]
    state_cb = None
    try:
        from apexw_hf.integrations.callbacks import OptimizerStateCallback

        state_cb = OptimizerStateCallback()
        callbacks.insert(0, state_cb)
    except ImportError as exc:
        result["callback_missing"] = str(exc)
    trainer = Trainer(
        model=model,
        args=build_training_arguments(cfg, out_dir, precision),
        train_dataset=train_ds,
        eval_dataset=val_ds or None,
        data_collator=PadCollator(tok.pad_token_id, cfg.data.pad_to_multiple_of),
        callbacks=callbacks,
    )
    return trainer, state_cb


def run_finetune(
    cfg: RecipeConfig, output_dir: str | Path, prepared: dict | None = None, verbose: bool = True
) -> dict[str, Any]:
    """Run one fine-tune; return (and write to ``<output_dir>/result.json``) its result dict."""
    out_dir = Path(output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    t = cfg.train
    result = _result_header(cfg)
    backend, why = select_backend(cfg)
    result["backend"], result["backend_reason"] = backend, why
    if backend == "unsloth":
        import unsloth  # noqa: F401 - patch transformers/TRL before anything else imports them
    import torch

    if t.torch_threads > 0:
        torch.set_num_threads(t.torch_threads)
    probe_optimizer(t.optim)
    import apexw_hf  # noqa: F401 - registers the apexw_* optim names with transformers

    from .data import load_chat_data, tokenize_chat

    prepared = prepared or prepare_base(cfg, out_dir, verbose=verbose)
    precision = resolve_precision(cfg)
    if verbose:
        print(
            f"[apexw recipe] backend: {backend} ({why}); {t.finetuning} fine-tuning, {result['param_dtype']} "
            f"parameters, precision {precision}; optim {t.optim}; lr "
            f"{t.learning_rate}; seed {t.seed}",
            flush=True,
        )
    data = load_chat_data(cfg.data, verbose=verbose)
    gpu_lock = _acquire_gpu_lock(result)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t_load = time.time()
    model, tok = load_model_and_tokenizer(cfg, prepared, backend, precision, t.seed)
    train_ds = tokenize_chat(data.train, tok, cfg.model.max_seq_length, cfg.data.train_on_responses_only)
    val_ds = tokenize_chat(data.validation, tok, cfg.model.max_seq_length, cfg.data.train_on_responses_only)
    n_train_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    timer = _StepTimer()
    trainer, state_cb = _make_trainer(cfg, model, tok, train_ds, val_ds, out_dir, precision, timer, result)
    t_train = time.time()
    train_out = trainer.train()
    t_train_end = time.time()
    mem = _optimizer_facts(cfg, trainer.optimizer, model, result)
    result.update(_process_facts())
    result.update(_training_facts(cfg, trainer, train_out, timer, bool(mem.get("gradient_release"))))
    result.update(
        {
            "trainable_params": n_train_params,
            "train_samples": len(train_ds),
            "validation_samples": len(val_ds),
            "data_source": data.source,
            "precision": precision,
        }
    )
    if val_ds:
        result["validation_loss"] = trainer.evaluate()["eval_loss"]
    t_end = time.time()
    result["timing_s"] = {
        "startup_to_model_load": round(t_load - _T0, 2),
        "model_load_and_data": round(t_train - t_load, 2),
        "train": round(t_train_end - t_train, 2),
        "eval": round(t_end - t_train_end, 2),
        "total": round(t_end - _T0, 2),
    }
    result["log_history"] = trainer.state.log_history
    result["environment"] = _environment(backend)
    result["prepared"] = prepared
    del gpu_lock  # released when this process exits
    if state_cb is not None:
        result["callback"] = type(state_cb).__name__
    return result


def _write(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    tmp.replace(path)


def _warm_cpu_kernels(cfg: RecipeConfig) -> None:
    """On a machine without CUDA, compile ApexW's fused CPU kernels (numba, cached on disk) once before a grid whose
    optimizers use them, so that the first runs' steps/s do not include the compile (~6 s on 2 cores)."""
    import torch

    names = {split_optimizer_spec(o)[0] for o in [*cfg.compare.optimizers, cfg.train.optim]}
    if torch.cuda.is_available() or not names & {"apexw_8bit", "apexw_4bit"}:
        return
    from apexw_hf.engines.torch import numba_engine
    from apexw_hf.optim import ApexW

    module = numba_engine()
    if module is not None:
        print(f"[apexw recipe] CPU kernels (numba) compiled or loaded in {module.warm_up(ApexW):.1f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="One fine-tune from a recipe config (see apexw_hf.recipe).")
    ap.add_argument("--config", default="offline_default", help="YAML path or shipped config name")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--optim", help="an optim name, optionally with the parameter dtype: apexw_8bit@bf16")
    ap.add_argument("--lr", type=float), ap.add_argument("--seed", type=int)
    ap.add_argument("--output-dir", default=None, help="default: <compare.output_dir>/single")
    ap.add_argument("--prepared", default=None, help="JSON file written by prepare_base (the runner passes it)")
    ap.add_argument("--prepare-only", action="store_true", help="only build the shared base model/tokenizer")
    args = ap.parse_args(argv)
    overrides = list(args.overrides)
    optim, dtype = split_optimizer_spec(args.optim) if args.optim else (None, None)
    for key, val in (("optim", optim), ("param_dtype", dtype), ("learning_rate", args.lr), ("seed", args.seed)):
        if val is not None:
            overrides.append(f"train.{key}={val}")
    cfg = load_config(args.config, overrides)
    if args.optim and args.optim in cfg.compare.optim_args:  # this grid cell's own optim_args
        cfg.train.optim_args = cfg.compare.optim_args[args.optim]
    out_dir = Path(args.output_dir or Path(cfg.compare.output_dir) / "single")
    if args.prepare_only:
        prepared = prepare_base(cfg, out_dir)
        _write(out_dir / "prepared_paths.json", prepared)
        _warm_cpu_kernels(cfg)
        return 0
    prepared = json.loads(Path(args.prepared).read_text()) if args.prepared else None
    result_path = out_dir / "result.json"
    try:
        result = run_finetune(cfg, out_dir, prepared)
    except SkipRun as exc:
        result = {
            "status": "skipped",
            "reason": str(exc),
            "optimizer": _run_key(cfg),
            "optimizer_label": optimizer_label(_run_key(cfg)),
            "learning_rate": cfg.train.learning_rate,
            "seed": cfg.train.seed,
        }
        print(f"[apexw recipe] SKIPPED {cfg.train.optim}: {exc}", flush=True)
        _write(result_path, result)
        return 0
    except Exception as exc:  # noqa: BLE001 - the failure is recorded for the runner, then re-raised via exit code
        traceback.print_exc()
        _write(
            result_path,
            {
                "status": "failed",
                "reason": f"{type(exc).__name__}: {exc}",
                "optimizer": _run_key(cfg),
                "learning_rate": cfg.train.learning_rate,
                "seed": cfg.train.seed,
                "traceback": traceback.format_exc()[-4000:],
            },
        )
        return 1
    _write(result_path, result)
    v = result.get("validation_loss")
    print(
        f"[apexw recipe] done: {result['global_steps']} steps, train loss {result['initial_train_loss']:.3f} -> "
        f"{result['final_train_loss']:.3f}, validation loss {v if v is None else round(v, 4)}, "
        f"{result['steps_per_s']:.2f} steps/s, optimizer state {result['optimizer_state_mib']:.3f} MiB "
        f"-> {result_path}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
