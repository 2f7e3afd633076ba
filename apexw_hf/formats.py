"""State layouts of the four formats: allocation, byte accounting, and conversion between formats.

Per parameter ``p``, ``optimizer.state[p]`` holds ``step`` (a 0-dim fp32 CPU tensor, as in ``torch.optim.AdamW``)
and the moments:

=========  ===========================  ==============================================================
format     tensors                      bytes per parameter
=========  ===========================  ==============================================================
fp32       exp_avg, exp_avg_sq: fp32    8
compact    exp_avg, exp_avg_sq: bf16    4
8bit       exp_avg: uint8 codes,        2, plus 2 + 4 bytes of scales per block of
           exp_avg_sq: uint8 codes,     :data:`~apexw_hf.reference.BLOCK` elements (2.023)
           exp_avg_scale: bf16,
           exp_avg_sq_scale: fp32
4bit       exp_avg_mv: uint8, both      1, plus 4 + 4 bytes of scales per block of
           moments' codes per byte,     :data:`~apexw_hf.reference.BLOCK4` elements (1.0625)
           exp_avg_scale: fp32,
           exp_avg_sq_scale: fp32
=========  ===========================  ==============================================================

The key names are those of ``torch.optim.AdamW``, so a torch state dict maps onto them (and is converted); 4-bit
state keeps both moments in one tensor, ``exp_avg_mv`` (``reference.quantize_mv4``).

The 8-bit codes are of format version 3 (``reference.py``); the dtypes say which version a state entry holds: an
fp32 ``exp_avg_sq_scale`` (the envelope scale of e5m3 ``v`` codes) is version 3, a bf16 one with uint8 ``exp_avg``
(e4m4 ``v`` codes) version 2 (``"8bit_v2"``), int8 ``exp_avg`` (``(c/127)**2``) version 1 (``"8bit_v1"``). Entries
of versions 1 and 2 are converted on load (decoded, then re-encoded with the random stream of their step, so
deterministically).

The 4-bit codes are of format version 4 (``reference.quantize_mv4``). Versions 3 and 4 have the same tensors (both
scales fp32), so a state dict says which it holds: ``ApexW.state_dict`` writes :data:`MV4_VERSION_KEY` (4) into
every param group, and a state dict without it holds version 3 (``"4bit_v3"``, ``reference.quantize_mv4_v3``). The
scales' dtypes tell the earlier ones: a bf16 ``exp_avg_scale`` with an fp32 ``exp_avg_sq_scale`` is version 2
(``reference.quantize_mv4_v2``, ``"4bit_v2"``), both bf16 version 1 (``reference.quantize_mv4_v1``, ``"4bit_v1"``);
versions 1 to 3 are converted on load the same way.
A scale of any other dtype or shape is refused with a ``ValueError`` before anything changes.

Every layout converts into every format (fp32, compact, 8bit, 4bit, and from 8bit_v1, 8bit_v2, 4bit_v1, 4bit_v2,
4bit_v3 and ``torch.optim.AdamW``'s float moments): decoded to fp32 by ``reference.load_moments``, re-encoded by
``reference.store_moments``.
"""

from __future__ import annotations

import torch

from . import dtensor as dt
from . import reference as ref

MOMENT_KEYS = ("exp_avg", "exp_avg_sq")
MV4_KEY = "exp_avg_mv"  # 4-bit state: both moments' codes in one uint8 tensor shaped like the parameter
EIGHT_BIT = ("8bit", "8bit_v2", "8bit_v1")  # the 8-bit layouts: version 3, and versions 2 and 1 (read only)
FOUR_BIT = ("4bit", "4bit_v3", "4bit_v2", "4bit_v1")  # 4-bit: format version 4, and versions 3, 2, 1 (read only)
# The 4-bit format version of a state dict's entries, which a saved param group carries (state dicts of earlier
# versions lack it): versions 3 and 4 have the same tensors, so only this tells them apart.
MV4_VERSION_KEY = "exp_avg_mv_version"
MV4_VERSION = 4
QUANTIZED = (*EIGHT_BIT, *FOUR_BIT)  # the layouts with block scales
SCALE_KEYS = ("exp_avg_scale", "exp_avg_sq_scale")
STATE_KEYS = (*MOMENT_KEYS, MV4_KEY, *SCALE_KEYS)  # every tensor key of some layout, besides "step"
MOMENT_DTYPES = {
    "fp32": (torch.float32, torch.float32),
    "compact": (torch.bfloat16, torch.bfloat16),
    "8bit": (torch.uint8, torch.uint8),
    "8bit_v2": (torch.uint8, torch.uint8),
    "8bit_v1": (torch.int8, torch.uint8),
    "4bit": (torch.uint8,),
    "4bit_v3": (torch.uint8,),
    "4bit_v2": (torch.uint8,),
    "4bit_v1": (torch.uint8,),
}
SCALE_BLOCKS = {  # elements per scale
    "8bit": ref.BLOCK,
    "8bit_v2": ref.BLOCK,
    "8bit_v1": ref.BLOCK,
    "4bit": ref.BLOCK4,
    "4bit_v3": ref.BLOCK4,
    "4bit_v2": ref.BLOCK4,
    "4bit_v1": ref.BLOCK4,
}
SCALE_DTYPES = {  # dtypes of (exp_avg_scale, exp_avg_sq_scale)
    "8bit": (torch.bfloat16, torch.float32),
    "8bit_v2": (torch.bfloat16, torch.bfloat16),
    "8bit_v1": (torch.bfloat16, torch.bfloat16),
    "4bit": (torch.float32, torch.float32),
    "4bit_v3": (torch.float32, torch.float32),
    "4bit_v2": (torch.bfloat16, torch.float32),
    "4bit_v1": (torch.bfloat16, torch.bfloat16),
}


