"""The kernels' 8-bit code search at the exact code boundaries, against the reference's table search.

The kernels guess each code from an approximate hardware root and settle it with one exact comparison; on the CPU
the interpreter's root is exact, on a GPU it is the approximate instruction, so this test means most there.
"""

import pytest
import torch
import triton
import triton.language as tl

from apexw_hf import reference as ref
from apexw_hf.kernels._quant import lower_code, m_root, quant_m, quant_v, v_root

from .helpers import DEVICE


@triton.jit
def _lower_code_kernel(y_ptr, lo_ptr, n, V: tl.constexpr):
    offs = tl.program_id(0) * 256 + tl.arange(0, 256)
    mask = offs < n
    y = tl.load(y_ptr + offs, mask=mask, other=0.0)
    if V:
        lo, qlo, qhi = lower_code(y, v_root(y), 255.0, True)
    else:
        lo, qlo, qhi = lower_code(y, m_root(y), 127.0, False)
    tl.store(lo_ptr + offs, lo, mask=mask)


@triton.jit
def _quant_kernel(x_ptr, bits_ptr, code_ptr, scale_ptr, n, V: tl.constexpr):
    row = tl.program_id(0)
    offs = row * 256 + tl.arange(0, 256)[None, :]
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    bits = tl.load(bits_ptr + offs, mask=mask, other=0).to(tl.uint32, bitcast=True)
    if V:
        c, s = quant_v(x, mask, bits)
    else:
        c, s = quant_m(x, mask, bits)
    tl.store(code_ptr + offs, c, mask=mask)
    tl.store(scale_ptr + row + tl.arange(0, 1), s)


def _near_boundaries(table: torch.Tensor) -> torch.Tensor:
    """Every code value, its fp32 neighbours two ulps either side, and the midpoints between codes, in [0, 1]."""
    t = table[1:]
    down1 = torch.nextafter(t, torch.zeros_like(t))
    up1 = torch.nextafter(t, torch.ones_like(t))
    vals = [t, down1, up1, torch.nextafter(down1, torch.zeros_like(t)), torch.nextafter(up1, torch.ones_like(t))]
    vals = torch.cat(vals + [(t[1:] + t[:-1]) / 2, torch.tensor([0.0, 1.0, 2.0**-149, 2.0**-126])])
    return vals[(vals >= 0) & (vals <= 1.0)]


@pytest.mark.parametrize("moment", ["m", "v"])
def test_lower_code_matches_table_search(moment):
    table = ref._Q2_TABLE if moment == "m" else ref._Q4_TABLE
    y = _near_boundaries(table)
    want = ref._lower_code(y, table)
    got = torch.empty(y.numel(), dtype=torch.float32, device=DEVICE)
    _lower_code_kernel[(ref.num_blocks(y.numel()),)](
        y.to(DEVICE), got, y.numel(), V=moment == "v", num_warps=2, enable_fp_fusion=False
    )
    diff = (got.cpu() != want).nonzero().flatten()
    assert diff.numel() == 0, f"{diff.numel()} codes differ, first at y={y[diff[0]].item()!r}"
    assert len(want.unique()) == table.numel() - 1  # every code but the top one is some value's lower code


@pytest.mark.parametrize("moment", ["m", "v"])
def test_codes_and_scales_match_reference(moment):
    table = ref._Q2_TABLE if moment == "m" else ref._Q4_TABLE
    vals = _near_boundaries(table)
    x = torch.cat([torch.cat([torch.ones(1), b]) for b in vals.split(255)])  # blocks led by 1.0: scale 1, y = |x|
    if moment == "m":
        x[1::2] = -x[1::2]
    n = x.numel()
    bits = ref.hash_uniform_bits(n, ref.stream_key(11, 2, 7, ref.STREAM_MV), "cpu")
    want_codes, want_scale = (ref.quantize_v if moment == "v" else ref.quantize_m)(x, bits)
    codes = torch.empty(n, dtype=want_codes.dtype, device=DEVICE)
    scale = torch.empty(ref.num_blocks(n), dtype=torch.int16, device=DEVICE)
    bits32 = (bits - (bits >= 2**31).long() * 2**32).to(torch.int32)
    _quant_kernel[(ref.num_blocks(n),)](
        x.to(DEVICE), bits32.to(DEVICE), codes, scale, n, V=moment == "v", num_warps=2, enable_fp_fusion=False
    )
    assert torch.equal(scale.cpu().view(torch.bfloat16), want_scale)
    assert torch.equal(codes.cpu(), want_codes)
