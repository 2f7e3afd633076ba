"""`apexw-compare` never destroys results: a typo or a second grid leaves the earlier one byte-identical, and an
interrupted grid resumes with only its missing cells.

The training of each cell is stubbed (``compare._run_child`` writes a result file as the finetune process would), so
these run the runner's own logic in a second each; ``test_compare.py::test_two_run_grid`` trains for real.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from apexw_hf.recipe import compare

GRID = ["--optimizers", "adamw_torch,apexw_8bit", "--lrs", "5e-3,1e-2", "--seeds", "0", "--jobs", "1"]
N_CELLS = 4


class FakeRuns:
    """Stands in for ``compare._run_child``: records the cells started, writes what the finetune process writes."""

    def __init__(self, interrupt_at: int | None = None):
        self.cells: list[str] = []
        self.interrupt_at = interrupt_at

    def __call__(self, args: list[str], log: Path, env: dict[str, str]) -> int:
        opt = dict(zip(args[::2], args[1::2]))
        out = Path(args[args.index("--output-dir") + 1])
        log.write_text("fake run\n")
        if "--prepare-only" in args:
            (out / "prepared_paths.json").write_text(json.dumps({"model": str(out / "base"), "built": True}))
            return 0
        self.cells.append(out.name)
        if self.interrupt_at is not None and len(self.cells) == self.interrupt_at:
            # Ctrl-C while this cell trains: it leaves a log and no result. The runner's main thread gets the signal
            # and stops the pool (_STOP) before another cell starts; a stub raising in a worker thread must do so
            compare._STOP.set()
            raise KeyboardInterrupt
        lr, seed = float(opt["--lr"]), int(opt["--seed"])
        loss = 2.0 - lr * 10 - 0.01 * seed
        result = {
            "status": "ok",
            "optimizer": opt["--optim"],
            "learning_rate": lr,
            "seed": seed,
            "initial_train_loss": 3.0,
            "final_train_loss": loss,
            "validation_loss": loss + 0.1,
            "steps_per_s": 1.0,
            "optimizer_state_mib": 1.0,
            "peak_rss_gib": 0.5,
            "global_steps": 2,
            "loss_curve": [[1, 3.0], [2, loss]],
            "environment": {"device": "cpu", "torch": "x", "transformers": "y"},
            "precision": "fp32",
            "backend": "transformers",
            "data_source": "shipped",
        }
        (out / "result.json").write_text(json.dumps(result))
        return 0


def _main(monkeypatch, capsys, argv, fake=None):
    monkeypatch.setattr(compare, "_run_child", fake or FakeRuns())
    try:
        rc = compare.main(argv)
    except SystemExit as exc:  # argparse's own errors
        rc = exc.code
    return rc, capsys.readouterr()


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def earlier(tmp_path, monkeypatch, capsys):
    """An output folder holding a finished 4-run grid, and its files' bytes."""
    out = tmp_path / "cmp"
    rc, _ = _main(monkeypatch, capsys, [*GRID, "--output-dir", str(out)])
    assert rc == 0
    assert len(list((out / "runs").glob("*/result.json"))) == N_CELLS
    assert {"summary.md", "results.csv", "loss_curves.png", "config.json"} <= {p.name for p in out.iterdir()}
    return out, _snapshot(out)


def _one_line_exit_2(rc, streams, *needles):
    assert rc == 2, streams
    err = streams.err.strip()
    assert err.count("\n") == 0 and err.startswith("apexw-compare: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err
    return err


@pytest.mark.parametrize("extra", [[], ["--overwrite"], ["--resume"]])
def test_typo_in_an_optimizer_name_changes_nothing(earlier, monkeypatch, capsys, extra):
    out, before = earlier
    fake = FakeRuns()
    argv = ["--optimizers", "adamw_torch,adamw_foo", "--output-dir", str(out), *extra]
    rc, streams = _main(monkeypatch, capsys, argv, fake)
    _one_line_exit_2(rc, streams, "'adamw_foo'", "not an optim name the Trainer accepts", "apexw_8bit", "adafactor")
    assert fake.cells == [] and streams.out == ""  # nothing built or run
    assert _snapshot(out) == before


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["--optimizers", "apexw_8bti"], ("'apexw_8bti'", "Did you mean 'apexw_8bit'")),
        (["--optimizers", "adamw_torch@fp16"], ("adamw_torch@fp16",)),
        (["--set", "compare.baseline=adamw_tourch"], ("compare.baseline", "'adamw_tourch'", "'adamw_torch'")),
        (["--set", "train.optim_args=engine=fast"], ("train.optim_args", "engine='fast'", "auto, triton, torch")),
        (
            ["--set", "compare.optim_args={apexw_8bit: 'gradient_release=true'}"],
            ("compare.optim_args['apexw_8bit']", "gradient_accumulation_steps=4"),
        ),
        (["--set", "compare.optim_args={apexw_8bit: 'releese_bucket_size=4'}"], ("'releese_bucket_size'",)),
        (["--max-minutes", "-1"], ("compare.max_minutes=-1.0",)),
        (["--jobs", "0"], ("compare.jobs=0",)),
    ],
)
def test_bad_options_are_refused_before_anything_runs(earlier, monkeypatch, capsys, argv, needles):
    out, before = earlier
    fake = FakeRuns()
    rc, streams = _main(monkeypatch, capsys, [*GRID, *argv, "--output-dir", str(out), "--overwrite"], fake)
    _one_line_exit_2(rc, streams, *needles)
    assert fake.cells == [] and _snapshot(out) == before


