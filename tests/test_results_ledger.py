"""The results ledger (docs/results/*.jsonl) is well formed, and every table generated from it is current."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
HEAD = ["run", "grid", "gpu", "commit", "date", "command"]
LEDGERS = ["compare", "memory", "step", "cpu_step"]


@pytest.mark.parametrize("family", LEDGERS)
def test_every_row_starts_with_the_common_keys(family):
    rows = [json.loads(line) for line in (RESULTS / f"{family}.jsonl").read_text().splitlines()]
    assert rows
    for r in rows:
        assert list(r)[: len(HEAD)] == HEAD, r.get("run")
        assert r["run"], r
        if r.get("status", "ok") == "ok":  # a run cut short (its device call ended) may have recorded neither
            assert r["commit"] and r["date"], r["run"]
    names = [(r["grid"], r["run"]) for r in rows]
    assert len(names) == len(set(names)), "a run is in the ledger twice"


def test_every_compare_run_has_its_grid_config():
    grids = {json.loads(line)["grid"] for line in (RESULTS / "compare_grids.jsonl").read_text().splitlines()}
    runs = {json.loads(line)["grid"] for line in (RESULTS / "compare.jsonl").read_text().splitlines()}
    assert runs <= grids, sorted(runs - grids)


def test_the_index_names_every_ledger_file():
    index = (RESULTS / "README.md").read_text()
    for p in sorted(RESULTS.glob("*.jsonl")) + sorted((RESULTS / "archive").glob("*")):
        assert p.name in index, f"docs/results/README.md does not describe {p.name}"


@pytest.mark.parametrize(
    "script", ["make_step_report.py", "make_full_finetune_report.py", "make_fits_table.py", "make_readme_figure.py"]
)
def test_generated_tables_match_the_ledger(script):
    """README.md's and docs/*.md's generated tables are what the report makers produce from the ledger today."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), "--check"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
