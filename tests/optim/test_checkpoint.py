"""state_dict / load_state_dict: exact resume, dtypes kept, weights_only loading, torch AdamW conversion."""

import io
from pathlib import Path

import pytest
import torch

from apexw_hf import ApexW, ApexW4bit, ApexW8bit
from apexw_hf import formats as st
from apexw_hf import reference as ref

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


STATE_KEYS = {
    "fp32": {"step", "exp_avg", "exp_avg_sq"},
    "compact": {"step", "exp_avg", "exp_avg_sq"},
    "8bit": {"step", "exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale"},
    "4bit": {"step", "exp_avg_mv", "exp_avg_scale", "exp_avg_sq_scale"},
}


@pytest.mark.parametrize("fmt", ["8bit", "4bit"])
def test_state_dict_holds_only_tensors_and_plain_values(fmt):
    ps = _params(torch.float32)
    opt = ApexW(ps, state_format=fmt)
    run_steps(opt, ps, [make_grads(p.shape, 1, i) for i, p in enumerate(ps)])
    sd = _roundtrip(opt.state_dict())  # weights_only=True raises on anything else
    assert set(sd["state"][0]) == STATE_KEYS[fmt]
    assert sd["param_groups"][0]["state_format"] == fmt
    block = {"8bit": ref.BLOCK, "4bit": ref.BLOCK4}[fmt]
    for i, p in enumerate(ps):
        assert sd["state"][i]["exp_avg_scale"].shape == (ref.num_blocks(p.numel(), block),)
        # 4-bit format version 2 keeps v's scale in fp32 (the exact block absmax)
        assert sd["state"][i]["exp_avg_sq_scale"].dtype == torch.float32  # 8-bit version 3, 4-bit version 2


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
    # 4bit: the converted moments are rounded to powers of two of the block scale; measured 0.011 (6 seeds)
    assert moved < {"fp32": 1e-6, "compact": 1e-3, "8bit": 5e-3, "4bit": 0.025}[fmt]


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


def test_format_change_to_4bit_on_load():
    p = torch.nn.Parameter(torch.randn(300))
    opt = ApexW([p], state_format="fp32")
    run_steps(opt, [p], [make_grads((300,), 3)])
    sd = opt.state_dict()
    sd["param_groups"][0]["state_format"] = "4bit"
    q = torch.nn.Parameter(p.detach().clone())
    opt2 = ApexW([q], state_format="fp32")
    opt2.load_state_dict(sd)
    assert set(opt2.state[q]) == STATE_KEYS["4bit"] and opt2.param_groups[0]["state_format"] == "4bit"
    m, v = opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]
    m4, v4 = ref.dequantize_mv4(
        opt2.state[q]["exp_avg_mv"], opt2.state[q]["exp_avg_scale"], opt2.state[q]["exp_avg_sq_scale"]
    )
    assert _within_one_4bit_code(m4, v4, m, v)


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


def _state_snapshot(opt):
    return {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}


def _unchanged(opt, snapshot):
    return snapshot.keys() == {id(p) for p in opt.state} and all(
        s.keys() == snapshot[id(p)].keys() and all(torch.equal(v, snapshot[id(p)][k]) for k, v in s.items())
        for p, s in opt.state.items()
    )


# issue 28: the state of another model whose tensor count matches names the shapes that differ
OTHER_MODEL = r"has shape \(12,\) but its parameter has shape \(10,\): the state dict was saved from a different model"


def _stepped(fmt, shape=(300,), steps=2):
    p = torch.nn.Parameter(torch.randn(shape))
    opt = ApexW([p], state_format=fmt, seed=3)
    run_steps(opt, [p], [make_grads(shape, steps, 1)])
    return opt, p


@pytest.mark.parametrize("target", FORMATS)
@pytest.mark.parametrize(
    "edit, match",
    [
        (
            lambda s: s.update(exp_avg_mv=s["exp_avg_mv"].view(torch.int8)),
            r"'exp_avg_mv' for a parameter of shape \(300,\) is torch.int8 \(300,\); format '4bit' needs torch.uint8",
        ),
        (
            lambda s: s.update(exp_avg_mv=s["exp_avg_mv"][:299]),
            r"'exp_avg_mv' has shape \(299,\) but its parameter has shape \(300,\): the state dict was saved from a "
            r"different model",
        ),
        (  # scales cut for the 8-bit block (2 of 256) instead of 4-bit's 3 of 128
            lambda s: s.update(exp_avg_sq_scale=s["exp_avg_sq_scale"][:2]),
            r"'exp_avg_sq_scale' .* is torch.float32 \(2,\); format '4bit' needs torch.float32 \(3,\)",
        ),
        (
            lambda s: s.update(exp_avg_scale=s["exp_avg_scale"].half()),
            r"'exp_avg_scale' .* is torch.float16 \(3,\); format '4bit' needs torch.float32 \(3,\)",
        ),
        (lambda s: s.pop("exp_avg_sq_scale"), r"'exp_avg_sq_scale' .* is missing; format '4bit' needs"),
        (
            lambda s: s.update(exp_avg=torch.zeros(300)),
            r"holds 'exp_avg' beside the tensors of format '4bit', which are exactly 'exp_avg_mv', 'exp_avg_scale', "
            r"'exp_avg_sq_scale' \(and 'step'\)",
        ),
    ],
    ids=["codes_dtype", "codes_shape", "scales_of_8bit_blocks", "scales_dtype", "scale_missing", "two_layouts"],
)
def test_bad_4bit_state_is_refused_and_changes_nothing(target, edit, match):
    """A damaged 4-bit entry is refused whatever format it would be converted to, naming the tensor, what it is and
    what the format needs; the optimizer loading it keeps its state."""
    src, _ = _stepped("4bit")
    sd = src.state_dict()
    edit(sd["state"][0])
    opt, _ = _stepped(target)
    sd["param_groups"][0]["state_format"] = target
    before = _state_snapshot(opt)
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)
    assert _unchanged(opt, before), "a failed load must change nothing"
    assert opt.param_groups[0]["state_format"] == target


