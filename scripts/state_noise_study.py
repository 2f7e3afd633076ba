"""How much noise stochastic rounding leaves in the 8-bit second moment, for the shipped code and candidate formats.

Each element's squared gradient is held constant (levels spread over four decades below its block's maximum), v
runs 3,000 AdamW updates at beta2 = 0.999 and is re-encoded after each, as in training; printed: the relative
standard deviation (and mean) of the decoded v around its exact value, per decade of v / block max. Candidate codes
are unsigned minifloats eEmM on the block-normalized value (scale = block absmax rounded up to bf16, as shipped),
with the same value-unbiased stochastic choice between neighbouring codes and nonzero v never coded 0.

    python scripts/state_noise_study.py [--steps 3000]

This is a CPU study for the 8-bit format's design (docs/results/step_h200_2026-11-30.notes.md): minifloat codes are
cheaper to encode in the kernel than the 4th-root code, and this measures what they would cost in precision.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from apexw_hf import reference as ref  # noqa: E402


def minifloat_table(e_bits: int, m_bits: int) -> torch.Tensor:
    """Every value <= 1 of an unsigned minifloat with e_bits exponent and m_bits mantissa bits (1.0 = top binade)."""
    bias = 2**e_bits - 1
    vals = {0.0}
    vals.update(2.0 ** (1 - bias) * m / 2**m_bits for m in range(1, 2**m_bits))
    for e in range(1, 2**e_bits):
        vals.update(v for m in range(2**m_bits) if (v := 2.0 ** (e - bias) * (1 + m / 2**m_bits)) <= 1.0)
    return torch.tensor(sorted(vals), dtype=torch.float32)


def table_codec(table: torch.Tensor):
    def quant(v, bits):
        vb = ref._blocks(v)
        scale, inv = ref._scale(vb)
        y = ref._normalized(vb, inv)
        lo = ref._lower_code(y, table).long()
        qlo, qhi = table[lo], table[lo + 1]
        u = ref._uniform16(ref._blocks(bits) & 0xFFFF)
        idx = lo + ((u * (qhi - qlo)) < (y - qlo)).long()
        return torch.where((vb > 0) & (idx == 0), torch.ones_like(idx), idx), scale

    def dequant(idx, scale):
        return (table[idx] * scale.float()[:, None]).reshape(-1)

    return quant, dequant


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3000)
    args = ap.parse_args()
    blocks = 64
    n = ref.BLOCK * blocks
    level = torch.logspace(-4, 0, ref.BLOCK).repeat(blocks)  # v / block max of each element, constant g^2
    formats = {"shipped: 4th-root code": (ref.quantize_v, ref.dequantize_v)}
    for e, m in ((4, 4), (5, 3), (3, 5)):
        t = minifloat_table(e, m)
        formats[f"minifloat e{e}m{m} ({t.numel()} codes)"] = table_codec(t)
    decades = [(1e-4, 1e-3), (1e-3, 1e-2), (1e-2, 1e-1), (1e-1, 1.01)]
    print("relative std (mean) of decoded v, by v / block max:", "  ".join(f"[{a:g},{b:g})" for a, b in decades))
    for name, (quant, dequant) in formats.items():
        codes, scale = quant(level, ref.hash_uniform_bits(n, 1, "cpu"))
        for t in range(1, args.steps + 1):
            v = dequant(codes, scale) * 0.999 + level * (1 - 0.999)
            codes, scale = quant(v, ref.hash_uniform_bits(n, ref.stream_key(0, 0, t, ref.STREAM_MV), "cpu"))
        rel = (dequant(codes, scale) / level - 1).view(blocks, ref.BLOCK)
        cols = level.view(blocks, ref.BLOCK)[0]
        cells = []
        for a, b in decades:
            r = rel[:, (cols >= a) & (cols < b)]
            cells.append(f"{r.std().item():.4f} ({r.mean().item():+.4f})")
        print(f"{name:32s}", "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
