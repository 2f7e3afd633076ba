"""The plain-PyTorch engine against ``reference.adamw_step_ref_`` applied per tensor: the same bits, every path.

The oracle steps a twin optimizer tensor by tensor with the reference (what ``ApexW`` did on the CPU before the
engine). Parameters and every state tensor are compared bit for bit; where NaN is expected, NaN positions must agree
and the sign and payload bits of NaN are not compared (IEEE leaves them to the hardware). Most tests shrink the
engine's chunk to 4096 elements, so that small shapes exercise every layout: tensors used in place, split across
chunks, packed several to a chunk, and packed with 8-bit (4-bit) block padding.
"""

import io
import os
import tempfile

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from apexw_hf import ApexW, reference
from apexw_hf import dtensor as dt
from apexw_hf.engines import torch as torch_engine
from apexw_hf.engines import torch_passes

from ..distributed import workers
from .helpers import FORMATS, SHAPES, same_bits

FORMATS = tuple(dict.fromkeys((*FORMATS, "4bit")))
QUANTIZED = ("8bit", "4bit")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(torch_engine, "CHUNK", 4096)


@torch.no_grad()
def reference_step(opt: ApexW) -> None:
    """One step of ``opt`` by the per-tensor reference (the oracle)."""
    for group in opt.param_groups:
        b1, b2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = opt._init_state(p, group)
            state["step"] += 1
            t = int(state["step"].item())
            scalars = reference.StepScalars.make(
                lr=float(group["lr"]), beta1=b1, beta2=b2, eps=group["eps"], weight_decay=group["weight_decay"], step=t
            )
            reference.adamw_step_ref_(
                p,
                p.grad,
                state,
                fmt=group["state_format"],
                scalars=scalars,
                seed=group["seed"],
                tensor_index=opt._tensor_index(p),
                step=t,
                maximize=group["maximize"],
                param_rounding=group["param_rounding"],
            )


def assert_same(opt_a, params_a, opt_b, params_b):
    for i, (a, b) in enumerate(zip(params_a, params_b)):
        assert same_bits(a.detach(), b.detach()), f"param {i} {tuple(a.shape)} {a.dtype}"
        sa, sb = opt_a.state.get(a, {}), opt_b.state.get(b, {})
        assert sa.keys() == sb.keys(), i
        for key in sa:
            assert same_bits(sa[key], sb[key]), f"param {i} {tuple(a.shape)} state {key}"


def _make(values, dtype):
    return [torch.nn.Parameter(v.clone().to(dtype)) for v in values]


def _twins(values, dtype, groups=None, **kw):
    """(engine optimizer, its params, oracle optimizer, its params) over copies of ``values``."""
    pa, pb = _make(values, dtype), _make(values, dtype)
    if groups is None:
        return ApexW(pa, engine="torch", **kw), pa, ApexW(pb, engine="torch", **kw), pb
    return (
        ApexW(groups(pa), engine="torch", **kw),
        pa,
        ApexW(groups(pb), engine="torch", **kw),
        pb,
    )


def _run(opt_a, pa, opt_b, pb, grads_per_step):
    for grads in grads_per_step:
        for x, y, g in zip(pa, pb, grads):
            x.grad = None if g is None else g.to(x.dtype)
            y.grad = None if g is None else g.to(y.dtype)
        opt_a.step()
        reference_step(opt_b)


