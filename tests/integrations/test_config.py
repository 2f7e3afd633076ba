"""The ApexW optim names everywhere ``optim`` is set: TrainingArguments, SFTConfig, JSON, YAML, CLI, training_args.bin.

Also: idempotent registration, the lazy import hook, and the errors for bad input.
"""

from __future__ import annotations

import json

import pytest
import torch

from apexw_hf.integrations import register
from apexw_hf.integrations.transformers import OPTIM_ARGS, get_optimizer_cls_and_kwargs, parse_optim_args

from .conftest import run_python
from .tiny import NAMES

BASE = {"report_to": [], "use_cpu": True}


def _args(tmp_path, **kw):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(tmp_path), **BASE, **kw)


@pytest.mark.parametrize("name", NAMES)
def test_training_args_and_sft_config_accept_names(tmp_path, name):
    from transformers.training_args import OptimizerNames
    from trl import SFTConfig

    assert OptimizerNames(name).value == name
    assert _args(tmp_path, optim=name).optim == name
    assert SFTConfig(output_dir=str(tmp_path), optim=name, **BASE).optim == OptimizerNames(name)


def test_registration_is_idempotent(tmp_path):
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_callback import CallbackHandler
    from transformers.training_args import OptimizerNames

    import apexw_hf.integrations.callbacks  # noqa: F401  (installs the run-first ordering)

    members = list(OptimizerNames)
    post_init = TrainingArguments.__post_init__
    missing = OptimizerNames._missing_
    get_cls = Trainer.__dict__["get_optimizer_cls_and_kwargs"]
    add_callback = CallbackHandler.add_callback
    for _ in range(3):
        register()
        register(eager=True)
        apexw_hf.integrations.callbacks._install_run_first()
    assert list(OptimizerNames) == members
    assert [m.value for m in members].count("apexw_8bit") == 1
    assert TrainingArguments.__post_init__ is post_init
    assert OptimizerNames._missing_ == missing
    assert Trainer.__dict__["get_optimizer_cls_and_kwargs"] is get_cls
    assert CallbackHandler.add_callback is add_callback
    assert getattr(post_init, "__wrapped__", None) is not None
    assert not hasattr(post_init.__wrapped__, "_apexw_wrapped")


def test_registration_is_idempotent_when_another_library_wrapped_ours():
    """Unsloth's CPU mode wraps TrainingArguments.__post_init__ (functools.wraps) after us: no second wrapper."""
    import functools

    from transformers import TrainingArguments

    ours = TrainingArguments.__post_init__

    @functools.wraps(ours)
    def theirs(self, *a, **kw):
        return ours(self, *a, **kw)

    TrainingArguments.__post_init__ = theirs
    try:
        register(eager=True)
        assert TrainingArguments.__post_init__ is theirs
    finally:
        TrainingArguments.__post_init__ = ours


@pytest.mark.parametrize("name", NAMES)
def test_json_round_trip(tmp_path, name):
    from transformers import HfArgumentParser, TrainingArguments

    args = _args(tmp_path, optim=name, optim_args="engine=torch,seed=3")
    path = tmp_path / "args.json"
    path.write_text(args.to_json_string())
    assert json.loads(path.read_text())["optim"] == name
    (loaded,) = HfArgumentParser(TrainingArguments).parse_json_file(str(path))
    assert loaded.optim == name and loaded.optim_args == "engine=torch,seed=3"
    (loaded,) = HfArgumentParser(TrainingArguments).parse_dict(json.loads(path.read_text()))
    assert loaded.optim == name


def test_yaml_round_trip_and_trl_parser_config(tmp_path):
    yaml = pytest.importorskip("yaml")
    from transformers import HfArgumentParser, TrainingArguments
    from trl import SFTConfig, TrlParser

    path = tmp_path / "config.yaml"
    path.write_text(
        yaml.safe_dump({"output_dir": str(tmp_path), "optim": "apexw_8bit", "optim_args": "seed=5", **BASE})
    )
    (loaded,) = HfArgumentParser(TrainingArguments).parse_yaml_file(str(path))
    assert loaded.optim == "apexw_8bit" and loaded.optim_args == "seed=5"
    (config,) = TrlParser((SFTConfig,)).parse_args_and_config(["--config", str(path)])
    assert isinstance(config, SFTConfig) and config.optim == "apexw_8bit"
    # the command line overrides the YAML file
    (config,) = TrlParser((SFTConfig,)).parse_args_and_config(["--config", str(path), "--optim", "apexw_compact"])
    assert config.optim == "apexw_compact"


@pytest.mark.parametrize("name", NAMES)
def test_cli(tmp_path, name):
    from transformers import HfArgumentParser, TrainingArguments
    from trl import SFTConfig, TrlParser

    argv = ["--output_dir", str(tmp_path), "--optim", name, "--optim_args", "engine=torch", "--use_cpu", "true"]
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(argv + ["--report_to", "none"])
    assert args.optim == name and args.optim_args == "engine=torch"
    (config,) = TrlParser((SFTConfig,)).parse_args_and_config(argv + ["--report_to", "none"])
    assert config.optim == name
    help_text = HfArgumentParser(TrainingArguments).format_help()
    assert name in help_text


