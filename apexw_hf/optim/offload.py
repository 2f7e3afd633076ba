"""State offload: the optimizer state lives in host memory and streams through the update kernel.

With ``ApexW(..., state_offload=True)`` every tensor of ``optimizer.state`` (moments, scales) is a host tensor, in
pinned memory when CUDA is there; that is what ``state_dict``, ``dequantized_state`` and the export to torch AdamW
read. Each launch of the Triton engine (a gradient-release bucket, or a chunk of a param group in ``step()``) updates
a copy of its tensors' state in one of a few device buffers ("slots"):

1. *stage*: the bucket's state is copied host -> device into a slot on a side stream (or found there already: it was
   prefetched, or is still resident from the last step), and the compute stream waits for that copy only;
2. the bucket's usual launch updates the slot in place (the plan takes the slot's addresses:
   ``LaunchPlan.set_state_ptrs``);
3. the slot is copied device -> host on a second side stream once the launch is done, while backward goes on.

Buckets come in the same order every step (gradient release cuts the same buckets from the second step on, and
``step()`` cuts the same chunks), so the offload learns the order of the last step and, after each launch, copies in
the state of the next ``slots - 1`` buckets of that order. A bucket that is not the one expected (the first step, a
parameter without a gradient, a changed grouping) is copied in when it is launched: the same bits, later. The device
holds ``slots`` buffers of the largest bucket's state; the host copy of a bucket's state is never older than its
last update once :meth:`StateOffload.sync` has returned (``state_dict`` and the readers above call it).

Slot ``i`` of step position ``k`` is ``k % slots``: a prefetch never overwrites the bucket being launched, and with
three slots the copy in of bucket ``k + 1`` and the copy out of bucket ``k - 1`` use different buffers and run at
once (the link carries both directions). Copies are queued after the events they depend on (the launch that last
wrote a slot, the copy out that last wrote a bucket's host state): nothing waits on the host.

On the CPU (the Triton interpreter runs the kernels on CPU tensors) the same logic runs with plain copies, which is
how the tests check it.
"""

from __future__ import annotations

import torch

from . import state as st

DEFAULT_SLOTS = 3
ALIGN = 256  # bytes: every staged tensor starts at a multiple (16 is what the kernel's vector loads need)
STEP_CHUNK = 2**26  # elements per launch of step() under offload (a param larger than that is one launch alone)


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _tensor_keys(state: dict) -> list[str]:
    return [k for k in st.STATE_KEYS if k in state]


def to_host(state: dict) -> dict:
    """A parameter's state entry with its tensors copied into new host memory (pinned where CUDA is there), as the
    offload keeps them: never the loaded state dict's own tensors, which the copies out would then overwrite.
    ``step`` stays the 0-dim CPU tensor it is."""
    pin = torch.cuda.is_available()
    out = {}
    for k, v in state.items():
        if k != "step" and isinstance(v, torch.Tensor):
            host = torch.empty(v.shape, dtype=v.dtype, device="cpu", pin_memory=pin)
            v = host.copy_(v)
        out[k] = v
    return out


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


class _Slot:
    """One device buffer and what it holds: the bucket ``key`` whose state is there (None: nothing usable), each
    parameter's views into it, and the events of its last copy in and copy out."""

    def __init__(self):
        self.buffer: torch.Tensor | None = None
        self.key: tuple | None = None
        self.views: dict[int, dict[str, torch.Tensor]] = {}
        self.copied_in = None  # event: the copy in of ``key`` (waited for by the launch)
        self.copied_out = None  # event: the last copy out of this slot (waited for by the next copy in)


