"""Shared helpers of the kernel tests."""

import torch

from apexw_hf.engines.triton.kernels import INTERPRETED

from ..optim.helpers import same_bits  # noqa: F401  (the kernel tests import it from here)

DEVICE = "cpu" if INTERPRETED or not torch.cuda.is_available() else "cuda"
SHAPES = [(1,), (255,), (256,), (257,), (4095,), (4097,), (33, 65)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def mismatch(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}"
    d = (a != b) & ~(a.isnan() & b.isnan()) if a.dtype.is_floating_point else a != b
    idx = d.reshape(-1).nonzero()[:5].flatten().tolist()
    return f"{int(d.sum())} differ, first at {idx}: {a.reshape(-1)[idx].tolist()} vs {b.reshape(-1)[idx].tolist()}"
