"""Gradient release: ApexW steps parameters inside backward; the same bits as step(), and the refusals."""

from __future__ import annotations

import copy

import pytest
import torch

from apexw_hf import ApexW
from apexw_hf.optim import release as release_module

from .helpers import FORMATS
from .release_model import TinyLM, groups, loss_of, make, train, train_from, train_tied_from


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("checkpoint", [None, "reentrant", "non_reentrant"])
def test_release_is_bit_identical_to_step(fmt, checkpoint):
    """Several groups, tied weights, a frozen tensor, checkpointing, an lr schedule, buckets of several tensors."""
    dtype = torch.bfloat16 if fmt in ("8bit", "4bit") else torch.float32
    a, b = make(checkpoint=checkpoint, dtype=dtype), make(checkpoint=checkpoint, dtype=dtype)
    oa = ApexW(groups(a), lr=2e-2, state_format=fmt, engine="torch")
    ob = ApexW(groups(b), lr=2e-2, state_format=fmt, engine="torch", gradient_release=True, release_bucket_size=700)
    sa = torch.optim.lr_scheduler.LambdaLR(oa, lambda t: 1.0 / (1 + t))
    sb = torch.optim.lr_scheduler.LambdaLR(ob, lambda t: 1.0 / (1 + t))
    train(a, oa, 4, sa)
    train(b, ob, 4, sb)
    assert ob._release.flushes > 4  # more than one bucket per step: the buckets really split the model
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    assert not b.frozen.requires_grad and torch.equal(a.frozen, b.frozen)
    sd_a, sd_b = oa.state_dict(), ob.state_dict()
    for i, entry in sd_a["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, sd_b["state"][i][key]), (i, key)
    assert sd_b["gradient_release"]["prev_grad_norm"] > 0


def test_a_bucket_holds_one_param_group_until_backward_ends():
    """Each group fills its own bucket (one launch per bucket): inside backward a flush steps one group; only the
    end-of-backward flush takes what is left of every group. Same bits as step() (the test above)."""
    model = make()
    opt = ApexW(groups(model), state_format="8bit", engine="torch", gradient_release=True, release_bucket_size=300)
    release, launched = opt._release, []
    step_params = opt._step_params

    def record(group, params, grads, bucket=None, grad_scale=None):
        launched.append((release.flushes, opt.param_groups.index(group), len(params)))
        return step_params(group, params, grads, bucket=bucket, grad_scale=grad_scale)

    opt._step_params = record
    loss_of(model, 0).backward()
    last = release.flushes - 1  # the end-of-backward flush
    inside = [(f, g) for f, g, _ in launched if f < last]
    assert len({f for f, _ in inside}) >= 3, launched  # the bucket size really split backward
    for f in {f for f, _ in inside}:
        assert len({g for ff, g in inside if ff == f}) == 1, launched  # one group per flush inside backward
    assert {g for _, g, _ in launched} == {0, 1}
    assert sum(n for *_, n in launched) == sum(p.requires_grad for p in model.parameters())
    opt.step()
    opt.zero_grad()


def test_clipping_follows_its_rule_and_logs_the_true_norm():
    """max_grad_norm with one bucket: the estimate is the step's own norm from the second step on (exact clipping);
    the first step uses the norm so far; grad_norm is the true norm."""
    model = make()
    opt = ApexW(model.parameters(), lr=1e-2, state_format="fp32", gradient_release=True, max_grad_norm=0.05)
    ref = make()
    ref_opt = ApexW(ref.parameters(), lr=1e-2, state_format="fp32")
    prev = prev_sumsq = None
    for t in range(3):
        loss_of(ref, t).backward()
        grads = [p.grad for p in ref.parameters() if p.grad is not None]
        true_norm = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square().sum().sqrt()
        # one bucket (the default bucket size holds the whole model): its share of the previous step's squared norm
        # is 1 up to rounding, so the estimate is this step's own norm (exact clipping)
        sumsq = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square().sum()
        if prev is None:
            est = sumsq.sqrt()
        else:
            est = torch.maximum(sumsq / (prev_sumsq / prev.square()), sumsq).sqrt()
        coef = torch.clamp(0.05 / (est + 1e-6), max=1)
        prev_sumsq = sumsq
        torch._foreach_mul_(grads, coef)
        ref_opt.step()
        ref_opt.zero_grad()
        loss_of(model, t).backward()
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(opt.grad_norm, true_norm, rtol=1e-6, atol=0)
        assert 0 < coef < 1  # the clip was active in every step
        prev = opt.grad_norm
        for p, q in zip(ref.parameters(), model.parameters()):
            # the sums of squares run in hook order here and in parameter order there: equal up to rounding
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


class Detour(torch.nn.Module):
    """A stack of 64-wide layers whose middle layer is used only when asked: its parameters get a gradient in some
    steps and not in others (as an unused expert does)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.mid, self.extra, self.top = (torch.nn.Linear(8 if i == 0 else 64, 64) for i in range(4))
        self.head = torch.nn.Linear(64, 8)

    def forward(self, x, detour):
        h = torch.tanh(self.mid(torch.tanh(self.inp(x))))
        if detour:
            h = torch.tanh(self.extra(h))
        return self.head(torch.tanh(self.top(h)))


def test_clipping_estimate_falls_back_from_the_first_bucket_that_changed(monkeypatch):
    """The share estimate needs the previous step's running sums at the same buckets: from the first bucket that is
    not the previous step's (a layer used in one step and not the next) the step uses the fallback rule."""
    from apexw_hf.optim import release

    model = Detour()
    opt = ApexW(model.parameters(), lr=1e-3, gradient_release=True, max_grad_norm=0.01, release_bucket_size=4000)
    calls, impl = [], release._norm_impl

    def record(device):
        inner = impl(device)

        def norm(parts, squared, cum, k, prev_cum, *rest):
            calls[-1].append(prev_cum is not None)
            return inner(parts, squared, cum, k, prev_cum, *rest)

        return norm

    monkeypatch.setattr(release, "_norm_impl", record)
    detours = [False, False, True, True, False]
    for t, detour in enumerate(detours):
        calls.append([])
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(t))
        model(x, detour).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert all(len(c) >= 3 for c in calls), calls  # several buckets per step
    assert not any(calls[0])  # the first step: nothing to compare with
    assert all(calls[1]) and all(calls[3])  # the same buckets as the step before
    for t in (2, 4):  # the detour's layer joins or leaves: the head and top layer's bucket comes first and is the same
        assert calls[t][0] and not any(calls[t][1:]), (t, calls[t])


