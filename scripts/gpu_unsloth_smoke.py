"""GPU smoke test of the Unsloth integration (issue 4): an Unsloth SFTTrainer run with each ApexW name, fp16 and bf16.

A small random Llama is built from a config, saved with a tokenizer trained in-process to a local directory, and
loaded by Unsloth with ``load_in_4bit=True`` (nothing is downloaded). For every (optim, precision) pair the script
trains LoRA (r=16, all 7 projections) for a few steps through TRL's SFTTrainer as patched by Unsloth, with
``OptimizerStateCallback``, and records the optimizer class, whether the Triton engine ran, the state dtypes, the
losses, the optimizer-state MiB and the peak GPU memory. bitsandbytes' ``adamw_8bit`` runs once as the reference
for the accounting. Losses measure learning a synthetic task from random weights, nothing more.

Run on an offline GPU host (see ../shared/gpu/README.md), from the repository root:
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
    APEXW_COMMIT=<commit> python3 scripts/gpu_unsloth_smoke.py --out $OUT   # the copy there may have no .git
Exit status 0 only if every run trained with the optimizer it asked for and finite, decreasing losses.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import unsloth  # noqa: E402,F401  (first, as Unsloth asks)
from unsloth import FastLanguageModel  # noqa: E402

import apexw_hf  # noqa: E402
from apexw_hf.accounting import unwrap_optimizer  # noqa: E402
from apexw_hf.integrations.callbacks import OptimizerStateCallback  # noqa: E402

WORDS = [f"w{i}" for i in range(1020)]
LR = 2e-3
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_model_dir(path: Path) -> None:
    """A 4-layer random Llama (hidden 512) and a word-level tokenizer, saved for from_pretrained."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(
        [" ".join(WORDS)] * 2,
        trainer=trainers.WordLevelTrainer(special_tokens=["<pad>", "<unk>", "<s>", "</s>"], vocab_size=1024),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.model_max_length = 512
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)


def dataset(n: int = 64):
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        start = int(torch.randint(0, len(WORDS) - 64, (1,), generator=g))
        rows.append({"text": " ".join(WORDS[start : start + 64])})
    return Dataset.from_list(rows)


def one_run(model_dir: Path, out_dir: Path, optim: str, precision: str, steps: int, variant: str = "sft") -> dict:
    """One training run; variant "loraplus" uses UnslothTrainer with loraplus_lr_ratio=16 (its own param groups)."""
    from trl import SFTConfig, SFTTrainer
    from unsloth import UnslothTrainer, UnslothTrainingArguments

    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=str(model_dir.resolve()), max_seq_length=128, dtype=dtype, load_in_4bit=True
    )
    model = FastLanguageModel.get_peft_model(
        model,
        r=16,
        lora_alpha=16,
        lora_dropout=0,
        bias="none",
        target_modules=TARGETS,
        use_gradient_checkpointing="unsloth",
        random_state=3407,
    )
    config_cls, trainer_cls = (
        (UnslothTrainingArguments, UnslothTrainer) if variant == "loraplus" else (SFTConfig, SFTTrainer)
    )
    extra = {"loraplus_lr_ratio": 16.0} if variant == "loraplus" else {}
    config = config_cls(
        output_dir=str(out_dir / f"{optim}_{precision}_{variant}"),
        optim=optim,
        learning_rate=LR,
        weight_decay=0.001,
        warmup_steps=2,
        lr_scheduler_type="linear",
        max_steps=steps,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        logging_steps=1,
        fp16=precision == "fp16",
        bf16=precision == "bf16",
        max_length=128,
        dataset_text_field="text",
        report_to=[],
        save_strategy="no",
        seed=3407,
        disable_tqdm=True,
        **extra,
    )
    trainer = trainer_cls(
        model=model,
        args=config,
        train_dataset=dataset(),
        processing_class=tokenizer,
        callbacks=[OptimizerStateCallback()],
    )
    t0 = time.perf_counter()
    trainer.train()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    opt = unwrap_optimizer(trainer.optimizer)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    params = [p for g in opt.param_groups for p in g["params"]]
    row = {
        "optim": optim,
        "precision": precision,
        "variant": variant,
        "group_lrs": sorted({g.get("initial_lr", g["lr"]) for g in opt.param_groups}),
        "optimizer": type(opt).__name__,
        "triton_engine": getattr(opt, "_engine", None) is not None,
        "param_dtypes": sorted({str(p.dtype) for p in params}),
        "state_dtypes": sorted({str(v.dtype) for s in opt.state.values() for v in s.values() if torch.is_tensor(v)}),
        "trainable_params": sum(p.numel() for p in params),
        "losses": [h["loss"] for h in logs],
        "optimizer_state_mib": logs[-1].get("optimizer_state_mib"),
        "state_bytes_per_param": logs[-1].get("optimizer_state_bytes_per_param"),
        "peak_gpu_memory_gib": logs[-1].get("peak_gpu_memory_gib"),
        "steps_per_s": steps / elapsed,
    }
    del trainer, model, opt
    return row


