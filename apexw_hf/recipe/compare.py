"""apexw-compare: the optimizer comparison grid (optimizers x learning rates x seeds), one process per run.

With no arguments it runs the embedded offline default (apexw_hf/configs/offline_default.yaml): a small Llama, the
shipped instruction set, on the CPU, in a few minutes. Give a config path (or a shipped config's name) for anything
else, e.g. "apexw-compare configs/llama32_3b_t4.yaml", or the full fine-tune comparison "apexw-compare offline_full"
(CPU) / "apexw-compare configs/llama32_1b_full_h200.yaml" (GPU). Optimizers are Trainer optim names, optionally with
the dtype the parameters are kept in: adamw_torch_fused@fp32 (fp32 master weights, bf16 autocast) vs apexw_8bit@bf16
(the model itself in bf16).

Every optimizer name, option and config value is checked before anything is built, run or written: wrong input
gives one line on stderr and exit code 2.

Each run is a fresh "python -m apexw_hf.recipe.finetune" process, so peak-memory numbers belong to that run alone.
The runner shows progress, keeps each run's result.json and log.txt under <output_dir>/runs/<run name>/, and writes
into <output_dir>:

  results.csv      one row per run
  summary.md       the table shaped like the published one (peak memory, optimizer-state MiB, steps/s, final train
                   loss per learning rate) plus held-out validation loss, as mean +- std over seeds, and Welch's
                   t-test of each optimizer against the baseline (compare.baseline)
  loss_curves.png  training loss against step, mean over seeds, one panel per learning rate (and one with each
                   optimizer at its best learning rate when learning rates were swept)
  config.json      the grid's config, overrides applied (what every run reads)

An output folder that already holds a grid is never deleted or mixed into silently. Give another --output-dir, or:

  --resume       finish the grid in that folder: only the cells without a complete result (a result.json with
                 status ok) run, and the report covers the whole grid. The config must equal the stored
                 config.json (only --jobs, --max-minutes and compare.fail_fast / compare.warmup_run may differ);
                 with no config argument the stored one is used.
  --overwrite    delete that grid's runs and reports, then run a new grid there.

Otherwise apexw-compare stops with exit code 2 and changes nothing. --report-only rebuilds the three reports from
the run results already in <output_dir>/runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from .config import DEFAULT_CONFIG, KNOWN_OPTIMIZERS, RecipeConfig, load_config, split_optimizer_spec
from .report import write_reports

__all__ = ["main", "plan_grid", "run_grid", "validate_grid", "earlier_grid", "config_differences"]

# The files a grid writes into its output folder (besides runs/ and warmup/); base/ is a cache keyed by the model
# config, shared by grids, and is kept by --overwrite.
_GRID_FILES = ("config.json", "grid_meta.json", "results.csv", "summary.md", "loss_curves.png")
# Config keys a resumed grid may change: how many runs go at a time and when to stop launching, not what a cell runs.
_RESUME_MAY_CHANGE = {
    "compare.jobs",
    "compare.max_minutes",
    "compare.output_dir",
    "compare.fail_fast",
    "compare.warmup_run",
}


def plan_grid(cfg: RecipeConfig) -> list[dict[str, Any]]:
    """All runs in the order they are started.

    Every optimizer runs at the shared ``compare.learning_rates`` and at its own ``compare.lr_sweep`` entries.
    An optimizer may carry the parameter dtype of its runs (``"apexw_8bit@bf16"``, see
    :func:`~apexw_hf.recipe.config.split_optimizer_spec`). Seed-major (a grid stopped early by ``max_minutes`` still
    has whole seeds of every optimizer). Within a seed the
    optimizers go in the configured order for the 1st, 3rd, ... seed and in reverse for the others: on a GPU the runs
    go one at a time, and the run in first position was 6-7% slower in steps/s than the one after it in the H200 grids
    (docs/results/recipe_lora/h200_llama32_3b_alone), so alternating gives every optimizer the same average position.
    With ``compare.devices``, seed ``i`` runs on device ``i % len(devices)`` (each cell's ``"device"``), and with
    several the devices' runs are interleaved, so the first ``jobs`` runs started reach every device instead of
    queueing on the first one.
    """
    devices = cfg.compare.devices
    per_seed = []
    for i, s in enumerate(cfg.compare.seeds):
        opts = cfg.compare.optimizers if i % 2 == 0 else cfg.compare.optimizers[::-1]
        where = {"device": devices[i % len(devices)]} if devices else {}
        lrs = list(dict.fromkeys(lr for o in opts for lr in cfg.compare.learning_rates_of(o)))
        per_seed.append(
            [
                {"optim": o, "lr": lr, "seed": s, "name": f"{o}_lr{lr:g}_seed{s}", **where}
                for lr in lrs
                for o in opts
                if lr in cfg.compare.learning_rates_of(o)
            ]
        )
    if len(devices) < 2:
        return [cell for runs in per_seed for cell in runs]
    queues = [[cell for runs in per_seed for cell in runs if cell["device"] == d] for d in devices]
    return [q[k] for k in range(max(map(len, queues))) for q in queues if k < len(q)]


def _trainer_optim_names() -> list[str]:
    """Every ``optim`` value the Trainer accepts in this environment (ApexW's registered), importing transformers."""
    import transformers.training_args as training_args

    from ..integrations.transformers import register_optimizer_names

    register_optimizer_names(training_args)
    return list(training_args.OptimizerNames._value2member_map_)


def validate_grid(cfg: RecipeConfig) -> None:
    """Raise ``ValueError`` for a grid that would fail in its runs: run before anything is built, run or deleted.

    ``load_config`` has checked every key and value, and ApexW names; this adds what needs transformers: every
    other optimizer name must be one the Trainer accepts, and every ApexW cell's optim_args must parse and fit the
    trainer settings (gradient release with accumulation, say).
    """
    from ..integrations.transformers import APEXW_OPTIMIZERS, get_optimizer_cls_and_kwargs

    known = set(KNOWN_OPTIMIZERS) | set(APEXW_OPTIMIZERS)
    specs = [("compare.optimizers (--optimizers)", s) for s in cfg.compare.optimizers]
    specs.append(("compare.baseline", cfg.compare.baseline))
    for where, spec in specs:
        name = split_optimizer_spec(spec)[0]
        if name in known:
            continue
        allowed = _trainer_optim_names()
        if name in allowed:
            continue
        import difflib

        close = difflib.get_close_matches(name, allowed, n=1, cutoff=0.6)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"{where}: {name!r} is not an optim name the Trainer accepts.{hint} Allowed: {', '.join(allowed)} "
            "(each optionally with @fp32 or @bf16)"
        )
    t = cfg.train
    for spec in cfg.compare.optimizers:
        name = split_optimizer_spec(spec)[0]
        if name not in APEXW_OPTIMIZERS:
            continue
        source = f"compare.optim_args[{spec!r}]" if spec in cfg.compare.optim_args else "train.optim_args"
        args = argparse.Namespace(
            optim=name,
            optim_args=cfg.compare.optim_args.get(spec, t.optim_args) or None,
            learning_rate=t.learning_rate,
            adam_beta1=0.9,
            adam_beta2=0.999,
            adam_epsilon=1e-8,
            weight_decay=t.weight_decay,
            max_grad_norm=t.max_grad_norm,
            gradient_accumulation_steps=t.gradient_accumulation_steps,
            fp16=t.precision == "fp16",
            deepspeed=None,
            fsdp=None,
            fsdp_config=None,
        )
        try:
            get_optimizer_cls_and_kwargs(args)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{source} ({spec} runs): {exc}") from None
    if cfg.compare.max_minutes < 0:
        raise ValueError(f"compare.max_minutes={cfg.compare.max_minutes} must be >= 0 (0: no limit)")


def earlier_grid(out: Path) -> list[str]:
    """What of an earlier grid ``out`` holds (empty when nothing): run folders and report files."""
    found = []
    runs = out / "runs"
    if runs.is_dir():
        cells = [p for p in runs.iterdir() if p.is_dir()]
        complete = sum(_completed(p / "result.json") is not None for p in cells)
        if cells:
            found.append(f"{len(cells)} run folders ({complete} with a result)")
    found += [name for name in _GRID_FILES if (out / name).exists()]
    return found


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and k in ("model", "lora", "data", "train", "compare") and not prefix:
            out.update(_flat(v, f"{k}."))
        else:
            out[prefix + k] = v
    return out


def config_differences(stored: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``section.key: stored -> new`` for every value a resumed grid may not change (see ``_RESUME_MAY_CHANGE``)."""
    a, b = _flat(stored), _flat(new)
    keys = sorted((set(a) | set(b)) - _RESUME_MAY_CHANGE)
    return [f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}" for k in keys if a.get(k) != b.get(k)]


def _completed(path: Path) -> dict[str, Any] | None:
    """The result stored at ``path`` when that run finished training (status ok), else None."""
    try:
        res = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return res if isinstance(res, dict) and res.get("status") == "ok" else None


def _write_json(path: Path, obj: Any) -> None:
    """Write through a temporary file and a rename, so a result file on disk is always complete."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    tmp.replace(path)


def _child_env(cfg: RecipeConfig) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    threads = cfg.train.torch_threads
    if threads > 0:
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env.setdefault(var, str(threads))
    # run from a source checkout: the children must import this tree (an installed package needs nothing)
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file():
        env["PYTHONPATH"] = str(root) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


_CHILDREN: set[subprocess.Popen] = set()
_STOP = threading.Event()


def _run_child(args: list[str], log: Path, env: dict[str, str]) -> int:
    env = dict(env, APEXW_LAUNCH_TIME=repr(time.time()))
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "apexw_hf.recipe.finetune", *args], stdout=fh, stderr=subprocess.STDOUT, env=env
        )
        _CHILDREN.add(proc)
        try:
            return proc.wait()
        finally:
            _CHILDREN.discard(proc)