def test_a_second_grid_into_the_same_folder_keeps_the_first(earlier, monkeypatch, capsys, tmp_path):
    out, before = earlier
    fake = FakeRuns()
    rc, streams = _main(monkeypatch, capsys, ["--optimizers", "apexw_4bit", "--output-dir", str(out)], fake)
    _one_line_exit_2(
        rc, streams, str(out), "4 run folders (4 with a result)", "--output-dir", "--resume", "--overwrite"
    )
    assert fake.cells == [] and _snapshot(out) == before
    # into another folder it runs, and the first is still untouched
    rc, _ = _main(monkeypatch, capsys, [*GRID, "--output-dir", str(tmp_path / "second")], fake)
    assert rc == 0 and len(fake.cells) == N_CELLS and _snapshot(out) == before
    # --overwrite replaces the grid, asked for by name
    fake = FakeRuns()
    argv = ["--optimizers", "apexw_4bit", "--lrs", "5e-3", "--seeds", "0", "--output-dir", str(out), "--overwrite"]
    rc, streams = _main(monkeypatch, capsys, argv, fake)
    assert rc == 0 and "--overwrite: deleted the earlier grid" in streams.out
    assert [p.parent.name for p in (out / "runs").glob("*/result.json")] == fake.cells == ["apexw_4bit_lr0.005_seed0"]


def test_an_interrupted_grid_resumes_with_only_its_missing_cells(tmp_path, monkeypatch, capsys):
    out = tmp_path / "cmp"
    first = FakeRuns(interrupt_at=3)  # Ctrl-C during the third of four runs
    rc, streams = _main(monkeypatch, capsys, [*GRID, "--output-dir", str(out)], first)
    assert rc == 130 and "--resume" in streams.out
    finished = sorted(p.parent.name for p in (out / "runs").glob("*/result.json"))
    assert finished == sorted(first.cells[:2])
    kept = {name: (out / "runs" / name / "result.json").read_bytes() for name in finished}

    # a resume with another config is refused, naming what differs, and changes nothing
    before = _snapshot(out)
    rc, streams = _main(monkeypatch, capsys, [*GRID, "--lrs", "1e-3", "--output-dir", str(out), "--resume"])
    _one_line_exit_2(rc, streams, "compare.learning_rates: [0.005, 0.01] -> [0.001]", "another --output-dir")
    assert _snapshot(out) == before

    second = FakeRuns()
    rc, streams = _main(monkeypatch, capsys, [*GRID, "--output-dir", str(out), "--resume", "--jobs", "2"], second)
    assert rc == 0, streams
    all_cells = [c["name"] for c in compare.plan_grid(compare.load_config(out / "config.json"))]
    assert sorted(second.cells) == sorted(set(all_cells) - set(finished)) and len(second.cells) == 2
    assert "2 of 4 runs finished earlier and are kept, 2 to run" in streams.out
    for name, data in kept.items():
        assert (out / "runs" / name / "result.json").read_bytes() == data
    rows = (out / "results.csv").read_text().strip().splitlines()
    assert len(rows) == 1 + N_CELLS  # the report covers the whole grid

    # the stored config alone is enough to resume; a finished grid has nothing left to run
    third = FakeRuns()
    rc, streams = _main(monkeypatch, capsys, ["--output-dir", str(out), "--resume"], third)
    assert rc == 0 and third.cells == [] and "4 of 4 runs finished earlier" in streams.out


def test_resume_needs_a_grid(tmp_path, monkeypatch, capsys):
    rc, streams = _main(monkeypatch, capsys, [*GRID, "--output-dir", str(tmp_path / "empty"), "--resume"])
    _one_line_exit_2(rc, streams, "holds no grid to resume")
    assert not (tmp_path / "empty").exists()


def test_a_failed_cell_runs_again_on_resume(earlier, monkeypatch, capsys):
    out, _ = earlier
    name = sorted(p.name for p in (out / "runs").iterdir())[0]
    (out / "runs" / name / "result.json").write_text(json.dumps({"status": "failed", "reason": "exit code 1"}))
    (out / "runs" / sorted(p.name for p in (out / "runs").iterdir())[1] / "result.json").write_text('{"status": "o')
    fake = FakeRuns()
    rc, _ = _main(monkeypatch, capsys, ["--output-dir", str(out), "--resume"], fake)
    assert rc == 0 and len(fake.cells) == 2 and name in fake.cells
    assert json.loads((out / "runs" / name / "result.json").read_text())["status"] == "ok"
