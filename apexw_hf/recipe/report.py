"""Turn the comparison's per-run results into ``results.csv``, ``summary.md`` and ``loss_curves.png``.

Statistics: mean +- sample standard deviation over seeds, and two-sided t-tests of each optimizer against the
baseline, per learning rate: on final training loss and validation loss a paired test over seeds (a seed fixes LoRA
initialisation and data order for every optimizer, so seed-to-seed variation cancels) with Welch's unpaired test
beside it; on steps/s Welch's test. The
t distribution's tail comes from the regularized incomplete beta function (Numerical Recipes' continued fraction),
so no SciPy is needed. With fewer than 2 seeds per group no test is made and the table says so.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path
from typing import Any

from .config import RecipeConfig, optimizer_label

__all__ = [
    "welch_t_test",
    "paired_t_test",
    "student_t_sf",
    "best_learning_rates",
    "paired_cell",
    "summarize",
    "write_reports",
    "CSV_FIELDS",
    "BEST_LR_RULE",
]

ALPHA = 0.05
CSV_FIELDS = [
    "run_name",
    "status",
    "reason",
    "optimizer",
    "optimizer_label",
    "optim",
    "finetuning",
    "param_dtype",
    "learning_rate",
    "seed",
    "backend",
    "device",
    "precision",
    "global_steps",
    "steps_per_s",
    "steps_per_s_steady",
    "optimizer_step_ms",
    "optimizer_state_bytes",
    "optimizer_state_mib",
    "peak_gpu_mem_allocated_gib",
    "peak_gpu_mem_reserved_gib",
    "peak_rss_gib",
    "trainable_param_bytes",
    "grad_bytes",
    "train_bytes_per_param",
    "initial_train_loss",
    "final_train_loss",
    "last_train_loss",
    "validation_loss",
    "trainable_params",
    "total_params",
    "train_runtime_s",
    "process_seconds",
    "cpu_seconds",
    "optimizer_class",
    "optimizer_engine",
    "optimizer_triton_engine_used",
    "optimizer_grad_moves",
    "optimizer_torch_engine_used",
    "optimizer_numba_used",
    "data_source",
    "git_commit",
    "torch",
    "transformers",
    "date_utc",
]


def _betacf(a: float, b: float, x: float) -> float:
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > 1e-300 else 1e-300)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > 1e-300 else 1e-300)
        c = 1.0 + aa / c if abs(1.0 + aa / c) > 1e-300 else 1e-300
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > 1e-300 else 1e-300)
        c = 1.0 + aa / c if abs(1.0 + aa / c) > 1e-300 else 1e-300
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-14:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    lbt = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(lbt) * _betacf(a, b, x) / a
    return 1.0 - math.exp(lbt) * _betacf(b, a, 1.0 - x) / b


def student_t_sf(t: float, df: float) -> float:
    """Two-sided tail probability P(|T| >= |t|) of Student's t with ``df`` degrees of freedom."""
    return _betainc(df / 2.0, 0.5, df / (df + t * t))


def welch_t_test(a: list[float], b: list[float]) -> dict[str, float] | None:
    """Welch's two-sided t-test of mean(a) - mean(b); None when either group has fewer than 2 values."""
    if len(a) < 2 or len(b) < 2:
        return None
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    if va + vb == 0.0:
        return {
            "diff": ma - mb,
            "t": math.inf if ma != mb else 0.0,
            "df": len(a) + len(b) - 2.0,
            "p": 0.0 if ma != mb else 1.0,
        }
    t = (ma - mb) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    return {"diff": ma - mb, "t": t, "df": df, "p": student_t_sf(t, df)}


