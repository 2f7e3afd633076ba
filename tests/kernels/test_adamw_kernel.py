"""The one-launch AdamW kernel against the plain-PyTorch reference, bit for bit."""

import pytest
import torch

from apexw_hf import formats as st
from apexw_hf import reference as ref
from apexw_hf.engines.triton.kernels import adamw_step_

from .helpers import DEVICE, DTYPES, SHAPES, mismatch, same_bits

HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def _run_both(
    params,
    grads_per_step,
    fmt,
    *,
    param_rounding="stochastic",
    maximize=False,
    seed=3,
    first_index=5,
    states=None,
    hp=HP,
    words=None,
    tile=(None, None),
    maxnreg="auto",
    grad_scale=None,
):
    """Step copies of ``params`` with the kernel (one launch per step) and with the reference; compare everything.

    ``grad_scale``: a float the kernel multiplies the gradients by first (``adamw_step_(grad_scale=...)``); the
    reference gets them multiplied in place as gradient release's clip does without the kernel
    (``torch._foreach_mul_`` by the factor rounded to the gradients' dtype).

    ``states``: initial states (default: fresh ones); ``hp``: hyperparameters; ``words``: whether the launch must
    (True) or must not (False) take the whole-block, 16-byte aligned path that moves data as uint32 words; ``tile``:
    (rows, warps) of the launch (default: launch.LAUNCH_CONFIG); ``maxnreg``: a register cap for the compiler
    (default: the engine's, launch.MAX_REGISTERS).
    """
    kp = [p.clone() for p in params]
    rp = [p.clone() for p in params]
    ks = (
        [st.init_state(p, fmt) for p in params]
        if states is None
        else [{k: v.clone() for k, v in s.items()} for s in states]
    )
    rs = [{k: v.clone() for k, v in s.items()} for s in ks]
    indices = [first_index + i for i in range(len(params))]
    if words is not None:
        assert _takes_word_path(kp, grads_per_step[0], ks) == words
    scale = None if grad_scale is None else torch.tensor([grad_scale], dtype=torch.float32, device=DEVICE)
    for step, grads in enumerate(grads_per_step, start=1):
        scalars = ref.StepScalars.make(step=step, **hp)
        adamw_step_(
            kp,
            grads,
            ks,
            fmt=fmt,
            scalars=scalars,
            seed=seed,
            tensor_indices=indices,
            step=step,
            maximize=maximize,
            param_rounding=param_rounding,
            rows=tile[0],
            num_warps=tile[1],
            maxnreg=maxnreg,
            grad_scale=scale,
        )
        if scale is not None:  # the reference's copy, multiplied in place
            grads = [g.clone() for g in grads]
            torch._foreach_mul_(grads, scale.reshape(()).to(grads[0].dtype))
        for p, g, s, i in zip(rp, grads, rs, indices):
            ref.adamw_step_ref_(
                p,
                g,
                s,
                fmt=fmt,
                scalars=scalars,
                seed=seed,
                tensor_index=i,
                step=step,
                maximize=maximize,
                param_rounding=param_rounding,
            )
    for i, (a, b, sa, sb) in enumerate(zip(kp, rp, ks, rs)):
        assert same_bits(a, b), f"param {i} {tuple(a.shape)}: {mismatch(a, b)}"
        for key in sa:
            if key != "step":
                assert same_bits(sa[key], sb[key]), (
                    f"{key} of param {i} {tuple(a.shape)}: {mismatch(sa[key], sb[key])}"
                )


def _takes_word_path(params, grads, states) -> bool:
    """Whether a launch over these tensors is specialized EVEN and ALIGNED (see launch.LaunchPlan)."""
    tensors = (
        list(params) + list(grads) + [s[k] for s in states for k in ("exp_avg", "exp_avg_sq", "exp_avg_mv") if k in s]
    )
    return all(p.numel() % 256 == 0 for p in params) and all(t.data_ptr() % 16 == 0 for t in tensors)


