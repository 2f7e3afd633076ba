"""The update each state format makes on a weight whose columns differ in gradient scale, against fp32
``torch.optim.AdamW`` (issue 45: the 4-bit format on noisy, skewed rows).

A weight of ``--rows`` x ``--cols`` elements gets gradients ``1e-3 * row_i * col_j * (N(0, 1) + d_ij)``: ``row`` and
``col`` log-normal scales (``exp(N(0, --sigma))``; ``--sigma 0`` makes every element alike), ``d_ij`` a fixed drift
``N(0, 0.3)``, so the gradients are mostly noise, as in training, and a 128- or 256-element block of a row holds
elements whose ``v`` lies up to ~2**20 below its largest. With ``--shrink`` every gradient halves 8 times over the run.
Each optimizer steps its own copy of the weight (fp32 parameters: only the state is quantized) on the same gradients:
this package's ``ApexW8bit`` and ``ApexW4bit``, and with ``--old DIR`` the ``ApexW4bit`` of the ``apexw_hf`` package
under DIR (another commit's: ``git archive <commit> apexw_hf | tar x -C DIR``), imported as ``apexw_old``.

Reported per optimizer, against torch AdamW: the mean ``|update|`` per element and step as a ratio (the step size the
format gives; 1.00 exact), the per-step update error ``||u - u_torch|| / ||u_torch||``, the end point's distance from
torch AdamW's over the distance torch AdamW travelled, and the mean ``|update|`` ratio per octile of the columns'
``g**2`` below the largest column's.

``--split`` adds which moment does it: the same gradients through a plain AdamW loop (fp32, the update from the new
moments as in the kernel) whose stored ``m``, ``v`` or both are replaced after each step by their 4-bit round trip
(``reference.quantize_mv4`` and ``dequantize_mv4``, format version 4, or the ``_v3`` and ``_v2`` functions kept for
checkpoints), with the random words of ``reference.hash_uniform_bits`` (:func:`split_run`).

    python scripts/update_size.py [--old DIR] [--steps 400] [--rows 128] [--cols 512] [--sigma 1.0] [--shrink]
        [--split]
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_step_against import import_old  # noqa: E402

import apexw_hf  # noqa: E402
from apexw_hf import reference as ref  # noqa: E402
from apexw_hf.provenance import describe_source  # noqa: E402

HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)


def run(make, p0, row, col, drift, steps: int, shrink: bool):
    """Step ``make([param])`` over the gradients; the end point and every step's update [steps, rows, cols]."""
    p = torch.nn.Parameter(p0.clone())
    opt = make([p])
    updates = []
    for t in range(steps):
        p.grad = gradient(t, row, col, drift, steps, shrink)
        before = p.detach().clone()
        opt.step()
        updates.append(p.detach() - before)
    return p.detach().clone(), torch.stack(updates)


def gradient(t: int, row, col, drift, steps: int, shrink: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + t)
    scale = 0.5 ** (8 * t / steps) if shrink else 1.0
    return row * col * (torch.randn(drift.shape, generator=g) + drift) * scale * 1e-3


