"""The engine contract (``apexw_hf.engines.Engine``), checked once for every engine through ``ApexW(engine=...)`` and
by calling the engines directly with the arguments the contract names.

Engines: the plain-PyTorch engine with its numba fast path (taken by 8-bit and 4-bit state), the same engine with
``TorchEngine.use_numba = False`` (the torch passes only), and the Triton engine (on the GPU, or on the CPU under the
Triton interpreter, ``conftest.py``). Formats: all four. Tiny tensors and 2-3 steps: the interpreter is slow.

Each check is what the ``Engine`` docstrings promise: (1) the steps are bit-identical to ``reference.adamw_step_ref_``
applied tensor by tensor (``reference_step``, the oracle of the torch engine's tests); (2) ``state["step"]`` moves only
for params with a gradient, and a param without one keeps its parameter and state; (3) a sparse gradient raises
RuntimeError, a gradient of another shape ValueError, and neither changes a parameter, a state tensor or a step
counter, on the first step or a later one (``check`` raises the same, so the optimizer creates no state); (4) a
gradient with a NaN in one 256-element block leaves that block's parameter and moments as they were, updates the rest,
and counts the step in ``nonfinite_skipped``; (5) after ``load_state_dict`` (which calls ``invalidate()``), or state
tensors replaced and ``invalidate()`` called, the next step equals that of an unbroken run. (``load_state_dict`` also
makes new param group dicts, which miss the engines' caches, keyed by the group, anyway; the third case is the one
where ``invalidate()`` alone keeps the engine right.) Called directly: (6) the tensor indices given decide the random
streams (the reference's bits for those indices, not the positions); (7) ``grad_scale``, a tensor or a callable
(called once, with the launch plans on the Triton engine, None on the torch engine), gives the reference's bits for
the gradients multiplied by it in their dtype, and a NaN factor updates nothing; (8) the non-finite counters given
receive the skipped blocks under the tensor indices given.
"""

import copy
import warnings

import pytest
import torch

from apexw_hf import ApexW, engines

from ..kernels.helpers import DEVICE as TRITON_DEVICE
from ..optim.helpers import FORMATS
from .helpers import assert_same, reference_step

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
@pytest.mark.parametrize("poison", [float("nan"), 3e19])  # 3e19: finite, but its square overflows fp32
def test_nonfinite_block_is_kept_and_counted(engine, fmt, poison):
    opt, pa, oracle, pb = _twins(engine, fmt)
    rows = _grads(engine, 2)
    _step_both(opt, pa, oracle, pb, rows[0])
    p = pa[3]  # fp32, 2145 elements: blocks 0..8, block 1 gets the NaN
    before = p.detach().clone().reshape(-1)
    moments = opt.dequantized_state(p)
    rows[1][3].reshape(-1)[300] = poison
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
        # and new state dicts (which the optimizer would look up again): new tensors in the same dicts
        for p in pa:
            state = opt.state[p]
            state.update({k: v.clone() for k, v in state.items()})
        for e in engines.engines_of(opt):
            e.invalidate()
    else:
        if how == "fresh optimizer":
            opt = _optimizer(pa, engine, fmt)
        opt.load_state_dict(saved)
    _set(pa, rows[2])
    opt.step()
    assert_same(opt, pa, unbroken, pu)


# ---- the engines called directly -------------------------------------------------------------------------------


@torch.no_grad()  # as ApexW.step
def _step(engine, *args, **kwargs):
    engine.step_group(*args, **kwargs)


def _bare_engine(engine):
    if engine == "triton":
        from apexw_hf.engines.triton import TritonEngine

        return TritonEngine()
    from apexw_hf.engines.torch import TorchEngine

    e = TorchEngine()
    e.use_numba = engine == "torch+numba"
    return e


def _group(params, fmt):
    """A param group as ApexW makes one."""
    return dict(
        params=params,
        lr=HP["lr"],
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=HP["weight_decay"],
        state_format=fmt,
        maximize=False,
        param_rounding="stochastic",
        engine="auto",
        seed=HP["seed"],
    )


@torch.no_grad()
def _reference(group, params, grads, states, indices) -> list[int]:
    """One step of ``params`` by ``reference.adamw_step_ref_`` with the tensor indices ``indices``; the blocks each
    tensor skipped."""
    from apexw_hf import reference
    from apexw_hf.hparams import step_hparams

    skipped = []
    for p, g, state, i in zip(params, grads, states, indices):
        state["step"] += 1
        t = int(state["step"])
        skipped.append(
            reference.adamw_step_ref_(
                p,
                g,
                state,
                fmt=group["state_format"],
                scalars=reference.StepScalars.make(step=t, **step_hparams(group)),
                seed=group["seed"],
                tensor_index=i,
                step=t,
                maximize=group["maximize"],
                param_rounding=group["param_rounding"],
            )
        )
    return skipped


def _states(params, fmt):
    from apexw_hf.formats import init_state

    return [init_state(p, fmt) for p in params]


