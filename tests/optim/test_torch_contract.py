"""torch.optim's generic optimizer contract, run on ApexW and, as the control, on torch.optim.AdamW.

PyTorch checks every optimizer in ``test/test_optim.py`` (``TestOptimRenewed``) against a table of
``OptimizerInfo`` entries from ``torch.testing._internal.common_optimizers``. That module ships in the torch wheel;
test_optim.py does not. The optimizers here are described with torch's own ``OptimizerInfo`` / ``OptimizerInput``
classes, and the checks are this project's, modelled on test_optim.py's: the ones that apply to a CPU optimizer
(no CUDA, capturable or fused-versus-forloop parity). Every check runs on ``torch.optim.AdamW`` with the same inputs
too: a check that AdamW fails would be a wrong check, not an ApexW defect.

Where ApexW's contract differs from AdamW's on purpose, the entry says so the way torch says it for its own
optimizers: ``supported_impls=()`` (like LBFGS and SparseAdam) because ``foreach``, ``fused``, ``capturable`` and
``differentiable`` choose among torch's own implementations, and ApexW chooses its implementation with ``engine``
instead (accepting ``fused=True`` and running something else would be a silent fallback); ``supports_complex=False``
(like SparseAdam) with an error that names the dtype and the real-view workaround.
"""

import copy
import io
import pickle

import pytest
import torch
from torch.nn import Parameter
from torch.optim.lr_scheduler import ExponentialLR, LambdaLR, LinearLR, ReduceLROnPlateau, StepLR
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.testing._internal.common_optimizers import (
    OptimizerErrorEnum,
    OptimizerInfo,
    OptimizerInput,
    get_error_inputs_for_all_optims,
)

from apexw_hf import ApexW, ApexW4bit, ApexW8bit, ApexWCompact

FORMATS = ("fp32", "compact", "8bit", "4bit")
IMPL_FLAGS = ("foreach", "fused", "capturable", "differentiable")


def _shared_inputs():
    """Inputs that mean the same to ApexW and to torch.optim.AdamW (fresh tensors on every call)."""
    return [
        OptimizerInput(params=None, kwargs={}, desc="default"),
        OptimizerInput(params=None, kwargs={"lr": 0.01}, desc="non-default lr"),
        OptimizerInput(params=None, kwargs={"lr": torch.tensor(0.01)}, desc="tensor lr"),
        OptimizerInput(params=None, kwargs={"weight_decay": 0.1}, desc="nonzero weight_decay"),
        OptimizerInput(params=None, kwargs={"weight_decay": 0.1, "maximize": True}, desc="maximize"),
        OptimizerInput(params=None, kwargs={"betas": (0.8, 0.99)}, desc="non-default betas"),
        OptimizerInput(params=None, kwargs={"betas": (torch.tensor(0.8), torch.tensor(0.99))}, desc="tensor betas"),
    ]


def optim_inputs_func_adamw_control(device, dtype=None):
    return _shared_inputs()


def optim_inputs_func_apexw(device, dtype=None):
    out = []
    for fmt in FORMATS:
        for oi in _shared_inputs():
            kwargs = {**oi.kwargs, "state_format": fmt, "engine": "torch"}
            out.append(OptimizerInput(params=None, kwargs=kwargs, desc=f"{oi.desc}, {fmt}"))
    return out


def optim_inputs_func_apexw_subclass(device, dtype=None):
    """The subclasses only fix state_format, whose inputs ApexW's entry covers in full: a few inputs suffice."""
    return [
        OptimizerInput(params=None, kwargs={**oi.kwargs, "engine": "torch"}, desc=oi.desc)
        for oi in _shared_inputs()
        if oi.desc in ("default", "tensor lr", "maximize")
    ]


def _apexw_info(cls, inputs_func):
    return OptimizerInfo(
        cls,
        optim_inputs_func=inputs_func,
        optim_error_inputs_func=get_error_inputs_for_all_optims,
        supported_impls=(),
        supports_complex=False,
    )


