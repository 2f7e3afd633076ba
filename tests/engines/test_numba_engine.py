"""The fused numba path of the plain-PyTorch engine (8-bit and 4-bit state on the CPU, fp32 and bf16 parameters)
against ``reference.adamw_step_ref_``, bit for bit, and the torch passes it replaces (still the path without numba,
on CUDA, and for fp16 parameters) on the same cases.

Most cases are those of ``test_torch_engine.py`` (``cpu_cases.py``), run here once per path (``path`` fixture):
``numba`` checks that every chunk went through the kernel, ``torch-passes`` switches it off
(``TorchEngine.use_numba``). The rest are
cases of the kernel's own arithmetic: codes at every boundary through the whole step (``betas=(0, 0)`` makes the
stored moments ``m = g`` and ``v = g * g``), every code decoded under extreme scales, square roots over the whole
fp32 range, thread counts, and the fallback when numba cannot be imported.
"""

import logging
import sys
import warnings
from pathlib import Path

import pytest
import torch

import apexw_hf.engines
from apexw_hf import ApexW, reference
from apexw_hf.engines import torch as torch_engine

from ..optim.helpers import SHAPES
from . import cpu_cases as cases
from .helpers import assert_same, reference_step

try:
    from apexw_hf.engines import numba as numba_engine
except ImportError:
    numba_engine = None

needs_numba = pytest.mark.skipif(numba_engine is None, reason="numba is not installed")
DTYPES = [torch.float32, torch.bfloat16]
FORMATS = ("8bit", "4bit")


@pytest.fixture(params=["numba", "torch-passes"])
def path(request, monkeypatch):
    """Small chunks (4096 elements), and one of the two CPU paths for 8-bit state; checks afterwards that the
    chosen one ran."""
    monkeypatch.setattr(torch_engine, "CHUNK", 4096)
    calls = []
    if request.param == "numba":
        if numba_engine is None:
            pytest.skip("numba is not installed")
        kernel = numba_engine.step_chunk

        def counted(*args):
            calls.append(1)
            return kernel(*args)

        monkeypatch.setattr(numba_engine, "step_chunk", counted)
    else:
        monkeypatch.setattr(torch_engine.TorchEngine, "use_numba", False)
    yield request.param
    assert bool(calls) == (request.param == "numba")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@cases.OPTIONS
