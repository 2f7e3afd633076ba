"""Gradient release under FSDP2 (hooks on the local shards, after the reduce-scatter) and its refusal under DDP.

Two gloo ranks on CPU, the machinery of test_fsdp_ddp.py (``workers``): one spawn runs every case, the tests read its
results.
"""

import os

import pytest
import torch
import torch.distributed as dist

from apexw_hf import ApexW

from . import workers as w

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch without distributed support")

FORMATS = ("8bit", "4bit")  # block scales on local shards; every format is compared in tests/optim (one process)
# the second: one bucket per backward; the third: the output layer's weight (5 x 300, split 3 + 2 rows over two ranks)
# holds 900 and 600 local elements, and fills a bucket on every rank only because buckets count each tensor's global
# size over its shard count (750), the same on all ranks: counted locally, rank 0 would flush it alone, and the
# ranks' per-bucket all-reduces of the norm would pair different buckets
BUCKETS = (100, 10**9, 700)
BUCKET = 100  # gradient elements per launch: the larger tensors of each FSDP group go in buckets of their own


def _global_norm(grads):
    """The L2 norm of sharded gradients, each rank's squares summed in fp64 and all-reduced over the mesh."""
    sq = sum(g.to_local().double().square().sum() for g in grads)
    dist.all_reduce(sq)
    return float(sq.sqrt())


def _same(a: dict, b: dict) -> bool:
    """Two parameters' optimizer states hold the same keys and the same bits (local shards of DTensors)."""
    if sorted(a) != sorted(b):
        return False
    for key, x in a.items():
        y = b[key]
        if isinstance(x, torch.Tensor):
            x, y = (x.to_local(), y.to_local()) if hasattr(x, "to_local") else (x, y)
            if not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return True


