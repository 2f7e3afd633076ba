"""Read and extend the results ledger: the JSON-lines tables in ``docs/results/`` (docs/results/README.md lists them).

One line per run. Every line starts with the same keys: ``run`` (its name), ``grid`` (the grid or batch of runs it
belongs to, or null), ``gpu`` (the device), ``commit``, ``date`` (UTC) and ``command`` (null where the run did not
record one); the rest is the record the tool wrote, as it wrote it (``apexw-compare``'s run JSON without its
``log_history``, ``benchmarks/bench_step.py``'s output with its rows, ...). ``compare_grids.jsonl`` holds one line per
``apexw-compare`` grid: its ``config.json`` and ``grid_meta.json``.

    python scripts/ledger.py add compare GRID_DIR --grid NAME     # every runs/*/result.json of an apexw-compare grid
    python scripts/ledger.py add step RUN.json [--notes RUN.md]    # one run of benchmarks/bench_step.py
    python scripts/ledger.py add memory CELL.json ... --grid NAME  # runs of benchmarks/bench_full_finetune_memory.py
    python scripts/ledger.py add cpu_step RUN.json                 # one run of benchmarks/bench_cpu_step.py
    python scripts/ledger.py add host_link RUN.json --grid NAME    # one run of benchmarks/bench_host_link.py
    python scripts/ledger.py add step_against RUN.json --grid NAME  # one run of benchmarks/bench_step_against.py

The report makers (``scripts/make_*.py``) read the ledger through :func:`load`; after adding runs, rerun them.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
FAMILIES = ("compare", "compare_grids", "memory", "step", "cpu_step", "host_link", "step_against")
_HEAD = ("run", "grid", "gpu", "commit", "date", "command")


def path(family: str) -> Path:
    if family not in FAMILIES:
        raise ValueError(f"unknown ledger {family!r}; one of {', '.join(FAMILIES)}")
    return RESULTS / f"{family}.jsonl"


@cache
def _load(family: str) -> tuple[dict, ...]:
    p = path(family)
    return tuple(json.loads(line) for line in p.read_text().splitlines() if line.strip()) if p.exists() else ()


def load(family: str) -> list[dict]:
    """Every row of ``docs/results/<family>.jsonl``, in file order (copies: callers may change them)."""
    return [dict(r) for r in _load(family)]


def grids(pattern: str) -> list[str]:
    """The names of the ``apexw-compare`` grids matching the glob ``pattern``, sorted."""
    names = {r["grid"] for r in _load("compare")} | {g["grid"] for g in _load("compare_grids")}
    return sorted(n for n in names if fnmatch.fnmatchcase(n, pattern))


def runs(grid: str) -> list[dict]:
    """The runs of one ``apexw-compare`` grid, in the order of their run names."""
    return sorted((dict(r) for r in _load("compare") if r["grid"] == grid), key=lambda r: r["run"])


def grid_config(grid: str) -> dict | None:
    """A grid's ``config.json`` as ``apexw-compare`` wrote it, or None when none was stored."""
    return next((g["config"] for g in _load("compare_grids") if g["grid"] == grid), None)


def row(record: dict, run: str, grid: str | None, gpu, commit, date, command=None) -> dict:
    """A ledger line: the common keys first, then the tool's record."""
    return {**dict(zip(_HEAD, (run, grid, gpu, commit, date, command))), **record}


def append(family: str, rows: list[dict]) -> None:
    known = {(r["grid"], r["run"]) for r in _load(family)} if family != "compare_grids" else set()
    clash = [r["run"] for r in rows if (r.get("grid"), r.get("run")) in known]
    if clash:
        raise SystemExit(f"{path(family).name} already has {', '.join(clash)}")
    with path(family).open("a") as f:
        for r in rows:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")
    _load.cache_clear()


def _from_compare(folder: Path, grid: str) -> tuple[list[dict], dict]:
    rows = []
    for p in sorted(folder.glob("runs/*/result.json")):
        r = json.loads(p.read_text())
        r.pop("log_history", None)
        env = r.get("environment", {})
        rows.append(row(r, p.parent.name, grid, env.get("device"), env.get("git_commit"), env.get("date_utc")))
    meta = folder / "grid_meta.json"
    config = {"grid": grid, "config": json.loads((folder / "config.json").read_text())}
    config["meta"] = json.loads(meta.read_text()) if meta.exists() else None
    return rows, config


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    add = sub.add_parser("add", help="append runs to a ledger")
    add.add_argument("family", choices=[f for f in FAMILIES if f != "compare_grids"])
    add.add_argument("paths", nargs="+", type=Path)
    add.add_argument("--grid", help="grid name (compare, memory)")
    add.add_argument("--notes", type=Path, help="step: a Markdown file of notes on the run, shown in its report")
    add.add_argument("--command", help="the command that made the run, where the record lacks it")
    args = ap.parse_args(argv)
    if args.family == "compare":
        for folder in args.paths:
            rows, config = _from_compare(folder, args.grid or folder.name)
            append("compare", rows)
            append("compare_grids", [config])
        return 0
    rows = []
    for p in args.paths:
        d = json.loads(p.read_text())
        if args.family in ("memory", "host_link", "step_against"):
            rows.append(row(d, p.stem, args.grid, d.get("gpu"), d.get("commit"), d.get("date"), args.command))
        elif args.family == "step":
            env = d["environment"]
            r = row(d, p.stem, args.grid, env.get("gpu"), env.get("git_commit"), env.get("date"), args.command)
            r["notes"] = args.notes.read_text() if args.notes else None
            rows.append(r)
        else:
            gpu = (d.get("cpu") or {}).get("model")
            rows.append(row(d, p.stem, args.grid, gpu, d.get("git_commit"), d.get("date"), args.command))
    append(args.family, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