APEXW_INFOS = [
    _apexw_info(ApexW, optim_inputs_func_apexw),
    _apexw_info(ApexWCompact, optim_inputs_func_apexw_subclass),
    _apexw_info(ApexW8bit, optim_inputs_func_apexw_subclass),
    _apexw_info(ApexW4bit, optim_inputs_func_apexw_subclass),
]
# The control runs in AdamW's default implementation for CPU parameters (the for-loop one).
CONTROL = OptimizerInfo(
    torch.optim.AdamW,
    optim_inputs_func=optim_inputs_func_adamw_control,
    optim_error_inputs_func=get_error_inputs_for_all_optims,
    supported_impls=(),
)
INFOS = [*APEXW_INFOS, CONTROL]
CASES = [
    pytest.param(info, i, id=f"{info.name}-{oi.desc}")
    for info in INFOS
    for i, oi in enumerate(info.optim_inputs_func(device="cpu"))
]
# For the slow checks (many steps): per entry and format, the float and the tensor lr.
LR_CASES = [case for case in CASES if case.id.split("-", 1)[1].split(",")[0] in ("default", "tensor lr")]


def _kwargs(info, index):
    """A fresh copy of one input's kwargs: schedulers write into tensor lrs in place."""
    return copy.deepcopy(info.optim_inputs_func(device="cpu")[index].kwargs)


def _weight_bias(seed=0):
    g = torch.Generator().manual_seed(seed)
    weight = Parameter(torch.randn(10, 5, generator=g))
    bias = Parameter(torch.randn(10, generator=g))
    return weight, bias, torch.randn(5, generator=g)


def _closure(opt, weight, bias, x, extra=()):
    """The loss of test_optim.py's linear model; ``extra`` parameters get a random gradient of their own."""

    def closure():
        opt.zero_grad()
        loss = (weight.mv(x) + bias).pow(2).sum()
        loss.backward()
        for p in extra:
            p.grad = torch.rand_like(p)
        return loss

    return closure


def assert_same(a, b, path="state_dict"):
    """Equal nested state dicts: same keys, same Python values, tensors equal bit for bit with the same dtype."""
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict)), f"{path}: {type(a)} vs {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}"
        assert torch.equal(a, b), f"{path}: tensors differ"
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{path}: keys {sorted(map(str, set(a) ^ set(b)))} in only one of them"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: lengths {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


def _primed(info, index, steps=5):
    """An optimizer over (weight, bias) after ``steps`` closure steps, with its params and input."""
    weight, bias, x = _weight_bias()
    opt = info.optim_cls([weight, bias], **_kwargs(info, index))
    for _ in range(steps):
        opt.step(_closure(opt, weight, bias, x))
    return opt, weight, bias, x


def _clone_params(*params):
    return [Parameter(p.detach().clone()) for p in params]


# ---- the optimizer moves the right way -------------------------------------------------------------------------


@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("info, index", CASES)
def test_goes_right_direction(info, index, contiguous):
    kwargs = _kwargs(info, index)
    if contiguous:
        weight, bias, x = _weight_bias()
    else:
        weight = Parameter(torch.randn(10, 5, 2)[..., 0])
        bias = Parameter(torch.randn(10, 2)[..., 0])
        x = torch.randn(5)
        assert not weight.is_contiguous()
    opt = info.optim_cls([weight, bias], **kwargs)
    closure = _closure(opt, weight, bias, x)
    initial = closure().item()
    for _ in range(20):
        opt.step(closure)
    if kwargs.get("maximize"):
        assert closure().item() > initial
    else:
        assert closure().item() < initial