def _stop_children() -> None:
    """Terminate the runs still going (Ctrl-C or an error in the runner must not leave them behind)."""
    _STOP.set()
    for proc in list(_CHILDREN):
        proc.terminate()
    for proc in list(_CHILDREN):
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


_FAILED_FIRST = "the first run failed (compare.fail_fast)"


def _cell_result(cell: dict[str, Any], status: str, reason: str) -> dict[str, Any]:
    """The result of a cell that has no result file of its own (not run, or failed before writing one)."""
    return {
        "status": status,
        "reason": reason,
        "optimizer": cell["optim"],
        "learning_rate": cell["lr"],
        "seed": cell["seed"],
    }


def _prepare_base(config_path: Path, out: Path, env: dict[str, str]) -> None:
    """The shared base model and tokenizer, made once per grid by a child process (``--prepare-only``)."""
    t0 = time.time()
    print(f"[apexw-compare] preparing the shared base model/tokenizer in {out}/base ...", flush=True)
    rc = _run_child(
        ["--config", str(config_path), "--output-dir", str(out), "--prepare-only"], out / "prepare.log", env
    )
    if rc != 0:
        raise RuntimeError(
            f"preparing the base model failed (exit {rc}); log {out / 'prepare.log'}:\n{_tail(out / 'prepare.log')}"
        )
    print(f"[apexw-compare] base ready in {time.time() - t0:.1f} s", flush=True)


