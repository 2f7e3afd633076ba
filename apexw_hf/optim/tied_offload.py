"""Tied gradient offload for gradient release: the output layer's share of a tied embedding's gradient waits in host
memory instead of on the GPU.

A model whose input embedding and output layer share one weight (Llama-3.2-1B and -3B) gets that weight's gradient in
two parts: the output layer's at the start of the backward pass, the embedding's at its end. Gradient release updates
the weight once, with their sum, so autograd keeps the first part (vocabulary x hidden in the gradients' dtype: 0.73
GiB for Llama-3.2-3B in bf16) on the GPU through the whole backward pass, and with a checkpointed model that is where
the peak comes: every checkpointed layer input is still alive then, and one layer is recomputed.

With ``tied_grad_offload=True`` the backward node that sends the first part to the weight (found by a short search of
the autograd graph from the loss, before ``backward()``) gets a hook that copies that part into a pinned host buffer on
a side stream and gives autograd no gradient for that input instead, so its GPU memory is free once the copy is done.
Halfway through the backward pass (by the share of the last step's gradient elements released so far) the part is
copied back on the side stream, where the activations freed by then leave room; when the weight's gradient is complete
(the embedding's part, accumulated by autograd) the part is added to it in place. bf16 addition of two numbers is
commutative, so the sum has the bits autograd's own sum of the two parts has, and the update is the same (tested).
If the weight gets no other gradient in a backward pass, the part alone is its gradient: autograd completes the
weight's gradient right after that node (nothing is saved then), or the end of the pass applies it.

With ``state_offload`` as well, both copies go on the state offload's copy streams
(:meth:`~apexw_hf.optim.offload.StateOffload.side_copy`) instead of a stream of their own: the copy out whole (its GPU
memory is freed only when all of it is out), the copy back in chunks beside the state's pieces' copies in. A copy
engine runs one direction's copies in the order they were queued, so the part's copy back queued whole held the
pieces' copies behind it.

Only parameters registered under two names of the model (``named_parameters(remove_duplicate=False)``) are offloaded,
and only contiguous CUDA gradients of plain tensors (not FSDP2's DTensor shards). The search needs the loss and the
model before ``backward()``: Accelerate's ``backward`` (so the Trainer) passes them; a plain loop calls
``optimizer.before_backward(loss, model)``.
"""

from __future__ import annotations

import collections
import dataclasses
import warnings
import weakref

import torch

from .. import dtensor as dt
from .offload import SideCopy

PREFETCH_SHARE = 0.5  # the copy back starts once this share of the last step's gradient elements is released
SEARCH_NODES = 256  # autograd nodes searched from the loss for the first use of a tied weight


def _offloadable(t: torch.Tensor) -> bool:
    """Whether a gradient part (or a parameter's) of this device is offloaded: CUDA only (tests let CPU tensors take
    the same path, with a copy in place of the host buffer)."""
    return t.is_cuda and t.is_contiguous()


def tied_parameters(models) -> list[torch.Tensor]:
    """The parameters registered under more than one name in ``models`` (a module or several): tied weights."""
    if isinstance(models, torch.nn.Module):
        models = [models]
    seen: dict[int, int] = {}
    params: dict[int, torch.Tensor] = {}
    for model in models:
        for _, p in model.named_parameters(remove_duplicate=False):
            seen[id(p)] = seen.get(id(p), 0) + 1
            params[id(p)] = p
    return [params[i] for i, n in seen.items() if n > 1]


@dataclasses.dataclass
class _Part:
    """One offloaded gradient part of this pass."""

    param: torch.Tensor
    host: torch.Tensor  # the pinned host buffer (a CPU copy in tests)
    # recorded after the copy out (None: a CPU copy); a SideCopy where the state offload's streams carry it
    out: object | None
    transposed: bool  # the buffer holds the part's transpose
    dev: torch.Tensor | None = None  # the copy back on the device, once started
    back: object | None = None  # recorded after the copy back, or its SideCopy