SCHEDULERS = {
    "StepLR": lambda opt: StepLR(opt, gamma=0.9, step_size=10),
    "ReduceLROnPlateau": lambda opt: ReduceLROnPlateau(opt),
    "ExponentialLR": lambda opt: ExponentialLR(opt, gamma=0.9),
    "LinearLR": lambda opt: LinearLR(opt, start_factor=0.3, total_iters=5),
}


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("info, index", LR_CASES)
def test_goes_right_direction_with_lr_scheduler(info, index, scheduler):
    kwargs = _kwargs(info, index)
    weight, bias, x = _weight_bias()
    opt = info.optim_cls([weight, bias], **kwargs)
    sched = SCHEDULERS[scheduler](opt)
    closure = _closure(opt, weight, bias, x)
    initial = closure().item()
    for _ in range(20):
        loss = opt.step(closure)
        sched.step(loss.item()) if isinstance(sched, ReduceLROnPlateau) else sched.step()
    assert (closure().item() > initial) if kwargs.get("maximize") else (closure().item() < initial)


@pytest.mark.parametrize("info, index", CASES)
def test_lr_set_by_a_scheduler_is_the_lr_used(info, index):
    """An lr of 0 from the scheduler stops the parameters: the step reads the group's lr (a tensor in place) anew."""
    weight, bias, x = _weight_bias()
    opt = info.optim_cls([weight, bias], **_kwargs(info, index))
    sched = LambdaLR(opt, lambda k: 1.0 if k < 3 else 0.0)
    closure = _closure(opt, weight, bias, x)
    for k in range(6):
        before = [p.detach().clone() for p in (weight, bias)]
        opt.step(closure)
        sched.step()
        moved = any(not torch.equal(b, p) for b, p in zip(before, (weight, bias)))
        assert moved == (k < 3), f"step {k}: lr {opt.param_groups[0]['lr']}, moved={moved}"


@pytest.mark.parametrize("num_dim", [0, 1, 2])
@pytest.mark.parametrize("info, index", LR_CASES)
def test_tensor_lr_matches_float_lr(info, index, num_dim):
    """A 1-element lr tensor of any shape steps like the float it holds (torch: within fp32 tolerance; ApexW reads
    the lr once on the host, so there the bits are equal)."""
    kwargs = _kwargs(info, index)
    lr = torch.tensor(float(kwargs.get("lr", 1e-3))).item()  # the fp32 value, so both runs have one number
    runs = []
    for value in (lr, torch.tensor(lr).reshape([1] * num_dim)):
        weight, bias, x = _weight_bias()
        opt = info.optim_cls([weight, bias], **{**_kwargs(info, index), "lr": value})
        for _ in range(5):
            opt.step(_closure(opt, weight, bias, x))
        runs.append((weight.detach(), bias.detach()))
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b)
        if info is not CONTROL:
            assert torch.equal(a, b)


def test_tensor_lr_control_is_meaningful():
    """The tensor-lr check above sees an lr: a different lr gives different parameters."""
    ends = []
    for lr in (1e-3, torch.tensor(2e-3)):
        weight, bias, x = _weight_bias()
        opt = ApexW([weight, bias], lr=lr, engine="torch")
        opt.step(_closure(opt, weight, bias, x))
        ends.append(weight.detach())
    assert not torch.equal(*ends)


# ---- param groups --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("info, index", CASES)
def test_param_groups_weight_decay(info, index):
    kwargs = _kwargs(info, index)
    weight, bias, x = _weight_bias()
    opt = info.optim_cls([dict(params=[weight], **kwargs), dict(params=[bias], **{**kwargs, "weight_decay": 0.0})])
    closure = _closure(opt, weight, bias, x)
    initial = closure().item()
    for _ in range(20):
        opt.step(closure)
    assert (closure().item() > initial) if kwargs.get("maximize") else (closure().item() < initial)
    assert opt.param_groups[1]["weight_decay"] == 0.0