def moment_keys(fmt: str) -> tuple[str, ...]:
    """The state keys of a format's moments (4-bit: both in one tensor)."""
    return (MV4_KEY,) if fmt in FOUR_BIT else MOMENT_KEYS


def state_dtypes(fmt: str) -> dict[str, torch.dtype]:
    """Each state tensor's key (moments first, then scales) -> its dtype, in format ``fmt``."""
    keys = moment_keys(fmt) + (SCALE_KEYS if fmt in QUANTIZED else ())
    return dict(zip(keys, MOMENT_DTYPES[fmt] + SCALE_DTYPES.get(fmt, ()), strict=True))


def init_state(
    p: torch.Tensor, fmt: str, *, device: torch.device | None = None, pin_memory: bool = False
) -> dict:
    """Fresh zero state for parameter ``p`` in format ``fmt`` (``DTensor`` state for a ``DTensor`` parameter), on
    ``p``'s device or on ``device`` (in pinned memory with ``pin_memory``: state offload's host copy)."""
    if dt.is_dtensor(p):
        return dt.wrap_state(init_state(p.to_local(), fmt, device=device, pin_memory=pin_memory), p)
    state = {"step": torch.tensor(0.0, dtype=torch.float32)}
    device = p.device if device is None else device

    def zeros(shape, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)

    if fmt == "fp32":
        state["exp_avg"] = zeros(p.shape, torch.float32)
        state["exp_avg_sq"] = zeros(p.shape, torch.float32)
    elif fmt == "compact":
        state["exp_avg"] = zeros(p.shape, torch.bfloat16)
        state["exp_avg_sq"] = zeros(p.shape, torch.bfloat16)
    elif fmt == "8bit":
        nb = ref.num_blocks(p.numel())
        state["exp_avg"] = zeros(p.shape, torch.uint8)
        state["exp_avg_scale"] = zeros(nb, torch.bfloat16)
        state["exp_avg_sq"] = zeros(p.shape, torch.uint8)
        state["exp_avg_sq_scale"] = zeros(nb, SCALE_DTYPES[fmt][1])
    elif fmt == "4bit":
        nb = ref.num_blocks(p.numel(), SCALE_BLOCKS[fmt])
        state[MV4_KEY] = zeros(p.shape, torch.uint8)
        state["exp_avg_scale"] = zeros(nb, SCALE_DTYPES[fmt][0])
        state["exp_avg_sq_scale"] = zeros(nb, SCALE_DTYPES[fmt][1])
    else:
        raise ValueError(f"unknown state_format {fmt!r}; allowed: {', '.join(ref.STATE_FORMATS)}")
    return state


