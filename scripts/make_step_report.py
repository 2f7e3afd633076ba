"""Generate docs/step_benchmark.md and docs/step_benchmark.png from the step-benchmark ledger.

Every number in the outputs comes from the runs of ``benchmarks/bench_step.py`` in ``docs/results/step.jsonl`` (one
line per run, with the notes written about it; ``scripts/ledger.py add step`` appends one); nothing is typed by hand.

Usage::

    python scripts/make_step_report.py [--check]   # --check: exit 1 if docs/step_benchmark.md is not up to date
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
sys.path.insert(0, str(ROOT / "scripts"))
import ledger  # noqa: E402

TARGETS = {  # issue 3: ratio to torch fused AdamW, same run
    "4x8192^2 fp32": {"apexw_8bit": 1.9, "apexw_compact": 1.5},
    "4x8192^2 bf16": {"apexw_8bit": 1.9, "apexw_compact": 1.4},
    "Llama-3.2-1B shapes fp32": {"apexw_8bit": 1.8, "apexw_compact": 1.5},
    "LoRA Llama-3.2-3B (392 fp32)": {"apexw_8bit": 6.0, "apexw_compact": 6.0},
    "5000x4096 fp32": {"apexw_8bit": 10.0, "apexw_compact": 10.0},
}


def _fmt_ms(r):
    return f"{r['median_ms']:.3f}" if r.get("status") == "ok" else "-"


def _dirty_note(dirty) -> str:
    if dirty in (None, False, ""):
        return ""
    if dirty == "unknown":  # the commit came from APEXW_COMMIT: the tree's state was not recorded with it
        return " (working-tree state not recorded)"
    return f" (with uncommitted changes: {dirty})" if isinstance(dirty, str) else " (with uncommitted changes)"


def report(data: dict) -> str:
    env = data["environment"]
    rows = data["rows"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    optimizers = list(dict.fromkeys(r["optimizer"] for r in rows))
    by = {(r["workload"], r["optimizer"]): r for r in rows}
    lines = [
        f"### {data['run']}: {env['gpu']}",
        "",
        f"torch {env['torch']} (CUDA {env['cuda']}), triton {env['triton']}, bitsandbytes {env['bitsandbytes']}, "
        f"torchao {env['torchao']}, Python {env['python']}; commit `{env['git_commit']}`"
        f"{_dirty_note(env.get('git_dirty'))}; {env['date']}; "
        f"measured copy bandwidth {env['copy_bandwidth_GBps'] / 1e3:.2f} TB/s.",
        f"Median of {data['settings']['steps']} steps"
        + (
            f" or more, until they cover {data['settings']['min_window_seconds']} s (the `steps timed` column),"
            if data["settings"].get("min_window_seconds")
            else ""
        )
        + f" after {data['settings']['warmup']} warm-up steps"
        + (
            f" and at least {data['settings']['warmup_seconds']} s of warm-up"
            if data["settings"].get("warmup_seconds")
            else ""
        )
        + " unless the "
        "row says fewer (slow baselines are capped at a time budget); `x fused` = torch fused time / this time; "
        "`floor` = bytes the step must move (params and grads read, params and states written back) / copy bandwidth.",
        "",
    ]
    # Runs before the flag was recorded in the settings are marked by their name (`*_moving`).
    if data["settings"].get("moving_grads", data["run"].endswith("_moving")):
        lines += [
            "**Gradients at new addresses every step** (`--moving-grads`: two sets of equal values swapped before "
            "each step, outside the timed span), as in training loops whose `zero_grad` frees them; the other runs "
            "keep one set of gradients.",
            "",
        ]
    if data.get("launch_config"):
        lines += [f"Kernel tiles used (rows of 256, warps) by format and param bytes: `{data['launch_config']}`", ""]
    clocks = any("sm_clock_mhz_median" in r for r in rows)  # runs since the benchmark samples nvidia-smi
    if clocks:
        lines += [
            "`SM MHz` = median (min) SM clock over the row's warm-up and timed steps (nvidia-smi, every 100 ms).",
            "",
        ]
    for w in workloads:
        fused = by.get((w, "torch_fused"), {}).get("median_ms")
        first = next(r for r in rows if r["workload"] == w)
        lines += [
            f"#### {w} ({first['num_tensors']} tensors, {first['numel'] / 1e6:.1f}M params)",
            "",
            "| optimizer | ms/step | x fused | floor ms | % of floor | state B/param | steps timed |"
            + (" SM MHz |" if clocks else ""),
            "|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if clocks else ""),
        ]
        for o in optimizers:
            r = by.get((w, o))
            if r is None:
                continue
            if r.get("status") != "ok":
                lines.append(f"| {o} | {r['status']} | | | | | |" + (" |" if clocks else ""))
                continue
            ratio = f"{fused / r['median_ms']:.2f}" if fused else "-"  # a run without torch's fused AdamW
            clk = ""
            if clocks:
                clk = (
                    f" {r['sm_clock_mhz_median']:.0f} ({r['sm_clock_mhz_min']:.0f}) |"
                    if "sm_clock_mhz_median" in r
                    else f" {r.get('clocks', '-')} |"
                )
            lines.append(
                f"| {o} | {r['median_ms']:.3f} | {ratio} | {r['floor_ms']:.3f} | {r['floor_fraction'] * 100:.0f}% "
                f"| {r['state_bytes_per_param']:.2f} | {r['steps_timed']} |" + clk
            )
        lines.append("")
    # Targets of issue 3.
    lines += [
        "#### Targets of issue 3 (ratio to torch fused, forced kernel)",
        "",
        "| workload | apexw_8bit | target | apexw_compact | target |",
        "|---|---:|---:|---:|---:|",
    ]
    for w, t in TARGETS.items():
        fused = by.get((w, "torch_fused"), {}).get("median_ms")
        cells = []
        for fmt in ("apexw_8bit", "apexw_compact"):
            r = by.get((w, fmt + "_triton"), {})
            ok = r.get("status") == "ok" and fused
            cells += [f"{fused / r['median_ms']:.2f}" if ok else "-", f">= {t[fmt]}"]
        lines.append(f"| {w} | " + " | ".join(cells) + " |")
    lines.append("")
    if data.get("notes"):  # analysis written by a person about this run, kept beside its numbers
        lines += ["#### Notes on this run", "", data["notes"].strip(), ""]
    return "\n".join(lines)


def plot(datas, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # the newest run among those with the most workloads (a short run of two workloads does not replace a full one),
    # of the runs that timed torch's fused AdamW (the plot's ratios are to it; a run of ApexW rows only compares
    # ApexW variants with each other)
    datas = [d for d in datas if any(r["optimizer"] == "torch_fused" for r in d["rows"])] or datas
    most = max(len({r["workload"] for r in d["rows"]}) for d in datas)
    data = next(d for d in datas if len({r["workload"] for r in d["rows"]}) == most)
    rows = [r for r in data["rows"] if r.get("status") == "ok"]
    workloads = list(dict.fromkeys(r["workload"] for r in data["rows"]))
    optimizers = list(dict.fromkeys(r["optimizer"] for r in data["rows"]))
    by = {(r["workload"], r["optimizer"]): r for r in rows}
    fig, ax = plt.subplots(figsize=(13, 5))
    width = 0.8 / len(optimizers)
    colors = plt.get_cmap("tab20").colors
    for j, o in enumerate(optimizers):
        xs, ys = [], []
        for i, w in enumerate(workloads):
            fused = by.get((w, "torch_fused"))
            r = by.get((w, o))
            if r and fused:
                xs.append(i + (j - len(optimizers) / 2) * width)
                ys.append(fused["median_ms"] / r["median_ms"])
        ax.bar(xs, ys, width, label=o, color=colors[j % len(colors)])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_yscale("log")
    ax.set_xticks(range(len(workloads)))
    ax.set_xticklabels(workloads, rotation=15, fontsize=8)
    ax.set_ylabel("speed vs torch fused AdamW (x, log)")
    env = data["environment"]
    ax.set_title(
        f"Optimizer step, {env['gpu']}, commit {env['git_commit'][:7]}, {env['date'][:10]} (higher is faster)"
    )
    ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only check docs/step_benchmark.md against the ledger")
    args = ap.parse_args(argv)
    # newest first (by the date each run recorded); the plot shows the newest full run
    datas = sorted(ledger.load("step"), key=lambda d: d["environment"]["date"], reverse=True)
    if not datas:
        sys.exit("no results: run benchmarks/bench_step.py --out RUN.json, then scripts/ledger.py add step RUN.json")
    parts = [
        "# Optimizer step benchmark",
        "",
        "Generated by `scripts/make_step_report.py` from the runs in "
        "[`docs/results/step.jsonl`](results/step.jsonl) (written by `benchmarks/bench_step.py`). Do not edit by "
        "hand.",
        "",
    ]
    parts += [report(d) for d in datas]
    if not any(r["optimizer"].startswith("apexw_4bit") for d in datas for r in d["rows"]):
        parts[4:4] = [
            "No stored result has a row for the 4-bit state format (`apexw_4bit`): its GPU step time is not measured "
            "yet.",
            "",
        ]
    parts += ["![step benchmark](step_benchmark.png)", ""]
    text = "\n".join(parts)
    if args.check:
        if (DOCS / "step_benchmark.md").read_text() != text:
            print("docs/step_benchmark.md is out of date: run python scripts/make_step_report.py")
            return 1
        return 0
    (DOCS / "step_benchmark.md").write_text(text)
    plot(datas, DOCS / "step_benchmark.png")
    print(f"wrote {DOCS / 'step_benchmark.md'} and {DOCS / 'step_benchmark.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
