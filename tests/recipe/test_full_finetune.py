"""The full fine-tune comparison: grid plan with parameter dtypes and per-optimizer learning-rate sweeps, the best-lr
rule, the memory accounting, the report, and a tiny grid end to end through `apexw-compare`."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from apexw_hf.recipe.compare import plan_grid
from apexw_hf.recipe.config import config_from_dict, load_config, optimizer_label, split_optimizer_spec
from apexw_hf.recipe.report import best_learning_rates, summarize

ROOT = Path(__file__).resolve().parents[2]


def test_offline_full_plan_has_every_dtype_and_the_sweeps():
    cfg = load_config("offline_full")
    assert cfg.train.finetuning == "full"
    grid = plan_grid(cfg)
    cells = {(c["optim"], c["lr"]) for c in grid}
    shared = set(cfg.compare.learning_rates)
    swept = {o: set(v) for o, v in cfg.compare.lr_sweep.items()}
    assert cells == {(o, lr) for o in cfg.compare.optimizers for lr in shared | swept.get(o, set())}
    assert len(grid) == len(cells) * len(cfg.compare.seeds) and len({c["name"] for c in grid}) == len(grid)
    dtypes = {split_optimizer_spec(o)[1] for o in cfg.compare.optimizers}
    assert dtypes == {"fp32", "bf16"} and cfg.compare.baseline == "adamw_torch@fp32"
    # the H200 grid names the same cells with torch's fused AdamW as the reference
    gpu = load_config(str(ROOT / "configs/llama32_1b_full_h200.yaml"))
    assert gpu.train.max_steps >= 1000 and gpu.model.gradient_checkpointing and gpu.model.build["vocab_size"] == 128256
    names = {o.replace("adamw_torch_fused", "adamw_torch") for o in gpu.compare.optimizers}
    assert set(cfg.compare.optimizers) <= names and len(names) == 9
    assert {"apexw_8bit_release@bf16", "apexw_4bit_release@bf16"} <= names
    for big in ("llama32_3b_full_h200", "llama31_8b_full_h200"):  # gradient release + Liger, vs torch @fp32
        c = load_config(str(ROOT / "configs" / f"{big}.yaml"))
        assert c.train.use_liger_kernel and c.train.gradient_accumulation_steps == 1
        assert c.compare.baseline == "adamw_torch_fused@fp32" and c.model.build["vocab_size"] == 128256
        # the tied 3B embedding's gradient part waits in host memory in the release cells (8B is untied)
        tied = c.model.build["tie_word_embeddings"]
        want = {o: "tied_grad_offload=true" for o in c.compare.optimizers if "_release" in o} if tied else {}
        assert c.compare.optim_args == want and (not tied or want)


def test_docs_tables_are_generated_from_the_stored_results():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_full_finetune_report.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_optimizer_specs_and_their_errors():
    assert split_optimizer_spec("apexw_8bit@bf16") == ("apexw_8bit", "bf16")
    assert split_optimizer_spec("adamw_torch") == ("adamw_torch", None)
    assert optimizer_label("apexw_8bit@bf16") == "ApexW 8bit, bf16 params"
    with pytest.raises(ValueError, match="GradScaler refuses fp16 gradients"):
        split_optimizer_spec("apexw_8bit@fp16")
    with pytest.raises(ValueError, match="DTYPE one of fp32, bf16"):
        split_optimizer_spec("apexw_8bit@int8")
    base = {"model": {"name_or_path": "m"}}
    for raw, match in (
        ({"train": {"finetuning": "lora", "param_dtype": "bf16"}}, "applies to full fine-tuning"),
        ({"train": {"finetuning": "partial"}}, "allowed: lora, full"),
        ({"train": {"optim": "apexw_8bit@bf16"}}, "give the parameter dtype as train.param_dtype"),
        ({"compare": {"optimizers": ["a@fp32"], "lr_sweep": {"b@fp32": [0.1]}}}, "not in compare.optimizers"),
        ({"compare": {"optimizers": ["a"], "lr_sweep": {"a": [-1.0]}}}, "positive learning rates"),
        ({"compare": {"optimizers": ["a@fp32"], "optim_args": {"b@fp32": "x=1"}}}, "optim_args names \\['b@fp32'\\]"),
        ({"compare": {"optimizers": ["a"], "optim_args": {"a": ""}}}, "expected a non-empty 'key=value,...' string"),
    ):
        with pytest.raises(ValueError, match=match):
            config_from_dict({**base, **raw})


def _r(opt, lr, seed, val, train=None, status="ok"):
    return {
        "status": status,
        "optimizer": opt,
        "learning_rate": lr,
        "seed": seed,
        "validation_loss": val,
        "final_train_loss": val + 0.1 if train is None else train,
        "steps_per_s": 1.0,
        "optimizer_state_mib": 1.0,
        "peak_rss_gib": 0.5,
        "global_steps": 10,
        "loss_curve": [[1, 3.0], [2, val]],
        "environment": {"device": "cpu", "torch": "x", "transformers": "y"},
        "precision": "fp32",
        "backend": "transformers",
        "data_source": "shipped",
        "finetuning": "full",
        "train_bytes_per_param": 6.016,
    }


def test_best_lr_rule():
    res = [
        *[_r("a", 1e-3, s, 1.0 + 0.01 * s) for s in range(3)],
        *[_r("a", 3e-3, s, 0.9 + 0.01 * s) for s in range(3)],  # lower mean: best
        *[_r("b", 1e-3, s, 1.0) for s in range(3)],
        # the lowest single loss, but one seed failed there: fewer seeds cannot win
        _r("b", 3e-3, 0, 0.5),
        _r("b", 3e-3, 1, 0.5),
        _r("b", 3e-3, 2, 0.0, status="failed"),
        *[_r("c", 1e-3, s, 1.2) for s in range(2)],
        _r("c", 3e-3, 0, 0.1),
        _r("c", 3e-3, 1, math.nan),  # diverged: that lr counts as worst
    ]
    best = best_learning_rates(res)
    assert best["a"]["lr"] == 3e-3 and best["a"]["seeds"] == 3 and best["a"]["metric"] == "validation loss"
    assert best["a"]["by_lr"] == pytest.approx({1e-3: 1.01, 3e-3: 0.91})
    assert best["b"]["lr"] == 1e-3
    assert best["c"]["lr"] == 1e-3 and best["c"]["by_lr"][3e-3] == math.inf
    # no validation set: the final train loss decides, and the rule says so
    no_val = [_r("d", lr, s, None, train=t) for lr, t in ((1e-3, 2.0), (3e-3, 1.5)) for s in range(2)]
    for r in no_val:
        r["validation_loss"] = None
    assert best_learning_rates(no_val)["d"] == {
        "lr": 3e-3,
        "by_lr": {1e-3: 2.0, 3e-3: 1.5},
        "seeds": 2,
        "metric": "final train loss",
    }


def test_report_has_best_lr_section_and_memory_columns():
    cfg = load_config(
        "offline_full",
        [
            "compare.optimizers=[adamw_torch@fp32, adamw_torch@bf16, apexw_8bit@bf16]",
            "compare.learning_rates=[0.001]",
            "compare.lr_sweep={adamw_torch@fp32: [0.003], adamw_torch@bf16: [0.003], apexw_8bit@bf16: [0.003]}",
            "compare.seeds=[0, 1, 2]",
        ],
    )
    res = []
    for s in range(3):
        res += [_r("adamw_torch@fp32", 1e-3, s, 1.30 + 0.01 * s), _r("adamw_torch@fp32", 3e-3, s, 1.20 + 0.01 * s)]
        res += [_r("adamw_torch@bf16", 1e-3, s, 1.60 + 0.01 * s), _r("adamw_torch@bf16", 3e-3, s, 1.50 + 0.01 * s)]
        res += [_r("apexw_8bit@bf16", 1e-3, s, 1.21 + 0.01 * s), _r("apexw_8bit@bf16", 3e-3, s, 1.40 + 0.011 * s)]
    md = summarize(res, cfg)
    header = next(line for line in md.splitlines() if line.startswith("| optimizer | peak"))
    assert "bytes/param" in header and "reserved" not in header  # CPU rows: no GPU memory columns
    sec = md[md.index("## Each optimizer at its best learning rate") :]
    lines = [line for line in sec.splitlines() if line.startswith("| ") and "(`" in line]
    rows = {line.split("(`")[1].split("`)")[0]: line for line in lines}
    assert "| 0.003 | 3 |" in rows["adamw_torch@fp32"] and "| 0.001 | 3 |" in rows["apexw_8bit@bf16"]
    # at each one's best: bf16 torch is 0.3 worse on every seed (significant), ApexW 0.01 worse on every seed
    assert "+0.3000 (p = " in rows["adamw_torch@bf16"] and "**significant**" in rows["adamw_torch@bf16"]
    assert "+0.0100 (p = " in rows["apexw_8bit@bf16"]
    # GPU rows add the reserved-memory column (runs stored before it was recorded leave it out, see test_report.py)
    for r in res:
        r["environment"]["device"] = "NVIDIA H200"
        r["peak_gpu_mem_allocated_gib"], r["peak_gpu_mem_reserved_gib"] = 10.0, 12.5
    md = summarize(res, cfg)
    header = next(line for line in md.splitlines() if line.startswith("| optimizer | peak"))
    assert "peak GPU mem allocated (GiB)" in header and "peak GPU mem reserved (GiB)" in header
    assert "12.500 ± 0.000" in md


def test_training_memory_counts_params_grads_and_state_once():
    from transformers import LlamaConfig, LlamaForCausalLM

    from apexw_hf import ApexW8bit
    from apexw_hf.recipe.finetune import training_memory

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.model.norm.weight.requires_grad_(False)  # a frozen tensor counts in total_params only
    opt = ApexW8bit([p for p in model.parameters() if p.requires_grad], lr=1e-3, engine="torch")
    model(torch.arange(8).view(1, 8), labels=torch.arange(8).view(1, 8)).loss.backward()
    opt.step()
    mem = training_memory(model, opt)
    trainable = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in trainable)
    assert mem["total_params"] == n + 32  # the tied embedding once, the frozen norm
    assert mem["trainable_param_dtypes"] == ["bfloat16"]
    assert mem["trainable_param_bytes"] == mem["grad_bytes"] == 2 * n
    assert mem["train_bytes_per_param"] == (4 * n + opt.state_bytes()) / n


def test_trainable_dtype_check_accepts_only_unsloths_fp32_norms():
    """A run whose trainable parameters are not all of its dtype fails, except the fp32 RMSNorm weights that
    Unsloth's full fine-tuning loads (recorded); a bf16 run that got an fp32 weight matrix fails under Unsloth too."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from apexw_hf.recipe.finetune import check_trainable_dtypes

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    assert check_trainable_dtypes(model, "bf16", "transformers") is None
    assert check_trainable_dtypes(model, "bf16", "unsloth") is None
    with pytest.raises(RuntimeError, match=r"asked for fp32 parameters, but .* are \['bfloat16'\]"):
        check_trainable_dtypes(model, "fp32", "transformers")
    norms = [m for n, m in model.named_modules() if n.endswith("norm")]
    for m in norms:
        m.float()
    assert len(norms) == 5  # 2 layers x (input, post-attention) + the final norm
    assert check_trainable_dtypes(model, "bf16", "unsloth") == {"tensors": 5, "elements": 5 * 32}
    with pytest.raises(RuntimeError, match=r"something in the training stack cast them \(e\.g\. model\.layers\.0\."):
        check_trainable_dtypes(model, "bf16", "transformers")
    model.model.layers[0].mlp.down_proj.float()
    with pytest.raises(RuntimeError, match="down_proj.weight torch.float32"):
        check_trainable_dtypes(model, "bf16", "unsloth")
    model.model.layers[0].mlp.down_proj.weight.requires_grad_(False)  # frozen: not checked
    assert check_trainable_dtypes(model, "bf16", "unsloth") == {"tensors": 5, "elements": 5 * 32}


