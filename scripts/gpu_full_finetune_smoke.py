"""GPU check of full fine-tuning with the model itself in bf16 through each stack.

For every stack the script trains a small random Llama (built from a config, saved in bf16 to a local directory with
a tokenizer trained in-process; nothing is downloaded) for a few steps with every trainable parameter and records:
the dtypes of the trainable parameters before and after training (a stack that upcasts them, or keeps an fp32 copy in
their place, shows here), the optimizer class and whether its Triton engine ran, the parameter rounding of its
groups, the dtypes held in the optimizer state (an fp32 master copy would appear there as fp32 tensors of the
parameters' sizes), optimizer-state bytes per parameter, peak GPU memory and the losses.

Stacks (each in its own process, because Unsloth patches transformers and TRL when imported):

* ``trainer``: ``transformers.Trainer`` with ``TrainingArguments(bf16=True)`` on a model loaded in bf16;
* ``sft``: TRL's ``SFTTrainer`` given the model object loaded in bf16, and given the model's *path* with
  ``model_init_kwargs={"dtype": "bfloat16"}`` (TRL loads a path in float32 unless told otherwise);
* ``sft_path_default``: ``SFTTrainer`` given the path without ``model_init_kwargs``: records what a user gets;
* ``unsloth``: ``FastLanguageModel.from_pretrained(..., dtype=torch.bfloat16, full_finetuning=True)`` and the
  SFTTrainer as Unsloth patches it;
* ``fp16``: a model in fp16 with ``fp16=True``: the run must stop with apexw_hf's error naming what to do.

Run on an offline GPU host (see ../shared/gpu/README.md), from the repository root:
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1
    APEXW_COMMIT=<commit> python3 scripts/gpu_full_finetune_smoke.py --out $OUT
Exit status 0 only if every check held.
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

WORDS = [f"w{i}" for i in range(1020)]
LR = 1e-3
STEPS = 16
STACKS = ("trainer", "sft", "sft_path_default", "unsloth", "fp16")
OPTIMS = ("apexw_8bit", "apexw_compact")


def build_model_dir(path: Path) -> None:
    """A 4-layer random Llama (hidden 512) in bf16 and a word-level tokenizer, saved for from_pretrained."""
    import torch
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
    tokenizer.chat_template = None
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
        dtype="bfloat16",
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    tokenizer.save_pretrained(path)


def text_dataset(n: int = 64):
    from datasets import Dataset

    rows = []
    for i in range(n):
        start = (37 * i) % (len(WORDS) - 32)
        rows.append({"text": " ".join(WORDS[start : start + 32])})
    return Dataset.from_list(rows)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _train_kwargs(out: Path, optim: str) -> dict:
    """The arguments every stack's run shares (TrainingArguments and SFTConfig alike)."""
    return dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        max_steps=STEPS,
        learning_rate=LR,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        optim=optim,
        seed=0,
        use_cpu=not _cuda(),
    )


def _sft_config(out: Path, optim: str, **kw):
    from trl import SFTConfig

    return SFTConfig(**_train_kwargs(out, optim), max_length=48, dataset_text_field="text", packing=False, **kw)


