"""State offload: the optimizer state lives in host memory and streams through the update kernel.

With ``ApexW(..., state_offload=True)`` every tensor of ``optimizer.state`` (moments, scales) is a host tensor, in
pinned memory when CUDA is there; that is what ``state_dict``, ``dequantized_state`` and the export to torch AdamW
read. The Triton engine's launches (a gradient-release bucket, or a param group in ``step()``) are cut into *pieces*:
consecutive work items of a launch plan (chunks of ``rows * 256`` elements, a large tensor cut between chunks) whose
state takes at most ``piece_bytes`` (:func:`default_layout` of the whole state, or ``offload_piece_mib``). Each
piece updates a copy of its state in one of a few device buffers ("slots"):

1. *stage*: the piece's state is copied host -> device into a slot on a side stream (or found there already: it was
   prefetched, or is still resident from the last step), and the compute stream waits for that copy only;
2. the plan is launched over the piece's work items with a table of state addresses pointing into the slot
   (``LaunchPlan.state_table``: the address of element 0 of each tensor's state, shifted so that the piece's elements
   land in the slot; made once per piece and slot, since a piece comes back to the same slot every step);
3. the slot is copied device -> host on a second side stream once the launch is done, while backward goes on.

So the device holds ``slots`` buffers of at most about ``piece_bytes`` each, whatever the size of a bucket or of one
tensor (a vocabulary embedding's state passes through in pieces), and a launch computes the same bits as one over the
whole plan: every work item computes the same elements from the same addresses' contents.

Pieces come in the same order every step (gradient release cuts the same buckets from the second step on, ``step()``
the same groups), so the offload learns the order of the last step and, after each launch, copies in the state of the
next ``slots - 1`` pieces of that order. A piece that is not the one expected (the first step, a parameter without a
gradient, a changed grouping) is copied in when it is launched: the same bits, later. The host copy of a piece's state
is never older than its last update once :meth:`StateOffload.sync` has returned (``state_dict`` and the readers above
call it).

Slot ``i`` of step position ``k`` is ``k % slots``: a prefetch never overwrites the piece being launched, and with
three slots the copy in of piece ``k + 1`` and the copy out of piece ``k - 1`` use different buffers and run at once
(the link carries both directions). Copies are queued after the events they depend on (the launch that last wrote a
slot, the copy out that last wrote the same elements' host state): nothing waits on the host.

The launches stay on the compute stream, which waits for each piece's copy in. Launching on a stream of their own
would let backward run ahead of a piece that is late, but then every bucket's gradients are used on a second stream
and the caching allocator can hand their memory to nothing else until that stream has passed them: on 8B shapes the
peak reserved memory grew from 18.7 to 23.6-24.4 GiB (past what a 24 GB GPU holds) for 0-7% less time per step.

Under FSDP2 each rank streams the state of its local shards through its own GPU. The state of a ``DTensor``
parameter is what it is without offload (:mod:`apexw_hf.dtensor`: ``DTensor``s with the parameter's mesh and
placements, block scales padded to the largest shard's count, ``block_shards``), over local tensors taken from the
host blocks and left there (``DTensor.from_local`` would copy them to the mesh's device); the pieces are cut from the
local shards and their local state, exactly as for plain tensors, so ``torch.distributed.checkpoint`` saves and loads
the same state dicts with or without offload.

On the CPU (the Triton interpreter runs the kernels on CPU tensors) the same logic runs with plain copies, which is
how the tests check it.
"""

from __future__ import annotations

import collections
import ctypes
import os
import weakref

import torch

from .. import dtensor as dt
from .. import formats as st

DEFAULT_SLOTS = 3
# Bytes of state per launch (a piece of fewer bytes where a bucket ends; one work item at least). The device holds
# a few buffers of about this size, and all but one of them are how far the copies run ahead of the launches: smaller
# pieces take less GPU memory and hide less of the link (docs/gradient_release.md, "State offload", has the measured
# trade-off). By default a piece is 1/72 of the whole state, between these bounds, in DEFAULT_SLOTS buffers (1/24 of
# the state); a state whose 1/72 is above DEEP_SHARE x PIECE_BYTES (an 8B model's) gets one buffer more instead:
# on 8B shapes four buffers ran ahead further than three of a third more bytes, in the same GPU memory. A 1B model's
# state gets the smallest pieces: less GPU memory, and a slower step where the copies need to run further ahead
# (a 3B 4-bit state: 3 x 33.5 MiB stepped slower than 3 x 44 MiB; docs/gradient_release.md, "State offload").
PIECE_BYTES = 64 * 2**20
MIN_PIECE_BYTES = 32 * 2**20
PIECES_PER_STATE = 72
# The fourth buffer only where the state's 1/72 is over this many PIECE_BYTES: 8B shapes (4-bit ~1.7, 8-bit ~3.3);
# a 3B 8-bit state (1/72 ~1.35 x PIECE_BYTES) streams through three buffers (three took 0.09 GiB less than four at
# the same speed, measured with larger pieces).
DEEP_SHARE = 1.5


