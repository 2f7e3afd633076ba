"""Every kernel specialization compiles for the T4 (sm_75) on the CPU, with no bf16 or fast-math instructions."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_compiles_for_sm75_without_bf16_instructions():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("aot_check.py")), "75"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("sm_75 ")]
    assert len(lines) >= 76 + 12 + 15 + 12 and all(": ok (" in line for line in lines), out.stdout[-3000:]
    assert sum(" grad_scale: ok (" in line for line in lines) == 12, out.stdout[-3000:]
    assert sum(" release_norm " in line for line in lines) == 15, out.stdout[-3000:]
    assert sum(" grad_sumsq " in line for line in lines) == 12, out.stdout[-3000:]
