"""Tiny Llama, tokenizer and data for the integration tests (no pytest import: also used by subprocess scripts).

Nothing is downloaded: the model comes from a ``LlamaConfig``, the tokenizer is trained in-process with
``tokenizers``, the data is generated.
"""

from __future__ import annotations

from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
NAMES = ("apexw_8bit", "apexw_compact", "apexw_4bit")
VOCAB = 64
SEQ = 16

WORDS = [f"w{i}" for i in range(VOCAB - 4)]


def make_tokenizer():
    """A word-level tokenizer trained in-process on the synthetic vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(special_tokens=["<pad>", "<unk>", "<s>", "</s>"], vocab_size=VOCAB)
    tok.train_from_iterator([" ".join(WORDS)] * 2, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def make_model(lora: bool = True, seed: int = 0, modules_to_save: list[str] | None = None):
    """A 2-layer Llama (hidden 32) from a config, with a LoRA adapter on all 7 projections."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
    )
    model = LlamaForCausalLM(config)
    if not lora:
        return model
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, modules_to_save=modules_to_save)
    return get_peft_model(model, config)


def token_dataset(n: int = 32, seed: int = 0):
    """Pre-tokenized rows (input_ids, attention_mask, labels) following a learnable pattern. Skips the calling test
    where ``datasets`` is not installed (a GPU host's image may lack it; the project's dev install has it)."""
    import pytest

    Dataset = pytest.importorskip("datasets").Dataset

    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        start = int(torch.randint(4, VOCAB - SEQ, (1,), generator=g))
        ids = list(range(start, start + SEQ))
        rows.append({"input_ids": ids, "attention_mask": [1] * SEQ, "labels": ids})
    return Dataset.from_list(rows)


def text_dataset(n: int = 32, seed: int = 0):
    """Plain-text rows for TRL's SFTTrainer (tokenized by the in-process tokenizer)."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        start = int(torch.randint(0, len(WORDS) - SEQ, (1,), generator=g))
        rows.append({"text": " ".join(WORDS[start : start + SEQ])})
    return Dataset.from_list(rows)


def train_kwargs(tmp_path, **overrides):
    """TrainingArguments keywords for a few quick deterministic CPU steps."""
    kw = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        learning_rate=1e-2,
        max_steps=4,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        optim_args="engine=torch",
    )
    kw.update(overrides)
    return kw


def make_trainer(out_dir, *, model=None, rows: int = 32, trainer_cls=None, trainer_kwargs=None, **overrides):
    """The integration tests' Trainer: ``trainer_cls`` (default ``transformers.Trainer``) over ``model`` (default
    ``make_model()``, the LoRA tiny Llama) and ``token_dataset(rows)``, with
    ``TrainingArguments(**train_kwargs(out_dir, **overrides))``; ``trainer_kwargs``: further Trainer arguments
    (``callbacks``, ``optimizer_cls_and_kwargs``)."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(**train_kwargs(out_dir, **overrides))
    return (trainer_cls or Trainer)(
        model=make_model() if model is None else model,
        args=args,
        train_dataset=token_dataset(rows),
        **(trainer_kwargs or {}),
    )