def _assert_same_direct(pa, sa, pb, sb):
    from ..optim.helpers import same_bits

    for i, (a, b) in enumerate(zip(pa, pb)):
        assert same_bits(a.detach(), b.detach()), f"param {i}"
        assert sa[i].keys() == sb[i].keys()
        for key in sa[i]:
            assert same_bits(sa[i][key], sb[i][key].to(sa[i][key].device)), f"param {i} state {key}"


class _Counters:
    """Non-finite counters (``engines.NonfiniteCounters``) of a test: a table per device."""

    serial = 5

    def __init__(self):
        self.tables = {}

    def counts(self, device):
        device = torch.device(device)
        if device not in self.tables:
            self.tables[device] = torch.zeros(2 + 16, dtype=torch.int32, device=device)
        return self.tables[device]

    def add(self, device, skipped):
        t = self.counts(device)
        for i, n in skipped.items():
            t[2 + i] += n
        t[1] += int(t[0]) != self.serial
        t[0] = self.serial


INDICES = [7, 2, 11, 5]  # not the positions: the engine must take the indices it is given


@cases
def test_tensor_indices_given_decide_the_random_streams(engine, fmt):
    pa, pb, pc = _params(engine), _params(engine), _params(engine)
    group = _group(pa, fmt)
    e = _bare_engine(engine)
    sa, sb, sc = _states(pa, fmt), _states(pb, fmt), _states(pc, fmt)
    for row in _grads(engine, 2):
        _step(e, group, pa, [g.clone() for g in row], sa, INDICES)
        _reference(group, pb, row, sb, INDICES)
        _reference(group, pc, row, sc, range(len(pc)))
    _assert_same_direct(pa, sa, pb, sb)
    # the bf16 parameter is rounded stochastically: its bits depend on its index
    assert not torch.equal(pb[2], pc[2])


@cases
@pytest.mark.parametrize("kind", ["tensor", "callable"])
def test_grad_scale_multiplies_each_gradient_in_its_dtype(engine, fmt, kind):
    pa, pb = _params(engine), _params(engine)
    group = _group(pa, fmt)
    e = _bare_engine(engine)
    sa, sb = _states(pa, fmt), _states(pb, fmt)
    coef = torch.tensor([0.3712], dtype=torch.float32, device=_device(engine))
    seen = []

    def scale(plans):
        seen.append(plans)
        return coef

    for row in _grads(engine, 2):
        _step(e, group, pa, [g.clone() for g in row], sa, INDICES, grad_scale=coef if kind == "tensor" else scale)
        _reference(group, pb, [g * coef.to(g.dtype) for g in row], sb, INDICES)
    _assert_same_direct(pa, sa, pb, sb)
    if kind == "callable":
        assert len(seen) == 2
        if engine == "triton":
            assert all(isinstance(plans, list) and plans for plans in seen)  # the launch plans, one per dtype
        else:
            assert seen == [None, None]


@cases
def test_nonfinite_counters_given_receive_the_counts(engine, fmt):
    pa, pb = _params(engine), _params(engine)
    group = _group(pa, fmt)
    e = _bare_engine(engine)
    sa, sb = _states(pa, fmt), _states(pb, fmt)
    counters = _Counters()
    row = _grads(engine, 1)[0]
    row[3].reshape(-1)[300] = float("nan")  # block 1 of the fp32 (33, 65) param, tensor index 5
    _step(e, group, pa, [g.clone() for g in row], sa, INDICES, nonfinite=counters)
    assert _reference(group, pb, row, sb, INDICES) == [0, 0, 0, 1]
    _assert_same_direct(pa, sa, pb, sb)
    (table,) = counters.tables.values()
    expected = torch.zeros_like(table)
    expected[0], expected[1], expected[2 + INDICES[3]] = counters.serial, 1, 1
    assert torch.equal(table, expected), table
    # a NaN factor: every block of every tensor is kept, and counted
    kept = [p.detach().clone() for p in pa]
    counters.serial += 1
    nan = torch.tensor([float("nan")], device=_device(engine))
    _step(e, group, pa, [g.clone() for g in _grads(engine, 1)[0]], sa, INDICES, grad_scale=nan, nonfinite=counters)
    assert all(torch.equal(p, k) for p, k in zip(pa, kept))
    for p, i in zip(pa, INDICES):
        expected[2 + i] += -(-p.numel() // 256)
    expected[0], expected[1] = counters.serial, 2
    assert torch.equal(table, expected), table


@cases
@pytest.mark.parametrize("kind, error", [("sparse", RuntimeError), ("shape", ValueError)])
def test_check_raises_what_step_group_raises(engine, fmt, kind, error):
    pa = _params(engine)
    group = _group(pa, fmt)
    e = _bare_engine(engine)
    grads = _grads(engine, 1)[0]
    e.check(group, pa, grads)  # good gradients: nothing to say
    _set_bad_grad(kind, pa[3])
    grads[3] = pa[3].grad
    with pytest.raises(error):
        e.check(group, pa, grads)
    states = _states(pa, fmt)
    kept = [{k: v.clone() for k, v in s.items()} for s in states]
    with pytest.raises(error):
        _step(e, group, pa, grads, states, INDICES)
    for s, k in zip(states, kept):
        assert all(torch.equal(s[key], k[key]) for key in k)
