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
PIECE = 1500  # bytes of state per launch: each rank's shard of the first layer goes through in several pieces
BUCKET = 100  # gradient elements per release launch


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


def _same_as_device_state(world, fmt, release, data):
    """FSDP2 with and without offload, 4 steps: the same parameters, state, state dicts, exports and dequantized
    state; where the offloaded state lives and what it reports."""
    from torch.distributed.tensor import DTensor

    from apexw_hf.accounting import optimizer_state_placement

    runs = []
    for offload in (False, True):
        model = w.sharded(world)
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
        and any(lo <= v.to_local().data_ptr() < hi for lo, hi in blocks)
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
            w.same_bits(oa.dequantized_state(p), ob.dequantized_state(q)) for p, q in zip(a.parameters(), b.parameters())
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
    }


def _resume(world, rank, out, fmt, release, full, data):
    """Offload checkpointed after 2 of 4 steps with torch.distributed.checkpoint (sharded) or a full state dict,
    loaded into a new model and optimizer with offload and into one without: both continue as the unbroken run."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    model = w.sharded(world)
    opt = _opt(model, fmt, True, release)
    _train(model, opt, data, release)
    unbroken = w.gathered_params(model)
    if release:
        opt._release.remove_hooks()

    model = w.sharded(world)
    opt = _opt(model, fmt, True, release)
    _train(model, opt, data[:2], release)
    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=full, cpu_offload=full))
    msd = {k: v.detach().clone() if not full else v for k, v in model.state_dict().items()}
    ckpt = os.path.join(out, f"ckpt_{fmt}_{release}_{full}")
    if full:
        if rank == 0:
            torch.save(osd, ckpt)
        dist.barrier()
    else:
        dcp.save({"optim": osd}, checkpoint_id=ckpt)
    if release:
        opt._release.remove_hooks()

    result = {}
    for offload in (True, False):
        model2 = w.sharded(world)
        model2.load_state_dict(msd)
        opt2 = _opt(model2, fmt, offload, release)
        if full:
            osd2 = torch.load(ckpt, weights_only=True) if rank == 0 else {}
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            set_optimizer_state_dict(model2, opt2, osd2, options=options)
        else:
            target = {"optim": get_optimizer_state_dict(model2, opt2)}
            dcp.load(target, checkpoint_id=ckpt)
            set_optimizer_state_dict(model2, opt2, target["optim"])
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


def _worker(rank, world, store, out):
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported (on the first Triton step)
    from apexw_hf.optim import offload as offload_mod

    offload_mod.PIECE_BYTES = PIECE
    w.init(rank, world, store)
    data = w.batches(4, rank, world)
    result = {"package": __import__("apexw_hf").__file__}
    for fmt in FORMATS:
        for release in (False, True):
            result[("same", fmt, release)] = _same_as_device_state(world, fmt, release, data)
    for fmt, release, full in (("8bit", False, False), ("4bit", True, False), ("4bit", False, True)):
        result[("resume", fmt, release, full)] = _resume(world, rank, out, fmt, release, full, data)
    w.save_result(out, rank, result)
    w.finish()


@pytest.fixture(scope="module")
def results():
    return w.spawn(_worker, 2)  # one spawn for every test of this file: starting the ranks costs seconds


def test_ranks_import_this_checkout(results):
    import apexw_hf

    assert all(r["package"] == apexw_hf.__file__ for r in results)


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