def default_layout(state_bytes: int) -> tuple[int, int]:
    """The default (piece bytes, device buffers) for a state of ``state_bytes`` in all: pieces of
    1/``PIECES_PER_STATE`` of it within [``MIN_PIECE_BYTES``, ``PIECE_BYTES``], in ``DEFAULT_SLOTS`` buffers, one
    buffer more where the state is larger than ``PIECES_PER_STATE`` pieces of ``DEEP_SHARE`` x ``PIECE_BYTES``."""
    share = state_bytes // PIECES_PER_STATE
    return min(PIECE_BYTES, max(MIN_PIECE_BYTES, share)), DEFAULT_SLOTS + (share > DEEP_SHARE * PIECE_BYTES)


ALIGN = 256  # bytes: every staged range starts at a multiple (16 is what the kernel's vector loads need)
# Host state is taken from blocks of this many bytes (a parameter whose state is larger gets a block of its own): the
# state tensors of consecutive parameters lie one after the other, each at a multiple of ALIGN, as a piece lays them
# out in its slot, so a piece of whole tensors is one copy each way instead of one per tensor.
ARENA_BYTES = 256 * 2**20


# Another copy that shares the link with the state's pieces (the tied weight's gradient part, tied_offload.py) goes on
# the offload's stream of its direction in chunks of SIDE_CHUNK_BYTES: the first SIDE_FIRST_BYTES when it is queued,
# then SIDE_RATIO of the bytes of each piece's copy that direction beside it, the rest when it is needed. A copy engine
# runs one direction's copies in the order they were queued, so one copy of the whole part held every piece's copy
# queued after it. The part going out is queued whole: its GPU memory is freed only when all of it is out, and going
# out in chunks raised the 3B peak by 0.21 GiB (docs/gradient_release.md, "State offload").
SIDE_CHUNK_BYTES = 16 * 2**20
SIDE_FIRST_BYTES = {"out": float("inf"), "in": 16 * 2**20}
SIDE_RATIO = {"out": 1.0, "in": 1.0}


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _tensor_keys(state: dict) -> list[str]:
    return [k for k in st.STATE_KEYS if k in state]


def _local_state(state: dict, p: torch.Tensor) -> dict:
    """The state tensors a launch reads for ``p``: its own, or for an FSDP2 (``DTensor``) parameter those of its local
    shard (:func:`apexw_hf.dtensor.local_view`: host tensors, block scales cut to the shard's blocks)."""
    return dt.local_view(state, p) if dt.is_dtensor(p) else state


def host_bytes_available() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes, or None where there is none (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def local_ranks() -> int:
    """The processes of this job on this host (``LOCAL_WORLD_SIZE``, which torchrun and ``accelerate launch`` set; 1
    where it is not set)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


class _MemLocation(ctypes.Structure):
    """``CUmemLocation`` of cuda.h (a location type and an id; all zero: no hint)."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    """``CUmemcpyAttributes`` of cuda.h: the attributes of the copies of one ``cuMemcpyBatchAsync``."""

    _fields_ = [
        ("src_access_order", ctypes.c_int),
        ("src_loc_hint", _MemLocation),
        ("dst_loc_hint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


SRC_ACCESS_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: the source is read in stream order


class _RawCopies:
    """The copies that move one piece's state between the host blocks and one slot: ``triples`` of (host address,
    slot address, bytes), and per direction the arrays a batched driver copy takes (made on first use)."""

    __slots__ = ("triples", "arrays")

    def __init__(self, triples: list[tuple[int, int, int]]):
        self.triples = triples
        self.arrays: dict[bool, tuple] = {}


class _DriverCopies:
    """Copies between pinned host memory and the device queued with the CUDA driver on a given stream (the direction
    follows from the addresses: CUDA's unified addressing). A piece's state moves in a few copies each way, and
    ``Tensor.copy_`` spends most of the offload's host time per piece (dispatch, the pinned allocator's bookkeeping, a
    stream switch around it: docs/gradient_release.md, "State offload"); this queues the same copies on the same
    stream. A piece's copies in one direction go to the driver in one ``cuMemcpyBatchAsync`` (drivers of CUDA 12.8 and
    later; the copies of a piece never overlap, so their order within the batch does not matter), else one
    ``cuMemcpyAsync`` each: :attr:`batched` says which. Used where the caller's current device is the offload's (the
    driver copies within the current context): the stagers' copies; the prefetch at a step's end goes through
    ``Tensor.copy_``.

    The pinned allocator is not told of these copies: the host blocks they touch live as long as the
    :class:`StateOffload`, whose collection waits for its copy streams first.

    ``lib``: the driver library (``libcuda.so.1`` by default; the tests pass stand-ins with the same functions)."""

    def __init__(self, lib=None):
        try:
            lib = ctypes.CDLL("libcuda.so.1") if lib is None else lib
            one = lib.cuMemcpyAsync
        except (OSError, AttributeError) as e:
            raise RuntimeError(
                f"state_offload=True queues its copies through the CUDA driver, and libcuda.so.1 did not load ({e}). "
                "Check the NVIDIA driver installation, or turn state_offload off."
            ) from e
        one.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        one.restype = ctypes.c_int
        self._one = one
        arrays = [ctypes.POINTER(ctypes.c_uint64)] * 2 + [ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t]
        attrs = [ctypes.POINTER(_MemcpyAttributes), ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t]
        # CUDA 13's ABI has no failure index; CUDA 12.8's (the unsuffixed name) has one before the stream
        batch, fail_index = getattr(lib, "cuMemcpyBatchAsync_v2", None), False
        if batch is None:
            batch, version = getattr(lib, "cuMemcpyBatchAsync", None), ctypes.c_int(0)
            if batch is not None and (lib.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value < 12080):
                batch = None
            fail_index = True
        if batch is not None:
            batch.argtypes = (
                arrays + attrs + ([ctypes.POINTER(ctypes.c_size_t)] if fail_index else []) + [ctypes.c_void_p]
            )
            batch.restype = ctypes.c_int
        self._batch, self._fail_index = batch, ctypes.c_size_t(0) if fail_index else None
        self._attrs = (_MemcpyAttributes * 1)(_MemcpyAttributes(SRC_ACCESS_ORDER_STREAM))
        self._attr_starts = (ctypes.c_size_t * 1)(0)

    @property
    def batched(self) -> bool:
        """Whether a piece's copies in one direction are one driver call (``cuMemcpyBatchAsync``)."""
        return self._batch is not None

    def __call__(self, raw: _RawCopies, to_host: bool, stream: int) -> None:
        """Queue the copies of ``raw`` on ``stream`` (a ``CUstream`` handle): to the host blocks, or from them."""
        if self._batch is None or len(raw.triples) == 1:
            for h, d, n in raw.triples:
                dst, src = (h, d) if to_host else (d, h)
                err = self._one(dst, src, n, stream)
                if err:
                    self._failed("cuMemcpyAsync", n, err)
            return
        arrays = raw.arrays.get(to_host)
        if arrays is None:
            count = len(raw.triples)
            hosts = (ctypes.c_uint64 * count)(*(h for h, _, _ in raw.triples))
            slots = (ctypes.c_uint64 * count)(*(d for _, d, _ in raw.triples))
            sizes = (ctypes.c_size_t * count)(*(n for _, _, n in raw.triples))
            arrays = raw.arrays[to_host] = (hosts, slots, sizes, count) if to_host else (slots, hosts, sizes, count)
        extra = (self._fail_index,) if self._fail_index is not None else ()
        err = self._batch(*arrays, self._attrs, self._attr_starts, 1, *extra, stream)
        if err:
            self._failed(f"cuMemcpyBatchAsync of {arrays[3]} copies", sum(n for _, _, n in raw.triples), err)

    @staticmethod
    def _failed(call: str, nbytes: int, err: int):
        raise RuntimeError(
            f"state_offload=True: {call} ({nbytes} bytes of optimizer state) failed with CUDA error {err} (a CUresult "
            "of cuda.h)"
        )


