"""The tiny model and training loop of the gradient release tests (tests/optim, tests/kernels): a tied embedding, two
blocks (optionally checkpointed), a frozen tensor, a bias, and a fixed batch per step."""

from __future__ import annotations

import torch
import torch.utils.checkpoint as ckpt


class TinyLM(torch.nn.Module):
    """Embedding tied to the output layer, two blocks (optionally checkpointed), a frozen tensor, a bias."""

    def __init__(self, vocab=40, dim=16, checkpoint=None, dtype=torch.float32):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim, dtype=dtype)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.Linear(dim, 3 * dim, dtype=dtype), torch.nn.GELU(), torch.nn.Linear(3 * dim, dim, dtype=dtype)
            )
            for _ in range(2)
        )
        self.norm = torch.nn.LayerNorm(dim, dtype=dtype)
        self.frozen = torch.nn.Parameter(torch.randn(dim, dtype=dtype), requires_grad=False)
        self.head = torch.nn.Linear(dim, vocab, bias=False, dtype=dtype)
        self.head.weight = self.emb.weight
        self.checkpoint = checkpoint

    def forward(self, x):
        h = self.emb(x) + self.frozen
        for block in self.blocks:
            if self.checkpoint is None:
                h = h + block(h)
            else:
                h = h + ckpt.checkpoint(block, h, use_reentrant=self.checkpoint == "reentrant")
        return self.head(self.norm(h))


def make(seed=0, **kw):
    torch.manual_seed(seed)
    return TinyLM(**kw)


def groups(model, lr=2e-2):
    decay = [p for n, p in model.named_parameters() if p.ndim == 2]
    rest = [p for n, p in model.named_parameters() if p.ndim != 2]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": lr / 2}]


def loss_of(model, step):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, 40, (3, 9), generator=g).to(model.emb.weight.device)
    logits = model(x).float()
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.roll(1, 1).flatten())


def train_from(model, opt, step):
    """One training step on the batch of step ``step``; with release, no gradient may outlive the backward pass."""
    loss_of(model, step).backward()
    if opt.gradient_release:
        assert all(p.grad is None for p in model.parameters()), "a gradient outlived its backward pass"
    opt.step()
    opt.zero_grad()


def train_tied_from(model, opt, step):
    """One training step with ``tied_grad_offload``: the tied weight's output-layer part is hooked before backward, and
    after it no gradient is left on the parameters and no part is still away from its weight."""
    loss = loss_of(model, step)
    assert opt.before_backward(loss, model) == 1
    loss.backward()
    assert all(p.grad is None for p in model.parameters()) and not opt._release.offload.pending()
    opt.step()
    opt.zero_grad()


def train(model, opt, steps, sched=None):
    for t in range(steps):
        train_from(model, opt, t)
        if sched is not None:
            sched.step()
