"""Statistics and the markdown table: Welch's test against known values, the table's shape, skipped rows."""

import math
import re

import pytest

from apexw_hf.recipe.config import load_config
from apexw_hf.recipe.report import paired_t_test, student_t_sf, summarize, welch_t_test


def _t_tail_closed_form(t, df):
    """Two-sided tail of Student's t for df = 1, 2, 3 (closed forms), an oracle independent of the beta function."""
    t = abs(t)
    if df == 1:
        return 1 - 2 / math.pi * math.atan(t)
    if df == 2:
        return 1 - t / math.sqrt(t * t + 2)
    x = t / math.sqrt(3)
    return 1 - 2 / math.pi * (x / (1 + x * x) + math.atan(x))


def _t_tail_numeric(t, df, n=20000):
    """Two-sided tail by Simpson integration of the t density over [0, |t|] (works for fractional df)."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    f = lambda x: c * (1 + x * x / df) ** (-(df + 1) / 2)
    h = abs(t) / n
    area = f(0) + f(abs(t)) + sum((4 if i % 2 else 2) * f(i * h) for i in range(1, n))
    return 1 - 2 * area * h / 3


@pytest.mark.parametrize("df", [1, 2, 3])
@pytest.mark.parametrize("t", [0.0, 0.2255, 1.0, 2.5, -4.303])
def test_t_tail_matches_closed_forms(t, df):
    assert student_t_sf(t, df) == pytest.approx(_t_tail_closed_form(t, df), abs=1e-9)


@pytest.mark.parametrize(("t", "df"), [(1.2572, 3.806), (2.0, 10.0), (0.3, 4.7), (6.0, 1.5)])
def test_t_tail_matches_numeric_integration(t, df):
    assert student_t_sf(t, df) == pytest.approx(_t_tail_numeric(t, df), abs=1e-7)


def test_welch_statistic_and_degrees_of_freedom():
    r = welch_t_test([1, 2, 3], [2, 3, 4.5])
    # by hand: means 2 and 3.1667, variances 1 and 1.5833; se^2 = 1/3 + 1.5833/3
    se2 = 1 / 3 + (19 / 12) / 3
    assert r["t"] == pytest.approx((2 - 19 / 6) / math.sqrt(se2), rel=1e-12)
    assert r["df"] == pytest.approx(se2**2 / ((1 / 3) ** 2 / 2 + ((19 / 12) / 3) ** 2 / 2), rel=1e-12)
    assert r["p"] == pytest.approx(_t_tail_numeric(r["t"], r["df"]), abs=1e-7)
    assert welch_t_test([1.0], [1.0, 2.0]) is None
    same = welch_t_test([1.0, 1.0], [2.0, 2.0])
    assert same["p"] == 0.0 and math.isinf(same["t"])


def _run(opt, lr, seed, loss, val, state):
    return {
        "status": "ok",
        "optimizer": opt,
        "learning_rate": lr,
        "seed": seed,
        "final_train_loss": loss,
        "validation_loss": val,
        "steps_per_s": 1.0 + 0.01 * seed,
        "optimizer_state_mib": state,
        "peak_gpu_mem_allocated_gib": 2.5,
        "global_steps": 100,
        "loss_curve": [[1, 3.0], [2, loss]],
        "environment": {"device": "NVIDIA H200", "torch": "x", "transformers": "y"},
        "precision": "bf16",
        "backend": "unsloth",
        "data_source": "shipped",
    }


def test_summary_table_shape_significance_and_skips():
    cfg = load_config("offline_default", ["compare.learning_rates=[0.0002, 0.00005]", "compare.seeds=[0, 1, 2]"])
    res = []
    for s in range(3):
        for lr in (2e-4, 5e-5):
            res.append(_run("adamw_torch", lr, s, 1.0 + 0.01 * s, 1.1 + 0.01 * s, 185.501))
            res.append(_run("apexw_8bit", lr, s, 1.0 + 0.01 * s + 0.001, 1.1 + 0.01 * s, 47.101))
            res.append(_run("apexw_compact", lr, s, 2.0 + 0.01 * s, 2.1 + 0.01 * s, 92.751))  # clearly worse
            res.append(
                {
                    "status": "skipped",
                    "reason": "bitsandbytes is not installed",
                    "optimizer": "adamw_8bit",
                    "learning_rate": lr,
                    "seed": s,
                }
            )
    md = summarize(res, cfg)
    # the summary leads with each optimizer at its best lr: state, step time, validation loss, bracketing
    glance = md[md.index("## Each optimizer at its best learning rate, at a glance") : md.index("## Every run")]
    head = next(line for line in glance.splitlines() if line.startswith("| optimizer"))
    assert head.split(" | ")[1:4] == ["optimizer state (MiB)", "bytes/param", "optimizer step ms"]
    row8 = next(line for line in glance.splitlines() if "(`apexw_8bit`)" in line)
    assert "| 47.101 |" in row8 and "| 5e-05 | no: lowest tried |" in row8  # two lrs, best at the lower one
    assert "`adamw_8bit`" not in glance  # skipped everywhere: no best lr
    table = md[md.index("## Every run") :]
    header = next(line for line in table.splitlines() if line.startswith("| optimizer"))
    for col in (
        "peak GPU mem",
        "optimizer state (MiB)",
        "steps/s (0.0002)",
        "final train loss 0.0002",
        "val loss 0.0002",
        "final train loss 5e-05",
        "val loss 5e-05",
    ):
        assert col in header
    assert "47.101" in md and "185.501" in md and "92.751" in md
    assert "skipped: bitsandbytes is not installed" in md
    assert "1.0100 ± 0.0100" in md  # mean ± std over the three seeds
    sig = md[md.index("## Significance") :]
    line_c = next(x for x in sig.splitlines() if x.startswith("- `apexw_compact` vs `adamw_torch`, lr 0.0002"))
    assert re.search(r"final train loss Δ \+1 \(paired p = [0-9.e-]+ \*\*significant\*\*, 3 seeds; Welch p = ", line_c)
    line8 = next(x for x in sig.splitlines() if x.startswith("- `apexw_8bit` vs `adamw_torch`, lr 0.0002"))
    # a constant +0.001 on every seed: the paired test sees it (p = 0), Welch's drowns it in seed noise
    assert re.search(
        r"final train loss Δ \+0.001 \(paired p = [0-9.e-]+ \*\*significant\*\*, 3 seeds; Welch p = 0.908\)", line8
    )
    assert "validation loss Δ +0 (paired p = 1, 3 seeds; Welch p = 1)" in line8
    assert "steps/s Δ +0 (Welch t = 0.00, df = 4.0, p = 1)" in line8
    assert "**Conclusion:" in sig and "apexw_compact final train loss @ lr 0.0002" in sig


def test_paired_test_by_hand():
    # differences -0.1, 0.1, -0.3, 0.2: mean -0.025, sd 0.2217, t = -0.2255 with 3 degrees of freedom
    r = paired_t_test([1.0, 2.1, 2.9, 4.2], [1.1, 2.0, 3.2, 4.0])
    assert r["df"] == 3 and r["t"] == pytest.approx(-0.22549, abs=1e-5)
    assert r["p"] == pytest.approx(_t_tail_closed_form(r["t"], 3), abs=1e-9)
    assert paired_t_test([1.0], [2.0]) is None


def test_single_seed_says_n_too_small():
    cfg = load_config("offline_default", ["compare.learning_rates=[0.005]", "compare.seeds=[0]"])
    md = summarize([_run("adamw_torch", 0.005, 0, 1.0, 1.1, 1.0), _run("apexw_8bit", 0.005, 0, 1.0, 1.1, 0.5)], cfg)
    assert "n too small (n=1 vs 1)" in md and "n too small for any test" in md


def test_4bit_rows_are_labelled():
    cfg = load_config("offline_default", ["compare.learning_rates=[0.005]", "compare.seeds=[0, 1]"])
    res = [
        _run(o, 0.005, s, 1.0 + 0.01 * s, 1.1, mib)
        for s in (0, 1)
        for o, mib in (("adamw_torch", 1.0), ("apexw_4bit", 0.129))
    ]
    md = summarize(res, cfg)
    row = next(line for line in md.splitlines() if line.startswith("| ApexW 4bit (`apexw_4bit`)"))
    assert "0.129" in row
    assert "- `apexw_4bit` vs `adamw_torch`, lr 0.005" in md


def test_headline_says_whether_the_best_lr_is_bracketed():
    """The leading table marks a best learning rate at the edge of the grid (the optimum may lie outside it)."""
    cfg = load_config("offline_default", ["compare.learning_rates=[0.005, 0.01, 0.02]", "compare.seeds=[0, 1]"])
    val = {"adamw_torch": {0.005: 2.5, 0.01: 2.4, 0.02: 2.6}, "apexw_4bit": {0.005: 2.6, 0.01: 2.5, 0.02: 2.4}}
    cells = [(o, lr, v) for o, by in val.items() for lr, v in by.items()]
    res = [_run(o, lr, s, v + 0.01 * s, v + 0.01 * s, 1.0) for o, lr, v in cells for s in (0, 1)]
    glance = summarize(res, cfg).split("## Every run")[0]
    rows = {o: next(x for x in glance.splitlines() if f"(`{o}`)" in x) for o in val}
    assert "| 0.01 | yes |" in rows["adamw_torch"]
    assert "| 0.02 | no: highest tried |" in rows["apexw_4bit"]


@pytest.mark.parametrize(
    "jobs, load, shared",
    [(2, (1.0, 1.5), True), (1, (3.1, 5.2), True), (1, (0.2, 1.1), False)],
    ids=["two_at_a_time", "loaded_machine", "alone"],
)
def test_cpu_headline_says_how_it_was_timed(jobs, load, shared):
    """On a CPU the step times next to the headline say how many runs shared the cores and under what load, and
    warn when they were shared: there they can order the optimizers differently than each alone."""
    cfg = load_config("offline_default", ["compare.learning_rates=[0.01]", "compare.seeds=[0, 1]"])
    res = []
    for o in ("adamw_torch", "apexw_8bit"):
        for s in (0, 1):
            r = _run(o, 0.01, s, 2.0, 2.1, 1.0)
            r.update(peak_gpu_mem_allocated_gib=None, peak_rss_gib=0.5, optimizer_step_ms=1.0)
            res.append(r)
    meta = {"runs": 4, "wall_seconds": 10.0, "jobs": jobs, "cpu_count": 2}
    meta.update(loadavg_1min_start=load[0], loadavg_1min_end=load[1])
    glance = summarize(res, cfg, meta).split("## Every run")[0]
    assert (
        f"Timed on the CPU with {jobs} run" in glance
        and f"at a time on 2 cores, 1-min load average {load[0]}" in glance
    )
    assert ("**The runs shared the cores**" in glance) == shared
    assert ("benchmarks/bench_cpu_step.py" in glance) == shared
    # a GPU grid's times are not shared (its runs hold a lock per GPU): no note
    gpu = summarize(
        [_run(o, 0.01, s, 2.0, 2.1, 1.0) for o in ("adamw_torch", "apexw_8bit") for s in (0, 1)], cfg, meta
    )
    assert "Timed on the CPU" not in gpu
