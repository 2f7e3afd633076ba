"""Checkpoints of earlier state format versions: recognised by their scales' dtypes (4-bit version 3 by its state
dict's lack of ``exp_avg_mv_version``), converted on load into today's version deterministically (decoded, then
re-encoded with the random stream of their step), converted into the other formats, refused with a clear error and
no change when damaged.

Each file under ``data/`` was written by the package at the last commit with that version: the optimizer (lr 1e-2,
seed 7) over a (3, 299) and a (17,) parameter, six steps (the 8-bit one with skewed gradients: one element in 256 at
3.0, the others near 1e-3).

- ``apexw4bit_v1_a329abf.pt``: 4-bit version 1 (bf16 ``m`` and ``v`` scales), converted into version 4;
- ``apexw4bit_v2_0f676df.pt``: 4-bit version 2 (a bf16 ``m`` scale, an fp32 ``v`` scale; skewed gradients: one element
  in 128 at 3.0 N(0, 1), the others near 1e-3), converted into version 4;
- ``apexw4bit_v3_9c47f27.pt``: 4-bit version 3 (fp32 ``m`` and ``v`` scales, as version 4; its param groups carry no
  ``exp_avg_mv_version``; the parameters drawn from ``torch.Generator().manual_seed(0)``, the same skewed gradients),
  converted into version 4;
- ``apexw8bit_v2_745d1b6.pt``: 8-bit version 2 (bf16 ``v`` scales), converted into version 3.
"""

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from apexw_hf import ApexW, ApexW4bit, ApexW8bit
from apexw_hf import formats as st
from apexw_hf import reference as ref

from .helpers import same_bits

DATA = Path(__file__).parent / "data"


@dataclasses.dataclass(frozen=True)
class Old:
    file: str
    cls: type
    old_format: str  # what formats.state_format_of calls it (with the version its state dict declares)
    new_format: str
    decode: Callable  # a saved entry -> its (m, v), as the old version decoded them
    v_tol: dict  # target format -> relative tolerance of the decoded v after the conversion


OLD = {
    "4bit_v1": Old(
        "apexw4bit_v1_a329abf.pt", ApexW4bit, "4bit_v1", "4bit",
        lambda e: ref.dequantize_mv4_v2(e["exp_avg_mv"], e["exp_avg_scale"], e["exp_avg_sq_scale"]),
        {"fp32": 0.0, "compact": 2.0**-7, "8bit": 2.0**-3},
    ),
    "4bit_v2": Old(
        "apexw4bit_v2_0f676df.pt", ApexW4bit, "4bit_v2", "4bit",
        lambda e: ref.dequantize_mv4_v2(e["exp_avg_mv"], e["exp_avg_scale"], e["exp_avg_sq_scale"]),
        {"fp32": 0.0, "compact": 2.0**-7, "8bit": 2.0**-3},
    ),
    "4bit_v3": Old(
        "apexw4bit_v3_9c47f27.pt", ApexW4bit, "4bit_v3", "4bit",
        lambda e: ref.dequantize_mv4_v3(e["exp_avg_mv"], e["exp_avg_scale"], e["exp_avg_sq_scale"]),
        {"fp32": 0.0, "compact": 2.0**-7, "8bit": 2.0**-3},
    ),
    "8bit_v2": Old(
        "apexw8bit_v2_745d1b6.pt", ApexW8bit, "8bit_v2", "8bit",
        lambda e: (ref.dequantize_m(e["exp_avg"], e["exp_avg_scale"]),
                   ref.dequantize_v_v2(e["exp_avg_sq"], e["exp_avg_sq_scale"])),
        {"fp32": 0.0, "compact": 2.0**-7, "8bit": 2.0**-3, "4bit": None},
    ),
}


def _load(old: Old):
    saved = torch.load(DATA / old.file, weights_only=True)
    return saved, [torch.nn.Parameter(t.clone()) for t in saved["params"]]


def _converted(old: Old, cls):
    """The checkpoint of ``old`` loaded into a new ``cls``: per parameter, the old entry's decoded ``(m, v)`` and the
    optimizer's dequantized state."""
    saved, params = _load(old)
    opt = cls(params)
    opt.load_state_dict(saved["optimizer"])
    return [(*old.decode(saved["optimizer"]["state"][i]), opt.dequantized_state(p)) for i, p in enumerate(params)]


def _snapshot(opt):
    return {id(p): {k: v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)} for p, s in opt.state.items()}


def _same(opt, snap):
    return snap.keys() == {id(p) for p in opt.state} and all(
        same_bits(v, opt.state[p][k]) for p in opt.state for k, v in snap[id(p)].items()
    )


