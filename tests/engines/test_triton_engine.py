"""ApexW with engine="triton" against engine="torch": same bits through groups, missing grads, dtype changes."""

import warnings

import pytest
import torch

from apexw_hf.optim import ApexW

from ..kernels.helpers import DEVICE, mismatch, same_bits


def _params():
    gen = torch.Generator().manual_seed(1)
    spec = [
        ((300,), torch.float32),
        ((17, 33), torch.bfloat16),
        ((5,), torch.float16),
        ((1000,), torch.float32),
        ((64,), torch.float32),
        ((9,), torch.float32),
    ]
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dt).to(DEVICE)) for s, dt in spec]
    ps[5].requires_grad_(False)  # frozen: never a grad, never state
    for p in ps:
        if hasattr(p, "grad_dtype"):
            p.grad_dtype = None  # torch >= 2.10 checks grad dtype against the param's unless told otherwise
    return ps


def _grads(steps):
    gen = torch.Generator().manual_seed(2)
    shapes = [p.shape for p in _params()]
    out = []
    for step in range(steps):
        row = []
        for i in range(5):
            dtype = torch.bfloat16 if (i == 3 and step >= 2) else torch.float32
            g = torch.randn(shapes[i], generator=gen).to(dtype).to(DEVICE)
            row.append(None if (i == 1 and step in (1, 2)) or (i == 4 and step == 0) else g)
        out.append(row)
    return out


def _optimizer(ps, engine, fmt):
    return ApexW(
        [{"params": ps[:3]}, {"params": ps[3:], "lr": 3e-3, "weight_decay": 0.1, "betas": (0.8, 0.99)}],
        lr=1e-2,
        state_format=fmt,
        engine=engine,
        seed=7,
    )


def _run(ps, opt, grads):
    for row in grads:
        for p, g in zip(ps, row):
            p.grad = None if g is None else g.clone()
        for group in opt.param_groups:
            group["lr"] *= 0.9  # a schedule: new lr every step
        opt.step()


def _assert_same(pa, oa, pb, ob):
    for i, (a, b) in enumerate(zip(pa, pb)):
        assert same_bits(a, b), f"param {i}: {mismatch(a, b)}"
        sa, sb = oa.state.get(a, {}), ob.state.get(b, {})
        assert set(sa) == set(sb)
        for key in sa:
            assert same_bits(sa[key], sb[key]), f"{key} of param {i}: {mismatch(sa[key], sb[key])}"


@pytest.mark.parametrize("fmt", ["fp32", "compact", "8bit", "4bit"])
def test_engine_matches_torch_path(fmt):
    grads = _grads(5)
    pa, pb = _params(), _params()
    oa, ob = _optimizer(pa, "torch", fmt), _optimizer(pb, "triton", fmt)
    _run(pa, oa, grads)
    _run(pb, ob, grads)
    _assert_same(pa, oa, pb, ob)
    assert [float(ob.state[p]["step"]) for p in pb[:5]] == [5.0, 3.0, 5.0, 5.0, 4.0]
    assert not ob.state.get(pb[5])


@pytest.mark.parametrize("fmt", ["compact", "8bit", "4bit"])
def test_engine_whole_blocks_matches_torch_path(fmt):
    """Parameters of whole 256-element blocks (the kernel's word path) in bf16 and fp32, a gradient missing at some
    steps (tensors of a launch at different step counts), bf16 gradients for a bf16 parameter."""
    gen = torch.Generator().manual_seed(3)
    spec = [((256,), torch.bfloat16), ((4, 256), torch.bfloat16), ((512,), torch.float32), ((2, 128), torch.float32)]

    def params():
        ps = [
            torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i)).to(dt).to(DEVICE))
            for i, (s, dt) in enumerate(spec)
        ]
        for p in ps:
            if hasattr(p, "grad_dtype"):
                p.grad_dtype = None
        return ps

    grads = []
    for step in range(4):
        row = [torch.randn(s, generator=gen).to(dt).to(DEVICE) for s, dt in spec]
        if step in (1, 2):
            row[1] = None
        grads.append(row)
    pa, pb = params(), params()
    oa = ApexW([{"params": pa}], lr=1e-2, state_format=fmt, engine="torch", seed=5)
    ob = ApexW([{"params": pb}], lr=1e-2, state_format=fmt, engine="triton", seed=5)
    _run(pa, oa, grads)
    _run(pb, ob, grads)
    _assert_same(pa, oa, pb, ob)
    assert [float(ob.state[p]["step"]) for p in pb] == [4.0, 2.0, 4.0, 4.0]


