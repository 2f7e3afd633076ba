"""Non-finite gradients on the Triton kernel (CUDA on a GPU, the interpreter on the CPU): the blocks that the reference
leaves un-updated, bit for bit, on every load and store path of the kernel (whole aligned rows moved as words, masked
rows, fp32 parameters stored in runs, tiles of several rows), the counters it writes, and the same through the
engine: ``step()``, gradient release with and without clipping, and state offload, against the PyTorch engine."""

import pytest
import torch

from apexw_hf import formats as st
from apexw_hf import reference as ref
from apexw_hf.engines.triton.kernels import adamw_step_
from apexw_hf.optim import ApexW

from ..optim.release_model import groups, loss_of, make
from .helpers import DEVICE, DTYPES, mismatch, same_bits

HP = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
FORMATS = ("fp32", "compact", "8bit", "4bit")
EVEN = [(512,), (3, 256), (256,)]  # whole rows (the word path where aligned)
ODD = [(1000,), (33, 65), (5,), (300,)]
FIRST = 3  # the tensor index of the first tensor of a launch


def _grads(shapes, step, dtype, gen):
    grads = [torch.randn(s, generator=gen) for s in shapes]
    if step == 2:
        grads[0].view(-1)[300] = float("nan")  # row 1
        grads[1].view(-1)[-1] = float("inf")  # the last row (a partial one where the size is not a multiple of 256)
        grads[2].view(-1)[:] = float("-inf")  # the whole tensor
    if step == 3:
        grads[0].view(-1)[0] = float("inf")
        # finite, but its square overflows fp32: v would be infinite (in fp16, already infinite itself)
        grads[1].view(-1)[0] = 3e19
    return [g.to(dtype).to(DEVICE) for g in grads]


def _run(shapes, fmt, pdt, gdt, tile=(None, None), steps=4, grad_scale=None):
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(s, generator=gen).to(pdt).to(DEVICE) for s in shapes]
    kp, rp = [v.clone() for v in values], [v.clone() for v in values]
    ks = [st.init_state(v, fmt) for v in values]
    rs = [{k: x.clone() for k, x in s.items()} for s in ks]
    counts = torch.zeros(2 + FIRST + len(shapes), dtype=torch.int32, device=DEVICE)
    expected = [0] * len(shapes)
    scale = None if grad_scale is None else torch.tensor([grad_scale], device=DEVICE)
    for step in range(1, steps + 1):
        grads = _grads(shapes, step, gdt, gen)
        scalars = ref.StepScalars.make(step=step, **HP)
        indices = [FIRST + i for i in range(len(shapes))]
        kw = dict(fmt=fmt, scalars=scalars, seed=1, tensor_indices=indices, step=step, rows=tile[0], num_warps=tile[1])
        adamw_step_(kp, grads, ks, **kw, grad_scale=scale, nonfinite=(counts, step))
        if scale is not None:
            grads = [g.clone() for g in grads]
            torch._foreach_mul_(grads, scale.reshape(()).to(grads[0].dtype))
        for i, (p, g, s) in enumerate(zip(rp, grads, rs)):
            expected[i] += ref.adamw_step_ref_(
                p, g, s, fmt=fmt, scalars=scalars, seed=1, tensor_index=FIRST + i, step=step
            )
    for i, (a, b, sa, sb) in enumerate(zip(kp, rp, ks, rs)):
        assert same_bits(a, b), f"param {i}: {mismatch(a, b)}"
        for key in sa:
            if key != "step":
                assert same_bits(sa[key], sb[key]), f"{key} of param {i}: {mismatch(sa[key], sb[key])}"
    return counts.tolist(), expected


CASES = [(fmt, p, g) for fmt in FORMATS for p in DTYPES for g in DTYPES if g in ("fp32", p)]


@pytest.mark.parametrize("shapes", [EVEN, ODD], ids=["even", "odd"])
@pytest.mark.parametrize("fmt,pdt,gdt", CASES)
def test_kernel_skips_the_reference_blocks(fmt, pdt, gdt, shapes):
    counts, expected = _run(shapes, fmt, DTYPES[pdt], DTYPES[gdt])
    assert counts[2 + FIRST :] == expected and counts[2 : 2 + FIRST] == [0] * FIRST
    assert counts[:2] == [3, 2]  # the last step that skipped (its serial) and the steps that skipped
    assert sum(expected) > 0


@pytest.mark.parametrize("fmt,tile", [("4bit", (2, 2)), ("8bit", (4, 4)), ("compact", (2, 1)), ("fp32", (4, 4))])
def test_kernel_tiles_of_several_rows(fmt, tile):
    """A row with a bad gradient among good rows of the same program (and 4-bit's two scale blocks per row)."""
    for shapes in (EVEN, ODD):
        counts, expected = _run(shapes, fmt, torch.bfloat16, torch.bfloat16, tile=tile)
        assert counts[2 + FIRST :] == expected


def test_nan_clip_coefficient_skips_everything():
    """Gradient release's clip coefficient is NaN after a non-finite norm: every block of the launch is skipped."""
    counts, expected = _run(ODD, "8bit", torch.bfloat16, torch.bfloat16, steps=2, grad_scale=float("nan"))
    assert expected == [ref.num_blocks(torch.Size(s).numel()) * 2 for s in ODD]
    assert counts[2 + FIRST :] == expected and counts[1] == 2