def _warmup_run(cfg: RecipeConfig, config_path: Path, out: Path, env: dict[str, str]) -> None:
    """A short unreported run of the first optimizer (``compare.warmup_run``): it fills the compile caches, so the
    first reported run is not slower for it."""
    tw = time.time()
    wdir = out / "warmup"
    wdir.mkdir(exist_ok=True)
    args = ["--config", str(config_path), "--output-dir", str(wdir), "--optim", cfg.compare.optimizers[0]]
    args += ["--set", "train.max_steps=5", "--set", "data.validation_samples=0"]
    rc = _run_child(args + ["--prepared", str(out / "prepared_paths.json")], wdir / "log.txt", env)
    print(
        f"[apexw-compare] warm-up run (fills compile caches, not reported): exit {rc}, {time.time() - tw:.1f} s",
        flush=True,
    )


def _outcome(res: dict[str, Any], run_dir: Path) -> str:
    """One run's line of progress: its losses, speed and state size, or why it did not finish."""
    if res["status"] == "ok":
        v = res.get("validation_loss")
        return (
            f"loss {res['initial_train_loss']:.3f} -> {res['final_train_loss']:.3f}, val "
            f"{'n/a' if v is None else f'{v:.3f}'}, {res['steps_per_s']:.2f} steps/s, state "
            f"{res['optimizer_state_mib']:.3f} MiB"
        )
    what = f"{res['status'].upper()}: {res.get('reason', '')}"
    if res["status"] == "failed":
        what += f"\n{_tail(run_dir / 'log.txt')}"
    return what


