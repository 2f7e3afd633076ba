"""The shipped offline instruction set is exactly what scripts/make_dataset.py generates, and its splits are sound."""

import json
from pathlib import Path

from ..scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "apexw_hf" / "data"


def _generator():
    return load_script("make_dataset")


def test_regenerated_files_equal_shipped_bytes(tmp_path):
    paths = _generator().write(tmp_path)
    assert sorted(p.name for p in paths) == ["offline_train.jsonl", "offline_validation.jsonl"]
    for p in paths:
        assert p.read_bytes() == (DATA / p.name).read_bytes(), f"{p.name} differs from the shipped file"


def test_other_seed_gives_other_data(tmp_path):
    gen = _generator()
    gen.write(tmp_path, seed=gen.SEED + 1)
    assert (tmp_path / "offline_train.jsonl").read_bytes() != (DATA / "offline_train.jsonl").read_bytes()


def test_splits_sizes_disjoint_and_all_tasks_present():
    rows = {
        s: [json.loads(x) for x in (DATA / f"offline_{s}.jsonl").read_text().splitlines()]
        for s in ("train", "validation")
    }
    assert len(rows["train"]) == 1000 and len(rows["validation"]) == 200
    key = lambda r: json.dumps(r["messages"], sort_keys=True)
    assert not {key(r) for r in rows["train"]} & {key(r) for r in rows["validation"]}
    assert len({key(r) for r in rows["train"]}) == 1000  # no duplicate samples
    tasks = set(_generator().TASKS)
    for split in rows.values():
        assert {r["task"] for r in split} == tasks
        for r in split:
            roles = [m["role"] for m in r["messages"]]
            assert roles == ["user", "assistant"] and all(m["content"] for m in r["messages"])