@pytest.mark.parametrize("info, index", CASES)
def test_param_groups_lr(info, index):
    """The outer lr of 1e-28 reaches only the group without its own lr: that group's parameter does not move."""
    kwargs = _kwargs(info, index)
    kwargs.setdefault("lr", 1e-3)
    weight, bias, x = _weight_bias()
    irrelevant = Parameter(torch.randn(2))
    irrelevant_start = irrelevant.detach().clone()
    opt = info.optim_cls([dict(params=[weight, bias], **kwargs), dict(params=[irrelevant])], lr=1e-28)
    closure = _closure(opt, weight, bias, x, extra=[irrelevant])
    initial = closure().item()
    for _ in range(20):
        opt.step(closure)
    assert opt.state[irrelevant]["step"].item() == 20, "the group with the tiny lr was stepped"
    assert (closure().item() > initial) if kwargs.get("maximize") else (closure().item() < initial)
    assert torch.equal(irrelevant.detach(), irrelevant_start)


@pytest.mark.parametrize("info, index", CASES)
def test_add_param_group_later(info, index):
    """A group added after some steps takes the defaults, is stepped, and round-trips through state_dict."""
    opt, weight, bias, x = _primed(info, index, steps=2)
    extra = Parameter(torch.randn(7))
    opt.add_param_group({"params": [extra], "weight_decay": 0.0})
    assert opt.param_groups[1]["lr"] is not None and opt.param_groups[1]["weight_decay"] == 0.0
    assert set(opt.param_groups[1]) == set(opt.param_groups[0])
    start = extra.detach().clone()
    opt.step(_closure(opt, weight, bias, x, extra=[extra]))
    assert not torch.equal(extra.detach(), start)
    twin = info.optim_cls(_clone_params(weight, bias), **_kwargs(info, index))
    twin.add_param_group({"params": _clone_params(extra)})
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert_same(twin.state_dict(), opt.state_dict())


def test_add_param_group_after_deepcopy_gains_no_torch_only_key():
    """(a) torch's __setstate__ puts differentiable into the defaults, which add_param_group copies into a group."""
    opt = copy.deepcopy(ApexW([Parameter(torch.randn(3))], engine="torch"))
    opt.add_param_group({"params": [Parameter(torch.randn(3))]})
    assert "differentiable" not in opt.param_groups[1]
    assert "differentiable" not in opt.defaults


# ---- steps without gradients, empty tensors, zero_grad -------------------------------------------------------


@pytest.mark.parametrize("info, index", CASES)
def test_step_is_noop_when_params_have_no_grad(info, index):
    params = [torch.randn(2, 3, requires_grad=False) for _ in range(2)]
    old = [p.clone() for p in params]
    opt = info.optim_cls(params, **_kwargs(info, index))
    opt.step(lambda: torch.tensor([1.0]))
    assert all(torch.equal(a, b) for a, b in zip(old, params))
    assert not opt.state


@pytest.mark.parametrize("info, index", CASES)
def test_step_is_noop_for_zero_grads(info, index):
    """Without weight decay a zero gradient leaves the parameter exactly as it was (state stays at zero)."""
    param = Parameter(torch.randn(5, 1))
    old = param.detach().clone()
    opt = info.optim_cls([param], **{**_kwargs(info, index), "weight_decay": 0.0})
    for _ in range(3):
        param.grad = torch.zeros_like(param)
        opt.step()
    assert torch.equal(param.detach(), old)


@pytest.mark.parametrize("info, index", CASES)
def test_zero_size_params(info, index):
    """Parameters with no elements (and a 0-dim one) step beside a normal one without error."""
    empty, empty2d, scalar, normal = (Parameter(torch.randn(s)) for s in [(0,), (3, 0), (), (4,)])
    opt = info.optim_cls([empty, empty2d, scalar, normal], **_kwargs(info, index))
    start = normal.detach().clone()
    for p in (empty, empty2d, scalar, normal):
        p.grad = torch.randn_like(p)
    opt.step()
    opt.step()
    assert not torch.equal(normal.detach(), start)
    assert empty.shape == (0,) and empty2d.shape == (3, 0)
    assert_same(_roundtrip(opt.state_dict()), opt.state_dict())


@pytest.mark.parametrize("info, index", CASES)
def test_zero_grad(info, index):
    weight, bias, x = _weight_bias()
    opt = info.optim_cls([weight, bias], **_kwargs(info, index))
    _closure(opt, weight, bias, x)()
    grad = weight.grad
    opt.zero_grad(set_to_none=False)
    assert weight.grad is grad and not weight.grad.any() and not bias.grad.any()
    opt.zero_grad()
    assert weight.grad is None and bias.grad is None


