"""CUDA streams and events stood in for on the CPU, to check the order that a GPU would run copies and launches in.

On the CPU every copy of the state offload runs when it is issued, so its tests see the bits of a correct program
whatever events it records and waits for. :func:`record_streams` replaces ``torch.cuda.Stream``, ``Event``,
``stream``, ``set_stream``, ``current_stream``, ``current_device`` and ``record_stream`` with stand-ins that still copy
at once, but also record each operation on its stream with what it must follow (the operation before it on that
stream, and every event or stream waited for since); :meth:`Recorder.hazards` then lists every two operations on
overlapping memory, one of them writing, that the recorded waits leave unordered: on a GPU these could run the other
way round from how they were issued (and computed, on the CPU).

What is recorded: copies issued with ``non_blocking=True`` (the side streams' copies), and operations a test adds with
:meth:`Recorder.op` (a launch that updates a device buffer, say). Memory is byte ranges of CPU storage.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field

import torch


def byte_range(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``t`` spans (all of them, for a strided view)."""
    if t.numel() == 0:
        return (t.data_ptr(), t.data_ptr())
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return (t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size())


@dataclass
class Op:
    name: str
    stream: str
    after: set  # indices of the operations it follows directly
    reads: list  # byte ranges
    writes: list


class FakeStream:
    def __init__(self, name: str):
        self.name = name
        self.last: int | None = None  # the last operation queued on it
        self.waits: set = set()  # what its next operation follows besides ``last``

    def wait_event(self, event: FakeEvent) -> None:
        if event.op is not None:
            self.waits.add(event.op)

    def wait_stream(self, other: FakeStream) -> None:
        self.waits |= other.waits
        if other.last is not None:
            self.waits.add(other.last)

    def synchronize(self) -> None:
        pass  # the host waits: on the CPU everything has run already


class FakeEvent:
    def __init__(self, recorder: Recorder):
        self.recorder = recorder
        self.op: int | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        self.op = self.recorder.op(stream or self.recorder.current, "event")


@dataclass
class Recorder:
    ops: list = field(default_factory=list)
    kept: list = field(default_factory=list)

    def __post_init__(self):
        self.compute = FakeStream("compute")
        self.current = self.compute

    def op(self, stream: FakeStream, name: str, reads=(), writes=(), keep=()) -> int:
        """Queue an operation on ``stream`` that reads and writes the byte ranges given; its index. ``keep``: the
        tensors it touches, kept alive to the end so that no later tensor takes their memory (an allocator that
        reuses memory only after the streams are done with it, as CUDA's does with ``record_stream``, is not
        modelled)."""
        self.kept.extend(keep)
        after = set(stream.waits)
        if stream.last is not None:
            after.add(stream.last)
        stream.waits = set()
        self.ops.append(Op(name, stream.name, after, list(reads), list(writes)))
        stream.last = len(self.ops) - 1
        return stream.last

    def hazards(self) -> list[tuple[Op, Op]]:
        """Every (earlier, later) pair of operations, in the order they were issued, that touch overlapping bytes, one
        of them writing, where the later does not follow the earlier through the recorded order."""
        before = []  # bit i of before[j]: operation i runs before operation j starts
        for o in self.ops:
            mask = 0
            for i in o.after:
                mask |= before[i] | (1 << i)
            before.append(mask)
        touched = [(j, o) for j, o in enumerate(self.ops) if o.reads or o.writes]
        found = []
        for x, (i, a) in enumerate(touched):
            for j, b in touched[x + 1 :]:
                if before[j] >> i & 1:
                    continue
                if _meet(a.writes, b.reads + b.writes) or _meet(a.reads, b.writes):
                    found.append((a, b))
        return found

    def count(self, name: str) -> int:
        return sum(o.name == name for o in self.ops)


def _meet(xs, ys) -> bool:
    return any(a0 < b1 and b0 < a1 for a0, a1 in xs for b0, b1 in ys)


@contextlib.contextmanager
def record_streams(monkeypatch):
    """Stand-ins for CUDA's streams and events (module docstring) while the block runs; yields the
    :class:`Recorder`."""
    rec = Recorder()
    copy = torch.Tensor.copy_

    def copy_(self, src, non_blocking=False):
        if non_blocking:
            rec.op(rec.current, "copy", reads=[byte_range(src)], writes=[byte_range(self)], keep=(self, src))
        return copy(self, src)

    @contextlib.contextmanager
    def on(stream):
        outer, rec.current = rec.current, stream
        try:
            yield
        finally:
            rec.current = outer

    sides = itertools.count()
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None, **kw: FakeStream(f"side{next(sides)}"))
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **kw: FakeEvent(rec))
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: rec.current)
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: setattr(rec, "current", stream))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: None)  # the index of the CPU device the tests run on
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    yield rec
