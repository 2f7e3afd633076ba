"""State offload under FSDP2: each rank keeps its shards' state in host memory and streams it through the Triton
kernels (here under the interpreter, on CPU tensors), with the same bits and the same state dicts as FSDP2 without
offload. Two gloo ranks on CPU, the machinery of test_fsdp_ddp.py (``workers``): one spawn runs every case."""

import os

import pytest
import torch
import torch.distributed as dist

from apexw_hf import ApexW

from . import workers as w

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch without distributed support")

FORMATS = ("8bit", "4bit", "compact")
PIECE = 1200  # bytes of state per launch: each rank's first-layer shard goes through in pieces of one work item
BUCKET = 100  # gradient elements per release launch
STEPS = 3


def _sharded(world, outs=5):
    """A smaller model than ``workers.make_model``'s (the kernels run under the interpreter here), sharded as
    ``workers.sharded`` shards it: the first layer's 960 elements are 480 per rank (two work items, so its state goes
    through in two pieces), the output layer's ``outs`` rows 3 + 2 (uneven shards) or, for 1, 1 + 0 (rank 1's shards
    of the output layer's weight and bias are empty)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, outs))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _opt(model, fmt, offload, release):
    kw = dict(gradient_release=True, release_bucket_size=BUCKET, max_grad_norm=0.05) if release else {}
    return ApexW(model.parameters(), lr=3e-3, state_format=fmt, seed=4, engine="triton", state_offload=offload, **kw)


def _train(model, opt, data, release):
    for x, y in data:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if not release:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad()


def _state_dict_bits(sd) -> dict:
    """A state dict's tensors as this rank holds them: DTensors by their local tensor, placements and global shape."""
    out = {}
    for i, entry in sd["state"].items():
        for k, v in entry.items():
            if isinstance(v, torch.Tensor) and hasattr(v, "to_local"):
                out[(i, k)] = (v.to_local().clone(), tuple(v.placements), tuple(v.shape))
            else:
                out[(i, k)] = v.clone() if isinstance(v, torch.Tensor) else v
    return out


def _same_as_device_state(world, fmt, release, data, outs=5):
    """FSDP2 with and without offload, 3 steps: the same parameters, state, state dicts, exports and dequantized
    state; where the offloaded state lives and what it reports. ``outs``: see :func:`_sharded`."""
    from torch.distributed.tensor import DTensor

    from apexw_hf.accounting import optimizer_state_placement

    runs = []
    data = [(x, y[:, :outs]) for x, y in data]
    for offload in (False, True):
        model = _sharded(world, outs)
        opt = _opt(model, fmt, offload, release)
        _train(model, opt, data, release)
        runs.append((model, opt))
    (a, oa), (b, ob) = runs
    off = ob._offload
    sa, sb = _state_dict_bits(oa.state_dict()), _state_dict_bits(ob.state_dict())
    ea, eb = _state_dict_bits(oa.to_torch_adamw_state_dict()), _state_dict_bits(ob.to_torch_adamw_state_dict())
    blocks = [(blk.data_ptr(), blk.data_ptr() + blk.numel()) for blk in off._blocks]
    in_blocks = all(
        isinstance(v, DTensor)
        and v.device_mesh == p.device_mesh
        and v.to_local().device.type == "cpu"
        and (v.to_local().numel() == 0 or any(lo <= v.to_local().data_ptr() < hi for lo, hi in blocks))
        for p in b.parameters()
        for k, v in ob.state[p].items()
        if k.startswith("exp_avg")
    )
    placement = optimizer_state_placement(ob)
    return {
        "params": w.same_bits(w.gathered_params(a), w.gathered_params(b)),
        "state": w.same_bits(w.snapshot(a, oa)["state"], w.snapshot(b, ob)["state"]),
        "state_dict": w.same_bits(sa, sb),
        "export": w.same_bits(ea, eb),
        "dequantized": all(
            w.same_bits(oa.dequantized_state(p), ob.dequantized_state(q))
            for p, q in zip(a.parameters(), b.parameters())
        ),
        "in_blocks": in_blocks,
        "launches": len(off._order),
        "split": len({id(p) for piece, _ in off._order for p in piece.params})
        < sum(len(piece.params) for piece, _ in off._order),
        "hits": off.hits,
        "host": placement["host"],
        "device": placement["device"],
        "staging": ob.staging_bytes(),
        "bytes": ob.state_bytes(),
        "bytes_device_run": oa.state_bytes(),
        "empty_shards": sum(q.to_local().numel() == 0 for q in b.parameters()),
    }