@pytest.mark.parametrize("info, index", CASES)
def test_step_with_closure_returns_its_loss(info, index):
    weight, bias, x = _weight_bias()
    opt = info.optim_cls([weight, bias], **_kwargs(info, index))
    seen = {}

    def closure():
        seen["grad_enabled"] = torch.is_grad_enabled()
        return _closure(opt, weight, bias, x)()

    with torch.no_grad():  # step must enable grad for the closure itself
        loss = opt.step(closure)
    assert seen["grad_enabled"] and isinstance(loss, torch.Tensor) and loss.requires_grad
    assert opt.step() is None


@pytest.mark.parametrize("info, index", CASES)
def test_step_is_not_differentiable(info, index):
    """differentiable=False, torch's default and ApexW's only mode: the update records no autograd graph."""
    weight, bias, x = _weight_bias()
    opt = info.optim_cls([weight, bias], **_kwargs(info, index))
    with torch.enable_grad():
        opt.step(_closure(opt, weight, bias, x))
    assert weight.is_leaf and weight.grad_fn is None and weight.requires_grad


@pytest.mark.parametrize("info", APEXW_INFOS, ids=lambda i: i.name)
@pytest.mark.parametrize("flag", IMPL_FLAGS)
def test_implementation_flags_are_not_constructor_arguments(info, flag):
    """supported_impls=(): ApexW picks its implementation with engine=; a torch flag is refused, never ignored."""
    with pytest.raises(TypeError, match=flag):
        info.optim_cls([Parameter(torch.randn(3))], **{flag: False})


@pytest.mark.parametrize("info", INFOS, ids=lambda i: i.name)
def test_optim_infos_do_not_specify_implementation_flags(info):
    for oi in info.optim_inputs_func(device="cpu"):
        assert not set(oi.kwargs) & set(IMPL_FLAGS), oi.desc


# ---- printing, copying, pickling -----------------------------------------------------------------------------


@pytest.mark.parametrize("info, index", CASES)
def test_optimizer_can_be_printed(info, index):
    opt = info.optim_cls([Parameter(torch.randn(2, 3)) for _ in range(2)], **_kwargs(info, index))
    text = repr(opt)
    assert info.optim_cls.__name__ in text and "lr:" in text and "weight_decay:" in text


def _public_attrs(obj):
    return {k for k in obj.__dict__ if not k.startswith("_")}


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("info, index", CASES)
def test_copy_continues_identically(info, index, how):
    opt, weight, bias, x = _primed(info, index, steps=3)
    if how == "deepcopy":
        twin_opt, twin_w, twin_b = copy.deepcopy((opt, weight, bias))
    else:
        twin_opt, twin_w, twin_b = pickle.loads(pickle.dumps((opt, weight, bias)))
    assert _public_attrs(twin_opt) == _public_attrs(opt)
    assert twin_opt.param_groups[0]["params"][0] is twin_w
    assert_same(twin_opt.state_dict(), opt.state_dict())
    for _ in range(3):
        opt.step(_closure(opt, weight, bias, x))
        twin_opt.step(_closure(twin_opt, twin_w, twin_b, x))
    assert torch.equal(weight.detach(), twin_w.detach()) and torch.equal(bias.detach(), twin_b.detach())
    assert_same(twin_opt.state_dict(), opt.state_dict())


# ---- state_dict / load_state_dict ----------------------------------------------------------------------------


