"""Launch table of the AdamW kernel: static per-tensor metadata built once, a few small copies per step.

:class:`LaunchPlan` holds, on the parameters' device, everything about a set of tensors that does not change from
step to step (addresses of parameters and states, sizes, per-tensor random keys, each tensor's first program). Per
step only the gradient addresses are refreshed (and only when they moved), and, when tensors of the set are at
different step counts, their per-tensor bias corrections. Both go through pinned host memory with non-blocking
copies: no host-device synchronization.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import triton

from .... import formats
from ...._random import mix32, tensor_key, to_int32
from . import adamw
from ._rounding import INTERPRETED
from .adamw import NUM_ADDR_ROWS, WORK_GROUP, _adamw_kernel

ADDR_PARAM, ADDR_GRAD, ADDR_M, ADDR_V, ADDR_M_SCALE, ADDR_V_SCALE = (
    adamw.ADDR_PARAM.value,
    adamw.ADDR_GRAD.value,
    adamw.ADDR_M.value,
    adamw.ADDR_V.value,
    adamw.ADDR_M_SCALE.value,
    adamw.ADDR_V_SCALE.value,
)

QBLOCK = 256  # a program's chunk is a multiple of this many elements (the 8-bit block)
BLOCK_OF = {fmt: formats.SCALE_BLOCKS[fmt] for fmt in ("8bit", "4bit")}  # elements per block scale (stepped formats)

# The kernel's parameters after its 23 runtime arguments, in signature order: LaunchPlan.launch passes them
# positionally to the compiled kernel, so the order is checked here once.
_CONSTEXPR_NAMES = (
    "FMT",
    "P_DTYPE",
    "G_DTYPE",
    "MAXIMIZE",
    "STOCHASTIC_PARAM",
    "PER_TENSOR_STEP",
    "ALIGNED",
    "EVEN",
    "ROWS",
    "GRAD_SCALE",
    "SKIP_NONFINITE",
)
if tuple(_adamw_kernel.arg_names[23:]) != _CONSTEXPR_NAMES:
    raise RuntimeError(f"_adamw_kernel's parameters changed: {_adamw_kernel.arg_names}; update LaunchPlan.launch")

_TL_DTYPES = {
    torch.float32: triton.language.float32,
    torch.bfloat16: triton.language.bfloat16,
    torch.float16: triton.language.float16,
}

# (rows of 256 elements per program, warps) by state format and parameter element size in bytes, the winners of
# benchmarks/bench_step.py --tune on 4 x 8192^2 (the timings are in the results ledger, docs/performance.md). Every
# winner has 8 elements per thread. One warp per 256-element block (a block's absmax is then a warp reduction without
# shared memory) is fastest, or within 1%, for fp32 parameters and for 8-bit state, and larger tiles or 16 elements
# per thread are slower. Compact state with 16-bit parameters moves the fewest bytes per element and runs about 2%
# faster with four warps per program: at most 32 programs are resident per SM, so one-warp programs cap an SM at 32
# warps in flight. 4-bit takes 8-bit's tile (1 x 256 elements, one warp: two 128-element blocks of half a warp
# each); no other tile was faster for it on the LoRA set or on 4 x 8192^2.
LAUNCH_CONFIG = {
    "fp32": {4: (1, 1), 2: (1, 1)},
    "compact": {4: (1, 1), 2: (4, 4)},
    "8bit": {4: (1, 1), 2: (1, 1)},
    "4bit": {4: (1, 1), 2: (1, 1)},
}

MAXNREG_RANGE = range(24, 256)  # register caps ptxas accepts per thread (LaunchPlan's maxnreg)

# Register cap per thread (ptxas .maxnreg) of the default tile, by (format, parameter dtype, stochastic parameter
# rounding (False for fp32 parameters), whole 256-element rows, per-tensor steps): LaunchPlan's maxnreg="auto". The
# one-warp 1 x 256 tile is limited by registers: an SM holds at most 32 resident programs, and its 65,536 registers
# give 32 one-warp programs only at <= 64 registers per thread (28 at 72, 25 at 80). 4-bit state with bf16 parameters
# rounded stochastically takes 78 registers uncapped (sm_90), with fp32 parameters about 72. Capped at 72 (16 bytes of
# spill) the bf16 kernel runs 1.5-3.5% faster than at 64 (32 bytes) and 3% faster than uncapped on 4 x 8192^2 and
# Llama-3.2-1B shapes (one H100, interleaved rounds; 68 lies between); the fp32 kernel at 64 (32 bytes of spill) runs
# 4% faster than uncapped and 1.3-1.6% faster than at 72. The release clip's variant (grad_scale) spills the same.
# 8-bit state with bf16 parameters rounded stochastically takes 70 registers with the non-finite check: capped at 64
# it needs 62 and no spill, and steps 3-7% faster on 4 x 8192^2 and on Llama-3.2-1B shapes (one H100, the same
# process); with fp32 parameters a cap of 64 spills and is 2% slower.
# A cap changes register allocation only, never a result (tests/kernels/test_adamw_kernel.py checks the bits with
# caps).
MAX_REGISTERS = {
    ("4bit", torch.bfloat16, True, True, False): 72,
    ("4bit", torch.float32, False, True, False): 64,
    ("8bit", torch.bfloat16, True, True, False): 64,
    ("8bit", torch.bfloat16, True, True, True): 64,
}

# The state tensors' dtypes of the formats the kernel steps (version-1 state is converted on load, never stepped).
_STATE_DTYPES = {fmt: formats.state_dtypes(fmt) for fmt in ("fp32", "compact", "8bit", "4bit")}


# The address table's state rows (ADDR_M, ADDR_V, ADDR_M_SCALE, ADDR_V_SCALE) of each state tensor, by format: 4-bit
# keeps both moments' codes in one tensor (ADDR_V unused).
STATE_ROW = {
    "fp32": {"exp_avg": 0, "exp_avg_sq": 1},
    "compact": {"exp_avg": 0, "exp_avg_sq": 1},
    "8bit": {"exp_avg": 0, "exp_avg_sq": 1, "exp_avg_scale": 2, "exp_avg_sq_scale": 3},
    "4bit": {"exp_avg_mv": 0, "exp_avg_scale": 2, "exp_avg_sq_scale": 3},
}


def device_guard(device: torch.device):
    """A context in which Triton launches on ``device``: Triton launches on the current CUDA device, so a tensor on
    another GPU (a model moved to ``cuda:1`` without ``torch.cuda.set_device``) needs a device guard; none is entered
    on the current device, under the interpreter, or for a device without an index."""
    index = device.index
    if INTERPRETED or index is None or index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(index)


def _copy_from_host_(dst: torch.Tensor, values) -> None:
    """Copy host values into ``dst`` without waiting for the device."""
    if dst.device.type == "cpu":
        dst.copy_(torch.as_tensor(values, dtype=dst.dtype).view(dst.shape))
        return
    # The caching host allocator keeps a pinned block until the copy that reads it has completed.
    staged = torch.as_tensor(values, dtype=dst.dtype).view(dst.shape).pin_memory()
    dst.copy_(staged, non_blocking=True)


def _state_addresses(fmt: str, numel: int, s: dict, device: torch.device) -> tuple[int, int, int, int]:
    """Addresses of the state tensors ``s`` of a parameter of ``numel`` elements, for the address table's rows
    ``ADDR_M``, ``ADDR_V``, ``ADDR_M_SCALE``, ``ADDR_V_SCALE`` (0 where the format has none), after checking each
    tensor's dtype, size, layout and device."""
    block = BLOCK_OF.get(fmt, QBLOCK)
    for key, dtype in _STATE_DTYPES[fmt].items():
        x = s.get(key)
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"state '{key}' is missing for format {fmt!r}; got keys {sorted(s)}")
        want = (numel + block - 1) // block if key.endswith("_scale") else numel
        if x.dtype != dtype or x.numel() != want or not x.is_contiguous() or x.device != device:
            raise ValueError(
                f"state '{key}' must be a contiguous {dtype} tensor of {want} elements on {device} for "
                f"format {fmt!r}; got {x.dtype}, {x.numel()} elements, on {x.device}"
            )
    if fmt == "4bit":
        m, v = s["exp_avg_mv"].data_ptr(), 0  # ADDR_V stays 0
    else:
        m, v = s["exp_avg"].data_ptr(), s["exp_avg_sq"].data_ptr()
    if fmt in BLOCK_OF:
        return m, v, s["exp_avg_scale"].data_ptr(), s["exp_avg_sq_scale"].data_ptr()
    return m, v, 0, 0