def test_tiny_full_grid_end_to_end(tmp_path):
    out = tmp_path / "full"
    cmd = [
        sys.executable, "-m", "apexw_hf.recipe.compare", "offline_full",
        "--optimizers", "adamw_torch@fp32,apexw_8bit@bf16",
        "--lrs", "5e-3", "--seeds", "0", "--jobs", "2", "--output-dir", str(out),
        "--set", "compare.lr_sweep={apexw_8bit@bf16: [0.01]}",
        "--set", "compare.baseline=adamw_torch@fp32",
        "--set", "compare.optim_args={apexw_8bit@bf16: 'engine=torch,state_format=4bit'}",
        "--set", "train.max_steps=6", "--set", "data.num_samples=48", "--set", "data.validation_samples=16",
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "(full fine-tuning)" in proc.stdout and "= 3 runs" in proc.stdout
    runs = {}
    for p in (out / "runs").glob("*/result.json"):
        r = json.loads(p.read_text())
        runs[(r["optimizer"], r["learning_rate"])] = r
    assert set(runs) == {("adamw_torch@fp32", 5e-3), ("apexw_8bit@bf16", 5e-3), ("apexw_8bit@bf16", 1e-2)}
    for (spec, _), r in runs.items():
        assert r["status"] == "ok", r
        dtype = spec.split("@")[1]
        assert r["finetuning"] == "full" and r["param_dtype"] == dtype and r["optim"] == spec.split("@")[0]
        assert r["trainable_param_dtypes"] == [{"fp32": "float32", "bf16": "bfloat16"}[dtype]]
        assert r["trainable_params"] == r["total_params"]  # every parameter trains
        # compare.optim_args reach that cell's TrainingArguments, and only its
        assert r.get("optim_args") == ("engine=torch,state_format=4bit" if spec == "apexw_8bit@bf16" else None)
        n, size = r["trainable_params"], {"fp32": 4, "bf16": 2}[dtype]
        assert r["trainable_param_bytes"] == r["grad_bytes"] == size * n
        assert r["train_bytes_per_param"] == pytest.approx((2 * size * n + r["optimizer_state_bytes"]) / n)
    assert runs[("adamw_torch@fp32", 5e-3)]["train_bytes_per_param"] == pytest.approx(16.0, abs=0.01)
    # its optim_args took the optimizer to 4-bit state: ~1.06 bytes per parameter (8-bit's ~2.03)
    apexw = runs[("apexw_8bit@bf16", 5e-3)]
    assert 1.0 < apexw["optimizer_state_bytes"] / apexw["trainable_params"] < 1.2
    md = (out / "summary.md").read_text()
    assert "ApexW 8bit, bf16 params (`apexw_8bit@bf16`)" in md and "## Each optimizer at its best learning rate" in md
    assert "bytes/param" in md and "fine-tuning: full" in md
    # the report can be rebuilt from the stored runs alone
    (out / "summary.md").unlink()
    proc = subprocess.run(cmd + ["--report-only"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "summary.md").read_text() == md


def test_training_memory_counts_no_gradients_under_gradient_release():
    import torch

    from apexw_hf import ApexW8bit
    from apexw_hf.recipe.finetune import training_memory

    model = torch.nn.Linear(64, 32, dtype=torch.bfloat16)
    kept = training_memory(model, ApexW8bit(model.parameters()))
    released = training_memory(model, ApexW8bit(model.parameters(), gradient_release=True))
    n = sum(p.numel() for p in model.parameters())
    assert kept["grad_bytes"] == 2 * n and released["grad_bytes"] == 0 and released["gradient_release"]
    assert kept["train_bytes_per_param"] - released["train_bytes_per_param"] == 2.0