class _FailOnce(torch.autograd.Function):
    """Identity whose backward raises the first time (as an out-of-memory error in the middle of backward would)."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if _FailOnce.armed:
            _FailOnce.armed = False
            raise RuntimeError("simulated out of memory")
        return g


@pytest.mark.parametrize("recover", ["zero_grad", "step"])
def test_training_goes_on_after_a_backward_pass_that_raised(recover):
    """A backward pass raises after the output layer was released: ``zero_grad()`` gives up that step (the released
    tensors keep their update, the waiting gradients are dropped), ``step()`` finishes it (the waiting gradients are
    applied); either way the next backward passes release every gradient within backward again, the last ones (the
    input scale's, below a bucket) by the end-of-backward flush."""
    torch.manual_seed(0)
    scale, first, last = torch.nn.Parameter(torch.ones(8)), torch.nn.Linear(8, 64), torch.nn.Linear(64, 8)
    params = [scale, *first.parameters(), *last.parameters()]
    opt = ApexW(params, lr=1e-2, gradient_release=True, max_grad_norm=1.0, release_bucket_size=100)
    x = torch.randn(4, 8)

    def loss():
        return last(_FailOnce.apply(torch.tanh(first(x * scale)))).square().mean()

    before = [p.detach().clone() for p in params]
    _FailOnce.armed = True
    with pytest.raises(RuntimeError, match="simulated out of memory"):
        loss().backward()
    moved = [not torch.equal(a, p) for a, p in zip(before, params)]
    assert moved[:3] == [False] * 3 and any(moved[3:])  # the output layer, and only it, was updated before the error

    def steps():
        return [int(opt.state[p]["step"]) if p in opt.state else 0 for p in params]

    getattr(opt, recover)()
    after = steps()
    if recover == "zero_grad":
        assert after == [int(m) for m in moved]
    else:
        assert after[:3] == [0] * 3 and after[3:] == [1, 1]  # the waiting gradient of the output layer was applied
    for _ in range(2):
        loss().backward()
        assert all(p.grad is None for p in params)  # the end-of-backward flush ran
        opt.step()
        opt.zero_grad()
    assert steps() == [n + 2 for n in after]
    assert torch.isfinite(opt.grad_norm)


def test_a_parameter_unfrozen_during_training_is_released_from_the_next_step():
    """Gradual unfreezing: a block frozen at construction has no hook; unfrozen, its first gradient waits for step()
    (updated there, as without release), and from then on it is released in backward. Same bits as step()
    throughout."""
    a, b = make(), make()
    for model in (a, b):
        model.blocks[1].requires_grad_(False)
    oa = ApexW(groups(a), state_format="8bit")
    ob = ApexW(groups(b), state_format="8bit", gradient_release=True, release_bucket_size=300)
    alive = []
    for t in range(4):
        if t == 1:
            for model in (a, b):
                model.blocks[1].requires_grad_(True)
        for model, opt in ((a, oa), (b, ob)):
            loss_of(model, t).backward()
            if opt is ob:
                alive.append(sum(p.grad is not None for p in model.parameters()))
            opt.step()
            opt.zero_grad()
    assert alive == [0, 4, 0, 0]  # the unfrozen block's 4 tensors waited for step() once
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_hooks_on_two_threads_take_turns():
    """Autograd runs each device's backward on its own thread, so a model split over devices has its hooks called
    from two threads at once: every bucket is stepped and counted once, and the norm is the sum of all of them."""
    import threading

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4096)) for _ in range(400)]
    opt = ApexW(
        [{"params": params[:200]}, {"params": params[200:]}],
        lr=1e-3,
        state_format="8bit",
        gradient_release=True,
        max_grad_norm=1.0,
        release_bucket_size=1,
    )
    release = opt._release
    grads = [torch.randn(4096) for _ in params]
    expect = sum(float(g.double().square().sum()) for g in grads)
    release._queued = True  # no backward pass here: the threads call the hooks themselves

    @torch.no_grad()
    def worker(lo, hi):
        for i in range(lo, hi):
            params[i].grad = grads[i].clone()
            release.on_grad_ready(params[i])

    threads = [threading.Thread(target=worker, args=(0, 200)), threading.Thread(target=worker, args=(200, 400))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    release._queued = False
    assert release.flushes == 400 and release._k == 400
    assert float(release.current_norm()) ** 2 == pytest.approx(expect, rel=1e-5)
    opt.step()
    assert all(opt.state[p]["step"] == 1 for p in params)


def test_resume_continues_bit_for_bit(tmp_path):
    a = make()
    oa = ApexW(groups(a), state_format="8bit", gradient_release=True, max_grad_norm=0.5, release_bucket_size=500)
    train(a, oa, 3)
    torch.save({"model": a.state_dict(), "opt": oa.state_dict()}, tmp_path / "ckpt.pt")
    train(a, oa, 2)

    b = make(seed=5)
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    b.load_state_dict(saved["model"])
    ob = ApexW(groups(b), state_format="8bit", gradient_release=True, max_grad_norm=0.5, release_bucket_size=500)
    ob.load_state_dict(saved["opt"])
    train(b, ob, 2)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_loading_a_state_dict_from_before_the_first_step_then_training():
    """A checkpoint saved before any step (no partial sums yet) loads, and training then runs several buckets per
    backward and several steps exactly as an optimizer that never loaded it."""
    a, b = make(), make()
    kw = dict(state_format="8bit", gradient_release=True, max_grad_norm=0.5, release_bucket_size=300)
    oa, ob = ApexW(groups(a), **kw), ApexW(groups(b), **kw)
    ob.load_state_dict(copy.deepcopy(ApexW(groups(make()), **kw).state_dict()))
    train(a, oa, 4)
    train(b, ob, 4)
    assert oa._release.flushes > 8
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    assert torch.equal(oa.grad_norm, ob.grad_norm)


def test_export_to_torch_adamw_after_release():
    model = make()
    opt = ApexW(model.parameters(), state_format="compact", gradient_release=True)
    train(model, opt, 2)
    torch_opt = torch.optim.AdamW(model.parameters())
    torch_opt.load_state_dict(opt.to_torch_adamw_state_dict())
    assert all(torch_opt.state[p]["step"] == 2 for p in model.parameters() if p.requires_grad)


def test_gradient_accumulation_is_refused_before_any_update():
    model = make()
    opt = ApexW(model.parameters(), gradient_release=True)
    loss_of(model, 0).backward()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(RuntimeError, match="accumulate gradients over several backward passes"):
        loss_of(model, 1).backward()
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the second backward changed nothing
    opt.zero_grad()
    opt.step()  # the step boundary: the next backward is a new step
    loss_of(model, 2).backward()


def test_grad_scaler_is_refused():
    model = make()
    opt = ApexW(model.parameters(), gradient_release=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    scaler.scale(loss_of(model, 0)).backward()
    with pytest.raises(RuntimeError, match="GradScaler"):
        scaler.step(opt)


def test_gradient_set_without_backward_is_stepped_once_and_double_update_refused():
    p = torch.nn.Parameter(torch.ones(5))
    q = torch.nn.Parameter(torch.ones(5))
    opt = ApexW([p, q], lr=0.1, gradient_release=True, state_format="fp32")
    ref_p = torch.nn.Parameter(torch.ones(5))
    ref = ApexW([ref_p], lr=0.1, state_format="fp32")
    p.grad = torch.full((5,), 0.5)  # no backward: step() updates it, as an ordinary optimizer would
    ref_p.grad = torch.full((5,), 0.5)
    opt.step()
    ref.step()
    assert torch.equal(p, ref_p) and p.grad is None
    (q * 2).sum().backward()  # released in backward
    q.grad = torch.ones(5)  # ... and then set again before step(): a second update would be wrong
    with pytest.raises(RuntimeError, match="update it twice"):
        opt.step()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(gradient_release=1), "gradient_release must be a bool"),
        (dict(max_grad_norm=1.0), "max_grad_norm is for gradient_release=True"),
        (dict(gradient_release=True, max_grad_norm=0.0), "invalid max_grad_norm"),
        (dict(gradient_release=True, max_grad_norm=float("inf")), "invalid max_grad_norm"),
        (dict(gradient_release=True, release_bucket_size=0), "release_bucket_size must be an int >= 1"),
        (dict(gradient_release=True, release_bucket_size=2.0), "release_bucket_size must be an int >= 1"),
    ],
)
def test_bad_release_arguments(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        ApexW([torch.nn.Parameter(torch.ones(2))], **kwargs)


@pytest.mark.parametrize("clip", [None, 1.0])
def test_nonfinite_gradient_skips_its_block_and_with_clipping_the_rest_of_the_step(clip):
    """A NaN gradient in b: b is not updated; the bucket before it (c) is; with clipping the bucket after it (a, whose
    gradient is finite) is not updated either (the clip coefficient is NaN from b's bucket on), without clipping it
    is. The weights and the state stay finite; the next step clips and updates normally."""
    a = torch.nn.Parameter(torch.ones(4))
    b = torch.nn.Parameter(torch.ones(4))
    c = torch.nn.Parameter(torch.ones(4))
    opt = ApexW(
        [a, b, c], lr=0.1, state_format="fp32", gradient_release=True, max_grad_norm=clip, release_bucket_size=1
    )
    # backward reaches c first, then b (NaN), then a
    first = 0 if clip else 1  # with clipping a's gradient is NaN too when the optimizer gets it
    with pytest.warns(RuntimeWarning, match=rf"non-finite gradient .* parameter {first}, shape \(4,\)"):
        (a.sum() + (b * torch.tensor([1.0, float("nan"), 1.0, 1.0])).sum() + c.sum()).backward()
        opt.step()
    assert not torch.equal(c.detach(), torch.ones(4))
    assert torch.equal(b.detach(), torch.ones(4)) and not opt.state[b]["exp_avg"].any()
    assert torch.equal(a.detach(), torch.ones(4)) == (clip is not None)
    assert torch.isnan(opt.grad_norm)
    assert opt.nonfinite_skipped == 1
    before = [p.detach().clone() for p in (a, b, c)]
    (a.sum() + b.sum() + c.sum()).backward()
    opt.step()
    assert all(not torch.equal(p.detach(), q) and torch.isfinite(p).all() for p, q in zip((a, b, c), before))
    assert torch.isfinite(opt.grad_norm) and opt.nonfinite_skipped == 1


def test_remove_release_hooks_returns_to_ordinary_steps():
    model = make()
    opt = ApexW(model.parameters(), gradient_release=True)
    opt.remove_release_hooks()
    loss_of(model, 0).backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    opt.step()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_release_on_cuda_kernels_is_bit_identical(fmt):
    a, b = make(dtype=torch.bfloat16).cuda(), make(dtype=torch.bfloat16).cuda()
    oa = ApexW(groups(a), lr=2e-2, state_format=fmt, engine="triton")
    ob = ApexW(groups(b), lr=2e-2, state_format=fmt, engine="triton", gradient_release=True, release_bucket_size=700)
    for t in range(4):
        for model, opt in ((a, oa), (b, ob)):
            g = torch.Generator().manual_seed(100 + t)
            x = torch.randint(0, 40, (3, 9), generator=g).cuda()
            torch.nn.functional.cross_entropy(model(x).float().flatten(0, 1), x.roll(1, 1).flatten()).backward()
            opt.step()
            opt.zero_grad()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


class TwoDevices(torch.nn.Module):
    """Five layers alternating between two devices, one param group per device (a param group holds one device).
    With buckets of 3,000 elements, backward flushes the fourth layer (``first``), then the third and fifth
    (``second``), and the end-of-backward flush takes the first two layers, one from each device."""

    def __init__(self, first, second):
        super().__init__()
        torch.manual_seed(0)
        sizes = [16, 16, 64, 64, 64, 8]
        self.layers = torch.nn.ModuleList(
            torch.nn.Linear(i, o).to(first if k % 2 else second) for k, (i, o) in enumerate(zip(sizes, sizes[1:]))
        )

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x.to(layer.weight.device))
            x = torch.nn.functional.gelu(x) if i + 1 < len(self.layers) else x
        return x.cpu()

    def groups(self, one=False):
        if one:  # one group over both devices, as the Trainer builds for a model dispatched over GPUs
            return [{"params": list(self.parameters())}]
        return [{"params": [p for layer in self.layers[k::2] for p in layer.parameters()]} for k in (1, 0)]