def _record(trainer, model, before_dtypes, optim: str, stack: str, t0: float) -> dict:
    import torch

    from apexw_hf.accounting import optimizer_state_bytes, unwrap_optimizer

    opt = unwrap_optimizer(trainer.optimizer)
    params = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    sizes = {p.numel() for p in params}
    state_dtypes: dict[str, int] = {}
    fp32_param_sized = 0
    for st in opt.state.values():
        for v in st.values():
            if torch.is_tensor(v):
                state_dtypes[str(v.dtype)] = state_dtypes.get(str(v.dtype), 0) + v.numel()
                if v.dtype == torch.float32 and v.numel() in sizes and v.numel() > 1:
                    fp32_param_sized += 1
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    after_dtypes = sorted({str(p.dtype) for p in params})
    # which trainable parameters are not bf16 (name, dtype, elements): a stack that keeps some in fp32 shows here
    not_bf16 = [(name, str(p.dtype), p.numel()) for name, p in model.named_parameters() if p.requires_grad]
    not_bf16 = [t for t in not_bf16 if t[1] != "torch.bfloat16"]
    row = {
        "stack": stack,
        "optim": optim,
        "optimizer": type(opt).__name__,
        "triton_engine": getattr(opt, "_engine", None) is not None,
        "param_rounding": sorted({str(g.get("param_rounding")) for g in opt.param_groups}),
        "param_dtypes_before": before_dtypes,
        "param_dtypes_after": after_dtypes,
        "params_not_bf16": not_bf16[:40],
        "params_not_bf16_count": len(not_bf16),
        "params_not_bf16_elements": sum(t[2] for t in not_bf16),
        "state_dtypes": state_dtypes,
        "fp32_param_sized_state_tensors": fp32_param_sized,
        "trainable_params": n,
        "state_bytes_per_param": optimizer_state_bytes(trainer.optimizer) / n,
        "peak_gpu_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        "losses": losses,
        "seconds": round(time.time() - t0, 1),
    }
    problems = []
    # Unsloth's full fine-tuning loads the RMSNorm weights in fp32 (found on an H200 at 5cd725d): they are the
    # model's own fp32 parameters (0.04% of this model), stepped in fp32, not a copy of bf16 weights; anything else
    # that is not bf16 is a problem
    unexpected = [t for t in not_bf16 if not (stack == "unsloth" and t[0].endswith("norm.weight"))]
    if unexpected:
        names = ", ".join(f"{t[0]} ({t[1]}, {t[2]})" for t in unexpected[:4])
        problems.append(
            f"trainable parameters are {after_dtypes} after training, not bf16: {len(unexpected)} parameters with "
            f"{sum(t[2] for t in unexpected)} of {n} elements, e.g. {names}"
        )
    if fp32_param_sized:
        problems.append(f"{fp32_param_sized} fp32 state tensors of parameter size (a master copy?)")
    if not row["triton_engine"]:
        problems.append("the Triton engine did not run")
    if row["param_rounding"] != ["stochastic"]:
        problems.append(f"param_rounding {row['param_rounding']}")
    if len(losses) < 8 or not all(map(math.isfinite, losses)) or not sum(losses[-4:]) < sum(losses[:4]):
        problems.append(f"losses not finite and decreasing: {losses}")
    row["problems"] = problems
    return row


