"""4-bit format version 1 checkpoints (issue 27): recognised by their bf16 ``v`` scales, converted on load into
version 2 deterministically (decoded, then re-encoded with the random stream of their step), refused with a clear
error and no change when damaged.

``data/apexw4bit_v1_a329abf.pt`` was written by the package at a329abf, the last commit with version 1: ApexW4bit
(lr 1e-2, seed 7) over a (3, 299) and a (17,) parameter, six steps.
"""

from pathlib import Path

import pytest
import torch

from apexw_hf import ApexW, ApexW4bit
from apexw_hf import formats as st
from apexw_hf import reference as ref

from .helpers import same_bits

V1_4BIT = Path(__file__).parent / "data" / "apexw4bit_v1_a329abf.pt"


def _load():
    saved = torch.load(V1_4BIT, weights_only=True)
    return saved, [torch.nn.Parameter(t.clone()) for t in saved["params"]]


def _snapshot(opt):
    return {id(p): {k: v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)} for p, s in opt.state.items()}


def _same(opt, snap):
    return snap.keys() == {id(p) for p in opt.state} and all(
        same_bits(v, opt.state[p][k]) for p in opt.state for k, v in snap[id(p)].items()
    )


def test_version_1_entries_are_recognised_by_their_bf16_v_scale():
    saved, _ = _load()
    for entry in saved["optimizer"]["state"].values():
        assert entry["exp_avg_sq_scale"].dtype == torch.bfloat16
        assert st.state_format_of(entry) == "4bit_v1"


def test_version_1_checkpoint_converts_exactly_and_deterministically():
    """Each entry becomes the version-2 encoding of its decoded moments with the moments' random stream of its step
    (seed 7, its tensor index, step 6): bit for bit, the same on every load, and training goes on."""
    saved, params = _load()
    v1 = saved["optimizer"]
    opt = ApexW4bit(params, lr=1.0)  # hyperparameters come from the checkpoint
    opt.load_state_dict(v1)
    assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[0]["seed"] == 7
    for i, p in enumerate(params):
        old, s = v1["state"][i], opt.state[p]
        assert st.state_format_of(s) == "4bit" and s["exp_avg_sq_scale"].dtype == torch.float32
        m, v = ref.dequantize_mv4(old["exp_avg_mv"], old["exp_avg_scale"], old["exp_avg_sq_scale"])
        want = st.init_state(p, "4bit")
        ref.store_moments(want, "4bit", m, v, ref.stream_key(7, i, 6, ref.STREAM_MV))
        for key in st.moment_keys("4bit") + st.SCALE_KEYS:
            assert same_bits(s[key], want[key]), key
        assert s["step"].item() == old["step"].item() == 6
    again, params2 = _load()
    opt2 = ApexW4bit(params2)
    opt2.load_state_dict(again["optimizer"])
    assert all(
        same_bits(opt.state[p][k], opt2.state[q][k]) for p, q in zip(params, params2) for k in st.SCALE_KEYS
    )
    for p in params:
        p.grad = torch.randn(p.shape)
    opt.step()
    assert all(torch.isfinite(p).all() for p in params)


@pytest.mark.parametrize("target", ["fp32", "compact", "8bit"])
def test_version_1_checkpoint_converts_into_other_formats(target):
    saved, params = _load()
    sd = saved["optimizer"]
    sd["param_groups"][0]["state_format"] = target
    opt = ApexW(params)
    opt.load_state_dict(sd)
    for i, p in enumerate(params):
        old = sd["state"][i]
        m, v = ref.dequantize_mv4(old["exp_avg_mv"], old["exp_avg_scale"], old["exp_avg_sq_scale"])
        got = opt.dequantized_state(p)
        assert st.state_format_of(opt.state[p]) == target
        tol = {"fp32": 0.0, "compact": 2.0**-7, "8bit": 2.0**-3}[target]
        assert torch.allclose(got["exp_avg_sq"], v, rtol=tol, atol=0.0)
        assert torch.allclose(got["exp_avg"], m, rtol=tol, atol=float(m.abs().max()) * 2.0**-16)


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            lambda s: s.update(exp_avg_sq_scale=s["exp_avg_sq_scale"][:-1]),
            r"'exp_avg_sq_scale' for a parameter of shape \(3, 299\) is torch.bfloat16 \(7,\); format '4bit_v1' "
            r"needs torch.bfloat16 \(8,\)",
        ),
        (
            lambda s: s.update(exp_avg_scale=s["exp_avg_scale"].float()),
            r"'exp_avg_scale' .* is torch.float32 \(8,\); format '4bit_v1' needs torch.bfloat16 \(8,\)",
        ),
        (
            lambda s: s.update(exp_avg_sq_scale=s["exp_avg_sq_scale"].half()),
            r"'exp_avg_sq_scale' .* is torch.float16 \(8,\); format '4bit' needs torch.float32 \(8,\)",
        ),
        (
            lambda s: s.update(exp_avg_mv=s["exp_avg_mv"].reshape(299, 3)),
            r"'exp_avg_mv' has shape \(299, 3\) but its parameter has shape \(3, 299\): the state dict was saved from "
            r"a different model",
        ),
    ],
    ids=["v_scale_count", "m_scale_dtype", "v_scale_fp16", "other_model"],
)
def test_damaged_version_1_state_is_refused_and_changes_nothing(edit, match):
    saved, params = _load()
    opt = ApexW4bit(params, seed=7)
    for p in params:
        p.grad = torch.randn(p.shape)
    opt.step()
    before = _snapshot(opt)
    sd = saved["optimizer"]
    edit(sd["state"][0])
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)
    assert _same(opt, before)


def test_version_2_state_dict_says_its_version():
    """A saved version-2 entry holds fp32 v scales (the version) and reloads as itself, bit for bit."""
    p = torch.nn.Parameter(torch.randn(300))
    opt = ApexW4bit([p])
    p.grad = torch.randn(300)
    opt.step()
    sd = opt.state_dict()
    entry = sd["state"][0]
    assert entry["exp_avg_sq_scale"].dtype == torch.float32 and st.state_format_of(entry) == "4bit"
    q = torch.nn.Parameter(p.detach().clone())
    opt2 = ApexW4bit([q])
    opt2.load_state_dict(sd)
    assert all(same_bits(opt2.state[q][k], opt.state[p][k]) for k in ("exp_avg_mv", *st.SCALE_KEYS))
