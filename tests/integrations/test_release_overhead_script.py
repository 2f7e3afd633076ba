"""scripts/bench_release_overhead.py (the GPU measurement of what gradient release costs per step) on a tiny model on
the CPU: its blocks alternate, the release arm really releases, and the JSON holds what the summary is made of."""

import json
import math
import statistics

import pytest

from ..scripts import load_script


def _load():
    return load_script("bench_release_overhead")


def test_release_overhead_smoke_run_on_cpu(tmp_path):
    out = tmp_path / "ro.json"
    argv = ["--shape", "tiny", "--device", "cpu", "--format", "8bit", "--rounds", "2", "--steps", "3", "--warmup", "1"]
    row = _load().main([*argv, "--seq", "16", "--batch", "2", "--bucket", "4096", "--out", str(out)])
    assert json.loads(out.read_text())["median_ratio"] == row["median_ratio"]
    assert [b["first"] for b in row["blocks"]] == ["plain", "release"]  # A B, then B A
    for block in (b[arm] for b in row["blocks"] for arm in ("plain", "release")):
        assert len(block["step_s"]) == 3 and len(block["timed"]) == 2 and math.isfinite(block["loss_last"])
    # buckets of 4,096 elements split the tiny model's backward into several launches
    assert row["flushes_per_step"] > 2 and row["release_host_ms_per_step"] > 0
    expect = [statistics.median(b["release"]["timed"]) / statistics.median(b["plain"]["timed"]) for b in row["blocks"]]
    assert row["round_ratios"] == expect and row["median_ratio"] == statistics.median(expect)
    assert row["commit"] and row["date"] and row["device"] == "cpu" and row["offload"] is False


def test_release_overhead_offload_arm_is_refused_on_cpu():
    """--offload puts the release arm's state in host memory, which needs the Triton kernels on a GPU: on the CPU the
    optimizer's own error says so (no arm silently runs without it)."""
    argv = ["--shape", "tiny", "--device", "cpu", "--rounds", "1", "--steps", "2", "--warmup", "1", "--offload"]
    with pytest.raises(ValueError, match="state_offload=True streams the state through the Triton kernels on a GPU"):
        _load().main([*argv, "--seq", "16", "--batch", "2"])