def run_stack(stack: str, model_dir: Path, out: Path) -> list[dict]:
    rows = []
    if stack == "unsloth":
        import unsloth  # noqa: F401  (first, as Unsloth asks)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import apexw_hf  # noqa: F401  registers the optim names

    tok = AutoTokenizer.from_pretrained(model_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU only to try the script out
    for optim in OPTIMS:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        t0 = time.time()
        try:
            if stack == "unsloth":
                from trl import SFTTrainer
                from unsloth import FastLanguageModel

                model, tok = FastLanguageModel.from_pretrained(
                    model_name=str(model_dir.resolve()),
                    max_seq_length=64,
                    dtype=torch.bfloat16,
                    load_in_4bit=False,
                    full_finetuning=True,
                )
                before = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad})
                cfg = _sft_config(out / f"{stack}_{optim}", optim, bf16=True)
                trainer = SFTTrainer(model=model, args=cfg, train_dataset=text_dataset(), processing_class=tok)
            elif stack in ("sft", "sft_path_default"):
                from trl import SFTTrainer

                kw = {"model_init_kwargs": {"dtype": "bfloat16"}} if stack == "sft" else {}
                cfg = _sft_config(out / f"{stack}_{optim}", optim, bf16=True, **kw)
                trainer = SFTTrainer(
                    model=str(model_dir), args=cfg, train_dataset=text_dataset(), processing_class=tok
                )
                model = trainer.model
                before = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad})
            else:
                from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

                dtype = torch.float16 if stack == "fp16" else torch.bfloat16
                model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
                before = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad})
                ds = text_dataset().map(
                    lambda r, tok=tok: tok(r["text"], truncation=True, max_length=48), remove_columns=["text"]
                )
                args = TrainingArguments(
                    **_train_kwargs(out / f"{stack}_{optim}", optim), bf16=stack != "fp16", fp16=stack == "fp16"
                )
                trainer = Trainer(
                    model=model,
                    args=args,
                    train_dataset=ds,
                    data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
                )
            if stack == "fp16":
                try:
                    trainer.train()
                except ValueError as exc:
                    msg = str(exc)
                    ok = "fp16 GradScaler refuses fp16 gradients" in msg and "bf16=True" in msg
                    rows.append(
                        {"stack": stack, "optim": optim, "error": msg, "problems": [] if ok else ["unexpected error"]}
                    )
                else:
                    rows.append({"stack": stack, "optim": optim, "problems": ["trained without the expected error"]})
            else:
                trainer.train()
                row = _record(trainer, model, before, optim, stack, t0)
                if stack == "sft_path_default":
                    # TRL loads a path in float32 by default: the user gets fp32 weights under bf16 autocast (mixed
                    # precision), not a bf16 model. Recorded as what happens, not as a failure of this stack.
                    row["problems"] = [p for p in row["problems"] if "not bf16" not in p]
                    row["note"] = "SFTTrainer(model=<path>) without model_init_kwargs dtype loads float32"
                rows.append(row)
        except Exception as exc:  # noqa: BLE001 - recorded and reported as a failed check
            rows.append(
                {
                    "stack": stack,
                    "optim": optim,
                    "problems": [f"{type(exc).__name__}: {exc}"],
                    "traceback": traceback.format_exc()[-3000:],
                }
            )
        for r in rows[-1:]:
            print("ROW " + json.dumps(r), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/gpu_full_finetune_smoke")
    ap.add_argument("--stack", choices=STACKS, help="run one stack in this process (the parent uses this)")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument(
        "--stacks", default=",".join(STACKS), help=f"comma-separated stacks to run (default: {', '.join(STACKS)})"
    )
    a = ap.parse_args()
    stacks = [s for s in a.stacks.split(",") if s]
    unknown = sorted(set(stacks) - set(STACKS))
    if unknown:
        ap.error(f"unknown stack(s) {', '.join(unknown)}; allowed: {', '.join(STACKS)}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.stack:
        rows = run_stack(a.stack, Path(a.model_dir), out)
        (out / f"rows_{a.stack}.json").write_text(json.dumps(rows, indent=1))
        return 0
    import torch
    import transformers

    model_dir = out / "model"
    build_model_dir(model_dir)
    rows = []
    for stack in stacks:
        cmd = [sys.executable, __file__, "--stack", stack, "--model-dir", str(model_dir), "--out", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        (out / f"{stack}.log").write_text(proc.stdout[-200000:] + "\n--- stderr ---\n" + proc.stderr[-200000:])
        f = out / f"rows_{stack}.json"
        if f.exists():
            rows += json.loads(f.read_text())
        else:
            rows.append({"stack": stack, "problems": [f"process exited {proc.returncode}: {proc.stderr[-800:]}"]})
    from apexw_hf.provenance import source_commit

    env = {
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "commit": source_commit()[0],
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "note": "random-weight Llama (hidden 512, 4 layers) in bf16, synthetic text: losses are from-scratch",
    }
    for mod in ("trl", "unsloth", "triton"):
        try:
            env[mod] = __import__(mod).__version__ if mod != "unsloth" else _version("unsloth")
        except Exception:  # noqa: BLE001 - optional metadata
            env[mod] = None
    (out / "full_finetune_smoke.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    print(json.dumps(env))
    head = f"{'stack':17s} {'optim':14s} {'params after':16s} {'triton':6s} {'state B/param':>13s} {'peak GiB':>8s}  "
    print(head + "loss first->last  problems")
    for r in rows:
        losses = r.get("losses") or []
        loss = f"{losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "-"
        print(
            f"{r['stack']:17s} {r.get('optim', '-'):14s} {','.join(r.get('param_dtypes_after', ['-'])):16s} "
            f"{str(r.get('triton_engine', '-')):6s} {r.get('state_bytes_per_param', float('nan')):13.3f} "
            f"{r.get('peak_gpu_memory_gib') or float('nan'):8.3f}  {loss:16s}  {'; '.join(r['problems']) or 'ok'}"
        )
    return 0 if all(not r["problems"] for r in rows) else 1


def _version(dist: str) -> str | None:
    from importlib.metadata import version

    return version(dist)


if __name__ == "__main__":
    sys.exit(main())
