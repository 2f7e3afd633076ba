"""Shared helpers of the kernel tests."""

import torch

from apexw_hf.kernels import INTERPRETED

DEVICE = "cpu" if INTERPRETED or not torch.cuda.is_available() else "cuda"
SHAPES = [(1,), (255,), (256,), (257,), (4095,), (4097,), (33, 65)]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal, except that any NaN matches any NaN (payloads differ between CPU and CUDA conversions)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.dtype.is_floating_point:
        return torch.equal(a, b)
    na, nb = torch.isnan(a), torch.isnan(b)
    if not torch.equal(na, nb):
        return False
    ia = a.view({2: torch.int16, 4: torch.int32}[a.element_size()])
    ib = b.view({2: torch.int16, 4: torch.int32}[b.element_size()])
    return torch.equal(ia[~na], ib[~nb])


def mismatch(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}"
    d = (a != b) & ~(a.isnan() & b.isnan()) if a.dtype.is_floating_point else a != b
    idx = d.reshape(-1).nonzero()[:5].flatten().tolist()
    return f"{int(d.sum())} differ, first at {idx}: {a.reshape(-1)[idx].tolist()} vs {b.reshape(-1)[idx].tolist()}"