@pytest.mark.gpu
@pytest.mark.parametrize("one_group", [False, True], ids=["group_per_device", "one_group"])
@pytest.mark.parametrize("first, second", [("cuda", "cpu"), ("cpu", "cuda")])
def test_release_with_clipping_on_param_groups_of_two_devices(first, second, one_group):
    """Buckets from two devices in one backward: the step's running sums stay on one device (a bucket from the other
    adds to them, not to a fresh buffer), and the end-of-backward flush scales each device's gradients with a
    coefficient on that device. Against the same model on one device: the same clipping and updates, up to the
    rounding of the per-tensor norms on the other device."""
    split, single = TwoDevices(first, second), TwoDevices("cpu", "cpu")
    # fp32 state: the two runs' gradients differ in rounding (CUDA and CPU matrix products), which can flip a
    # stochastic rounding of 8-bit codes; exact moments keep the difference at the gradients' rounding
    kw = dict(lr=1e-2, state_format="fp32", gradient_release=True, max_grad_norm=0.01, release_bucket_size=3000)
    os_, o1 = ApexW(split.groups(one_group), **kw), ApexW(single.groups(one_group), **kw)
    for t in range(4):
        x = torch.randn(32, 16, generator=torch.Generator().manual_seed(t))
        norms = []
        for model, opt in ((split, os_), (single, o1)):
            model(x).square().mean().backward()
            norms.append(opt._release.current_norm().item())
            opt.step()
            opt.zero_grad()
            assert opt._release.flushes >= 3 * (t + 1)
        torch.testing.assert_close(norms[0], norms[1], rtol=1e-5, atol=0)
        assert norms[1] > 0.01  # the clip was active
    for p, q in zip(split.parameters(), single.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["8bit", "4bit"])
