"""ApexW under FSDP2 (DTensor shards) and DDP, with the gloo backend on CPU, and distributed checkpoints."""

import os

import pytest
import torch
import torch.distributed as dist

from apexw_hf import ApexW
from apexw_hf import dtensor as dt
from apexw_hf import reference as ref

from . import workers as w

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch without distributed support")

FORMATS = ("fp32", "compact", "8bit", "4bit")


def _fsdp_train(rank, world, store, out, fmt):
    from torch.distributed.tensor import DTensor

    w.init(rank, world, store)
    model = w.sharded(world)
    opt = ApexW(model.parameters(), lr=3e-3, state_format=fmt)
    losses = w.train(model, opt, w.batches(60, rank, world))
    first = next(model.parameters())
    state = opt.state[first]
    placements_ok = all(
        isinstance(v, DTensor) and v.device_mesh == first.device_mesh
        for k, v in state.items()
        if k.startswith("exp_avg")
    )
    # each rank's tensors: codes or moments shaped like its shard, scales padded to the largest shard's block count;
    # their bytes exactly (the moments' bytes per element, per padded block a bf16 m and an fp32 v scale for 8bit,
    # two fp32 scales for 4bit, an fp32 step per tensor)
    block = {"8bit": ref.BLOCK, "4bit": ref.BLOCK4}.get(fmt)
    expected_bytes = 0
    for p in model.parameters():
        blocks = dt.max_local_blocks(p, block) if block else 0
        scale_bytes = {"8bit": 6, "4bit": 8}.get(fmt, 0) * blocks
        expected_bytes += {"fp32": 8, "compact": 4, "8bit": 2, "4bit": 1}[fmt] * p.to_local().numel() + scale_bytes + 4
        for k, v in opt.state[p].items():
            if k.endswith("_scale"):
                placements_ok &= tuple(v.to_local().shape) == (blocks,)
            elif k.startswith("exp_avg"):
                placements_ok &= tuple(v.to_local().shape) == tuple(p.to_local().shape)
    w.save_result(
        out,
        rank,
        {
            "losses": losses,
            "state_bytes": opt.state_bytes(),
            "placements_ok": placements_ok,
            "params": w.gathered_params(model),
            "expected_bytes": expected_bytes,
        },
    )
    w.finish()


@pytest.mark.parametrize("fmt", FORMATS)
def test_fsdp2_trains_on_local_shards(fmt):
    results = w.spawn(_fsdp_train, 2, fmt)
    for r in results:
        assert r["placements_ok"]
        assert r["losses"][-1] < 0.1 * r["losses"][0]
    n_params = sum(p.numel() for p in w.make_model().parameters())
    per_param = {"fp32": 8, "compact": 4, "8bit": 2, "4bit": 1}[fmt]
    # the ranks hold the moments between them (plus step counters and, for 8bit/4bit, block scales), each about half
    total = sum(r["state_bytes"] for r in results)
    assert per_param * n_params <= total <= per_param * n_params * 1.1 + 128
    assert all(r["state_bytes"] < 0.6 * total for r in results)
    assert all(r["state_bytes"] == r["expected_bytes"] for r in results)
    # every rank ends with the same full parameters
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)


def _fsdp_resume(rank, world, store, out, fmt, full):
    w.init(rank, world, store)
    w.save_result(out, rank, resume_once(rank, world, out, fmt, full))
    w.finish()


