"""Candidate block codes for skewed blocks (issue 45), simulated like ``scripts/skew_walk.py``: not formats of the
package, the designs weighed for it, kept so that the next format version starts from numbers.

Each candidate replaces the reference's moment codec by a plain-PyTorch prototype (float64 where that is simpler; not
bit-exact specifications), inside the reference's update (``m``, ``v``, ``sqrt_rn``, the step in fp32, the moments'
random word of ``reference.hash_uniform_bits``), on ``skew_walk.gradients``; the number is again the mean distance
the small elements move as a ratio to fp32 ``torch.optim.AdamW``'s.

* ``8bit_exact``: 8-bit version 3's codes (e5m3 ``v``, 16 random bits) over the block's exact fp32 absmax instead of
  the envelope: the scale moves with every fluctuation of the maximum and re-rounds the block (what version 3 avoids).
* ``4bit_env``: 4-bit ``v`` codes of two binades each (``2**(2 (c - 15))``, down to 2**-28), over the envelope scale
  of ``reference.v8_scale`` with 4x headroom (a restart puts the maximum on a code), rounded with the probability
  ``A u + (1 - A) u**2`` of the upper code (``u`` the position within the code's interval; ``A`` = ``--a``, 1.85), and
  ``m`` (4-bit version 2's sign + e3m0) rounded with 16 random bits instead of 6.

    python scripts/skew_candidates.py [--candidates 4bit_env,8bit_exact] [--a 1.85] [skew_walk's flags]
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from apexw_hf.provenance import describe_source  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import skew_walk as sw  # noqa: E402

from apexw_hf import reference as ref  # noqa: E402

CANDIDATES = ("4bit_env", "8bit_exact")
BLOCK_OF = {"4bit_env": ref.BLOCK4, "8bit_exact": ref.BLOCK}


def _envelope(vb: torch.Tensor, prev: torch.Tensor, beta2: float, headroom: float):
    amax = vb.amax(dim=1)
    env = prev * torch.tensor(beta2, dtype=torch.float32)
    s = torch.where(amax <= env, env, amax * headroom)
    return s, torch.where(s == 0, torch.zeros_like(s), 1.0 / s)


def _v8_exact(v: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    vb = ref._blocks(v)
    s, inv = ref._scale_exact(vb)
    y = ref._normalized(vb, inv)
    c = ref.minifloat_code(y, ref._rand_offset(ref._blocks(bits), 6, 16, 20), ref.V8_MANT, ref.V8_BIAS)
    c = torch.where((vb > 0) & (c == 0), torch.ones_like(c), c)
    return (ref.minifloat_value(c, ref.V8_MANT, ref.V8_BIAS) * s[:, None]).reshape(-1)[: v.numel()]


def _v4_env(v, bits, prev, beta2, a):
    """(decoded v, new scales) of the ``4bit_env`` candidate."""
    vb = ref._blocks(v, ref.BLOCK4)
    s, inv = _envelope(vb, prev, beta2, 4.0)
    y = ref._normalized(vb, inv).double()
    log2y = torch.log2(torch.where(y > 0, y, torch.ones_like(y)))
    low = torch.clamp(torch.floor((log2y + 30) / 2), min=0)  # the code below: value 2**(2 low - 30) (0: zero)
    u = torch.clamp((y / 2.0 ** (2 * low - 30) - 1) / 3, 0, 1)
    r = (((ref._blocks(bits, ref.BLOCK4) >> 6) & 0xFFFF).double() + 0.5) / 65536
    c = torch.clamp(low + (r > 1 - (a * u + (1 - a) * u * u)).double(), max=15).long()
    c = torch.where(vb > 0, torch.clamp(c, min=1), torch.zeros_like(c))
    val = torch.where(c == 0, torch.zeros_like(y), 2.0 ** (2.0 * c - 30))
    return (val.float() * s[:, None]).reshape(-1)[: v.numel()], s


def _m4_16(m, bits):
    mb = ref._blocks(m, ref.BLOCK4)
    a = mb.abs()
    sm, inv = ref._scale(a)
    y = ref._normalized(a, inv)
    c = ref.minifloat_code(y, ref._rand_offset(ref._blocks(bits, ref.BLOCK4), 0, 16, 23), 0, ref.M4_BIAS)
    mag = ref.minifloat_value(c, 0, ref.M4_BIAS)
    return (torch.where(mb < 0, -mag, mag) * sm.float()[:, None]).reshape(-1)[: m.numel()]


def distances(cand, beta2, log2_ratios, blocks, block, burst, after, scenario, seed, a=1.85) -> torch.Tensor:
    """``skew_walk.distances`` with the candidate's codec."""
    n = len(log2_ratios) * blocks * block
    p, m, v = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    prev = torch.zeros(n // block)
    p0 = p.clone()
    for t, g in sw.gradients(log2_ratios, blocks, block, burst, after, scenario, seed):
        s = ref.StepScalars.make(lr=sw.LR, beta1=sw.BETA1, beta2=beta2, eps=sw.EPS, weight_decay=0.0, step=t)
        m = m * s.beta1 + g * s.one_minus_beta1
        v = v * s.beta2 + (g * g) * s.one_minus_beta2
        p = p * s.decay - (m / (ref.sqrt_rn(v) * s.inv_bc2_sqrt + s.eps)) * s.step_size
        bits = ref.hash_uniform_bits(n, ref.stream_key(seed + 1, 0, t, ref.STREAM_MV), "cpu")
        if cand == "8bit_exact":
            codes, scale = ref.quantize_m(m, bits)
            m = ref.dequantize_m(codes, scale)
            v = _v8_exact(v, bits)
        else:
            m = _m4_16(m, bits)
            v, prev = _v4_env(v, bits, prev, s.beta2, a)
        if t == burst:
            p0 = p.clone()
    d = (p - p0).abs().view(len(log2_ratios), blocks, block)[..., 1:]
    return d.double().mean(dim=(1, 2))


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--candidates", default=",".join(CANDIDATES))
    ap.add_argument("--a", type=float, default=1.85, help="4bit_env: slope of the rounding probability at u = 0")
    ap.add_argument("--beta2", default=",".join(map(str, sw.BETA2S)))
    ap.add_argument("--ratios", default=",".join(map(str, sw.LOG2_RATIOS)), help="log2 of the ratios")
    ap.add_argument("--scenarios", default=",".join(sw.SCENARIOS))
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--burst", type=int, default=0)
    ap.add_argument("--steps-scale", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    cands = tuple(args.candidates.split(","))
    for c in cands:
        if c not in CANDIDATES:
            raise ValueError(f"--candidates: {c!r}; allowed: {', '.join(CANDIDATES)}")
    beta2s = tuple(float(x) for x in args.beta2.split(","))
    ratios = tuple(int(x) for x in args.ratios.split(","))
    scenarios = tuple(args.scenarios.split(","))
    torch.set_num_threads(1)
    commit = describe_source()  # before the run: the tree it ran
    t0 = time.time()
    rows = []
    for scenario in scenarios:
        for beta2 in beta2s:
            after = max(1, round(sw.AFTER.get(beta2, 3000) * args.steps_scale))
            for cand in cands:
                blk = BLOCK_OF[cand]
                walk = (ratios, args.blocks, blk, args.burst, after, scenario, args.seed)
                base = sw.distances("torch", beta2, *walk)
                d = distances(cand, beta2, *walk, a=args.a)
                for k, x in zip(ratios, (d / base).tolist()):
                    rows.append(
                        {
                            "scenario": scenario,
                            "beta2": beta2,
                            "steps": after,
                            "format": cand,
                            "log2_ratio": k,
                            "ratio": x,
                        }
                    )
    cmd = "python scripts/skew_candidates.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = "\n".join(
        [
            f"commit {commit}, torch {torch.__version__}, {datetime.date.today().isoformat()}, "
            f"{time.time() - t0:.0f} s; command: `{cmd.strip()}`",
            "",
            "Candidates (prototypes, not formats): mean distance of the small elements (after a burst of "
            f"{args.burst} steps) as a ratio to fp32 torch AdamW's; target 0.9-1.1.",
            "",
            *sw.table(rows, cands, beta2s, ratios, scenarios),
        ]
    )
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return rows


if __name__ == "__main__":
    main()