def _roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("info, index", CASES)
def test_state_dict_deterministic(info, index):
    """A resumed optimizer steps like the original, and its state_dict() equals the original's."""
    opt, weight, bias, x = _primed(info, index, steps=10)
    weight_c, bias_c = _clone_params(weight, bias)
    opt_c = info.optim_cls([weight_c, bias_c], **_kwargs(info, index))
    opt_c.load_state_dict(copy.deepcopy(opt.state_dict()))
    for _ in range(10):
        opt.step(_closure(opt, weight, bias, x))
        opt_c.step(_closure(opt_c, weight_c, bias_c, x))
        assert torch.equal(weight.detach(), weight_c.detach()) and torch.equal(bias.detach(), bias_c.detach())
    assert_same(opt.state_dict(), opt_c.state_dict())
    # repeated parameters have one representation (pytorch#36831)
    opt_c.param_groups.extend(opt_c.param_groups)
    assert_same(opt.state_dict()["param_groups"][-1], opt_c.state_dict()["param_groups"][-1])


@pytest.mark.parametrize("info, index", CASES)
def test_resumed_state_dict_has_the_original_group_keys(info, index):
    """(a) load_state_dict must not add keys to the groups (torch's __setstate__ adds differentiable to defaults)."""
    opt, *_ = _primed(info, index, steps=1)
    saved = opt.state_dict()
    resumed = info.optim_cls([Parameter(torch.randn(10, 5)), Parameter(torch.randn(10))], **_kwargs(info, index))
    resumed.load_state_dict(_roundtrip(saved))
    for got, want in zip(resumed.state_dict()["param_groups"], saved["param_groups"]):
        assert set(got) == set(want), f"keys gained {set(got) - set(want)}, lost {set(want) - set(got)}"
    opt.load_state_dict(opt.state_dict())  # loading into itself, twice, changes nothing either
    opt.load_state_dict(opt.state_dict())
    assert_same(opt.state_dict(), saved)


@pytest.mark.parametrize("info, index", CASES)
def test_can_load_older_state_dict(info, index):
    """State dicts from before maximize and the implementation flags existed still load and step."""
    opt, weight, bias, x = _primed(info, index, steps=3)
    old = copy.deepcopy(opt.state_dict())
    for group in old["param_groups"]:
        for flag in ("maximize", *IMPL_FLAGS):
            group.pop(flag, None)
    opt.load_state_dict(old)
    assert "maximize" in opt.param_groups[0]
    opt.step(_closure(opt, weight, bias, x))


@pytest.mark.parametrize("info, index", CASES)
def test_load_nontensor_step(info, index):
    opt, weight, bias, x = _primed(info, index, steps=3)
    sd = copy.deepcopy(opt.state_dict())
    for entry in sd["state"].values():
        entry["step"] = entry["step"].item()
    opt.load_state_dict(sd)
    assert all(torch.is_tensor(s["step"]) and s["step"].item() == 3 for s in opt.state.values())
    opt.step(_closure(opt, weight, bias, x))


@pytest.mark.parametrize("info, index", CASES)
def test_load_state_dict_with_param_groups(info, index):
    """Per-group hyperparameters come from the state dict, parameters stay this optimizer's."""
    kwargs = _kwargs(info, index)
    weight, bias, x = _weight_bias()
    opt = info.optim_cls([dict(params=[weight]), dict(params=[bias], weight_decay=0.0, lr=5e-3)], **kwargs)
    for _ in range(3):
        opt.step(_closure(opt, weight, bias, x))
    weight_c, bias_c = _clone_params(weight, bias)
    opt_c = info.optim_cls([dict(params=[weight_c]), dict(params=[bias_c])], **kwargs)
    opt_c.load_state_dict(_roundtrip(opt.state_dict()))
    assert opt_c.param_groups[1]["lr"] == 5e-3 and opt_c.param_groups[1]["weight_decay"] == 0.0
    assert opt_c.param_groups[0]["params"] == [weight_c] and opt_c.param_groups[1]["params"] == [bias_c]
    for _ in range(3):
        opt.step(_closure(opt, weight, bias, x))
        opt_c.step(_closure(opt_c, weight_c, bias_c, x))
    assert torch.equal(weight.detach(), weight_c.detach()) and torch.equal(bias.detach(), bias_c.detach())
    with pytest.raises(ValueError):
        info.optim_cls([weight_c, bias_c], **kwargs).load_state_dict(opt.state_dict())  # one group, not two