def _resume(world, rank, out, fmt, release, full, data):
    """Offload checkpointed after 2 of 3 steps with torch.distributed.checkpoint (sharded) or a full state dict,
    loaded into a new model and optimizer with offload and into one without: both continue as the unbroken run."""

    model = _sharded(world)
    opt = _opt(model, fmt, True, release)
    _train(model, opt, data, release)
    unbroken = w.gathered_params(model)
    if release:
        opt._release.remove_hooks()

    model = _sharded(world)
    opt = _opt(model, fmt, True, release)
    _train(model, opt, data[:2], release)
    msd = {k: v.detach().clone() if not full else v for k, v in model.state_dict().items()}
    ckpt = os.path.join(out, f"ckpt_{fmt}_{release}_{full}")
    w.save_optimizer(model, opt, ckpt, full, rank)
    if release:
        opt._release.remove_hooks()

    result = {}
    for offload in (True, False):
        model2 = _sharded(world)
        model2.load_state_dict(msd)
        opt2 = _opt(model2, fmt, offload, release)
        w.load_optimizer(model2, opt2, ckpt, full, rank)
        on_host = all(
            dt_local.device.type == "cpu"
            for e in opt2.state.values()
            for v in e.values()
            if isinstance(v, torch.Tensor)
            for dt_local in [v.to_local() if hasattr(v, "to_local") else v]
        )
        _train(model2, opt2, data[2:], release)
        result[offload] = {"equal": w.same_bits(unbroken, w.gathered_params(model2)), "on_host": on_host}
        if release:
            opt2._release.remove_hooks()
    return result


