"""The engine contract (``apexw_hf.engines.Engine``), checked once for every engine through ``ApexW(engine=...)``.

Engines: the plain-PyTorch engine with its numba fast path (taken by 8-bit and 4-bit state), the same engine with
``TorchEngine.use_numba = False`` (the torch passes only), and the Triton engine (on the GPU, or on the CPU under the
Triton interpreter, ``conftest.py``). Formats: all four. Tiny tensors and 2-3 steps: the interpreter is slow.

Each check is what the ``Engine`` docstrings promise: (1) the steps are bit-identical to ``reference.adamw_step_ref_``
applied tensor by tensor (``reference_step``, the oracle of the torch engine's tests); (2) ``state["step"]`` moves only
for params with a gradient, and a param without one keeps its parameter and state; (3) a sparse gradient raises
RuntimeError, a gradient of another shape ValueError, and neither changes a parameter, a state tensor or a step
counter, on the first step or a later one; (4) a gradient with a NaN in one 256-element block leaves that block's
parameter and moments as they were, updates the rest, and counts the step in ``nonfinite_skipped``; (5) after
``load_state_dict`` (which calls ``invalidate()``), or state tensors replaced and ``invalidate()`` called, the next
step equals that of an unbroken run. (``load_state_dict`` also makes new param group dicts, which miss the engines'
caches, keyed by the group, anyway; the third case is the one where ``invalidate()`` alone keeps the engine right.)
"""

import copy
import warnings

import pytest
import torch

from apexw_hf import ApexW, engines

from ..kernels.helpers import DEVICE as TRITON_DEVICE
from ..optim.helpers import FORMATS
from ..optim.test_torch_engine import assert_same, reference_step

ENGINES = ["torch+numba", "torch", "triton"]
SPEC = [((1,), torch.float32), ((255,), torch.float32), ((257,), torch.bfloat16), ((33, 65), torch.float32)]
HP = dict(lr=1e-2, weight_decay=0.1, seed=3)
pytestmark = pytest.mark.filterwarnings("ignore:ApexW skipped:UserWarning")


def _device(engine):
    return TRITON_DEVICE if engine == "triton" else "cpu"


def _params(engine):
    gen = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen).to(_device(engine), dt)) for s, dt in SPEC]
    return ps


def _optimizer(params, engine, fmt):
    opt = ApexW(params, state_format=fmt, engine="triton" if engine == "triton" else "torch", **HP)
    if engine == "torch":
        engines.torch_engine(opt).use_numba = False
    return opt


def _grads(engine, steps, seed=1):
    """``steps`` rows of gradients, one per param, in the param's dtype."""
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen).to(_device(engine), dt) for s, dt in SPEC] for _ in range(steps)]


def _set(params, row):
    for p, g in zip(params, row):
        p.grad = None if g is None else g.clone()


def _twins(engine, fmt):
    """(engine optimizer, its params, oracle optimizer, its params): the oracle steps by ``reference_step``."""
    pa, pb = _params(engine), _params(engine)
    return _optimizer(pa, engine, fmt), pa, ApexW(pb, state_format=fmt, engine="torch", **HP), pb


def _step_both(opt, pa, oracle, pb, row):
    _set(pa, row)
    _set(pb, row)
    opt.step()
    reference_step(oracle)


def _snapshot(opt, params):
    return [p.detach().clone() for p in params], [
        {k: v.clone() for k, v in opt.state[p].items()} if p in opt.state else None for p in params
    ]


def _assert_engine_ran(opt, engine, fmt):
    if engine == "triton":
        assert opt._engine is not None and opt._cpu_engine is None
    else:
        assert opt._engine is None
        numba = engine == "torch+numba" and fmt in ("8bit", "4bit")
        assert opt._cpu_engine.numba_used == numba


cases = pytest.mark.parametrize("engine, fmt", [(e, f) for e in ENGINES for f in FORMATS])


@cases
def test_steps_match_the_reference(engine, fmt):
    opt, pa, oracle, pb = _twins(engine, fmt)
    for row in _grads(engine, 3):
        _step_both(opt, pa, oracle, pb, row)
        assert_same(opt, pa, oracle, pb)
    _assert_engine_ran(opt, engine, fmt)
    assert [float(opt.state[p]["step"]) for p in pa] == [3.0] * len(pa)


