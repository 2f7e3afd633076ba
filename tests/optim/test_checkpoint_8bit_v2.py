"""8-bit format version 2 checkpoints (issue 45): recognised by their bf16 ``v`` scales, converted on load into
version 3 deterministically (decoded, then re-encoded with the random stream of their step), refused with a clear
error and no change when damaged.

``data/apexw8bit_v2_745d1b6.pt`` was written by the package at 745d1b6, the last commit with version 2: ApexW8bit
(lr 1e-2, seed 7) over a (3, 299) and a (17,) parameter, six steps of skewed gradients (one element in 256 at 3.0,
the others near 1e-3).
"""

from pathlib import Path

import pytest
import torch

from apexw_hf import ApexW, ApexW8bit
from apexw_hf import formats as st
from apexw_hf import reference as ref

from .helpers import same_bits

V2_8BIT = Path(__file__).parent / "data" / "apexw8bit_v2_745d1b6.pt"


def _load():
    saved = torch.load(V2_8BIT, weights_only=True)
    return saved, [torch.nn.Parameter(t.clone()) for t in saved["params"]]


def test_version_2_entries_are_recognised_by_their_bf16_v_scale():
    saved, _ = _load()
    for entry in saved["optimizer"]["state"].values():
        assert entry["exp_avg"].dtype == torch.uint8 and entry["exp_avg_sq_scale"].dtype == torch.bfloat16
        assert st.state_format_of(entry) == "8bit_v2"


def test_version_2_checkpoint_converts_exactly_and_deterministically():
    """Each entry becomes the version-3 encoding of its decoded moments with the moments' random stream of its step
    (seed 7, its tensor index, step 6) and a fresh v scale: bit for bit, the same on every load, and training goes
    on. The decoded moments stay within a code step of version 2's."""
    saved, params = _load()
    v2 = saved["optimizer"]
    opt = ApexW8bit(params, lr=1.0)  # hyperparameters come from the checkpoint
    opt.load_state_dict(v2)
    assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[0]["seed"] == 7
    for i, p in enumerate(params):
        old, s = v2["state"][i], opt.state[p]
        assert st.state_format_of(s) == "8bit" and s["exp_avg_sq_scale"].dtype == torch.float32
        m = ref.dequantize_m(old["exp_avg"], old["exp_avg_scale"])
        v = ref.dequantize_v_v2(old["exp_avg_sq"], old["exp_avg_sq_scale"])
        want = st.init_state(p, "8bit")
        ref.store_moments(want, "8bit", m, v, ref.stream_key(7, i, 6, ref.STREAM_MV))
        for key in st.moment_keys("8bit") + st.SCALE_KEYS:
            assert same_bits(s[key], want[key]), key
        assert s["step"].item() == old["step"].item() == 6
        got = opt.dequantized_state(p)
        assert torch.equal(got["exp_avg"], m)  # m's codes and scale are version 2's
        assert ((got["exp_avg_sq"] - v).abs() <= v / 8).all()  # within one e5m3 step (the skewed v are in range)
    again, params2 = _load()
    opt2 = ApexW8bit(params2)
    opt2.load_state_dict(again["optimizer"])
    assert all(same_bits(opt.state[p][k], opt2.state[q][k]) for p, q in zip(params, params2) for k in opt.state[p])
    for p in params:
        p.grad = torch.randn(p.shape)
    opt.step()
    assert all(torch.isfinite(p).all() for p in params)
    assert opt.state[params[0]]["step"].item() == 7


@pytest.mark.parametrize("target", ["fp32", "compact", "4bit"])
def test_version_2_checkpoint_converts_into_other_formats(target):
    saved, params = _load()
    sd = saved["optimizer"]
    sd["param_groups"][0]["state_format"] = target
    opt = ApexW(params)
    opt.load_state_dict(sd)
    for i, p in enumerate(params):
        old = saved["optimizer"]["state"][i]
        v = ref.dequantize_v_v2(old["exp_avg_sq"], old["exp_avg_sq_scale"])
        assert st.state_format_of(opt.state[p]) == target
        if target == "fp32":
            assert torch.equal(opt.state[p]["exp_avg_sq"], v)


def test_damaged_version_2_entry_is_refused_without_change():
    saved, params = _load()
    sd = saved["optimizer"]
    sd["state"][1]["exp_avg_sq_scale"] = sd["state"][1]["exp_avg_sq_scale"][:0]  # wrong number of blocks
    opt = ApexW8bit(params)
    with pytest.raises(ValueError, match="exp_avg_sq_scale"):
        opt.load_state_dict(sd)
    assert not opt.state
