"""`apexw-compare` with wrong input: one clear line on stderr, exit code 2, no traceback, nothing run."""

import pytest

from apexw_hf.recipe import compare


def _fails(capsys, argv, *needles):
    try:
        rc = compare.main(argv)
    except SystemExit as exc:  # argparse's own errors exit through SystemExit
        rc = exc.code
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err
    return err


def test_missing_config(capsys, tmp_path):
    missing = str(tmp_path / "nope.yaml")
    _fails(capsys, [missing], "nope.yaml", "neither a file nor a shipped config", "offline_default")


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["--lrs", "abc"], ("--lrs", "'abc'", "not a number")),
        (["--lrs", "1e-3,x"], ("--lrs", "'x'", "not a number")),
        (["--seeds", "0,1.5"], ("--seeds", "'1.5'", "not an integer")),
        (["--set", "train.max_steps=abc"], ("train.max_steps", "'abc'")),
        (["--set", "compare.learning_rates=[a]"], ("compare.learning_rates", "'a'", "not a number")),
        (["--set", "nosection"], ("section.key=value",)),
    ],
)
def test_bad_values_name_option_and_value(capsys, tmp_path, argv, needles):
    _fails(capsys, [*argv, "--output-dir", str(tmp_path / "out")], *needles)
    assert not (tmp_path / "out").exists()


def test_not_yaml(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text('model: [1, 2\ntrain: "x\n')
    err = _fails(capsys, [str(bad)], "bad.yaml", "not a valid YAML file", "line 2")
    assert "ScannerError" not in err and "ParserError" not in err


def test_yaml_that_is_not_a_mapping(capsys, tmp_path):
    bad = tmp_path / "list.yaml"
    bad.write_text("- just\n- a list\n")
    _fails(capsys, [str(bad)], "list.yaml", "must be a YAML mapping", "got a list")
