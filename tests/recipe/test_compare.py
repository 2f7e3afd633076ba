"""`apexw-compare` end to end on a two-run grid with a few steps: processes, JSON, CSV, table, plot."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_two_run_grid(tmp_path):
    out = tmp_path / "cmp"
    cmd = [
        sys.executable,
        "-m",
        "apexw_hf.recipe.compare",
        "--optimizers",
        "adamw_torch,apexw_8bit",
        "--lrs",
        "5e-3",
        "--seeds",
        "0",
        "--jobs",
        "2",
        "--output-dir",
        str(out),
        "--set",
        "train.max_steps=6",
        "--set",
        "data.num_samples=48",
        "--set",
        "data.validation_samples=16",
        "--set",
        "compare.devices=[3]",  # no GPU here: only the assignment (CUDA_VISIBLE_DEVICES per run) is checked
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[2/2]" in proc.stdout and "| optimizer |" in proc.stdout  # progress, then the table

    runs = {
        json.loads(p.read_text())["optimizer"]: json.loads(p.read_text()) for p in (out / "runs").glob("*/result.json")
    }
    assert set(runs) == {"adamw_torch", "apexw_8bit"}
    pids = set()
    for r in runs.values():
        assert r["status"] == "ok", r
        assert r["global_steps"] == 6 and len(r["loss_curve"]) == 6
        assert r["backend"] == "transformers" and r["data_source"] == "shipped"
        assert r["validation_loss"] > 0 and r["steps_per_s"] > 0 and r["optimizer_state_bytes"] > 0
        assert 0 < r["optimizer_step_ms"] < 1000 * r["train_runtime_s"] / r["global_steps"]  # a part of each step
        assert r["learning_rate"] == 5e-3 and r["seed"] == 0 and r["cuda_device"] == 3
        pids.add(r["prepared"]["model"])
    assert len(pids) == 1  # both runs start from the same prepared base
    assert runs["apexw_8bit"]["optimizer_class"].endswith("ApexW8bit")
    # which engine ran is recorded: on a CPU the plain-PyTorch engine, fused through numba when it is importable
    from apexw_hf.engines.torch import numba_engine

    r8 = runs["apexw_8bit"]
    assert r8["optimizer_torch_engine_used"] and not r8["optimizer_triton_engine_used"]
    assert r8["optimizer_numba_used"] == (numba_engine() is not None)
    assert runs["adamw_torch"]["optimizer_class"] == "torch.optim.adamw.AdamW"
    # fp32 AdamW keeps 8 bytes per trainable parameter (plus a step counter per tensor); 8-bit about a quarter
    n = runs["adamw_torch"]["trainable_params"]
    assert 8 * n <= runs["adamw_torch"]["optimizer_state_bytes"] <= 8 * n + 4 * 64  # + a 4-byte step per tensor
    assert runs["apexw_8bit"]["optimizer_state_bytes"] < 0.3 * runs["adamw_torch"]["optimizer_state_bytes"]

    with open(out / "results.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 2 and {r["status"] for r in rows} == {"ok"}
    md = (out / "summary.md").read_text()
    assert "ApexW 8bit (`apexw_8bit`)" in md and "torch AdamW (`adamw_torch`)" in md and "n too small" in md
    assert "GPUs [3], each seed's runs on one GPU" in md
    assert "optimizer step ms (0.005)" in md and "median time of `optimizer.step()`" in md
    assert (out / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # the report can be rebuilt from the stored runs alone
    (out / "summary.md").unlink()
    proc = subprocess.run(cmd + ["--report-only"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "summary.md").read_text() == md


def _plan(overrides):
    from apexw_hf.recipe.compare import plan_grid
    from apexw_hf.recipe.config import load_config

    return [(c["optim"], c["seed"]) for c in plan_grid(load_config("offline_default", overrides))]


def test_plan_alternates_order_and_interleaves_devices():
    grid = ["compare.optimizers=[a,b,c]", "compare.learning_rates=[0.001]", "compare.seeds=[1,2,3]"]
    # one device: seed-major, every second seed in reverse, so each optimizer's average position is the same
    assert _plan(grid) == [("a", 1), ("b", 1), ("c", 1), ("c", 2), ("b", 2), ("a", 2), ("a", 3), ("b", 3), ("c", 3)]
    # two devices (seeds 1, 3 on the first, 2 on the second): their runs alternate, so both start at once
    assert _plan(grid + ["compare.devices=[0,1]"]) == [
        ("a", 1), ("c", 2), ("b", 1), ("b", 2), ("c", 1), ("a", 2), ("a", 3), ("b", 3), ("c", 3),
    ]  # fmt: skip


def test_single_run_with_apexw_4bit_from_the_command_line(tmp_path):
    """`python -m apexw_hf.recipe.finetune --optim apexw_4bit`: ApexW4bit trains the LoRA adapters, and the result
    JSON carries its label and its exact state bytes (format version 2: one byte per element, a bf16 m scale and an
    fp32 v scale per 128, a step each)."""
    out = tmp_path / "one"
    cmd = [
        sys.executable, "-m", "apexw_hf.recipe.finetune", "--config", "offline_default", "--optim", "apexw_4bit",
        "--lr", "5e-3", "--seed", "0", "--output-dir", str(out),
        "--set", "train.max_steps=4", "--set", "data.num_samples=24", "--set", "data.validation_samples=8",
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((out / "result.json").read_text())
    assert r["status"] == "ok" and r["optimizer"] == "apexw_4bit" and r["optimizer_label"] == "ApexW 4bit"
    assert r["optimizer_class"].endswith("ApexW4bit") and r["global_steps"] == 4
    # LoRA r=16 on the offline default's 2 layers (hidden 128, intermediate 352, 2 KV heads of 32): A is (16, in),
    # B is (out, 16) for q, k, v, o, gate, up, down
    dims = [(128, 128), (128, 64), (128, 64), (128, 128), (128, 352), (128, 352), (352, 128)]
    sizes = [n for _ in range(2) for fan_in, fan_out in dims for n in (16 * fan_in, 16 * fan_out)]
    assert sum(sizes) == r["trainable_params"]
    assert r["optimizer_state_bytes"] == sum(n + (4 + 4) * -(-n // 128) + 4 for n in sizes)  # fp32 m, v scales
