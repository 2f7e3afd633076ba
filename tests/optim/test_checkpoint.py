"""state_dict / load_state_dict: exact resume, dtypes kept, weights_only loading, torch AdamW conversion."""

import io
from pathlib import Path

import pytest
import torch

from apexw_hf import ApexW, ApexW8bit
from apexw_hf import reference as ref
from apexw_hf.optim import state as st

from .helpers import FORMATS, make_grads, run_steps


def _roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _params(dtype):
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in [(33, 65), (257,), (1,)]]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_resume_is_bit_identical(fmt, dtype):
    grads = [[g.to(dtype) for g in make_grads(s, 8, i)] for i, s in enumerate([(33, 65), (257,), (1,)])]
    kw = dict(lr=1e-2, weight_decay=0.1, state_format=fmt, seed=11)

    unbroken = _params(dtype)
    run_steps(ApexW(unbroken, **kw), unbroken, grads)

    first = _params(dtype)
    opt = ApexW(first, **kw)
    run_steps(opt, first, [g[:5] for g in grads])
    sd = _roundtrip(opt.state_dict())
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    opt2 = ApexW(resumed, lr=1.0, state_format="fp32")  # hyperparameters and format come from the state dict
    opt2.load_state_dict(sd)
    for p_first, p in zip(first, resumed):
        for key, value in opt.state[p_first].items():
            got = opt2.state[p][key]
            assert got.dtype == value.dtype and got.device == value.device and torch.equal(got, value), key
    run_steps(opt2, resumed, [g[5:] for g in grads])
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for a, b in zip(unbroken, resumed):
        assert torch.equal(a.detach().view(bits), b.detach().view(bits))


def test_state_dict_holds_only_tensors_and_plain_values():
    ps = _params(torch.float32)
    opt = ApexW(ps, state_format="8bit")
    run_steps(opt, ps, [make_grads(p.shape, 1, i) for i, p in enumerate(ps)])
    sd = _roundtrip(opt.state_dict())  # weights_only=True raises on anything else
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale"}
    assert sd["param_groups"][0]["state_format"] == "8bit"


@pytest.mark.parametrize("fmt", FORMATS)
def test_load_torch_adamw_state_dict_converts_moments(fmt):
    shape = (40, 70)
    grads = make_grads(shape, 20, 3)
    p_torch = torch.nn.Parameter(torch.randn(shape))
    p_ours = torch.nn.Parameter(p_torch.detach().clone())
    topt = torch.optim.AdamW([p_torch], lr=1e-2, weight_decay=0.0)
    run_steps(topt, [p_torch], [grads[:10]])
    opt = ApexW([p_ours], lr=1e-2, weight_decay=0.0, state_format=fmt)
    opt.load_state_dict(_roundtrip(topt.state_dict()))
    p_ours.data.copy_(p_torch.detach())
    assert opt.state[p_ours]["step"].item() == 10
    assert set(opt.param_groups[0]) >= {"state_format", "engine", "param_rounding", "seed"}
    assert "amsgrad" not in opt.param_groups[0]
    run_steps(topt, [p_torch], [grads[10:]])
    run_steps(opt, [p_ours], [grads[10:]])
    start = p_torch.detach() * 0  # compare the remaining 10 steps' movement
    moved = (p_torch.detach() - p_ours.detach()).norm() / (p_torch.detach() - start).norm()
    assert moved < {"fp32": 1e-6, "compact": 1e-3, "8bit": 5e-3}[fmt]


def test_format_change_on_load():
    p = torch.nn.Parameter(torch.randn(300))
    opt = ApexW([p], state_format="fp32")
    run_steps(opt, [p], [make_grads((300,), 3)])
    sd = opt.state_dict()
    sd["param_groups"][0]["state_format"] = "8bit"
    q = torch.nn.Parameter(p.detach().clone())
    opt2 = ApexW([q], state_format="fp32")
    opt2.load_state_dict(sd)
    assert opt2.state[q]["exp_avg"].dtype == torch.uint8
    m = opt.state[p]["exp_avg"]
    from apexw_hf import reference as ref

    m8 = ref.dequantize_m(opt2.state[q]["exp_avg"], opt2.state[q]["exp_avg_scale"])
    assert ((m8 - m).abs() <= torch.maximum(m.abs() / 8, m.abs().max() * 2.0**-16)).all()  # within one code


def test_load_rejects_mismatched_state_dicts():
    p = torch.nn.Parameter(torch.randn(10))
    opt = ApexW([p])
    with pytest.raises(ValueError, match=r"sizes \[2\] but this optimizer has \[1\]"):
        opt.load_state_dict({"state": {}, "param_groups": [{**opt.param_groups[0], "params": [0, 1]}]})
    bad = ApexW([torch.nn.Parameter(torch.randn(12))], state_format="8bit")
    bad.param_groups[0]["params"][0].grad = torch.randn(12)
    bad.step()
    p.grad = torch.randn(10)
    opt.step()
    before = {k: v.clone() for k, v in opt.state[p].items()}
    with pytest.raises(ValueError, match="shape"):
        opt.load_state_dict(bad.state_dict())
    assert all(torch.equal(opt.state[p][k], v) for k, v in before.items()), "a failed load must change nothing"
    with pytest.raises(ValueError, match="amsgrad"):
        t = torch.optim.AdamW([torch.nn.Parameter(torch.randn(10))], amsgrad=True)
        opt.load_state_dict(t.state_dict())


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_state_dict_loads_on_cpu_and_back(fmt):
    p = torch.nn.Parameter(torch.randn(1000, device="cuda"))
    opt = ApexW([p], state_format=fmt)
    run_steps(opt, [p], [[g.cuda() for g in make_grads((1000,), 3)]])
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True, map_location="cpu")
    q = torch.nn.Parameter(p.detach().cpu())
    cpu_opt = ApexW([q], state_format=fmt)
    cpu_opt.load_state_dict(sd)
    back = ApexW([p], state_format=fmt)
    back.load_state_dict(cpu_opt.state_dict())
    for key, value in opt.state[p].items():
        assert cpu_opt.state[q][key].device.type == "cpu" or key == "step"
        assert torch.equal(back.state[p][key].cpu(), value.cpu())


