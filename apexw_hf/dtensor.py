"""Sharded parameters (FSDP2 ``DTensor``): the step runs on each rank's local shard, state lives per local shard.

The moments of a ``DTensor`` parameter are ``DTensor``s with the parameter's mesh and placements, so
``torch.distributed.checkpoint`` saves, loads and reshards them like the parameter itself (the 4-bit codes
``exp_avg_mv`` too: one byte per element, shaped like the parameter). The block scales of the quantized formats
(8-bit: one per 256 elements, 4-bit: one per 128) belong to blocks of the *local* shard, so they cannot be resharded:
each rank's scales are padded to the largest local block count and exposed as a ``DTensor`` sharded on dim 0 (the
layout ``torch.distributed.checkpoint`` expects), and the state records how many shards the blocks were cut for
(``block_shards``). Loading quantized state for another number of shards raises a clear error; fp32 and compact state
reshard freely.

The local tensors of that state stay on the device they were made on, also where it is not the mesh's: state offload
keeps them in host memory under a CUDA mesh (as FSDP2's ``CPUOffloadPolicy`` keeps its parameters), and
``torch.distributed.checkpoint`` moves such shards to the mesh's device itself when it gathers them.
"""

from __future__ import annotations

import importlib
import math
import sys

import torch

from . import reference as ref

# ``torch.distributed.tensor`` costs ~1.6 s to import, a third of ``import apexw_hf``; it is imported on first use
# instead. No tensor can be a ``DTensor`` before that module is imported, so ``is_dtensor`` only looks it up in
# ``sys.modules``. ``DTensor``, ``Shard`` and ``Replicate`` stay module attributes (``DTensor`` is None on a torch
# built without distributed support), resolved by ``__getattr__`` below.
_DT_MODULE = "torch.distributed.tensor"
_DT_NAMES = ("DTensor", "Replicate", "Shard")


def _dt_attr(name: str):
    try:
        module = importlib.import_module(_DT_MODULE)
    except ImportError:  # torch built without distributed support
        return None
    return getattr(module, name)


def __getattr__(name: str):
    if name in _DT_NAMES:
        return _dt_attr(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_dtensor(t) -> bool:
    module = sys.modules.get(_DT_MODULE)
    return module is not None and isinstance(t, module.DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t


def shard_count(p) -> int:
    """How many pieces the parameter is cut into (the product of the mesh sizes of its sharded mesh dims)."""
    mesh = p.device_mesh
    return math.prod(mesh.size(i) for i, pl in enumerate(p.placements) if pl.is_shard())


def scale_block(state: dict) -> int:
    """Elements per block scale of a state entry: 4-bit state (codes in ``exp_avg_mv``) has blocks of
    :data:`~apexw_hf.reference.BLOCK4`, 8-bit state of :data:`~apexw_hf.reference.BLOCK`."""
    return ref.BLOCK4 if "exp_avg_mv" in state else ref.BLOCK


def _format_name(state: dict) -> str:
    return "4-bit" if "exp_avg_mv" in state else "8-bit"


def max_local_blocks(p, block: int = ref.BLOCK) -> int:
    """Blocks of ``block`` elements in the largest local shard (the first chunk along each sharded dim)."""
    shape = list(p.shape)
    for i, pl in enumerate(p.placements):
        if pl.is_shard():
            dim = pl.dim
            shape[dim] = -(-shape[dim] // p.device_mesh.size(i))
    return ref.num_blocks(math.prod(shape), block)


def _from_local(local: torch.Tensor, mesh, placements, shape, stride):
    """``DTensor.from_local(local, mesh, placements, shape=shape, stride=stride)``, except that ``local`` stays where
    it is: ``from_local`` copies a tensor on another device type than the mesh's (host state under a CUDA mesh) to the
    mesh's device."""
    if local.device.type == mesh.device_type or local.is_meta:
        DTensor = _dt_attr("DTensor")
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)
    return _over(local, mesh, placements, shape, stride)


def _over(local: torch.Tensor, mesh, placements, shape, stride):
    """A ``DTensor`` whose local tensor is ``local`` itself, wherever it is (FSDP2 builds its ``CPUOffloadPolicy``
    parameters, host shards under a CUDA mesh, the same way)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    meta = TensorMeta(torch.Size(shape), tuple(stride), local.dtype)
    return _dt_attr("DTensor")(local, DTensorSpec(mesh, tuple(placements), tensor_meta=meta), requires_grad=False)


def like(local: torch.Tensor, other) -> object:
    """A ``DTensor`` over ``local`` (which stays where it is) with the mesh, placements, shape and stride of the
    ``DTensor`` ``other``: a state tensor moved or copied as a local tensor, wrapped again."""
    return _from_local(local, other.device_mesh, other.placements, other.shape, other.stride())


def host_stand_in(p: torch.Tensor) -> torch.Tensor:
    """A tensor like parameter ``p`` (shape, dtype; a ``DTensor`` with ``p``'s mesh, placements and local shape) on the
    host, holding no memory (one element, expanded): what ``formats.convert_state`` converts a loaded state entry for
    when the state belongs in host memory (state offload), since it puts the state on its parameter's device."""
    blank = torch.empty((), dtype=p.dtype).expand(local(p).shape)
    return _over(blank, p.device_mesh, p.placements, p.shape, p.stride()) if is_dtensor(p) else blank


def _scale_placements(p):
    shard, replicate = _dt_attr("Shard"), _dt_attr("Replicate")
    return [shard(0) if pl.is_shard() else replicate() for pl in p.placements]


def wrap_state(local_state: dict, p) -> dict:
    """Turn a freshly initialised local state (for ``p.to_local()``) into ``DTensor`` state for ``p``."""
    out = {"step": local_state["step"]}
    block = scale_block(local_state)
    for key, value in local_state.items():
        if key == "step":
            continue
        if key.endswith("_scale"):
            k = max_local_blocks(p, block)
            padded = torch.zeros(k, dtype=value.dtype, device=value.device)
            padded[: value.numel()] = value
            n = shard_count(p)
            out[key] = _from_local(padded, p.device_mesh, _scale_placements(p), (k * n,), (1,))
        else:
            out[key] = _from_local(value, p.device_mesh, p.placements, p.shape, p.stride())
    if "exp_avg_scale" in local_state:
        out["block_shards"] = shard_count(p)
    return out


def local_view(state: dict, p) -> dict:
    """The local tensors of a ``DTensor`` state, with the padded scales cut to the local block count."""
    nb = ref.num_blocks(p.to_local().numel(), scale_block(state))
    out = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            value = local(value)
            out[key] = value[:nb] if key.endswith("_scale") else value
        else:
            out[key] = value
    return out


def check_block_shards(state: dict, p) -> None:
    """Raise ``ValueError`` unless quantized ``state`` was saved for as many shards as ``p`` is cut into now."""
    if "exp_avg_scale" not in state:
        return
    saved = state.get("block_shards")
    if saved != shard_count(p):
        name, block = _format_name(state), scale_block(state)
        how = "without sharding (no 'block_shards')" if saved is None else f"for a parameter cut into {saved} shards"
        raise ValueError(
            f"{name} optimizer state was saved {how}, but here the parameter is cut into {shard_count(p)}: its "
            f"blocks of {block} elements belong to local shards and cannot be resharded. Resume with the same number "
            "of shards, or save with state_format='compact' or 'fp32', which reshard freely"
        )