class TiedGradOffload:
    """The host buffers, streams and this step's offloaded gradient parts of one :class:`GradientRelease`."""

    def __init__(self, link=None):
        # the optimizer's StateOffload, whose copy streams carry the parts' copies (None: a stream of this offload's)
        self._link = link
        # the models last asked about (weak references) and their tied parameters
        self._tied: tuple[list[weakref.ref], list[torch.Tensor]] = ([], [])
        self._host: dict[int, torch.Tensor] = {}  # id(param) -> its pinned host buffer
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._parts: dict[int, _Part] = {}  # id(param) -> this pass's offloaded part
        self.offloaded = 0  # gradient parts offloaded since construction (a diagnostic)
        self._warned = False  # said once that some tied weight, or none, can be offloaded
        self.prepared = False  # before_backward ran for the coming (or running) backward pass
        self._warned_unprepared = False

    # ---- before backward ---------------------------------------------------------------------------------------

    def _tied_of(self, models) -> list[torch.Tensor]:
        """``tied_parameters(models)``, searched again only for other models than the last call's."""
        models = [models] if isinstance(models, torch.nn.Module) else list(models)
        if not all(isinstance(m, torch.nn.Module) for m in models):
            raise TypeError(
                "before_backward(loss, model): model must be the torch.nn.Module being trained, or a list of them; "
                f"got {[type(m).__name__ for m in models]}"
            )
        refs, tied = self._tied
        if len(refs) != len(models) or any(r() is not m for r, m in zip(refs, models)):
            tied = tied_parameters(models)
            self._tied = ([weakref.ref(m) for m in models], tied)
        return tied

    def prepare(self, loss: torch.Tensor, models, hooked: set[int]) -> int:
        """Hook the first use of each tied parameter of ``models`` (among ``hooked``, the ids of the parameters
        with a release hook) in the graph of ``loss``; the number of uses hooked."""
        tied = [p for p in self._tied_of(models) if id(p) in hooked and p.requires_grad]
        targets = {id(p): p for p in tied if not dt.is_dtensor(p) and _offloadable(p)}
        if not self._warned and len(targets) < len(tied):
            self._warned = True
            warnings.warn(
                f"tied_grad_offload: {len(tied) - len(targets)} of the model's {len(tied)} trainable tied weights are "
                "not plain CUDA tensors (FSDP2 shards, or on the CPU): their gradients stay where autograd keeps them",
                stacklevel=4,
            )
        elif not self._warned and not tied:
            self._warned = True
            warnings.warn(
                "tied_grad_offload: the model has no trainable tied weights (none registered under two names), so "
                "nothing is offloaded; the option only helps models whose embedding and output layer share a weight.",
                stacklevel=4,
            )
        self.prepared = True
        self._parts.clear()  # left by a backward pass that raised
        root = getattr(loss, "grad_fn", None)
        if not targets or root is None:
            return 0
        found: dict[int, tuple] = {}
        queue, seen, searched = collections.deque([root]), {root}, 0
        while queue and len(found) < len(targets) and searched < SEARCH_NODES:
            node = queue.popleft()
            searched += 1
            for i, (nxt, _) in enumerate(node.next_functions):
                if nxt is None:
                    continue
                var = getattr(nxt, "variable", None)  # an AccumulateGrad node: a leaf
                if var is not None:
                    if id(var) in targets and id(var) not in found:
                        found[id(var)] = (node, i)
                    continue
                if nxt not in seen:
                    seen.add(nxt)
                    queue.append(nxt)
        for pid, (node, i) in found.items():
            node.register_hook(self._node_hook(targets[pid], i))
        return len(found)

    def check_prepared(self) -> None:
        """At the first gradient of a backward pass: say once if no ``before_backward`` came before it (a training
        loop that calls ``loss.backward()`` itself, not through Accelerate): nothing is offloaded then."""
        if not self.prepared and not self._warned_unprepared:
            self._warned_unprepared = True
            warnings.warn(
                "tied_grad_offload: a backward pass ran without optimizer.before_backward(loss, model) before it, so "
                "no tied weight's gradient was offloaded. Accelerate's backward (and so the Trainer) calls it; a "
                "training loop that calls loss.backward() itself must call it first.",
                stacklevel=2,
            )

    def _node_hook(self, p: torch.Tensor, i: int):
        ref = weakref.ref(self)

        def hook(grad_inputs, grad_outputs):
            offload = ref()
            g = grad_inputs[i]
            if offload is None or g is None or id(p) in offload._parts:
                return None  # autograd keeps this part, as without offload
            # an output layer's weight.t() hands its part over as the transpose of a contiguous tensor
            transposed = not g.is_contiguous() and g.dim() == 2 and g.t().is_contiguous()
            src = g.t() if transposed else g
            if not _offloadable(src):
                return None
            offload._copy_out(p, src, transposed)
            return tuple(None if j == i else x for j, x in enumerate(grad_inputs))

        return hook

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def _linked(self, device: torch.device) -> bool:
        return self._link is not None and self._link.streams_on(device)

    def _copy_out(self, p: torch.Tensor, g: torch.Tensor, transposed: bool) -> None:
        if not g.is_cuda and not self._linked(g.device):  # CPU gradients, in tests only (see _offloadable): a copy
            self._parts[id(p)] = _Part(p, g.clone(), None, transposed)
            self.offloaded += 1
            return
        buf = self._host.get(id(p))
        if buf is None or buf.shape != g.shape or buf.dtype != g.dtype:
            buf = self._host[id(p)] = torch.empty(g.shape, dtype=g.dtype, pin_memory=g.is_cuda)
        if self._linked(g.device):
            self._parts[id(p)] = _Part(p, buf, self._link.side_copy("out", buf, g), transposed)
            self.offloaded += 1
            return
        stream = self._stream(g.device)
        stream.wait_stream(torch.cuda.current_stream(g.device))
        with torch.cuda.stream(stream):
            buf.copy_(g, non_blocking=True)
            out = torch.cuda.Event()
            out.record(stream)
        g.record_stream(stream)  # its memory is reused only once the copy is done
        self._parts[id(p)] = _Part(p, buf, out, transposed)
        self.offloaded += 1

    # ---- during backward ---------------------------------------------------------------------------------------

    def prefetch(self) -> None:
        """Start copying every offloaded part back to its device (on the side stream), if not started."""
        for part in self._parts.values():
            if part.dev is None:
                self._copy_in(part)

    def _copy_in(self, part: _Part) -> None:
        if part.out is None:  # a CPU copy (tests)
            part.dev = part.host
            return
        device = part.param.device
        dev = torch.empty(part.host.shape, dtype=part.host.dtype, device=device)
        if isinstance(part.out, SideCopy):  # the state offload's streams carried it out
            self._link.finish(part.out)  # every chunk out issued: its done event is recorded
            part.dev, part.back = dev, self._link.side_copy("in", dev, part.host, wait=(part.out.done,))
            return
        stream = self._stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))  # the allocation, on the current stream
        with torch.cuda.stream(stream):
            stream.wait_event(part.out)
            dev.copy_(part.host, non_blocking=True)
            back = torch.cuda.Event()
            back.record(stream)
        dev.record_stream(stream)
        part.dev, part.back = dev, back

    def take(self, p: torch.Tensor) -> torch.Tensor | None:
        """``p``'s offloaded part on its device, ready to use on the current stream (None if none); shaped like
        ``p``, not necessarily contiguous."""
        part = self._parts.pop(id(p), None)
        if part is None:
            return None
        if part.dev is None:
            self._copy_in(part)
        back = part.back
        if isinstance(back, SideCopy):
            self._link.finish(back)
            back = back.done
        if back is not None:
            torch.cuda.current_stream(p.device).wait_event(back)
        return part.dev.t() if part.transposed else part.dev

    def pending(self) -> list[torch.Tensor]:
        """The parameters whose offloaded part is still waiting (their gradient never completed in this pass)."""
        return [part.param for part in self._parts.values()]

    def drop(self) -> None:
        """Forget this pass's parts (a step given up)."""
        if self._link is not None:
            self._link.finish_side()
        self._parts.clear()
