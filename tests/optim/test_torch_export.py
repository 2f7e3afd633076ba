"""dequantized_state and to_torch_adamw_state_dict: ApexW's state in fp32, and leaving ApexW for torch.optim.AdamW."""

import copy
import io

import pytest
import torch

from apexw_hf import ApexW
from apexw_hf import reference as ref

from .helpers import FORMATS, make_grads, run_steps

SHAPES = [(33, 65), (257,), (1,)]
# One code step of the largest values (8-bit: the m code step in the top binade [1/2, 1) of the scale is 1/16 of the
# scale, v's 1/32). 4-bit codes step a whole binade (1/2 of the scale at the top), and six steps of rounding the
# moments to powers of two put them up to 0.67 of the largest value away from an fp32 run's (measured): 1/4 here,
# so that the test's 4 x TOLERANCE is the largest value itself.
TOLERANCE = {"fp32": 0.0, "compact": 2**-8, "8bit": 1 / 16, "4bit": 1 / 4}
# 4-bit v (format version 3): codes a factor 4 apart under a scale up to 4x the block's maximum (the envelope), so a
# decoded v can be a few times the largest exact one (measured 2.5x here): 3/4, so that 4 x that is 3x the largest.
V_TOLERANCE = {**TOLERANCE, "4bit": 3 / 4}


def _roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _params():
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _groups(params, fmt, lr=1e-2):
    """Two groups with different hyperparameters (a tensor lr in one), to see that each reaches torch."""
    return [
        {"params": params[:2], "lr": lr, "weight_decay": 0.1, "betas": (0.8, 0.99)},
        {"params": params[2:], "lr": torch.tensor(3e-3), "weight_decay": 0.0, "maximize": True, "eps": 1e-6},
    ], dict(state_format=fmt, engine="torch", seed=5)


def _trained(fmt, steps=6):
    params = _params()
    groups, kw = _groups(params, fmt)
    opt = ApexW(groups, **kw)
    run_steps(opt, params, [make_grads(p.shape, steps, i) for i, p in enumerate(params)])
    return opt, params


def assert_equal_moments(a, b):
    assert all(torch.equal(a[k], b[k]) for k in ("step", "exp_avg", "exp_avg_sq"))