class StateTable:
    """A device table of state addresses (int64 [4, tensors]: rows ADDR_M .. ADDR_V_SCALE) for
    :meth:`LaunchPlan.launch`, and whether its moment rows are 16-byte aligned."""

    __slots__ = ("table", "aligned")

    def __init__(self, table: torch.Tensor, aligned: bool):
        self.table, self.aligned = table, aligned


class LaunchPlan:
    """Static launch metadata for tensors that share a device, a state format, a param dtype and a grad dtype.

    Args:
        params: the parameters (contiguous, same dtype and device).
        states: their state dicts (format ``fmt``, see :mod:`apexw_hf.formats`), or None: every launch then takes
            a :meth:`state_table` (state offload streams each launch's state through a device buffer).
        fmt: state format.
        tensor_indices: each parameter's index in the optimizer's global order (selects its random streams).
        seed: the optimizer's seed.
        grad_dtype: dtype of the gradients this plan is launched with.
        rows, num_warps: tile height (rows of 256 elements: one 8-bit block or two 4-bit blocks each) and warps
            per program; default by format.
        maxnreg: a cap on registers per thread for ptxas: ``"auto"`` (default) the measured caps of
            :data:`MAX_REGISTERS` for the default tile, ``None`` the compiler's choice, or an int in 24..255 (for
            timing register-limited kernels). Register allocation only: the bits are the
            same with any cap.
    """

    def __init__(
        self, params, states, fmt, tensor_indices, seed, grad_dtype, rows=None, num_warps=None, maxnreg="auto"
    ):
        if not params:
            raise ValueError("a launch plan needs at least one tensor")
        self.fmt = fmt
        self.device = params[0].device
        self.param_dtype = params[0].dtype
        self.grad_dtype = grad_dtype
        cfg_rows, cfg_warps = LAUNCH_CONFIG[fmt][params[0].element_size()]
        self.rows = rows or cfg_rows
        self.num_warps = num_warps or cfg_warps
        if not (maxnreg is None or maxnreg == "auto" or (type(maxnreg) is int and maxnreg in MAXNREG_RANGE)):
            raise ValueError(
                f"maxnreg must be 'auto', None or an int in 24..255 (registers per thread), got {maxnreg!r}"
            )
        self.maxnreg = maxnreg
        self._auto_caps = maxnreg == "auto" and (self.rows, self.num_warps) == (cfg_rows, cfg_warps)
        chunk = self.rows * QBLOCK
        n = len(params)
        self.num_tensors = n
        addr = [[0] * n for _ in range(NUM_ADDR_ROWS)]
        numel, tkey, nchunks = [], [], []
        params_aligned = states_aligned = True
        for i, (p, s) in enumerate(zip(params, states or [None] * len(params))):
            if p.dtype != self.param_dtype or p.device != self.device:
                raise ValueError("all tensors of a launch plan must share dtype and device")
            if not p.is_contiguous():
                raise ValueError(f"the Triton engine needs contiguous parameters; got strides {p.stride()}")
            addr[ADDR_PARAM][i] = p.data_ptr()
            if states is not None:
                m, v, addr[ADDR_M_SCALE][i], addr[ADDR_V_SCALE][i] = _state_addresses(fmt, p.numel(), s, self.device)
                addr[ADDR_M][i], addr[ADDR_V][i] = m, v
            else:
                m = v = 0
            params_aligned &= addr[ADDR_PARAM][i] % 16 == 0
            states_aligned &= m % 16 == 0 and v % 16 == 0
            numel.append(p.numel())
            tkey.append(to_int32(tensor_key(seed, tensor_indices[i])))
            nchunks.append((p.numel() + chunk - 1) // chunk)
        cstart = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(nchunks, out=cstart[1:])
        total = int(cstart[-1])
        if total >= 2**31 - WORK_GROUP.value:
            raise ValueError("too many chunks for one launch")
        # the tensor of program k * WORK_GROUP (the last program's for k past the end): where each search starts
        firsts = np.minimum(np.arange(0, total // WORK_GROUP.value + 2) * WORK_GROUP.value, max(total - 1, 0))
        gfirst = np.searchsorted(cstart[1:], firsts, side="right")
        self._params_aligned = params_aligned
        self.static_aligned = params_aligned and states_aligned
        self.even = all(k % QBLOCK == 0 for k in numel)  # whole 256-element rows of the kernel's tile: row masks
        self.grads_aligned = False
        dev = self.device
        self.addr = torch.tensor(addr, dtype=torch.int64).to(dev)
        self.numel = torch.tensor(numel, dtype=torch.int64).to(dev)
        self.tkey = torch.tensor(tkey, dtype=torch.int32).to(dev)
        # each tensor's index in the optimizer: its non-finite counter (LaunchPlan.launch's nonfinite)
        self.tidx = torch.tensor(list(tensor_indices), dtype=torch.int32).to(dev)
        self._own_counts: torch.Tensor | None = None  # counters of launches given none (adamw_step_, tests, tools)
        self.cstart = torch.from_numpy(cstart.astype(np.int32)).to(dev)
        self.gfirst = torch.from_numpy(np.minimum(gfirst, n - 1).astype(np.int32)).to(dev)
        self.num_work = total
        self.chunk_starts = cstart  # host copy: the first program of each tensor, then the total
        self.chunk_elements = chunk
        self.tstep = torch.zeros(3, n, dtype=torch.int32, device=dev)
        self._grad_ptrs: list[int] | None = None
        self._compiled: dict = {}  # specialization -> Triton's compiled kernel (see launch)
        self.sumsq_parts: torch.Tensor | None = None  # gradient release's partial sums of squares (release_norm)

    def set_grad_ptrs(self, ptrs: list[int]) -> None:
        """Gradient addresses in plan order, 0 for a tensor that does not step now. Copied only when they changed."""
        if ptrs == self._grad_ptrs:
            return
        self._grad_ptrs = ptrs
        table = np.array(ptrs, dtype=np.int64)
        self.grads_aligned = not (table & 15).any()
        _copy_from_host_(self.addr[ADDR_GRAD], torch.from_numpy(table))

    def state_table(self, bases) -> StateTable:
        """A state address table of this plan's tensors for :meth:`launch` (``state_table=``), from one dict per tensor
        (plan order) of state key -> the address of its element 0 (block 0 for a scale). A launch over a range of
        work items (``programs``) dereferences only that range's elements, so state offload stages a range in a
        device buffer and passes addresses shifted to match; a tensor whose dict is empty gets address 0 (a launch
        must not reach it). One copy to the device, when the table is made: a caller keeps the tables it reuses."""
        if len(bases) != self.num_tensors:
            raise ValueError(f"state_table: {len(bases)} entries for a plan of {self.num_tensors} tensors")
        rows = STATE_ROW[self.fmt]
        table = np.zeros((4, self.num_tensors), dtype=np.int64)
        for i, b in enumerate(bases):
            for key, address in b.items():
                table[rows[key], i] = address
        device = torch.empty((4, self.num_tensors), dtype=torch.int64, device=self.device)
        _copy_from_host_(device, torch.from_numpy(table))
        return StateTable(device, not (table[:2] & 15).any())

    def set_tensor_steps(self, steps, step_sizes, inv_bc2_sqrts) -> None:
        """Per-tensor step counts (int32) and fp32 bias-correction scalars (numpy arrays), for unequal steps."""
        packed = np.stack(
            [
                np.asarray(steps, dtype=np.int32),
                np.asarray(step_sizes, dtype=np.float32).view(np.int32),
                np.asarray(inv_bc2_sqrts, dtype=np.float32).view(np.int32),
            ]
        )
        _copy_from_host_(self.tstep, torch.from_numpy(packed))

    def launch(
        self,
        *,
        step,
        scalars,
        maximize,
        stochastic_param,
        per_tensor_step=False,
        grad_scale=None,
        nonfinite=None,
        programs=None,
        state_table=None,
        check_nonfinite=True,
    ) -> None:
        """One launch over all tensors, or over the work items (chunks of ``rows * 256`` elements, numbered through
        the tensors in plan order: :attr:`chunk_starts`) ``programs = (first, end)``; the same bits either way.
        ``state_table``: a :meth:`state_table` to take the state addresses from instead of the plan's own.
        ``scalars`` is a :class:`apexw_hf.reference.StepScalars`; with
        ``per_tensor_step`` its ``step_size`` and ``inv_bc2_sqrt`` (and ``step``) come from
        :meth:`set_tensor_steps`. ``grad_scale``: an fp32 tensor of one element on the plan's device; the kernel
        then multiplies each gradient by it first, exactly as ``g.mul_(grad_scale.to(g.dtype))`` would (gradient
        release's clip, without a pass of its own over the gradients). ``nonfinite``: ``(counts, serial)``, the
        optimizer's int32 counters on the plan's device (``2 +`` its tensor count elements,
        :mod:`apexw_hf.optim.nonfinite`) and its step number: a block of 256 elements whose gradient is not finite
        is not written (``reference.nonfinite_blocks``) and is counted there; None counts into a buffer of the plan's
        own (:meth:`own_counts`). ``check_nonfinite=False`` leaves that check out of the kernel (the update is then
        not the reference's on non-finite gradients, and nothing is counted): only for timing what the check costs.

        The first launch of each specialization goes through Triton's JIT, which compiles (or finds) the kernel; later
        ones call that compiled kernel directly. The JIT's per-call work (binding and specializing ~30 arguments,
        hashing the specialization, looking it up) would otherwise be paid every step, and this plan already knows
        everything the specialization depends on: its flags below, its own metadata tensors (fixed addresses, so
        fixed alignment), and its device. The integer arguments are excluded from specialization
        (``do_not_specialize``) and floats are never specialized.

        Triton launches on the current CUDA device; a plan on another GPU (a model moved to ``cuda:1`` without
        ``torch.cuda.set_device``) is launched under a device guard, on that device's current stream. So every launch
        of a plan happens on the plan's device, and its compiled kernels are those of that device.
        """
        first, end = (0, self.num_work) if programs is None else programs
        if not 0 <= first <= end <= self.num_work:
            raise ValueError(f"programs must be a range within 0..{self.num_work}, got {programs}")
        if end == first:
            return
        with device_guard(self.device):
            self._launch(
                step, scalars, maximize, stochastic_param, per_tensor_step, grad_scale, nonfinite, first, end,
                state_table, check_nonfinite,
            )

    def own_counts(self) -> torch.Tensor:
        """The non-finite counters of launches given none (the layout of :mod:`apexw_hf.optim.nonfinite`)."""
        if self._own_counts is None:
            size = 3 + int(self.tidx.max()) if self.num_tensors else 2
            self._own_counts = torch.zeros(size, dtype=torch.int32, device=self.device)
        return self._own_counts

    def _cap(self, constexprs: tuple) -> int | None:
        """The register cap of this specialization (``constexprs`` as :meth:`_launch` builds them)."""
        if not self._auto_caps:
            return None if self.maxnreg == "auto" else self.maxnreg
        stochastic, per_tensor_step, even = constexprs[4], constexprs[5], constexprs[7]
        stochastic = stochastic and self.param_dtype != torch.float32  # fp32 parameters are never rounded
        return MAX_REGISTERS.get((self.fmt, self.param_dtype, stochastic, even, per_tensor_step))

    def _launch(
        self, step, scalars, maximize, stochastic_param, per_tensor_step, grad_scale, nonfinite, first, end,
        state_table, check_nonfinite,
    ) -> None:
        s = scalars
        counts, serial = (self.own_counts(), 1) if nonfinite is None else nonfinite
        if state_table is None:
            states, aligned = self.addr[ADDR_M:], self.static_aligned
        else:
            states, aligned = state_table.table, self._params_aligned and state_table.aligned
        args = (
            self.cstart,
            self.gfirst,
            self.addr,
            states,
            self.numel,
            self.tkey,
            self.tstep,
            self.num_work,
            self.num_tensors,
            first,
            to_int32(mix32(int(step) & 0x7FFFFFFF)),
            s.step_size,
            s.inv_bc2_sqrt,
            s.beta1,
            s.beta2,
            s.one_minus_beta1,
            s.one_minus_beta2,
            s.decay,
            s.eps,
            self.tstep if grad_scale is None else grad_scale,  # any pointer where unused
            counts,
            self.tidx,
            int(serial) & 0x7FFFFFFF,
        )
        constexprs = (
            self.fmt,
            _TL_DTYPES[self.param_dtype],
            _TL_DTYPES[self.grad_dtype],
            bool(maximize),
            bool(stochastic_param),
            bool(per_tensor_step),
            aligned and self.grads_aligned,
            self.even,
            self.rows,
            grad_scale is not None,
            bool(check_nonfinite),
        )
        compiled = self._compiled.get(constexprs)
        if compiled is not None:
            compiled[(end - first, 1, 1)](*args, *constexprs)
            return
        compiled = _adamw_kernel[(end - first,)](
            *args,
            **dict(zip(_CONSTEXPR_NAMES, constexprs)),
            num_warps=self.num_warps,
            enable_fp_fusion=False,
            maxnreg=self._cap(constexprs),
        )
        if not INTERPRETED:  # the interpreter has no compiled kernel; every launch goes through it
            self._compiled[constexprs] = compiled


def adamw_step_(
    params,
    grads,
    states,
    *,
    fmt,
    scalars,
    seed,
    tensor_indices,
    step,
    maximize=False,
    param_rounding="stochastic",
    rows=None,
    num_warps=None,
    maxnreg="auto",
    grad_scale=None,
    nonfinite=None,
) -> None:
    """Uncached one-launch AdamW step of ``params`` (same dtype) with ``grads`` (same dtype), all at step ``step``.

    The same contract as :func:`apexw_hf.reference.adamw_step_ref_` applied to each tensor; for tests and tools.
    ``grad_scale``, ``nonfinite``: see :meth:`LaunchPlan.launch`.
    """
    plan = LaunchPlan(
        params, states, fmt, tensor_indices, seed, grads[0].dtype, rows=rows, num_warps=num_warps, maxnreg=maxnreg
    )
    for g, p in zip(grads, params):
        if g.dtype != plan.grad_dtype or g.shape != p.shape or not g.is_contiguous():
            raise ValueError("gradients must be contiguous, shaped like their parameters, and of one dtype")
    plan.set_grad_ptrs([g.data_ptr() for g in grads])
    plan.launch(
        step=step,
        scalars=scalars,
        maximize=maximize,
        stochastic_param=param_rounding == "stochastic",
        grad_scale=grad_scale,
        nonfinite=nonfinite,
    )