@pytest.mark.parametrize("fmt", FORMATS)
def test_load_torch_adamw_state_of_fp16_params(fmt):
    """torch.optim.AdamW keeps fp16 moments for fp16 parameters: they are converted into every format."""
    p_torch = torch.nn.Parameter(torch.randn(300).half())
    topt = torch.optim.AdamW([p_torch], lr=1e-3)
    run_steps(topt, [p_torch], [[g.half() for g in make_grads((300,), 3)]])
    assert topt.state[p_torch]["exp_avg"].dtype == torch.float16
    p = torch.nn.Parameter(p_torch.detach().clone())
    opt = ApexW([p], state_format=fmt)
    opt.load_state_dict(_roundtrip(topt.state_dict()))
    m = opt.state[p]["exp_avg"]
    assert m.dtype == {"fp32": torch.float32, "compact": torch.bfloat16, "8bit": torch.uint8}[fmt]
    if fmt != "8bit":
        assert torch.allclose(m.float(), topt.state[p_torch]["exp_avg"].float(), rtol=2**-7, atol=1e-6)


def test_conversion_source_of_the_wrong_shape_is_refused():
    p = torch.nn.Parameter(torch.randn(10))
    t = torch.optim.AdamW([torch.nn.Parameter(torch.randn(12))])
    run_steps(t, t.param_groups[0]["params"], [make_grads((12,), 1)])
    opt = ApexW([p], state_format="8bit")
    with pytest.raises(ValueError, match=r"exp_avg' for a parameter of shape \(10,\) is torch.float32 \(12,\)"):
        opt.load_state_dict(t.state_dict())
    assert not opt.state


V1_CHECKPOINT = Path(__file__).parent / "data" / "apexw8bit_v1_62a3659.pt"


def _load_v1():
    saved = torch.load(V1_CHECKPOINT, weights_only=True)
    params = [torch.nn.Parameter(t.clone()) for t in saved["params"]]
    return saved, params


def test_8bit_format_v1_checkpoint_is_converted_on_load():
    """A checkpoint of the first 8-bit format (int8 m codes; written by 62a3659) loads: its moments are decoded and
    re-encoded into the current codes, deterministically, within one current code step, and training goes on."""
    saved, params = _load_v1()
    v1 = saved["optimizer"]
    assert v1["state"][0]["exp_avg"].dtype == torch.int8
    assert st.state_format_of(v1["state"][0]) == "8bit_v1"
    opt = ApexW8bit(params, lr=1.0)  # hyperparameters come from the checkpoint
    opt.load_state_dict(v1)
    assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[0]["seed"] == 7
    for i, p in enumerate(params):
        s, old = opt.state[p], v1["state"][i]
        assert s["exp_avg"].dtype == torch.uint8 and st.state_format_of(s) == "8bit"
        assert s["step"].item() == old["step"].item() == 6
        m1 = ref.dequantize_m_v1(old["exp_avg"], old["exp_avg_scale"])
        v1_sq = ref.dequantize_v_v1(old["exp_avg_sq"], old["exp_avg_sq_scale"])
        got = opt.dequantized_state(p)
        for new, want in ((got["exp_avg"], m1), (got["exp_avg_sq"], v1_sq)):
            step = torch.maximum(
                want.abs() / 8,
                ref._blocks(want.abs()).amax(1).repeat_interleave(256)[: want.numel()].view(want.shape) * 2.0**-15,
            )
            assert ((new - want).abs() <= step).all()
    again = ApexW8bit([torch.nn.Parameter(t.clone()) for t in saved["params"]])
    again.load_state_dict(torch.load(V1_CHECKPOINT, weights_only=True)["optimizer"])
    for p, q in zip(params, again.param_groups[0]["params"]):
        same = all(torch.equal(opt.state[p][k], again.state[q][k]) for k in opt.state[p])
        assert same, "conversion must be deterministic"
    # the converted state saves as the current format and training continues
    sd = _roundtrip(opt.state_dict())
    assert {v["exp_avg"].dtype for v in sd["state"].values()} == {torch.uint8}
    for p in params:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in params]
    opt.step()
    assert all(torch.isfinite(p).all() and not torch.equal(p, b) for p, b in zip(params, before))
    assert opt.state[params[0]]["step"].item() == 7


def test_8bit_format_v1_checkpoint_for_other_shapes_is_refused():
    saved, _ = _load_v1()
    p = torch.nn.Parameter(torch.randn(3, 299))
    q = torch.nn.Parameter(torch.randn(17))
    opt = ApexW8bit([p, q])
    with pytest.raises(ValueError, match=r"exp_avg' for a parameter of shape \(3, 299\) is torch.int8 \(3, 300\)"):
        opt.load_state_dict(saved["optimizer"])
    assert not opt.state, "a failed load must change nothing"