def test_a_group_over_cpu_and_cuda_steps_as_on_one_device(fmt):
    """One param group over two devices, ordinary steps: each device's tensors are stepped by that device's engine,
    and the bits are those of the same tensors and gradients on one device (the engines compute the reference's)."""
    torch.manual_seed(0)
    shapes = [(64, 32), (32,), (300,), (16, 16)]
    on_one = [torch.nn.Parameter(torch.randn(s, dtype=torch.bfloat16)) for s in shapes]
    mixed = [torch.nn.Parameter(p.detach().clone().to("cuda" if i % 2 else "cpu")) for i, p in enumerate(on_one)]
    oa, ob = (ApexW(ps, lr=1e-2, weight_decay=0.1, state_format=fmt) for ps in (on_one, mixed))
    for t in range(3):
        g = torch.Generator().manual_seed(t)
        for p, q in zip(on_one, mixed):
            p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
            q.grad = p.grad.to(q.device)
        oa.step()
        ob.step()
    for p, q in zip(on_one, mixed):
        assert torch.equal(p, q.cpu())


def test_a_release_checkpoint_loads_into_an_optimizer_without_release():
    """The clipping state travels with a release checkpoint; an optimizer without release ignores it (no stray
    param-group key), and the moments carry over."""
    a = make()
    oa = ApexW(groups(a), state_format="8bit", gradient_release=True, max_grad_norm=1.0)
    train(a, oa, 2)
    b = make()
    ob = ApexW(groups(b), state_format="8bit")
    ob.load_state_dict(oa.state_dict())
    assert all("gradient_release_state" not in g for g in ob.param_groups)
    assert "gradient_release" not in ob.state_dict()
    for p, q in zip(a.parameters(), b.parameters()):
        if p.requires_grad:
            assert torch.equal(oa.state[p]["exp_avg"], ob.state[q]["exp_avg"])


