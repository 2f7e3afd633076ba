"""Bad input gets an error that names the problem."""

import pytest
import torch

from apexw_hf import ApexW


def P(*shape, **kw):
    return torch.nn.Parameter(torch.randn(*shape, **kw))


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(lr=-1e-3), ValueError, "learning rate -0.001: must be >= 0"),
        (
            dict(lr=torch.tensor([1e-3, 2e-3])),
            ValueError,
            r"^Tensor lr must be 1-element, got a tensor of shape \(2,\)",
        ),
        (dict(lr="0.1"), TypeError, "lr must be a number, got str"),
        (dict(eps=-1e-8), ValueError, "invalid eps"),
        (dict(weight_decay=-0.1), ValueError, "invalid weight_decay"),
        (dict(betas=(1.0, 0.999)), ValueError, r"invalid beta1 1.0: must be in \[0, 1\)"),
        (dict(betas=(0.9, -0.1)), ValueError, "invalid beta2"),
        (dict(betas=(0.9,)), ValueError, "betas must be a pair"),
        (
            dict(state_format="int4"),
            ValueError,
            "unknown state_format 'int4'; allowed: 'fp32', 'compact', '8bit', '4bit'",
        ),
        (dict(param_rounding="up"), ValueError, "unknown param_rounding 'up'"),
        (dict(engine="cuda"), ValueError, "unknown engine 'cuda'; allowed: 'auto', 'triton', 'torch'"),
        (dict(amsgrad=True), ValueError, "amsgrad=True is not supported"),
        (dict(seed=-1), ValueError, "seed must be an int"),
        (dict(maximize="yes"), TypeError, "maximize must be a bool"),
    ],
)
def test_bad_hyperparameters(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        ApexW([P(3)], **kwargs)


def test_lr_changed_after_construction_is_read_with_the_same_check():
    # a scheduler or user code may replace the group's lr after the constructor checked it: the step reads it with
    # the same reader before anything moves, so a multi-element tensor gets the same message and nothing changes
    p = P(3)
    opt = ApexW([p], lr=1e-3, engine="torch")
    opt.param_groups[0]["lr"] = torch.tensor([1e-3, 2e-3])
    p.grad = torch.ones(3)
    before = p.detach().clone()
    with pytest.raises(ValueError, match=r"^Tensor lr must be 1-element, got a tensor of shape \(2,\)"):
        opt.step()
    assert torch.equal(p.detach(), before)
    assert not opt.state.get(p)  # no state created, no step counted


def test_bad_group_override():
    with pytest.raises(ValueError, match="unknown state_format 'int8'"):
        ApexW([{"params": [P(3)], "state_format": "int8"}])
    with pytest.raises(ValueError, match="invalid learning rate"):
        ApexW([{"params": [P(3)], "lr": -1.0}])
    with pytest.raises(ValueError, match="seed is per optimizer"):
        ApexW([{"params": [P(3)], "seed": 3}])


def test_unknown_keyword_is_rejected():
    with pytest.raises(TypeError, match="fused"):
        ApexW([P(3)], fused=True)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.float64])
def test_unsupported_param_dtypes(dtype):
    with pytest.raises(TypeError, match=str(dtype).replace("torch.", "")):
        ApexW([torch.nn.Parameter(torch.zeros(3, dtype=dtype))])


def test_integer_params():
    with pytest.raises(TypeError, match="real floating-point parameters only, got a torch.int64"):
        ApexW([torch.zeros(3, dtype=torch.int64)])


def test_param_in_two_groups():
    p = P(3)
    with pytest.raises(ValueError, match="more than one parameter group"):
        ApexW([{"params": [p]}, {"params": [p]}])


def test_a_group_over_two_devices_steps_each_device_on_its_own(monkeypatch):
    """A param group may span devices (the Trainer's groups of a model dispatched over GPUs): each step hands the
    engine one device's tensors at a time, each under its own bucket name (its own cached launch plan)."""
    from apexw_hf import engines

    cpu, meta = [P(3), P(4)], [torch.nn.Parameter(torch.zeros(5, device="meta"))]
    opt = ApexW([cpu[0], meta[0], cpu[1]])
    calls = []

    class Recorder:
        def check(self, group, params, grads):
            pass

        def step_group(self, group, params, grads, states, tensor_indices, bucket=None, **_):
            calls.append(({p.device.type for p in params}, [id(p) for p in params], [id(g) for g in grads], bucket))

    monkeypatch.setattr(engines, "engine_for", lambda optimizer, group, params: Recorder())
    for p in (*cpu, *meta):
        p.grad = torch.ones_like(p)
    opt.step()
    assert calls == [
        ({"cpu"}, [id(p) for p in cpu], [id(p.grad) for p in cpu], (None, torch.device("cpu"))),
        ({"meta"}, [id(meta[0])], [id(meta[0].grad)], (None, torch.device("meta"))),
    ]


def test_sparse_gradient():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = ApexW(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        opt.step()


def test_auto_engine_on_cuda_without_triton_warns_once(monkeypatch):
    from apexw_hf import engines

    monkeypatch.setattr(engines, "_TRITON_OK", False)
    monkeypatch.setattr(engines, "_WARNED_NO_TRITON", False)
    with pytest.warns(RuntimeWarning, match="triton is not installed"):
        assert engines._auto_uses_triton(True) is False
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert engines._auto_uses_triton(True) is False  # only once
        assert engines._auto_uses_triton(False) is False  # CPU parameters: the plain path by design, no warning


def test_4bit_at_high_beta2_needs_no_warning():
    """Format version 2 decays v at every beta2 < 1 (version 1 warned from 0.9995 on: its v stopped decaying)."""
    import warnings

    from apexw_hf import ApexW4bit

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ApexW4bit([P(4)], betas=(0.9, 0.9999))
        opt = ApexW4bit([P(4)], betas=(0.9, 0.9998))
        opt.add_param_group({"params": [P(3)], "betas": (0.9, 0.99999)})