@pytest.mark.parametrize("fmt", ["8bit", "4bit"])
def test_engine_resume_from_state_dict(fmt):
    """k steps, state_dict, fresh optimizer, continue: equal to an unbroken run, bit for bit."""
    grads = _grads(6)
    pa = _params()
    oa = _optimizer(pa, "triton", fmt)
    _run(pa, oa, grads)
    pb = _params()
    ob = _optimizer(pb, "triton", fmt)
    _run(pb, ob, grads[:3])
    sd = ob.state_dict()
    pc = [torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad) for p in pb]
    for p in pc:
        if hasattr(p, "grad_dtype"):
            p.grad_dtype = None
    oc = _optimizer(pc, "triton", fmt)
    oc.load_state_dict(sd)
    _run(pc, oc, grads[3:])
    _assert_same(pa, oa, pc, oc)


@pytest.mark.parametrize("engine", ["triton", "torch"])
def test_parameters_swapped_after_construction(engine):
    """A wrapper that replaces the parameter objects in param_groups (Accelerate's FSDP2 preparation swaps in the
    sharded ones) gets the same steps as an optimizer built on the new objects, and the old ones are released."""
    import gc
    import weakref

    grads = _grads(3)
    old = _params()
    opt = _optimizer(old, engine, "8bit")
    pa = _params()
    it = iter(pa)
    for group in opt.param_groups:
        group["params"] = [next(it) for _ in group["params"]]
    gone = weakref.ref(old[0])
    del old, it
    _run(pa, opt, grads)
    gc.collect()
    assert gone() is None, "the optimizer still holds a replaced parameter"
    pb = _params()
    ob = _optimizer(pb, engine, "8bit")
    _run(pb, ob, grads)
    _assert_same(pa, opt, pb, ob)


def test_cpu_without_interpreter_raises(monkeypatch):
    import apexw_hf.engines.triton.kernels as k

    monkeypatch.setattr(k, "INTERPRETED", False)
    if DEVICE != "cpu":
        pytest.skip("CPU-only check")
    import apexw_hf.engines.triton.kernels.launch  # noqa: F401

    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4)
    opt = ApexW([p], engine="triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        opt.step()


def test_cuda_parameters_under_the_interpreter(monkeypatch):
    """With TRITON_INTERPRET=1 the interpreter would run the kernel on the host over device addresses (a crash):
    engine='triton' refuses CUDA parameters with a clear error; engine='auto' sends them to the plain-PyTorch path
    and says so once."""
    import types

    import apexw_hf.engines.triton.kernels as k
    from apexw_hf import engines
    from apexw_hf.engines.triton import TritonEngine

    on_cuda = types.SimpleNamespace(device=torch.device("cuda", 0))  # only its device is looked at
    monkeypatch.setattr(k, "INTERPRETED", True)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        TritonEngine._check_device(on_cuda)
    monkeypatch.setattr(k, "INTERPRETED", False)
    TritonEngine._check_device(on_cuda)  # compiled kernels: CUDA parameters are what they run on

    monkeypatch.setattr(k, "INTERPRETED", True)
    monkeypatch.setattr(engines, "_WARNED_INTERPRETER", False)
    with pytest.warns(RuntimeWarning, match="TRITON_INTERPRET=1 is set"):
        assert engines._auto_uses_triton(True) is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        assert engines._auto_uses_triton(True) is False
        assert engines._auto_uses_triton(False) is False
    monkeypatch.setattr(k, "INTERPRETED", False)
    assert engines._auto_uses_triton(True) is True


def _compiled_kernels() -> int | None:
    from apexw_hf.engines.triton.kernels.adamw import _adamw_kernel

    caches = getattr(_adamw_kernel, "device_caches", None)
    if caches is None:
        return None
    return sum(len(c[0]) for c in caches.values())


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["compact", "8bit", "4bit"])
def test_gpu_matches_cpu_reference_without_recompiles(fmt):
    """Kernels on the GPU give the bits of the plain-PyTorch path on the CPU; an lr schedule compiles nothing new."""
    if DEVICE != "cuda":
        pytest.skip("needs the compiled kernels on a GPU")
    gen = torch.Generator().manual_seed(9)
    shapes = [(4097,), (3, 1000), (1,), (512, 16), (384,)]
    cpu = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    gpu = [torch.nn.Parameter(p.detach().cuda()) for p in cpu]
    oc = ApexW(cpu, lr=1e-3, state_format=fmt, engine="torch", seed=11)
    og = ApexW(gpu, lr=1e-3, state_format=fmt, engine="triton", seed=11)
    counts = []
    for step in range(6):
        for pc, pg in zip(cpu, gpu):
            pc.grad = torch.randn(pc.shape, generator=gen)
            pg.grad = pc.grad.cuda()
        for o in (oc, og):
            o.param_groups[0]["lr"] = 1e-3 * (0.5 + step / 7)
        oc.step()
        og.step()
        counts.append(_compiled_kernels())
    for i, (a, b) in enumerate(zip(cpu, gpu)):
        assert same_bits(a.detach(), b.detach().cpu()), f"param {i}: {mismatch(a.detach(), b.detach().cpu())}"
        for key, v in oc.state[a].items():
            assert same_bits(v, og.state[b][key].cpu()), f"{key} of param {i}"
    if counts[0] is not None:
        assert counts[1:] == counts[:-1], f"kernels compiled per step: {counts}"


