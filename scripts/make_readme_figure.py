"""Make the README's figure (docs/readme_gains.png) and its speed table from stored results.

Every number comes from the results ledger in ``docs/results/`` (nothing is typed by hand):

* peak GPU memory of a full fine-tune of Llama-3.2-1B shapes on one H200, per optimizer and model dtype: the newest
  grid ``full_finetune_h200/speed_*`` of ``compare.jsonl`` (the same runs as the README's full fine-tune table);
* optimizer step time against torch fused AdamW, bitsandbytes 8-bit and torchao 8/4-bit, measured in one run of
  ``benchmarks/bench_step.py``: the run :data:`STEP_RUN` of ``step.jsonl`` (the newest run that has every baseline).

The speed table is written between ``<!-- readme-speed -->`` and ``<!-- /readme-speed -->`` in README.md.

Usage::

    python scripts/make_readme_figure.py            # writes docs/readme_gains.png and README.md's speed table
    python scripts/make_readme_figure.py --check    # exit 1 if README.md's table is not what the results give
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import ledger  # noqa: E402

FIGURE = ROOT / "docs" / "readme_gains.png"
README = ROOT / "README.md"
# the newest step-benchmark run with every baseline (torch fused, bitsandbytes, torchao) and every ApexW format
STEP_RUN = "step_h200_2026-12-03_5cd725d"

MEMORY_ROWS = [  # (optimizer spec in the grid, label)
    ("adamw_torch_fused@fp32", "torch AdamW, fp32 master weights"),
    ("adamw_torch_fused@bf16", "torch AdamW, bf16 model"),
    ("adamw_8bit@fp32", "bitsandbytes 8-bit, fp32 master"),
    ("adamw_8bit@bf16", "bitsandbytes 8-bit, bf16 model"),
    ("apexw_compact@bf16", "apexw_compact, bf16 model"),
    ("apexw_8bit@bf16", "apexw_8bit, bf16 model"),
]
STEP_ROWS = [  # (bench_step.py optimizer name, label)
    ("torch_fused", "torch AdamW (fused)"),
    ("bnb_adamw8bit", "bitsandbytes 8-bit"),
    ("torchao_adamw8bit", "torchao 8-bit"),
    ("torchao_adamw4bit", "torchao 4-bit"),
    ("apexw_compact_triton", "apexw_compact"),
    ("apexw_8bit_triton", "apexw_8bit"),
    ("apexw_4bit_triton", "apexw_4bit"),
]
STEP_WORKLOADS = ["Llama-3.2-1B shapes fp32", "LoRA Llama-3.2-3B (392 fp32)"]


def _speed_grid() -> str:
    def date(g: str) -> str:
        return max((r.get("environment", {}).get("date_utc", "") for r in ledger.runs(g)), default="")

    grids = sorted(ledger.grids("full_finetune_h200/speed_*"), key=lambda g: (date(g), g))
    if not grids:
        raise SystemExit("no grid full_finetune_h200/speed_* in docs/results/compare.jsonl")
    return grids[-1]


def _step_rows() -> list[dict]:
    found = [r for r in ledger.load("step") if r["run"] == STEP_RUN]
    if not found:
        raise SystemExit(f"no run {STEP_RUN} in docs/results/step.jsonl")
    return found[0]["rows"]


def memory() -> tuple[str, list[tuple[str, float]]]:
    grid = _speed_grid()
    runs = {}
    for r in ledger.runs(grid):
        if r.get("status") == "ok":
            runs.setdefault(r["optimizer"], r["peak_gpu_mem_allocated_gib"])
    return grid, [(label, runs[spec]) for spec, label in MEMORY_ROWS if spec in runs]


def step_times() -> dict[str, dict[str, float]]:
    rows = _step_rows()
    ms = {(r["workload"], r["optimizer"]): r["median_ms"] for r in rows if r.get("status") == "ok"}
    return {w: {label: ms[(w, o)] for o, label in STEP_ROWS if (w, o) in ms} for w in STEP_WORKLOADS}


def training_speed() -> str:
    """One line: whole training steps/s of the longer H200 runs (``full_finetune_h200/steady_*``), mean over seeds."""
    grids = ledger.grids("full_finetune_h200/steady_*")
    if not grids:
        return ""
    runs = ledger.runs(grids[-1])
    by: dict[str, list[float]] = {}
    for r in runs:
        if r.get("status") == "ok":
            by.setdefault(r["optimizer"], []).append(r["steps_per_s"])
    steps = sorted({r["global_steps"] for r in runs})
    names = {
        "adamw_torch_fused@fp32": "torch AdamW with fp32 master weights",
        "apexw_8bit@bf16": "apexw_8bit on the bf16 model",
    }
    parts = [f"{names.get(o, o)} {sum(v) / len(v):.2f}" for o, v in by.items()]
    return (
        f"\nWhole training steps/s, same H200 set-up ({'/'.join(map(str, steps))} steps, "
        f"{len(runs) // max(1, len(by))} seeds): {', '.join(parts)}.\n"
    )


def speed_table() -> str:
    times = step_times()
    rows = _step_rows()
    bpp = {r["optimizer"]: r["state_bytes_per_param"] for r in rows if r["workload"] == STEP_WORKLOADS[0]}
    head = " | ".join(f"{w}: ms (x torch fused)" for w in STEP_WORKLOADS)
    lines = [f"| optimizer | state bytes/param | {head} |", "|---|---:|" + "---:|" * len(STEP_WORKLOADS)]
    for o, label in STEP_ROWS:
        cells = []
        for w in STEP_WORKLOADS:
            t, base = times[w].get(label), times[w].get("torch AdamW (fused)")
            cells.append("-" if t is None else f"{t:.2f} ({base / t:.2f}x)")
        lines.append(f"| {label} | {bpp.get(o, float('nan')):.2f} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n" + training_speed()


def figure(path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid, mem = memory()
    times = step_times()
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.6), gridspec_kw={"width_ratios": [1, 1.15]})
    labels, gib = zip(*mem)
    colors = ["#1f77b4" if "apexw" in x else "#9e9e9e" for x in labels]
    a.barh(labels, gib, color=colors)
    for y, v in enumerate(gib):
        a.text(v + 0.2, y, f"{v:.1f}", va="center", fontsize=9)
    a.invert_yaxis()
    a.set_xlabel("peak GPU memory (GiB)")
    a.set_title(
        "Full fine-tune, Llama-3.2-1B shapes, one H200\n(seq 1024 x batch 4, gradient checkpointing)", fontsize=10
    )
    a.set_xlim(0, max(gib) * 1.15)

    names = [label for _, label in STEP_ROWS]
    width = 0.38
    for k, w in enumerate(STEP_WORKLOADS):
        vals = [times[w].get(n, float("nan")) for n in names]
        ys = [i + (k - 0.5) * width for i in range(len(names))]
        b.barh(ys, vals, height=width, label=w, color=["#ff7f0e", "#2ca02c"][k])
    b.set_yticks(range(len(names)), names)
    b.invert_yaxis()
    b.set_xscale("log")
    b.set_xlabel("optimizer step (ms, log scale; lower is better)")
    b.set_title("Optimizer step alone, one H200 (same run)", fontsize=10)
    b.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    fig.text(
        0.01,
        0.01,
        f"Generated by scripts/make_readme_figure.py from docs/results/compare.jsonl (grid {grid}) and "
        f"docs/results/step.jsonl (run {STEP_RUN})",
        fontsize=7,
        color="#666666",
    )
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _replace(text: str, name: str, body: str) -> str:
    start, end = f"<!-- {name} -->", f"<!-- /{name} -->"
    if start not in text or end not in text:
        raise SystemExit(f"README.md: marker {start} ... {end} missing")
    a, b = text.index(start) + len(start), text.index(end)
    return text[:a] + "\n" + body + text[b:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only check README.md's table against the results")
    args = ap.parse_args(argv)
    text = README.read_text()
    new = _replace(text, "readme-speed", speed_table())
    if args.check:
        if new != text:
            print("README.md's speed table is out of date: run python scripts/make_readme_figure.py")
            return 1
        return 0
    README.write_text(new)
    figure(FIGURE)
    print(f"wrote {FIGURE.relative_to(ROOT)} and README.md's speed table")
    return 0


if __name__ == "__main__":
    sys.exit(main())