def _random(shapes, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    values = [torch.randn(s, generator=gen) for s in shapes]
    # gradients over many magnitudes, so the 8-bit codes span their range and moments differ per block
    grads = [
        [torch.randn(s, generator=gen) * 10.0 ** torch.randint(-6, 2, (1,), generator=gen).item() for s in shapes]
        for _ in range(steps)
    ]
    return values, grads


# optimizer options every path is compared under (also tests/optim/test_numba_engine.py)
OPTIONS = pytest.mark.parametrize(
    "options",
    [dict(), dict(maximize=True), dict(param_rounding="nearest"), dict(lr=3e-2, betas=(0.8, 0.95), eps=0.0)],
    ids=["default", "maximize", "nearest", "hparams"],
)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@OPTIONS
def test_matches_reference(small_chunks, fmt, dtype, options):
    values, grads = _random(SHAPES + [(4096,), (8193,), (64, 130)], steps=4)
    kw = dict(lr=1e-2, weight_decay=0.1, state_format=fmt, seed=7)
    kw.update(options)
    opt_a, pa, opt_b, pb = _twins(values, dtype, **kw)
    _run(opt_a, pa, opt_b, pb, grads)
    assert_same(opt_a, pa, opt_b, pb)


@pytest.mark.parametrize("fmt", FORMATS)
def test_default_chunk_size(fmt):
    """The shipped chunk size: a tensor used in place over two chunks plus its packed tail and small tensors."""
    n = torch_engine.CHUNK
    values, grads = _random([(2 * n + 300,), (257,), (3, 5)], steps=2, seed=1)
    opt_a, pa, opt_b, pb = _twins(values, torch.float32, state_format=fmt, lr=1e-2)
    _run(opt_a, pa, opt_b, pb, grads)
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


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference_with_cuda_semantics(small_chunks, monkeypatch, fmt, dtype):
    """The engine's bits hold under the semantics a CUDA device gives its operations where they differ from the
    CPU's: the kernel dtype of a mixed-dtype write (an int32 shift into int16 gave NaN bf16 parameters on an H200),
    and the square root from ``reference.sqrt_rn`` instead of NumPy."""
    init = torch_passes.Buffers.__init__

    def on_device(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.cpu = False

    monkeypatch.setattr(torch_passes.Buffers, "__init__", on_device)
    values, grads = _random(SHAPES + [(8193,)], steps=3, seed=3)
    opt_a, pa, opt_b, pb = _twins(values, dtype, lr=1e-2, weight_decay=0.1, state_format=fmt, seed=3)
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


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_special_values(small_chunks, fmt, dtype):
    n = 1300  # blocks 0..4 (256 elements each) and a partial block
    values = [_special_values(n, 0), torch.zeros(300), torch.randn(700), torch.randn(5)]
    steps = []
    gen = torch.Generator().manual_seed(3)
    for step in range(4):
        g = torch.randn(n, generator=gen)
        g[256:512] = 0.0  # an all-zero block
        g[512] = 1e30  # a block with one huge value
        g[600:604] = torch.tensor([1e-40, -1e-42, -0.0, 0.0])
        if step == 1:
            g[768] = float("inf")
            g[800] = float("-inf")
            g[1290] = float("inf")  # in the partial last block: its padding must stay zero next step
        if step == 2:
            g[1030] = float("nan")
        other = torch.randn(700, generator=gen)
        other[::50] = 0.0
        steps.append([g, torch.zeros(300), other, torch.full((5,), 1e-30)])
    opt_a, pa, opt_b, pb = _twins(values, dtype, state_format=fmt, lr=1e-3, seed=5)
    _run(opt_a, pa, opt_b, pb, steps)
    assert_same(opt_a, pa, opt_b, pb)
    # the blocks with an inf (768, 800: one block; 1290) or a NaN (1030) gradient were skipped, as the reference does;
    # in fp16 the gradient 1e30 (block 2) is an inf at every step
    fp16 = dtype == torch.float16
    assert opt_a.nonfinite_skipped == (4 if fp16 else 2)
    assert opt_a._nonfinite._read()[torch.device("cpu")][2] == (7 if fp16 else 3)  # blocks of tensor index 0
    assert torch.isfinite(pa[2].detach()).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_groups_missing_grads_and_unequal_steps(small_chunks, fmt):
    shapes = [(300,), (17, 33), (5000,), (1,), (256,), (9,)]
    values, grads = _random(shapes, steps=6, seed=2)
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

    opt_a, pa, opt_b, pb = _twins(values, torch.float32, groups=groups, state_format=fmt, seed=3)
    _run(opt_a, pa, opt_b, pb, grads)
    assert_same(opt_a, pa, opt_b, pb)
    assert int(opt_a.state[pa[1]]["step"]) == 4 and int(opt_a.state[pa[0]]["step"]) == 6
    assert pa[5] not in opt_a.state


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_mixed_param_and_grad_dtypes(small_chunks, fmt):
    values, grads = _random([(300,), (5000,), (17,), (257,)], steps=3, seed=4)
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


@pytest.mark.parametrize("fmt", FORMATS)
def test_non_contiguous_param_and_grad(small_chunks, fmt):
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


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resume_matches_unbroken_reference(small_chunks, fmt, dtype):
    values, grads = _random([(33, 65), (5000,), (1,)], steps=6, seed=6)
    grads[2][2] = None
    kw = dict(lr=1e-2, weight_decay=0.1, state_format=fmt, seed=11)
    opt_a, pa, opt_b, pb = _twins(values, dtype, **kw)
    _run(opt_a, pa, opt_b, pb, grads[:3])
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in pa]
    opt_r = ApexW(resumed, engine="torch", lr=1.0, state_format="fp32")
    opt_r.load_state_dict(_roundtrip(opt_a.state_dict()))
    _run(opt_r, resumed, opt_b, pb, grads[3:])
    assert_same(opt_r, resumed, opt_b, pb)


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_load_state_dict_replaces_the_cached_plan(small_chunks, fmt):
    """A loaded state must be the one stepped (the engine caches views of the state tensors)."""
    values, grads = _random([(5000,), (300,)], steps=4, seed=8)
    opt_a, pa, opt_b, pb = _twins(values, torch.float32, state_format=fmt)
    _run(opt_a, pa, opt_b, pb, grads[:2])
    opt_a.load_state_dict(_roundtrip(opt_b.state_dict()))  # the same values in new tensors
    _run(opt_a, pa, opt_b, pb, grads[2:])
    assert_same(opt_a, pa, opt_b, pb)


@pytest.mark.parametrize("fmt", FORMATS)
def test_state_edits_between_steps_are_honored(small_chunks, fmt):
    """Packed tensors keep their moments in their chunk's own buffers (the state entries are views of them): state
    written in place between steps, or replaced by new tensors, is what the next step reads."""
    values, grads = _random([(300,), (17, 33), (5000,), (9,)], steps=4, seed=13)
    opt_a, pa, opt_b, pb = _twins(values, torch.float32, state_format=fmt, lr=1e-2, seed=2)
    _run(opt_a, pa, opt_b, pb, grads[:2])
    # 4-bit: both moments' codes in one tensor; its v scales and m scales stand for "v only" and "m only"
    m_key, v_key = ("exp_avg_mv", "exp_avg_sq_scale") if fmt == "4bit" else ("exp_avg", "exp_avg_sq")
    storages = {opt_a.state[p][m_key].untyped_storage().data_ptr() for p in (pa[0], pa[1], pa[3])}
    assert len(storages) == 1  # the small tensors' moments live in one chunk buffer
    for opt, ps in ((opt_a, pa), (opt_b, pb)):
        opt.state[ps[0]][v_key].zero_()  # in place
        opt.state[ps[3]][v_key] = opt.state[ps[3]][v_key].flip(0).clone()  # replaced, v only
    _run(opt_a, pa, opt_b, pb, grads[2:3])
    for opt, ps in ((opt_a, pa), (opt_b, pb)):
        opt.state[ps[1]][m_key] = opt.state[ps[1]][m_key].flip(0).clone()  # replaced, m only (4-bit: the codes)
    _run(opt_a, pa, opt_b, pb, grads[3:])
    assert_same(opt_a, pa, opt_b, pb)


@pytest.mark.parametrize("fmt", FORMATS)
def test_parameters_given_new_memory_between_steps_are_stepped(small_chunks, fmt):
    """The chunks keep views of the parameters' memory. A parameter object that keeps its identity and state but gets
    other memory (``p.data = ...``; ``swap_tensors``, which ``Module._apply`` uses for DTensor parameters; FSDP2
    re-padding a shard) must be stepped where its elements are now: a full chunk, a tail, a packed tensor."""
    values, grads = _random([(4096 + 300,), (17, 33), (9,)], steps=3, seed=21)
    opt_a, pa, opt_b, pb = _twins(values, torch.float32, state_format=fmt, lr=1e-2, seed=4)
    _run(opt_a, pa, opt_b, pb, grads[:1])
    for p in pa:
        p.data = p.data.clone()  # same values, other memory
    _run(opt_a, pa, opt_b, pb, grads[1:])
    assert_same(opt_a, pa, opt_b, pb)


def test_auto_engine_on_cpu_uses_it():
    p = torch.nn.Parameter(torch.randn(10))
    opt = ApexW([p])
    p.grad = torch.randn(10)
    opt.step()
    assert isinstance(opt._cpu_engine, torch_engine.TorchEngine) and opt._engine is None


def test_gradient_of_another_shape_is_an_error():
    p = torch.nn.Parameter(torch.randn(4, 6))
    opt = ApexW([p], engine="torch")
    p.grad = torch.randn(4, 6)
    opt.step()
    p.grad.set_(torch.randn(24))  # torch refuses to assign such a gradient, not to reshape one in place
    with pytest.raises(ValueError, match=r"a gradient of shape \(24,\) for a parameter of shape \(4, 6\)"):
        opt.step()


def test_sqrt_is_correctly_rounded():
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(1 << 17, generator=gen) * torch.logspace(-45, 38, 1 << 17)
    x[:6] = torch.tensor([0.0, 1e-45, 2.0, 3.4e38, float("inf"), 1e-38])
    b = torch_passes.Scratch(torch.device("cpu"), 1 << 17).upto(x.numel())
    b.v.copy_(x)
    torch_passes.sqrt_into(b, b.v, b.np["v"], b.a, b.np["a"])
    assert torch.equal(b.a, reference.sqrt_rn(x))


@pytest.mark.parametrize("aligned", [True, False], ids=["block-aligned", "unaligned"])
@pytest.mark.parametrize("top", [True, False])
def test_hash_matches_reference_per_piece(aligned, top):
    """A packed chunk: pieces of tensors at various chunk offsets and tensor offsets, each with its own key. Pieces
    that all start at a block take the per-block path, the others the cumsum."""
    sc = torch_passes.Scratch(torch.device("cpu"), 1 << 17)
    if aligned:
        segs = [(0, 0, 300, 0, True), (1, 4096, 1000, 512, False), (2, 0, 1, 1536, True), (3, 7, 2000, 1792, False)]
        n = 3840
    else:
        segs = [(0, 0, 300, 0, True), (1, 4096, 1000, 300, False), (2, 0, 1, 1300, True), (3, 7, 2000, 1301, False)]
        n = 3301
    keys = [reference.stream_key(s, i, 3, reference.STREAM_MV) for i, s in enumerate((0, 5, 2**32 - 1, 17))]
    b = sc.upto(n)
    assert (b.block_counts(tuple(s[3] for s in segs)) is not None) == aligned
    torch_passes.hash_into(b, sc.c, segs, keys, top=top)
    full = torch_passes.full_bits(b)
    for (_, a, k, o, _), key in zip(segs, keys):
        want = reference.hash_uniform_bits(a + k, key, "cpu")[a:]
        assert torch.equal(full[o : o + k], want)
        z = b.z[o : o + k].long() & reference.MASK32
        if top:
            assert torch.equal(b.t[o : o + k].long(), want >> 16)
            assert torch.equal(z, want)  # the whole word
        else:
            assert torch.equal(z & 0xFFFF, want & 0xFFFF)  # its low half


def _near_every_code(mant, bias=reference.BIAS):
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
_SCALES = [1.0, 0.73, 3e-5, 2.0**-125, 2.0**-126, 2.0**-127, 2.0**-129, 2.0**-133]
_SCALES += [2.0**100, 2.0**101, 2.0**120, 3.39e38, 3.4e38]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_8bit_state_at_extreme_scales(small_chunks, dtype):
    """Steps from 8-bit states with tiny (bf16 subnormal, 1/scale infinite), huge and zero block scales, with zero,
    tiny and signed-zero gradients: the engine's exact path and the reference agree."""
    values, grads = _random([(1024,), (300,), (5000,)], steps=4, seed=12)
    opt_a, pa, opt_b, pb = _twins(values, dtype, state_format="8bit", lr=1e-3, seed=4)
    _run(opt_a, pa, opt_b, pb, grads[:1])
    tiny = torch.tensor([2.0**-133, 2.0**-128, 2.0**-126, 0.0], dtype=torch.bfloat16)
    for opt, ps in ((opt_a, pa), (opt_b, pb)):
        s = opt.state[ps[0]]
        s["exp_avg_scale"].copy_(tiny)
        s["exp_avg_sq_scale"].copy_(tiny.flip(0))
        s = opt.state[ps[2]]
        s["exp_avg_scale"][::3] = 2.0**110
        s["exp_avg_sq_scale"][::5] = 2.0**120
    for row in grads[1:]:
        row[0].zero_()
        row[0][::7] = -0.0
        row[0][::11] = 1e-40
    _run(opt_a, pa, opt_b, pb, grads[1:])
    assert_same(opt_a, pa, opt_b, pb)


def _encode_chunk4(m, v, key):
    """The engine's 4-bit encoding of one chunk (``m`` and ``v``, whole blocks of 128), its path and the reference's
    codes and scales for the same random words."""
    n = m.numel()
    sc = torch_passes.Scratch(torch.device("cpu"), n)
    b = sc.upto(n, reference.BLOCK4)
    torch_passes.hash_into(b, sc.c, [(0, 0, n, 0, True)], [key], top=True)  # 4-bit v reads bits 16-21 too
    b.m.copy_(m)
    b.v.copy_(v)
    torch_passes.sign_and_abs(b, sc.c)
    nb = n // reference.BLOCK4
    got = [
        torch.empty(n, dtype=torch.uint8),
        torch.empty(nb, dtype=torch.bfloat16),
        torch.empty(nb, dtype=torch.float32),  # format version 2: the exact v absmax
    ]
    path = torch_passes.block_scales(b, sc.c, got[1], got[2])
    if path != "ref":
        torch_passes.encode_4bit(b, sc.c, got[0], path == "exact")
    return got, list(reference.quantize_mv4(m, v, reference.hash_uniform_bits(n, key, "cpu"))), path


@pytest.mark.parametrize("top", _SCALES)
def test_4bit_codes_at_every_boundary(top):
    """As for 8-bit: normalized values at, between, and one ulp around every 4-bit code's value (both moments, and
    the 8-bit ones), signed zeros, fp32 subnormals, a zero block, with block maxima across the range of scales."""
    gen = torch.Generator().manual_seed(1)
    near = torch.cat([_near_every_code(0, reference.M4_BIAS), _near_every_code(0), _near_every_code(3)])
    y = torch.cat([near, torch.rand(2048, generator=gen) ** 8, torch.rand(256, generator=gen) * 2.0**-5])
    y = y[torch.randperm(y.numel(), generator=gen)]
    y = torch.cat([y, y.new_zeros(-y.numel() % 128 + 128)]).view(-1, 128)  # the last block all zero
    y[:-1, 0] = 1.0
    y[1, 0] = 0.77
    x = (y * top).reshape(-1)
    x[5:600:128] = 1e-45  # fp32 subnormals in blocks with a large maximum: y underflows
    m = torch.where(torch.rand(x.numel(), generator=gen) < 0.5, -x, x)
    m[3::97] = -0.0
    v = x.flip(0)
    amax = torch.cat([m.abs(), v]).view(-1, 128).amax(1)
    amax = amax[amax > 0]
    fast = bool((amax >= torch_passes.FAST_SCALE_MIN).all() and (amax <= torch_passes.FAST_SCALE_MAX).all())
    assert fast == (2.0**-126 / 0.77 <= top <= 2.0**100)
    for key in (12345, 2**32 - 1):
        got, want, path = _encode_chunk4(m, v, key)
        assert path == ("fast" if fast else "exact")
        for g, w, name in zip(got, want, ("codes", "m scales", "v scales")):
            assert same_bits(g, w), name


@pytest.mark.parametrize("v_zeros", [True, False])
def test_4bit_nonzero_v_never_gets_code_0(v_zeros):
    """The two ways of keeping a nonzero v off code 0 (a chunk without a zero v, and one with zeros), with m codes of
    both signs in the same bytes."""
    gen = torch.Generator().manual_seed(2)
    v = torch.rand(4096, generator=gen) ** 20  # most far below 2**-14 of their block maximum
    v[::128] = 1.0
    v[7] = 1e-45
    if v_zeros:
        v[100:110] = 0.0
    m = torch.randn(4096, generator=gen)
    got, want, path = _encode_chunk4(m, v, 99)
    assert path == "fast"
    assert all(same_bits(g, w) for g, w in zip(got, want))
    cv = got[0] >> 4
    assert (cv[v > 0] > 0).all() and (cv[v == 0] == 0).all()
    assert ((cv == 1) & (v < 1e-10)).sum() > 100  # the rule did matter
    assert ((got[0] & 8) > 0).sum() > 1000  # negative m codes sit beside the v codes


def test_4bit_nan_and_inf_take_the_reference_path():
    m = torch.randn(512)
    v = torch.rand(512)
    for bad in (float("nan"), float("inf")):
        m2 = m.clone()
        m2[300] = bad
        assert _encode_chunk4(m2, v, 1)[2] == "ref"
        v2 = v.clone()
        v2[3] = bad
        assert _encode_chunk4(m, v2, 1)[2] == "ref"


def test_4bit_decode_every_code():
    """Every byte (both codes) under m and v scales 0, tiny, ordinary, huge, inf and NaN, and m scales at and
    around 2**120, where 2**8 * scale overflows (the decoder's other order)."""
    codes = torch.arange(256, dtype=torch.uint8).repeat_interleave(2).repeat(6)  # 24 blocks of 128
    scales = [0.0, 2.0**-133, 1.0, 0.73, 3e38, float("inf"), float("nan"), 2.0**-126, 2.0**119, 2.0**120, 3.3e38]
    scales = torch.tensor(scales + [1.5] * 13).to(torch.bfloat16)
    n = codes.numel()
    sc = torch_passes.Scratch(torch.device("cpu"), n)
    b = sc.upto(n, reference.BLOCK4)
    for m_scale, v_scale in ((scales, scales.flip(0)), (scales.clamp(max=2.0**119), scales)):
        torch_passes.decode_4bit(b, sc.c, codes, m_scale, v_scale)
        want_m, want_v = reference.dequantize_mv4(codes, m_scale, v_scale)
        assert same_bits(b.m, want_m) and same_bits(b.v, want_v)
    assert torch.signbit(b.m[codes == 8]).all()  # the m code of a negative zero


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_4bit_state_at_extreme_scales(small_chunks, dtype):
    """Steps from 4-bit states with tiny (bf16 subnormal, 1/scale infinite), huge (2**8 * scale overflows) and zero
    block scales, with zero, tiny and signed-zero gradients: the engine's exact paths and the reference agree."""
    values, grads = _random([(512,), (300,), (5000,)], steps=4, seed=12)
    opt_a, pa, opt_b, pb = _twins(values, dtype, state_format="4bit", lr=1e-3, seed=4)
    _run(opt_a, pa, opt_b, pb, grads[:1])
    tiny = torch.tensor([2.0**-133, 2.0**-128, 2.0**-126, 0.0], dtype=torch.bfloat16)
    for opt, ps in ((opt_a, pa), (opt_b, pb)):
        s = opt.state[ps[0]]
        s["exp_avg_scale"].copy_(tiny)
        s["exp_avg_sq_scale"].copy_(tiny.flip(0))
        s = opt.state[ps[2]]
        s["exp_avg_scale"][::3] = 2.0**121
        s["exp_avg_sq_scale"][::5] = 2.0**120
    for row in grads[1:]:
        row[0].zero_()
        row[0][::7] = -0.0
        row[0][::11] = 1e-40
    _run(opt_a, pa, opt_b, pb, grads[1:])
    assert_same(opt_a, pa, opt_b, pb)


def _dtensor_worker(rank, world, store, out):
    """One rank: each format's engine against the reference on the local shards of DTensor parameters."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch_engine.CHUNK = 4096
    mesh = init_device_mesh("cpu", (world,))
    failures = []
    for fmt in FORMATS:
        values, grads = _random([(301, 7), (5000,), (3, 5), (9000,)], steps=3, seed=14)
        pa, pb = ([torch.nn.Parameter(distribute_tensor(v, mesh, [Shard(0)])) for v in values] for _ in range(2))
        opt_a, opt_b = (
            ApexW(ps, engine="torch", state_format=fmt, lr=1e-2, weight_decay=0.1, seed=3) for ps in (pa, pb)
        )
        group = opt_b.param_groups[0]
        for row in grads:
            for x, y, g in zip(pa, pb, row):
                x.grad, y.grad = distribute_tensor(g, mesh, [Shard(0)]), distribute_tensor(g, mesh, [Shard(0)])
            opt_a.step()
            with torch.no_grad():
                for p in pb:
                    state = opt_b._init_state(p, group)
                    state["step"] += 1
                    t = int(state["step"].item())
                    s = reference.StepScalars.make(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=t)
                    reference.adamw_step_ref_(
                        p.to_local(),
                        p.grad.to_local(),
                        dt.local_view(state, p),
                        fmt=fmt,
                        scalars=s,
                        seed=3,
                        tensor_index=opt_b._tensor_index(p),
                        step=t,
                    )
        for i, (x, y) in enumerate(zip(pa, pb)):
            sa, sb = dt.local_view(opt_a.state[x], x), dt.local_view(opt_b.state[y], y)
            if not same_bits(x.detach().to_local(), y.detach().to_local()):
                failures.append(f"{fmt} param {i}")
            failures += [
                f"{fmt} param {i} state {k}"
                for k in sb
                if not (same_bits(sa[k], sb[k]) if isinstance(sb[k], torch.Tensor) else sa[k] == sb[k])
            ]
    workers.save_result(out, rank, failures)
    workers.finish()


@pytest.mark.skipif(not dt.DTensor or not torch.distributed.is_available(), reason="torch without distributed")
def test_dtensor_local_shards_match_reference():
    """DTensor parameters (two gloo ranks, uneven shards): the engine steps each rank's local shard exactly as the
    reference does, in every format (4-bit scales per 128 elements of the local shard)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_dtensor_worker, args=(2, os.path.join(tmp, "store"), tmp), nprocs=2, join=True)
        for r in range(2):
            assert torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=True) == []


def test_comparison_notices_one_bit():
    """The comparison these tests rely on tells apart values one ulp apart, and -0 from +0."""
    x = torch.tensor([1.0, 0.0])
    assert not same_bits(x, torch.tensor([torch.nextafter(x[0], x[1]).item(), 0.0]))
    assert not same_bits(x, torch.tensor([1.0, -0.0]))
    assert same_bits(torch.tensor([float("nan")]), -torch.tensor([float("nan")]))
