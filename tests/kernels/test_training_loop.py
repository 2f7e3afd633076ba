"""The kernels inside a real training loop: GradScaler (with a skipped inf step), gradient clipping, gradient
accumulation and an lr schedule give the same bits on engine="triton" as on engine="torch"."""

import pytest
import torch

from apexw_hf.optim import ApexW

from .helpers import DEVICE, mismatch, same_bits


def _run(engine, fmt, dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3)).to(DEVICE)
    opt = ApexW(
        [
            {"params": [model[0].weight, model[2].weight], "weight_decay": 0.01},
            {"params": [model[0].bias, model[2].bias], "weight_decay": 0.0, "lr": 2e-3},
        ],
        lr=3e-3,
        state_format=fmt,
        engine=engine,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1.0 + 0.3 * t))
    scaler = torch.amp.GradScaler(torch.device(DEVICE).type, init_scale=2.0**10)
    gen = torch.Generator().manual_seed(1)
    skipped = 0
    for step in range(6):
        for micro in range(2):  # gradient accumulation over two micro-batches
            x = torch.randn(8, 12, generator=gen).to(DEVICE)
            y = torch.randn(8, 3, generator=gen).to(DEVICE)
            with torch.autocast(device_type=torch.device(DEVICE).type, dtype=dtype):
                loss = torch.nn.functional.mse_loss(model(x).float(), y) / 2
            if step == 3 and micro == 1:
                loss = loss * float("inf")  # an overflow: the scaler must skip this step
            scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scale_before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped += scaler.get_scale() < scale_before
        sched.step()
        opt.zero_grad()
    return model, opt, skipped


@pytest.mark.parametrize("fmt", ["compact", "8bit", "4bit"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_grad_scaler_clipping_accumulation_schedule(fmt, dtype):
    m_torch, o_torch, skipped = _run("torch", fmt, dtype)
    m_triton, o_triton, _ = _run("triton", fmt, dtype)
    assert skipped == 1, "the inf step must be skipped by the scaler"
    steps = {int(s["step"].item()) for s in o_triton.state.values()}
    assert steps == {5}, "6 iterations, one skipped"
    for a, b in zip(m_torch.parameters(), m_triton.parameters()):
        assert same_bits(a.detach(), b.detach()), mismatch(a.detach(), b.detach())
        for key, value in o_torch.state[a].items():
            assert same_bits(value, o_triton.state[b][key]), key