def _randn(shape, dtype, gen, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(DEVICE)


FORMATS = ("fp32", "compact", "8bit", "4bit")
QUANTIZED = ("8bit", "4bit")
CASES = [(fmt, p, g) for fmt in FORMATS for p in DTYPES for g in DTYPES if g in ("fp32", p)]


@pytest.mark.parametrize("fmt,pdt,gdt", CASES)
def test_shapes_and_dtypes_bit_exact(fmt, pdt, gdt):
    gen = torch.Generator().manual_seed(0)
    params = [_randn(s, DTYPES[pdt], gen) for s in SHAPES]
    grads = [[_randn(s, DTYPES[gdt], gen, scale=1 + k) for s in SHAPES] for k in range(3)]
    _run_both(params, grads, fmt)


@pytest.mark.parametrize("fmt", ["compact", *QUANTIZED])
@pytest.mark.parametrize("pdt", ["bf16", "fp16"])
def test_nearest_rounding_and_maximize(fmt, pdt):
    gen = torch.Generator().manual_seed(1)
    shapes = [(257,), (33, 65)]
    params = [_randn(s, DTYPES[pdt], gen) for s in shapes]
    grads = [[_randn(s, torch.float32, gen) for s in shapes] for _ in range(2)]
    _run_both(params, grads, fmt, param_rounding="nearest", maximize=True)


def _special_tensors(dtype):
    """Tensors full of edge cases; the NaN/inf ones must not disturb the others (same launch)."""
    f32 = torch.float32
    tiny = torch.finfo(dtype).tiny
    specials = torch.tensor(
        [0.0, -0.0, float("inf"), -float("inf"), float("nan"), tiny / 4, -tiny / 2, 1e-30, 3e38], dtype=f32
    )
    n = 600
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(n, generator=gen)
    with_specials = base.clone()
    with_specials[::67][: len(specials)] = specials[: len(with_specials[::67])]
    huge = base.clone()
    huge[300] = 1e30
    zero_block = base.clone()
    zero_block[256:512] = 0
    subnormal = torch.full((300,), tiny / 8, dtype=f32) * torch.randn(300, generator=gen).sign()
    return [with_specials, huge, zero_block, subnormal, base.clone()]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("pdt", ["fp32", "bf16", "fp16"])
def test_special_values(fmt, pdt):
    dtype = DTYPES[pdt]
    gen = torch.Generator().manual_seed(3)
    params = [t.to(dtype).to(DEVICE) for t in _special_tensors(dtype)]
    grads = []
    for k in range(3):
        gs = [t.roll(k * 7).to(DEVICE) for t in _special_tensors(dtype)]
        gs[4] = torch.zeros_like(gs[4])  # zero gradient everywhere: must not drift
        gs[2] = _randn(gs[2].shape, torch.float32, gen) * (gs[2] != 0)
        grads.append(gs)
    _run_both(params, grads, fmt)


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_many_steps_zero_gradient_exact(fmt):
    gen = torch.Generator().manual_seed(4)
    p = _randn((513,), torch.float32, gen)
    grads = [
        [torch.where(torch.arange(513, device=DEVICE) < 256, _randn((513,), torch.float32, gen), 0.0)]
        for _ in range(6)
    ]
    _run_both([p], grads, fmt)


def test_large_tensor_index_and_seed():
    """Random keys depend on the tensor index and seed exactly as in the reference (high bits included)."""
    gen = torch.Generator().manual_seed(5)
    params = [_randn((300,), torch.bfloat16, gen) for _ in range(2)]
    grads = [[_randn((300,), torch.float32, gen) for _ in range(2)]]
    _run_both(params, grads, "compact", seed=2**32 - 1, first_index=123457)


@pytest.mark.parametrize("fmt", ["compact", *QUANTIZED])
def test_program_lookup_over_many_tensors(fmt):
    """Each program finds its tensor by a search that starts from one table entry per 64 programs: tensors of one,
    none and many chunks, group boundaries falling inside and between tensors, all step exactly as the reference."""
    gen = torch.Generator().manual_seed(6)
    sizes = [256] * 70 + [0, 0] + [256 * 130 + 7] + [1, 0, 300] * 10 + [256 * 64] + [0] + [5]
    params = [_randn((n,), torch.float32, gen) for n in sizes]
    grads = [[_randn((n,), torch.float32, gen) for n in sizes]]
    _run_both(params, grads, fmt)


WHOLE_BLOCKS = [(256,), (4, 128), (1024,), (3, 512)]


@pytest.mark.parametrize("fmt,pdt,gdt", CASES)
def test_whole_blocks_word_path(fmt, pdt, gdt):
    """Every tensor whole 256-element blocks at aligned addresses: the specialization that loads and stores 16-bit and
    8-bit data as uint32 words."""
    gen = torch.Generator().manual_seed(10)
    params = [_randn(s, DTYPES[pdt], gen) for s in WHOLE_BLOCKS]
    grads = [[_randn(s, DTYPES[gdt], gen, scale=1 + k) for s in WHOLE_BLOCKS] for k in range(2)]
    _run_both(params, grads, fmt, words=True)


@pytest.mark.parametrize("fmt", ["compact", *QUANTIZED])
@pytest.mark.parametrize("pdt", ["bf16", "fp16"])
def test_whole_blocks_nearest_rounding_and_maximize(fmt, pdt):
    gen = torch.Generator().manual_seed(11)
    params = [_randn(s, DTYPES[pdt], gen) for s in WHOLE_BLOCKS[:2]]
    grads = [[_randn(s, torch.float32, gen) for s in WHOLE_BLOCKS[:2]] for _ in range(2)]
    _run_both(params, grads, fmt, param_rounding="nearest", maximize=True, words=True)


@pytest.mark.parametrize("fmt", ["compact", *QUANTIZED])
def test_whole_blocks_unaligned_gradient(fmt):
    """Whole blocks, but a gradient at an address that is not 16-byte aligned: element-wise loads and stores."""
    gen = torch.Generator().manual_seed(12)
    params = [_randn((512,), torch.bfloat16, gen), _randn((256,), torch.bfloat16, gen)]
    grads = []
    for _ in range(2):
        buf = _randn((513,), torch.bfloat16, gen)
        grads.append([buf[1:], _randn((256,), torch.bfloat16, gen)])
    _run_both(params, grads, fmt, words=False)


@pytest.mark.parametrize("fmt", ["compact", *QUANTIZED])
@pytest.mark.parametrize("even", [True, False], ids=["whole_blocks", "partial_blocks"])
def test_special_values_word_path(fmt, even):
    """NaN, inf, signed zeros, subnormals in parameters and gradients (bf16), through both load paths."""
    dtype = torch.bfloat16
    tensors = [t[:512] if even else t for t in _special_tensors(dtype)[:3]]
    tensors = [torch.cat([t, t[: 512 - t.numel()]]) if even and t.numel() < 512 else t for t in tensors]
    params = [t.to(dtype).to(DEVICE) for t in tensors]
    grads = [[t.roll(3 * k).to(dtype).to(DEVICE) for t in tensors] for k in range(2)]
    _run_both(params, grads, fmt, words=even)


def _all_codes_state(p, gen):
    """An 8-bit state holding every m code and every v code in each block, with scales that cover the ordinary and
    the special cases (0, subnormal, huge, inf, NaN)."""
    s = st.init_state(p, "8bit")
    nb = s["exp_avg_scale"].numel()
    s["exp_avg"].copy_(
        torch.stack([torch.randperm(256, generator=gen) for _ in range(nb)]).reshape(-1)[: p.numel()].view(p.shape)
    )
    s["exp_avg_sq"].copy_(
        torch.stack([torch.randperm(256, generator=gen) for _ in range(nb)]).reshape(-1)[: p.numel()].view(p.shape)
    )
    specials = [1.0, 3.0, 2.0**-10, 0.0, 2.0**-133, 1e30, float("inf"), float("nan")]
    s["exp_avg_scale"].copy_(torch.tensor([specials[i % len(specials)] for i in range(nb)]))
    s["exp_avg_sq_scale"].copy_(torch.tensor([specials[(i + 3) % len(specials)] for i in range(nb)]))
    return {k: v.to(DEVICE) for k, v in s.items()}


@pytest.mark.parametrize("pdt", ["fp32", "bf16"])
@pytest.mark.parametrize("even", [True, False], ids=["whole_blocks", "partial_blocks"])
def test_8bit_every_code_in_the_state(pdt, even):
    """States holding every code under every kind of scale are decoded, updated and re-encoded as the reference does
    (decoding by words and by bytes)."""
    gen = torch.Generator().manual_seed(13)
    shapes = [(2048,), (8, 256)] if even else [(2048,), (7, 77)]
    params = [_randn(s, DTYPES[pdt], gen) for s in shapes]
    states = [_all_codes_state(p, gen) for p in params]
    grads = [[_randn(s, torch.float32, gen) for s in shapes]]
    _run_both(params, grads, "8bit", states=states, words=even)


def test_8bit_encoder_sees_exact_values():
    """beta1 = beta2 = 0: the new moments are the gradient and its square, so the values at the code boundaries
    (the code values, their neighbours, the subnormal/normal boundary) reach the encoder exactly."""
    c = ref.minifloat_value(torch.arange(121), ref.M_MANT)
    b = ref.MIN_NORMAL
    vals = torch.cat(
        [
            c,
            torch.nextafter(c, torch.zeros_like(c)),
            torch.nextafter(c, torch.ones_like(c)),
            torch.tensor([b, b * (1 - 2**-24), b - 2**-38, 2**-149, 0.0, -0.0]),
        ]
    )
    vals = vals[vals <= 1]
    g = torch.cat([torch.ones(1), vals, -vals])
    g = torch.cat([g, torch.zeros(256 * ref.num_blocks(g.numel()) - g.numel())])
    params = [torch.zeros_like(g).to(DEVICE)]
    hp = dict(lr=1e-3, beta1=0.0, beta2=0.0, eps=1e-8, weight_decay=0.0)
    _run_both(params, [[g.to(DEVICE)]], "8bit", hp=hp, words=True)


@pytest.mark.parametrize("fmt", ["compact", *QUANTIZED])
def test_per_tensor_steps(fmt):
    """Tensors of one launch at different step counts (after missing gradients): each its own random stream and bias
    corrections."""
    import numpy as np

    from apexw_hf.engines.triton.kernels import LaunchPlan

    gen = torch.Generator().manual_seed(14)
    shapes = [(512,), (256,), (300,)]
    params = [_randn(s, torch.bfloat16, gen) for s in shapes]
    grads = [_randn(s, torch.float32, gen) for s in shapes]
    steps = [3, 7, 1]
    kp = [p.clone() for p in params]
    ks = [st.init_state(p, fmt) for p in params]
    rs = [{k: v.clone() for k, v in s.items()} for s in ks]
    sc = [ref.StepScalars.make(step=t, **HP) for t in steps]
    plan = LaunchPlan(kp, ks, fmt, [0, 1, 2], 9, torch.float32)
    plan.set_grad_ptrs([g.data_ptr() for g in grads])
    plan.set_tensor_steps(np.array(steps), [s.step_size for s in sc], [s.inv_bc2_sqrt for s in sc])
    plan.launch(step=steps[0], scalars=sc[0], maximize=False, stochastic_param=True, per_tensor_step=True)
    for i, (p, g, s) in enumerate(zip(params, grads, rs)):
        r = p.clone()
        ref.adamw_step_ref_(r, g, s, fmt=fmt, scalars=sc[i], seed=9, tensor_index=i, step=steps[i])
        assert same_bits(kp[i], r), f"param {i}: {mismatch(kp[i], r)}"
        for key in s:
            assert same_bits(ks[i][key], s[key]), f"{key} of param {i}: {mismatch(ks[i][key], s[key])}"


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("even", [True, False], ids=["whole_blocks", "partial_blocks"])
def test_nan_payloads_round_to_the_bf16_nan(rounding, even):
    """A NaN with every payload bit set (the NaN of CUDA arithmetic; the CPU propagates a gradient's payload) must
    still round to the bf16 NaN: adding the rounding bits to its pattern would carry into the sign."""
    gen = torch.Generator().manual_seed(15)
    n = 512 if even else 300
    params = [_randn((n,), torch.bfloat16, gen)]
    g = _randn((n,), torch.float32, gen)
    g.view(torch.int32)[7] = 0x7FFFFFFF
    g.view(torch.int32)[300 - 9] = -1  # 0xFFFFFFFF
    for fmt in ("compact", *QUANTIZED):
        _run_both(params, [[g]], fmt, param_rounding=rounding, words=even)


# ---- 4-bit specifics ----------------------------------------------------------------------------------------------


def _all_bytes_state4(p, gen):
    """A 4-bit state holding all 256 bytes (every m code with every v code) in every pair of 128-element blocks, with
    scales that cover the ordinary and the special cases (0, subnormal, huge, inf, NaN) for both moments."""
    s = st.init_state(p, "4bit")
    n, nb = p.numel(), s["exp_avg_scale"].numel()
    codes = torch.stack([torch.randperm(256, generator=gen) for _ in range((n + 255) // 256)]).reshape(-1)[:n]
    s["exp_avg_mv"].copy_(codes.view(p.shape))
    specials = [1.0, 3.0, 2.0**-10, 0.0, 2.0**-133, 1e30, float("inf"), float("nan"), 2.0**121, 2.0**-120]
    s["exp_avg_scale"].copy_(torch.tensor([specials[i % len(specials)] for i in range(nb)]))
    s["exp_avg_sq_scale"].copy_(torch.tensor([specials[(i + 3) % len(specials)] for i in range(nb)]))
    return {k: v.to(DEVICE) for k, v in s.items()}


@pytest.mark.parametrize("pdt", ["fp32", "bf16"])
@pytest.mark.parametrize("even", [True, False], ids=["whole_blocks", "partial_blocks"])
def test_4bit_every_byte_in_the_state(pdt, even):
    """States holding every byte (both codes) under every kind of scale are decoded (by words and by bytes), updated
    and re-encoded as the reference does."""
    gen = torch.Generator().manual_seed(16)
    shapes = [(2560,), (8, 256)] if even else [(2560,), (7, 77), (384,)]
    params = [_randn(s, DTYPES[pdt], gen) for s in shapes]
    states = [_all_bytes_state4(p, gen) for p in params]
    grads = [[_randn(s, torch.float32, gen) for s in shapes]]
    _run_both(params, grads, "4bit", states=states, words=even)


def test_4bit_encoder_sees_exact_values():
    """beta1 = beta2 = 0: the new moments are the gradient and its square, so the 4-bit code values (m: 2**-6 .. 1; v:
    2**-14 .. 1 as squares of 2**-7 .. 1), their fp32 neighbours, the subnormal/normal boundaries of both codes and
    the midpoints between codes reach the encoder exactly, in blocks led by 1 (scale 1)."""
    c = torch.cat([torch.zeros(1), 2.0 ** torch.arange(-14, 1, dtype=torch.float32)])
    mid = (c[1:] + c[:-1]) / 2
    vals = torch.cat(
        [
            c,
            mid,
            torch.nextafter(c, torch.zeros_like(c)),
            torch.nextafter(c, torch.ones_like(c)),
            torch.tensor([2.0**-6 - 2.0**-30, 2.0**-7 + 2.0**-30, 2.0**-29, 2.0**-30, 2.0**-149, -0.0]),
        ]
    )
    vals = vals[vals <= 1]
    blocks = [torch.cat([torch.ones(1), b]) for b in torch.cat([vals, -vals]).split(127)]
    g = torch.cat(blocks)
    g = torch.cat([g, torch.zeros(256 * ref.num_blocks(g.numel()) - g.numel())])
    params = [torch.zeros_like(g).to(DEVICE)]
    hp = dict(lr=1e-3, beta1=0.0, beta2=0.0, eps=1e-8, weight_decay=0.0)
    _run_both(params, [[g.to(DEVICE)]], "4bit", hp=hp, words=True)


@pytest.mark.parametrize("pdt", ["fp32", "bf16"])
def test_4bit_half_blocks_and_small_tensors(pdt):
    """Sizes in 128-element blocks that do not fill the kernel's 256-element rows (128, 384, 3 x 128), tensors smaller
    than a block, and a tail inside a row's second block, all in one launch (so the element-wise path)."""
    gen = torch.Generator().manual_seed(17)
    shapes = [(128,), (384,), (3, 128), (1,), (5,), (127,), (129,), (200,), (256 + 129,)]
    params = [_randn(s, DTYPES[pdt], gen) for s in shapes]
    grads = [[_randn(s, torch.float32, gen, scale=1 + k) for s in shapes] for k in range(3)]
    _run_both(params, grads, "4bit", words=False)


def test_4bit_many_small_tensors_one_launch():
    """More than a hundred tensors smaller than a block, of varied sizes, stepped in one launch."""
    gen = torch.Generator().manual_seed(18)
    sizes = torch.randint(1, 130, (120,), generator=gen).tolist()
    params = [_randn((n,), torch.bfloat16, gen) for n in sizes]
    grads = [[_randn((n,), torch.bfloat16, gen) for n in sizes] for _ in range(2)]
    _run_both(params, grads, "4bit")


def _guarded(t: torch.Tensor, fill) -> tuple[torch.Tensor, torch.Tensor]:
    """A copy of ``t`` at the start of a larger buffer whose 64 extra elements hold ``fill``: (view, buffer)."""
    buf = torch.full((t.numel() + 64,), fill, dtype=t.dtype, device=DEVICE)
    view = buf[: t.numel()].view(t.shape)
    view.copy_(t)
    return view, buf


@pytest.mark.parametrize("pdt", ["fp32", "bf16"])
@pytest.mark.parametrize("even", [True, False], ids=["whole_blocks", "partial_blocks"])
def test_4bit_writes_stay_inside_the_tensors(pdt, even):
    """Parameters and every 4-bit state tensor end where a guard region starts: the kernel's stores (codes, block
    scales of partial rows and of rows whose second block is past the end, parameters) leave the guards as they
    were, and the steps match the reference."""
    gen = torch.Generator().manual_seed(19)
    shapes = [(256,), (512,), (3, 256)] if even else [(1,), (128,), (129,), (384,), (300,), (512,)]
    params, states, guards = [], [], []
    for shape in shapes:
        p, pbuf = _guarded(_randn(shape, DTYPES[pdt], gen), float("nan"))
        s = st.init_state(p, "4bit")
        gs = {"step": s["step"]}
        for key in ("exp_avg_mv", "exp_avg_scale", "exp_avg_sq_scale"):
            gs[key], buf = _guarded(s[key].to(DEVICE), 0xFF if key == "exp_avg_mv" else float("nan"))
            guards.append((buf, gs[key].numel()))
        params.append(p)
        states.append(gs)
        guards.append((pbuf, p.numel()))
    before = [buf[n:].clone() for buf, n in guards]
    init = [(p.clone(), {k: v.clone() for k, v in s.items()}) for p, s in zip(params, states)]
    grads = [[_randn(s, torch.float32, gen) for s in shapes] for _ in range(2)]
    for k in range(2):
        scalars = ref.StepScalars.make(step=k + 1, **HP)
        adamw_step_(
            params,
            grads[k],
            states,
            fmt="4bit",
            scalars=scalars,
            seed=1,
            tensor_indices=[*range(len(shapes))],
            step=k + 1,
        )
        for i, (rp, rs) in enumerate(init):
            ref.adamw_step_ref_(rp, grads[k][i], rs, fmt="4bit", scalars=scalars, seed=1, tensor_index=i, step=k + 1)
    for (buf, n), b in zip(guards, before):
        assert same_bits(buf[n:], b), f"a store went past the end of a tensor of {n} elements"
    for i, (rp, rs) in enumerate(init):
        assert same_bits(params[i], rp), f"param {i}: {mismatch(params[i], rp)}"
        for key in ("exp_avg_mv", "exp_avg_scale", "exp_avg_sq_scale"):
            assert same_bits(states[i][key], rs[key]), f"{key} of param {i}: {mismatch(states[i][key], rs[key])}"


@pytest.mark.parametrize("pdt", ["fp32", "bf16"])
@pytest.mark.parametrize("tile", [(2, 2), (4, 1)], ids=["2x2", "4x1"])
def test_4bit_taller_tiles(pdt, tile):
    """Tiles of several 256-element rows (4 and 8 blocks of 128 per program): block scales, partial last chunks and
    the row-wise parameter stores, on both load paths."""
    gen = torch.Generator().manual_seed(20)
    for shapes, words in (([(2048,), (768,), (3, 256)], True), ([(1000,), (128,), (385,)], False)):
        params = [_randn(s, DTYPES[pdt], gen) for s in shapes]
        grads = [[_randn(s, torch.float32, gen) for s in shapes] for _ in range(2)]
        _run_both(params, grads, "4bit", words=words, tile=tile)


@pytest.mark.parametrize("fmt", QUANTIZED)
@pytest.mark.parametrize("pdt", ["fp32", "bf16"])
def test_register_cap_keeps_the_bits(fmt, pdt):
    """A register cap (LaunchPlan(maxnreg=...), timed on a GPU) changes register allocation only:
    the capped kernel matches the reference bit for bit on both load paths (on a GPU, with spills at 64 for bf16)."""
    gen = torch.Generator().manual_seed(21)
    for shapes, words in (([(2048,), (768,), (3, 256)], True), ([(1000,), (128,), (385,)], False)):
        params = [_randn(s, DTYPES[pdt], gen) for s in shapes]
        grads = [[_randn(s, DTYPES[pdt], gen) for s in shapes] for _ in range(2)]
        _run_both(params, grads, fmt, words=words, maxnreg=64)


def test_register_caps_by_specialization():
    """maxnreg="auto" (the engine's plans) caps exactly the specializations of launch.MAX_REGISTERS, with the default
    tile; None leaves every one to the compiler; an int caps every one."""
    from apexw_hf.engines.triton.kernels import LaunchPlan
    from apexw_hf.engines.triton.kernels.launch import MAX_REGISTERS

    def cap(fmt, dtype, stochastic=True, even=True, per_tensor=False, grad_scale=False, **kw):
        p = torch.zeros(512, dtype=dtype, device=DEVICE)
        plan = LaunchPlan([p], [st.init_state(p, fmt)], fmt, [0], 0, dtype, **kw)
        return plan._cap((fmt, None, None, False, stochastic, per_tensor, True, even, plan.rows, grad_scale))

    assert MAX_REGISTERS == {
        ("4bit", torch.bfloat16, True, True, False): 72,
        ("4bit", torch.float32, False, True, False): 64,
        ("8bit", torch.bfloat16, True, True, False): 64,
        ("8bit", torch.bfloat16, True, True, True): 64,
    }
    assert cap("4bit", torch.bfloat16) == 72
    assert cap("4bit", torch.bfloat16, grad_scale=True) == 72  # the release clip's variant: the same spill (sm_90)
    assert cap("4bit", torch.bfloat16, stochastic=False) is None
    assert cap("4bit", torch.bfloat16, even=False) is None
    assert cap("4bit", torch.bfloat16, per_tensor=True) is None
    assert cap("4bit", torch.float32, stochastic=False) == 64
    assert cap("4bit", torch.float32) == 64  # the engine's flag for fp32 parameters: nothing to round
    assert cap("4bit", torch.float32, stochastic=False, even=False) is None
    assert cap("4bit", torch.float32, stochastic=False, per_tensor=True) is None
    assert cap("8bit", torch.float32, stochastic=False) is None
    assert cap("8bit", torch.bfloat16) == 64  # 63 registers and no spill with the non-finite check (sm_90)
    assert cap("8bit", torch.bfloat16, grad_scale=True) == 64
    assert cap("8bit", torch.bfloat16, per_tensor=True) == 64
    assert cap("8bit", torch.bfloat16, stochastic=False) is None
    assert cap("4bit", torch.float32, stochastic=False, rows=2, num_warps=2) is None  # another tile: not measured
    assert cap("4bit", torch.float32, stochastic=False, maxnreg=None) is None
    assert cap("8bit", torch.float32, maxnreg=64) == 64


def test_register_cap_is_checked():
    from apexw_hf.engines.triton.kernels import LaunchPlan

    p = torch.zeros(256, device=DEVICE)
    for bad in (8, 300, 64.0, "64"):
        with pytest.raises(ValueError, match="maxnreg must be .auto., None or an int in 24..255"):
            LaunchPlan([p], [st.init_state(p, "4bit")], "4bit", [0], 0, torch.float32, maxnreg=bad)


@pytest.mark.parametrize("scale", [0.3712345, 1.0, 0.0])
@pytest.mark.parametrize("fmt,pdt,gdt", [c for c in CASES if c[0] in ("fp32", "4bit")] + [("8bit", "bf16", "bf16")])
def test_grad_scale_is_the_in_place_multiply(fmt, pdt, gdt, scale):
    """adamw_step_(grad_scale=c): the gradients multiplied by c in the kernel's load give the bits of the update of
    the gradients multiplied in place first (gradient release's clip coefficient, fp32, rounded to the gradients'
    dtype): whole blocks and partial ones, subnormal products, a zero factor on non-finite gradients."""
    gen = torch.Generator().manual_seed(11)
    shapes = [(4097,), (256, 3), (5,)]
    params = [_randn(s, DTYPES[pdt], gen) for s in shapes]
    steps = []
    for k in range(3):
        grads = [_randn(s, DTYPES[gdt], gen, scale=(1e-39 if k == 1 else 3.0)) for s in shapes]
        if scale == 0.0 and k == 2:
            grads[2][1], grads[2][3] = float("inf"), float("nan")  # the later buckets of a non-finite norm
        steps.append(grads)
    _run_both(params, steps, fmt, grad_scale=scale)
