"""docs/integration.md lists every ``optim_args`` key and every value ``OptimizerStateCallback`` logs, as named in
the code, and its sample error is the one the code raises."""

from __future__ import annotations

import re

import pytest
import torch

from apexw_hf import ApexW8bit
from apexw_hf.integrations.callbacks import optimizer_state_metrics
from apexw_hf.integrations.transformers import OPTIM_ARGS, parse_optim_args

from .tiny import ROOT

DOC = (ROOT / "docs" / "integration.md").read_text()


def _section(heading: str) -> str:
    return DOC.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def test_optim_args_table_has_every_key():
    rows = re.findall(r"^\| `(\w+)` \|", _section("`optim_args`"), flags=re.M)
    assert rows == list(OPTIM_ARGS)


def test_sample_error_is_the_codes():
    with pytest.raises(ValueError) as info:
        parse_optim_args("egnine=torch", "apexw_8bit")
    sample = _section("`optim_args`").split("```\nValueError: ", 1)[1].split("\nValueError:", 1)[0]
    assert " ".join(sample.split()) == str(info.value)


def test_callback_keys_are_listed():
    values = optimizer_state_metrics(ApexW8bit([torch.nn.Parameter(torch.zeros(8))]), peak_memory=False)
    listed = re.findall(r"^- `(\w+)`:", _section("Logging optimizer-state memory"), flags=re.M)
    assert set(values) | {"peak_gpu_memory_gib"} == set(listed)