def state_format_of(state: dict, mv4_version: int = MV4_VERSION) -> str | None:
    """The format a state dict entry is stored in: one of the formats, ``"8bit_v1"`` for 8-bit codes of format
    version 1 (int8 ``exp_avg``; always converted), ``"8bit_v2"`` for those of version 2 (uint8 codes with a bf16
    ``exp_avg_sq_scale``; always converted), ``"4bit_v2"`` and ``"4bit_v1"`` for 4-bit codes of format version 2 (a
    bf16 ``exp_avg_scale``, an fp32 ``exp_avg_sq_scale``) and version 1 (both scales bf16; both always converted),
    ``"4bit_v3"`` for 4-bit codes with both scales fp32 when ``mv4_version`` (the version the state dict declares,
    :data:`MV4_VERSION_KEY`) is 3, ``"float"`` for moments of another float dtype
    (``torch.optim.AdamW`` keeps fp16 moments for fp16 parameters; they are always converted), or ``None`` for an
    empty entry."""
    if MV4_KEY in state:
        if getattr(state.get("exp_avg_sq_scale"), "dtype", None) == torch.bfloat16:
            return "4bit_v1"
        if getattr(state.get("exp_avg_scale"), "dtype", None) == torch.bfloat16:
            return "4bit_v2"
        return "4bit" if mv4_version == MV4_VERSION else "4bit_v3"
    if "exp_avg" not in state:
        return None
    if "exp_avg_scale" in state:
        if getattr(state["exp_avg"], "dtype", None) == torch.int8:
            return "8bit_v1"
        return "8bit_v2" if getattr(state.get("exp_avg_sq_scale"), "dtype", None) == torch.bfloat16 else "8bit"
    dtypes = {state["exp_avg"].dtype, state["exp_avg_sq"].dtype}
    if dtypes == {torch.bfloat16}:
        return "compact"
    if dtypes == {torch.float32}:
        return "fp32"
    return "float"


def saved_mv4_version(group: dict) -> int:
    """The 4-bit format version of a saved param group's state entries: :data:`MV4_VERSION_KEY`'s value, 3 where it is
    absent (state dicts written before version 4). ``ValueError`` for a version this package does not know."""
    version = group.get(MV4_VERSION_KEY, 3)
    if version not in (3, MV4_VERSION):
        raise ValueError(
            f"the state dict's param group declares 4-bit format version {version!r} ({MV4_VERSION_KEY}); this "
            f"apexw_hf reads versions 3 and {MV4_VERSION} (and the earlier ones by their dtypes): it was saved by a "
            "newer apexw_hf"
        )
    return version


def _check_source(state: dict, p: torch.Tensor, src: str) -> None:
    """Raise ``ValueError`` unless the moments to convert fit ``p`` (quantized: exactly its layout)."""
    if src in QUANTIZED:
        if dt.is_dtensor(p):  # first: a checkpoint of another shard count also has other scale shapes
            dt.check_block_shards(state, p)
        check_state(state, p, src)
        return
    for key in MOMENT_KEYS:
        got = state[key]
        if isinstance(got, torch.Tensor) and got.is_floating_point() and got.shape != p.shape:
            _shape_mismatch(key, got, p)
        if not isinstance(got, torch.Tensor) or not got.is_floating_point() or got.shape != p.shape:
            raise ValueError(
                f"optimizer state '{key}' for a parameter of shape {tuple(p.shape)} is "
                f"{getattr(got, 'dtype', type(got))} {tuple(getattr(got, 'shape', ()))}; expected float moments of "
                "the parameter's shape"
            )
        _check_kind(key, got, p)


def _layout(p: torch.Tensor, fmt: str) -> dict:
    """(dtype, global shape) of each state tensor of format ``fmt`` for ``p``."""
    out = dict(zip(moment_keys(fmt), ((d, p.shape) for d in MOMENT_DTYPES[fmt])))
    if fmt in QUANTIZED:
        block = SCALE_BLOCKS[fmt]
        if dt.is_dtensor(p):
            nb = dt.max_local_blocks(p, block) * dt.shard_count(p)
        else:
            nb = ref.num_blocks(p.numel(), block)
        out.update({k: (d, torch.Size([nb])) for k, d in zip(SCALE_KEYS, SCALE_DTYPES[fmt])})
    return out


def _shape_mismatch(key: str, got: torch.Tensor, p: torch.Tensor) -> None:
    """Raise the error of a moment tensor whose shape is not its parameter's (a state dict of another model)."""
    raise ValueError(
        f"optimizer state '{key}' has shape {tuple(got.shape)} but its parameter has shape {tuple(p.shape)}: the "
        "state dict was saved from a different model (or with its parameters in another order)"
    )


def _check_kind(key: str, got: torch.Tensor, p: torch.Tensor) -> None:
    if dt.is_dtensor(p) != dt.is_dtensor(got):
        raise ValueError(
            f"optimizer state '{key}' is a {type(got).__name__} but its parameter is a {type(p).__name__}: "
            "load sharded (FSDP2) optimizer state with torch.distributed.checkpoint.state_dict."
            "set_optimizer_state_dict, which shards full tensors first"
        )