@pytest.mark.parametrize("version", OLD)
def test_old_entries_are_recognised_by_their_scales(version):
    """A bf16 v scale (4-bit and 8-bit version 1, 8-bit version 2), a bf16 m scale beside an fp32 v scale (4-bit
    version 2), both fp32 in a state dict that declares no 4-bit version (4-bit version 3: version 4's tensors)."""
    old = OLD[version]
    saved, _ = _load(old)
    group = saved["optimizer"]["param_groups"][0]
    assert st.MV4_VERSION_KEY not in group and st.saved_mv4_version(group) == 3
    for entry in saved["optimizer"]["state"].values():
        fp32_v = version in ("4bit_v2", "4bit_v3")
        assert entry["exp_avg_sq_scale"].dtype == (torch.float32 if fp32_v else torch.bfloat16)
        assert entry["exp_avg_scale"].dtype == (torch.float32 if version == "4bit_v3" else torch.bfloat16)
        assert st.state_format_of(entry, st.saved_mv4_version(group)) == old.old_format
        assert st.state_format_of(entry) == ("4bit" if version == "4bit_v3" else old.old_format)


@pytest.mark.parametrize("version", OLD)
def test_old_checkpoint_converts_exactly_and_deterministically(version):
    """Each entry becomes today's encoding of its decoded moments with the moments' random stream of its step (seed 7,
    its tensor index, step 6) and a fresh fp32 v scale: bit for bit, the same on every load, and training goes on."""
    old = OLD[version]
    saved, params = _load(old)
    sd = saved["optimizer"]
    opt = old.cls(params, lr=1.0)  # hyperparameters come from the checkpoint
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 1e-2 and opt.param_groups[0]["seed"] == 7
    for i, p in enumerate(params):
        entry, s = sd["state"][i], opt.state[p]
        assert st.state_format_of(s) == old.new_format and s["exp_avg_sq_scale"].dtype == torch.float32
        assert s["exp_avg_scale"].dtype == (torch.float32 if old.new_format == "4bit" else torch.bfloat16)
        m, v = old.decode(entry)
        want = st.init_state(p, old.new_format)
        ref.store_moments(want, old.new_format, m, v, ref.stream_key(7, i, 6, ref.STREAM_MV))
        for key in st.moment_keys(old.new_format) + st.SCALE_KEYS:
            assert same_bits(s[key], want[key]), key
        assert s["step"].item() == entry["step"].item() == 6
    again, params2 = _load(old)
    opt2 = old.cls(params2)
    opt2.load_state_dict(again["optimizer"])
    assert all(same_bits(opt.state[p][k], opt2.state[q][k]) for p, q in zip(params, params2) for k in opt.state[p])
    for p in params:
        p.grad = torch.randn(p.shape)
    opt.step()
    assert all(torch.isfinite(p).all() for p in params)
    assert opt.state[params[0]]["step"].item() == 7


def test_8bit_v2_keeps_m_and_v_within_one_code_step():
    """8-bit version 3 codes m as version 2 did (the same codes and scale) and v in e5m3 over a finer range: the
    decoded moments of the converted checkpoint are version 2's m exactly and v within one e5m3 step."""
    for m, v, got in _converted(OLD["8bit_v2"], ApexW8bit):
        assert torch.equal(got["exp_avg"], m)
        assert ((got["exp_avg_sq"] - v).abs() <= v / 8).all()  # the skewed v are in range


@pytest.mark.parametrize(("version", "target"), [(k, t) for k, old in OLD.items() for t in old.v_tol
                                                 if t != old.new_format])
def test_old_checkpoint_converts_into_other_formats(version, target):
    old = OLD[version]
    saved, params = _load(old)
    sd = saved["optimizer"]
    sd["param_groups"][0]["state_format"] = target
    opt = ApexW(params)
    opt.load_state_dict(sd)
    tol = old.v_tol[target]
    for i, p in enumerate(params):
        m, v = old.decode(sd["state"][i])
        assert st.state_format_of(opt.state[p]) == target
        if tol is None:  # 4-bit's v code is coarser than either old version's: only the format is checked
            continue
        got = opt.dequantized_state(p)
        assert torch.allclose(got["exp_avg_sq"], v, rtol=tol, atol=0.0)
        assert torch.allclose(got["exp_avg"], m, rtol=tol, atol=float(m.abs().max()) * 2.0**-16)


