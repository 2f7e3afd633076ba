"""How far the small elements of a skewed block move, per state format, against fp32 ``torch.optim.AdamW`` (issue 45).

A block format codes ``v`` relative to one scale per block (its largest ``v``). This simulation builds blocks where
element 0 keeps large gradients and the other elements get small ones, ``ratio`` times smaller in ``g**2`` (so their
``v`` settles ``ratio`` times below the block maximum), and runs them through the project's real update path
(``reference.adamw_step_ref_``, which every engine matches bit for bit) and through ``torch.optim.AdamW`` in fp32 on
the same gradients. The number reported is the mean distance the small elements move over the run, as a ratio to
torch AdamW's: the update's size, ``lr * m / sqrt(v)`` summed over the steps (1.00: exact; the issue's target
0.9-1.1).

Per block (``--block`` elements, default the format's block; every ratio gets ``--blocks`` blocks of its own):

* element 0: ``G(t) * N(0, 1)``, the block maximum of ``v``;
* the others: ``--burst`` steps (default 0) of ``G(t) * N(0, 1)`` (as large as element 0's), then
  ``G(t) / sqrt(ratio) * (s_i + 0.1 * N(0, 1))`` with a fixed sign ``s_i`` per element, so they keep moving one way.
  Without a burst their ``v`` sits ``ratio`` below the block maximum from the first step (the skew itself); after a
  burst it decays from the maximum's level towards that (the issue's scenario, ``--burst 20``: how far it gets
  depends on beta2 and the steps, so the columns are the gradients' ratio, not the ``v`` ratio, there).

``G(t)``: ``held``: 1 throughout (the maximum is held); ``decaying``: 1 during the burst, then it halves every
``after / 8`` steps (the whole block's gradients shrink, ``v`` falls 16 binades behind them, the maximum with it).

The distance is measured from the end of the burst (or the start) to the end of the run (``after`` steps), per
element, then averaged over the small elements of each ratio.

    python scripts/skew_walk.py [--formats compact,8bit,4bit] [--beta2 0.99,0.999,0.9995,0.9999]
        [--ratios 4,8,12,16,20,24] [--blocks 4] [--scenarios held,decaying] [--burst 0] [--steps-scale 1.0]
        [--out FILE.md]

``--ratios`` are log2 of the ratio. ``--steps-scale`` shrinks every run (``after`` steps per beta2: 1000 at 0.99,
3000 at 0.999, 4000 at 0.9995, 6000 at 0.9999) for a quick look; the tables in docs/skewed_blocks.md use 1.0.
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from apexw_hf import formats as st  # noqa: E402
from apexw_hf import reference as ref  # noqa: E402
from apexw_hf.provenance import describe_source  # noqa: E402

BETA2S = (0.99, 0.999, 0.9995, 0.9999)
AFTER = {0.99: 1000, 0.999: 3000, 0.9995: 4000, 0.9999: 6000}  # steps after the burst
LOG2_RATIOS = (4, 8, 12, 16, 20, 24)
SCENARIOS = ("held", "decaying")
FORMATS = ("compact", "8bit", "4bit")
LR, BETA1, EPS = 1e-3, 0.9, 1e-8
BLOCK_OF = {"8bit": ref.BLOCK, "4bit": ref.BLOCK4}


def gradients(log2_ratios, blocks: int, block: int, burst: int, after: int, scenario: str, seed: int):
    """Yield ``(t, g)`` for t = 1 .. burst + after; ``g`` of shape ``(len(log2_ratios) * blocks * block,)``."""
    if scenario not in SCENARIOS:
        raise ValueError(f"scenario {scenario!r}; allowed: {', '.join(SCENARIOS)}")
    gen = torch.Generator().manual_seed(seed)
    shape = (len(log2_ratios), blocks, block)
    small = torch.tensor([2.0 ** (-r / 2) for r in log2_ratios])[:, None, None].expand(shape)
    sign = torch.randn(shape, generator=gen).sign()
    is_max = torch.zeros(shape, dtype=torch.bool)
    is_max[..., 0] = True
    for t in range(1, burst + after + 1):
        noise = torch.randn(shape, generator=gen)
        if t <= burst:
            g = noise
        else:
            g = torch.where(is_max, noise, small * (sign + 0.1 * noise))
        if scenario == "decaying" and t > burst:
            g = g * 2.0 ** (-8.0 * (t - burst) / after)
        yield t, g.reshape(-1)


def distances(
    fmt: str, beta2: float, log2_ratios, blocks: int, block: int, burst: int, after: int, scenario: str, seed: int
) -> torch.Tensor:
    """Per ratio, the mean distance the small elements move after the burst: ``fmt`` through the reference, or
    ``"torch"`` (``torch.optim.AdamW``, fp32)."""
    n = len(log2_ratios) * blocks * block
    if fmt == "torch":
        p = torch.nn.Parameter(torch.zeros(n))
        opt = torch.optim.AdamW([p], lr=LR, betas=(BETA1, beta2), eps=EPS, weight_decay=0.0, foreach=False)
    else:
        p = torch.zeros(n)
        state = st.init_state(p, fmt)
    p0 = p.detach().clone()
    for t, g in gradients(log2_ratios, blocks, block, burst, after, scenario, seed):
        if fmt == "torch":
            p.grad = g
            opt.step()
        else:
            s = ref.StepScalars.make(lr=LR, beta1=BETA1, beta2=beta2, eps=EPS, weight_decay=0.0, step=t)
            ref.adamw_step_ref_(p, g, state, fmt=fmt, scalars=s, seed=seed + 1, tensor_index=0, step=t)
        if t == burst:
            p0 = p.detach().clone()
    d = (p.detach() - p0).abs().view(len(log2_ratios), blocks, block)[..., 1:]
    return d.double().mean(dim=(1, 2))


def run(
    formats, beta2s, log2_ratios, scenarios, blocks: int, block: int | None, burst: int, steps_scale: float, seed: int
) -> list[dict]:
    rows = []
    for scenario in scenarios:
        for beta2 in beta2s:
            after = max(1, round(AFTER.get(beta2, 3000) * steps_scale))
            ref_d = {}
            for fmt in formats:
                b = block or BLOCK_OF.get(fmt, ref.BLOCK)
                if b not in ref_d:
                    ref_d[b] = distances("torch", beta2, log2_ratios, blocks, b, burst, after, scenario, seed)
                d = distances(fmt, beta2, log2_ratios, blocks, b, burst, after, scenario, seed)
                for r, x, y in zip(log2_ratios, d.tolist(), ref_d[b].tolist()):
                    rows.append(
                        {
                            "scenario": scenario,
                            "beta2": beta2,
                            "steps": after,
                            "format": fmt,
                            "log2_ratio": r,
                            "ratio": x / y,
                        }
                    )
    return rows


def table(rows, formats, beta2s, log2_ratios, scenarios) -> list[str]:
    lines = []
    for scenario in scenarios:
        lines += [
            f"### {scenario}",
            "",
            "| format | beta2 (steps) | " + " | ".join(f"2^{r}" for r in log2_ratios) + " |",
            "|---|---|" + "---:|" * len(log2_ratios),
        ]
        for fmt in formats:
            for beta2 in beta2s:
                sel = {
                    r["log2_ratio"]: r
                    for r in rows
                    if (r["scenario"], r["format"], r["beta2"]) == (scenario, fmt, beta2)
                }
                steps = next(iter(sel.values()))["steps"]
                cells = [f"{sel[r]['ratio']:.3f}" for r in log2_ratios]
                lines.append(f"| {fmt} | {beta2} ({steps}) | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(","))


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--formats", default=",".join(FORMATS), help="comma-separated state formats")
    ap.add_argument("--beta2", default=",".join(map(str, BETA2S)), help="comma-separated beta2 values")
    ap.add_argument("--ratios", default=",".join(map(str, LOG2_RATIOS)), help="comma-separated log2 of the ratio")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="held, decaying or both")
    ap.add_argument("--blocks", type=int, default=4, help="blocks per ratio")
    ap.add_argument("--block", type=int, default=None, help="elements per simulated block (default: the format's)")
    ap.add_argument("--burst", type=int, default=0, help="steps of large gradients for every element first")
    ap.add_argument("--steps-scale", type=float, default=1.0, help="multiplies the steps after the burst")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--out", type=Path, default=None, help="also write the markdown here")
    args = ap.parse_args(argv)
    formats = tuple(args.formats.split(","))
    for f in formats:
        if f not in ref.STATE_FORMATS:
            raise ValueError(f"--formats: {f!r}; allowed: {', '.join(ref.STATE_FORMATS)}")
    scenarios = tuple(args.scenarios.split(","))
    beta2s = _floats(args.beta2)
    log2_ratios = tuple(int(x) for x in args.ratios.split(","))
    if args.blocks < 1 or args.steps_scale <= 0 or args.burst < 0:
        raise ValueError(
            f"--blocks {args.blocks} (>= 1), --burst {args.burst} (>= 0), --steps-scale {args.steps_scale} "
            "(> 0): out of range"
        )
    torch.set_num_threads(args.threads)
    commit = describe_source()  # before the run: the tree it ran
    t0 = time.time()
    rows = run(
        formats, beta2s, log2_ratios, scenarios, args.blocks, args.block, args.burst, args.steps_scale, args.seed
    )
    cmd = "python scripts/skew_walk.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [
        f"commit {commit}, torch {torch.__version__}, {datetime.date.today().isoformat()}, "
        f"{time.time() - t0:.0f} s; command: `{cmd.strip()}`",
        "",
        f"Mean distance moved by the small elements (after a burst of {args.burst} steps), as a ratio to fp32 "
        "torch AdamW's, by the ratio of the block maximum's g**2 to theirs; target 0.9-1.1.",
        "",
        *table(rows, formats, beta2s, log2_ratios, scenarios),
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    if not all(math.isfinite(r["ratio"]) for r in rows):
        raise RuntimeError("a non-finite ratio: a format lost its elements' state")
    return rows


if __name__ == "__main__":
    main()