class _Grid:
    """The cells of one grid still to run (``todo``, indices into ``grid``), run from a thread pool by
    :meth:`run_cell`, and what they gave (``results``, by index; cells kept from an earlier attempt already there)."""

    def __init__(
        self, cfg: RecipeConfig, config_path: Path, out: Path, env: dict[str, str], jobs: int, resume: bool, t0: float
    ):
        self.cfg, self.config_path, self.out, self.env, self.jobs = cfg, config_path, out, env, jobs
        self.runs_dir = out / "runs"
        self.grid = plan_grid(cfg)
        self.results: list[dict[str, Any] | None] = [None] * len(self.grid)
        self.todo = []
        for i, cell in enumerate(self.grid):
            kept = _completed(self.runs_dir / cell["name"] / "result.json") if resume else None
            if kept is None:
                self.todo.append(i)
            else:
                self.results[i] = kept
        self.t0 = t0  # the grid's start, preparation included: compare.max_minutes counts from it
        self.done = 0
        self.durations: list[float] = []
        self.failed_first: list[str] = []
        self.lock = threading.Lock()

    def _env_of(self, cell: dict[str, Any]) -> dict[str, str]:
        """The child's environment: with ``compare.devices``, only the cell's GPU visible (and its own lock)."""
        if "device" not in cell:
            return self.env
        dev = cell["device"]
        run_env = {**self.env, "CUDA_VISIBLE_DEVICES": str(dev)}
        if "APEXW_GPU_LOCK" in self.env:
            run_env["APEXW_GPU_LOCK"] = f"{self.env['APEXW_GPU_LOCK']}.{dev}"
        return run_env

    def _skip_reason(self) -> str | None:
        """Why the next cell is not started: the first run failed (``compare.fail_fast``) or the time budget is
        used (``compare.max_minutes``); None to run it."""
        if self.cfg.compare.fail_fast and self.failed_first:
            return _FAILED_FIRST
        budget = self.cfg.compare.max_minutes * 60
        if budget > 0 and time.time() - self.t0 > budget:
            return f"compare.max_minutes={self.cfg.compare.max_minutes} reached"
        return None

    def run_cell(self, i: int) -> None:
        """Run cell ``i`` in a child process and record its result (also in its ``result.json``)."""
        if _STOP.is_set():
            return
        cell = self.grid[i]
        n = len(self.todo)
        reason = self._skip_reason()
        if reason is not None:
            self.results[i] = _cell_result(cell, "not run", reason)
            if reason != _FAILED_FIRST:
                k = self.todo.index(i) + 1
                print(f"[apexw-compare] [{k}/{n}] {cell['name']}: not run (time budget used)", flush=True)
            return
        run_dir = self.runs_dir / cell["name"]
        run_dir.mkdir(parents=True, exist_ok=True)
        res_path = run_dir / "result.json"
        res_path.unlink(missing_ok=True)  # a failed earlier attempt's, on resume: never read as this run's
        args = ["--config", str(self.config_path), "--output-dir", str(run_dir), "--optim", cell["optim"]]
        args += ["--lr", repr(cell["lr"]), "--seed", str(cell["seed"])]
        ts = time.time()
        args += ["--prepared", str(self.out / "prepared_paths.json")]
        rc = _run_child(args, run_dir / "log.txt", self._env_of(cell))
        dt = time.time() - ts
        if res_path.is_file():
            res = json.loads(res_path.read_text())
        else:
            why = f"killed by signal {-rc} before it finished" if rc < 0 else f"exit code {rc}, no result file"
            res = _cell_result(cell, "failed", why)
        res["run_name"], res["process_seconds"] = cell["name"], round(dt, 2)
        if "device" in cell:
            res["cuda_device"] = cell["device"]
        self.results[i] = res
        with self.lock:
            if self.done == 0 and res["status"] == "failed":
                self.failed_first.append(cell["name"])
            self.durations.append(dt)
            self.done += 1
            done, left = self.done, n - self.done
            eta = (sum(self.durations) / len(self.durations)) * left / max(1, self.jobs)
        print(
            f"[apexw-compare] [{done}/{n}] {cell['name']} ({dt:.1f} s): {_outcome(res, run_dir)}  | elapsed "
            f"{time.time() - self.t0:.0f} s, ~{eta:.0f} s left",
            flush=True,
        )
        _write_json(res_path, res)


