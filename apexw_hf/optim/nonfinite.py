"""What ApexW does with non-finite gradients: it skips them, counts them, warns once it sees them, or raises.

Every engine leaves a block of 256 elements whose gradient holds a NaN or an infinity (or a value whose square
overflows fp32: any block whose new ``v`` is not finite) un-updated: parameter, moments and block scales keep their
values (``reference.nonfinite_blocks``, which says why blocks and why ``v``). The engines count
what they skip on the parameters' device, into one int32 tensor per device:

* ``[0]``: the number of the last optimizer step that skipped a block (the Triton kernel swaps it in atomically, so
  the first program of a step that skips anything also adds 1 to ``[1]``, and no other program or launch does);
* ``[1]``: the steps in which at least one block was skipped;
* ``[2 + i]``: the blocks skipped of the parameter of tensor index ``i`` (its position in the flattened param groups).

Reading a device tensor waits for the device, so nothing here reads them in the step's hot path: with
``nonfinite="skip"`` (the default) the counts of CUDA tensors travel to pinned host memory through a non-blocking copy
every :data:`POLL_EVERY` steps and are read once that copy has completed (an event query, no wait); counts on the CPU
are read at every step. A warning then names the first parameter (in param-group order) with newly skipped blocks.
The Trainer callback reads the counts when it logs (:meth:`NonfiniteGuard.report`, which synchronizes, as logging
the loss does). With ``nonfinite="raise"`` every step ends by reading them (one synchronization per step, the price
of stopping at the step itself) and raises ``FloatingPointError`` naming the parameter; the skipped blocks were not
updated either way.

Counts are since the optimizer was built (not saved with its state) and per process: under FSDP2 each rank counts
the blocks of its own shards (a NaN loss reaches every rank's gradients, so every rank counts that step).
"""

from __future__ import annotations

import warnings

import torch

NONFINITE_MODES = ("skip", "raise")
POLL_EVERY = 16  # steps between the non-blocking copies of CUDA counters (each costs a few microseconds of host time)