def test_cuda_gradients_without_triton_take_the_pytorch_norm(monkeypatch):
    """engine="torch" on a GPU needs no triton: without it (or under the Triton interpreter, which cannot read GPU
    memory) the bucket norm of CUDA gradients is the PyTorch operations, the same arithmetic as the kernel."""
    import sys

    from apexw_hf.optim import release

    monkeypatch.setattr(release, "_CUDA_KERNELS", [])
    monkeypatch.setitem(sys.modules, "apexw_hf.engines.triton.kernels.release_norm", None)  # its import fails
    assert release._norm_impl(torch.device("cuda")) is release.release_norm_torch
    assert release._norm_impl(torch.device("cpu")) is release.release_norm_torch
    assert release._sumsq_impl(torch.device("cuda")) is None  # the per-tensor norms then


def test_default_bucket_limit_grows_through_backward(monkeypatch):
    """``release_bucket_size=None`` (the default): the first step cuts buckets at DEFAULT_BUCKET_SIZE; later steps at
    a limit that grows with the share of the last step's elements released so far, up to BUCKET_GROWTH times that:
    fewer buckets, the same ones every step, and the same bits as step()."""
    monkeypatch.setattr(release_module, "DEFAULT_BUCKET_SIZE", 300)
    a, b, c = make(), make(), make()
    oa = ApexW(groups(a), lr=2e-2, state_format="8bit", engine="torch")
    ob = ApexW(groups(b), lr=2e-2, state_format="8bit", engine="torch", gradient_release=True)
    oc = ApexW(groups(c), lr=2e-2, state_format="8bit", engine="torch", gradient_release=True, release_bucket_size=300)
    counts, cuts, fixed = [], [], []
    for t in range(4):
        train_from(a, oa, t)
        before, before_c = ob._release.flushes, oc._release.flushes
        train_from(b, ob, t)
        train_from(c, oc, t)
        counts.append(ob._release.flushes - before)
        fixed.append(oc._release.flushes - before_c)
        cuts.append(ob._release._prev_keys)
    trainable = {id(p): p for p in b.parameters() if p.requires_grad}.values()
    assert ob._release._prev_released == sum(p.numel() for p in trainable)  # the tied weight once
    assert counts[0] == fixed[0] and fixed[1:] == fixed[:-1]  # the first step: the base limit, as a fixed one
    assert counts[1] < counts[0], counts  # then larger buckets
    assert counts[1] == counts[2] == counts[3] and cuts[1] == cuts[2] == cuts[3]  # the same cut every step
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


