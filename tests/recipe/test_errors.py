"""Clear messages: which data set is in use, what to do about a missing model or data set, skipped optimizers."""

import importlib.util

import pytest

from apexw_hf.recipe import finetune
from apexw_hf.recipe.config import DataConfig, load_config
from apexw_hf.recipe.data import load_chat_data


def test_auto_data_offline_falls_back_and_says_so(monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = load_chat_data(DataConfig(source="auto", num_samples=10, validation_samples=5))
    msg = capsys.readouterr().out
    assert data.source == "shipped" and len(data.train) == 10 and len(data.validation) == 5
    assert "SHIPPED" in msg and "mlabonne/FineTome-100k unavailable" in msg


def test_missing_hub_dataset_says_what_to_do(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(RuntimeError, match="could not load dataset 'no-such-user/no-such-data'.*data.source: shipped"):
        load_chat_data(DataConfig(source="hub", hub_dataset="no-such-user/no-such-data", num_samples=4))


def test_missing_model_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = load_config("offline_default", ["train.optim=adamw_torch", "train.max_steps=1"])
    cfg.model.build, cfg.model.name_or_path = None, str(tmp_path / "no_model_here")
    with pytest.raises(RuntimeError, match="could not load model .*offline default"):
        finetune.run_finetune(cfg, tmp_path / "out", verbose=False)


def test_bitsandbytes_missing_is_a_skip_with_reason(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        finetune.importlib.util, "find_spec", lambda n, *a: None if n == "bitsandbytes" else real(n, *a)
    )
    with pytest.raises(finetune.SkipRun, match="bitsandbytes is not installed"):
        finetune.probe_optimizer("adamw_8bit")
    finetune.probe_optimizer("apexw_8bit")  # ours needs nothing extra


def test_cpu_refuses_fp16_and_4bit_clearly():
    cfg = load_config("offline_default", ["train.precision=fp16"])
    if not finetune._cuda():
        with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
            finetune.resolve_precision(cfg)
