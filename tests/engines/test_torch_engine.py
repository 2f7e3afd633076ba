"""The plain-PyTorch engine against ``reference.adamw_step_ref_`` applied per tensor: the same bits, every path.

The oracle steps a twin optimizer tensor by tensor with the reference (what ``ApexW`` did on the CPU before the
engine). Parameters and every state tensor are compared bit for bit; where NaN is expected, NaN positions must agree
and the sign and payload bits of NaN are not compared (IEEE leaves them to the hardware). Most tests shrink the
engine's chunk to 4096 elements, so that small shapes exercise every layout: tensors used in place, split across
chunks, packed several to a chunk, and packed with 8-bit (4-bit) block padding. The cases that the numba path is
checked on too live in ``cpu_cases.py``; this module runs them on the default path.
"""

import os
import tempfile

import pytest
import torch

from apexw_hf import ApexW, reference
from apexw_hf import dtensor as dt
from apexw_hf.engines import torch as torch_engine
from apexw_hf.engines import torch_passes

from ..distributed import workers
from ..optim.helpers import same_bits
from . import cpu_cases as cases
from .cpu_cases import DTYPES, FORMATS, OPTIONS, QUANTIZED, random_case, run, twins
from .helpers import assert_same


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(torch_engine, "CHUNK", 4096)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@OPTIONS
def test_matches_reference(small_chunks, fmt, dtype, options):
    cases.matches_reference(fmt, dtype, options)


@pytest.mark.parametrize("fmt", FORMATS)
def test_default_chunk_size(fmt):
    cases.default_chunk_size(fmt)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference_with_cuda_semantics(small_chunks, monkeypatch, fmt, dtype):
    cases.matches_reference_with_cuda_semantics(monkeypatch, fmt, dtype)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_special_values(small_chunks, fmt, dtype):
    cases.special_values(fmt, dtype)


@pytest.mark.parametrize("fmt", FORMATS)
def test_groups_missing_grads_and_unequal_steps(small_chunks, fmt):
    cases.groups_missing_grads_and_unequal_steps(fmt)


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_mixed_param_and_grad_dtypes(small_chunks, fmt):
    cases.mixed_param_and_grad_dtypes(fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_non_contiguous_param_and_grad(small_chunks, fmt):
    cases.non_contiguous_param_and_grad(fmt)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resume_matches_unbroken_reference(small_chunks, fmt, dtype):
    cases.resume_matches_unbroken_reference(fmt, dtype)


@pytest.mark.parametrize("fmt", QUANTIZED)
def test_load_state_dict_replaces_the_cached_plan(small_chunks, fmt):
    cases.load_state_dict_replaces_the_cached_plan(fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_state_edits_between_steps_are_honored(small_chunks, fmt):
    cases.state_edits_between_steps_are_honored(fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_parameters_given_new_memory_between_steps_are_stepped(small_chunks, fmt):
    """The chunks keep views of the parameters' memory. A parameter object that keeps its identity and state but gets
    other memory (``p.data = ...``; ``swap_tensors``, which ``Module._apply`` uses for DTensor parameters; FSDP2
    re-padding a shard) must be stepped where its elements are now: a full chunk, a tail, a packed tensor."""
    values, grads = random_case([(4096 + 300,), (17, 33), (9,)], steps=3, seed=21)
    opt_a, pa, opt_b, pb = twins(values, torch.float32, state_format=fmt, lr=1e-2, seed=4)
    run(opt_a, pa, opt_b, pb, grads[:1])
    for p in pa:
        p.data = p.data.clone()  # same values, other memory
    run(opt_a, pa, opt_b, pb, grads[1:])
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_8bit_state_at_extreme_scales(small_chunks, dtype):
    cases.eight_bit_state_at_extreme_scales(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_4bit_state_at_extreme_scales(small_chunks, dtype):
    cases.four_bit_state_at_extreme_scales(dtype)


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
        values, grads = random_case([(301, 7), (5000,), (3, 5), (9000,)], steps=3, seed=14)
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