def paired_t_test(a: list[float], b: list[float]) -> dict[str, float] | None:
    """Paired two-sided t-test of mean(a - b) over matched pairs; None with fewer than 2 pairs."""
    if len(a) != len(b):
        raise ValueError(f"paired test needs equal lengths, got {len(a)} and {len(b)}")
    if len(a) < 2:
        return None
    d = [x - y for x, y in zip(a, b, strict=True)]
    md, sd = statistics.fmean(d), statistics.stdev(d)
    df = len(d) - 1.0
    if sd == 0.0:
        return {"diff": md, "t": math.inf if md else 0.0, "df": df, "p": 0.0 if md else 1.0}
    t = md / (sd / math.sqrt(len(d)))
    return {"diff": md, "t": t, "df": df, "p": student_t_sf(t, df)}


def _flat(res: dict[str, Any]) -> dict[str, Any]:
    env = res.get("environment") or {}
    row = {k: res.get(k) for k in CSV_FIELDS}
    row["device"] = env.get("device")
    for k in ("git_commit", "torch", "transformers", "date_utc"):
        row[k] = env.get(k)
    return row


def _fmt(vals: list[float], digits: int) -> str:
    if not vals:
        return "-"
    if len(vals) == 1:
        return f"{vals[0]:.{digits}f} (n=1)"
    return f"{statistics.fmean(vals):.{digits}f} ± {statistics.stdev(vals):.{digits}f}"


def _lr(x: float) -> str:
    return f"{x:g}"


BEST_LR_RULE = (
    "best learning rate = the one with the lowest mean validation loss over seeds (final train loss where a run has "
    "no validation set), among the learning rates at which the most seeds of that optimizer finished (a learning "
    "rate where a seed failed or diverged cannot win on fewer seeds); a NaN or inf loss counts as worst. The same "
    "validation runs pick the learning rate and are reported, so the best cell is slightly optimistic for every "
    "optimizer alike"
)


def _loss_key(r: dict[str, Any]) -> float:
    v = r.get("validation_loss")
    if v is None:
        v = r.get("final_train_loss")
    return v if v is not None and math.isfinite(v) else math.inf