def resume_once(rank, world, out, fmt, full):
    """One unbroken run of 12 steps and one of 7 steps, a checkpoint (DCP, or a full state dict with ``full``) in
    ``out``, a new model and optimizer loaded from it, 5 more steps. Returns ``{"equal": whether the resumed
    parameters are the unbroken run's bit for bit, "where": None, or where the runs first part}``. Run on every rank of
    an initialised group; scripts/stress_fsdp_resume.py repeats it inside one pair of ranks."""

    data = w.batches(12, rank, world)
    model = w.sharded(world)
    opt = ApexW(model.parameters(), lr=3e-3, state_format=fmt, seed=5)
    unbroken_steps, first_steps, resumed_steps = [], [], []  # this rank's shards and state after each step
    w.train(model, opt, data, unbroken_steps)
    unbroken = w.gathered_params(model)

    model = w.sharded(world)
    opt = ApexW(model.parameters(), lr=3e-3, state_format=fmt, seed=5)
    w.train(model, opt, data[:7], first_steps)
    msd = {k: v.detach().clone() if not full else v for k, v in model.state_dict().items()}
    ckpt = os.path.join(out, "full.pt" if full else "ckpt")
    w.save_optimizer(model, opt, ckpt, full, rank)

    model2 = w.sharded(world)
    model2.load_state_dict(msd)
    opt2 = ApexW(model2.parameters(), lr=3e-3, state_format=fmt, seed=5)
    w.load_optimizer(model2, opt2, ckpt, full, rank)
    loaded = w.snapshot(model2, opt2)
    w.train(model2, opt2, data[7:], resumed_steps)
    resumed = w.gathered_params(model2)
    # where a resumed run parts from the unbroken one, if it does: the first 7 steps, the loaded state, or after
    where = w.first_difference(unbroken_steps, first_steps)
    for key in ("params", "state"):
        if where is None and not w.same_bits(unbroken_steps[6][key], loaded[key]):
            where = f"the loaded {key}: not those of the unbroken run after step 7"
    where = where or w.first_difference(unbroken_steps, resumed_steps, start=7)
    return {"equal": w.same_bits(unbroken, resumed), "where": where}


@pytest.mark.parametrize("full", [False, True], ids=["sharded", "full_state_dict"])
@pytest.mark.parametrize("fmt", ["compact", "8bit", "4bit"])
def test_fsdp2_checkpoint_resume_is_exact(fmt, full):
    results = w.spawn(_fsdp_resume, 2, fmt, full)
    assert all(r["equal"] for r in results), [(r["equal"], r["where"]) for r in results]
    assert all(r["where"] is None for r in results), [r["where"] for r in results]


def _ddp_train(rank, world, store, out, fmt):
    from torch.nn.parallel import DistributedDataParallel as DDP

    w.init(rank, world, store)
    model = DDP(w.make_model())
    opt = ApexW(model.parameters(), lr=3e-3, state_format=fmt)
    losses = w.train(model, opt, w.batches(20, rank, world))
    w.save_result(out, rank, {"losses": losses, "params": w.gathered_params(model)})
    w.finish()


@pytest.mark.parametrize("fmt", ["8bit", "4bit"])
def test_ddp_replicas_stay_identical(fmt):
    results = w.spawn(_ddp_train, 2, fmt)
    assert results[0]["losses"][-1] < 0.2 * results[0]["losses"][0]
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b), "stochastic rounding must draw the same bits on every replica"


def _save_sharded(rank, world, store, out, fmt, ckpt):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    w.init(rank, world, store)
    model = w.sharded(world)
    opt = ApexW(model.parameters(), lr=3e-3, state_format=fmt)
    w.train(model, opt, w.batches(5, rank, world))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    full = {k: v.full_tensor() for k, v in opt.state[next(model.parameters())].items() if k.startswith("exp_avg")}
    w.save_result(out, rank, full)
    w.finish()


def _load_sharded(rank, world, store, out, fmt, ckpt):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    w.init(rank, world, store)
    model = w.sharded(world)
    opt = ApexW(model.parameters(), lr=3e-3, state_format=fmt)
    msd, osd = get_state_dict(model, opt)
    target = {"model": msd, "optim": osd}
    try:
        dcp.load(target, checkpoint_id=ckpt)
        set_state_dict(model, opt, model_state_dict=target["model"], optim_state_dict=target["optim"])
    except (Exception, CheckpointException) as e:  # reported to the test, which checks the message
        w.save_result(out, rank, {"error": f"{type(e).__name__}: {e}"})
        w.finish(barrier=False)
    state = {
        k: v.full_tensor().clone() for k, v in opt.state[next(model.parameters())].items() if k.startswith("exp_avg")
    }
    losses = w.train(model, opt, w.batches(5, rank, world))
    w.save_result(out, rank, {"state": state, "losses": losses})
    w.finish()


