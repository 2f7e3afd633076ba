"""The cases both CPU paths of the plain-PyTorch engine are checked on (``test_torch_engine.py`` runs them on the
default path, ``test_numba_engine.py`` once on the fused numba path and once on the torch passes), and what they are
built from: twin optimizers (the engine and the per-tensor reference, :func:`~.helpers.reference_step`) over copies
of the same values, random gradients over many magnitudes, special values, codes near every boundary.

Each case asserts bit-for-bit equality itself; the caller chooses the path and the chunk size (its fixtures).
"""

import io

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from apexw_hf import ApexW, reference
from apexw_hf.engines import torch as torch_engine
from apexw_hf.engines import torch_passes

from ..optim import helpers
from ..optim.helpers import SHAPES
from .helpers import assert_same, reference_step

FORMATS = tuple(dict.fromkeys((*helpers.FORMATS, "4bit")))
QUANTIZED = ("8bit", "4bit")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_params(values, dtype):
    return [torch.nn.Parameter(v.clone().to(dtype)) for v in values]


def twins(values, dtype, groups=None, **kw):
    """(engine optimizer, its params, oracle optimizer, its params) over copies of ``values``."""
    pa, pb = make_params(values, dtype), make_params(values, dtype)
    if groups is None:
        return ApexW(pa, engine="torch", **kw), pa, ApexW(pb, engine="torch", **kw), pb
    return (
        ApexW(groups(pa), engine="torch", **kw),
        pa,
        ApexW(groups(pb), engine="torch", **kw),
        pb,
    )


def run(opt_a, pa, opt_b, pb, grads_per_step):
    for grads in grads_per_step:
        for x, y, g in zip(pa, pb, grads):
            x.grad = None if g is None else g.to(x.dtype)
            y.grad = None if g is None else g.to(y.dtype)
        opt_a.step()
        reference_step(opt_b)