def check_state(state: dict, p: torch.Tensor, fmt: str) -> None:
    """Raise ``ValueError`` unless ``state`` has exactly the shapes and dtypes of format ``fmt`` for ``p``, and no
    tensor of another layout (4-bit codes beside float moments would leave it unclear which to read)."""
    layout = _layout(p, fmt)
    stray = [k for k in STATE_KEYS if k in state and k not in layout]
    if stray:
        raise ValueError(
            f"optimizer state for a parameter of shape {tuple(p.shape)} holds {', '.join(map(repr, stray))} beside "
            f"the tensors of format {fmt!r}, which are exactly {', '.join(map(repr, layout))} (and 'step'); "
            "one state entry holds one format"
        )
    for key, (dtype, shape) in layout.items():
        got = state.get(key)
        if isinstance(got, torch.Tensor):
            _check_kind(key, got, p)
            if key in (*MOMENT_KEYS, MV4_KEY) and got.dtype == dtype and got.shape != p.shape:
                _shape_mismatch(key, got, p)
        if not isinstance(got, torch.Tensor) or got.dtype != dtype or got.shape != shape:
            desc = (
                "missing" if got is None else f"{getattr(got, 'dtype', type(got))} {tuple(getattr(got, 'shape', ()))}"
            )
            raise ValueError(
                f"optimizer state '{key}' for a parameter of shape {tuple(p.shape)} is {desc}; "
                f"format {fmt!r} needs {dtype} {tuple(shape)}"
            )


def convert_state(
    state: dict, p: torch.Tensor, fmt: str, *, seed: int, tensor_index: int, mv4_version: int = MV4_VERSION
) -> dict:
    """Return ``state`` in format ``fmt`` on ``p``'s device, converting moments from whatever format they are in.

    Same-format tensors are only moved (bit-exact). Moments from another format (for example fp32 moments of a
    ``torch.optim.AdamW`` state dict, or 4-bit codes of an earlier format version) are decoded to fp32 and re-encoded
    with the random streams of the current step, so the conversion is deterministic. ``mv4_version``: the 4-bit format
    version the state dict declares (:func:`saved_mv4_version`).
    """
    step = state.get("step", torch.tensor(0.0))
    step = (step if isinstance(step, torch.Tensor) else torch.tensor(float(step))).detach().to("cpu", torch.float32)
    src = state_format_of(state, mv4_version)
    if src is None:
        return {}
    if src == fmt:
        if dt.is_dtensor(p) and fmt in QUANTIZED:
            dt.check_block_shards(state, p)
        check_state(state, p, fmt)
        out = {k: v.to(p.device) for k, v in state.items() if k in STATE_KEYS}
        if dt.is_dtensor(p) and fmt in QUANTIZED:
            out["block_shards"] = state["block_shards"]
        out["step"] = step.clone()
        return out
    _check_source(state, p, src)
    if dt.is_dtensor(p):
        state = dt.local_view(state, p)
    local_p = dt.local(p)
    m, v = ref.load_moments(state, src, local_p.shape)
    out = init_state(p, fmt)
    out["step"] = step.clone()
    t = int(step.item())
    ref.store_moments(
        dt.local_view(out, p) if dt.is_dtensor(p) else out,
        fmt,
        m.to(local_p.device, torch.float32),
        v.to(local_p.device, torch.float32),
        ref.stream_key(seed, tensor_index, t, ref.STREAM_MV),
    )
    return out


def dequantized(state: dict, p: torch.Tensor) -> dict:
    """fp32 ``step``, ``exp_avg`` and ``exp_avg_sq`` of one parameter's state entry, whatever its format.

    New tensors, never views of the live state. A ``DTensor`` parameter gives its local shard's moments (plain
    tensors shaped like ``p.to_local()``). An empty entry (a parameter not stepped yet) gives the zeros and step 0
    that the first step starts from.
    """
    local_p = dt.local(p)
    src = state_format_of(state)
    if src is None:
        zeros = torch.zeros(local_p.shape, dtype=torch.float32, device=local_p.device)
        return {"step": torch.tensor(0.0), "exp_avg": zeros, "exp_avg_sq": zeros.clone()}
    local_state = dt.local_view(state, p) if dt.is_dtensor(p) else state
    m, v = ref.load_moments(local_state, src, local_p.shape)
    if src == "fp32":  # load_moments returns the stored tensors themselves
        m, v = m.clone(), v.clone()
    step = state["step"]
    step = (
        step.detach().to("cpu", torch.float32).clone() if isinstance(step, torch.Tensor) else torch.tensor(float(step))
    )
    return {"step": step, "exp_avg": m, "exp_avg_sq": v}


def state_tensor_bytes(state: dict) -> int:
    """Bytes of every tensor in a parameter's state entry (on this rank, for sharded state)."""
    return sum(dt.local(v).numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