def check(row: dict, lr: float) -> list[str]:
    problems = []
    if row["variant"] == "loraplus" and row["group_lrs"] != [lr, 16 * lr]:
        problems.append(f"LoRA+ groups have learning rates {row['group_lrs']}, expected [{lr}, {16 * lr}]")
    # transformers builds bitsandbytes' AdamW(optim_bits=8) for adamw_8bit
    classes = {
        "apexw_8bit": "ApexW8bit",
        "apexw_compact": "ApexWCompact",
        "apexw_4bit": "ApexW4bit",
        "adamw_8bit": "AdamW",
    }
    want = classes[row["optim"]]
    if row["optimizer"] != want:
        problems.append(f"optimizer is {row['optimizer']}, expected {want}")
    losses = row["losses"]
    if not losses or not all(math.isfinite(x) for x in losses):
        problems.append(f"non-finite losses {losses}")
    elif not losses[-1] < losses[0]:
        problems.append(f"loss did not decrease: {losses[0]:.4f} -> {losses[-1]:.4f}")
    if row["optim"].startswith("apexw") and not row["triton_engine"]:
        problems.append("the Triton engine did not run (engine='auto' on CUDA parameters should use it)")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "outputs/gpu_unsloth_smoke"))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--optims", default="apexw_8bit,apexw_compact")
    ap.add_argument("--precisions", default="fp16,bf16")
    ap.add_argument("--no-baseline", action="store_true", help="skip the bitsandbytes adamw_8bit reference run")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = Path("/tmp/apexw_smoke_llama")
    build_model_dir(model_dir)

    runs = [(o, p, "sft") for o in a.optims.split(",") for p in a.precisions.split(",")]
    runs.append(("apexw_8bit", "bf16", "loraplus"))
    if not a.no_baseline:
        runs.append(("adamw_8bit", "bf16", "sft"))
    rows, failures = [], 0
    for optim, precision, variant in runs:
        try:
            row = one_run(model_dir, out, optim, precision, a.steps, variant)
            row["problems"] = check(row, LR)
        except Exception as exc:  # record and go on: one failing run must not hide the others
            row = {"optim": optim, "precision": precision, "variant": variant}
            row["problems"] = [f"{type(exc).__name__}: {exc}"]
            traceback.print_exc()
        failures += bool(row["problems"])
        rows.append(row)
        print("ROW", json.dumps(row), flush=True)

    try:
        proc = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True)
        commit = proc.stdout.strip() if proc.returncode == 0 else os.environ.get("APEXW_COMMIT", "unknown")
    except OSError:
        commit = os.environ.get("APEXW_COMMIT", "unknown")
    import transformers
    import trl

    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": trl.__version__,
        "unsloth": unsloth.__version__,
        "apexw_hf": apexw_hf.__version__,
        "python": platform.python_version(),
        "commit": commit,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "note": "random-weight Llama (hidden 512, 4 layers) in 4-bit, synthetic text: losses are from-scratch",
    }
    (out / "gpu_unsloth_smoke.json").write_text(json.dumps({"meta": meta, "runs": rows}, indent=1))
    print(json.dumps(meta))
    print(
        f"{'optim':<14}{'prec':<6}{'variant':<10}{'optimizer':<14}{'triton':<8}{'loss first->last':<20}"
        f"{'state MiB':>10}{'B/param':>9}{'peak GiB':>10}{'it/s':>7}  problems"
    )
    for r in rows:
        losses = r.get("losses") or [float("nan")]
        print(
            f"{r['optim']:<14}{r['precision']:<6}{r['variant']:<10}{r.get('optimizer', '-'):<14}"
            f"{str(r.get('triton_engine', '-')):<8}"
            f"{losses[0]:>7.4f} -> {losses[-1]:<9.4f}{r.get('optimizer_state_mib') or float('nan'):>10.4f}"
            f"{r.get('state_bytes_per_param') or float('nan'):>9.3f}"
            f"{r.get('peak_gpu_memory_gib') or float('nan'):>10.3f}"
            f"{r.get('steps_per_s', float('nan')):>7.2f}  {'; '.join(r['problems']) or 'ok'}"
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
