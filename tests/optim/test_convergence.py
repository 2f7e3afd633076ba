"""Training small models: ApexW's final loss stays within a stated margin of torch.optim.AdamW's, over seeds."""

import statistics

import pytest
import torch

from apexw_hf import ApexW

SEEDS = (0, 1, 2)


def _teacher_student(seed, make_opt, steps=150):
    torch.manual_seed(seed)
    teacher = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    x = torch.randn(512, 16)
    y = teacher(x).argmax(-1)
    torch.manual_seed(100 + seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 128), torch.nn.GELU(), torch.nn.LayerNorm(128), torch.nn.Linear(128, 4)
    )
    opt = make_opt(model.parameters())
    for i in range(steps):
        idx = torch.arange(i * 64, i * 64 + 64) % 512
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(model(x), y).item()


def _tiny_llama(seed, make_opt, steps=60):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg)
    gen = torch.Generator().manual_seed(seed)
    # a learnable language: each sequence counts upward from a random start, modulo the vocabulary
    starts = torch.randint(0, 64, (256, 1), generator=gen)
    data = (starts + torch.arange(24)) % 64
    opt = make_opt(model.parameters())
    for i in range(steps):
        batch = data[(i * 16) % 256 : (i * 16) % 256 + 16]
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return model(input_ids=data, labels=data).loss.item()


# A quantized or bf16 state must not cost more than a small fraction of the loss torch reaches. Margins (relative to
# torch AdamW's mean final loss over 3 seeds): compact 3%, 8bit 5%. On this CPU test the gaps measured were within
# +-0.01% (compact) and -0.2% (8bit) on both tasks, where the losses fell from 1.6 to 0.06 and from 4.2 to 0.25.
# 4bit, 10%: measured -16% (mlp) and -21% (tiny_llama) with the reference's 4-bit numerics: lower losses than torch at
# this lr (its powers-of-two v makes the mean step larger, E[1/sqrt(v)] over the rounding exceeds 1/sqrt(E[v])),
# which a one-sided margin accepts; whether that holds at a tuned lr is what a grid over learning rates shows.
MARGIN = {"fp32": 0.001, "compact": 0.03, "8bit": 0.05, "4bit": 0.10}


@pytest.mark.parametrize("task, lr", [(_teacher_student, 3e-3), (_tiny_llama, 3e-3)], ids=["mlp", "tiny_llama"])
@pytest.mark.parametrize("fmt", ["fp32", "compact", "8bit", "4bit"])
def test_final_loss_close_to_torch_adamw(task, lr, fmt):
    torch_losses = [task(s, lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.01)) for s in SEEDS]
    ours = [task(s, lambda ps, s=s: ApexW(ps, lr=lr, weight_decay=0.01, state_format=fmt, seed=s)) for s in SEEDS]
    start = task(0, lambda ps: torch.optim.AdamW(ps, lr=0.0)) if fmt == "fp32" else None
    if start is not None:
        assert statistics.mean(torch_losses) < 0.5 * start, "the task must really be learned"
    gap = (statistics.mean(ours) - statistics.mean(torch_losses)) / statistics.mean(torch_losses)
    assert gap < MARGIN[fmt], (ours, torch_losses)