def run_grid(cfg: RecipeConfig, config_path: Path, out: Path, jobs: int, resume: bool = False) -> list[dict[str, Any]]:
    """Prepare the shared base once, then run every grid cell in its own process; return the result dicts.

    Without ``resume``, ``out/runs`` must be empty or absent (an earlier grid is never deleted or mixed in: the
    caller moves it away or clears it). With ``resume``, a cell whose ``result.json`` holds a finished run (status
    ok) is kept and not run again; the caller has checked that ``config_path`` is that grid's config.
    """
    _STOP.clear()  # a grid stopped earlier in this process must not stop this one
    env = _child_env(cfg)
    runs_dir = out / "runs"
    if not resume and runs_dir.is_dir() and any(runs_dir.iterdir()):
        raise FileExistsError(f"{runs_dir} holds the runs of an earlier grid; resume it, or clear it first")
    runs_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    _prepare_base(config_path, out, env)
    if cfg.compare.warmup_run:
        _warmup_run(cfg, config_path, out, env)
    grid = _Grid(cfg, config_path, out, env, jobs, resume, t0)
    if resume:
        print(
            f"[apexw-compare] resuming: {len(grid.grid) - len(grid.todo)} of {len(grid.grid)} runs finished earlier "
            f"and are kept, {len(grid.todo)} to run",
            flush=True,
        )
    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        for fut in [pool.submit(grid.run_cell, i) for i in grid.todo]:
            fut.result()
    except BaseException:
        _STOP.set()
        pool.shutdown(wait=False, cancel_futures=True)
        _stop_children()
        raise
    pool.shutdown()
    return [r for r in grid.results if r is not None]


def _load_results(out: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted((out / "runs").glob("*/result.json"))]


_NEEDS = ("transformers", "peft", "accelerate", "datasets", "tokenizers", "yaml", "matplotlib")