def split_run(version, quant_m: bool, quant_v: bool, row, col, drift, steps: int, shrink: bool):
    """Every step's update [steps, rows, cols] of a plain fp32 AdamW loop whose stored moments named by ``quant_m``
    and ``quant_v`` make the 4-bit round trip of format ``version`` (2, 3 or 4) after each step."""
    lr, (b1, b2), eps = HP["lr"], HP["betas"], HP["eps"]
    n = drift.numel()
    m, v, v_scale = torch.zeros(n), torch.zeros(n), torch.zeros(-(-n // ref.BLOCK4))
    updates = []
    for t in range(steps):
        g = gradient(t, row, col, drift, steps, shrink).reshape(-1)
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        updates.append(lr * (m / (1 - b1 ** (t + 1))) / ((v / (1 - b2 ** (t + 1))).sqrt() + eps))
        bits = ref.hash_uniform_bits(n, 77 + t, torch.device("cpu"))
        if version in (3, 4):
            v3 = (ref.quantize_mv4_v3, ref.dequantize_mv4_v3)
            quantize, dequantize = (ref.quantize_mv4, ref.dequantize_mv4) if version == 4 else v3
            mv, m_scale, v_scale = quantize(m, v, bits, v_scale, b2)
            qm, qv = dequantize(mv, m_scale, v_scale)
        else:
            qm, qv = ref.dequantize_mv4_v2(*ref.quantize_mv4_v2(m, v, bits))
        m = qm.reshape(-1) if quant_m else m
        v = qv.reshape(-1) if quant_v else v
    return torch.stack(updates).view(steps, *drift.shape)


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=Path, help="a folder holding another commit's apexw_hf package")
    ap.add_argument("--old-label", default="4bit_old", help="its column name")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--cols", type=int, default=512)
    ap.add_argument("--sigma", type=float, default=1.0, help="std of the log of the row and column scales")
    ap.add_argument("--shrink", action="store_true", help="the gradients halve 8 times over the run")
    ap.add_argument("--split", action="store_true", help="also quantize one 4-bit moment at a time (see above)")
    args = ap.parse_args(argv)
    if args.steps < 2 or args.rows < 1 or args.cols < 8 or args.sigma < 0:
        raise SystemExit("--steps >= 2, --rows >= 1, --cols >= 8 and --sigma >= 0 are required")
    if args.split and args.sigma == 0:
        raise SystemExit("--split compares the columns furthest below the largest: it needs --sigma > 0")
    commit = describe_source()
    t0 = time.time()
    gen = torch.Generator().manual_seed(0)
    row = torch.exp(torch.randn(args.rows, 1, generator=gen) * args.sigma)
    col = torch.exp(torch.randn(1, args.cols, generator=gen) * args.sigma)
    drift = torch.randn(args.rows, args.cols, generator=gen) * 0.3
    p0 = torch.randn(args.rows, args.cols, generator=gen) * 0.02
    makers = {"torch": lambda ps: torch.optim.AdamW(ps, **HP)}
    with tempfile.TemporaryDirectory() as tmp:
        if args.old is not None:
            old = import_old(args.old, Path(tmp))
            makers[args.old_label] = lambda ps: old.ApexW4bit(ps, **HP)
        makers["4bit"] = lambda ps: apexw_hf.ApexW4bit(ps, **HP)
        makers["8bit"] = lambda ps: apexw_hf.ApexW8bit(ps, **HP)
        res = {k: run(m, p0, row, col, drift, args.steps, args.shrink) for k, m in makers.items()}
    end_ref, u_ref = res.pop("torch")
    travel = (end_ref - p0).norm()
    rel = torch.log2((col[0] ** 2).max() / col[0] ** 2)
    edges = torch.quantile(rel, torch.linspace(0, 1, 9))
    lines = [
        "| optimizer | mean abs update / torch's | per-step update error | end point's distance / torch's travel |",
        "|---|---:|---:|---:|",
    ]
    for k, (end, u) in res.items():
        size = u.abs().mean() / u_ref.abs().mean()
        err = (u - u_ref).norm() / u_ref.norm()
        lines.append(f"| {k} | {size:.3f} | {err:.3f} | {(end - end_ref).norm() / travel:.3f} |")
    if args.sigma > 0:  # (every column alike: no octiles)
        lines += octiles(res, u_ref, rel, edges)
    if args.split:
        lines += split_table(row, col, drift, args.steps, args.shrink, u_ref, rel >= edges[7])
    cmd = "python scripts/update_size.py " + " ".join(argv if argv is not None else sys.argv[1:])
    header = (
        f"commit {commit}, torch {torch.__version__}, {datetime.date.today().isoformat()}, "
        f"{time.time() - t0:.0f} s; command: `{cmd.strip()}`"
    )
    text = "\n".join([header, "", *lines])
    print(text)
    return text


def octiles(res: dict, u_ref, rel, edges) -> list[str]:
    lines = [
        "",
        "Mean abs update / torch's by the columns' g**2 below the largest column's (octiles of the columns):",
        "",
        "| log2 below the largest | " + " | ".join(res) + " |",
        "|---|" + "---:|" * len(res),
    ]
    for i in range(8):
        sel = (rel >= edges[i]) & (rel <= edges[i + 1])
        ratios = [u[:, :, sel].abs().mean() / u_ref[:, :, sel].abs().mean() for _, u in res.values()]
        lines.append(f"| {edges[i]:.1f}-{edges[i + 1]:.1f} | " + " | ".join(f"{r:.3f}" for r in ratios) + " |")
    return lines


def split_table(row, col, drift, steps: int, shrink: bool, u_ref, far) -> list[str]:
    lines = [
        "",
        "4-bit round trip of one moment at a time (plain AdamW loop, `--split`): mean abs update / torch's, "
        "over all columns and over the last octile's",
        "",
        "| version | m quantized | v quantized | all columns | last octile |",
        "|---|---|---|---:|---:|",
    ]
    for version in (2, 3, 4):
        for qm, qv in ((True, True), (True, False), (False, True)):
            u = split_run(version, qm, qv, row, col, drift, steps, shrink)
            lines.append(
                f"| {version} | {'yes' if qm else 'no'} | {'yes' if qv else 'no'} | "
                f"{u.abs().mean() / u_ref.abs().mean():.3f} | "
                f"{u[:, :, far].abs().mean() / u_ref[:, :, far].abs().mean():.3f} |"
            )
    return lines


if __name__ == "__main__":
    main()