def _clones(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def _torch_groups(params):
    return [{"params": params[:2]}, {"params": params[2:]}]


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantized_state_is_fp32_and_close_to_an_fp32_run(fmt):
    opt, params = _trained(fmt)
    exact, exact_params = _trained("fp32")
    for p, q in zip(params, exact_params):
        got, want = opt.dequantized_state(p), exact.state[q]
        assert got["step"].item() == 6 and got["step"].dtype == torch.float32 and got["step"].device.type == "cpu"
        for key in ("exp_avg", "exp_avg_sq"):
            assert got[key].dtype == torch.float32 and got[key].shape == p.shape
            scale = want[key].abs().max()
            # the formats' runs drift apart a little through the parameters, hence the factor 4
            tol = (V_TOLERANCE if key == "exp_avg_sq" else TOLERANCE)[fmt]
            assert (got[key] - want[key]).abs().max() <= 4 * tol * scale + 1e-12, key
        if fmt == "fp32":
            assert torch.equal(got["exp_avg"], opt.state[p]["exp_avg"])
        m, v = ref.load_moments(opt.state[p], fmt, p.shape)  # the specification's decoding, bit for bit
        assert torch.equal(got["exp_avg"], m.float()) and torch.equal(got["exp_avg_sq"], v.float())


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantized_state_is_a_copy(fmt):
    opt, params = _trained(fmt, steps=2)
    before = opt.dequantized_state(params[0])
    kept = {k: v.clone() for k, v in before.items()}
    run_steps(opt, params, [make_grads(p.shape, 1, 9 + i) for i, p in enumerate(params)])
    assert all(torch.equal(before[k], kept[k]) for k in kept)
    assert not torch.equal(opt.dequantized_state(params[0])["exp_avg"], before["exp_avg"])


@pytest.mark.parametrize("fmt", ["8bit", "4bit"])
def test_dequantized_state_before_the_first_step(fmt):
    p = torch.nn.Parameter(torch.randn(5))
    got = ApexW([p], state_format=fmt).dequantized_state(p)
    assert got["step"].item() == 0 and not got["exp_avg"].any() and not got["exp_avg_sq"].any()


def test_dequantized_state_rejects_what_is_not_a_parameter():
    opt, _ = _trained("8bit", steps=1)
    with pytest.raises(ValueError, match=r"Parameter of shape \(3,\) and dtype torch.float32 is not a parameter"):
        opt.dequantized_state(torch.nn.Parameter(torch.randn(3)))
    with pytest.raises(TypeError, match="takes a parameter tensor, got int"):
        opt.dequantized_state(0)


def test_export_has_torch_adamw_keys():
    opt, params = _trained("8bit", steps=1)
    sd = opt.to_torch_adamw_state_dict()
    native = torch.optim.AdamW(_torch_groups(_clones(params)))
    for p in native.param_groups[0]["params"] + native.param_groups[1]["params"]:
        p.grad = torch.ones_like(p)
    native.step()
    want = native.state_dict()
    assert [set(g) for g in sd["param_groups"]] == [set(g) for g in want["param_groups"]]
    assert set(sd["state"]) == set(want["state"]) == {0, 1, 2}
    assert all(set(e) == set(want["state"][0]) for e in sd["state"].values())
    assert all(
        isinstance(e["exp_avg"], torch.Tensor) and e["exp_avg"].dtype == torch.float32 for e in sd["state"].values()
    )
    _roundtrip(sd)  # plain tensors and values: loads with weights_only=True


@pytest.mark.parametrize("fmt", FORMATS)
def test_torch_adamw_continues_from_the_export(fmt):
    """torch AdamW's next step after loading the export is the AdamW update from the exported fp32 moments."""
    opt, params = _trained(fmt)
    sd = _roundtrip(opt.to_torch_adamw_state_dict())
    clones = _clones(params)
    topt = torch.optim.AdamW(_torch_groups(clones), lr=1.0, weight_decay=0.5)  # hyperparameters come from sd
    topt.load_state_dict(copy.deepcopy(sd))  # torch keeps the loaded tensors and updates them in place
    grads = [g[0] for g in (make_grads(p.shape, 1, 40 + i) for i, p in enumerate(params))]
    for p, g in zip(clones, grads):
        p.grad = g.clone()
    topt.step()
    index = 0
    for group in sd["param_groups"]:
        lr = float(group["lr"])
        b1, b2 = group["betas"]
        for _ in group["params"]:
            entry, p0, g = sd["state"][index], params[index].detach().double(), grads[index].double()
            assert_equal_moments(entry, opt.dequantized_state(params[index]))
            g = -g if group["maximize"] else g
            t = entry["step"].item() + 1
            m = b1 * entry["exp_avg"].double() + (1 - b1) * g
            v = b2 * entry["exp_avg_sq"].double() + (1 - b2) * g * g
            denom = v.sqrt() / (1 - b2**t) ** 0.5 + group["eps"]
            want = p0 * (1 - lr * group["weight_decay"]) - lr / (1 - b1**t) * m / denom
            torch.testing.assert_close(clones[index].detach().double(), want, rtol=1e-5, atol=1e-7)
            assert topt.state[clones[index]]["step"].item() == t
            index += 1
    assert not torch.equal(clones[0].detach(), params[0].detach()), "the step moved the parameter"


def test_fp32_through_torch_and_back_is_exact():
    opt, params = _trained("fp32")
    topt = torch.optim.AdamW(_torch_groups(_clones(params)))
    topt.load_state_dict(_roundtrip(opt.to_torch_adamw_state_dict()))
    clones = [p for g in topt.param_groups for p in g["params"]]
    groups, kw = _groups(clones, "fp32", lr=0.5)  # the state dict's hyperparameters must win
    back = ApexW(groups, **kw)
    back.load_state_dict(_roundtrip(topt.state_dict()))
    for p, q in zip(params, clones):
        for key, value in opt.state[p].items():
            assert torch.equal(back.state[q][key], value), key
    for a, b in zip(opt.param_groups, back.param_groups):
        assert {k: v for k, v in a.items() if k != "params"}.keys() == {k for k in b if k != "params"}
        assert float(a["lr"]) == float(b["lr"]) and a["betas"] == b["betas"] and a["maximize"] == b["maximize"]
    more = [make_grads(p.shape, 4, 20 + i) for i, p in enumerate(params)]
    run_steps(opt, params, more)
    run_steps(back, clones, more)
    assert all(torch.equal(p.detach(), q.detach()) for p, q in zip(params, clones))


@pytest.mark.parametrize("fmt", ["compact", "8bit", "4bit"])
def test_quantized_through_torch_and_back_keeps_the_moments(fmt):
    """compact -> fp32 -> compact is exact (bf16 values re-round to themselves); 8-bit re-quantizes its own
    decoded values, within one code step of the block scale; 4-bit decoded values are powers of two times the block
    scale, which re-encode to the same values exactly (the codes and scales may shift together when a block's
    largest code was below 1.0)."""
    opt, params = _trained(fmt)
    topt = torch.optim.AdamW(_torch_groups(_clones(params)))
    topt.load_state_dict(opt.to_torch_adamw_state_dict())
    clones = [p for g in topt.param_groups for p in g["params"]]
    groups, kw = _groups(clones, fmt)
    back = ApexW(groups, **kw)
    back.load_state_dict(topt.state_dict())
    for p, q in zip(params, clones):
        before, after = opt.dequantized_state(p), back.dequantized_state(q)
        assert torch.equal(before["step"], after["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            if fmt == "compact":
                assert torch.equal(before[key], after[key]), key
                assert torch.equal(back.state[q][key], opt.state[p][key]), key
            elif fmt == "4bit":
                assert torch.equal(before[key], after[key]), key
            else:
                bound = TOLERANCE[fmt] * before[key].abs().max()
                assert (before[key] - after[key]).abs().max() <= bound, key