def _drain(streams: list) -> None:
    """Wait for ``streams`` (a collected offload's copy streams: their copies may still touch its host blocks)."""
    for s in streams:
        s.synchronize()


class _Piece:
    """Work items ``programs = (first, end)`` of one launch plan and the state they update: ``ranges``, one
    ``(plan position, param, key, first unit, end unit, bytes per unit, offset in the slot)`` per state tensor range
    (a unit is an element, or a block for the block scales), ``size`` bytes in a slot."""

    __slots__ = (
        "cut", "programs", "ranges", "params", "tensors", "size", "tables", "copies", "spans", "placed", "out_slot",
        "overlapping",
    )

    def __init__(self, cut: tuple, programs: tuple[int, int], ranges: list, params: list, tensors: int):
        # ``cut``: (launch key, plan index), one object shared by the pieces of one cut (compared by identity: a launch
        # key is a tuple of every parameter's id, too long to hash or compare per piece)
        self.cut, self.programs, self.ranges, self.params = cut, programs, ranges, params
        self.tensors = tensors  # of the plan
        # (id(param), key) -> the unit ranges of that state tensor in this piece: what another piece's overlap is
        # looked up in
        self.spans: dict[tuple[int, str], list[tuple[int, int]]] = {}
        for _, p, k, u0, u1, _, _ in ranges:
            self.spans.setdefault((id(p), k), []).append((u0, u1))
        self.tables: dict[int, tuple[int, object]] = {}  # slot index -> (its buffer's address, the state table)
        # slot index -> (its buffer's address, [(host, slot) views], their driver copies, or None where a view is
        # not of the host blocks)
        self.copies: dict[int, tuple[int, list, _RawCopies | None]] = {}
        self.placed = False  # its params' host state exists
        self.out_slot: int | None = None  # the slot its last copy out read (CUDA)
        # (cuts version, the pieces whose state overlaps this one's, itself included): StateOffload._overlapping
        self.overlapping: tuple[int, list[_Piece]] | None = None
        self.size = ranges[-1][6] + _align((ranges[-1][4] - ranges[-1][3]) * ranges[-1][5]) if ranges else 0


def _overlap(a: _Piece, b: _Piece) -> bool:
    """Whether pieces ``a`` and ``b`` update some of the same state elements. The pieces of one cut (the same launch
    and plan) never do: they split its work items."""
    if a.cut is b.cut or a.spans.keys().isdisjoint(b.spans):
        return False
    return any(
        v0 < u1 and u0 < v1 for t in a.spans.keys() & b.spans.keys() for v0, v1 in a.spans[t] for u0, u1 in b.spans[t]
    )


class SideCopy:
    """A copy queued beside the state's copies (:meth:`StateOffload.side_copy`): its chunks not yet issued, the event
    its first chunk waits for, and ``done``, recorded on the stream after its last chunk."""

    __slots__ = ("direction", "chunks", "after", "done")

    def __init__(self, direction: str, chunks: list, after: list):
        self.direction, self.chunks, self.after = direction, collections.deque(chunks), after
        self.done = torch.cuda.Event()

    @property
    def issued(self) -> bool:
        return not self.chunks