class NonfiniteGuard:
    """The non-finite counters of one optimizer (see the module docstring)."""

    def __init__(self, optimizer, mode: str):
        if mode not in NONFINITE_MODES:
            raise ValueError(f"unknown nonfinite {mode!r}; allowed: {', '.join(map(repr, NONFINITE_MODES))}")
        self.mode = mode
        self._opt = optimizer
        self.serial = 1  # the number of the step in progress (its kernels swap it into counts[0])
        self._counts: dict[torch.device, torch.Tensor] = {}
        self._seen: dict[torch.device, list[int]] = {}  # the counts at the last report, per device
        self._pending: dict[torch.device, tuple] = {}  # device -> (event, pinned copy) of a non-blocking read
        self._since_poll = 0
        self.names = None  # a function returning id(param) -> name (set_parameter_names), for warnings and errors

    # ---- what the engines use --------------------------------------------------------------------------------

    def counts(self, device: torch.device) -> torch.Tensor:
        """The counters on ``device`` (created, or grown to the optimizer's parameter count, on first need)."""
        need = 2 + sum(len(g["params"]) for g in self._opt.param_groups)
        t = self._counts.get(device)
        if t is None or t.numel() < need:
            grown = torch.zeros(need, dtype=torch.int32, device=device)
            if t is not None:
                grown[: t.numel()] = t
            self._counts[device] = t = grown
            self._pending.pop(device, None)
        return t

    def add(self, device: torch.device, skipped: dict[int, int]) -> None:
        """Count blocks skipped outside the kernel (the PyTorch engine): ``skipped`` maps tensor indices to blocks.
        The step is counted once, as the kernel counts it; on a CUDA device without reading the counters."""
        skipped = {i: n for i, n in skipped.items() if n}
        if not skipped:
            return
        t = self.counts(device)
        idx = torch.tensor([2 + i for i in skipped], dtype=torch.int64, device=device)
        t.index_add_(0, idx, torch.tensor(list(skipped.values()), dtype=torch.int32, device=device))
        serial = self.serial & 0x7FFFFFFF
        t[1] += (t[0] != serial).to(torch.int32)
        t[0] = serial

    # ---- the step boundary -----------------------------------------------------------------------------------

    def end_step(self) -> None:
        """End of ``optimizer.step()``: the next step gets the next number; with ``"raise"`` the counts are read and a
        step that skipped anything raises, with ``"skip"`` they are polled (see the module docstring)."""
        self.serial += 1
        if not self._counts:
            return
        if self.mode == "raise":
            first, new_steps, new_blocks = self._news(self._read())
            if new_steps:
                raise FloatingPointError(
                    f"ApexW(nonfinite='raise'): a non-finite gradient (NaN or inf) in {self._name(first, self.names)} "
                    f"at step "
                    f"{self.serial - 1}: {new_blocks} block(s) of 256 elements were not updated, so nothing "
                    "non-finite reached the weights or the optimizer state. Find what made the gradient non-finite "
                    "(the batch, the loss, the learning rate), or pass nonfinite='skip' (the default) to skip such "
                    "blocks and go on."
                )
            return
        self._poll()

    def _poll(self) -> None:
        self._since_poll += 1
        due = self._since_poll >= POLL_EVERY
        if due:
            self._since_poll = 0
        ready = {}
        for device, t in self._counts.items():
            if device.type != "cuda":  # host memory: read now, the whole table only when the step count moved
                seen = self._seen.get(device)
                if seen is None or int(t[1]) != seen[1]:
                    ready[device] = t.tolist()
                continue
            pending = self._pending.get(device)
            if pending is not None:
                if pending[0].query():
                    ready[device] = pending[1].tolist()
                    del self._pending[device]
            elif due:
                pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                pinned.copy_(t, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                self._pending[device] = (event, pinned)
        if ready:
            self._warn(*self._news(ready))

    # ---- reading -----------------------------------------------------------------------------------------------

    def _read(self) -> dict[torch.device, list[int]]:
        """Every device's counts (waits for each device)."""
        return {device: t.tolist() for device, t in self._counts.items()}

    def _news(self, read: dict[torch.device, list[int]]) -> tuple[int | None, int, int]:
        """``(first tensor index with new skipped blocks, new steps, new blocks)`` since the last call, which these
        counts become."""
        first, steps, blocks = None, 0, 0
        for device, now in read.items():
            before = self._seen.get(device, [])
            before = before + [0] * (len(now) - len(before))
            steps += now[1] - before[1]
            for i in range(2, len(now)):
                if now[i] != before[i]:
                    blocks += now[i] - before[i]
                    first = i - 2 if first is None else min(first, i - 2)
            self._seen[device] = now
        return first, steps, blocks

    def _warn(self, first: int | None, steps: int, blocks: int, names=None) -> None:
        if not steps and not blocks:
            return
        names = names if names is not None else self.names  # (_name calls it where it is a function)
        warnings.warn(
            f"ApexW: a non-finite gradient (NaN or inf) in {self._name(first, names)}: {blocks} block(s) of 256 "
            f"elements were not updated in {steps} step(s) (parameters, moments and scales keep their values; "
            f"{self.total(read=False)} step(s) with skipped blocks so far). That is the first parameter in "
            "param-group order whose gradient was not finite as the optimizer got it (clipping by a non-finite norm "
            "makes every gradient NaN). One bad batch is skipped this way; if it keeps happening, look at the data, "
            "the loss and the learning rate.",
            RuntimeWarning,
            stacklevel=4,
        )

    def total(self, read: bool = True) -> int:
        """Steps with at least one skipped block since the optimizer was built (summed over devices). ``read``: read
        the counters now (waits for each device); else the counts as last read."""
        if read:
            return sum(t[1] for t in self._read().values())
        return sum(seen[1] for seen in self._seen.values())

    def report(self, names=None) -> int:
        """Read the counters now (waits for each device), warn if blocks were skipped since the last read (naming the
        first parameter, by ``names``: ``id(param) -> name``, e.g. from ``model.named_parameters()``, or a function
        returning that, called only for a warning; else the param groups' ``param_names``), and return
        :meth:`total`."""
        self._pending.clear()
        self._warn(*self._news(self._read()), names=names)
        return self.total(read=False)

    def _name(self, index: int | None, names: dict | None = None) -> str:
        """How a warning names the parameter of tensor index ``index``."""
        if index is None:
            return "a parameter"
        if callable(names):
            names = names()
        k = index
        for gi, group in enumerate(self._opt.param_groups):
            params = group["params"]
            if k < len(params):
                p = params[k]
                name = (names or {}).get(id(p))
                group_names = group.get("param_names")
                if name is None and group_names and k < len(group_names):
                    name = group_names[k]
                where = f"param group {gi}, parameter {k}, shape {tuple(p.shape)}"
                return f"parameter '{name}' ({where})" if name else f"the parameter at {where}"
            k -= len(params)
        return f"the parameter of tensor index {index}"