def _check_dependencies() -> None:
    missing = [m for m in _NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(
            f"apexw-compare needs {', '.join('pyyaml' if m == 'yaml' else m for m in missing)}: "
            "install the Hugging Face extra, pip install 'apexw_hf[hf]' (or pip install -e '.[hf]' in "
            "a checkout)"
        )


def _error(text: str) -> int:
    print(f"apexw-compare: error: {text}", file=sys.stderr)
    return 2


def _parser() -> argparse.ArgumentParser:
    doc = __doc__.split("\n\n")
    ap = argparse.ArgumentParser(
        prog="apexw-compare",
        description="\n\n".join(doc[:3]),
        epilog="\n\n".join(doc[3:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "config",
        nargs="?",
        default=None,
        help="YAML path or shipped config name (default: the embedded offline default; with --resume, the "
        "resumed grid's stored config)",
    )
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a config value, e.g. --set train.max_steps=20 (repeatable)",
    )
    ap.add_argument("--optimizers", help="comma-separated, replaces compare.optimizers")
    ap.add_argument("--lrs", help="comma-separated, replaces compare.learning_rates")
    ap.add_argument("--seeds", help="comma-separated, replaces compare.seeds")
    ap.add_argument("--output-dir", help="replaces compare.output_dir")
    ap.add_argument("--jobs", type=int, help="runs at a time (CPU only; GPU runs always go one at a time)")
    ap.add_argument("--max-minutes", type=float, help="launch no new run after this long (0: no limit)")
    what = ap.add_mutually_exclusive_group()
    what.add_argument(
        "--resume", action="store_true", help="finish the grid in the output folder: run only its missing cells"
    )
    what.add_argument(
        "--overwrite", action="store_true", help="delete the grid in the output folder first, then run a new one"
    )
    what.add_argument("--report-only", action="store_true", help="only rebuild CSV/table/plot from existing runs")
    return ap


def _overrides(args: argparse.Namespace) -> list[str]:
    """The ``--set`` overrides with those of the shorthand options (``--optimizers``, ``--lrs``, ...) after them."""
    ov = list(args.overrides)
    for key, val in (("optimizers", args.optimizers), ("learning_rates", args.lrs), ("seeds", args.seeds)):
        if val:
            ov.append(f"compare.{key}=[{val}]")
    if args.output_dir:
        ov.append(f"compare.output_dir={args.output_dir}")
    if args.jobs is not None:
        ov.append(f"compare.jobs={args.jobs}")
    if args.max_minutes is not None:
        ov.append(f"compare.max_minutes={args.max_minutes}")
    return ov


def _check_lists(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--lrs`` and ``--seeds`` are comma-separated numbers (argparse's exit 2 with the item that is not)."""
    for option, text, kind in (("--lrs", args.lrs, float), ("--seeds", args.seeds, int)):
        for item in (text or "").split(",") if text else []:
            try:
                kind(item)
            except ValueError:
                ap.error(
                    f"{option} {text}: {item.strip()!r} is not {'a number' if kind is float else 'an integer'} "
                    f"(give a comma-separated list, e.g. {option} {'1e-3,3e-3' if kind is float else '0,1,2'})"
                )


def _output_error(args: argparse.Namespace, cfg: RecipeConfig, out: Path, earlier: list[str]) -> str | None:
    """Why this call may not write into ``out`` (an earlier grid there without --resume or --overwrite, a resume of
    no grid or with another config), or None."""
    stored = out / "config.json"
    if args.resume:
        if not stored.is_file():
            return f"--resume: {out} holds no grid to resume (no config.json); run without --resume to start one"
        try:
            diffs = config_differences(json.loads(stored.read_text()), cfg.to_dict())
        except ValueError as exc:
            return f"--resume: {stored} is not readable JSON ({exc}); start a new grid in another --output-dir"
        if diffs:
            return (
                f"--resume: this config differs from the grid's in {stored}: {'; '.join(diffs)}. Resume with the "
                "same config and options (or none: the stored config is used), or start a new grid in another "
                "--output-dir"
            )
    elif earlier and not args.overwrite:
        return (
            f"{out} holds an earlier grid ({', '.join(earlier)}), left unchanged. Give another --output-dir, "
            "--resume to finish that grid (only its missing runs), or --overwrite to delete it and start again"
        )
    return None


def _devices_error(cfg: RecipeConfig) -> str | None:
    """Why ``compare.devices`` cannot be used on this machine (a GPU index it does not have), or None."""
    if not (cfg.compare.devices and _gpu_present()):
        return None
    import torch

    count = torch.cuda.device_count()
    missing = [d for d in cfg.compare.devices if d >= count]
    if missing:
        return (
            f"compare.devices={cfg.compare.devices} names GPU(s) {missing}, but this machine has {count} "
            f"(indices 0..{count - 1}); set compare.devices to those or leave it empty"
        )
    return None


def _share_gpus(cfg: RecipeConfig, out: Path, jobs: int) -> None:
    """With several runs at a time on a GPU machine: one run at a time per GPU through a lock (the children take it
    around loading, training and evaluation), unless ``compare.runs_per_device`` lets runs share a GPU."""
    if not (jobs > 1 and _gpu_present()):
        return
    ndev = max(1, len(cfg.compare.devices))
    if cfg.compare.runs_per_device == 1:
        os.environ["APEXW_GPU_LOCK"] = str(out / "gpu.lock")
        print(
            f"[apexw-compare] GPU present: {jobs} runs overlap only their start-up (imports); model loading, "
            f"training and evaluation hold a lock, one run at a time per GPU ({ndev} GPU(s))",
            flush=True,
        )
    else:
        os.environ.pop("APEXW_GPU_LOCK", None)
        print(
            f"[apexw-compare] GPU present: up to {jobs} runs at a time over {ndev} GPU(s), "
            f"compare.runs_per_device={cfg.compare.runs_per_device} sharing each GPU: steps/s are measured "
            "under sharing (peak memory is per process)",
            flush=True,
        )


def _delete_grid(out: Path, earlier: list[str]) -> None:
    """--overwrite: the earlier grid's runs and reports (the shared base/ cache stays)."""
    for name in ("runs", "warmup"):
        shutil.rmtree(out / name, ignore_errors=True)
    for name in _GRID_FILES:
        (out / name).unlink(missing_ok=True)
    print(f"[apexw-compare] --overwrite: deleted the earlier grid in {out} ({', '.join(earlier)})", flush=True)


def _announce(cfg: RecipeConfig, out: Path, jobs: int) -> None:
    n = len(plan_grid(cfg))
    n_lrs = len({lr for o in cfg.compare.optimizers for lr in cfg.compare.learning_rates_of(o)})
    print(
        f"[apexw-compare] config {cfg.name} ({cfg.train.finetuning} fine-tuning): "
        f"{len(cfg.compare.optimizers)} optimizers x {n_lrs} learning rates"
        f"{' (per-optimizer sweeps)' if cfg.compare.lr_sweep else ''} x {len(cfg.compare.seeds)} seeds = {n} "
        f"runs, {jobs} at a time; output {out}",
        flush=True,
    )


def _run_to_end(cfg: RecipeConfig, out: Path, jobs: int, resume: bool):
    """:func:`run_grid` until it ends or is interrupted (Ctrl-C, SIGTERM: the running children are stopped and the
    runs that finished are reported); the results, the interruption (or None) and the grid's meta data."""
    t0 = time.time()
    load0 = os.getloadavg()
    # `timeout` or a scheduler sends SIGTERM: unwind through the finally below, which stops the running children
    on_sigterm = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    interrupted = None
    try:
        results = run_grid(cfg, out / "config.json", out, jobs, resume=resume)
    except (KeyboardInterrupt, SystemExit) as exc:  # Ctrl-C or SIGTERM: report the runs that finished
        interrupted = exc
        _stop_children()
        results = _load_results(out)
        print(f"[apexw-compare] INTERRUPTED: reporting the {len(results)} runs that finished", flush=True)
    finally:
        _stop_children()
        signal.signal(signal.SIGTERM, on_sigterm)
    meta = {
        "wall_seconds": round(time.time() - t0, 1),
        "runs": len(results),
        "jobs": jobs,
        "devices": cfg.compare.devices,
        "runs_per_device": cfg.compare.runs_per_device,
        "cpu_count": os.cpu_count(),
        "loadavg_1min_start": round(load0[0], 2),
        "loadavg_1min_end": round(os.getloadavg()[0], 2),
        "interrupted": interrupted is not None,
        "resumed": resume,
    }
    return results, interrupted, meta


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    _check_lists(ap, args)
    _check_dependencies()
    ov = _overrides(args)
    # Everything is checked here, before a folder is made, a file written or deleted, or a model built.
    try:
        cfg = load_config(args.config or DEFAULT_CONFIG, ov)
        out = Path(cfg.compare.output_dir).resolve()
        stored = out / "config.json"
        if args.resume and args.config is None and stored.is_file():
            cfg = load_config(stored, ov)  # the grid's own config, with this call's overrides
        validate_grid(cfg)
    except (OSError, ValueError, TypeError) as exc:  # a missing or malformed config, or a bad value
        return _error(str(exc))
    if args.report_only:
        results = _load_results(out)
        if not results:
            print(f"[apexw-compare] no run results under {out / 'runs'}", file=sys.stderr)
            return 1
        return _report(results, cfg, out, time.time(), None)
    earlier = earlier_grid(out)
    problem = _output_error(args, cfg, out, earlier) or _devices_error(cfg)
    if problem:
        return _error(problem)
    if args.overwrite and earlier:
        _delete_grid(out, earlier)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    if not args.resume:
        _write_json(stored, cfg.to_dict())  # the exact config every child reads, overrides applied
    jobs = cfg.compare.jobs
    _share_gpus(cfg, out, jobs)
    _announce(cfg, out, jobs)
    results, interrupted, meta = _run_to_end(cfg, out, jobs, args.resume)
    (out / "grid_meta.json").write_text(json.dumps(meta, indent=1))
    if interrupted is not None and not results:
        raise interrupted
    return _report(results, cfg, out, t0, interrupted)


def _report(results: list[dict[str, Any]], cfg: RecipeConfig, out: Path, t0: float, interrupted) -> int:
    table = write_reports(results, cfg, out)
    print(table, flush=True)
    print(
        f"[apexw-compare] wrote {out / 'results.csv'}, {out / 'summary.md'}, {out / 'loss_curves.png'} "
        f"({time.time() - t0:.0f} s)",
        flush=True,
    )
    if interrupted is not None:
        print(
            "[apexw-compare] the grid is not finished: run the same command with --resume to run the missing cells",
            flush=True,
        )
        return 130
    return 0 if any(r.get("status") == "ok" for r in results) else 1


def _gpu_present() -> bool:
    """True when a CUDA device is visible, checked without importing torch into the runner process."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return any(Path(p).exists() for p in ("/dev/nvidia0", "/dev/nvidiactl"))


if __name__ == "__main__":
    sys.exit(main())
