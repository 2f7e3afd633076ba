"""Shared helpers for the optimizer tests."""

import torch

FORMATS = ("fp32", "compact", "8bit", "4bit")
SHAPES = [(1,), (255,), (256,), (257,), (4095,), (4097,), (33, 65)]


def make_grads(shape, steps, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=g) * (1 + i % 3)).to(dtype) for i in range(steps)]


def run_steps(opt, params, grads_per_param):
    for step_grads in zip(*grads_per_param):
        for p, g in zip(params, step_grads):
            p.grad = None if g is None else g.clone()
        opt.step()


def relative_deviation(a, b, start):
    """How far apart two trajectories ended, relative to how far the reference travelled."""
    return ((a.double() - b.double()).norm() / (b.double() - start.double()).norm()).item()


def lora_3b_shapes():
    """The 392 LoRA tensors of Llama-3.2-3B with r=16 on all 7 projections (FACTS.md)."""
    dims = {
        "q": (3072, 3072),
        "k": (3072, 1024),
        "v": (3072, 1024),
        "o": (3072, 3072),
        "gate": (3072, 8192),
        "up": (3072, 8192),
        "down": (8192, 3072),
    }
    shapes = []
    for _ in range(28):
        for fan_in, fan_out in dims.values():
            shapes += [(16, fan_in), (fan_out, 16)]
    return shapes


_INT_VIEW = {4: torch.int32, 2: torch.int16, 1: torch.int8}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal, except that any NaN matches any NaN (IEEE leaves the sign and payload of NaN to the hardware, and
    they differ between CPU and CUDA conversions)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.dtype.is_floating_point:
        return torch.equal(a, b)
    na, nb = torch.isnan(a), torch.isnan(b)
    if not torch.equal(na, nb):
        return False
    bits = _INT_VIEW[a.element_size()]
    return torch.equal(a.view(bits)[~na], b.view(bits)[~nb])
