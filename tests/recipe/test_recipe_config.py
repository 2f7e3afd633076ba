"""Config loading: the published set-up is encoded faithfully; bad keys and values fail with clear errors."""

from pathlib import Path

import pytest

from apexw_hf.recipe.config import apply_overrides, config_from_dict, load_config

ROOT = Path(__file__).resolve().parents[2]
PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_published_t4_config_matches_facts():
    cfg = load_config(ROOT / "configs" / "llama32_3b_t4.yaml")
    assert cfg.model.name_or_path == "unsloth/Llama-3.2-3B-Instruct-bnb-4bit" and cfg.model.load_in_4bit
    assert (cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.bias) == (16, 16, 0.0, "none")
    assert cfg.lora.target_modules == PROJ
    t = cfg.train
    assert (t.backend, t.precision, t.seed, t.warmup_steps, t.weight_decay, t.lr_scheduler_type) == (
        "unsloth",
        "fp16",
        3407,
        5,
        0.001,
        "linear",
    )
    steps = (
        cfg.data.num_samples // (t.per_device_train_batch_size * t.gradient_accumulation_steps) * t.num_train_epochs
    )
    assert (cfg.data.num_samples, t.per_device_train_batch_size, t.gradient_accumulation_steps, steps) == (
        1000,
        2,
        4,
        250,
    )
    assert cfg.compare.learning_rates == [2e-4, 5e-5]
    assert cfg.compare.optimizers == ["adamw_torch", "adamw_8bit", "apexw_compact", "apexw_8bit"]
    assert len(cfg.compare.seeds) >= 2


def test_embedded_default_loads_by_name_and_is_offline():
    cfg = load_config()  # no argument: the embedded offline default
    assert cfg.name == "offline_default"
    assert cfg.model.build is not None and not cfg.model.load_in_4bit and cfg.data.source == "shipped"
    assert cfg.lora.target_modules == PROJ
    assert set(cfg.compare.optimizers) == {"adamw_torch", "adamw_8bit", "apexw_8bit", "apexw_4bit"}
    # at least three learning rates, so that the best one can have a worse one on each side
    assert len(cfg.compare.learning_rates) >= 3 and len(cfg.compare.seeds) >= 2
    assert load_config("llama32_3b_t4").name == "llama32_3b_t4"  # repo configs/ resolve by name too


def test_overrides_parse_floats_and_lists():
    cfg = load_config("offline_default", ["train.learning_rate=1e-5", "compare.seeds=[4, 5]", "train.max_steps=7"])
    assert cfg.train.learning_rate == 1e-5 and cfg.compare.seeds == [4, 5] and cfg.train.max_steps == 7
    raw = apply_overrides({}, ["model.build={hidden_size: 8, rms_norm_eps: 1e-6}"])
    assert raw["model"]["build"]["rms_norm_eps"] == 1e-6


@pytest.mark.parametrize(
    ("raw", "exc", "match"),
    [
        ({"trian": {}}, ValueError, "unknown top-level"),
        ({"train": {"lerning_rate": 1.0}}, ValueError, "lerning_rate"),
        ({"train": {"precision": "fp8"}}, ValueError, "fp8"),
        ({"train": {"max_steps": "many"}}, TypeError, "max_steps"),
        ({"model": {"name_or_path": "x", "build": {"hidden_size": 8}}}, ValueError, "exactly one"),
        ({"compare": {"seeds": [1, 1]}}, ValueError, "duplicates"),
        ({"compare": {"devices": [0, 0]}}, ValueError, "distinct CUDA device"),
        ({"compare": {"devices": ["a"]}}, ValueError, "distinct CUDA device"),
        ({"compare": {"devices": [0.5]}}, ValueError, "distinct CUDA device"),
        ({"compare": {"runs_per_device": 0}}, ValueError, "runs_per_device=0"),
        ({"lora": {"r": 0}}, ValueError, "r=0"),
        (
            {"train": {"optim": "apexw_4bt"}},
            ValueError,
            r"train.optim: 'apexw_4bt' is not an ApexW optimizer\. Did you mean 'apexw_4bit'\?",
        ),
        (
            {"compare": {"optimizers": ["adamw_torch", "apexw_int4@bf16"]}},
            ValueError,
            r"compare.optimizers: 'apexw_int4' .* The ApexW names are: 'apexw_8bit', 'apexw_compact', 'apexw_4bit'",
        ),
        ({"compare": {"baseline": "apexw_4"}}, ValueError, "compare.baseline: 'apexw_4' is not an ApexW optimizer"),
    ],
)
def test_bad_configs_fail_clearly(raw, exc, match):
    raw.setdefault("model", {"name_or_path": "m"})
    with pytest.raises(exc, match=match):
        config_from_dict(raw)


def test_missing_config_names_what_exists():
    with pytest.raises(FileNotFoundError, match="offline_default"):
        load_config("no_such_config")


def test_4bit_in_yaml_json_and_overrides(tmp_path):
    """apexw_4bit as train.optim and in compare.optimizers (with a parameter dtype), from YAML, through the runner's
    resolved JSON and from --set overrides, with its report label."""
    import json

    import yaml

    from apexw_hf.recipe.config import optimizer_label, split_optimizer_spec

    raw = yaml.safe_load((ROOT / "apexw_hf" / "configs" / "offline_full.yaml").read_text())
    raw["train"]["optim"] = "apexw_4bit"
    raw["compare"]["optimizers"] = ["adamw_torch@fp32", "apexw_4bit@bf16", "apexw_4bit@fp32"]
    raw["compare"]["lr_sweep"] = {"apexw_4bit@bf16": [0.01]}
    path = tmp_path / "four.yaml"
    path.write_text(yaml.safe_dump(raw))
    cfg = load_config(path)
    assert cfg.train.optim == "apexw_4bit" and cfg.compare.optimizers[1:] == ["apexw_4bit@bf16", "apexw_4bit@fp32"]
    assert cfg.compare.learning_rates_of("apexw_4bit@bf16")[-1] == 0.01
    resolved = tmp_path / "config.json"
    resolved.write_text(json.dumps(cfg.to_dict()))
    assert load_config(resolved).to_dict() == cfg.to_dict()
    cfg = load_config("offline_default", ["train.optim=apexw_4bit", "compare.optimizers=[adamw_torch, apexw_4bit]"])
    assert cfg.train.optim == "apexw_4bit" and cfg.compare.optimizers == ["adamw_torch", "apexw_4bit"]
    assert split_optimizer_spec("apexw_4bit@bf16") == ("apexw_4bit", "bf16")
    assert optimizer_label("apexw_4bit") == "ApexW 4bit"
    assert optimizer_label("apexw_4bit@bf16") == "ApexW 4bit, bf16 params"
