"""Non-finite gradients: the reference's rule (a 256-element block with a NaN or inf gradient keeps its parameter,
moments and scales), the plain-PyTorch engine's and the numba path's bits against it, the counters, the warning and
the ``nonfinite`` option."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from apexw_hf import ApexW
from apexw_hf import formats as st
from apexw_hf import reference as ref
from apexw_hf.engines import torch as torch_engine
from apexw_hf.optim.nonfinite import NONFINITE_MODES

from .helpers import FORMATS, same_bits

HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def _step_ref(params, grads, states, fmt, step, seed=0):
    scalars = ref.StepScalars.make(step=step, **HP)
    return [
        ref.adamw_step_ref_(p, g, s, fmt=fmt, scalars=scalars, seed=seed, tensor_index=i, step=step)
        for i, (p, g, s) in enumerate(zip(params, grads, states))
    ]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_skips_exactly_the_bad_blocks(fmt, dtype):
    torch.manual_seed(0)
    n = 1100  # blocks 0..3 and a partial block 4
    p = torch.randn(n).to(dtype)
    s = st.init_state(p, fmt)
    _step_ref([p], [torch.randn(n).to(dtype)], [s], fmt, 1)
    g = torch.randn(n).to(dtype)
    g[300] = float("nan")  # block 1
    g[1090] = float("-inf")  # block 4, the partial one
    before_p, before_s = p.clone(), {k: v.clone() for k, v in s.items()}
    assert _step_ref([p], [g], [s], fmt, 2) == [2]
    bad = torch.zeros(n, dtype=torch.bool)
    bad[256:512] = bad[1024:] = True
    assert torch.equal(p[bad], before_p[bad]) and (p[~bad] != before_p[~bad]).any()
    for key, value in s.items():
        if key == "step":
            continue
        if value.numel() == n:
            assert torch.equal(value[bad], before_s[key][bad]), key
        else:  # scales: blocks 1 and 4 kept (4-bit: their two halves each, 2, 3 and 8)
            kept = [1, 4] if value.numel() == 5 else [2, 3, 8]
            changed = [i for i in range(value.numel()) if not torch.equal(value[i], before_s[key][i])]
            assert not set(kept) & set(changed), (key, changed)


def test_reference_finite_gradient_counts_nothing():
    p = torch.randn(300)
    assert _step_ref([p], [torch.randn(300)], [st.init_state(p, "8bit")], "8bit", 1) == [0]


@pytest.fixture(params=["numba", "passes"])
def cpu_path(request, monkeypatch):
    """Small chunks (4096 elements: direct chunks, tails and packed chunks in one group), on the fused numba path or
    the torch passes."""
    monkeypatch.setattr(torch_engine, "CHUNK", 4096)
    if request.param == "numba":
        if torch_engine.numba_engine() is None:
            pytest.skip("numba is not installed")
    else:
        monkeypatch.setattr(torch_engine.TorchEngine, "use_numba", False)
    return request.param


# a tensor of 100 elements first, so the next one starts at an odd multiple of 128 of a packed 4-bit chunk (its
# 256-element blocks straddle two of the numba path's 128-element blocks); 9000: two direct chunks and a tail
SHAPES = [(100,), (1000,), (9000,), (5,), (33, 65)]


def _bad_grads(step):
    gen = torch.Generator().manual_seed(step)
    grads = [torch.randn(s, generator=gen) for s in SHAPES]
    if step == 2:
        grads[1][200] = float("nan")  # the second half of block 0 of a tensor at chunk offset 128
        grads[2][4096 + 300] = float("inf")  # in the second direct chunk
        grads[2][8200] = float("-inf")  # in the tail
        grads[4].view(-1)[2000] = float("nan")
    if step == 3:
        grads[0][99] = float("inf")
        grads[3][:] = float("nan")
    return grads


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_engine_matches_reference(cpu_path, fmt, dtype):
    torch.manual_seed(1)
    values = [torch.randn(s).to(dtype) for s in SHAPES]
    params = [torch.nn.Parameter(v.clone()) for v in values]
    rp = [v.clone() for v in values]
    rs = [st.init_state(v, fmt) for v in values]
    opt = ApexW(params, lr=HP["lr"], weight_decay=HP["weight_decay"], state_format=fmt, engine="torch")
    expected = [0] * len(SHAPES)
    for step in range(1, 5):
        grads = _bad_grads(step)
        for p, g in zip(params, grads):
            p.grad = g.to(dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step()
        counts = _step_ref(rp, [g.to(dtype) for g in grads], rs, fmt, step)
        expected = [a + b for a, b in zip(expected, counts)]
    for p, r, s in zip(params, rp, rs):
        assert same_bits(p.detach(), r)
        for key, value in s.items():
            if key != "step":
                assert same_bits(opt.state[p][key], value), key
    counts = opt._nonfinite._read()[torch.device("cpu")]
    assert counts[1] == 2 and counts[2:] == expected
    assert opt.nonfinite_skipped == 2
    if cpu_path == "numba" and fmt in ("8bit", "4bit"):
        assert opt._cpu_engine.numba_used


def test_warning_names_the_first_parameter_once():
    a, b = torch.nn.Parameter(torch.randn(10)), torch.nn.Parameter(torch.randn(10))
    opt = ApexW([{"params": [a]}, {"params": [b]}], engine="torch")
    model = torch.nn.ParameterDict({"alpha": a, "beta": b})  # held weakly by the optimizer
    opt.set_parameter_names(model)
    b.grad, a.grad = torch.full((10,), float("nan")), torch.ones(10)
    with pytest.warns(RuntimeWarning, match=r"in parameter 'beta' \(param group 1, parameter 0, shape \(10,\)\)"):
        opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing new: no warning, here or in the report
        a.grad, b.grad = torch.ones(10), torch.ones(10)
        opt.step()
        assert opt.nonfinite_report() == 1


def test_raise_after_skipping():
    p = torch.nn.Parameter(torch.ones(300))
    opt = ApexW([p], engine="torch", nonfinite="raise", lr=0.1)
    p.grad = torch.ones(300)
    opt.step()
    p.grad[280] = float("inf")
    before = p.detach().clone()
    with pytest.raises(FloatingPointError, match=r"the parameter at param group 0, parameter 0, shape \(300,\)"):
        opt.step()
    assert torch.equal(p.detach()[256:], before[256:])  # block 1 was not updated
    assert not torch.equal(p.detach()[:256], before[:256])  # block 0 was
    assert float(opt.state[p]["step"]) == 2


def test_option_is_checked_and_copies_skip():
    with pytest.raises(ValueError, match=r"unknown nonfinite 'ignore'; allowed: 'skip', 'raise'"):
        ApexW([torch.nn.Parameter(torch.ones(2))], nonfinite="ignore")
    assert NONFINITE_MODES == ("skip", "raise")
    opt = ApexW([torch.nn.Parameter(torch.ones(2))], nonfinite="raise")
    assert copy.deepcopy(opt)._nonfinite.mode == "skip"  # the pickled state keeps no mode, as it keeps no hooks