def test_resume_cuts_the_buckets_of_an_unbroken_run(tmp_path, monkeypatch):
    """The grown default limit depends on the last step's released elements, saved with the clipping state: a resumed
    run cuts (and so clips) as an unbroken one, bit for bit."""
    monkeypatch.setattr(release_module, "DEFAULT_BUCKET_SIZE", 300)
    kw = dict(state_format="8bit", gradient_release=True, max_grad_norm=0.05)
    a = make()
    oa = ApexW(groups(a), **kw)
    train(a, oa, 3)
    torch.save({"model": a.state_dict(), "opt": oa.state_dict()}, tmp_path / "ckpt.pt")
    assert oa.state_dict()["gradient_release"]["prev_released_numel"] == oa._release._prev_released > 0
    flushes = oa._release.flushes
    train(a, oa, 2)
    per_step = (oa._release.flushes - flushes) / 2

    b = make(seed=5)
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    b.load_state_dict(saved["model"])
    ob = ApexW(groups(b), **kw)
    ob.load_state_dict(saved["opt"])
    train(b, ob, 2)
    assert ob._release.flushes / 2 == per_step
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_bad_released_count_in_a_state_dict_is_refused_and_changes_nothing():
    model = make()
    opt = ApexW(groups(model), state_format="8bit", gradient_release=True, max_grad_norm=0.5)
    train(model, opt, 1)
    before, before_sd = opt._release.state(), copy.deepcopy(opt.state_dict())
    sd = opt.state_dict()
    sd["state"] = {}  # were it loaded, the moments would be gone
    for bad in (-1, 1.5, "10", True):
        sd["gradient_release"]["prev_released_numel"] = bad
        with pytest.raises(ValueError, match="prev_released_numel must be an int >= 0"):
            opt.load_state_dict(sd)
        assert opt._release.state() == before
        after = opt.state_dict()
        for i, entry in before_sd["state"].items():
            assert all(torch.equal(v, after["state"][i][k]) for k, v in entry.items())


