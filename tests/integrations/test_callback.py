"""OptimizerStateCallback (console, log_history, TensorBoard event file) and the optimizer-state accounting."""

from __future__ import annotations

import pytest
import torch

from apexw_hf import ApexW4bit, ApexW8bit, ApexWCompact, optimizer_state_bytes
from apexw_hf.accounting import optimizer_param_count, unwrap_optimizer
from apexw_hf.integrations.callbacks import OptimizerStateCallback

from .tiny import make_trainer

KEYS = ("optimizer_state_mib", "optimizer_state_bytes_per_param")


def _read_scalars(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted(log_dir.rglob("events.out.tfevents.*"))
    assert files, f"no TensorBoard event file under {log_dir}"
    scalars = {}
    for f in files:
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return scalars


@pytest.mark.parametrize("how", ["callbacks_arg", "add_callback"])
def test_callback_reaches_console_history_and_tensorboard(tmp_path, capsys, how):
    pytest.importorskip("tensorboard")
    from transformers.integrations import TensorBoardCallback

    log_dir = tmp_path / "out"  # TensorBoard writes under output_dir/runs/ (transformers 4.57 to 5.x defaults)
    callback = OptimizerStateCallback()
    kw = {"callbacks": [callback]} if how == "callbacks_arg" else {}
    trainer = make_trainer(
        log_dir, rows=12, trainer_kwargs=kw, optim="apexw_8bit", max_steps=3, report_to=["tensorboard"]
    )
    if how == "add_callback":
        trainer.add_callback(callback)
    callbacks = trainer.callback_handler.callbacks
    assert callbacks[0] is callback
    assert any(isinstance(c, TensorBoardCallback) for c in callbacks)
    trainer.train()

    opt = unwrap_optimizer(trainer.optimizer)
    assert isinstance(opt, ApexW8bit)
    nbytes = opt.state_bytes()
    assert nbytes == optimizer_state_bytes(trainer.optimizer) > 0
    expected = {
        "optimizer_state_mib": nbytes / 2**20,
        "optimizer_state_bytes_per_param": nbytes / optimizer_param_count(opt),
    }

    train_logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in train_logs] == [1, 2, 3]
    for h in train_logs:
        for key in KEYS:
            assert h[key] == pytest.approx(expected[key], rel=1e-12)
    assert "peak_gpu_memory_gib" not in train_logs[0] or torch.cuda.is_available()

    console = capsys.readouterr().out
    assert console.count("'optimizer_state_mib'") >= 3 and "'optimizer_state_bytes_per_param'" in console

    scalars = _read_scalars(log_dir)
    for key in KEYS:
        values = scalars[f"train/{key}"]
        assert [s for s, _ in values][:3] == [1, 2, 3]
        assert all(v == pytest.approx(expected[key], rel=1e-6) for _, v in values)
    assert "train/loss" in scalars


def test_accounting_matches_torch_adamw_and_apexw():
    params = [torch.nn.Parameter(torch.randn(n)) for n in (10, 300, 1000)]
    opt = torch.optim.AdamW(params, foreach=False)
    for p in params:
        p.grad = torch.ones_like(p)
    assert optimizer_state_bytes(opt) == 0
    opt.step()
    n = sum(p.numel() for p in params)
    assert optimizer_state_bytes(opt) == 8 * n + 4 * len(params)  # fp32 moments + fp32 step counters
    assert optimizer_param_count(opt) == n

    for cls, per_param in ((ApexWCompact, 4), (ApexW8bit, 2), (ApexW4bit, 1)):
        apex = cls(params, engine="torch")
        apex.step()
        assert optimizer_state_bytes(apex) == apex.state_bytes()
        assert per_param * n <= apex.state_bytes() < (per_param + 1) * n


@pytest.mark.parametrize("name", ["apexw_4bit", "apexw_8bit"])
def test_callback_logs_the_exact_state_bytes(tmp_path, name):
    """The logged MiB and bytes per parameter are the exact bytes of the format's tensors: per trainable tensor of n
    elements, the codes (4bit: n bytes for both moments; 8bit: 2n), two scales per block (8bit format version 3: a bf16
    m scale and an fp32 v scale per 256 elements; 4bit format version 3: two fp32 scales per 128) and the fp32 step."""
    trainer = make_trainer(
        tmp_path, rows=8, trainer_kwargs={"callbacks": [OptimizerStateCallback()]}, optim=name, max_steps=2
    )
    trainer.train()
    sizes = [p.numel() for p in trainer.model.parameters() if p.requires_grad]
    codes, block, scale_bytes = {"apexw_4bit": (1, 128, 4 + 4), "apexw_8bit": (2, 256, 2 + 4)}[name]
    nbytes = sum(codes * n + scale_bytes * -(-n // block) + 4 for n in sizes)
    assert unwrap_optimizer(trainer.optimizer).state_bytes() == nbytes
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2
    for h in logs:
        assert h["optimizer_state_mib"] == nbytes / 2**20
        assert h["optimizer_state_bytes_per_param"] == nbytes / sum(sizes)


def test_accounting_unwraps_and_dedupes():
    p = torch.nn.Parameter(torch.zeros(8))
    q = torch.nn.Parameter(torch.zeros(8))
    opt = torch.optim.SGD([p, q], lr=0.1)
    shared = torch.zeros(256)
    opt.state[p]["qmap"] = shared  # bitsandbytes-style map referenced from every parameter's state
    opt.state[q]["qmap"] = shared
    opt.state[q]["pair"] = (torch.zeros(3, dtype=torch.int8), [torch.zeros(2, dtype=torch.bfloat16)])
    assert optimizer_state_bytes(opt) == 2 * 1024 + 3 + 4
    assert optimizer_state_bytes(opt, unique=True) == 1024 + 3 + 4

    class Wrapper:  # accelerate's AcceleratedOptimizer keeps the real optimizer in .optimizer
        def __init__(self, inner):
            self.optimizer = inner

    assert optimizer_state_bytes(Wrapper(Wrapper(opt))) == optimizer_state_bytes(opt)
    with pytest.raises(TypeError, match="not an optimizer"):
        optimizer_state_bytes(object())


def test_accounting_sees_through_tensor_subclasses():
    """torchao keeps quantized states as tensor subclasses: count the plain tensors inside, not the fake dtype."""

    class Packed(torch.Tensor):
        @staticmethod
        def __new__(cls, codes, scale, shape):
            return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32, device=codes.device)

        def __init__(self, codes, scale, shape):
            self.codes, self.scale = codes, scale

        def __tensor_flatten__(self):
            return ["codes", "scale"], {}

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise NotImplementedError

    p = torch.nn.Parameter(torch.zeros(512))
    opt = torch.optim.SGD([p], lr=0.1)
    opt.state[p]["exp_avg"] = Packed(torch.zeros(512, dtype=torch.uint8), torch.zeros(2), (512,))
    assert optimizer_state_bytes(opt) == 512 + 8


@pytest.mark.gpu
def test_accounting_of_real_8bit_baselines():
    bnb = pytest.importorskip("bitsandbytes")
    if not torch.cuda.is_available():
        pytest.skip("bitsandbytes 8-bit optimizers need a GPU")
    p = torch.nn.Parameter(torch.randn(4096 * 4, device="cuda"))
    opt = bnb.optim.AdamW8bit([p])
    p.grad = torch.randn_like(p)
    opt.step()
    # uint8 moments + fp32 absmax per 256 + two 256-entry fp32 maps (+ step); the published table's accounting
    assert optimizer_state_bytes(opt) >= 2 * p.numel() + 2 * 4 * p.numel() // 256 + 2 * 1024
