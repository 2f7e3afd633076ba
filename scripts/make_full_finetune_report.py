"""Write the measured tables of docs/full_finetune.md and README.md's "Full fine-tuning" section from the ledger.

Every number comes from the ``apexw-compare`` runs in ``docs/results/compare.jsonl`` (grids named by their ``grid``
column, their configs in ``compare_grids.jsonl``); nothing is typed by hand:

* the H200 memory/speed grid: ``full_finetune_h200/speed_*``, and the longer steps/s runs of the target's cells:
  ``steady_*``;
* the H200 quality grid: ``full_finetune_h200/quality*``; grids with the same set-up as the newest (equal ``model``,
  ``data`` and ``train`` sections of their config, e.g. the cells of one grid run in two device calls) are joined
  into one table;
* the CPU grid of ``apexw-compare offline_full``: ``offline_full`` (with ``offline_full_extra/*`` and the 4-bit
  grids ``offline_full_4bit/v2_*``).

Each table is written between ``<!-- name -->`` and ``<!-- /name -->`` markers in the two files.

Usage::

    python scripts/make_full_finetune_report.py [--check]   # --check: exit 1 if the files are not up to date
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "scripts"))

import ledger  # noqa: E402

from apexw_hf.recipe.config import optimizer_label  # noqa: E402
from apexw_hf.recipe.report import BEST_LR_RULE, best_learning_rates, paired_cell  # noqa: E402

LEDGER = "docs/results/compare.jsonl"
BASE_GPU, BASE_CPU = "adamw_torch_fused@fp32", "adamw_torch@fp32"


def _runs(grid: str) -> list[dict]:
    return ledger.runs(grid)


def _latest(pattern: str) -> str | None:
    """The newest grid of the ledger matching ``pattern``: by the date its runs recorded, then by name."""

    def key(g: str):
        dates = [r.get("environment", {}).get("date_utc", "") for r in _runs(g)]
        return (max(dates, default=""), g.rpartition("/")[2])

    found = sorted(ledger.grids(pattern), key=key)
    return found[-1] if found else None


def _same_setup(pattern: str) -> list[str]:
    """The newest grid matching ``pattern`` and every other one run with the same set-up (its model, data and train
    config; the optimizers, learning rates and seeds may differ), newest first."""
    newest = _latest(pattern)
    if newest is None or ledger.grid_config(newest) is None:
        return [newest] if newest else []

    def setup(grid: str):
        cfg = _grid(grid)
        return [cfg.get(k) for k in ("model", "data", "train")]

    want = setup(newest)
    others = [g for g in ledger.grids(pattern) if g != newest and ledger.grid_config(g) and setup(g) == want]
    return [newest, *others]


def _where(grids) -> str:
    return f"`{LEDGER}`, grid{'s' if len(grids) > 1 else ''} " + ", ".join(f"`{g}`" for g in grids)


def _mean(xs):
    return statistics.fmean(xs) if xs else float("nan")


def _env_line(runs: list[dict], folder: str) -> str:
    env = runs[0]["environment"]
    commits = sorted({r["environment"].get("git_commit", "?") for r in runs})
    dates = sorted({r["environment"].get("date_utc", "?")[:10] for r in runs})
    return (
        f"{env['device']}; torch {env['torch']}, transformers {env['transformers']}; commit {', '.join(commits)}; "
        f"{', '.join(dates)}; stored in {_where([folder])}"
    )


def speed_table() -> str:
    folder = _latest("full_finetune_h200/speed_*")
    if folder is None:
        return "(no stored H200 memory/speed grid)\n"
    found = {r["optimizer"]: r for r in _runs(folder) if r.get("status") == "ok"}
    runs = {o: found[o] for o in _order(folder, found)}
    base = runs.get(BASE_GPU)
    if base is None:  # the ratios and the set-up line are relative to the reference run
        return f"({_where([folder])} has no finished `{BASE_GPU}` run: no table)\n"
    lines = [
        f"{_env_line(list(runs.values()), folder)}. Llama-3.2-1B shapes ({base['trainable_params']:,} parameters), "
        f"every sample padded to {_grid(folder)['data']['pad_to_multiple_of']} tokens, batch "
        f"{_grid(folder)['train']['per_device_train_batch_size']}, gradient checkpointing, "
        f"{base['global_steps']} optimizer steps per run, one run on the GPU at a time, one seed.",
        "",
        "| optim | model dtype | peak allocated GiB | vs fp32 torch | peak reserved GiB | optimizer state MiB | "
        "bytes/param (params + grads + state) | steps/s | optimizer step ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for spec, r in runs.items():
        name, dtype = spec.split("@")
        lines.append(
            f"| `{name}` | {dtype} | {r['peak_gpu_mem_allocated_gib']:.2f} | "
            f"{r['peak_gpu_mem_allocated_gib'] / base['peak_gpu_mem_allocated_gib']:.2f}x | "
            f"{r['peak_gpu_mem_reserved_gib']:.2f} | {r['optimizer_state_mib']:.0f} | "
            f"{r['train_bytes_per_param']:.2f} | {r['steps_per_s_steady']:.2f} | {r['optimizer_step_ms']:.1f} |"
        )
    lines += [
        "",
        "steps/s: steady rate of that run (its first 10% of steps left out), one 120-step run per cell: treat "
        "differences of a few percent as noise. fp32 rows: fp32 master weights with bf16 autocast; bf16 rows: the "
        "model itself in bf16, no fp32 copy.",
    ]
    return "\n".join(lines) + "\n"


def steady_table() -> str:
    """steps/s of the steps/s target's cells over several seeds of longer runs (grid ``steady_*``)."""
    folder = _latest("full_finetune_h200/steady_*")
    if folder is None:
        return "(no stored H200 steps/s runs)\n"
    runs = [r for r in _runs(folder) if r.get("status") == "ok"]
    if not runs:
        return f"(no finished runs in {_where([folder])})\n"
    cfg = _grid(folder)
    lines = [
        f"{_env_line(runs, folder)}. Every sample padded to {cfg['data']['pad_to_multiple_of']} tokens, batch "
        f"{cfg['train']['per_device_train_batch_size']}, gradient checkpointing, {runs[0]['global_steps']} optimizer "
        "steps per run, one run on the GPU at a time; mean ± sample std over seeds.",
        "",
        "| optim | model dtype | seeds | steps/s (whole run) | steps/s (first 10% left out) | optimizer step ms | "
        "peak allocated GiB |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for spec in _order(folder, {r["optimizer"] for r in runs}):
        rs = [r for r in runs if r["optimizer"] == spec]
        name, dtype = spec.split("@")
        lines.append(
            f"| `{name}` | {dtype} | {len(rs)} | {_ms([r['steps_per_s'] for r in rs], 2)} | "
            f"{_ms([r['steps_per_s_steady'] for r in rs], 2)} | {_ms([r['optimizer_step_ms'] for r in rs], 2)} | "
            f"{_ms([r['peak_gpu_mem_allocated_gib'] for r in rs], 2)} |"
        )
    return "\n".join(lines) + "\n"


def _order(folder: str, names) -> list[str]:
    """The grid's configured optimizer order (its config), then any others."""
    cfg = ledger.grid_config(folder)
    first = cfg["compare"]["optimizers"] if cfg else []
    return [o for o in first if o in names] + sorted(set(names) - set(first))


def _order_grids(folders, names) -> list[str]:
    """The optimizer order of several grids: each grid's configured order, the grid whose runs are oldest first."""

    def first_date(g: str):
        return min((r.get("environment", {}).get("date_utc", "") for r in _runs(g)), default="")

    order = []
    for f in sorted(folders, key=lambda g: (first_date(g), g.rpartition("/")[2])):
        order += [o for o in _order(f, names) if o not in order]
    return order


def _grid(folder: str) -> dict:
    return ledger.grid_config(folder)


def quality_table(folder: str | None, base: str, from_log_note: bool, extra: list[str] = ()) -> str:
    """Validation loss per optimizer and learning rate, the best lr and paired tests; ``extra``: more grids of the
    same set-up (other seeds or learning rates) whose runs join ``folder``'s."""
    if folder is None:
        return "(no stored grid)\n"
    runs = [r for f in (folder, *extra) for r in _runs(f) if r.get("status") == "ok"]
    digits = 4
    if not runs:
        return f"(no finished runs in {_where([folder])})\n"
    best = best_learning_rates(runs)
    opts = _order_grids((folder, *extra), {r["optimizer"] for r in runs})
    if base in opts:
        opts.remove(base)
        opts.insert(0, base)
    lrs = sorted({r["learning_rate"] for r in runs})
    seeds = sorted({r["seed"] for r in runs})
    head = (
        "| optimizer | "
        + " | ".join(f"val loss, lr {lr:g}" for lr in lrs)
        + " | best lr | val loss at best | Δ vs "
        + f"`{base}` at its best (paired p) |"
    )
    lines = [
        f"From the runs in {_where([folder, *extra])}"
        + f"; seeds {seeds}; mean ± sample std over the seeds of each cell (n in brackets where it differs).",
        "",
        head,
        "|---|" + "---:|" * (len(lrs) + 3),
    ]
    base_lr = best[base]["lr"] if base in best else None  # no baseline run: every test cell says n too small
    base_best = {r["seed"]: r for r in runs if r["optimizer"] == base and r["learning_rate"] == base_lr}
    for o in opts:
        cells = []
        for lr in lrs:
            v = [r["validation_loss"] for r in runs if r["optimizer"] == o and r["learning_rate"] == lr]
            cells.append(_ms(v, digits) + (f" (n={len(v)})" if v and len(v) != len(seeds) else ""))
        b = best[o]
        why = _incomplete(runs, o)
        if why:
            lines.append(f"| {optimizer_label(o)} | " + " | ".join(cells) + f" | {why} | - | - |")
            continue
        at = {r["seed"]: r["validation_loss"] for r in runs if r["optimizer"] == o and r["learning_rate"] == b["lr"]}
        test = "-" if o == base else paired_cell(at, {s: r["validation_loss"] for s, r in base_best.items()})
        lines.append(
            f"| {optimizer_label(o)} | "
            + " | ".join(cells)
            + f" | {b['lr']:g} | {_ms(list(at.values()), digits)} | {test} |"
        )
    if from_log_note:
        lines += ["", f"Best lr rule: {BEST_LR_RULE}."]
    return "\n".join(lines) + "\n"


def _incomplete(runs: list[dict], opt: str) -> str | None:
    """Why ``opt``'s learning-rate sweep cannot name a best lr yet, or None: a learning rate it tried has fewer
    finished seeds than most optimizers of the grid have there (the best-lr rule would then choose among the complete
    learning rates only, which can be the worse one). Extra seeds run for every optimizer at one lr do not count."""
    short = []
    for lr in sorted({r["learning_rate"] for r in runs if r["optimizer"] == opt}):
        counts = {}
        for r in runs:
            if r["learning_rate"] == lr:
                counts[r["optimizer"]] = counts.get(r["optimizer"], 0) + 1
        usual = statistics.mode(sorted(counts.values(), reverse=True))
        if counts[opt] < usual:
            short.append(f"lr {lr:g} has {counts[opt]} of {usual} seeds")
    return "incomplete sweep: " + ", ".join(short) if short else None


def _ms(v: list[float], digits: int = 4) -> str:
    if not v:
        return "-"
    if len(v) == 1:
        return f"{v[0]:.{digits}f}"
    return f"{statistics.fmean(v):.{digits}f} ± {statistics.stdev(v):.{digits}f}"


def readme_table() -> str:
    """The short README table: H200 memory per optim/dtype, and the validation loss at each optimizer's best lr of the
    H200 quality grid and of the CPU grid."""
    folder = _latest("full_finetune_h200/speed_*")
    cpu_folders = ["offline_full", *ledger.grids("offline_full_extra/*")] if ledger.grids("offline_full") else []
    cpu_runs = [r for f in cpu_folders for r in _runs(f) if r.get("status") == "ok"]
    # the 4-bit grids of the same set-up; their torch AdamW runs repeat offline_full's (same seeds, same bits). Only
    # the current 4-bit format's (grids v2_*); the other grids hold version 1's runs, for the record
    cpu_runs += [
        r
        for f in ledger.grids("offline_full_4bit/v2_*")
        for r in _runs(f)
        if r.get("status") == "ok" and r["optimizer"].startswith("apexw_4bit")
    ]
    best = best_learning_rates(cpu_runs) if cpu_runs else {}
    cpu_seeds = max(
        (sum(1 for x in cpu_runs if x["optimizer"] == o and x["learning_rate"] == b["lr"]) for o, b in best.items()),
        default=0,
    )
    quality = _same_setup("full_finetune_h200/quality*")
    h200_runs = [r for f in quality for r in _runs(f) if r.get("status") == "ok"]
    h200_best = best_learning_rates(h200_runs) if h200_runs else {}
    h200_seeds = len({r["seed"] for r in h200_runs})
    lines = [
        "| optim | model dtype | H200 peak GiB (Llama-3.2-1B shapes) | bytes/param before activations | "
        f"H200 grid: val loss at best lr, {h200_seeds} seeds | "
        f"`offline_full` CPU grid: val loss at best lr, {cpu_seeds} seeds (torch AdamW for-loop for fused) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    found = {r["optimizer"]: r for r in _runs(folder) if r.get("status") == "ok"} if folder else {}
    gpu = {o: found[o] for o in _order(folder, found)} if folder else {}
    # cells of the quality grid that the memory/speed grid did not run: no peak at its set-up, bytes/param from the
    # quality runs (they do not depend on sequence length or batch)
    later = {r["optimizer"]: r for r in h200_runs if r["optimizer"] not in gpu and r["optimizer"] in h200_best}
    for spec in sorted(later):
        gpu[spec] = {**later[spec], "peak_gpu_mem_allocated_gib": None}
    for spec, r in gpu.items():
        cpu_spec = spec.replace("adamw_torch_fused", "adamw_torch")
        val = "-"
        if cpu_spec in best:
            at = [
                x["validation_loss"]
                for x in cpu_runs
                if x["optimizer"] == cpu_spec and x["learning_rate"] == best[cpu_spec]["lr"]
            ]
            val = f"{_ms(at)} (lr {best[cpu_spec]['lr']:g})"
        gval = "-"
        if spec in h200_best and _incomplete(h200_runs, spec):
            gval = "(incomplete sweep)"
        elif spec in h200_best:
            lr = h200_best[spec]["lr"]
            at = [x["validation_loss"] for x in h200_runs if x["optimizer"] == spec and x["learning_rate"] == lr]
            gval = _ms(at)
            gval += f" (lr {lr:g})"
        name, dtype = spec.split("@")
        peak = "-" if r["peak_gpu_mem_allocated_gib"] is None else f"{r['peak_gpu_mem_allocated_gib']:.2f}"
        lines.append(f"| `{name}` | {dtype} | {peak} | {r['train_bytes_per_param']:.2f} | {gval} | {val} |")
    return "\n".join(lines) + "\n"


def _replace(text: str, name: str, body: str) -> str:
    start, end = f"<!-- {name} -->", f"<!-- /{name} -->"
    if start not in text or end not in text:
        raise SystemExit(f"marker {start} ... {end} missing")
    a, b = text.index(start) + len(start), text.index(end)
    return text[:a] + "\n" + body + text[b:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    quality_gpu = _same_setup("full_finetune_h200/quality*")
    sections = {
        ROOT / "docs" / "full_finetune.md": {
            "ff-h200-speed": speed_table(),
            "ff-h200-steady": steady_table(),
            "ff-h200-quality": quality_table(
                quality_gpu[0] if quality_gpu else None, BASE_GPU, False, quality_gpu[1:]
            ),
            "ff-cpu-quality": quality_table("offline_full", BASE_CPU, True),
            "ff-cpu-quality-extra": quality_table(
                "offline_full", BASE_CPU, False, ledger.grids("offline_full_extra/*")
            ),
        },
        ROOT / "README.md": {"ff-readme": readme_table()},
    }
    stale = []
    for path, parts in sections.items():
        text = path.read_text()
        new = text
        for name, body in parts.items():
            new = _replace(new, name, body)
        if new != text:
            stale.append(path)
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        print("out of date: " + ", ".join(str(p.relative_to(ROOT)) for p in stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