@pytest.mark.parametrize("fmt", FORMATS)
def test_state_of_another_shape_is_refused_by_4bit(fmt):
    src, _ = _stepped(fmt, shape=(12,))
    opt, _ = _stepped("4bit", shape=(10,))
    sd = src.state_dict()
    sd["param_groups"][0]["state_format"] = "4bit"
    before = _state_snapshot(opt)
    with pytest.raises(ValueError, match=OTHER_MODEL):
        opt.load_state_dict(sd)
    assert _unchanged(opt, before)


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
    assert set(opt.state[p]) == STATE_KEYS[fmt]
    m = opt.state[p]["exp_avg_mv" if fmt == "4bit" else "exp_avg"]
    assert m.dtype == {"fp32": torch.float32, "compact": torch.bfloat16, "8bit": torch.uint8, "4bit": torch.uint8}[fmt]
    if fmt in ("fp32", "compact"):
        assert torch.allclose(m.float(), topt.state[p_torch]["exp_avg"].float(), rtol=2**-7, atol=1e-6)


def test_conversion_source_of_the_wrong_shape_is_refused():
    p = torch.nn.Parameter(torch.randn(10))
    t = torch.optim.AdamW([torch.nn.Parameter(torch.randn(12))])
    run_steps(t, t.param_groups[0]["params"], [make_grads((12,), 1)])
    opt = ApexW([p], state_format="8bit")
    with pytest.raises(ValueError, match="exp_avg' " + OTHER_MODEL):
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
    other = r"exp_avg' has shape \(3, 300\) but its parameter has shape \(3, 299\): the state dict was saved from a"
    with pytest.raises(ValueError, match=other):
        opt.load_state_dict(saved["optimizer"])
    assert not opt.state, "a failed load must change nothing"


def _within_one_4bit_code(got_m, got_v, m, v):
    """Decoded 4-bit moments are one of the two codes around the exact value (v: a power of four of its scale, 4x the
    block maximum after a conversion; m, coded as ``m / sqrt(v's code)``: a power of two on either side, or under the
    smallest code 0 or that code, 2**-6 of the block's largest ``|m| / sqrt(got_v)`` times its own ``sqrt(got_v)``);
    m keeps its sign, v stays nonzero where it was."""
    n = m.numel()
    root = got_v.sqrt()
    ratio = torch.where(root > 0, m.abs() / root, torch.zeros_like(root))
    top_r = ref._blocks(ratio, ref.BLOCK4).amax(1).repeat_interleave(ref.BLOCK4)[:n].view(m.shape) * 1.01
    top_v = ref._blocks(v, ref.BLOCK4).amax(1).repeat_interleave(ref.BLOCK4)[:n].view(v.shape) * 1.01
    return (
        bool(((got_m - m).abs() <= torch.maximum(m.abs(), top_r * root * 2.0**-6)).all())
        and bool(((got_v - v).abs() <= torch.maximum(3 * v, top_v * 2.0**-26)).all())
        and bool((torch.sign(got_m) * torch.sign(m) >= 0).all())
        and bool(((got_v > 0) == (v > 0)).all())
    )


def _converted(sd, fmt, params):
    sd = {"state": sd["state"], "param_groups": [{**g, "state_format": fmt} for g in sd["param_groups"]]}
    opt = ApexW(params, state_format="fp32")
    opt.load_state_dict(sd)
    return opt