# ---- tied_grad_offload -------------------------------------------------------------------------------------------


@pytest.fixture
def offload_on_cpu(monkeypatch):
    """The offload path on CPU tensors (a copy in place of the pinned host buffer, no streams): on a GPU only CUDA
    gradients take it."""
    from apexw_hf.optim import tied_offload

    monkeypatch.setattr(tied_offload, "_offloadable", lambda t: t.is_contiguous())
    calls = []
    prefetch = tied_offload.TiedGradOffload.prefetch

    def counted(self):
        calls.append(len(self._parts))
        prefetch(self)

    monkeypatch.setattr(tied_offload.TiedGradOffload, "prefetch", counted)
    return calls


class HeadOnlyLM(TinyLM):
    """TinyLM whose inputs skip the embedding: the tied weight gets the output layer's gradient alone."""

    def forward(self, x):
        h = torch.nn.functional.one_hot(x, self.emb.weight.shape[0]).to(self.frozen.dtype)[..., : self.frozen.numel()]
        for block in self.blocks:
            h = h + block(h + self.frozen)
        return self.head(self.norm(h))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("checkpoint", [None, "non_reentrant"])
@pytest.mark.parametrize("cls", [TinyLM, HeadOnlyLM], ids=["tied", "head_only"])
def test_tied_grad_offload_is_bit_identical_to_step(fmt, checkpoint, cls, offload_on_cpu):
    """The output layer's part of the tied weight's gradient leaves autograd at the start of backward and comes back
    when the embedding's part has arrived (or, without one, at the end of backward): the same bits as ordinary steps,
    with bf16 gradients too (whose sum rounds)."""
    torch.manual_seed(0)
    a, b = cls(checkpoint=checkpoint), cls(checkpoint=checkpoint)
    b.load_state_dict(a.state_dict())
    oa = ApexW(groups(a), lr=2e-2, state_format=fmt)
    ob = ApexW(
        groups(b), lr=2e-2, state_format=fmt, gradient_release=True, tied_grad_offload=True, release_bucket_size=700
    )
    for t in range(3):
        train_from(a, oa, t)
        train_tied_from(b, ob, t)
    assert ob._release.offload.offloaded == 3
    if cls is TinyLM:
        # from the second step on, the copy back starts in backward before the tied weight's gradient is complete
        assert offload_on_cpu and max(offload_on_cpu) == 1
    else:
        # the head's part is the weight's only one: autograd completes the weight's (empty) gradient right after it,
        # and the part comes back there, before any copy back halfway through backward
        assert offload_on_cpu and max(offload_on_cpu) == 0
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_tied_grad_offload_in_bf16_sums_as_autograd_does(offload_on_cpu):
    a, b = make(dtype=torch.bfloat16), make(dtype=torch.bfloat16)
    oa = ApexW(groups(a), lr=2e-2, state_format="4bit")
    ob = ApexW(groups(b), lr=2e-2, state_format="4bit", gradient_release=True, tied_grad_offload=True)
    for t in range(2):
        train_from(a, oa, t)
        loss = loss_of(b, t)
        assert ob.before_backward(loss, [b]) == 1
        loss.backward()
        ob.step()
        ob.zero_grad()
    assert ob._release.offload.offloaded == 2
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_tied_grad_offload_leaves_untied_weights_and_other_settings_alone(offload_on_cpu):
    model = make()
    model.head.weight = torch.nn.Parameter(model.emb.weight.detach().clone())  # untied
    opt = ApexW(groups(model), lr=2e-2, gradient_release=True, tied_grad_offload=True)
    with pytest.warns(UserWarning, match="no trainable tied weights"):
        assert opt.before_backward(loss_of(model, 0), model) == 0
    plain = ApexW(groups(make()), lr=2e-2, gradient_release=True)
    assert plain.before_backward(loss_of(model, 0), model) == 0  # without the option: nothing to do
    with pytest.raises(ValueError, match="tied_grad_offload=True is for gradient_release=True"):
        ApexW(groups(make()), tied_grad_offload=True)
    with pytest.raises(TypeError, match=r"model must be the torch.nn.Module being trained.*\['Parameter'\]"):
        opt.before_backward(loss_of(model, 0), [model.emb.weight])
    with pytest.raises(TypeError, match="tied_grad_offload must be a bool"):
        ApexW(groups(make()), gradient_release=True, tied_grad_offload="yes")


