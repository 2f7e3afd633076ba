"""Unsloth's CPU mode keeps optim="apexw_8bit" (it rewrites every name containing "8bit" to adamw_torch_fused).

Unsloth patches transformers and TRL globally, so each check runs in a fresh interpreter. Where Unsloth comes from:

* ``APEXW_UNSLOTH_SITE``, or ``.unsloth-site`` in the repository (``scripts/unsloth_cpu_site.sh``, run by the
  README's test command): a directory with Unsloth installed without its dependencies, put first on the path of this
  interpreter (the light way, used by CI: ``pip install --no-deps --target DIR unsloth==2026.10.9
  unsloth_zoo==2026.10.9 tyro docstring-parser shtab typeguard msgspec cut_cross_entropy structlog json5
  nest-asyncio hf_transfer sentencepiece``; a plain ``pip install unsloth`` would replace torch 2.13 CPU with a
  CUDA build of torch 2.14 and add torchvision, xformers and diffusers);
* ``APEXW_UNSLOTH_PYTHON``: another interpreter that has Unsloth;
* else this interpreter if it has Unsloth; otherwise the test is skipped with the reason.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .tiny import ROOT

SCRIPT = ROOT / "tests" / "integrations" / "unsloth_cpu_check.py"


def _interpreter() -> tuple[str, list[str]]:
    """The Python to run the check with, and the directories to put first on its path."""
    python = os.environ.get("APEXW_UNSLOTH_PYTHON")
    site = os.environ.get("APEXW_UNSLOTH_SITE")
    if not site and (ROOT / ".unsloth-site" / "unsloth").is_dir():  # made by scripts/unsloth_cpu_site.sh
        site = str(ROOT / ".unsloth-site")
    if site and not (Path(site) / "unsloth").is_dir():
        pytest.fail(f"APEXW_UNSLOTH_SITE={site} has no unsloth package")
    if not python and not site and importlib.util.find_spec("unsloth") is None:
        pytest.skip("Unsloth is not installed (set APEXW_UNSLOTH_SITE or APEXW_UNSLOTH_PYTHON, see the docstring)")
    return python or sys.executable, [site] if site else []


def _run_check(tmp_path, *args):
    python, extra_path = _interpreter()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*extra_path, str(ROOT), env.get("PYTHONPATH", "")])
    env["CUDA_VISIBLE_DEVICES"] = ""  # Unsloth's CPU mode even on a GPU machine
    env.pop("TRITON_INTERPRET", None)  # Unsloth's CPU mode replaces TRL's Triton loss with its own
    proc = subprocess.run(
        [python, str(SCRIPT), str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=str(ROOT),
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT ") :]), proc


@pytest.mark.parametrize("order", ["apexw_first", "unsloth_first"])
def test_unsloth_cpu_mode_keeps_apexw_names(tmp_path, order):
    result, proc = _run_check(tmp_path, order)

    assert result["control"] == "adamw_torch_fused", "Unsloth's CPU mode is not active: the check would prove nothing"
    assert all(k.split(":")[1] == v for k, v in result["names"].items()), result["names"]
    assert len(result["names"]) == 9
    assert result["optimizer"] == "ApexW8bit"
    # UnslothTrainer's own groups: the trained embedding copy at embedding_learning_rate, LoRA at learning_rate
    assert result["groups"] == [[0.001, 0.01, 1], [0.01, 0.01, 28]]
    assert "torch.uint8" in result["state_dtypes"] and "torch.int8" not in result["state_dtypes"]
    assert len(result["losses"]) == 3 and result["losses"][-1] < result["losses"][0]
    assert "'apexw_8bit' needs a GPU" not in proc.stdout


def test_unsloth_trainer_full_finetune_keeps_a_bf16_model_bf16(tmp_path):
    # UnslothTrainer on a model kept in bf16 (every parameter trained): no upcast, ApexW's stochastic rounding; and the
    # same with gradient release (optim="apexw_8bit_release"), in the same interpreter (Unsloth's import costs seconds)
    result, _ = _run_check(tmp_path, "unsloth_first", "full_bf16", "release")
    assert result["control"] == "adamw_torch_fused", "Unsloth's CPU mode is not active: the check would prove nothing"
    assert result["optimizer"] == "ApexW8bit" and result["param_dtypes"] == ["torch.bfloat16"]
    assert result["param_rounding"] == ["stochastic"]
    assert 2.0 < result["state_bytes_per_param"] < 2.2
    assert len(result["losses"]) == 3 and result["losses"][-1] < result["losses"][0]
    release = result["release"]
    assert release["optimizer"] == "ApexW8bit" and release["gradient_release"] and release["max_grad_norm"] == 1.0
    assert release["param_dtypes"] == ["torch.bfloat16"] and release["grads_freed"]
    assert len(release["losses"]) == 3 and release["losses"][-1] < release["losses"][0]
    assert len(release["grad_norms"]) == 3 and all(v > 0 for v in release["grad_norms"]), release["grad_norms"]
    assert release["bit_identical"] and release["trained"]
    assert release["offloaded"] == 3 and release["offload_bit_identical"]  # optim_args="tied_grad_offload=true"


def test_unsloth_cpu_mode_trains_with_apexw_4bit(tmp_path):
    """optim="apexw_4bit" through UnslothTrainer (its own param groups) in CPU mode: ApexW4bit, 4-bit state of the
    exact size (one byte per element, an fp32 m scale and an fp32 v scale per 128 elements, an fp32 step per tensor),
    the loss falls."""
    result, proc = _run_check(tmp_path, "unsloth_first", "optim=apexw_4bit")
    assert result["control"] == "adamw_torch_fused", "Unsloth's CPU mode is not active: the check would prove nothing"
    assert result["names"]["UnslothTrainingArguments:apexw_4bit"] == "apexw_4bit"
    assert result["optimizer"] == "ApexW4bit"
    assert result["groups"] == [[0.001, 0.01, 1], [0.01, 0.01, 28]]
    assert result["state_keys"] == ["exp_avg_mv", "exp_avg_scale", "exp_avg_sq_scale", "step"]
    assert result["state_bytes"] == sum(n + (4 + 4) * -(-n // 128) + 4 for n in result["trained_sizes"])
    assert len(result["losses"]) == 3 and result["losses"][-1] < result["losses"][0]
    assert "'apexw_4bit' needs a GPU" not in proc.stdout