def test_host_fp32_rounding_matches_torch():
    """StepScalars rounds with numpy's double -> float cast; it must equal torch's rounding of the same scalar."""
    import random

    from apexw_hf import reference as ref

    rng = random.Random(0)
    values = [10 ** rng.uniform(-45, 39) * rng.choice([1, -1]) for _ in range(20000)] + [0.0, 1e39, -1e39, 3.4e38]
    for x in values:
        assert ref._f32(x) == torch.tensor(x, dtype=torch.float32).item(), x


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["8bit", "4bit"])
def test_gpu_later_launches_bypass_the_jit(monkeypatch, fmt):
    """After a plan's first launch compiles (or finds) its kernel, later steps call the compiled kernel directly; the
    bits stay those of the plain-PyTorch path through a schedule and a change of gradient dtype (a new
    specialization, which goes through the JIT once)."""
    if DEVICE != "cuda":
        pytest.skip("needs the compiled kernels on a GPU")
    from apexw_hf.engines.triton.kernels import launch

    jit_calls = []
    real = launch._adamw_kernel

    class Counting:
        arg_names = real.arg_names

        def __getitem__(self, grid):
            jit_calls.append(grid)
            return real[grid]

    monkeypatch.setattr(launch, "_adamw_kernel", Counting())
    gen = torch.Generator().manual_seed(5)
    shapes = [(4097,), (256, 3), (7,)]
    cpu = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    gpu = [torch.nn.Parameter(p.detach().cuda()) for p in cpu]
    for p in cpu + gpu:
        if hasattr(p, "grad_dtype"):
            p.grad_dtype = None
    oc = ApexW(cpu, lr=1e-3, state_format=fmt, engine="torch", seed=3)
    og = ApexW(gpu, lr=1e-3, state_format=fmt, engine="triton", seed=3)
    for step in range(6):
        dtype = torch.bfloat16 if step >= 3 else torch.float32
        for pc, pg in zip(cpu, gpu):
            pc.grad = torch.randn(pc.shape, generator=gen).to(dtype)
            pg.grad = pc.grad.cuda()
        for o in (oc, og):
            o.param_groups[0]["lr"] = 1e-3 * (1 + step)
        oc.step()
        og.step()
    assert len(jit_calls) == 2, f"launches through the JIT: {len(jit_calls)} (one per gradient dtype expected)"
    for i, (a, b) in enumerate(zip(cpu, gpu)):
        assert same_bits(a.detach(), b.detach().cpu()), f"param {i}: {mismatch(a.detach(), b.detach().cpu())}"
        for key, v in oc.state[a].items():
            assert same_bits(v, og.state[b][key].cpu()), f"{key} of param {i}"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["8bit", "4bit"])
def test_gpu_params_on_a_second_device(fmt):
    """Parameters on cuda:1 while cuda:0 is current: the kernel runs on their device and gives the reference bits."""
    if DEVICE != "cuda" or torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    assert torch.cuda.current_device() == 0
    gen = torch.Generator().manual_seed(6)
    cpu = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(1000,), (37, 5)]]
    gpu = [torch.nn.Parameter(p.detach().to("cuda:1")) for p in cpu]
    oc = ApexW(cpu, lr=1e-3, state_format=fmt, engine="torch", seed=4)
    og = ApexW(gpu, lr=1e-3, state_format=fmt, engine="triton", seed=4)
    for _ in range(3):
        for pc, pg in zip(cpu, gpu):
            pc.grad = torch.randn(pc.shape, generator=gen)
            pg.grad = pc.grad.to("cuda:1")
        oc.step()
        og.step()
    torch.cuda.synchronize("cuda:1")
    for i, (a, b) in enumerate(zip(cpu, gpu)):
        assert same_bits(a.detach(), b.detach().cpu()), f"param {i}: {mismatch(a.detach(), b.detach().cpu())}"