def _swapped(world, data):
    """An optimizer with offload built over the plain parameters, which are then sharded and replaced in its param
    groups (what Accelerate's ``prepare(model, optimizer)`` does under FSDP2): the same bits as FSDP2 without offload
    built over the shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 5))
    opt = _opt(model, "4bit", True, False)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt.param_groups[0]["params"] = list(model.parameters())
    _train(model, opt, data, False)
    ref_model = _sharded(world)
    ref_opt = _opt(ref_model, "4bit", False, False)
    _train(ref_model, ref_opt, data, False)
    return {
        "params": w.same_bits(w.gathered_params(model), w.gathered_params(ref_model)),
        "state_dict": w.same_bits(_state_dict_bits(opt.state_dict()), _state_dict_bits(ref_opt.state_dict())),
    }


def _converted(world, data):
    """A compact state dict loaded as 8-bit state into optimizers with and without offload: the same DTensor state
    (converted on the host with offload, where it stays), and the same step after it."""
    model = _sharded(world)
    opt = _opt(model, "compact", False, False)
    _train(model, opt, data[:2], False)
    sd = opt.state_dict()
    for group in sd["param_groups"]:
        group["state_format"] = "8bit"
    msd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    runs = []
    for offload in (False, True):
        m = _sharded(world)
        m.load_state_dict(msd)
        o = _opt(m, "8bit", offload, False)
        o.load_state_dict(sd)
        loaded = _state_dict_bits(o.state_dict())
        _train(m, o, data[2:], False)
        runs.append((loaded, w.gathered_params(m), o))
    placed = {where[3] for where in runs[1][2]._offload._where.values()}  # the host tensors taken from its blocks
    on_host = all(
        v.to_local().device.type == "cpu" and v.to_local().data_ptr() in placed
        for e in runs[1][2].state.values()
        for k, v in e.items()
        if k.startswith("exp_avg")
    )
    return {
        "loaded": w.same_bits(runs[0][0], runs[1][0]),
        "params": w.same_bits(runs[0][1], runs[1][1]),
        "on_host": on_host,
    }


def _host_check(world):
    """The host-memory check counts the ranks on this host (``LOCAL_WORLD_SIZE``), each needing its shards' state:
    refused, naming the bytes, where this rank's state fits and the two ranks' do not."""
    from apexw_hf.optim import offload as offload_mod

    model = _sharded(world)
    need = ApexW(model.parameters(), state_format="8bit", engine="triton", state_offload=True)._check_offload()
    found = offload_mod.host_bytes_available
    offload_mod.host_bytes_available = lambda: need * 3 // 2
    out = {}
    try:
        for ranks in ("1", "2"):
            os.environ["LOCAL_WORLD_SIZE"] = ranks
            try:
                ApexW(model.parameters(), state_format="8bit", engine="triton", state_offload=True)
                out[ranks] = None
            except ValueError as e:
                out[ranks] = str(e)
    finally:
        offload_mod.host_bytes_available = found
        os.environ.pop("LOCAL_WORLD_SIZE")
    out["need"] = need
    return out


def _worker(rank, world, store, out):
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported (on the first Triton step)
    from apexw_hf import dtensor as dt
    from apexw_hf.optim import offload as offload_mod

    offload_mod.PIECE_BYTES = PIECE
    # On a GPU the offloaded state is host tensors under a CUDA mesh, which dtensor._from_local wraps without
    # DTensor.from_local (that would copy them to the GPU); here host and mesh are both the CPU, so every state tensor
    # takes that path on purpose, and the DTensors the GPU would see go through the checkpoints below.
    wrap, over, direct = dt._from_local, dt._over, []

    def from_local(local, *args):
        if local.is_meta:
            return wrap(local, *args)
        direct.append(local.numel())
        return over(local, *args)

    dt._from_local = from_local
    w.init(rank, world, store)
    data = w.batches(STEPS, rank, world)
    result = {"package": __import__("apexw_hf").__file__, "host_check": _host_check(world)}
    for fmt in FORMATS:
        for release in (False, True):
            result[("same", fmt, release)] = _same_as_device_state(world, fmt, release, data)
    for fmt, release in (("8bit", False), ("4bit", True), ("compact", True)):
        result[("empty", fmt, release)] = _same_as_device_state(world, fmt, release, data, outs=1)
    for fmt, release, full in (("8bit", False, False), ("4bit", True, False), ("4bit", False, True)):
        result[("resume", fmt, release, full)] = _resume(world, rank, out, fmt, release, full, data)
    result["swapped"] = _swapped(world, data)
    result["converted"] = _converted(world, data)
    result["direct"] = len(direct)
    w.save_result(out, rank, result)
    w.finish()


@pytest.fixture(scope="module")
def results():
    return w.spawn(_worker, 2)  # one spawn for every test of this file: starting the ranks costs seconds


def test_ranks_import_this_checkout(results):
    import apexw_hf

    assert all(r["package"] == apexw_hf.__file__ for r in results)
    assert all(r["direct"] > 0 for r in results)  # the state was wrapped as on a GPU (see _worker)


@pytest.mark.parametrize("release", [False, True], ids=["step", "release"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_fsdp2_offload_gives_the_bits_of_fsdp2_on_the_device(results, fmt, release):
    """Parameters, state, state dicts (DTensors over the shards, the same placements and shapes), the export to torch
    AdamW and the dequantized state: bit for bit those without offload, on every rank, with several pieces per
    launch and prefetched pieces; the state is DTensors over host memory, reported as host bytes."""
    for r in results:
        res = r[("same", fmt, release)]
        bad = [k for k in ("params", "state", "state_dict", "export", "dequantized", "in_blocks") if not res[k]]
        assert not bad, bad
        assert res["split"] and res["hits"] > 0 and res["launches"] > 3
        assert res["host"] == res["bytes"] == res["bytes_device_run"]
        assert res["device"] == res["staging"] > 0


@pytest.mark.parametrize(("fmt", "release"), [("8bit", False), ("4bit", True), ("compact", True)])
def test_fsdp2_offload_with_empty_local_shards(results, fmt, release):
    """An output layer of one row: rank 1's shards of its weight and bias are empty. That rank streams the state of
    its other shards and keeps empty state for those; every rank's bits are those of FSDP2 without offload."""
    assert [r[("empty", fmt, release)]["empty_shards"] for r in results] == [0, 2]
    for r in results:
        res = r[("empty", fmt, release)]
        bad = [k for k in ("params", "state", "state_dict", "export", "dequantized", "in_blocks") if not res[k]]
        assert not bad, bad
        assert res["host"] == res["bytes"] == res["bytes_device_run"]


@pytest.mark.parametrize(
    "fmt, release, full",
    [("8bit", False, False), ("4bit", True, False), ("4bit", False, True)],
    ids=["8bit_step_sharded", "4bit_release_sharded", "4bit_step_full_state_dict"],
)
def test_fsdp2_offload_resume_in_the_middle_is_exact(results, fmt, release, full):
    """A checkpoint of offloaded state resumes bit-exactly, into an optimizer with offload (its state in host memory
    again) and into one without."""
    for r in results:
        res = r[("resume", fmt, release, full)]
        assert res[True]["equal"] and res[True]["on_host"]
        assert res[False]["equal"]


def test_the_host_memory_check_counts_the_ranks_on_the_host(results):
    for r in results:
        res = r["host_check"]
        assert res["1"] is None
        total = 2 * res["need"]
        assert f"({total} bytes) of host memory" in res["2"] and "2 ranks on this host" in res["2"], res["2"]


def test_fsdp2_offload_with_parameters_sharded_after_the_optimizer_was_built(results):
    for r in results:
        assert r["swapped"] == {"params": True, "state_dict": True}


def test_fsdp2_offload_loads_state_of_another_format(results):
    for r in results:
        assert r["converted"] == {"loaded": True, "params": True, "on_host": True}
