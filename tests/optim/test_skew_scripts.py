"""scripts/skew_walk.py (the skewed-block simulation of issue 45), scripts/block_skew.py (how skewed a real
fine-tune's blocks are) and scripts/update_size.py (the formats' update on noisy skewed rows), each run tiny: they
run the real update path, write their markdown, and refuse bad flags."""

import shutil
from pathlib import Path

import pytest

from ..scripts import load_script


def test_skew_walk_tiny_run_writes_its_table(tmp_path):
    out = tmp_path / "walk.md"
    argv = ["--beta2", "0.99", "--ratios", "4,24", "--blocks", "1", "--steps-scale", "0.02", "--out", str(out)]
    rows = load_script("skew_walk").main(argv)
    assert {(r["format"], r["scenario"], r["log2_ratio"]) for r in rows} == {
        (f, s, k) for f in ("compact", "8bit", "4bit") for s in ("held", "decaying") for k in (4, 24)
    }
    # compact is the control: bf16 moments keep the update size of torch AdamW at any skew
    assert all(0.97 <= r["ratio"] <= 1.03 for r in rows if r["format"] == "compact")
    text = out.read_text()
    assert "python scripts/skew_walk.py --beta2 0.99" in text and "| 8bit | 0.99 (20) |" in text


@pytest.mark.parametrize("argv", [["--formats", "int4"], ["--scenarios", "rising"], ["--blocks", "0"]])
def test_skew_walk_refuses_bad_flags(argv):
    with pytest.raises(ValueError, match="int4|rising|blocks"):
        load_script("skew_walk").main([*argv, "--steps-scale", "0.01"])


def test_block_skew_tiny_fine_tune(tmp_path):
    out = tmp_path / "skew.md"
    rows = load_script("block_skew").main(["--steps", "1,2", "--out", str(out)])
    assert [(r["step"], r["block"]) for r in rows] == [(1, 256), (1, 128), (2, 256), (2, 128)]
    for r in rows:
        shares = [r["past"][k] for k in sorted(r["past"])]
        assert shares == sorted(shares, reverse=True) and 0 <= r["zero"] <= 1
    assert "config offline_full" in out.read_text()


def test_kernel_sass_compiles_for_sm90_on_the_cpu():
    """scripts/kernel_sass.py (the static kernel cost of issue 45's comparison) in a process of its own: the kernels
    must be compiled there, not interpreted."""
    import os
    import subprocess
    import sys

    from ..scripts import ROOT

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "kernel_sass.py"), "--formats", "8bit"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout
    lines = out.splitlines()
    assert len(lines) == 2 and all(x.startswith("sm_90 8bit p=g=") and "SASS instructions" in x for x in lines)


def test_skew_candidates_tiny_run():
    rows = load_script("skew_candidates").main(["--beta2", "0.99", "--ratios", "4", "--steps-scale", "0.02"])
    assert {(r["format"], r["scenario"]) for r in rows} == {
        (c, s) for c in ("4bit_env", "8bit_exact") for s in ("held", "decaying")
    }
    assert all(0.5 < r["ratio"] < 2 for r in rows)
    with pytest.raises(ValueError, match="int4"):
        load_script("skew_candidates").main(["--candidates", "int4"])


def test_update_size_tiny_run_against_an_old_package(tmp_path):
    """scripts/update_size.py with this tree's package standing in for another commit's (``--old``): the old column
    then steps exactly as the 4-bit one, and the split table's rows (4-bit round trips) are all there."""
    old = tmp_path / "old"
    old.mkdir()
    shutil.copytree(Path(__file__).resolve().parents[2] / "apexw_hf", old / "apexw_hf")
    argv = ["--old", str(old), "--steps", "12", "--rows", "2", "--cols", "256", "--split"]
    text = load_script("update_size").main(argv)
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert rows["4bit_old"].split(" | ")[1:] == rows["4bit"].split(" | ")[1:]
    assert sum(line.startswith(("| 2 | ", "| 3 | ", "| 4 | ")) for line in text.splitlines()) == 9
    assert "command: `python scripts/update_size.py --old" in text


def test_update_size_refuses_bad_flags():
    with pytest.raises(SystemExit, match="sigma"):
        load_script("update_size").main(["--split", "--sigma", "0", "--steps", "4"])