@cases
def test_step_counts_only_params_with_a_gradient(engine, fmt):
    opt, pa, oracle, pb = _twins(engine, fmt)
    rows = _grads(engine, 3)
    rows[0][3] = None  # never stepped in step 1: no state yet
    rows[1][1] = None  # has state, skips step 2
    rows[2][0] = None
    _step_both(opt, pa, oracle, pb, rows[0])
    assert pa[3] not in opt.state or not opt.state[pa[3]]
    kept_p, kept_s = _snapshot(opt, pa)
    _step_both(opt, pa, oracle, pb, rows[1])
    assert torch.equal(pa[1], kept_p[1])
    assert all(torch.equal(v, kept_s[1][k]) for k, v in opt.state[pa[1]].items())
    _step_both(opt, pa, oracle, pb, rows[2])
    assert_same(opt, pa, oracle, pb)
    assert [float(opt.state[p]["step"]) for p in pa] == [2.0, 2.0, 3.0, 2.0]


def _set_bad_grad(kind, p):
    if kind == "sparse":
        p.grad = torch.ones(p.shape, dtype=p.dtype, device=p.device).to_sparse()
    else:  # the .grad setter refuses another shape; its .data does not (as a hook or a buggy wrapper may do)
        p.grad = torch.ones(p.shape, dtype=p.dtype, device=p.device)
        p.grad.data = torch.ones(p.numel() + 1, dtype=p.dtype, device=p.device)


@cases
@pytest.mark.parametrize(
    "kind, error, match", [("sparse", RuntimeError, "sparse gradients"), ("shape", ValueError, "shape")]
)
@pytest.mark.parametrize("when", ["first", "later"])
def test_bad_gradient_raises_and_changes_nothing(engine, fmt, kind, error, match, when):
    opt, pa, oracle, pb = _twins(engine, fmt)
    rows = _grads(engine, 2)
    if when == "later":
        _step_both(opt, pa, oracle, pb, rows[0])
    kept_p, kept_s = _snapshot(opt, pa)
    _set(pa, rows[1])
    _set_bad_grad(kind, pa[3])  # the last param: the others come first in every loop over the group
    with pytest.raises(error, match=match):
        opt.step()
    for i, p in enumerate(pa):
        assert torch.equal(p, kept_p[i]), i
        state = opt.state.get(p)
        if kept_s[i] is None:
            assert not state, f"param {i} has state after a failed first step"
        else:
            assert state.keys() == kept_s[i].keys() and all(torch.equal(v, kept_s[i][k]) for k, v in state.items())
    _step_both(opt, pa, oracle, pb, rows[1])  # and the optimizer steps on as if the failed step never happened
    assert_same(opt, pa, oracle, pb)


@cases
def test_nonfinite_block_is_kept_and_counted(engine, fmt):
    opt, pa, oracle, pb = _twins(engine, fmt)
    rows = _grads(engine, 2)
    _step_both(opt, pa, oracle, pb, rows[0])
    p = pa[3]  # fp32, 2145 elements: blocks 0..8, block 1 gets the NaN
    before = p.detach().clone().reshape(-1)
    moments = opt.dequantized_state(p)
    rows[1][3].reshape(-1)[300] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _step_both(opt, pa, oracle, pb, rows[1])
    assert_same(opt, pa, oracle, pb)
    bad = torch.zeros(p.numel(), dtype=torch.bool)
    bad[256:512] = True
    after = p.detach().reshape(-1).cpu()
    before = before.cpu()
    assert torch.equal(after[bad], before[bad]) and (after[~bad] != before[~bad]).all()
    now = opt.dequantized_state(p)
    for key in ("exp_avg", "exp_avg_sq"):
        old, new = moments[key].reshape(-1).cpu(), now[key].reshape(-1).cpu()
        assert torch.equal(new[bad], old[bad]) and not torch.equal(new[~bad], old[~bad]), key
    assert opt.nonfinite_skipped == 1


@cases
@pytest.mark.parametrize("how", ["same optimizer", "fresh optimizer", "state replaced, invalidate()"])
def test_load_state_dict_then_step_equals_an_unbroken_run(engine, fmt, how):
    rows = _grads(engine, 3)
    pu, pa = _params(engine), _params(engine)
    unbroken, opt = _optimizer(pu, engine, fmt), _optimizer(pa, engine, fmt)
    for row in rows:
        _set(pu, row)
        unbroken.step()
    for row in rows[:2]:
        _set(pa, row)
        opt.step()
    # a deep copy: new state tensors, so the engine's cached views of the old ones (step counters, chunk plans,
    # launch tables) are stale unless load_state_dict's invalidate() drops them
    saved = copy.deepcopy(opt.state_dict())
    if how == "state replaced, invalidate()":
        # what load_state_dict does, without its new param group dicts (which miss every cache keyed by the group)
        for p in pa:
            opt.state[p] = {k: v.clone() for k, v in opt.state[p].items()}
        for e in engines.engines_of(opt):
            e.invalidate()
    else:
        if how == "fresh optimizer":
            opt = _optimizer(pa, engine, fmt)
        opt.load_state_dict(saved)
    _set(pa, rows[2])
    opt.step()
    assert_same(opt, pa, unbroken, pu)