@pytest.mark.parametrize("info, index", LR_CASES)
def test_named_parameters(info, index):
    """Parameters given as (name, tensor) pairs: the names travel in the state dict, and a resume keeps them."""
    opt, weight, bias, x = _primed(info, index, steps=0)
    named = info.optim_cls([("weight", weight), ("bias", bias)], **_kwargs(info, index))
    named.step(_closure(named, weight, bias, x))
    sd = named.state_dict()
    assert sd["param_groups"][0]["param_names"] == ["weight", "bias"]
    twin = info.optim_cls(list(zip(["weight", "bias"], _clone_params(weight, bias))), **_kwargs(info, index))
    twin.load_state_dict(_roundtrip(sd))
    assert_same(twin.state_dict(), sd)
    if info is not CONTROL:  # and they reach the torch AdamW export
        assert named.to_torch_adamw_state_dict()["param_groups"][0]["param_names"] == ["weight", "bias"]


# ---- hooks ---------------------------------------------------------------------------------------------------


def _state_dict_pre_hook(optimizer):
    optimizer.state["test"] = 1


def _state_dict_post_hook(optimizer, state_dict):
    state_dict["ran_state_dict_pre_hook"] = state_dict["state"].pop("test", None) == 1
    return state_dict


@pytest.mark.parametrize("info, index", CASES)
def test_state_dict_hooks(info, index):
    param = Parameter(torch.rand(2, 3))
    opt = info.optim_cls([param], **_kwargs(info, index))
    pre = opt.register_state_dict_pre_hook(_state_dict_pre_hook)
    assert opt.state_dict()["state"]["test"] == 1
    post = opt.register_state_dict_post_hook(_state_dict_post_hook)
    sd = opt.state_dict()
    assert "test" not in sd["state"] and sd["ran_state_dict_pre_hook"] is True
    pre.remove()
    opt.state.pop("test")
    assert opt.state_dict()["ran_state_dict_pre_hook"] is False
    post.remove()
    assert "ran_state_dict_pre_hook" not in opt.state_dict()


@pytest.mark.parametrize("info, index", CASES)
def test_load_state_dict_pre_hook_and_prepend(info, index):
    opt = info.optim_cls([Parameter(torch.rand(2, 3))], **_kwargs(info, index))
    sd = opt.state_dict()

    def set_lr_in_place(optimizer, state_dict):
        state_dict["param_groups"][0]["lr"] = 0.002

    def replace_with_copy(optimizer, state_dict):
        mine = copy.deepcopy(state_dict)
        mine["param_groups"][0]["lr"] = 0.003
        return mine

    opt.register_load_state_dict_pre_hook(set_lr_in_place)
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 0.002
    opt.register_load_state_dict_pre_hook(replace_with_copy, prepend=True)
    opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 0.002  # the prepended hook ran first, the other one overrode it


@pytest.mark.parametrize("info, index", CASES)
def test_load_state_dict_pre_hook_edits_the_state(info, index):
    """What a pre-hook returns is what gets loaded, the state included (a hook that remaps old checkpoints)."""
    opt, *_ = _primed(info, index, steps=3)
    target = info.optim_cls(_clone_params(*opt.param_groups[0]["params"]), **_kwargs(info, index))

    def drop_bias_state_and_restep(optimizer, state_dict):
        state_dict = copy.deepcopy(state_dict)
        del state_dict["state"][1]
        state_dict["state"][0]["step"] = torch.tensor(7.0)
        return state_dict

    target.register_load_state_dict_pre_hook(drop_bias_state_and_restep)
    target.load_state_dict(opt.state_dict())
    weight_c, bias_c = target.param_groups[0]["params"]
    assert target.state[weight_c]["step"].item() == 7 and bias_c not in target.state