def test_matches_reference(path, fmt, dtype, options):
    """Tensors of 1, 255, 256, 257, 4095, 4097, 33x65, 4096, 8193 and 64x130 elements (in place, split across
    chunks, packed with block padding), four steps."""
    cases.matches_reference(fmt, dtype, options)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_special_values(path, fmt, dtype):
    """Signed zeros, subnormals, values near the fp32 maximum, an all-zero block, a block with one huge value, inf
    and NaN gradients (confined to their tensor, the NaN to its block)."""
    cases.special_values(fmt, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_state_at_extreme_scales(path, dtype):
    cases.eight_bit_state_at_extreme_scales(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_4bit_state_at_extreme_scales(path, dtype):
    cases.four_bit_state_at_extreme_scales(dtype)


@pytest.mark.parametrize("fmt", FORMATS)
def test_groups_missing_grads_and_unequal_steps(path, fmt):
    cases.groups_missing_grads_and_unequal_steps(fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_mixed_param_and_grad_dtypes(path, fmt):
    """fp32, bf16 and fp16 parameters (fp16 on the torch passes) with fp32 and bf16 gradients."""
    cases.mixed_param_and_grad_dtypes(fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_non_contiguous_param_and_grad(path, fmt):
    cases.non_contiguous_param_and_grad(fmt)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_resume_matches_unbroken_reference(path, fmt, dtype):
    cases.resume_matches_unbroken_reference(fmt, dtype)


@pytest.mark.parametrize("fmt", FORMATS)
def test_load_state_dict_replaces_the_cached_plan(path, fmt):
    cases.load_state_dict_replaces_the_cached_plan(fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_state_edits_between_steps_are_honored(path, fmt):
    cases.state_edits_between_steps_are_honored(fmt)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_passes_with_cuda_semantics(monkeypatch, fmt, dtype):
    """The torch passes under CUDA's dtype rules (test_torch_engine.py's case, which would now reach the numba
    path for these dtypes)."""
    monkeypatch.setattr(torch_engine.TorchEngine, "use_numba", False)
    monkeypatch.setattr(torch_engine, "CHUNK", 4096)
    cases.matches_reference_with_cuda_semantics(monkeypatch, fmt, dtype)


@needs_numba
@pytest.mark.parametrize("fmt", FORMATS)
def test_default_chunk_size(fmt):
    """The shipped chunk size: a tensor in place over two chunks, its packed tail and small tensors."""
    cases.default_chunk_size(fmt)


# ---- the kernel's arithmetic ----------------------------------------------------------------------------------


def _one_step(values, grads, dtype=torch.float32, steps=1, fmt="8bit", **kw):
    """The engine and the reference from the same parameters, ``steps`` steps of ``grads``."""
    opt_a, pa, opt_b, pb = cases.twins(values, dtype, state_format=fmt, seed=21, **kw)
    cases.run(opt_a, pa, opt_b, pb, [grads] * steps)
    assert_same(opt_a, pa, opt_b, pb)
    assert opt_a._cpu_engine.numba_used
    return opt_a, pa


@needs_numba
@pytest.mark.parametrize("top", cases.SCALES)
@pytest.mark.parametrize("moment", ["m", "v"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_codes_at_every_boundary(fmt, top, moment):
    """With ``betas=(0, 0)`` a first step stores ``m = g`` and ``v = g * g``: normalized values at, between and one
    ulp around every code's value (8-bit and 4-bit codes of both moments), signed zeros, fp32 subnormals and a zero
    block, in blocks whose maxima span the range of scales (tiny, huge, rounding up to bf16 infinity), for ``m``
    directly and for ``v`` through ``g = sqrt(target)``."""
    blk = reference.BLOCK if fmt == "8bit" else reference.BLOCK4
    gen = torch.Generator().manual_seed(1)
    near = [cases.near_every_code(3), cases.near_every_code(4)]
    near += [cases.near_every_code(0, reference.M4_BIAS), cases.near_every_code(0)]
    y = torch.cat([*near, torch.rand(1024, generator=gen) ** 8, torch.rand(256, generator=gen) * 2.0**-13])
    y = y[torch.randperm(y.numel(), generator=gen)]
    y = torch.cat([y, y.new_zeros(-y.numel() % blk + blk)]).view(-1, blk)  # the last block all zero
    y[:-1, 0] = 1.0
    y[1, 0] = 0.77
    x = (y.double() * top).reshape(-1)
    if moment == "v":
        x = x.sqrt()
    x = x.float()
    x[5 : 3 * blk : blk] = 1e-45
    g = torch.where(torch.rand(x.numel(), generator=gen) < 0.5, -x, x)
    g[3::97] = -0.0
    g = g[:-37]  # a partial last block
    kw = dict(lr=1e-3, betas=(0.0, 0.0), weight_decay=0.0)
    _one_step([torch.randn(g.numel(), generator=gen)], [g], fmt=fmt, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_code_decoded_under_extreme_scales(path, fmt, dtype):
    """Every code of both moments (those above the largest the encoder writes too; 4-bit: every byte) under block
    scales 0, bf16 subnormal, ordinary, huge (2**8 * scale overflowing too), inf and NaN, then a step with zero and
    with random gradients: the blocks whose decoded ``v`` is not finite are skipped as the reference skips them."""
    codes = torch.arange(256, dtype=torch.uint8)
    scales = [0.0, 2.0**-133, 1.0, 0.73, 3e38, float("inf"), float("nan"), 2.0**-126, 2.0**119, 2.0**120, 3.3e38]
    if fmt == "8bit":
        codes = codes.repeat(11)
    else:
        codes = codes.repeat_interleave(2).repeat(6)[: 128 * 11]
    scales = torch.tensor(scales).to(torch.bfloat16)
    n = codes.numel()
    gen = torch.Generator().manual_seed(4)
    values = [torch.randn(n, generator=gen)]
    for g in (torch.zeros(n), torch.randn(n, generator=gen)):
        opt_a, pa, opt_b, pb = cases.twins(values, dtype, state_format=fmt, lr=1e-3)
        for opt, ps in ((opt_a, pa), (opt_b, pb)):
            state = opt._init_state(ps[0], opt.param_groups[0])
            if fmt == "8bit":
                state["exp_avg"].copy_(codes)
                state["exp_avg_sq"].copy_(codes.flip(0))
            else:
                state["exp_avg_mv"].copy_(codes)
            state["exp_avg_scale"].copy_(scales)
            state["exp_avg_sq_scale"].copy_(scales.flip(0))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the skipped blocks' warning
            cases.run(opt_a, pa, opt_b, pb, [[g]])
        assert_same(opt_a, pa, opt_b, pb)
        assert opt_a.nonfinite_skipped == 1


@needs_numba
@pytest.mark.parametrize("fmt", FORMATS)
def test_square_root_over_the_fp32_range(fmt):
    """``v = g * g`` from about 2**-149 to 2**127 (fp32 subnormals to the largest finite values), so the
    parameter's bits depend on a correctly rounded fp32 root of every magnitude."""
    gen = torch.Generator().manual_seed(5)
    n = 1 << 14
    g = (torch.rand(n, generator=gen) * 2 - 1) * torch.logspace(-22.5, 19.2, n, dtype=torch.float64).float()
    g = g[torch.randperm(n, generator=gen)]
    _one_step([torch.randn(n, generator=gen)], [g], fmt=fmt, lr=1e-3, betas=(0.0, 0.0))
    _one_step([torch.randn(n, generator=gen)], [g], fmt=fmt, steps=3, lr=1e-3)


@needs_numba
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_thread_count_follows_torch(threads):
    """numba runs at torch's thread count (at most its own pool's), and the bits do not depend on it."""
    import numba

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        values, grads = cases.random_case([(3000,), (70000,)], steps=2, seed=9)
        for row in grads:
            _one_step(values, row, lr=1e-2)
        assert numba.get_num_threads() == min(threads, numba.config.NUMBA_NUM_THREADS)
    finally:
        torch.set_num_threads(before)


@needs_numba
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_gradient_dtypes(fmt, dtype):
    """fp32, bf16 and fp16 gradients of fp32 parameters (fp16 ones widened into the scratch first)."""
    values, grads = cases.random_case([(5000,), (300,)], steps=3, seed=10)
    pa, pb = cases.make_params(values, torch.float32), cases.make_params(values, torch.float32)
    for p in pa + pb:
        if hasattr(p, "grad_dtype"):
            p.grad_dtype = None
    opt_a, opt_b = (ApexW(ps, state_format=fmt, engine="torch", lr=1e-2) for ps in (pa, pb))
    for row in grads:
        for x, y, g in zip(pa, pb, row):
            x.grad, y.grad = g.to(dtype), g.to(dtype)
        opt_a.step()
        reference_step(opt_b)
    assert_same(opt_a, pa, opt_b, pb)
    assert opt_a._cpu_engine.numba_used


def test_other_formats_and_fp16_stay_on_the_torch_passes():
    """The numba path takes 8-bit and 4-bit state with fp32 and bf16 parameters only."""
    cases = [("compact", torch.float32), ("fp32", torch.bfloat16), ("8bit", torch.float16), ("4bit", torch.float16)]
    for fmt, dtype in cases:
        p = torch.nn.Parameter(torch.randn(300, dtype=dtype))
        opt = ApexW([p], state_format=fmt)
        p.grad = torch.randn_like(p)
        opt.step()
        assert not opt._cpu_engine.numba_used, (fmt, dtype)


@needs_numba
def test_numba_with_its_jit_disabled_is_not_used(monkeypatch, caplog):
    """``NUMBA_DISABLE_JIT=1`` (numba's debugging switch) would run the kernels as Python: the torch passes run."""
    import numba

    monkeypatch.setattr(numba.config, "DISABLE_JIT", True)
    monkeypatch.delitem(sys.modules, "apexw_hf.engines.numba")
    monkeypatch.delattr(apexw_hf.engines, "numba", raising=False)
    monkeypatch.setattr(torch_engine, "_NUMBA_ENGINE", None)
    p = torch.nn.Parameter(torch.randn(300))
    opt = ApexW([p], state_format="8bit")
    p.grad = torch.randn_like(p)
    with caplog.at_level(logging.WARNING, logger=torch_engine.__name__):
        opt.step()
    assert not opt._cpu_engine.numba_used
    assert any("NUMBA_DISABLE_JIT" in r.getMessage() for r in caplog.records)


def test_without_numba_the_torch_passes_run_and_say_so(monkeypatch, caplog):
    """numba missing: the torch passes step (the reference's bits), and a warning says how to install numba."""
    monkeypatch.setitem(sys.modules, "numba", None)  # import numba raises ImportError
    monkeypatch.delitem(sys.modules, "apexw_hf.engines.numba", raising=False)
    monkeypatch.delattr(apexw_hf.engines, "numba", raising=False)
    monkeypatch.setattr(torch_engine, "_NUMBA_ENGINE", None)
    values, grads = cases.random_case([(300,), (5000,)], steps=2, seed=11)
    opt_a, pa, opt_b, pb = cases.twins(values, torch.float32, state_format="8bit", lr=1e-2)
    with caplog.at_level(logging.WARNING, logger=torch_engine.__name__):
        cases.run(opt_a, pa, opt_b, pb, grads)
    assert_same(opt_a, pa, opt_b, pb)
    assert not opt_a._cpu_engine.numba_used
    warnings = [r.getMessage() for r in caplog.records if "numba" in r.getMessage()]
    assert len(warnings) == 1 and "pip install" in warnings[0]  # once, not per step


@pytest.mark.parametrize("fmt", FORMATS)
def test_engine_reports_the_numba_path(fmt):
    p = torch.nn.Parameter(torch.randn(SHAPES[-1]))
    opt = ApexW([p], state_format=fmt)
    p.grad = torch.randn_like(p)
    opt.step()
    assert opt._cpu_engine.numba_used == (numba_engine is not None)


_LAYER_SCRIPT = """
import os, numba, torch
from apexw_hf import ApexW8bit
p = torch.nn.Parameter(torch.zeros(300)); p.grad = torch.ones(300)
ApexW8bit([p]).step()
chosen = os.environ.get("NUMBA_THREADING_LAYER")
print(numba.config.THREADING_LAYER, numba.threading_layer() if chosen is None else "-")
"""


@needs_numba
@pytest.mark.parametrize("chosen", [None, "omp"])
def test_threading_layer_workqueue_unless_chosen(chosen):
    """The fused path's threads must sleep between steps (numba's OpenMP workers spin and took the cores from torch and
    from a second training process): workqueue, unless the user set NUMBA_THREADING_LAYER (then left alone)."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "NUMBA_THREADING_LAYER"}
    if chosen:
        env["NUMBA_THREADING_LAYER"] = chosen
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    out = subprocess.run([sys.executable, "-c", _LAYER_SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    config, used = out.stdout.split()
    if chosen is None:
        assert config == used == "workqueue"
    else:
        assert config == chosen and used == "-"  # the user's choice stays (not launched here: it may be unavailable)
