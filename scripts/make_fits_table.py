"""The "what fits where" tables of README.md and docs/full_finetune.md, from stored H200 runs.

Reads the runs of ``benchmarks/bench_full_finetune_memory.py`` in the ledger ``docs/results/memory.jsonl`` whose grid
is ``gradient_release_h200/memory_*`` (the latest run of each cell) and writes two tables between
``<!-- fits-table -->`` and ``<!-- /fits-table -->`` markers: a short one for the README (the headline cells) and a
full one for docs/full_finetune.md (every cell, allocated and reserved GiB, s/step, state, the run's commit).

    python scripts/make_fits_table.py [--check]   # --check: exit 1 if the files are not up to date
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "scripts")]
import ledger  # noqa: E402
from bench_full_finetune_memory import CONTEXT_GIB, GPU_SIZES_GB, fits  # noqa: E402

MEMORY_GRIDS = "gradient_release_h200/memory_*"
OFFLOAD_GRIDS = "state_offload/*"  # the state offload cells' runs (their GPU is in the full table)
OFFLOAD_CELLS = ("apexw_8bit_offload+liger@bf16", "apexw_4bit_offload+liger@bf16")
SHAPE_NAMES = {"1b": "Llama-3.2-1B", "3b": "Llama-3.2-3B", "8b": "Llama-3.1-8B"}
LABELS = {
    "torch_fused@fp32": "torch AdamW (fused), fp32 master weights",
    "torch_fused@bf16": "torch AdamW (fused), bf16 model",
    "bnb_8bit@bf16": "bitsandbytes AdamW8bit, bf16 model",
    "torchao_8bit@bf16": "torchao AdamW8bit, bf16 model, stochastic rounding",
    "torchao_4bit@bf16": "torchao AdamW4bit, bf16 model, stochastic rounding",
    "torchao_8bit_inbwd+liger@bf16": "torchao AdamW8bit in backward (PyTorch's recipe, no clipping) + Liger",
    "torchao_4bit_inbwd+liger@bf16": "torchao AdamW4bit in backward (PyTorch's recipe, no clipping) + Liger",
    "apexw_8bit@bf16": "`apexw_8bit`",
    "apexw_4bit@bf16": "`apexw_4bit`",
    "apexw_8bit+liger@bf16": "`apexw_8bit` + Liger cross-entropy",
    "apexw_4bit+liger@bf16": "`apexw_4bit` + Liger cross-entropy",
    "apexw_8bit_release@bf16": "`apexw_8bit_release`",
    "apexw_4bit_release@bf16": "`apexw_4bit_release`",
    "apexw_8bit_release+liger@bf16": "`apexw_8bit_release` + Liger cross-entropy",
    "apexw_4bit_release+liger@bf16": "`apexw_4bit_release` + Liger cross-entropy",
    "apexw_8bit_offload+liger@bf16": "`apexw_8bit_offload` (release, state in host memory) + Liger cross-entropy",
    "apexw_4bit_offload+liger@bf16": "`apexw_4bit_offload` (release, state in host memory) + Liger cross-entropy",
}
README_CELLS = (
    "torch_fused@fp32",
    "bnb_8bit@bf16",
    "apexw_8bit_release+liger@bf16",
    "apexw_4bit_release+liger@bf16",
    "apexw_8bit_offload+liger@bf16",
    "apexw_4bit_offload+liger@bf16",
)


def load_runs() -> dict[tuple[str, str], dict]:
    runs = {}
    found = [
        r
        for r in ledger.load("memory")
        if fnmatch.fnmatchcase(r["grid"] or "", MEMORY_GRIDS)
        or (fnmatch.fnmatchcase(r["grid"] or "", OFFLOAD_GRIDS) and r["cell"] in OFFLOAD_CELLS)
    ]
    for row in sorted(found, key=lambda r: (r["grid"], r["run"])):
        if row.get("tag") or row.get("optim_args"):
            continue  # a variant (--tag / --optim-args), not the cell as a user runs it
        key = (row["shape"], row["cell"])
        if key not in runs or row.get("date", "") >= runs[key].get("date", ""):
            runs[key] = row  # the latest run of a cell (re-measured after a change)
    return runs


def _fits(row: dict) -> str:
    ok = fits(row["peak_reserved_gib"])
    return "-" if ok == "-" else ", ".join(f"{s} GB" for s in ok.split(","))


def _host_gib(row: dict) -> float | None:
    """The pinned host memory a state offload run held (what the allocator reserved, where the run recorded it; else
    the state's own bytes), None for a run that kept its state on the GPU."""
    if row.get("state_host_gib") is None:
        return None
    return row.get("host_pinned_gib") or row["state_host_gib"]


def _host(row: dict) -> str:
    value = _host_gib(row)
    return "-" if value is None else f"{value:.2f}"


def _gpu(row: dict) -> str:
    return (row.get("gpu") or "-").replace("NVIDIA ", "")


def full_table(runs: dict) -> str:
    lines = [
        "| shape | optimizer | peak allocated GiB | peak reserved GiB | s/step | optimizer state MiB | "
        "pinned host memory GiB | gradients alive at the step | fits | GPU | run |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    order = list(LABELS)
    for (shape, cell), r in sorted(runs.items(), key=lambda kv: (kv[0][0], order.index(kv[0][1]))):
        lines.append(
            f"| {SHAPE_NAMES[shape]} | {LABELS[cell]} | {r['peak_allocated_gib']:.2f} | "
            f"{r['peak_reserved_gib']:.2f} | {r['s_per_step']:.3f} | {r['optimizer_state_mib']:.0f} | "
            f"{_host(r)} | {r['grads_alive_before_step']} | {_fits(r)} | {_gpu(r)} | "
            f"[{r['commit']}](results/memory.jsonl) |"
        )
    return "\n".join(lines)


def readme_table(runs: dict) -> str:
    shapes = [s for s in SHAPE_NAMES if any((s, c) in runs for c in README_CELLS)]
    lines = ["| optimizer | " + " | ".join(SHAPE_NAMES[s] for s in shapes) + " |", "|---|" + "---:|" * len(shapes)]
    for cell in README_CELLS:
        if not any((s, cell) in runs for s in shapes):
            continue
        cells = []
        for s in shapes:
            r = runs.get((s, cell))
            if r is None:
                cells.append("-")
                continue
            host = "" if _host_gib(r) is None else f"; {_host_gib(r):.1f} GiB host"
            cells.append(f"{r['peak_allocated_gib']:.1f} GiB ({_fits(r).split(',')[0]}{host})")
        lines.append(f"| {LABELS[cell]} | " + " | ".join(cells) + " |")
    note = (
        "\nPeak GPU memory allocated through the Hugging Face Trainer, seq 1024 x batch 4, gradient checkpointing, "
        "random weights of each model's shape, one H200 (the `_offload` rows: one H100); in brackets the smallest of "
        f"{', '.join(map(str, GPU_SIZES_GB))} GB that holds the peak reserved memory plus {CONTEXT_GIB} GiB for the "
        "CUDA context, and for the `_offload` rows the pinned host memory they hold. Every cell, speeds and the "
        "method: "
        "[docs/full_finetune.md](docs/full_finetune.md#what-fits-where)."
    )
    return "\n".join(lines) + "\n" + note


def _replace(text: str, name: str, body: str) -> str:
    start, end = f"<!-- {name} -->", f"<!-- /{name} -->"
    i, j = text.index(start) + len(start), text.index(end)
    return text[:i] + "\n" + body + "\n" + text[j:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    runs = load_runs()
    stale = []
    targets = ((ROOT / "README.md", readme_table(runs)), (ROOT / "docs" / "full_finetune.md", full_table(runs)))
    for path, body in targets:
        old = path.read_text()
        new = _replace(old, "fits-table", body)
        if new != old:
            stale.append(path.name)
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        print(f"out of date: {', '.join(stale)}; run python scripts/make_fits_table.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