def test_damaged_8bit_v2_entry_is_refused_without_change():
    saved, params = _load(OLD["8bit_v2"])
    sd = saved["optimizer"]
    sd["state"][1]["exp_avg_sq_scale"] = sd["state"][1]["exp_avg_sq_scale"][:0]  # wrong number of blocks
    opt = ApexW8bit(params)
    with pytest.raises(ValueError, match="exp_avg_sq_scale"):
        opt.load_state_dict(sd)
    assert not opt.state


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
            r"'exp_avg_sq_scale' .* is torch.float16 \(8,\); format '4bit_v2' needs torch.float32 \(8,\)",
        ),
        (
            lambda s: s.update(exp_avg_mv=s["exp_avg_mv"].reshape(299, 3)),
            r"'exp_avg_mv' has shape \(299, 3\) but its parameter has shape \(3, 299\): the state dict was saved from "
            r"a different model",
        ),
    ],
    ids=["v_scale_count", "m_scale_dtype", "v_scale_fp16", "other_model"],
)
def test_damaged_4bit_v1_state_is_refused_and_changes_nothing(edit, match):
    saved, params = _load(OLD["4bit_v1"])
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


def _within_a_4bit_code(got: dict, m: torch.Tensor, v: torch.Tensor, opt_state: dict) -> None:
    """Version 4's rounding of the decoded ``m`` and ``v`` that it converted: ``m`` within one code step (a factor 2)
    or, below the least code, within 2**-6 of its block's scale times its ``v`` code's unit ``2**(cv - 15)``; ``v``
    within one code step (a factor 4)."""
    cv = (opt_state["exp_avg_mv"].reshape(-1).long() >> 4)
    scale = opt_state["exp_avg_scale"].repeat_interleave(ref.BLOCK4)[: m.numel()]
    least = scale * ref.v4_m_unit(cv) * 2.0**-6
    assert ((got["exp_avg"] - m).abs().reshape(-1) <= torch.maximum(m.abs().reshape(-1), least)).all()
    assert (got["exp_avg_sq"] <= 4 * v).all() and (got["exp_avg_sq"] >= v / 4).all()


@pytest.mark.parametrize("version", ["4bit_v2", "4bit_v3"])
def test_4bit_v2_and_v3_keep_m_and_v_close(version):
    """The converted checkpoint's moments are the old version's within one step of version 4's codes."""
    saved, params = _load(OLD[version])
    opt = ApexW4bit(params)
    opt.load_state_dict(saved["optimizer"])
    for i, p in enumerate(params):
        m, v = OLD[version].decode(saved["optimizer"]["state"][i])
        _within_a_4bit_code(opt.dequantized_state(p), m, v, opt.state[p])


def test_4bit_state_dict_says_its_version():
    """A saved entry holds fp32 m and v scales and every param group ``exp_avg_mv_version`` 4: it reloads as itself,
    bit for bit. The same tensors without the key are read as version 3 and converted; a version this package does
    not know is refused, naming it, and changes nothing."""
    p = torch.nn.Parameter(torch.randn(300))
    opt = ApexW4bit([p])
    p.grad = torch.randn(300)
    opt.step()
    sd = opt.state_dict()
    entry = sd["state"][0]
    assert entry["exp_avg_scale"].dtype == entry["exp_avg_sq_scale"].dtype == torch.float32
    assert sd["param_groups"][0][st.MV4_VERSION_KEY] == 4 and st.MV4_VERSION_KEY not in opt.param_groups[0]
    assert st.state_format_of(entry) == "4bit"
    q = torch.nn.Parameter(p.detach().clone())
    opt2 = ApexW4bit([q])
    opt2.load_state_dict(sd)
    assert all(same_bits(opt2.state[q][k], opt.state[p][k]) for k in ("exp_avg_mv", *st.SCALE_KEYS))
    assert st.MV4_VERSION_KEY not in opt2.param_groups[0]  # not a hyperparameter
    groups = [{k: v for k, v in g.items() if k != st.MV4_VERSION_KEY} for g in sd["param_groups"]]
    as_v3 = {**sd, "param_groups": groups}
    opt3 = ApexW4bit([torch.nn.Parameter(p.detach().clone())])
    opt3.load_state_dict(as_v3)
    m3, v3 = ref.dequantize_mv4_v3(entry["exp_avg_mv"], entry["exp_avg_scale"], entry["exp_avg_sq_scale"])
    want = st.init_state(p, "4bit")
    ref.store_moments(want, "4bit", m3, v3, ref.stream_key(0, 0, 1, ref.STREAM_MV))
    got = next(iter(opt3.state.values()))
    assert all(same_bits(got[k], want[k]) for k in ("exp_avg_mv", *st.SCALE_KEYS))
    future = {**sd, "param_groups": [{**g, st.MV4_VERSION_KEY: 5} for g in sd["param_groups"]]}
    before = _snapshot(opt2)
    with pytest.raises(ValueError, match="4-bit format version 5 .*reads versions 3 and 4"):
        opt2.load_state_dict(future)
    assert _same(opt2, before)
