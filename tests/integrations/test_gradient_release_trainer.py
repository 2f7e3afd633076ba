"""Gradient release through the stack on CPU: transformers' Trainer, TRL's SFTTrainer and a plain Accelerate loop.

A full fine-tune of the tiny Llama (tied embedding and output layer, norms without weight decay: two param groups).
"""

from __future__ import annotations

import json
import math
import shutil
from types import SimpleNamespace

import pytest
import torch

from apexw_hf import ApexW4bit, ApexW8bit
from apexw_hf.accounting import unwrap_optimizer

from .tiny import make_model, make_trainer, text_dataset, token_dataset, train_kwargs

BUCKET = 4000  # gradient elements per launch: the tiny Llama's ~21,000 go in several buckets per backward


class NormProbe:
    """The true pre-clip global gradient norm of every backward pass of ``model``.

    Its ``register_post_accumulate_grad_hook`` on each parameter is registered before the optimizer's (which the
    Trainer builds in ``train()``), so it runs first and sees each complete gradient before it is clipped and freed.
    """

    def __init__(self, model):
        self.sums: list[float] = []
        self._seen: set[int] = set()
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, p):
        if not self.sums or id(p) in self._seen:  # the first gradient of a new backward pass
            self.sums.append(0.0)
            self._seen = set()
        self._seen.add(id(p))
        self.sums[-1] += float(p.grad.double().square().sum())

    @property
    def norms(self) -> list[float]:
        return [math.sqrt(s) for s in self.sums]


def _train(out_dir, name, model=None, resume_from=None, **overrides):
    kw = dict(optim=name, weight_decay=0.1, max_steps=4)
    kw.update(overrides)
    trainer = make_trainer(out_dir, model=model or make_model(lora=False), **kw)
    trainer.train(resume_from_checkpoint=resume_from)
    return trainer


