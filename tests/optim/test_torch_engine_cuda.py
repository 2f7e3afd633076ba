"""The plain-PyTorch engine on a CUDA device (``engine="torch"``).

``engine="auto"`` sends CUDA tensors to the Triton kernel, but a user may force ``engine="torch"`` on a GPU (and
``auto`` takes it where triton is missing). On the GPU the engine takes its square root from ``reference.sqrt_rn``
instead of NumPy, and every elementwise pass is a CUDA kernel. Its first run on an H200 (5cd725d) matched the
reference only for fp32 state with fp32 parameters (an int32 shift written into int16 is computed in int16 on CUDA);
after the fix (c69a298) every format with fp32 and bf16 parameters matched on an H200 (34ce5de). Those combinations
are compared bit for bit here; fp16 parameters, not run on a GPU yet, are refused with a clear error (tested), and
their comparison is kept as a non-strict expected failure that shows XPASS once a GPU run finds them equal.
Marked ``gpu``: deselected by default, run with ``pytest -m gpu``.
"""

import pytest
import torch

from apexw_hf import ApexW
from apexw_hf.optim import torch_engine

from .helpers import FORMATS, same_bits
from .test_torch_engine import reference_step

pytestmark = pytest.mark.gpu

SHAPES = [(1,), (255,), (257,), (4097,), (33, 65), (300_000,)]  # the last spans a chunk and a packed tail
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CASES = [(f, d) for f in FORMATS for d in DTYPES]
VERIFIED = [c for c in CASES if torch_engine.cuda_verified(*c)]
REFUSED = [c for c in CASES if not torch_engine.cuda_verified(*c)]


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def _params(dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(device, dtype)) for s in SHAPES]


def _run(fmt, dtype, device, oracle=False, steps=3):
    gen = torch.Generator().manual_seed(1)
    grads = [
        [torch.randn(s, generator=gen) * 10.0 ** torch.randint(-6, 2, (1,), generator=gen).item() for s in SHAPES]
        for _ in range(steps)
    ]
    params = _params(dtype, device)
    opt = ApexW(params, engine="torch", state_format=fmt, lr=1e-2, weight_decay=0.1, seed=3)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.to(device, dtype)
        if oracle:
            reference_step(opt)
        else:
            opt.step()
    return opt, params


def _assert_same(a, pa, b, pb):
    for i, (x, y) in enumerate(zip(pa, pb)):
        assert same_bits(x.detach().cpu(), y.detach().cpu()), f"param {i} {tuple(x.shape)}"
        for key, value in a.state[x].items():
            assert same_bits(value.cpu(), b.state[y][key].cpu()), f"param {i} state {key}"


def _compare(fmt, dtype):
    gpu, gpu_params = _run(fmt, dtype, "cuda")
    assert all(p.device.type == "cuda" for p in gpu_params)
    oracle, oracle_params = _run(fmt, dtype, "cuda", oracle=True)
    _assert_same(gpu, gpu_params, oracle, oracle_params)
    cpu, cpu_params = _run(fmt, dtype, "cpu")
    _assert_same(gpu, gpu_params, cpu, cpu_params)


@pytest.mark.parametrize("fmt,dtype", VERIFIED)
def test_cuda_engine_matches_reference_and_cpu(fmt, dtype):
    _compare(fmt, dtype)


@pytest.mark.parametrize("fmt,dtype", REFUSED)
def test_cuda_engine_refuses_unverified_paths(fmt, dtype):
    params = _params(dtype, "cuda")
    before = [p.detach().clone() for p in params]
    opt = ApexW(params, engine="torch", state_format=fmt)
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match=rf"state_format='{fmt}' with {dtype} parameters.*Install triton"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(params, before))
    assert all(not s or float(s["step"]) == 0 for s in opt.state.values())


@pytest.mark.xfail(strict=False, reason="not yet compared on a GPU")
@pytest.mark.parametrize("fmt,dtype", REFUSED)
def test_cuda_engine_unverified_paths(monkeypatch, fmt, dtype):
    monkeypatch.setattr(torch_engine, "cuda_verified", lambda *_: True)
    _compare(fmt, dtype)