@pytest.mark.parametrize("fmt", ["compact", "8bit", "4bit"])
def test_fsdp2_checkpoint_at_another_world_size(fmt, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    saved = w.spawn(_save_sharded, 2, fmt, ckpt)[0]
    loaded = w.spawn(_load_sharded, 1, fmt, ckpt)[0]
    if fmt == "compact":  # moments reshard like the parameter
        assert "error" not in loaded, loaded.get("error")
        for key, value in saved.items():
            assert torch.equal(loaded["state"][key], value)
    else:  # 8-bit and 4-bit blocks belong to local shards: a clear error, never silently wrong state
        assert "error" in loaded
        assert "exp_avg_scale" in loaded["error"] or "shards" in loaded["error"], loaded["error"]


def _fsdp_engines(rank, world, store, out, fmt):
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported (on the first Triton step)
    w.init(rank, world, store)
    result = {}
    for engine in ("torch", "triton"):
        model = w.sharded(world)
        opt = ApexW(model.parameters(), lr=3e-3, state_format=fmt, engine=engine)
        w.train(model, opt, w.batches(3, rank, world))
        result[engine] = w.gathered_params(model)
    w.save_result(out, rank, result)
    w.finish()


@pytest.mark.parametrize("fmt", ["8bit", "compact", "4bit"])
def test_fsdp2_triton_engine_matches_torch_path_on_shards(fmt):
    pytest.importorskip("triton")
    results = w.spawn(_fsdp_engines, 2, fmt)
    for r in results:
        for a, b in zip(r["torch"], r["triton"]):
            assert torch.equal(a, b)


def _fsdp_convert(rank, world, store, out, src, dst):
    w.init(rank, world, store)
    model = w.sharded(world)
    opt = ApexW(model.parameters(), lr=3e-3, state_format=src, seed=2)
    w.train(model, opt, w.batches(3, rank, world))
    sd = opt.state_dict()
    for group in sd["param_groups"]:
        group["state_format"] = dst
    converted = []
    for _ in range(2):
        other = ApexW(model.parameters(), lr=3e-3, state_format="compact")
        other.load_state_dict(sd)  # DTensor state of one format -> DTensor state of another, on the local shards
        converted.append(other)
    first = next(model.parameters())
    state = converted[0].state[first]
    same = all(
        torch.equal(dt.local(v), dt.local(converted[1].state[p][k]))
        for p in model.parameters()
        for k, v in converted[0].state[p].items()
        if isinstance(v, torch.Tensor)
    )
    codes = state["exp_avg_mv" if dst == "4bit" else "exp_avg"]
    scale = state.get("exp_avg_scale")
    losses = w.train(model, converted[0], w.batches(3, rank, world))
    w.save_result(
        out,
        rank,
        {
            "dtype": str(codes.dtype),
            "block_shards": state.get("block_shards"),
            "local_scales": None if scale is None else dt.local(scale).numel(),
            "expected_scales": dt.max_local_blocks(first, dt.scale_block(state)),
            "deterministic": same,
            "finite": all(x == x for x in losses),
        },
    )
    w.finish()


@pytest.mark.parametrize("src, dst", [("compact", "8bit"), ("compact", "4bit"), ("4bit", "8bit"), ("8bit", "4bit")])
def test_fsdp2_state_converts_between_formats_on_shards(src, dst):
    for r in w.spawn(_fsdp_convert, 2, src, dst):
        assert r["dtype"] == "torch.uint8" and r["block_shards"] == 2 and r["deterministic"] and r["finite"]
        assert r["local_scales"] == r["expected_scales"]