def random_case(shapes, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    values = [torch.randn(s, generator=gen) for s in shapes]
    # gradients over many magnitudes, so the 8-bit codes span their range and moments differ per block
    grads = [
        [torch.randn(s, generator=gen) * 10.0 ** torch.randint(-6, 2, (1,), generator=gen).item() for s in shapes]
        for _ in range(steps)
    ]
    return values, grads


# optimizer options every path is compared under (also tests/engines/test_numba_engine.py)
OPTIONS = pytest.mark.parametrize(
    "options",
    [dict(), dict(maximize=True), dict(param_rounding="nearest"), dict(lr=3e-2, betas=(0.8, 0.95), eps=0.0)],
    ids=["default", "maximize", "nearest", "hparams"],
)


def matches_reference(fmt, dtype, options):
    values, grads = random_case(SHAPES + [(4096,), (8193,), (64, 130)], steps=4)
    kw = dict(lr=1e-2, weight_decay=0.1, state_format=fmt, seed=7)
    kw.update(options)
    opt_a, pa, opt_b, pb = twins(values, dtype, **kw)
    run(opt_a, pa, opt_b, pb, grads)
    assert_same(opt_a, pa, opt_b, pb)


def default_chunk_size(fmt):
    """The shipped chunk size: a tensor used in place over two chunks plus its packed tail and small tensors."""
    n = torch_engine.CHUNK
    values, grads = random_case([(2 * n + 300,), (257,), (3, 5)], steps=2, seed=1)
    opt_a, pa, opt_b, pb = twins(values, torch.float32, state_format=fmt, lr=1e-2)
    run(opt_a, pa, opt_b, pb, grads)
    assert_same(opt_a, pa, opt_b, pb)


# ops that write another dtype by definition, or take a bool mask: no cast of their operands to emulate
_WRITES_ANY_DTYPE = {"aten::copy_", "aten::_to_copy", "aten::cat", "aten::index_put_", "aten::masked_fill_"}


class _CudaKernelDtypes(TorchDispatchMode):
    """CUDA's choice of the dtype an elementwise kernel computes in, on the CPU.

    For a result written into a tensor of another dtype than its operands (an ``out=`` tensor, or ``self`` of an
    in-place op), the CPU computes in the operands' promoted dtype and casts the result; many CUDA kernels (the shifts,
    ``maximum``, ...) run in the written tensor's dtype and cast the operands to it on load, so that
    ``bitwise_right_shift(int32, 16, out=int16)`` is 0 or -1 there. Here every such op casts its operands first.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        dst = kwargs.get("out")
        if dst is None and name.endswith("_") and args and isinstance(args[0], torch.Tensor):
            dst = args[0]
        if isinstance(dst, torch.Tensor) and dst.dtype != torch.bool and name not in _WRITES_ANY_DTYPE:

            def cast(x):
                ok = not isinstance(x, torch.Tensor) or x is dst or x.dtype in (dst.dtype, torch.bool)
                return x if ok else x.to(dst.dtype)

            args = tuple(cast(a) for a in args)
            kwargs = {k: v if k == "out" else cast(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


def matches_reference_with_cuda_semantics(monkeypatch, fmt, dtype):
    """The engine's bits hold under the semantics a CUDA device gives its operations where they differ from the
    CPU's: the kernel dtype of a mixed-dtype write (an int32 shift into int16 gave NaN bf16 parameters on an H200),
    and the square root from ``reference.sqrt_rn`` instead of NumPy."""
    init = torch_passes.Buffers.__init__

    def on_device(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.cpu = False

    monkeypatch.setattr(torch_passes.Buffers, "__init__", on_device)
    values, grads = random_case(SHAPES + [(8193,)], steps=3, seed=3)
    opt_a, pa, opt_b, pb = twins(values, dtype, lr=1e-2, weight_decay=0.1, state_format=fmt, seed=3)
    for row in grads:
        for x, y, g in zip(pa, pb, row):
            x.grad, y.grad = g.to(dtype), g.to(dtype)
        with _CudaKernelDtypes():
            opt_a.step()
        reference_step(opt_b)
    assert_same(opt_a, pa, opt_b, pb)


def _special_values(n, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen)
    x[0:4] = torch.tensor([0.0, -0.0, 1e-40, -3e-42])  # signed zeros, subnormals
    x[4:6] = torch.tensor([3e38, -3.3e38])  # near the fp32 maximum
    return x


def special_values(fmt, dtype):
    n = 1300  # blocks 0..4 (256 elements each) and a partial block
    values = [_special_values(n, 0), torch.zeros(300), torch.randn(700), torch.randn(5)]
    steps = []
    gen = torch.Generator().manual_seed(3)
    for step in range(4):
        g = torch.randn(n, generator=gen)
        g[256:512] = 0.0  # an all-zero block
        g[512] = 1e18  # a block with one huge value (its square is finite)
        g[600:604] = torch.tensor([1e-40, -1e-42, -0.0, 0.0])
        if step == 1:
            g[768] = float("inf")
            g[800] = float("-inf")
            g[1290] = float("inf")  # in the partial last block: its padding must stay zero next step
        if step == 2:
            g[1030] = float("nan")
        if step == 3:
            g[900] = 3e19  # finite, but its square overflows fp32: v would be infinite
        other = torch.randn(700, generator=gen)
        other[::50] = 0.0
        steps.append([g, torch.zeros(300), other, torch.full((5,), 1e-30)])
    opt_a, pa, opt_b, pb = twins(values, dtype, state_format=fmt, lr=1e-3, seed=5)
    run(opt_a, pa, opt_b, pb, steps)
    assert_same(opt_a, pa, opt_b, pb)
    # the blocks with an inf (768, 800: one block; 1290), a NaN (1030) or an overflowing square (900) in the gradient
    # were skipped, as the reference does; in fp16 the gradients 1e18 (block 2) and 3e19 are infs
    fp16 = dtype == torch.float16
    assert opt_a.nonfinite_skipped == (4 if fp16 else 3)
    assert opt_a._nonfinite._read()[torch.device("cpu")][2] == (8 if fp16 else 4)  # blocks of tensor index 0
    assert torch.isfinite(pa[2].detach()).all()


def groups_missing_grads_and_unequal_steps(fmt):
    shapes = [(300,), (17, 33), (5000,), (1,), (256,), (9,)]
    values, grads = random_case(shapes, steps=6, seed=2)
    for step, row in enumerate(grads):
        if step in (1, 2):
            row[1] = None  # falls behind by two steps
        if step == 0:
            row[4] = None  # joins late
        row[5] = None  # never a gradient, never state

    def groups(ps):
        return [
            {"params": ps[:3], "lr": 1e-2, "weight_decay": 0.1},
            {"params": ps[3:], "lr": 3e-3, "weight_decay": 0.0, "state_format": "compact", "maximize": True},
        ]

    opt_a, pa, opt_b, pb = twins(values, torch.float32, groups=groups, state_format=fmt, seed=3)
    run(opt_a, pa, opt_b, pb, grads)
    assert_same(opt_a, pa, opt_b, pb)
    assert int(opt_a.state[pa[1]]["step"]) == 4 and int(opt_a.state[pa[0]]["step"]) == 6
    assert pa[5] not in opt_a.state


def mixed_param_and_grad_dtypes(fmt):
    values, grads = random_case([(300,), (5000,), (17,), (257,)], steps=3, seed=4)
    pa = [torch.nn.Parameter(v.clone().to(d)) for v, d in zip(values, DTYPES + [torch.bfloat16])]
    pb = [torch.nn.Parameter(p.detach().clone()) for p in pa]
    for p in pa + pb:
        if hasattr(p, "grad_dtype"):
            p.grad_dtype = None  # torch >= 2.10 checks grad dtype against the param's unless told otherwise
    opt_a, opt_b = (ApexW(ps, state_format=fmt, engine="torch", seed=9) for ps in (pa, pb))
    for step, row in enumerate(grads):
        for x, y, g in zip(pa, pb, row):
            dtype = torch.bfloat16 if step == 1 else torch.float32  # fp32 grads of bf16 params, and the reverse
            x.grad, y.grad = g.to(dtype), g.to(dtype)
        opt_a.step()
        reference_step(opt_b)
    assert_same(opt_a, pa, opt_b, pb)


def non_contiguous_param_and_grad(fmt):
    base = torch.randn(40, 70)
    pa = [torch.nn.Parameter(base.clone().t()), torch.nn.Parameter(torch.randn(300))]
    pb = [
        torch.nn.Parameter(p.detach().clone().t().contiguous().t())
        if i == 0
        else torch.nn.Parameter(p.detach().clone())
        for i, p in enumerate(pa)
    ]
    assert not pa[0].is_contiguous() and not pb[0].is_contiguous()
    opt_a, opt_b = (ApexW(ps, state_format=fmt, engine="torch") for ps in (pa, pb))
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        gs = [torch.randn(70, 40, generator=gen), torch.randn(600, generator=gen)[::2]]  # the second is strided
        for x, y, g in zip(pa, pb, gs):
            x.grad, y.grad = g.clone(), g.clone()
        opt_a.step()
        reference_step(opt_b)
    assert_same(opt_a, pa, opt_b, pb)


def _roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def resume_matches_unbroken_reference(fmt, dtype):
    values, grads = random_case([(33, 65), (5000,), (1,)], steps=6, seed=6)
    grads[2][2] = None
    kw = dict(lr=1e-2, weight_decay=0.1, state_format=fmt, seed=11)
    opt_a, pa, opt_b, pb = twins(values, dtype, **kw)
    run(opt_a, pa, opt_b, pb, grads[:3])
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in pa]
    opt_r = ApexW(resumed, engine="torch", lr=1.0, state_format="fp32")
    opt_r.load_state_dict(_roundtrip(opt_a.state_dict()))
    run(opt_r, resumed, opt_b, pb, grads[3:])
    assert_same(opt_r, resumed, opt_b, pb)


def load_state_dict_replaces_the_cached_plan(fmt):
    """A loaded state must be the one stepped (the engine caches views of the state tensors)."""
    values, grads = random_case([(5000,), (300,)], steps=4, seed=8)
    opt_a, pa, opt_b, pb = twins(values, torch.float32, state_format=fmt)
    run(opt_a, pa, opt_b, pb, grads[:2])
    opt_a.load_state_dict(_roundtrip(opt_b.state_dict()))  # the same values in new tensors
    run(opt_a, pa, opt_b, pb, grads[2:])
    assert_same(opt_a, pa, opt_b, pb)


def state_edits_between_steps_are_honored(fmt):
    """Packed tensors keep their moments in their chunk's own buffers (the state entries are views of them): state
    written in place between steps, or replaced by new tensors, is what the next step reads."""
    values, grads = random_case([(300,), (17, 33), (5000,), (9,)], steps=4, seed=13)
    opt_a, pa, opt_b, pb = twins(values, torch.float32, state_format=fmt, lr=1e-2, seed=2)
    run(opt_a, pa, opt_b, pb, grads[:2])
    # 4-bit: both moments' codes in one tensor; its v scales and m scales stand for "v only" and "m only"
    m_key, v_key = ("exp_avg_mv", "exp_avg_sq_scale") if fmt == "4bit" else ("exp_avg", "exp_avg_sq")
    storages = {opt_a.state[p][m_key].untyped_storage().data_ptr() for p in (pa[0], pa[1], pa[3])}
    assert len(storages) == 1  # the small tensors' moments live in one chunk buffer
    for opt, ps in ((opt_a, pa), (opt_b, pb)):
        opt.state[ps[0]][v_key].zero_()  # in place
        opt.state[ps[3]][v_key] = opt.state[ps[3]][v_key].flip(0).clone()  # replaced, v only
    run(opt_a, pa, opt_b, pb, grads[2:3])
    for opt, ps in ((opt_a, pa), (opt_b, pb)):
        opt.state[ps[1]][m_key] = opt.state[ps[1]][m_key].flip(0).clone()  # replaced, m only (4-bit: the codes)
    run(opt_a, pa, opt_b, pb, grads[3:])
    assert_same(opt_a, pa, opt_b, pb)


def near_every_code(mant, bias=reference.BIAS):
    """Every code's value, the midpoints between neighbours, the subnormal boundary and tiny values, each also one
    ulp below and above, within [0, 1]."""
    values = reference.minifloat_value(torch.arange(bias * 2**mant + 1), mant, bias)
    extra = [2.0**-6, 2.0**-7, 2.0**-14, 2.0**-15, 2.0**-18, 2.0**-19, 2.0**-126, 1e-45, 3e-39, 1.0 - 2.0**-24]
    x = torch.cat([values, (values[1:] + values[:-1]) / 2, torch.tensor(extra)])
    x = torch.cat([x, torch.nextafter(x, torch.zeros(1)), torch.nextafter(x, torch.ones(1))])
    return x[(x >= 0) & (x <= 1)]


# block maxima: ordinary, fast-path limits, and beyond them (the reference's clamp path): a tiny scale (1/scale
# finite or inf), a huge one, one that rounds up to bf16 infinity. (8-bit state, format version 3, is coded by the
# reference's own functions in this engine: test_8bit_state_at_extreme_scales covers it against the oracle.)
SCALES = [1.0, 0.73, 3e-5, 2.0**-125, 2.0**-126, 2.0**-127, 2.0**-129, 2.0**-133]
SCALES += [2.0**100, 2.0**101, 2.0**120, 3.39e38, 3.4e38]


def eight_bit_state_at_extreme_scales(dtype):
    """Steps from 8-bit states with tiny (bf16 subnormal, 1/scale infinite), huge and zero block scales, with zero,
    tiny and signed-zero gradients: the engine's exact path and the reference agree."""
    _state_at_extreme_scales("8bit", dtype, first_numel=1024, huge_m_scale=2.0**110)


def four_bit_state_at_extreme_scales(dtype):
    """Steps from 4-bit states with tiny (bf16 subnormal, 1/scale infinite), huge (2**8 * scale overflows) and zero
    block scales, with zero, tiny and signed-zero gradients: the engine's exact paths and the reference agree."""
    _state_at_extreme_scales("4bit", dtype, first_numel=512, huge_m_scale=2.0**121)


def _state_at_extreme_scales(fmt, dtype, first_numel, huge_m_scale):
    values, grads = random_case([(first_numel,), (300,), (5000,)], steps=4, seed=12)
    opt_a, pa, opt_b, pb = twins(values, dtype, state_format=fmt, lr=1e-3, seed=4)
    run(opt_a, pa, opt_b, pb, grads[:1])
    tiny = torch.tensor([2.0**-133, 2.0**-128, 2.0**-126, 0.0], dtype=torch.bfloat16)
    for opt, ps in ((opt_a, pa), (opt_b, pb)):
        s = opt.state[ps[0]]
        s["exp_avg_scale"].copy_(tiny)
        s["exp_avg_sq_scale"].copy_(tiny.flip(0))
        s = opt.state[ps[2]]
        s["exp_avg_scale"][::3] = huge_m_scale
        s["exp_avg_sq_scale"][::5] = 2.0**120
    for row in grads[1:]:
        row[0].zero_()
        row[0][::7] = -0.0
        row[0][::11] = 1e-40
    run(opt_a, pa, opt_b, pb, grads[1:])
    assert_same(opt_a, pa, opt_b, pb)