@pytest.mark.parametrize("src", FORMATS)
def test_conversion_into_4bit_and_out_is_deterministic(src):
    """Any format -> 4bit -> any format: each conversion is the same bits every time (re-encoded with the random
    stream of the entry's step), within one code of the moments it came from, and training goes on."""
    ps = _params(torch.float32)
    opt = ApexW(ps, state_format=src, seed=4)
    run_steps(opt, ps, [make_grads(p.shape, 3, i) for i, p in enumerate(ps)])
    sd = _roundtrip(opt.state_dict())
    fours = [_converted(sd, "4bit", [torch.nn.Parameter(p.detach().clone()) for p in ps]) for _ in range(2)]
    for p, q, r in zip(ps, fours[0].param_groups[0]["params"], fours[1].param_groups[0]["params"]):
        a, b = fours[0].state[q], fours[1].state[r]
        assert set(a) == STATE_KEYS["4bit"] and all(torch.equal(a[k], b[k]) for k in a)
        want, got = opt.dequantized_state(p), fours[0].dequantized_state(q)
        assert torch.equal(got["step"], want["step"])
        assert _within_one_4bit_code(got["exp_avg"], got["exp_avg_sq"], want["exp_avg"], want["exp_avg_sq"])
    four_sd = _roundtrip(fours[0].state_dict())
    for target in FORMATS:
        outs = [_converted(four_sd, target, [torch.nn.Parameter(p.detach().clone()) for p in ps]) for _ in range(2)]
        for q, x, y in zip(fours[0].param_groups[0]["params"], *(o.param_groups[0]["params"] for o in outs)):
            assert set(outs[0].state[x]) == STATE_KEYS[target]
            assert all(torch.equal(outs[0].state[x][k], outs[1].state[y][k]) for k in outs[0].state[x])
            if target in ("fp32", "4bit"):  # decoded 4-bit values are exact in fp32 and re-encode to themselves
                got, want = outs[0].dequantized_state(x), fours[0].dequantized_state(q)
                assert all(torch.equal(got[k], want[k]) for k in want)
        params = outs[0].param_groups[0]["params"]
        run_steps(outs[0], params, [make_grads(p.shape, 1, 9 + i) for i, p in enumerate(params)])
        assert all(outs[0].state[p]["step"].item() == 4 for p in params)


def test_4bit_checkpoint_resumes_exactly_in_a_fresh_apexw4bit():
    """The 4-bit state of a run saved with torch.save and loaded with weights_only=True into a new ApexW4bit (other
    constructor arguments: the state dict's win) continues bit for bit like the unbroken run."""
    shapes = [(33, 65), (257,), (1,)]
    grads = [make_grads(s, 7, i) for i, s in enumerate(shapes)]
    unbroken = _params(torch.bfloat16)
    run_steps(ApexW4bit(unbroken, lr=1e-2, seed=2), unbroken, [[g.bfloat16() for g in gs] for gs in grads])
    first = _params(torch.bfloat16)
    opt = ApexW4bit(first, lr=1e-2, seed=2)
    run_steps(opt, first, [[g.bfloat16() for g in gs[:4]] for gs in grads])
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    opt2 = ApexW4bit(resumed, lr=0.5, seed=9)
    opt2.load_state_dict(torch.load(buf, weights_only=True))
    assert opt2.defaults["seed"] == 9 and opt2.param_groups[0]["seed"] == 2 and opt2.param_groups[0]["lr"] == 1e-2
    run_steps(opt2, resumed, [[g.bfloat16() for g in gs[4:]] for gs in grads])
    assert all(
        torch.equal(a.detach().view(torch.int16), b.detach().view(torch.int16)) for a, b in zip(unbroken, resumed)
    )


def test_8bit_format_v1_checkpoint_converts_to_4bit():
    saved, params = _load_v1()
    v1 = saved["optimizer"]
    v1 = {"state": v1["state"], "param_groups": [{**g, "state_format": "4bit"} for g in v1["param_groups"]]}
    opt = ApexW4bit(params)
    opt.load_state_dict(v1)
    again = ApexW4bit([torch.nn.Parameter(t.clone()) for t in saved["params"]])
    again.load_state_dict(v1)
    for i, (p, q) in enumerate(zip(params, again.param_groups[0]["params"])):
        s, old = opt.state[p], v1["state"][i]
        assert set(s) == STATE_KEYS["4bit"] and s["step"].item() == 6
        assert all(torch.equal(s[k], again.state[q][k]) for k in s), "conversion must be deterministic"
        m1 = ref.dequantize_m_v1(old["exp_avg"], old["exp_avg_scale"])
        v1_sq = ref.dequantize_v_v1(old["exp_avg_sq"], old["exp_avg_sq_scale"])
        got = opt.dequantized_state(p)
        assert _within_one_4bit_code(got["exp_avg"], got["exp_avg_sq"], m1, v1_sq)


def test_state_dict_with_an_unknown_format_is_refused():
    src, _ = _stepped("4bit")
    sd = src.state_dict()
    sd["param_groups"][0]["state_format"] = "int4"
    opt, _ = _stepped("8bit")
    before = _state_snapshot(opt)
    with pytest.raises(ValueError, match="unknown state_format 'int4'; allowed: 'fp32', 'compact', '8bit', '4bit'"):
        opt.load_state_dict(sd)
    assert _unchanged(opt, before) and opt.param_groups[0]["state_format"] == "8bit"