def _set_bad_grad(p, case):
    """Give ``p`` a gradient at a new address that the kernel must not be handed; returns what the error names."""
    if case == 0:
        p.grad = torch.randn(p.shape[0], 2 * p.shape[1], device=p.device)[:, ::2]
        return ValueError, "dense contiguous"
    p.grad = torch.zeros_like(p)
    # a `.data` swap on the gradient itself bypasses the .grad setter's own shape and dtype checks
    if case == 1:
        p.grad.data = torch.zeros(p.numel() + 1, device=p.device)
        return ValueError, "shape"
    p.grad.data = torch.zeros(p.shape, dtype=torch.float64, device=p.device)
    return TypeError, "unsupported gradient dtype"


@pytest.mark.parametrize("case", range(3))
def test_engine_checks_gradients_that_moved(case):
    """After a step, gradients at new addresses are checked (all of them, in a few passes over the list) before
    their addresses reach the kernel; a bad one raises and the step changes nothing."""
    ps = [torch.nn.Parameter(torch.randn(4, 8, device=DEVICE)) for _ in range(5)]
    opt = ApexW(ps, lr=1e-2, state_format="8bit", engine="triton")
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()
    assert opt._engine.grad_moves == 1  # the first step's addresses are new too
    opt.step()
    assert opt._engine.grad_moves == 1  # the same gradients: nothing to check again
    for p in ps:
        p.grad = torch.randn_like(p)  # new allocations, all fine
    error, match = _set_bad_grad(ps[3], case)
    before = [p.detach().clone() for p in ps]
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in ps]
    with pytest.raises(error, match=match):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(ps, before))
    for p, saved in zip(ps, state):
        assert all(torch.equal(opt.state[p][k], v) for k, v in saved.items())
    for p in ps:
        p.grad = torch.randn_like(p)
    opt.step()  # good gradients step again
    assert all(float(opt.state[p]["step"]) == 3 for p in ps)
    assert opt._engine.grad_moves == 2  # the refused step is not counted


@pytest.mark.parametrize("change", ["float_lr", "tensor_lr_in_place", "betas_list_in_place"])
def test_engine_reads_changed_hyperparameters_every_step(change):
    """The engine keeps a group's hyperparameters while they are the same objects; a scheduler's new float, a tensor
    lr changed in place and a betas list changed in place are read at the next step (as the plain-PyTorch path reads
    them)."""
    runs = []
    for engine in ("torch", "triton"):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(300, device=DEVICE))
        lr = torch.tensor(1e-2) if change == "tensor_lr_in_place" else 1e-2
        opt = ApexW([p], lr=lr, betas=[0.9, 0.999], state_format="8bit", engine=engine)
        for t in range(4):
            p.grad = torch.randn(300, device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(t))
            opt.step()
            group = opt.param_groups[0]
            if change == "tensor_lr_in_place":
                group["lr"].mul_(0.5)
            elif change == "float_lr":
                group["lr"] = group["lr"] * 0.5
            else:
                group["betas"][0] -= 0.1
        runs.append(p.detach().clone())
    assert same_bits(runs[0], runs[1]), mismatch(runs[0], runs[1])


def test_launch_reads_the_layouts_of_formats():
    """The launch table checks state tensors against ``apexw_hf.formats`` (issue 43: one home of the layouts); these
    are the dtypes and block sizes it had written out before (8-bit and 4-bit at format version 3)."""
    from apexw_hf.engines.triton.kernels import launch

    assert launch.BLOCK_OF == {"8bit": 256, "4bit": 128}
    assert launch._STATE_DTYPES == {
        "fp32": {"exp_avg": torch.float32, "exp_avg_sq": torch.float32},
        "compact": {"exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16},
        "8bit": {
            "exp_avg": torch.uint8,
            "exp_avg_sq": torch.uint8,
            "exp_avg_scale": torch.bfloat16,
            "exp_avg_sq_scale": torch.float32,  # 8-bit format version 3
        },
        "4bit": {"exp_avg_mv": torch.uint8, "exp_avg_scale": torch.float32, "exp_avg_sq_scale": torch.float32},
    }
    assert [list(d) for d in launch._STATE_DTYPES.values()] == [list(d) for d in launch.STATE_ROW.values()]