def test_one_count_per_step_over_launches():
    """Two launches of one step (two buckets, or two param groups) that both skip count the step once."""
    gen = torch.Generator().manual_seed(0)
    p = [torch.randn(300, generator=gen).to(DEVICE) for _ in range(2)]
    s = [st.init_state(x, "compact") for x in p]
    counts = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    bad = torch.full((300,), float("nan"), device=DEVICE)
    for step in (1, 2):
        scalars = ref.StepScalars.make(step=step, **HP)
        for i in range(2):
            kw = dict(fmt="compact", scalars=scalars, seed=0, tensor_indices=[i], step=step)
            adamw_step_([p[i]], [bad], [s[i]], **kw, nonfinite=(counts, 7 + step))
    assert counts.tolist() == [9, 2, 4, 4]


def test_engine_without_the_check_updates_and_counts_nothing():
    """``TritonEngine(check_nonfinite=False)`` (the step benchmark's ``_nocheck`` rows) launches the kernel without the
    check: a non-finite gradient reaches the parameter and nothing is counted; the default engine skips and counts."""
    from apexw_hf.engines import triton_engine

    results = {}
    for check in (True, False):
        p = torch.nn.Parameter(torch.ones(512, device=DEVICE))
        opt = ApexW([p], lr=1e-2, state_format="compact", engine="triton")
        triton_engine(opt).check_nonfinite = check
        p.grad = torch.ones_like(p)
        p.grad[3] = float("nan")
        with pytest.warns(RuntimeWarning) if check and DEVICE == "cpu" else _nothing():
            opt.step()
        results[check] = (torch.isfinite(p.detach()).all().item(), opt.nonfinite_skipped)
    assert results[True] == (True, 1)
    assert results[False] == (False, 0)


# ---- through the engine ----------------------------------------------------------------------------------------


def _poisoned_run(fmt, engine, mode, offload=False):
    """Four steps of the tiny model; step 1's loss is NaN, step 2 has one row of the embedding's gradient inf."""
    release, clip = mode != "step", (0.05 if mode == "release_clipped" else None)
    model = make().to(DEVICE)
    kw = dict(gradient_release=True, release_bucket_size=300, max_grad_norm=clip) if release else {}
    opt = ApexW(groups(model), lr=2e-2, state_format=fmt, engine=engine, state_offload=offload, **kw)
    handle = None
    for step in range(4):
        loss = loss_of(model, step)
        if step == 1:
            loss = loss * float("nan")
        if step == 2:
            row = torch.tensor([3], device=DEVICE)
            handle = model.emb.weight.register_hook(lambda g, row=row: g.clone().index_fill_(0, row, float("inf")))
        loss.backward()
        if handle is not None:
            handle.remove()
            handle = None
        with pytest.warns(RuntimeWarning) if step in (1, 2) and DEVICE == "cpu" else _nothing():
            opt.step()
        opt.zero_grad()
    return model, opt


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mode", ["step", "release", "release_clipped"])
def test_engine_matches_the_torch_engine(fmt, mode, monkeypatch):
    from apexw_hf.optim import release

    # On a GPU the Triton engine's bucket norm (a tree of partial sums in a kernel) equals the per-tensor norms of the
    # PyTorch engine only up to rounding, so the clip coefficients would differ in the last bit: both take the
    # per-tensor norms here (what runs on the CPU anyway). The kernel's NaN coefficient is tested above.
    monkeypatch.setattr(release, "_sumsq_impl", lambda device: None)
    monkeypatch.setattr(release, "_norm_impl", lambda device: release.release_norm_torch)
    a, oa = _poisoned_run(fmt, "triton", mode)
    b, ob = _poisoned_run(fmt, "torch", mode)
    for p, q in zip(a.parameters(), b.parameters()):
        assert same_bits(p.detach(), q.detach()), mismatch(p.detach(), q.detach())
        assert torch.isfinite(p).all()
        for key, value in oa.state[p].items():
            if key != "step":
                assert same_bits(value, ob.state[q][key]), key
    assert oa.nonfinite_skipped == ob.nonfinite_skipped == 2
    ca, cb = oa._nonfinite._read(), ob._nonfinite._read()
    assert [c[1:] for c in ca.values()] == [c[1:] for c in cb.values()]


@pytest.mark.parametrize("fmt", ["compact", "8bit", "4bit"])
@pytest.mark.parametrize("mode", ["step", "release_clipped"])
def test_state_offload_same_bits(fmt, mode, monkeypatch):
    from apexw_hf.optim import offload as offload_mod

    monkeypatch.setattr(offload_mod, "PIECE_BYTES", 1500)  # several launches per tensor
    a, oa = _poisoned_run(fmt, "triton", mode)
    b, ob = _poisoned_run(fmt, "triton", mode, offload=True)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
        for key, value in oa.state[p].items():
            assert torch.equal(value.cpu(), ob.state[q][key].cpu()), key
    assert ob.nonfinite_skipped == 2