@pytest.mark.parametrize("info, index", CASES)
def test_load_state_dict_post_hook_sees_the_loaded_state(info, index):
    opt, *_ = _primed(info, index, steps=3)
    target = info.optim_cls(_clone_params(*opt.param_groups[0]["params"]), **_kwargs(info, index))
    seen = {}

    def post_hook(optimizer):
        seen["steps"] = [s["step"].item() for s in optimizer.state.values()]
        seen["group"] = dict(optimizer.param_groups[0])

    def replace_lr(optimizer, state_dict):
        mine = copy.deepcopy(state_dict)
        mine["param_groups"][0]["lr"] = 0.003
        return mine

    target.register_load_state_dict_post_hook(post_hook)
    target.register_load_state_dict_pre_hook(replace_lr)
    target.load_state_dict(opt.state_dict())
    assert seen["steps"] == [3.0, 3.0]
    assert seen["group"]["lr"] == 0.003 and seen["group"].keys() == opt.param_groups[0].keys()


def _increment(counter):
    def hook(opt, args, kwargs):
        counter.append(1)

    return hook


@pytest.mark.parametrize("info, index", CASES)
def test_step_hooks(info, index):
    params = [torch.tensor([1.0, 1.0])]
    opt = info.optim_cls(params, **_kwargs(info, index))
    other = torch.optim.SGD(params)
    order = []
    handles = [
        register_optimizer_step_pre_hook(lambda o, a, k: order.append("global pre")),
        register_optimizer_step_post_hook(lambda o, a, k: order.append("global post")),
        opt.register_step_pre_hook(lambda o, a, k: order.append(f"pre {type(o).__name__}")),
        opt.register_step_post_hook(lambda o, a, k: order.append(f"post {type(o).__name__}")),
    ]
    try:
        opt.step()
        other.step()
    finally:
        for h in handles:
            h.remove()
    name = info.optim_cls.__name__
    assert order == ["global pre", f"pre {name}", f"post {name}", "global post", "global pre", "global post"]
    opt.step()
    assert len(order) == 6, "removed hooks must not run"


# ---- complex parameters and bad input ------------------------------------------------------------------------


@pytest.mark.parametrize("info, index", CASES)
def test_complex_params(info, index):
    """AdamW updates a complex parameter as its real view; ApexW refuses it with a clear error instead."""
    kwargs = _kwargs(info, index)
    complex_params = [torch.randn(10, 5, dtype=torch.complex64, requires_grad=True), torch.randn(10, 5)]
    if not info.supports_complex:
        with pytest.raises(
            TypeError, match=r"real floating-point parameters only, got a torch\.complex64.*view_as_real"
        ):
            info.optim_cls(complex_params, **kwargs)
        return
    real_params = [torch.view_as_real(complex_params[0]).detach().clone().requires_grad_(), complex_params[1].clone()]
    complex_opt = info.optim_cls(complex_params, **kwargs)
    real_opt = info.optim_cls(real_params, **copy.deepcopy(kwargs))
    for _ in range(3):
        for cp, rp in zip(complex_params, real_params):
            rp.grad = torch.randn_like(rp)
            cp.grad = torch.view_as_complex(rp.grad) if cp.is_complex() else rp.grad.clone()
        complex_opt.step()
        real_opt.step()
    assert torch.equal(torch.view_as_real(complex_params[0]).detach(), real_params[0].detach())


@pytest.mark.parametrize("info", INFOS, ids=lambda i: i.name)
def test_errors(info):
    """torch's error inputs for every optimizer: same exception type and a message matching torch's regex."""
    for error_input in info.optim_error_inputs_func(device="cpu", dtype=torch.float32):
        oi = error_input.optimizer_error_input
        assert error_input.error_on == OptimizerErrorEnum.CONSTRUCTION_ERROR
        if issubclass(error_input.error_type, Warning):
            with pytest.warns(error_input.error_type, match=error_input.error_regex):
                info.optim_cls(oi.params, **oi.kwargs)
        else:
            with pytest.raises(error_input.error_type, match=error_input.error_regex):
                params = oi.params if oi.params is not None else [Parameter(torch.randn(2))]
                info.optim_cls(params, **oi.kwargs)