class _On:
    """``with _On(stream, back):`` runs the block with ``stream`` current, as ``torch.cuda.stream(stream)`` does, and
    then makes ``back`` current. ``back``: the current stream, known to be on the current device (the stager looked it
    up), so two ``torch.cuda.set_stream`` calls do it; None: ``torch.cuda.stream``, which looks both up (several
    microseconds of host time, and a piece switches streams two to four times)."""

    __slots__ = ("stream", "back", "ctx")

    def __init__(self, stream, back):
        self.stream, self.back = stream, back
        self.ctx = torch.cuda.stream(stream) if back is None else None

    def __enter__(self):
        if self.ctx is None:
            torch.cuda.set_stream(self.stream)
        else:
            self.ctx.__enter__()

    def __exit__(self, *exc):
        if self.ctx is None:
            torch.cuda.set_stream(self.back)
        else:
            self.ctx.__exit__(*exc)


class _Slot:
    """One device buffer and what it holds: the ``piece`` whose state is there (None: nothing usable), and the events
    of its last copy in and copy out.

    A slot's events are made once and recorded again for each copy (an event waited for stands for its last record at
    the time of the wait). The copy-out event then stands for later copies out of the slot too, which run after the
    one a wait needs on the same in-order stream: waiting for it is never too early, and in a step of the learned
    order never later than the copy in's wait for its own slot's last copy out (a piece comes back to the same
    slot)."""

    def __init__(self):
        self.buffer: torch.Tensor | None = None
        self.piece: _Piece | None = None
        self.copied_in = None  # the copy in of ``piece`` not yet waited for by a launch: ``in_event``, else None
        self.in_event = None  # CUDA event of the copies in, made on first use
        # CUDA events of the launches and of the copies out, made at the first copy out (waited for by the next copy
        # in, or by a launch of the piece still resident): None before it
        self.launched = self.out_event = None


