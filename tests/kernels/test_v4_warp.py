"""The kernel's ``v4_warp_scaled`` (the 4-bit ``v`` warp and the ``2**-112`` product in one helper, with the warp's
exponent restored by a multiplication instead of integer additions) against ``reference.v4_log_warp(y) * 2**-112``,
bit for bit, for every fp32 mantissa in the binades where the two formulations differ in their steps: subnormal
``y`` (the reference keeps a subnormal, the kernel a zero: both vanish in the product), the binades whose product is
subnormal or rounds to zero or to the smallest subnormal, the subnormal/normal boundary of the product, ordinary
binades, and ``y = 1``.
"""

import pytest
import torch
import triton
import triton.language as tl

from apexw_hf import reference as ref
from apexw_hf.engines.triton.kernels._quant import v4_warp_scaled

from .helpers import DEVICE, INTERPRETED, mismatch, same_bits

BLOCK = 1 << 20 if INTERPRETED else 1 << 12  # the interpreter runs a program as numpy arrays; a GPU, in registers


@triton.jit
def _warp_kernel(y_ptr, out_ptr, one_f32, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    y = tl.load(y_ptr + offs)
    t = v4_warp_scaled(y, one_f32.to(tl.uint32, bitcast=True))
    tl.store(out_ptr + offs, t)


def _binade(exp_field: int) -> torch.Tensor:
    """Every fp32 with this exponent field (all 2**23 mantissas), as int32 bits."""
    return (torch.arange(1 << 23, dtype=torch.int32) | (exp_field << 23)).view(torch.float32)


# 0: subnormal y; 1: the smallest normal binade; 88-90: products below, at and above half the smallest subnormal;
# 112-114: around the product's subnormal/normal boundary (2**-14 before the product); 126: y in [0.5, 1)
@pytest.mark.parametrize("exp_field", [0, 1, 88, 89, 90, 100, 112, 113, 114, 126])
def test_v4_warp_scaled_every_mantissa(exp_field):
    y = _binade(exp_field)
    if exp_field == 126:
        y = torch.cat([y, torch.tensor([1.0])])
        y = torch.cat([y, torch.zeros(BLOCK - y.numel() % BLOCK)])
    want = ref.v4_log_warp(y) * torch.tensor(2.0**-112, dtype=torch.float32)
    out = torch.empty(y.numel(), dtype=torch.float32, device=DEVICE)
    _warp_kernel[(y.numel() // BLOCK,)](
        y.to(DEVICE), out, 0x3F800000, BLOCK=BLOCK, num_warps=4, enable_fp_fusion=False
    )
    assert same_bits(out.cpu(), want), mismatch(out.cpu(), want)
