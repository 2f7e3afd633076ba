"""Tiny models, tokenizer and data for the Hugging Face integration tests: no downloads, seconds on a CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# TRL 1.15's SFTTrainer computes its loss with a Triton kernel (trl/kernels/chunked_logprob.py) whatever the
# device; on a machine without a GPU that only runs under the Triton interpreter, which must be chosen before
# TRL's kernels are decorated (the kernel tests of this repository run under it too). Not on a GPU machine: the
# interpreter cannot run kernels on CUDA tensors, and the GPU tests collected beside these need compiled kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("transformers")
pytest.importorskip("peft")

import apexw_hf  # noqa: E402,F401  (registers the optim names)

from .tiny import ROOT, make_tokenizer  # noqa: E402


def run_python(code: str, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter with the repository on the path; returns the completed process."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=str(ROOT),
    )


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()
