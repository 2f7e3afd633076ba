"""The kernel's ``v4_warp_scaled_bits`` (the 4-bit ``v`` warp and the ``2**-112`` product in one helper: the warp's
fused multiply-adds, then the exponent moved down as an integer) against ``reference.v4_log_warp``, bit for bit, for
every fp32 mantissa of a binade: from ``2**-14`` on its bits are those of ``reference.v4_log_warp(y) * 2**-112``;
in ``[2**-15, 2**-14)``, where that product is subnormal, they are the warp's mantissa alone (exponent field 0), which
rounds to code 0 or 1 as the subnormal does (and every nonzero ``v`` gets code 1 there anyway,
``test_quant_codes``); below, fp32 subnormals and 0 included, they are 0 (code 0).
"""

import pytest
import torch
import triton
import triton.language as tl

from apexw_hf import reference as ref
from apexw_hf.engines.triton.kernels._quant import v4_warp_scaled_bits

from .helpers import DEVICE, INTERPRETED, mismatch, same_bits

BLOCK = 1 << 20 if INTERPRETED else 1 << 12  # the interpreter runs a program as numpy arrays; a GPU, in registers


@triton.jit
def _warp_kernel(y_ptr, out_ptr, one_f32, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    y = tl.load(y_ptr + offs)
    t = v4_warp_scaled_bits(y, one_f32.to(tl.uint32, bitcast=True))
    tl.store(out_ptr + offs, t.to(tl.int32, bitcast=True))


def _binade(exp_field: int) -> torch.Tensor:
    """Every fp32 with this exponent field (all 2**23 mantissas)."""
    return (torch.arange(1 << 23, dtype=torch.int32) | (exp_field << 23)).view(torch.float32)


# 0: fp32 subnormals (and 0); 1, 100, 111: below 2**-15; 112: y in [2**-15, 2**-14), the product's subnormal range;
# 113-114: from the smallest normal product on; 120, 126: ordinary binades, the last one [0.5, 1), then y = 1
@pytest.mark.parametrize("exp_field", [0, 1, 100, 111, 112, 113, 114, 120, 126])
def test_v4_warp_scaled_bits_every_mantissa(exp_field):
    y = _binade(exp_field)
    if exp_field == 126:
        y = torch.cat([y, torch.tensor([1.0])])
        y = torch.cat([y, torch.full((BLOCK - y.numel() % BLOCK,), 0.75)])
    warped = ref.v4_log_warp(y)
    want = (warped.view(torch.int32).to(torch.int64) - (112 << 23)).clamp(min=0).to(torch.int32)
    if exp_field < 112:
        assert (want == 0).all()
    if exp_field >= 113:  # the product is normal: the same bits as the reference's multiplication by 2**-112
        assert torch.equal(want, (warped * torch.tensor(2.0**-112, dtype=torch.float32)).view(torch.int32))
    out = torch.empty(y.numel(), dtype=torch.int32, device=DEVICE)
    _warp_kernel[(y.numel() // BLOCK,)](
        y.to(DEVICE), out, 0x3F800000, BLOCK=BLOCK, num_warps=4, enable_fp_fusion=False
    )
    assert same_bits(out.cpu(), want), mismatch(out.cpu(), want)
