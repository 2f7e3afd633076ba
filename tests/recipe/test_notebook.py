"""The Llama-3.2 T4 notebook executes top to bottom on the offline default (no GPU, no internet)."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "examples" / "llama32_t4_apexw.ipynb"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the notebook runs the real 3B set-up")
def test_notebook_runs_offline(tmp_path, monkeypatch):
    try:
        import nbformat
        from nbclient import NotebookClient
    except ImportError as exc:  # a declared test dependency: fail, do not skip
        raise AssertionError(f"{exc}; install the test extras: pip install -e '.[test]'") from exc
    # a kernel spec for this very interpreter: a "python3" spec elsewhere on the machine may point to another Python
    spec = tmp_path / "jupyter" / "kernels" / "apexw-test"
    spec.mkdir(parents=True)
    kernel = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "apexw-test",
        "language": "python",
    }
    (spec / "kernel.json").write_text(json.dumps(kernel))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("APEXW_NOTEBOOK_OUTPUT", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(
        nb, timeout=600, kernel_name="apexw-test", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "backend: transformers" in text and "config: offline_default" in text
    assert "SHIPPED offline instruction set" in text
    assert "optimizer: ApexW8bit" in text
    assert (tmp_path / "offline_default" / "lora_model" / "adapter_config.json").is_file()
