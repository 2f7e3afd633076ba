"""The ranks of tests/distributed (gloo, CPU): :func:`spawn` starts them, the rest runs inside them."""

import os
import sys
import tempfile
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def spawn(fn, world, *args):
    """Run ``fn(rank, world, store_file, out_dir, *args)`` on ``world`` ranks; each rank's :func:`save_result`."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(fn, args=(world, os.path.join(tmp, "store"), tmp, *args), nprocs=world, join=True)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=True) for r in range(world)]


def init(rank, world, store_file, threads=1):
    """Join the gloo group, computing on ``threads`` intra-op threads (one by default: the ranks share the machine's
    cores, 2 on CI, so more threads per rank only oversubscribe them), after :func:`warm_up`."""
    torch.set_num_threads(threads)
    warm_up()
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    torch.manual_seed(0)


def warm_up():
    """One forward and backward pass of :func:`make_model`'s ops on a batch that every intra-op thread gets a share
    of, before anything is compared. The first ``torch.tanh`` of a process at two threads sometimes computes one
    thread's share up to ~700-870 ulp off (a one-time initialization racing between the threads; the second call is
    exact): about 1 fresh process in 200 on the 2-core machine, ``scripts/stress_fsdp_resume.py --first-tanh``.
    A test that compares two runs in one process would otherwise part at the first run's first step whenever that
    happens (the FSDP2 resume test did, once, at 2 threads)."""
    model = make_model()
    model(torch.randn(64, 24)).square().mean().backward()


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 300), torch.nn.Tanh(), torch.nn.Linear(300, 5))


def batches(n, rank, world):
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(8 * world, 24, generator=g) for _ in range(n)]
    data = [(x, x[:, :5] * 0.5 - x[:, 5:10]) for x in xs]  # a target the model can learn
    return [(x[rank * 8 : rank * 8 + 8], y[rank * 8 : rank * 8 + 8]) for x, y in data]


def train(model, opt, data, record=None):
    """Train on ``data``; with a list ``record``, append :func:`snapshot` of each step (its gradients, then the
    parameters and state after it), so a run that parts from another can say where."""
    losses = []
    for x, y in data:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        grads = [_local(p.grad) for p in model.parameters()] if record is not None else None
        opt.step()
        losses.append(loss.item())
        if record is not None:
            record.append({"loss": losses[-1], "grads": grads, **snapshot(model, opt)})
    return losses


def _local(t):
    if t is None:
        return None
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def snapshot(model, opt):
    """This rank's parameters (local shards) and optimizer state, copied."""
    params = list(model.parameters())
    state = [{k: _local(v) if isinstance(v, torch.Tensor) else v for k, v in opt.state[p].items()} for p in params]
    return {"params": [_local(p) for p in params], "state": state}


def same_bits(a, b) -> bool:
    """Bit for bit (NaN equal to the same NaN, -0 not equal to +0), through tensors, dicts, lists and plain values."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
            return False
        return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_bits(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same_bits(x, y) for x, y in zip(a, b))
    return a == b


def first_difference(expected: list, got: list, start: int = 0) -> str | None:
    """Where the step records ``got`` (of steps ``start + 1``, ``start + 2``, ...) first part from ``expected`` (of
    steps 1, 2, ...), or None where they agree."""
    for step, e, g in zip(range(start + 1, len(expected) + 1), expected[start:], got):
        if not same_bits(e["loss"], g["loss"]):
            return f"step {step}: the loss"
        for key in ("grads", "params", "state"):
            bad = [j for j, (a, b) in enumerate(zip(e[key], g[key])) if not same_bits(a, b)]
            if bad:
                return f"step {step}: {key} of parameters {bad}"
    return None


def sharded(world, mesh=None):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = mesh or init_device_mesh("cpu", (world,))
    model = make_model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def gathered_params(model):
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()]


def save_optimizer(model, opt, path: str, full: bool, rank: int) -> None:
    """Checkpoint ``opt`` at ``path``: its full state dict gathered to rank 0 and written there (``full``), or its
    sharded state dict through ``torch.distributed.checkpoint``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=full, cpu_offload=full))
    if full:
        if rank == 0:
            torch.save(osd, path)
        dist.barrier()
    else:
        dcp.save({"optim": osd}, checkpoint_id=path)


def load_optimizer(model, opt, path: str, full: bool, rank: int) -> None:
    """Load into ``opt`` what :func:`save_optimizer` wrote at ``path`` (the full state dict from rank 0, broadcast)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    if full:
        osd = torch.load(path, weights_only=True) if rank == 0 else {}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_optimizer_state_dict(model, opt, osd, options=options)
    else:
        target = {"optim": get_optimizer_state_dict(model, opt)}
        dcp.load(target, checkpoint_id=path)
        set_optimizer_state_dict(model, opt, target["optim"])


def save_result(out_dir, rank, obj):
    torch.save(obj, os.path.join(out_dir, f"rank{rank}.pt"))


def finish(barrier: bool = True) -> NoReturn:
    """End a rank, after its results are written: wait for the others (so no rank tears gloo down while another is
    still in a collective), leave the process group, then exit without the interpreter's teardown. With the barrier in
    place a rank still aborted now and then at exit ("terminate called without an active exception", SIGABRT with no
    Python frame: a native thread destroyed during the process's final cleanup; about one run in four of this file on
    the 2-core CI machine), failing a test whose work had finished. ``os._exit(0)`` skips that cleanup; spawn sees
    exit code 0, and an exception before this point still fails the rank as before."""
    if barrier:
        dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