def best_learning_rates(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each optimizer's best learning rate by :data:`BEST_LR_RULE`.

    Returns ``{optimizer: {"lr": best, "by_lr": {lr: mean loss}, "seeds": n, "metric": name}}`` for every optimizer
    with at least one finished run.
    """
    out: dict[str, dict[str, Any]] = {}
    ok = [r for r in results if r.get("status") == "ok"]
    for o in dict.fromkeys(r["optimizer"] for r in ok):
        runs = [r for r in ok if r["optimizer"] == o]
        by_lr: dict[float, list[float]] = {}
        for r in runs:
            by_lr.setdefault(r["learning_rate"], []).append(_loss_key(r))
        most = max(len(v) for v in by_lr.values())
        means = {lr: (statistics.fmean(v) if all(map(math.isfinite, v)) else math.inf) for lr, v in by_lr.items()}
        eligible = [lr for lr, v in by_lr.items() if len(v) == most]
        lr = min(eligible, key=lambda x: (means[x], x))
        metric = "validation loss" if all(r.get("validation_loss") is not None for r in runs) else "final train loss"
        out[o] = {"lr": lr, "by_lr": dict(sorted(means.items())), "seeds": most, "metric": metric}
    return out


def paired_cell(a: dict[Any, float], b: dict[Any, float]) -> str:
    """``a`` minus ``b`` over the seeds both have (``{seed: loss}``), as a table cell: the mean difference, the paired
    test's p (marked when below :data:`ALPHA`) and the number of seeds, or "n too small" with fewer than two."""
    common = sorted(set(a) & set(b), key=str)
    pair = paired_t_test([a[s] for s in common], [b[s] for s in common])
    if pair is None:
        return f"n too small ({len(common)} common seed{'' if len(common) == 1 else 's'})"
    mark = " **significant**" if pair["p"] < ALPHA else ""
    return f"{pair['diff']:+.4f} (p = {pair['p']:.3g}{mark}, {len(common)} seeds)"


def _best_lr_section(results: list[dict[str, Any]], cfg: RecipeConfig, opts: list[str]) -> list[str]:
    """Each optimizer at its own best learning rate, and paired tests against the baseline at its best."""
    best = best_learning_rates(results)
    if not best or all(len(b["by_lr"]) < 2 for b in best.values()):
        return []
    ok = [r for r in results if r.get("status") == "ok"]
    base = cfg.compare.baseline
    lines = [
        "## Each optimizer at its best learning rate",
        "",
        f"Rule: {BEST_LR_RULE}. A single shared learning rate favours whichever optimizer's effective step suits it "
        "(quantized states and rounding change the effective step size), so the comparison that matters is best "
        "against best.",
        "",
        "| optimizer | learning rates tried (mean loss) | best lr | seeds | final train loss | val loss | "
        f"Δ val loss vs `{base}` at its best (paired p) |",
        "|---|---|---|---|---|---|---|",
    ]
    base_runs = {}
    if base in best:
        base_runs = {r["seed"]: r for r in ok if r["optimizer"] == base and r["learning_rate"] == best[base]["lr"]}
    for o in opts:
        if o not in best:
            continue
        b = best[o]
        runs = [r for r in ok if r["optimizer"] == o and r["learning_rate"] == b["lr"]]
        tried = ", ".join(
            f"{_lr(lr)} ({m:.4f})" if math.isfinite(m) else f"{_lr(lr)} (diverged)" for lr, m in b["by_lr"].items()
        )
        vals = [r["validation_loss"] for r in runs if r.get("validation_loss") is not None]
        test = "-"
        if o != base and base_runs:
            test = paired_cell(_by_seed(runs, "validation_loss"), _by_seed(base_runs.values(), "validation_loss"))
        lines.append(
            f"| {optimizer_label(o)} (`{o}`) | {tried} | {_lr(b['lr'])} | {b['seeds']} | "
            f"{_fmt([r['final_train_loss'] for r in runs], 4)} | {_fmt(vals, 4)} | {test} |"
        )
    lines.append("")
    return lines


def _bracket(b: dict[str, Any]) -> str:
    """Whether the best learning rate has a tried rate on both sides (else the optimum may lie outside the grid)."""
    tried = sorted(b["by_lr"])
    if len(tried) == 1:
        return "one lr tried"
    if b["lr"] == tried[-1]:
        return "no: highest tried"
    if b["lr"] == tried[0]:
        return "no: lowest tried"
    return "yes"


def _headline(results: list[dict[str, Any]], cfg: RecipeConfig, opts: list[str]) -> list[str]:
    """The table that leads the summary: per optimizer its state, step time and validation loss, at its best lr."""
    best = best_learning_rates(results)
    if not best:
        return []
    ok = [r for r in results if r.get("status") == "ok"]
    base = cfg.compare.baseline
    base_runs = []
    if base in best:
        base_runs = [r for r in ok if r["optimizer"] == base and r["learning_rate"] == best[base]["lr"]]
    lines = [
        "## Each optimizer at its best learning rate, at a glance",
        "",
        "State = bytes of `optimizer.state`; optimizer step ms and steps/s at the best lr; best lr bracketed = a "
        "learning rate on each side of it was tried and was worse (the rule and every rate tried: the next sections).",
        "",
        "| optimizer | optimizer state (MiB) | bytes/param | optimizer step ms | steps/s | best lr | bracketed | "
        f"val loss at best lr | Δ vs `{base}` at its best (paired p) |",
        "|---|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for o in opts:
        if o not in best:
            continue
        b = best[o]
        runs = [r for r in ok if r["optimizer"] == o and r["learning_rate"] == b["lr"]]
        states = sorted({round(r["optimizer_state_mib"], 3) for r in runs})
        state = f"{states[0]:.3f}" if len(states) == 1 else _fmt([r["optimizer_state_mib"] for r in runs], 3)
        bpp = sorted({round(r["train_bytes_per_param"], 2) for r in runs if r.get("train_bytes_per_param")})
        ms = [r["optimizer_step_ms"] for r in runs if r.get("optimizer_step_ms")]
        vals = [r["validation_loss"] for r in runs if r.get("validation_loss") is not None]
        test = "-"
        if o != base and base_runs:
            test = paired_cell(_by_seed(runs, "validation_loss"), _by_seed(base_runs, "validation_loss"))
        lines.append(
            f"| {optimizer_label(o)} (`{o}`) | {state} | {', '.join(f'{x:.2f}' for x in bpp) or '-'} | "
            f"{_fmt(ms, 3) if ms else '-'} | {_fmt([r['steps_per_s'] for r in runs], 2)} | {_lr(b['lr'])} | "
            f"{_bracket(b)} | {_fmt(vals, 4) if vals else '-'} | {test} |"
        )
    lines.append("")
    return lines


def _timing_note(meta: dict[str, Any] | None, gpu: bool) -> list[str]:
    """How the headline's times were taken, next to them: on a CPU, runs at a time and load change them, and can
    change the optimizers' order (a step that needs every core waits for the other run's threads)."""
    if not meta or gpu:
        return []
    jobs, cpus = meta.get("jobs", 1), meta.get("cpu_count") or 1
    load = max(meta.get("loadavg_1min_start", 0.0), meta.get("loadavg_1min_end", 0.0))
    how = (
        f"Timed on the CPU with {jobs} run{'s' if jobs > 1 else ''} at a time on {cpus} cores, 1-min load average "
        f"{meta.get('loadavg_1min_start')} at the start and {meta.get('loadavg_1min_end')} at the end."
    )
    if jobs > 1 or load > 0.75 * cpus:
        how += (
            " **The runs shared the cores** (with each other or with other work): optimizer step ms and steps/s "
            "include waiting for a core and can order the optimizers differently than each alone. For step times "
            "alone: `apexw-compare --jobs 1` on an idle machine, or `python benchmarks/bench_cpu_step.py` (the "
            "optimizer step only, every optimizer interleaved in one process)."
        )
    return ["", how]


def summarize(results: list[dict[str, Any]], cfg: RecipeConfig, meta: dict[str, Any] | None = None) -> str:
    """The markdown summary: header, table shaped like the published one, significance statements."""
    ok = [r for r in results if r.get("status") == "ok"]
    lrs = list(dict.fromkeys(cfg.compare.learning_rates))
    opts = list(dict.fromkeys(cfg.compare.optimizers + [r["optimizer"] for r in results]))
    gpu = any(r.get("peak_gpu_mem_allocated_gib") is not None for r in ok)
    per_param = any(r.get("train_bytes_per_param") is not None for r in ok)
    lines = _summary_header(results, ok, cfg, meta, gpu, per_param)
    head_lines = _headline(results, cfg, opts)
    if head_lines:
        head_lines[-1:-1] = _timing_note(meta, gpu)
    lines += head_lines
    lines += _runs_table(results, ok, lrs, opts, gpu, per_param)
    lines += ["", *_best_lr_section(results, cfg, opts), *_significance(results, cfg, lrs, opts)]
    return "\n".join(lines) + "\n"


def _summary_header(
    results: list[dict[str, Any]],
    ok: list[dict[str, Any]],
    cfg: RecipeConfig,
    meta: dict[str, Any] | None,
    gpu: bool,
    per_param: bool,
) -> list[str]:
    """The summary's title and the bullet list of what ran where (devices, versions, commit, grid, columns)."""
    envs = [r.get("environment") or {} for r in ok]
    devices = sorted({e.get("device", "?") for e in envs})
    backends = sorted({r.get("backend", "?") for r in ok})
    steps = sorted({r.get("global_steps") for r in ok})
    seeds = sorted({r["seed"] for r in results})
    commits = sorted({f"{e.get('git_commit')} (source sha256 {e.get('source_sha256')})" for e in envs})
    dates = sorted({str(e.get("date_utc", ""))[:10] for e in envs})
    versions = sorted({f"torch {e.get('torch')}, transformers {e.get('transformers')}" for e in envs})
    lines = [
        f"# Optimizer comparison: `{cfg.name}`",
        "",
        f"{cfg.description}".strip(),
        "",
        f"- device: {', '.join(devices) or '-'}; backend: {', '.join(backends) or '-'}; precision: "
        f"{', '.join(sorted({str(r.get('precision')) for r in ok})) or '-'}",
        f"- fine-tuning: {', '.join(sorted({str(r.get('finetuning', 'lora')) for r in ok})) or '-'}; trainable "
        f"parameters: {', '.join(sorted({str(r.get('trainable_params')) for r in ok})) or '-'}",
        f"- optimizer steps per run: {', '.join(map(str, steps)) or '-'}; seeds: {seeds}; data: "
        f"{', '.join(sorted({str(r.get('data_source')) for r in ok})) or '-'}",
        f"- {'; '.join(versions) or '-'}; git commit {', '.join(commits) or '-'}; date {', '.join(dates) or '-'}",
        "- cells: mean ± sample std over seeds (n = seeds that ran). Final train loss = mean of the last "
        f"{cfg.train.final_loss_window} logged training losses; validation loss = held-out set after training; "
        "steps/s = Trainer's train_steps_per_second (whole run, warm-up included).",
    ]
    if any(r.get("optimizer_step_ms") is not None for r in results):
        lines.append(
            "- optimizer step ms = median time of `optimizer.step()` inside the training loop, first 10% of steps "
            "left out (CUDA events around it on a GPU: the GPU's time from the step's first to its last kernel, "
            "host gaps included; wall clock on the CPU)."
        )
    if meta:
        lines.append(
            f"- grid: {meta['runs']} runs in {meta['wall_seconds']:.0f} s wall, process start-ups included "
            f"({meta['jobs']} at a time, {meta['cpu_count']} CPUs, 1-min load average "
            f"{meta['loadavg_1min_start']} at the start, {meta['loadavg_1min_end']} at the end)"
            + (
                "; **the grid was interrupted**: only the runs that finished are reported"
                if meta.get("interrupted")
                else ""
            )
        )
        if meta.get("devices"):
            share = meta.get("runs_per_device", 1)
            lines.append(
                f"- GPUs {meta['devices']}, each seed's runs on one GPU; "
                + (
                    f"up to {share} runs shared a GPU at a time, so steps/s were measured under sharing (the same "
                    "mix of optimizers on every GPU); peak memory is per process"
                    if share > 1
                    else "one run at a time per GPU"
                )
            )
    if gpu:
        lines.append("- peak GPU mem = `torch.cuda.max_memory_allocated()` over the whole run, model load included.")
    else:
        lines.append(
            "- no GPU: the memory column is the run process's peak resident set size (CPU RAM, Python and "
            "libraries included), not GPU memory."
        )
    if per_param:
        lines.append(
            "- bytes/param = (trainable parameters + their gradients + optimizer state) / trainable parameters: what "
            "training keeps per parameter before activations (gradients have the parameter's dtype)."
        )
    lines.append("")
    return lines


def _runs_table(
    results: list[dict[str, Any]], ok: list[dict[str, Any]], lrs: list, opts: list[str], gpu: bool, per_param: bool
) -> list[str]:
    """Every run per learning rate: one row per optimizer, mean +- std over seeds (``ok``: the runs that finished)."""
    mem_h = "peak GPU mem allocated (GiB)" if gpu else "peak RSS (GiB, CPU)"
    lines = []
    lines += ["## Every run, per learning rate", ""]
    # runs stored before the reserved figure was recorded have no such key: the column appears when some run has it
    reserved = gpu and any(r.get("peak_gpu_mem_reserved_gib") is not None for r in ok)
    head = ["optimizer", mem_h] + (["peak GPU mem reserved (GiB)"] if reserved else []) + ["optimizer state (MiB)"]
    head += (["bytes/param"] if per_param else []) + [f"steps/s ({_lr(lrs[0])})"]
    step_ms = any(r.get("optimizer_step_ms") is not None for r in results)
    if step_ms:
        head.append(f"optimizer step ms ({_lr(lrs[0])})")
    for lr in lrs:
        head += [f"final train loss {_lr(lr)}", f"val loss {_lr(lr)}"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for o in opts:
        mine = [r for r in results if r["optimizer"] == o]
        runs = [r for r in mine if r.get("status") == "ok"]
        label = optimizer_label(o)
        if not runs:
            why = "; ".join(sorted({f"{r.get('status')}: {r.get('reason', '')}" for r in mine})) or "not run"
            lines.append(f"| {label} (`{o}`) | {why} |" + " |" * (len(head) - 2))
            continue
        mem = [r["peak_gpu_mem_allocated_gib" if gpu else "peak_rss_gib"] for r in runs]
        state = sorted({round(r["optimizer_state_mib"], 3) for r in runs})
        state_s = f"{state[0]:.3f}" if len(state) == 1 else _fmt([r["optimizer_state_mib"] for r in runs], 3)
        sps = [r["steps_per_s"] for r in runs if r["learning_rate"] == lrs[0]]
        row = [f"{label} (`{o}`)", _fmt(mem, 3)]
        if reserved:
            row.append(_fmt([x for r in runs if (x := r.get("peak_gpu_mem_reserved_gib")) is not None], 3))
        row.append(state_s)
        if per_param:
            bpp = sorted({round(r["train_bytes_per_param"], 3) for r in runs if r.get("train_bytes_per_param")})
            row.append(", ".join(f"{x:.3f}" for x in bpp) or "-")
        row.append(_fmt(sps, 3))
        if step_ms:
            at0 = [r["optimizer_step_ms"] for r in runs if r["learning_rate"] == lrs[0] and r.get("optimizer_step_ms")]
            row.append(_fmt(at0, 3) if at0 else "-")
        for lr in lrs:
            at = [r for r in runs if r["learning_rate"] == lr]
            row += [
                _fmt([r["final_train_loss"] for r in at], 4),
                _fmt([r["validation_loss"] for r in at if r.get("validation_loss") is not None], 4),
            ]
        bad = [r for r in mine if r.get("status") != "ok"]
        if bad:
            row[0] += f" ({len(bad)} run(s) {', '.join(sorted({r.get('status') for r in bad}))})"
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _by_seed(runs: list[dict[str, Any]], key: str) -> dict[Any, float]:
    return {r["seed"]: r[key] for r in runs if r.get(key) is not None}


def _significance(results: list[dict[str, Any]], cfg: RecipeConfig, lrs: list[float], opts: list[str]) -> list[str]:
    base = cfg.compare.baseline
    out = [
        f"## Significance against `{base}` (two-sided, α = {ALPHA}, per learning rate)",
        "",
        "Losses: paired t-test over seeds (a seed fixes the data order and, for LoRA, the adapters' initialisation; "
        "every run of a grid starts from the same base weights; so the same seed under two optimizers is a matched "
        "pair), with Welch's unpaired test beside it; steps/s: Welch. Δ = optimizer minus baseline.",
        "",
    ]
    ok = [r for r in results if r.get("status") == "ok"]
    if not any(r["optimizer"] == base for r in ok):
        return out + [f"No test: the baseline `{base}` has no successful runs.", ""]
    metrics = [
        ("final train loss", "final_train_loss", True),
        ("validation loss", "validation_loss", True),
        ("steps/s", "steps_per_s", False),
    ]
    significant, tested = [], 0
    for lr in lrs:
        ref_runs = [r for r in ok if r["optimizer"] == base and r["learning_rate"] == lr]
        for o in opts:
            runs = [r for r in ok if r["optimizer"] == o and r["learning_rate"] == lr]
            if o == base or not runs:
                continue
            parts = []
            for name, k, paired in metrics:
                a, b = _by_seed(runs, k), _by_seed(ref_runs, k)
                welch = welch_t_test(list(a.values()), list(b.values()))
                common = sorted(set(a) & set(b), key=str)
                pair = paired_t_test([a[s] for s in common], [b[s] for s in common]) if paired else None
                primary = pair if paired else welch
                if primary is None:
                    parts.append(
                        f"{name}: n too small (n={len(common) if paired else len(a)} vs "
                        f"{len(common) if paired else len(b)}), no test"
                    )
                    continue
                tested += 1
                sig = primary["p"] < ALPHA
                if sig:
                    significant.append(f"{o} {name} @ lr {_lr(lr)} (Δ {primary['diff']:+.4g}, p = {primary['p']:.3g})")
                mark = " **significant**" if sig else ""
                if paired:
                    txt = f"{name} Δ {primary['diff']:+.4g} (paired p = {pair['p']:.3g}{mark}, {len(common)} seeds"
                    txt += f"; Welch p = {welch['p']:.3g})" if welch else ")"
                else:
                    txt = (
                        f"{name} Δ {primary['diff']:+.4g} (Welch t = {welch['t']:.2f}, df = {welch['df']:.1f}, "
                        f"p = {welch['p']:.3g}{mark})"
                    )
                parts.append(txt)
            out.append(f"- `{o}` vs `{base}`, lr {_lr(lr)}: " + "; ".join(parts))
    out.append("")
    if tested == 0:
        out.append("**Conclusion: n too small for any test (need at least 2 seeds per optimizer and learning rate).**")
    elif significant:
        out.append(
            f"**Conclusion: {len(significant)} of {tested} comparisons differ significantly at α = {ALPHA}: "
            + "; ".join(significant)
            + ".** No correction for multiple comparisons: about one in twenty "
            "comparisons of equal optimizers comes out 'significant' by chance."
        )
    else:
        out.append(
            f"**Conclusion: none of the {tested} comparisons differs significantly from `{base}` at α = "
            f"{ALPHA}.** With few seeds only large differences would be detected; this is absence of evidence, "
            "not proof of equality."
        )
    out.append("")
    return out


def write_csv(results: list[dict[str, Any]], path: Path) -> None:
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in results:
            w.writerow(_flat(r))


def _smooth(ys: list[float], k: int) -> list[float]:
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= k:
            acc -= ys[i - k]
        out.append(acc / min(i + 1, k))
    return out


def _plot_optimizer(
    ax, dax, curves: list[dict], pairs: list[tuple[dict, dict]], label: str, diff_label: str, color: str, smooth: int
) -> None:
    """One optimizer in one panel: its mean training loss over seeds with the min-max band and the validation loss
    (``ax``), and its mean difference from the baseline on the same seeds (``dax``, from ``pairs``: (run, baseline
    run))."""
    n = min(len(r["loss_curve"]) for r in curves)
    steps = [st for st, _ in curves[0]["loss_curve"][:n]]
    per_seed = [_smooth([loss for _, loss in r["loss_curve"][:n]], smooth) for r in curves]
    mean = [statistics.fmean(c[i] for c in per_seed) for i in range(n)]
    ax.plot(steps, mean, label=label, lw=1.3, color=color)
    if len(per_seed) > 1:
        ax.fill_between(
            steps,
            [min(c[i] for c in per_seed) for i in range(n)],
            [max(c[i] for c in per_seed) for i in range(n)],
            color=color,
            alpha=0.12,
        )
    vals = [r["validation_loss"] for r in curves if r.get("validation_loss") is not None]
    if vals:
        ax.errorbar(
            [steps[-1]],
            [statistics.fmean(vals)],
            yerr=[statistics.stdev(vals) if len(vals) > 1 else 0],
            fmt="o",
            color=color,
            ms=5,
            capsize=3,
        )
    if pairs:
        m = min(n, *(len(b["loss_curve"]) for _, b in pairs))
        diffs = [
            _smooth(
                [a - b for (_, a), (_, b) in zip(r["loss_curve"][:m], br["loss_curve"][:m], strict=True)],
                smooth,
            )
            for r, br in pairs
        ]
        dax.plot(
            steps[:m],
            [statistics.fmean(d[i] for d in diffs) for i in range(m)],
            color=color,
            lw=1.2,
            label=diff_label,
        )


def plot_curves(results: list[dict[str, Any]], cfg: RecipeConfig, path: Path, smooth: int = 5) -> None:
    """Top row: training loss per optimizer (mean over seeds, min-max band, dot = validation loss). Bottom row: the
    difference from the baseline on the same seed, averaged over seeds (the curves on top overlap when the
    optimizers agree; this shows by how much they differ)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.get("status") == "ok" and r.get("loss_curve")]
    lrs = list(dict.fromkeys(cfg.compare.learning_rates))
    opts = [
        o
        for o in dict.fromkeys(cfg.compare.optimizers + [r["optimizer"] for r in ok])
        if any(r["optimizer"] == o for r in ok)
    ]
    colors = {o: f"C{i % 10}" for i, o in enumerate(opts)}
    base = cfg.compare.baseline
    # one panel per shared learning rate, and one with every optimizer at its own best learning rate
    panels = [(f"lr {_lr(lr)}", {o: lr for o in opts}) for lr in lrs]
    best = best_learning_rates(results)
    if any(len(b["by_lr"]) > 1 for b in best.values()):
        panels.append(("each optimizer at its best lr", {o: best[o]["lr"] for o in opts if o in best}))
    fig, axes = plt.subplots(
        2,
        len(panels),
        figsize=(6.5 * len(panels), 7.5),
        squeeze=False,
        sharex="col",
        gridspec_kw={"height_ratios": [3, 2]},
    )
    for col, (title, lr_of) in enumerate(panels):
        ax, dax = axes[0][col], axes[1][col]
        base_runs = {r["seed"]: r for r in ok if r["optimizer"] == base and r["learning_rate"] == lr_of.get(base)}
        for o in opts:
            curves = [r for r in ok if r["optimizer"] == o and r["learning_rate"] == lr_of.get(o)]
            if not curves:
                continue
            best_col = col >= len(lrs)
            label = f"{optimizer_label(o)} (n={len(curves)}" + (f", lr {_lr(lr_of[o])})" if best_col else ")")
            pairs = [(r, base_runs[r["seed"]]) for r in curves if r["seed"] in base_runs and o != base]
            _plot_optimizer(
                ax, dax, curves, pairs, label, f"{optimizer_label(o)} (n={len(pairs)} seeds)", colors[o], smooth
            )
        ax.set_title(f"{cfg.name}: {title}")
        ax.set_ylabel(f"training loss (moving average of {smooth})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        dax.axhline(0.0, color="k", lw=0.8)
        dax.set_xlabel("optimizer step")
        dax.set_ylabel(f"loss minus {optimizer_label(base)}, same seed")
        dax.grid(alpha=0.3)
        if dax.lines[1:]:
            dax.legend(fontsize=8)
    fig.suptitle(
        "top: mean over seeds (band: min-max; dot: final validation loss)\n"
        "bottom: difference from the baseline on the same seed, mean over seeds",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_reports(results: list[dict[str, Any]], cfg: RecipeConfig, out: Path) -> str:
    """Write results.csv, summary.md and loss_curves.png under ``out``; return the markdown summary."""
    write_csv(results, out / "results.csv")
    meta_path = out / "grid_meta.json"
    md = summarize(results, cfg, json.loads(meta_path.read_text()) if meta_path.is_file() else None)
    (out / "summary.md").write_text(md)
    plot_curves(results, cfg, out / "loss_curves.png")
    return md