def _logged(trainer, key):
    return {h["step"]: h[key] for h in trainer.state.log_history if key in h}


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing_buckets"])
def test_release_name_is_bit_identical_to_the_plain_name(tmp_path, checkpointing):
    """max_grad_norm=0 (no clipping): optim="apexw_8bit_release" trains exactly as "apexw_8bit", and logs the same
    gradient norms (computed by the optimizer instead of by clip_grad_norm_, so equal to rounding). Once as is (one
    bucket per backward), once with the Trainer's gradient checkpointing and several buckets per backward."""
    kw = dict(max_grad_norm=0, gradient_checkpointing=checkpointing)
    plain = _train(tmp_path / "a", "apexw_8bit", **kw)
    optim_args = "engine=torch" + (f",release_bucket_size={BUCKET}" if checkpointing else "")
    released = _train(tmp_path / "b", "apexw_8bit_release", optim_args=optim_args, **kw)
    opt = unwrap_optimizer(released.optimizer)
    assert type(opt) is ApexW8bit and opt.gradient_release and opt._release.max_grad_norm is None
    assert opt._release.flushes >= (4 * 3 if checkpointing else 4)
    assert len(opt.param_groups) == 2 and {g["weight_decay"] for g in opt.param_groups} == {0.1, 0.0}
    a, b = dict(plain.model.named_parameters()), dict(released.model.named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    initial = dict(make_model(lora=False).named_parameters())
    assert all(not torch.equal(initial[n], b[n]) for n in b)
    assert released.model.is_gradient_checkpointing == checkpointing
    assert all(p.grad is None for p in released.model.parameters())
    assert _logged(plain, "loss") == _logged(released, "loss")
    norms_a, norms_b = _logged(plain, "grad_norm"), _logged(released, "grad_norm")
    assert sorted(norms_b) == [1, 2, 3, 4] and all(v > 0 for v in norms_b.values())
    assert [norms_b[s] for s in norms_a] == pytest.approx(list(norms_a.values()), rel=1e-5)


def test_tied_grad_offload_through_the_trainer_is_bit_identical(tmp_path, monkeypatch):
    """optim_args="tied_grad_offload=true": Accelerate's backward hands the loss and the model to the optimizer, the
    output layer's part of the tied embedding's gradient is offloaded every step (on CPU a copy stands in for the
    pinned host buffer), and training is bit-identical to the plain name's."""
    from apexw_hf.optim import tied_offload

    monkeypatch.setattr(tied_offload, "_offloadable", lambda t: t.is_contiguous())
    kw = dict(max_grad_norm=0, gradient_checkpointing=True)
    plain = _train(tmp_path / "a", "apexw_8bit", **kw)
    optim_args = f"engine=torch,release_bucket_size={BUCKET},tied_grad_offload=true"
    released = _train(tmp_path / "b", "apexw_8bit_release", optim_args=optim_args, **kw)
    opt = unwrap_optimizer(released.optimizer)
    assert released.model.config.tie_word_embeddings and opt._release.offload.offloaded == 4
    a, b = dict(plain.model.named_parameters()), dict(released.model.named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert _logged(plain, "loss") == _logged(released, "loss")
    with pytest.raises(ValueError, match="tied_grad_offload is for gradient release"):
        _train(tmp_path / "c", "apexw_8bit", optim_args="tied_grad_offload=true")


def test_release_with_clipping_logs_the_true_grad_norm(tmp_path):
    """max_grad_norm=1.0 (the Trainer's default) reaches the optimizer, which clips in backward; the logged grad_norm
    of each step is the pre-clip global norm of that step's gradients, never 0."""
    model = make_model(lora=False)
    probe = NormProbe(model)
    optim_args = f"engine=torch,release_bucket_size={BUCKET}"
    trainer = _train(tmp_path, "apexw_8bit_release", model=model, max_grad_norm=1.0, optim_args=optim_args)
    assert unwrap_optimizer(trainer.optimizer)._release.max_grad_norm == 1.0
    logged = _logged(trainer, "grad_norm")
    assert sorted(logged) == [1, 2, 3, 4] and len(probe.norms) == 4
    assert all(v > 1.0 for v in logged.values()), "the test needs norms above max_grad_norm: clipping active"
    assert [logged[s] for s in (1, 2, 3, 4)] == pytest.approx(probe.norms, rel=1e-5)


@pytest.mark.parametrize(
    "setting, message",
    [
        ({"gradient_accumulation_steps": 2}, "gradient_accumulation_steps=2"),
        ({"fp16": True}, "fp16=True"),
    ],
    ids=["accumulation", "fp16"],
)
@pytest.mark.parametrize(
    "optim",
    [("apexw_8bit_release", "engine=torch"), ("apexw_4bit", "engine=torch,gradient_release=true")],
    ids=["release_name", "optim_args"],
)
def test_release_refuses_settings_when_arguments_are_built(tmp_path, setting, message, optim):
    from transformers import TrainingArguments

    name, optim_args = optim
    with pytest.raises(ValueError, match=message) as info:
        TrainingArguments(**train_kwargs(tmp_path, optim=name, optim_args=optim_args, **setting))
    assert "gradient release" in str(info.value)
    # the way out names what to change: the name without _release, or the optim_args item (not the current setting)
    if name.endswith("_release"):
        assert "without release (optim='apexw_8bit')" in str(info.value)
    else:
        assert "without release (drop gradient_release=true from optim_args)" in str(info.value)
        assert f"(optim={name!r})" not in str(info.value)


def test_release_resume_equals_unbroken_run(tmp_path):
    """Resume from the step-2 checkpoint with clipping on: the same losses, logged norms, parameters and state as the
    unbroken run (the optimizer's state dict carries the previous step's norm and partial sums its clipping uses;
    without them, the control, the resumed run's first step is clipped otherwise)."""
    kw = dict(
        max_steps=4,
        save_strategy="steps",
        save_steps=2,
        max_grad_norm=1.0,
        optim_args=f"engine=torch,release_bucket_size={BUCKET}",
    )
    unbroken = _train(tmp_path / "a", "apexw_8bit_release", **kw)
    checkpoint = tmp_path / "a" / "checkpoint-2"
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert saved["gradient_release"]["prev_grad_norm"] > 0 and saved["gradient_release"]["prev_partial_sumsq"]
    assert json.loads(saved["param_groups"][0]["gradient_release_state"]) == saved["gradient_release"]
    resumed = _train(tmp_path / "b", "apexw_8bit_release", resume_from=str(checkpoint), **kw)
    for key in ("loss", "grad_norm"):
        a, b = _logged(unbroken, key), _logged(resumed, key)
        assert sorted(a) == sorted(b) == [1, 2, 3, 4]
        assert all(a[s] == b[s] for s in (3, 4)), (key, a, b)
    a, b = dict(unbroken.model.named_parameters()), dict(resumed.model.named_parameters())
    assert all(torch.equal(a[n], b[n]) for n in a)
    oa, ob = unwrap_optimizer(unbroken.optimizer), unwrap_optimizer(resumed.optimizer)
    for pa, pb in zip(a.values(), b.values()):
        sa, sb = oa.state[pa], ob.state[pb]
        assert sorted(sa) == sorted(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert torch.equal(oa.grad_norm, ob.grad_norm)

    control = tmp_path / "control-2"
    shutil.copytree(checkpoint, control)
    del saved["gradient_release"]
    for group in saved["param_groups"]:
        group.pop("gradient_release_state", None)
    torch.save(saved, control / "optimizer.pt")
    forgetful = _train(tmp_path / "c", "apexw_8bit_release", resume_from=str(control), **kw)
    assert any(not torch.equal(p, q) for p, q in zip(unbroken.model.parameters(), forgetful.model.parameters()))


def test_sft_trainer_full_finetune_with_release(tmp_path, tokenizer):
    pytest.importorskip("triton", reason="TRL's SFTTrainer loss needs Triton")
    from trl import SFTConfig, SFTTrainer

    model = make_model(lora=False)
    before = [p.detach().clone() for p in model.parameters()]
    config = SFTConfig(
        **train_kwargs(tmp_path, optim="apexw_4bit_release", max_steps=4, bf16=False),
        max_length=32,
        dataset_text_field="text",
        packing=False,
    )
    trainer = SFTTrainer(model=model, args=config, train_dataset=text_dataset(), processing_class=tokenizer)
    trainer.train()
    opt = unwrap_optimizer(trainer.optimizer)
    assert type(opt) is ApexW4bit and opt.gradient_release and opt._release.max_grad_norm == 1.0
    assert all(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    assert all(p.grad is None for p in trainer.model.parameters())
    losses, norms = _logged(trainer, "loss"), _logged(trainer, "grad_norm")
    assert len(losses) == 4 and losses[4] < losses[1]
    assert len(norms) == 4 and all(math.isfinite(v) and v > 0 for v in norms.values())


def _batch():
    ids = torch.tensor([row["input_ids"] for row in token_dataset(4)])
    return {"input_ids": ids, "labels": ids}


def test_accelerate_loop_clip_grad_norm_returns_the_optimizers_norm():
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = make_model(lora=False)
    probe = NormProbe(model)
    opt = ApexW8bit(model.parameters(), lr=1e-2, engine="torch", gradient_release=True, max_grad_norm=1.0)
    model, opt = accelerator.prepare(model, opt)
    for _ in range(2):
        accelerator.backward(model(**_batch()).loss)
        assert all(p.grad is None for p in model.parameters())
        norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
        assert float(norm) == pytest.approx(probe.norms[-1], rel=1e-5) and float(norm) > 1.0
        assert float(accelerator.clip_grad_norm_(model.parameters(), float("inf"))) == float(norm)
        opt.step()
        opt.zero_grad()
    assert len(probe.norms) == 2


def test_accelerate_clip_grad_norm_after_a_backward_without_gradients_is_zero():
    """A backward pass that reaches no parameter (a loss of frozen parts only) has no gradient to clip:
    ``clip_grad_norm_`` returns 0 as torch's does over no gradients, not the last step's norm, so the Trainer's
    ``grad_norm`` log is not a stale value; the next step's norm is its own."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = make_model(lora=False)
    opt = ApexW8bit(model.parameters(), lr=1e-2, engine="torch", gradient_release=True, max_grad_norm=1.0)
    model, opt = accelerator.prepare(model, opt)
    accelerator.backward(model(**_batch()).loss)
    first = float(accelerator.clip_grad_norm_(model.parameters(), 1.0))
    opt.step()
    opt.zero_grad()
    accelerator.backward(model(**_batch()).loss.detach().requires_grad_())  # reaches no parameter
    assert float(accelerator.clip_grad_norm_(model.parameters(), 1.0)) == 0.0 != first
    opt.step()
    opt.zero_grad()
    accelerator.backward(model(**_batch()).loss)
    assert float(accelerator.clip_grad_norm_(model.parameters(), 1.0)) > 0


def test_accelerate_loop_goes_on_after_a_backward_pass_that_raised():
    """A backward pass raises halfway (as out of memory would), after the last layer's tensors were released: the next
    ``accelerator.backward`` gives up that unfinished step with a warning (no zero_grad needed, as when a notebook
    re-runs ``trainer.train()``), and training goes on with every gradient released in backward."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = make_model(lora=False)
    opt = ApexW8bit(model.parameters(), lr=1e-2, engine="torch", gradient_release=True, release_bucket_size=2000)
    model, opt = accelerator.prepare(model, opt)
    armed = [True]

    def fail_once(module, grad_input, grad_output):
        if armed[0]:
            armed[0] = False
            raise RuntimeError("simulated out of memory")

    handle = model.model.layers[1].register_full_backward_hook(fail_once)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(RuntimeError, match="simulated out of memory"):
        accelerator.backward(model(**_batch()).loss)
    moved = {n for n, p in model.named_parameters() if not torch.equal(before[n], p)}
    assert "model.layers.1.mlp.down_proj.weight" in moved and "model.layers.0.mlp.down_proj.weight" not in moved
    with pytest.warns(UserWarning, match="previous backward pass raised"):
        accelerator.backward(model(**_batch()).loss)
    assert all(p.grad is None for p in model.parameters())
    opt.step()
    opt.zero_grad()
    accelerator.backward(model(**_batch()).loss)  # no warning: that step finished
    assert all(p.grad is None for p in model.parameters())
    opt.step()
    handle.remove()


def test_accelerate_loop_refuses_a_max_norm_the_optimizer_was_not_built_with():
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = make_model(lora=False)
    before = [p.detach().clone() for p in model.parameters()]
    opt = ApexW8bit(model.parameters(), lr=1e-2, engine="torch", gradient_release=True)
    model, opt = accelerator.prepare(model, opt)
    accelerator.backward(model(**_batch()).loss)
    with pytest.raises(ValueError, match=r"max_grad_norm=None.*max_grad_norm=1\.0"):
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
    assert float(accelerator.clip_grad_norm_(model.parameters(), float("inf"))) > 0  # the norm, nothing clipped
    opt.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_release_refuses_fsdp_version_1_and_contradicting_optim_args(tmp_path):
    """Refused when the arguments are built: FSDP1 (its flat parameters are reduce-scattered outside the per-parameter
    hooks) and a _release name with gradient_release=false in optim_args."""
    from transformers import TrainingArguments

    with pytest.raises(ValueError, match="FSDP2 only.*version 1"):
        TrainingArguments(**train_kwargs(tmp_path, optim="apexw_8bit_release", fsdp=True, fsdp_config={"version": 1}))
    with pytest.raises(ValueError, match="gradient_release=false.*'apexw_8bit'"):
        TrainingArguments(**train_kwargs(tmp_path, optim="apexw_8bit_release", optim_args="gradient_release=false"))


def test_accelerate_backward_refuses_what_release_cannot_do():
    """Accelerator.backward's checks, before any update, on stand-ins for the accelerator: fp16's GradScaler, gradient
    accumulation, DDP (MULTI_CPU) and FSDP version 1; FSDP2 and one process pass."""
    from accelerate.utils import DistributedType

    from apexw_hf.integrations.accelerate import _check_backward

    ok = dict(scaler=None, gradient_accumulation_steps=1, distributed_type=DistributedType.NO, is_fsdp2=False)
    _check_backward(SimpleNamespace(**ok), [])
    _check_backward(SimpleNamespace(**{**ok, "distributed_type": DistributedType.FSDP, "is_fsdp2": True}), [])
    for change, message in [
        ({"scaler": object()}, "fp16"),
        ({"gradient_accumulation_steps": 2}, "gradient_accumulation_steps=2"),
        ({"distributed_type": DistributedType.MULTI_CPU}, "DDP"),
        ({"distributed_type": DistributedType.FSDP}, "FSDP2 only, not FSDP version 1"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            _check_backward(SimpleNamespace(**{**ok, **change}), [])