def test_cli_rejects_unknown_name_listing_valid_ones(tmp_path, capsys):
    from transformers import HfArgumentParser, TrainingArguments

    with pytest.raises(SystemExit):
        HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
            ["--output_dir", str(tmp_path), "--optim", "apexw_8bt"]
        )
    err = capsys.readouterr().err
    assert "apexw_8bt" in err and "apexw_8bit" in err and "apexw_compact" in err and "apexw_4bit" in err


def test_training_args_bin_round_trip_and_lazy_registration(tmp_path):
    args = _args(tmp_path, optim="apexw_8bit", optim_args="seed=9")
    torch.save(args, tmp_path / "training_args.bin")
    loaded = torch.load(tmp_path / "training_args.bin", weights_only=False)
    assert loaded.optim == "apexw_8bit" and loaded.optim_args == "seed=9"

    # A new process: `import apexw_hf` must not import transformers; unpickling training_args.bin imports
    # transformers.training_args, and the import hook registers the names before OptimizerNames("apexw_8bit") runs.
    proc = run_python(
        f"""
        import sys, apexw_hf, torch
        assert "transformers" not in sys.modules, "import apexw_hf must not import transformers"
        args = torch.load({str(tmp_path / "training_args.bin")!r}, weights_only=False)
        from transformers import Trainer, TrainingArguments
        cls, kw = Trainer.get_optimizer_cls_and_kwargs(args)
        print("BIN", args.optim.value, cls.__name__, kw["seed"], kw["state_format"])
        for name in ("apexw_compact", "apexw_4bit"):
            a = TrainingArguments(output_dir="/tmp/apexw_lazy", optim=name, report_to=[], use_cpu=True)
            cls, kw = Trainer.get_optimizer_cls_and_kwargs(a)
            print("NEW", a.optim.value, cls.__name__, kw["state_format"])
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert "BIN apexw_8bit ApexW8bit 9 8bit" in proc.stdout
    assert "NEW apexw_compact ApexWCompact compact" in proc.stdout
    assert "NEW apexw_4bit ApexW4bit 4bit" in proc.stdout


def test_registration_when_transformers_was_imported_first():
    proc = run_python(
        """
        from transformers import Trainer, TrainingArguments, HfArgumentParser
        import apexw_hf
        (a,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
            ["--output_dir", "/tmp/apexw_late", "--optim", "apexw_8bit", "--report_to", "none"])
        cls, kw = Trainer.get_optimizer_cls_and_kwargs(a)
        print("OK", a.optim.value, cls.__name__)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert "OK apexw_8bit ApexW8bit" in proc.stdout


# ---- bad input ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["apexw_8bt", "apexw", "apexw_compat", "APEXW-8BIT", "apexw_4bt", "apexw_int4"])
def test_unknown_apexw_name_suggests_valid_ones(tmp_path, bad):
    with pytest.raises(ValueError) as info:
        _args(tmp_path, optim=bad)
    msg = str(info.value)
    assert repr(bad) in msg and "'apexw_8bit'" in msg and "'apexw_compact'" in msg and "'apexw_4bit'" in msg
    if bad == "apexw_4bt":
        assert "Did you mean 'apexw_4bit'?" in msg


def test_other_unknown_names_keep_transformers_message(tmp_path):
    with pytest.raises(ValueError, match="adamw_torch"):
        _args(tmp_path, optim="adamw_trch")


@pytest.mark.parametrize(
    "optim_args, match",
    [
        ("egnine=torch", r"unknown key 'egnine'\. Did you mean 'engine'\?.*Allowed keys: state_format="),
        ("seed=1,foo=2", r"unknown key 'foo'.*Allowed keys"),
        ("lr=0.1", r"'lr' is set through TrainingArguments \(learning_rate\)"),
        ("weight_decay=0.1", r"weight_decay.*TrainingArguments"),
        ("engine", r"cannot parse 'engine'; expected 'key=value'"),
        ("engine=torch=1", r"cannot parse 'engine=torch=1'"),
        ("engine=cuda", r"engine='cuda' is not allowed; engine must be one of auto, triton, torch"),
        (
            "state_format=int4",
            r"state_format='int4' is not allowed; state_format must be one of compact, 8bit, 4bit, fp32",
        ),
        ("seed=-1", r"seed must be an int in \[0, 2\*\*32\)"),
        ("seed=abc", r"seed='abc' is not allowed"),
        ("maximize=maybe", r"maximize must be true or false"),
        ("seed=1,seed=2", r"'seed' is given twice"),
    ],
)
def test_optim_args_errors_name_the_bad_key(tmp_path, optim_args, match):
    with pytest.raises(ValueError, match=match):
        _args(tmp_path, optim="apexw_8bit", optim_args=optim_args)


def test_optim_args_values():
    assert parse_optim_args(" engine = TORCH , seed=0x10, maximize=True, param_rounding=nearest,") == {
        "engine": "torch",
        "seed": 16,
        "maximize": True,
        "param_rounding": "nearest",
    }
    assert parse_optim_args({"state_format": "fp32"}) == {"state_format": "fp32"}
    assert parse_optim_args("state_format=4BIT", "apexw_8bit") == {"state_format": "4bit"}
    assert parse_optim_args(None) == parse_optim_args("") == {}
    assert set(OPTIM_ARGS) == {
        "state_format",
        "seed",
        "engine",
        "param_rounding",
        "maximize",
        "gradient_release",
        "release_bucket_size",
        "tied_grad_offload",
        "state_offload",
        "offload_piece_mib",
        "nonfinite",
    }
    assert parse_optim_args("state_offload=true", "apexw_8bit") == {"state_offload": True}
    assert parse_optim_args("state_offload=true,offload_piece_mib=96", "apexw_8bit")["offload_piece_mib"] == 96
    with pytest.raises(ValueError, match="offload_piece_mib='0' is not allowed; it must be an int >= 1"):
        parse_optim_args("offload_piece_mib=0", "apexw_8bit")
    assert parse_optim_args("nonfinite=RAISE", "apexw_8bit") == {"nonfinite": "raise"}
    with pytest.raises(ValueError, match="nonfinite='ignore' is not allowed; nonfinite must be one of skip, raise"):
        parse_optim_args("nonfinite=ignore", "apexw_8bit")
    assert parse_optim_args("gradient_release=true, tied_grad_offload=YES", "apexw_4bit") == {
        "gradient_release": True,
        "tied_grad_offload": True,
    }
    with pytest.raises(ValueError, match="tied_grad_offload='maybe' is not allowed"):
        parse_optim_args("tied_grad_offload=maybe")


def test_every_optim_arg_is_accepted_by_the_optimizer(tmp_path):
    """The keys offered in optim_args must exist in the ApexW constructor (catches drift between the two)."""
    args = _args(
        tmp_path,
        optim="apexw_8bit",
        optim_args="state_format=compact,seed=4,engine=torch,param_rounding=nearest,maximize=false",
    )
    cls, kw = get_optimizer_cls_and_kwargs(args)
    opt = cls([torch.nn.Parameter(torch.zeros(4))], **kw)
    assert opt.defaults["state_format"] == "compact" and opt.defaults["seed"] == 4


def test_offload_names_offload_the_tied_gradient_part_unless_told_not_to(tmp_path):
    """optim="apexw_4bit_offload" keeps in host memory what can wait there: the state and a tied weight's output-layer
    gradient part (tied_grad_offload); optim_args may turn the latter off, and the "_release" names leave it off."""
    _, kw = get_optimizer_cls_and_kwargs(_args(tmp_path, optim="apexw_4bit_offload"))
    assert kw["state_offload"] and kw["gradient_release"] and kw["tied_grad_offload"]
    args = _args(tmp_path, optim="apexw_4bit_offload", optim_args="tied_grad_offload=false")
    _, kw = get_optimizer_cls_and_kwargs(args)
    assert kw["state_offload"] and kw["tied_grad_offload"] is False
    _, kw = get_optimizer_cls_and_kwargs(_args(tmp_path, optim="apexw_4bit_release"))
    assert "tied_grad_offload" not in kw and "state_offload" not in kw


def test_deepspeed_config_with_its_own_optimizer_is_refused(tmp_path):
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 2}}
    with pytest.raises(ValueError, match=r"DeepSpeed config.*own optimizer \(optimizer.type='AdamW'\)"):
        _args(tmp_path, optim="apexw_8bit", deepspeed=config)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="Remove the 'optimizer' section"):
        _args(tmp_path, optim="apexw_compact", deepspeed=str(path))


def test_every_state_format_is_an_optim_args_value_and_has_a_name():
    """optim_args accepts each format the optimizer has; each quantized or compact format has an optim name."""
    from apexw_hf import reference as ref
    from apexw_hf.integrations.transformers import APEXW_OPTIMIZERS

    assert set(OPTIM_ARGS["state_format"].split("|")) == set(ref.STATE_FORMATS)
    assert {fmt for _, fmt in APEXW_OPTIMIZERS.values()} == set(ref.STATE_FORMATS) - {"fp32"}
    for fmt in ref.STATE_FORMATS:
        assert parse_optim_args(f"state_format={fmt}") == {"state_format": fmt}


def test_optim_args_state_format_4bit_reaches_the_optimizer(tmp_path):
    from apexw_hf import ApexW8bit

    args = _args(tmp_path, optim="apexw_8bit", optim_args="state_format=4bit,engine=torch")
    cls, kw = get_optimizer_cls_and_kwargs(args)
    opt = cls([torch.nn.Parameter(torch.zeros(300))], **kw)
    assert cls is ApexW8bit and opt.defaults["state_format"] == "4bit"
