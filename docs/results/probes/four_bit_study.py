"""Design study for 4-bit optimizer state: candidate codes for m and v, trained on the convergence tests' two small
tasks with the reference's AdamW step (the 8-bit codec swapped for each candidate), 5 seeds, torch AdamW beside.

Every candidate keeps the 8-bit format's rules: a bf16 absmax scale per block (rounded up), unbiased stochastic
rounding between the two neighbouring code values (a table search with 16 random bits), zero coded exactly, and a
nonzero v never coded as zero. Codes are minifloats eEmM on the block-normalized value with the top code's value 1.0
(m with a sign), or a linear code without zero for v (Li et al. 2023, "Memory Efficient Optimizers with 4-bit
States", use linear v codes with rank-1 normalization; here with block scales).

    python docs/results/probes/four_bit_study.py [--seeds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from state_noise_study import RefAdamW8bit, minifloat_table, table_code  # noqa: E402

from apexw_hf import reference as ref  # noqa: E402


def codec(levels: torch.Tensor, block: int, signed: bool, nonzero: bool):
    def blocks(x):
        flat = x.reshape(-1)
        return torch.cat([flat, flat.new_zeros(-flat.numel() % block)]).view(-1, block)

    def quant(x, bits):
        xb = blocks(x)
        scale, inv = ref._scale(xb.abs())  # the 8-bit format's scale and normalization, on blocks of ``block``
        idx = table_code(ref._normalized(xb.abs(), inv), levels, blocks(bits) & 0xFFFF)
        if nonzero:
            idx = torch.where((xb > 0) & (idx == 0), torch.ones_like(idx), idx)
        if signed:
            idx = torch.where(xb < 0, -idx, idx)
        return idx.reshape(-1)[: x.numel()].view(x.shape).to(torch.int16), scale

    def dequant(codes, scale):
        c = blocks(codes.long())
        out = levels[c.abs()] * scale.float()[:, None]
        out = torch.where(c < 0, -out, out)
        return out.reshape(-1)[: codes.numel()].view(codes.shape)

    return quant, dequant


class RefAdamW4(RefAdamW8bit):
    """RefAdamW8bit with int16 code storage (any candidate fits) and scales per ``block`` elements."""

    def __init__(self, params, codec4, block, lr, weight_decay, seed=0):
        super().__init__(params, codec4, lr, weight_decay, seed)
        for group in self.param_groups:
            for p in group["params"]:
                nb = -(-p.numel() // block)
                self.state[p].update(step=0, exp_avg=torch.zeros_like(p, dtype=torch.int16),
                                     exp_avg_sq=torch.zeros_like(p, dtype=torch.int16),
                                     exp_avg_scale=torch.zeros(nb, dtype=torch.bfloat16),
                                     exp_avg_sq_scale=torch.zeros(nb, dtype=torch.bfloat16))  # fmt: skip


def candidates(block: int) -> dict:
    m_e3m0 = minifloat_table(3, 0)  # 0, 2**-6 .. 1
    m_e2m1 = minifloat_table(2, 1)  # 0, 1/8, 1/4, 3/8, 1/2, 3/4, 1
    v_e4m0 = minifloat_table(4, 0)  # 0, 2**-14 .. 1 (16 codes)
    v_e3m1 = minifloat_table(3, 1)  # 0, 2**-7, 2**-6 .. 1 in steps of 1.5x / 1.33x (15 codes)
    v_lin = torch.cat([torch.zeros(1), torch.arange(1, 16, dtype=torch.float32) / 15])  # zero only for zero
    out = {}
    for mname, mlev in (("m s+e3m0", m_e3m0), ("m s+e2m1", m_e2m1)):
        for vname, vlev in (("v e4m0", v_e4m0), ("v e3m1", v_e3m1), ("v linear/15", v_lin)):
            qm, dm = codec(mlev, block, True, False)
            qv, dv = codec(vlev, block, False, True)
            out[f"{mname}, {vname}, block {block}"] = (qm, dm, qv, dv)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--block", type=int, default=128)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests" / "optim"))
    from test_convergence import _teacher_student, _tiny_llama

    seeds = range(args.seeds)
    makers = {"torch AdamW": lambda ps, s: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.01)}
    for name, c in candidates(args.block).items():
        makers[name] = lambda ps, s, c=c: RefAdamW4(ps, c, args.block, 3e-3, 0.01, s)
    for task, fn, steps in (("teacher-student MLP", _teacher_student, 300), ("tiny Llama", _tiny_llama, 120)):
        base = None
        for name, make in makers.items():
            losses = [fn(s, lambda ps, s=s, make=make: make(ps, s), steps=steps) for s in seeds]
            base = base or losses
            d = [a - b for a, b in zip(losses, base)]
            print(
                f"{task:20s} {name:36s} final loss {statistics.fmean(losses):.4f} +- {statistics.stdev(losses):.4f}"
                f"  paired diff vs torch {statistics.fmean(d):+.4f} +- {statistics.stdev(d):.4f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
