"""The plain-PyTorch engine on a CUDA device (``engine="torch"``): the reference's bits there too.

``engine="auto"`` sends CUDA tensors to the Triton kernel, but a user may force ``engine="torch"`` on a GPU (and the
engine is what other devices run). On the GPU the engine takes its square root from ``reference.sqrt_rn`` instead of
NumPy, and every elementwise pass is a CUDA kernel, so the same bits are checked against the per-tensor reference on
the GPU and against the engine on the CPU. Marked ``gpu``: deselected by default, run with ``pytest -m gpu``.
"""

import pytest
import torch

from apexw_hf import ApexW

from .helpers import FORMATS, same_bits
from .test_torch_engine import reference_step

pytestmark = pytest.mark.gpu

SHAPES = [(1,), (255,), (257,), (4097,), (33, 65), (300_000,)]  # the last spans a chunk and a packed tail


def _run(fmt, dtype, device, oracle=False, steps=3):
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(s, generator=gen) for s in SHAPES]
    grads = [
        [torch.randn(s, generator=gen) * 10.0 ** torch.randint(-6, 2, (1,), generator=gen).item() for s in SHAPES]
        for _ in range(steps)
    ]
    params = [torch.nn.Parameter(v.to(device, dtype)) for v in values]
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


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_engine_matches_reference_and_cpu(fmt, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gpu, gpu_params = _run(fmt, dtype, "cuda")
    assert all(p.device.type == "cuda" for p in gpu_params)
    oracle, oracle_params = _run(fmt, dtype, "cuda", oracle=True)
    _assert_same(gpu, gpu_params, oracle, oracle_params)
    cpu, cpu_params = _run(fmt, dtype, "cpu")
    _assert_same(gpu, gpu_params, cpu, cpu_params)
