"""Code that runs inside the spawned ranks of tests/distributed (gloo, CPU)."""

import os
import sys
from typing import NoReturn

import torch
import torch.distributed as dist


def init(rank, world, store_file):
    """Join the gloo group, computing on one thread: the ranks share the machine's cores (2 on CI), so more threads
    per rank only oversubscribe them."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    torch.manual_seed(0)


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 300), torch.nn.Tanh(), torch.nn.Linear(300, 5))


def batches(n, rank, world):
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(8 * world, 24, generator=g) for _ in range(n)]
    data = [(x, x[:, :5] * 0.5 - x[:, 5:10]) for x in xs]  # a target the model can learn
    return [(x[rank * 8 : rank * 8 + 8], y[rank * 8 : rank * 8 + 8]) for x, y in data]


def train(model, opt, data):
    losses = []
    for x, y in data:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


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