class StateOffload:
    """The host copies, slots and copy streams of one optimizer with ``state_offload=True``.

    Args:
        optimizer: the :class:`~apexw_hf.optim.ApexW` (its ``state`` holds the host tensors).
        slots: device buffers (>= 2): the piece launched and ``slots - 1`` prefetched.
        piece_bytes: the most bytes of state one launch updates (one work item's state at least); None:
            ``PIECE_BYTES``.
    """

    def __init__(self, optimizer, slots: int | None = None, piece_bytes: int | None = None):
        slots = DEFAULT_SLOTS if slots is None else slots
        if slots < 2:
            raise ValueError(f"state offload needs at least 2 slots, got {slots}")
        self.optimizer = optimizer
        self.slots = [_Slot() for _ in range(slots)]
        self.piece_bytes = PIECE_BYTES if piece_bytes is None else piece_bytes
        self.device: torch.device | None = None
        self._h2d = self._d2h = None  # side streams (CUDA)
        self._raw: _DriverCopies | None = None  # (CUDA) the stagers' copies, on the streams' handles
        # the stream the launches run on, looked up once per launch plan by its stager (a lookup is several
        # microseconds of host time, and a piece made several), None outside a stager
        self._compute = None
        self._order: list[tuple[_Piece, dict]] = []  # the last finished step's pieces and their groups, in order
        self._now: list[tuple[_Piece, dict]] = []  # this step's so far
        self._launched: set[_Piece] = set()  # this step's pieces (by identity)
        self._cuts: dict[tuple, tuple[object, list[_Piece]]] = {}  # (launch key, plan index) -> (plan, its pieces)
        self._cuts_version = 0  # changes whenever a cut is added or the cuts are forgotten (_Piece.overlapping)
        self._barrier = None  # an event the next copy in waits for (a replaced cut's copies out; see _cut)
        self._blocks: list[torch.Tensor] = []  # the host memory the state tensors are views of (uint8)
        self._filling: int | None = None  # the block new state is taken from, and its first free byte
        self._free = 0
        # (id(param), key) -> (block, offset, bytes, address) of a state tensor taken from the blocks
        self._where: dict[tuple[int, str], tuple[int, int, int, int]] = {}
        self._side: dict[str, collections.deque[SideCopy]] = {"in": collections.deque(), "out": collections.deque()}
        self.bytes_in = 0  # bytes copied host -> device since construction
        self.bytes_out = 0  # bytes copied device -> host
        self.hits = 0  # pieces whose state was on the device already (prefetched or resident)
        self.misses = 0  # pieces that had to copy their state in first

    # ---- placement -------------------------------------------------------------------------------------------

    def host_state(self, p: torch.Tensor, group: dict) -> dict:
        """``optimizer.state[p]``, created in (pinned) host memory if it is new: zeros, its tensors taken one after
        the other from the current host block (:data:`ARENA_BYTES`). For an FSDP2 (``DTensor``) parameter the state
        is what it is without offload (``DTensor``s with the parameter's mesh, block scales padded to the largest
        shard's count, ``block_shards``) over local tensors in host memory: this rank's shard."""
        state = self.optimizer.state[p]
        if not state:
            meta = st.init_state(p, group["state_format"], device=torch.device("meta"))
            keys = _tensor_keys(meta)
            local = {k: dt.local(meta[k]) for k in keys}
            need = sum(_align(local[k].numel() * local[k].element_size()) for k in keys)
            try:
                block, start = self._take(need, p.device.type == "cuda")
            except RuntimeError as e:
                raise RuntimeError(
                    f"state_offload=True: could not allocate {need} bytes of pinned host memory for the state of a "
                    f"parameter of shape {tuple(p.shape)} ({e}). Free host memory, use a smaller state_format "
                    "('4bit'), or turn state_offload off."
                ) from e
            state["step"] = meta["step"].new_zeros((), device="cpu")
            off = start
            for k in keys:
                t = self._place(p, k, block, off, local[k])
                state[k] = dt.like(t, meta[k]) if dt.is_dtensor(meta[k]) else t
                off += _align(t.numel() * t.element_size())
            if "block_shards" in meta:
                state["block_shards"] = meta["block_shards"]
        return state

    def load_host(self, p: torch.Tensor, entry: dict) -> dict:
        """A loaded state entry of ``p`` as the offload keeps it: each tensor copied into ``p``'s host state tensor of
        that key where it has one of the same shape and dtype, else into new host memory from the blocks; never the
        loaded state dict's own tensors, which the copies out would then overwrite. ``step`` stays the 0-dim CPU
        tensor it is. A ``DTensor`` entry (FSDP2) is handled by its local tensors and wrapped again like the loaded
        one. Called after :meth:`invalidate` (no copy is in flight)."""
        old = self.optimizer.state.get(p, {})
        out = {}
        for k, v in entry.items():
            if k != "step" and isinstance(v, torch.Tensor):
                src, cur = dt.local(v), old.get(k)
                cur = None if cur is None else dt.local(cur)
                where = self._where.get((id(p), k))
                fits = cur is not None and cur.shape == src.shape and cur.dtype == src.dtype
                if not fits or where is None or where[3] != cur.data_ptr():
                    block, off = self._take(_align(src.numel() * src.element_size()), p.device.type == "cuda")
                    cur = self._place(p, k, block, off, src)
                cur.copy_(src)
                v = dt.like(cur, v) if dt.is_dtensor(v) else cur
            out[k] = v
        return out

    def _take(self, nbytes: int, pin: bool) -> tuple[int, int]:
        """``nbytes`` of zeroed host memory: (block index, offset), from the block being filled or a new one of
        ``ARENA_BYTES``, or of the next power of two above ``nbytes`` (what the pinned allocator takes anyway), whose
        rest the next parameters fill."""
        cur = self._filling
        if cur is not None and self._free + nbytes <= self._blocks[cur].numel():
            start, self._free = self._free, self._free + nbytes
            return cur, start
        size = max(ARENA_BYTES, 1 << (nbytes - 1).bit_length())
        self._blocks.append(torch.zeros(size, dtype=torch.uint8, pin_memory=pin))
        self._filling, self._free = len(self._blocks) - 1, nbytes
        return self._filling, 0

    def _place(self, p: torch.Tensor, key: str, block: int, off: int, like: torch.Tensor) -> torch.Tensor:
        """``p``'s host state tensor ``key``: shaped and typed like ``like``, over ``block`` from ``off``, with a
        storage of its own (``torch.save`` of a state dict writes its bytes, not the whole block's); where it lies is
        kept in ``_where`` (what :meth:`_copies` joins into one copy)."""
        nbytes = like.numel() * like.element_size()
        t = torch.from_numpy(self._blocks[block].numpy()[off : off + nbytes]).view(like.dtype).view(like.shape)
        self._where[(id(p), key)] = (block, off, nbytes, t.data_ptr())
        return t

    def _bind(self, device: torch.device) -> None:
        if self.device is not None:
            if device != self.device:
                raise ValueError(
                    f"state_offload=True streams the state of parameters on one device; got {device} after "
                    f"{self.device}. Put the trained parameters on one GPU, or turn state_offload off."
                )
            return
        self.device = device
        if device.type == "cuda":
            self._h2d = torch.cuda.Stream(device)
            self._d2h = torch.cuda.Stream(device)
            self._raw = _DriverCopies()
            # (not at exit: the process's memory goes with it)
            weakref.finalize(self, _drain, [self._h2d, self._d2h]).atexit = False

    # ---- one launch ------------------------------------------------------------------------------------------

    def stager(self, group: dict, key: tuple):
        """What the Triton engine's ``step_group(stager=...)`` calls for each launch plan of launch ``key`` (the ids
        of its params) of ``group``: ``stage(plan, params, index)`` yields ``(programs, state table)`` per piece, the
        state of that piece staged on the device for a launch on the current stream; when the engine asks for the next
        piece, the last one's launch is queued and its slot is copied back."""

        def stage(plan, params: list[torch.Tensor], index: int):
            self._bind(params[0].device)
            self._compute = None
            if self._h2d is not None and torch.cuda.current_device() == self.device.index:
                self._compute = torch.cuda.current_stream(self.device)
            try:
                for piece in self._cut(plan, params, (key, index)):
                    i = self._stage(group, piece)
                    slot = self.slots[i]
                    base = slot.buffer.data_ptr()
                    table = piece.tables.get(i)
                    if table is None or table[0] != base:
                        bases: list[dict[str, int]] = [{} for _ in range(piece.tensors)]
                        for j, _, k, u0, _, b, off in piece.ranges:
                            bases[j][k] = base + off - u0 * b  # unit 0's address: the piece's units land in the slot
                        table = piece.tables[i] = (base, plan.state_table(bases))
                    yield piece.programs, table[1]
                    self._done(slot, piece)
            finally:
                self._compute = None

        return stage

    def _cut(self, plan, params: list[torch.Tensor], key: tuple) -> list[_Piece]:
        """The pieces of ``plan`` (its ``params`` in plan order): consecutive work items, each piece's state at most
        ``piece_bytes`` (at least one work item), cut again only when the plan is another one."""
        cached = self._cuts.get(key)
        if cached is not None and cached[0] is plan:
            return cached[1]
        if cached is not None and self._d2h is not None and any(q.out_slot is not None for q in cached[1]):
            # its pieces leave the cuts that _overlapping looks through, and their copies out may still run: every
            # copy in from now on waits for the copies out queued so far (once: the copies in run in order)
            self._barrier = torch.cuda.Event()
            self._barrier.record(self._d2h)
        states = [_local_state(self.optimizer.state[p], p) for p in params]
        starts, per_item = plan.chunk_starts, plan.chunk_elements
        pieces, ranges, members, size, first = [], [], [], 0, 0

        def close(end: int) -> None:
            nonlocal ranges, members, size, first
            if end > first:
                pieces.append(_Piece(key, (first, end), ranges, members, len(params)))
            ranges, members, size, first = [], [], 0, end

        for j, (p, s) in enumerate(zip(params, states)):
            n = dt.local(p).numel()
            tensors = [(k, s[k].view(-1)) for k in _tensor_keys(s)]
            unit = {k: (1 if t.numel() == n else st.SCALE_BLOCKS[plan.fmt], t.element_size()) for k, t in tensors}
            item_bytes = sum(-(-per_item // u) * b for u, b in unit.values())
            # a range's bytes beyond its items': one unit more where it ends inside a block, and its alignment
            pad = sum(b + ALIGN for _, b in unit.values())
            c, c1 = int(starts[j]), int(starts[j + 1])
            while c < c1:
                take = min(c1 - c, max((self.piece_bytes - size - pad) // item_bytes, 0))
                if take == 0:
                    if c > first:
                        close(c)
                        continue
                    take = 1  # one work item is the least a launch covers
                e0, e1 = (c - int(starts[j])) * per_item, min((c + take - int(starts[j])) * per_item, n)
                for k, _ in tensors:
                    u, b = unit[k]
                    u0, u1 = e0 // u, -(-e1 // u)
                    ranges.append((j, p, k, u0, u1, b, size))
                    size += _align((u1 - u0) * b)
                members.append(p)
                c += take
                if c < c1:  # a tensor is one range per piece: its state's addresses are one base per launch
                    close(c)
        close(int(starts[-1]))
        self._cuts[key] = (plan, pieces)
        self._cuts_version += 1
        return pieces

    def _stage(self, group: dict, piece: _Piece) -> int:
        """Make the state of ``piece`` ready on the device for a launch on the current stream; its slot's index."""
        self._now.append((piece, group))
        self._launched.add(piece)
        index = next((i for i, s in enumerate(self.slots) if s.piece is piece), None)
        if index is None:
            self.misses += 1
            index = (len(self._now) - 1) % len(self.slots)
            self._copy_in(index, group, piece)
        else:
            self.hits += 1
        slot = self.slots[index]
        self._drop_overlaps(index, piece)
        if slot.copied_in is not None:  # (the copy in itself waited for the slot's last copy out)
            self._current().wait_event(slot.copied_in)
        elif slot.out_event is not None:  # resident: the launch must not write while its last copy out reads
            self._current().wait_event(slot.out_event)
        return index

    def _current(self):
        """The stream the launches run on: the one the running stager looked up, else the current stream."""
        return self._compute if self._compute is not None else torch.cuda.current_stream(self.device)

    def _done(self, slot: _Slot, piece: _Piece) -> None:
        """After the launch that updated ``slot``: copy it back to the host copies (on the copy-out stream, once the
        launch is done), and prefetch the next pieces."""
        index = self.slots.index(slot)
        pairs, raw = self._copies(index, piece)
        if self._d2h is None:
            for dst, src in pairs:
                dst.copy_(src)
        else:
            if slot.launched is None:
                slot.launched, slot.out_event = torch.cuda.Event(), torch.cuda.Event()
            slot.launched.record(self._current())
            self._d2h.wait_event(slot.launched)
            self._move(self._d2h, pairs, raw, to_host=True)
            slot.out_event.record(self._d2h)
            self._pump("out", SIDE_RATIO["out"] * piece.size)
            piece.out_slot = index
        slot.copied_in = None  # the slot holds the updated state: it stays valid until overwritten
        self.bytes_out += piece.size
        self._prefetch(len(self._now))

    def end_step(self) -> None:
        """The step is over: its pieces become the order to expect, and the first pieces of the next step are
        prefetched."""
        if self._now:
            self._order, self._now = self._now, []
        self._launched = set()
        self.finish_side()
        self._prefetch(0)

    # ---- copies ----------------------------------------------------------------------------------------------

    def _prefetch(self, start: int) -> None:
        """Copy in the pieces at positions ``start .. start + slots - 2`` of the expected order (those of the last
        step), each into slot ``position % slots``, unless it is on the device already."""
        if not self._order or self.device is None:
            return
        for pos in range(start, min(start + len(self.slots) - 1, len(self._order))):
            piece, group = self._order[pos]
            if piece in self._launched:
                continue  # launched already in this step (the order changed): nothing to prefetch
            if any(s.piece is piece for s in self.slots):
                continue
            self._copy_in(pos % len(self.slots), group, piece)

    def _copy_in(self, index: int, group: dict, piece: _Piece) -> None:
        """Copy the host state of ``piece`` into slot ``index`` (growing it if needed), after the slot's last copy
        out and the last copy out of the same elements' state."""
        slot = self.slots[index]
        if not piece.placed:
            for p in piece.params:
                self.host_state(p, group)
            piece.placed = True
        fresh = slot.buffer is None or slot.buffer.numel() < piece.size
        if fresh:
            # the pieces' cached copies into this slot view its old buffer: dropped, so that buffer is freed
            for _, pieces in self._cuts.values():
                for other in pieces:
                    other.copies.pop(index, None)
            grown = max([piece.size] + [s.buffer.numel() for s in self.slots if s.buffer is not None])
            slot.buffer = torch.empty(grown, dtype=torch.uint8, device=self.device)
            if self._h2d is not None:  # used on the side streams: freed only after their work queued by then
                slot.buffer.record_stream(self._h2d)
                slot.buffer.record_stream(self._d2h)
        pairs, raw = self._copies(index, piece)
        slot.piece = piece
        if self._h2d is None:
            for h, d in pairs:
                d.copy_(h)
        else:
            if fresh:  # the allocator gave memory that is free in the compute stream's order, not yet in ours
                self._h2d.wait_stream(self._current())
            if slot.out_event is not None:
                self._h2d.wait_event(slot.out_event)
            if self._barrier is not None:
                self._h2d.wait_event(self._barrier)
                self._barrier = None
            for ready in self._ready_events(piece, slot.out_event):
                self._h2d.wait_event(ready)
            self._move(self._h2d, pairs, raw, to_host=False)
            if slot.in_event is None:
                slot.in_event = torch.cuda.Event()
            slot.in_event.record(self._h2d)
            slot.copied_in = slot.in_event
            self._pump("in", SIDE_RATIO["in"] * piece.size)
        self.bytes_in += piece.size

    def _move(self, stream, pairs: list, raw: _RawCopies | None, to_host: bool) -> None:
        """Queue the copies of ``pairs`` ((host, slot) views; ``raw`` their addresses and bytes) on ``stream``, to
        the host or from it: through the driver (:class:`_DriverCopies`) inside a stager on the offload's device,
        else with ``Tensor.copy_`` with ``stream`` current."""
        if raw is not None and self._raw is not None and self._compute is not None:
            self._raw(raw, to_host, stream.cuda_stream)
            return
        with _On(stream, self._compute):
            for h, d in pairs:
                if to_host:
                    h.copy_(d, non_blocking=True)
                else:
                    d.copy_(h, non_blocking=True)

    def _copies(self, index: int, piece: _Piece) -> tuple[
        list[tuple[torch.Tensor, torch.Tensor]], _RawCopies | None
    ]:
        """The (host, slot) byte views that move ``piece``'s state between the host and slot ``index``, and their
        driver copies (host address, slot address, bytes) where every view is of the host blocks (else None), made
        once per piece and slot. Ranges that follow each other in a host block as in the slot (one tensor's range to
        its end, the next from its start at the next multiple of ALIGN in the block, as far from the first in the slot)
        are one copy: the bytes between them are padding on both sides."""
        slot = self.slots[index]
        base = slot.buffer.data_ptr()
        cached = piece.copies.get(index)
        if cached is not None and cached[0] == base:
            return cached[1], cached[2]
        host = {id(p): _local_state(self.optimizer.state[p], p) for p in piece.params}
        spans: list[list] = []  # [block or None, host start, host end, slot start, slot end, ends its tensor, view]
        for _, p, k, u0, u1, b, off in piece.ranges:
            t = host[id(p)][k]
            where = self._where.get((id(p), k))
            n = (u1 - u0) * b
            if where is None or where[3] != t.data_ptr():  # not taken from the blocks (a loaded state dict's)
                spans.append([None, 0, 0, off, off + n, False, t.view(-1)[u0:u1].view(torch.uint8)])
                continue
            blk, t0, tn, _ = where
            h0 = t0 + u0 * b
            last = spans[-1] if spans else None
            if (last is not None and last[0] == blk and last[5] and u0 == 0 and h0 == _align(last[2])
                    and h0 - last[2] == off - last[4]):
                last[2], last[4], last[5] = h0 + n, off + n, u0 * b + n == tn
            else:
                spans.append([blk, h0, h0 + n, off, off + n, u0 * b + n == tn, None])
        pairs = [
            (view if blk is None else self._blocks[blk][h0:h1], slot.buffer[s0:s1])
            for blk, h0, h1, s0, s1, _, view in spans
        ]
        raw = None
        if all(blk is not None for blk, *_ in spans):
            raw = _RawCopies([(h.data_ptr(), d.data_ptr(), d.numel()) for h, d in pairs])
        piece.copies[index] = (base, pairs, raw)
        return pairs, raw

    def _ready_events(self, piece: _Piece, waited=None) -> list:
        """The events after the last copies out of host state that ``piece`` reads (each once, ``waited`` left out):
        the copy-out events of the slots that the pieces overlapping it were last copied out of."""
        events = []
        for other in self._overlapping(piece):
            if other.out_slot is not None:
                e = self.slots[other.out_slot].out_event
                if e is not waited and all(e is not x for x in events):
                    events.append(e)
        return events

    def _overlapping(self, piece: _Piece) -> list[_Piece]:
        """``piece`` and the pieces of the other cuts whose state ranges overlap its own (computed again after a cut
        is added): what a copy in of ``piece`` must find on the host."""
        cached = piece.overlapping
        if cached is not None and cached[0] == self._cuts_version:
            return cached[1]
        found = [piece] + [other for _, pieces in self._cuts.values() for other in pieces if _overlap(piece, other)]
        piece.overlapping = (self._cuts_version, found)
        return found

    def _drop_overlaps(self, index: int, piece: _Piece) -> None:
        """Forget every other slot's copy of state that ``piece`` updates: the launch about to run makes it stale."""
        for i, s in enumerate(self.slots):
            if i != index and s.piece is not None and _overlap(piece, s.piece):
                s.piece = None

    # ---- copies beside the state's ------------------------------------------------------------------------------

    def streams_on(self, device: torch.device) -> bool:
        """Whether :meth:`side_copy` can queue copies for ``device``: the offload streams the state of that device and
        has its copy streams (it has run a launch)."""
        return self.device == device and self._h2d is not None

    def side_copy(self, direction: str, dst: torch.Tensor, src: torch.Tensor, wait=()) -> SideCopy:
        """Queue ``dst.copy_(src)`` (``direction`` "in": host -> device, "out": device -> host; both contiguous, of
        the same bytes) on the copy stream of that direction, in chunks beside the state's copies (``SIDE_*``). The
        copy follows the work queued on the current stream so far (the device tensor's producer or allocation) and
        the events of ``wait``; :meth:`finish` issues what is left, and ``.done`` is recorded after the last chunk."""
        stream = self._h2d if direction == "in" else self._d2h
        dev = dst if direction == "in" else src
        after = torch.cuda.Event()
        after.record(self._current())
        d, s = dst.reshape(-1).view(torch.uint8), src.reshape(-1).view(torch.uint8)
        if d.numel() != s.numel():
            raise ValueError(f"side_copy: {d.numel()} bytes into {s.numel()}")
        n = SIDE_CHUNK_BYTES
        job = SideCopy(direction, [(d[i : i + n], s[i : i + n]) for i in range(0, d.numel(), n)], [after, *wait])
        dev.record_stream(stream)  # its memory is reused only once the stream has passed the copy's last chunk
        self._side[direction].append(job)
        self._pump(direction, SIDE_FIRST_BYTES[direction])
        return job

    def finish(self, job: SideCopy) -> None:
        """Issue every chunk of ``job`` not issued yet (and of the side copies queued before it)."""
        while not job.issued:
            self._pump(job.direction, float("inf"), until=job)

    def finish_side(self) -> None:
        """Issue every side copy's chunks not issued yet."""
        for direction in self._side:
            self._pump(direction, float("inf"))

    def _pump(self, direction: str, nbytes: float, until: SideCopy | None = None, current=None) -> None:
        """Issue the queued side copies' chunks of ``direction``, in order, until ``nbytes`` are issued (at least
        one chunk if any is queued) or ``until`` is. ``current``: the current stream where the caller knows it."""
        queue = self._side[direction]
        if not queue:
            return
        stream = self._h2d if direction == "in" else self._d2h
        if current is stream:
            self._issue(queue, stream, nbytes, until)
        else:
            with _On(stream, self._compute):
                self._issue(queue, stream, nbytes, until)

    @staticmethod
    def _issue(queue: collections.deque, stream, nbytes: float, until: SideCopy | None) -> None:
        """:meth:`_pump`'s copies, with ``stream`` current."""
        while queue and nbytes > 0:
            job = queue[0]
            for event in job.after:
                stream.wait_event(event)
            job.after = []
            dst, src = job.chunks.popleft()
            dst.copy_(src, non_blocking=True)
            nbytes -= dst.numel()
            if job.chunks:
                continue
            job.done.record(stream)
            queue.popleft()
            if job is until:
                return

    # ---- outside the step ------------------------------------------------------------------------------------

    def sync(self) -> None:
        """Wait until every copy out has reached the host state (before anything reads or replaces it)."""
        if self._d2h is not None:
            self._d2h.synchronize()

    def invalidate(self) -> None:
        """Forget what the slots hold, the learned order and the cuts (the host state was replaced:
        ``load_state_dict``)."""
        self.finish_side()
        self.sync()
        for s in self.slots:
            s.piece, s.copied_in = None, None
        self._order, self._now, self._launched = [], [], set()
        self._cuts.clear()
        self._cuts_version += 1

    def abandon_step(self) -> None:
        """A backward pass that did not reach ``step()``: its launches so far are not an order to learn."""
        self.finish_side()
        self._now, self._launched = [], set()

    def device_bytes(self) -> int:
        """Bytes of the device buffers."""
        return sum(s.buffer.numel() for s in self.slots if s.buffer is not None)