class StateOffload:
    """The host copies, slots and copy streams of one optimizer with ``state_offload=True``.

    Args:
        optimizer: the :class:`~apexw_hf.optim.ApexW` (its ``state`` holds the host tensors).
        slots: device buffers (>= 2): the bucket launched and ``slots - 1`` prefetched.
    """

    def __init__(self, optimizer, slots: int = DEFAULT_SLOTS):
        self.optimizer = optimizer
        self.slots = [_Slot() for _ in range(slots)]
        self.device: torch.device | None = None
        self._h2d = self._d2h = None  # side streams (CUDA)
        self._order: list[tuple[tuple, list]] = []  # the last finished step's buckets: (key, params), in order
        self._now: list[tuple[tuple, list]] = []  # this step's so far
        self._host_ready: dict[int, object] = {}  # id(param) -> event after its state's last copy out (CUDA)
        self.bytes_in = 0  # bytes copied host -> device since construction
        self.bytes_out = 0  # bytes copied device -> host
        self.hits = 0  # launches whose state was on the device already (prefetched or resident)
        self.misses = 0  # launches that had to copy their state in first

    # ---- placement -------------------------------------------------------------------------------------------

    def host_state(self, p: torch.Tensor, group: dict) -> dict:
        """``optimizer.state[p]``, created in (pinned) host memory if it is new."""
        state = self.optimizer.state[p]
        if not state:
            pin = p.device.type == "cuda"
            fmt = group["state_format"]
            try:
                state.update(st.init_state(p, fmt, device=torch.device("cpu"), pin_memory=pin))
            except RuntimeError as e:
                nbytes = st.state_tensor_bytes(st.init_state(p, fmt, device=torch.device("meta")))
                raise RuntimeError(
                    f"state_offload=True: could not allocate {nbytes} bytes of pinned host memory for the state of a "
                    f"parameter of shape {tuple(p.shape)} ({e}). Free host memory, use a smaller state_format "
                    "('4bit'), or turn state_offload off."
                ) from e
        return state

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

    # ---- one launch ------------------------------------------------------------------------------------------

    def stage(self, group: dict, params: list[torch.Tensor], key: tuple) -> tuple[int, dict[int, dict]]:
        """Make the state of bucket ``key`` (``params`` of ``group``) ready on the device for a launch on the current
        stream: ``(slot index, id(param) -> staged state dict)``. Each staged dict holds the slot's views and the
        host dict's ``"step"``."""
        self._bind(params[0].device)
        pos = len(self._now)
        self._now.append((key, params))
        index = next((i for i, s in enumerate(self.slots) if s.key == key), None)
        if index is None:
            self.misses += 1
            index = pos % len(self.slots)
            self._copy_in(index, group, key, params)
        else:
            self.hits += 1
        slot = self.slots[index]
        self._drop_overlaps(index, key)
        if slot.copied_in is not None:  # (the copy in itself waited for the slot's last copy out)
            torch.cuda.current_stream(self.device).wait_event(slot.copied_in)
        elif slot.copied_out is not None:  # resident: the launch must not write while its last copy out reads
            torch.cuda.current_stream(self.device).wait_event(slot.copied_out)
        host = self.optimizer.state
        staged = {id(p): {"step": host[p]["step"], **slot.views[id(p)]} for p in params}
        return index, staged

    def done(self, index: int, params: list[torch.Tensor], staged: dict[int, dict]) -> None:
        """After the launch that updated slot ``index``: copy it back to the host copies (on the copy-out stream, once
        the launch is done), take over the step counters the engine set, and prefetch the next buckets."""
        slot = self.slots[index]
        host = self.optimizer.state
        pairs = []
        for p in params:
            s, h = staged[id(p)], host[p]
            h["step"] = s["step"]
            pairs += [(h[k], s[k]) for k in slot.views[id(p)]]
        nbytes = sum(d.numel() * d.element_size() for d, _ in pairs)
        if self._d2h is None:
            for dst, src in pairs:
                dst.copy_(src)
        else:
            launched = torch.cuda.Event()
            launched.record(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._d2h):
                self._d2h.wait_event(launched)
                for dst, src in pairs:
                    dst.copy_(src, non_blocking=True)
                out = slot.copied_out = torch.cuda.Event()
                out.record(self._d2h)
            for p in params:
                self._host_ready[id(p)] = out
        slot.copied_in = None  # the slot holds the updated state: it stays valid until overwritten
        self.bytes_out += nbytes
        self._prefetch(len(self._now))

    def end_step(self) -> None:
        """The step is over: its buckets become the order to expect, and the first buckets of the next step are
        prefetched."""
        if self._now:
            self._order, self._now = self._now, []
        self._prefetch(0)

    # ---- copies ----------------------------------------------------------------------------------------------

    def _prefetch(self, start: int) -> None:
        """Copy in the buckets at positions ``start .. start + slots - 2`` of the expected order (those of the last
        step), each into slot ``position % slots``, unless it is on the device already."""
        if not self._order or self.device is None:
            return
        for pos in range(start, min(start + len(self.slots) - 1, len(self._order))):
            key, params = self._order[pos]
            if any(s.key == key for s in self.slots):
                continue
            if any(key == k for k, _ in self._now):
                continue  # launched already in this step (the order changed): nothing to prefetch
            group = self.optimizer.param_groups[self.optimizer._group_slot(params[0])[0]]
            self._copy_in(pos % len(self.slots), group, key, params)

    def _copy_in(self, index: int, group: dict, key: tuple, params: list[torch.Tensor]) -> None:
        """Copy the host state of ``params`` into slot ``index`` (growing it if needed), after the slot's last copy
        out and the bucket's own last copy out."""
        slot = self.slots[index]
        states = [self.host_state(p, group) for p in params]
        layout, size = [], 0
        for p, s in zip(params, states):
            for k in _tensor_keys(s):
                t = s[k]
                layout.append((id(p), k, t, size))
                size = _align(size + t.numel() * t.element_size())
        fresh = slot.buffer is None or slot.buffer.numel() < size
        if fresh:
            grown = max([size] + [s.buffer.numel() for s in self.slots if s.buffer is not None])
            slot.buffer = torch.empty(grown, dtype=torch.uint8, device=self.device)
            if self._h2d is not None:  # used on the side streams: freed only after their work queued by then
                slot.buffer.record_stream(self._h2d)
                slot.buffer.record_stream(self._d2h)
        views: dict[int, dict[str, torch.Tensor]] = {}
        dst, src = [], []
        for pid, k, t, off in layout:
            nbytes = t.numel() * t.element_size()
            view = slot.buffer[off : off + nbytes].view(t.dtype).view(t.shape)
            views.setdefault(pid, {})[k] = view
            dst.append(view)
            src.append(t)
        slot.key, slot.views = key, views
        if self._h2d is None:
            for d, s in zip(dst, src):
                d.copy_(s)
        else:
            compute = torch.cuda.current_stream(self.device)
            with torch.cuda.stream(self._h2d):
                if fresh:  # the allocator gave memory that is free in the compute stream's order, not yet in ours
                    self._h2d.wait_stream(compute)
                if slot.copied_out is not None:
                    self._h2d.wait_event(slot.copied_out)
                # the parameters' last copies out (a parameter may have been in another bucket then)
                for ready in {id(e): e for e in map(self._host_ready.get, key) if e is not None}.values():
                    self._h2d.wait_event(ready)
                for d, s in zip(dst, src):
                    d.copy_(s, non_blocking=True)
                slot.copied_in = slot.copied_in or torch.cuda.Event()
                slot.copied_in.record(self._h2d)
        self.bytes_in += sum(t.numel() * t.element_size() for t in src)

    def _drop_overlaps(self, index: int, key: tuple) -> None:
        """Forget every other slot's copy of a parameter of ``key``: the launch about to run makes it stale."""
        ids = set(key)
        for i, s in enumerate(self.slots):
            if i != index and s.key is not None and not ids.isdisjoint(s.key):
                s.key, s.views = None, {}

    # ---- outside the step ------------------------------------------------------------------------------------

    def sync(self) -> None:
        """Wait until every copy out has reached the host state (before anything reads or replaces it)."""
        if self._d2h is not None:
            self._d2h.synchronize()

    def invalidate(self) -> None:
        """Forget what the slots hold and the learned order (the host state was replaced: ``load_state_dict``)."""
        self.sync()
        for s in self.slots:
            s.key, s.views, s.copied_in = None, {}, None
        self._order, self._now = [], []
        self._host_ready.clear()

    def abandon_step(self) -> None:
        """A backward pass that did not reach ``step()``: its launches so far are not an order to learn."""
        self._now = []

    def device_bytes(self) -> int:
        """Bytes of the device buffers."""
        return sum(s.buffer.numel() for s in self.slots if s.buffer is not None)