def _loss(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def _release_vs_step(world, fmt, data):
    plain, released = w.sharded(world), w.sharded(world)
    opt_a = ApexW(plain.parameters(), lr=3e-3, state_format=fmt, seed=3)
    opt_b = ApexW(
        released.parameters(), lr=3e-3, state_format=fmt, seed=3, gradient_release=True, release_bucket_size=BUCKET
    )
    grads_freed, norms_a, norms_b = True, [], []
    for x, y in data:
        _loss(plain, x, y).backward()
        norms_a.append(_global_norm([p.grad for p in plain.parameters()]))
        opt_a.step()
        opt_a.zero_grad()
        _loss(released, x, y).backward()
        grads_freed &= all(p.grad is None for p in released.parameters())
        norms_b.append(float(opt_b.grad_norm))
        opt_b.step()
        opt_b.zero_grad()
    return {
        "params_equal": all(torch.equal(a, b) for a, b in zip(w.gathered_params(plain), w.gathered_params(released))),
        "state_equal": all(
            _same(opt_a.state[pa], opt_b.state[pb]) for pa, pb in zip(plain.parameters(), released.parameters())
        ),
        "grads_freed": grads_freed,
        "flushes": opt_b._release.flushes,
        "norms_a": norms_a,
        "norms_b": norms_b,
    }


def _clipped_norms(world, bucket, data):
    model, probe = w.sharded(world), w.sharded(world)
    opt = ApexW(
        model.parameters(),
        lr=3e-3,
        state_format="8bit",
        gradient_release=True,
        max_grad_norm=0.05,
        release_bucket_size=bucket,
    )
    true_norms, logged, local_shards_differ, grads_freed = [], [], False, True
    for x, y in data:
        # the true pre-clip gradients of this step: the same parameters on a second model, ordinary backward
        with torch.no_grad():
            for p, q in zip(model.parameters(), probe.parameters()):
                q.to_local().copy_(p.to_local())
        _loss(probe, x, y).backward()
        true_norms.append(_global_norm([q.grad for q in probe.parameters()]))
        local_shards_differ |= any(
            not torch.equal(q.grad.to_local().square().sum(), q.grad.full_tensor().square().sum())
            for q in probe.parameters()
        )
        probe.zero_grad(set_to_none=True)
        _loss(model, x, y).backward()
        grads_freed &= all(p.grad is None for p in model.parameters())
        opt.step()
        opt.zero_grad()
        logged.append(float(opt.grad_norm))
    uneven = any(p.to_local().numel() * world != p.numel() for p in model.parameters())
    return {
        "true": true_norms,
        "logged": logged,
        "sharded": local_shards_differ,
        "grads_freed": grads_freed,
        "flushes": opt._release.flushes,
        "uneven": uneven,
    }


def _clipping_opt(model):
    return ApexW(
        model.parameters(),
        lr=3e-3,
        state_format="8bit",
        gradient_release=True,
        max_grad_norm=0.05,
        release_bucket_size=BUCKET,
    )


def _train_released(model, opt, data):
    for x, y in data:
        _loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()


def _resume_with_clipping(world, rank, out, data, full):
    """Checkpoint with torch.distributed.checkpoint's optimizer state dict (what Accelerate saves for FSDP2), resume,
    continue: equal to the unbroken run, the clipping of the first resumed step included."""

    model = w.sharded(world)
    _train_released(model, _clipping_opt(model), data)
    unbroken = w.gathered_params(model)

    model = w.sharded(world)
    opt = _clipping_opt(model)
    _train_released(model, opt, data[:2])
    msd = {k: v.detach().clone() if not full else v for k, v in model.state_dict().items()}
    ckpt = os.path.join(out, f"ckpt_{full}")
    w.save_optimizer(model, opt, ckpt, full, rank)
    opt._release.remove_hooks()

    model2 = w.sharded(world)
    model2.load_state_dict(msd)
    opt2 = _clipping_opt(model2)
    w.load_optimizer(model2, opt2, ckpt, full, rank)
    restored = opt2._release.state() == opt._release.state() and opt._release.grad_norm is not None
    _train_released(model2, opt2, data[2:])
    resumed = w.gathered_params(model2)
    return {"equal": all(torch.equal(a, b) for a, b in zip(unbroken, resumed)), "norm_restored": restored}


def _poisoned(world, fmt, data, release):
    """A NaN loss at the second of four steps, ordinary steps (clipped by clip_grad_norm_) or release with clipping:
    that step leaves every rank's shards and state as they were, each rank counts it, and the run goes on finite."""
    model = w.sharded(world)
    kw = dict(gradient_release=True, max_grad_norm=0.05, release_bucket_size=BUCKET) if release else {}
    opt = ApexW(model.parameters(), lr=3e-3, state_format=fmt, **kw)
    unchanged = moved_after = None
    for i, (x, y) in enumerate(data):
        loss = _loss(model, x, y)
        before = w.snapshot(model, opt)
        if i == 1:
            loss = loss * float("nan")
        loss.backward()
        if not release:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
        after = w.snapshot(model, opt)
        same = all(torch.equal(a, b) for a, b in zip(before["params"], after["params"]))
        same &= all(
            all(torch.equal(x, t[k]) for k, x in s.items() if k != "step" and isinstance(x, torch.Tensor))
            for s, t in zip(before["state"], after["state"])
        )
        if i == 1:
            unchanged = same
        if i == 2:
            moved_after = not same
    final = w.snapshot(model, opt)
    finite = all(torch.isfinite(p).all() for p in final["params"]) and all(
        torch.isfinite(v.float()).all() for s in final["state"] for v in s.values() if isinstance(v, torch.Tensor)
    )
    return {"unchanged": unchanged, "moved_after": moved_after, "finite": finite, "skipped": opt.nonfinite_skipped}


def _fsdp_release(rank, world, store, out):
    w.init(rank, world, store)
    data = w.batches(4, rank, world)
    result = {fmt: _release_vs_step(world, fmt, data) for fmt in FORMATS}
    for bucket in BUCKETS:
        result[f"clip_{bucket}"] = _clipped_norms(world, bucket, data)
    for full in (False, True):
        result[f"resume_{full}"] = _resume_with_clipping(world, rank, out, data, full)
    for release in (False, True):
        result[f"poisoned_{release}"] = _poisoned(world, "8bit", data, release)
    result["ddp"] = _ddp_release(world, rank)  # last: the refused backward leaves DDP's reducer mid-step
    w.save_result(out, rank, result)
    w.finish()


@pytest.fixture(scope="module")
def fsdp_results():
    return w.spawn(_fsdp_release, 2)  # one spawn for every test of this file: starting the ranks costs seconds


@pytest.mark.parametrize("fmt", FORMATS)
def test_fsdp2_release_is_bit_identical_to_step(fsdp_results, fmt):
    """The same parameters and state as ordinary steps, no gradient left after backward, several buckets per
    backward, and the recorded norm is the global one (the same on both ranks)."""
    for r in fsdp_results:
        res = r[fmt]
        assert res["params_equal"] and res["state_equal"]
        assert res["grads_freed"]
        assert res["flushes"] >= 4 * 3, res["flushes"]  # several buckets in each of the 4 steps
        assert res["norms_b"] == pytest.approx(res["norms_a"], rel=1e-6)
    assert fsdp_results[0][fmt]["norms_b"] == fsdp_results[1][fmt]["norms_b"]


@pytest.mark.parametrize("bucket", BUCKETS, ids=["buckets", "one_bucket", "uneven_shards"])
def test_fsdp2_release_with_clipping_records_the_global_norm(fsdp_results, bucket):
    """max_grad_norm under FSDP2: ``grad_norm`` is the pre-clip norm of all shards (all-reduced), equal on the ranks,
    with every bucket clipped (0.05 is below every step's norm); the ranks flush the same buckets, also where their
    shards differ in size."""
    for r in fsdp_results:
        res = r[f"clip_{bucket}"]
        assert res["sharded"], "the local shards' norms equal the full ones: the test would not see a missing reduce"
        assert res["uneven"], "every shard is an equal part: the test would not see buckets split differently"
        assert res["grads_freed"]
        assert min(res["true"]) > 0.05
        assert res["logged"] == pytest.approx(res["true"], rel=1e-5)
    first, second = (r[f"clip_{bucket}"] for r in fsdp_results)
    assert first["logged"] == second["logged"] and first["flushes"] == second["flushes"]


@pytest.mark.parametrize("full", [False, True], ids=["sharded", "full_state_dict"])
def test_fsdp2_release_resume_with_clipping_is_exact(fsdp_results, full):
    for r in fsdp_results:
        res = r[f"resume_{full}"]
        assert res["norm_restored"], "the clipping state (previous norm, partial sums) was lost in the checkpoint"
        assert res["equal"]


@pytest.mark.parametrize("release", [False, True], ids=["step", "release"])
def test_fsdp2_poisoned_batch_is_skipped_on_every_rank(fsdp_results, release):
    """The non-finite count is per rank (documented): a NaN loss reaches every rank's gradients, so each counts 1."""
    for r in fsdp_results:
        res = r[f"poisoned_{release}"]
        assert res["unchanged"] and res["moved_after"] and res["finite"]
        assert res["skipped"] == 1


def _ddp_release(world, rank):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(w.make_model())
    before = [p.detach().clone() for p in model.parameters()]
    opt = ApexW(model.parameters(), lr=3e-3, state_format="8bit", gradient_release=True)
    x, y = w.batches(1, rank, world)[0]
    error = None
    try:
        _loss(model, x, y).backward()
    except RuntimeError as e:
        error = str(e)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return {"error": error, "unchanged": unchanged, "state": len(opt.state)}


def test_ddp_with_release_is_refused_before_any_update(fsdp_results):
    for r in (r["ddp"] for r in fsdp_results):
        assert r["error"] is not None and "DDP" in r["error"] and "FSDP2" in r["error"], r["error"]
        assert r["unchanged"] and r["state"] == 0