def test_tied_grad_offload_says_when_a_tied_weight_is_not_on_a_gpu():
    """On the CPU (no offload_on_cpu here) the tied weight is not offloaded, and it says so once."""
    model = make()
    opt = ApexW(groups(model), lr=2e-2, gradient_release=True, tied_grad_offload=True)
    with pytest.warns(UserWarning, match="1 of the model's 1 trainable tied weights are not plain CUDA tensors"):
        assert opt.before_backward(loss_of(model, 0), model) == 0
    loss = loss_of(model, 1)
    assert opt.before_backward(loss, model) == 0  # said once
    loss.backward()
    opt.step()
    assert opt._release.offload.offloaded == 0


def test_tied_grad_offload_says_when_backward_came_without_before_backward(offload_on_cpu):
    model = make()
    opt = ApexW(groups(model), lr=2e-2, gradient_release=True, tied_grad_offload=True)
    loss = loss_of(model, 0)
    opt.before_backward(loss, model)
    loss.backward()
    opt.step()
    with pytest.warns(UserWarning, match="without optimizer.before_backward"):
        loss_of(model, 1).backward()  # a loop that forgot it: trains, offloads nothing
    opt.step()
    assert opt._release.offload.offloaded == 1


def test_tied_grad_offload_part_is_dropped_with_a_step_given_up(offload_on_cpu):
    """A backward pass that raises after the part was offloaded: zero_grad gives up the step and its part; the next
    step trains as an unbroken run from there would."""
    a, b = make(), make()
    oa = ApexW(groups(a), lr=2e-2)
    ob = ApexW(groups(b), lr=2e-2, gradient_release=True, tied_grad_offload=True)
    boom = b.blocks[1].register_full_backward_hook(lambda *args: (_ for _ in ()).throw(RuntimeError("boom")))
    loss = loss_of(b, 0)
    ob.before_backward(loss, b)
    with pytest.raises(RuntimeError, match="boom"):
        loss.backward()
    boom.remove()
    assert ob._release.offload.pending()
    ob.zero_grad()
    assert not ob._release.offload.pending()
    # the failed pass updated nothing yet here (its first bucket had not filled): both now train alike
    for t in range(2):
        train_from(a, oa, t)
        loss = loss_of(b, t)
        ob.before_backward(loss, b)
        loss.backward()
        ob.step()
        ob.zero_grad()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["8bit", "4bit"])
@pytest.mark.parametrize("cls", [TinyLM, HeadOnlyLM], ids=["tied", "head_only"])
def test_tied_grad_offload_on_cuda_is_bit_identical(fmt, cls):
    """The real path: pinned host buffer, side-stream copies out and back, bf16 gradients on the Triton engine."""
    torch.manual_seed(0)
    a, b = cls(dtype=torch.bfloat16).cuda(), cls(dtype=torch.bfloat16).cuda()
    b.load_state_dict(a.state_dict())
    oa = ApexW(groups(a), lr=2e-2, state_format=fmt, engine="triton")
    ob = ApexW(
        groups(b),
        lr=2e-2,
        state_format=fmt,
        engine="triton",
        gradient_release=True,
        tied_grad_offload=True,
        release_bucket_size=700,
        max_grad_norm=None,
    )
    for t in range(4):
        train_from(a, oa, t)
        loss = loss_of(b, t)
        assert ob.before_backward(loss, b) == 1
        loss.backward()
        ob.step()
        ob.zero_grad()
    offload = ob._release.offload
    assert offload.offloaded == 4 and offload._host[id(b.emb.weight)].is_pinned()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
