"""``ApexW``: AdamW (decoupled weight decay) with a choice of compact optimizer-state formats."""

from __future__ import annotations

import copy
import operator
import weakref
from collections import defaultdict
from collections.abc import Iterable
from itertools import repeat
from typing import Any

import torch

from .. import dtensor as dt
from .. import engines
from .. import formats as st
from .. import reference as ref
from ..hparams import as_float as _as_float
from .nonfinite import NonfiniteGuard
from .offload import StateOffload, default_layout
from .release import GROUP_STATE_KEY, GradientRelease

_GRAD = operator.attrgetter("grad")


def _is_positive_int(value) -> bool:
    """An int >= 1 (not a bool): what the size arguments take."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


ENGINES = ("auto", "triton", "torch")
PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Group keys of torch.optim.AdamW that mean nothing here; dropped when a torch state dict is loaded.
_TORCH_ONLY_KEYS = ("amsgrad", "foreach", "capturable", "differentiable", "fused", "decoupled_weight_decay")
# What torch.optim.AdamW(params) puts under those keys; to_torch_adamw_state_dict writes them.
_TORCH_ADAMW_FLAGS = dict(
    amsgrad=False, foreach=None, capturable=False, differentiable=False, fused=None, decoupled_weight_decay=True
)


def _interpreted() -> bool:
    """Whether the Triton kernels run under the interpreter (on CPU tensors): imports them, which reads
    ``TRITON_INTERPRET``."""
    try:
        from ..engines.triton.kernels import INTERPRETED
    except ImportError:  # triton is not installed
        return False
    return INTERPRETED


class ApexW(torch.optim.Optimizer):
    r"""AdamW with fp32, compact (bf16), 8-bit or 4-bit optimizer state, and one Triton launch per parameter group.

    The update is that of ``torch.optim.AdamW`` (Loshchilov & Hutter, 2019: decoupled weight decay, bias correction,
    ``eps`` outside the square root). Only the storage of the moments differs (see :mod:`apexw_hf.formats`) and
    bf16/fp16 parameters receive the update with stochastic rounding. The numerics are specified by
    :mod:`apexw_hf.reference`; every engine computes the same bits.

    Args:
        params: parameters or param groups (dicts). A group may override any keyword below except ``seed``. A group
            may span devices (a model dispatched over GPUs): each device's tensors are stepped by their own launch.
        lr: learning rate, a float or a 1-element tensor (read once per step, so a scheduler may change it in place).
        betas: coefficients of the running averages, each in [0, 1).
        eps: added to the denominator, >= 0.
        weight_decay: decoupled weight decay, >= 0.
        state_format: ``"compact"`` (bf16 moments, 4 bytes/param), ``"8bit"`` (block-quantized, about 2.03
            bytes/param), ``"4bit"`` (block-quantized, both moments in one byte, about 1.06 bytes/param) or
            ``"fp32"`` (8 bytes/param, exact).
        maximize: maximize the objective instead of minimizing it.
        amsgrad: not supported; ``True`` raises ``ValueError``.
        seed: seed of the counter-based random streams used for stochastic rounding. The same seed gives
            bit-identical runs; nothing else about the random streams needs saving.
        param_rounding: ``"stochastic"`` (default) or ``"nearest"``: how the fp32 update is rounded into bf16/fp16
            parameters (fp32 parameters are not rounded).
        engine: ``"auto"`` (Triton kernels for CUDA parameters, plain PyTorch otherwise), ``"triton"`` (always the
            kernels; an error if they cannot run) or ``"torch"`` (always the plain-PyTorch engine,
            :mod:`apexw_hf.engines.torch`: a param group in cache-sized chunks, the same bits as the kernels).
        gradient_release: update each parameter inside ``backward()`` as soon as its gradient is complete, and free
            the gradient (:mod:`apexw_hf.optim.release`): a full fine-tune then never holds the whole set of
            gradients. The updates are bit-identical to ``step()``'s for the same gradients; ``step()`` still closes
            each step and must follow every backward pass (no gradient accumulation, no GradScaler, no DDP; FSDP2
            works). Per optimizer, not per param group.
        max_grad_norm: with ``gradient_release``, clip the gradients to this global norm in backward, using an
            estimate of the step's norm from the part released so far and that part's share of the previous step's
            norm (see :mod:`apexw_hf.optim.release`); ``None`` (default) does not clip. Without release clip as usual,
            with ``torch.nn.utils.clip_grad_norm_`` before ``step()``.
        release_bucket_size: with ``gradient_release``, the number of gradient elements that wait for one launch
            (a sharded parameter counts its global size over its shard count, the same on every rank). ``None``
            (default): 2**25 at the start of each backward pass, growing to 4 x 2**25 by its end, where the
            activations freed by then leave room for it (see :mod:`apexw_hf.optim.release`).
        tied_grad_offload: with ``gradient_release``, keep the output layer's part of a tied embedding's gradient
            in pinned host memory until the embedding's part arrives at the end of backward, instead of on the GPU
            (vocabulary x hidden gradient elements less at the peak of a checkpointed model; two copies over PCIe
            per step, on a side stream; see :mod:`apexw_hf.optim.tied_offload`). Needs the loss and the model
            before each ``backward()``: Accelerate and the Trainer pass them, a plain loop calls
            :meth:`before_backward`.
        state_offload: keep every tensor of the optimizer state in host memory (pinned) and stream it through the
            update kernel: each launch (a gradient-release bucket, or a chunk of a param group in ``step()``) copies
            its tensors' state into one of a few device buffers on a side stream, updates it there and copies it
            back while training goes on, prefetching the next launch's state in the order of the last step
            (:mod:`apexw_hf.optim.offload`). The GPU then holds the state of 3-4 launches instead of all of it;
            the results are bit-identical. Needs the Triton engine on one GPU per process (CUDA parameters; CPU
            parameters only under the Triton interpreter) and host memory for the whole state. Under FSDP2 each rank
            keeps the state of its local shards in host memory (the same ``DTensor`` state as without offload, over
            host tensors) and streams it through its GPU.
        offload_piece_mib: with ``state_offload``, the most MiB of state one launch updates; the GPU holds three
            buffers of about that size. None (default): 1/72 of the whole state, between 32 and 64 MiB, in three
            buffers, or four of 64 MiB for a state over 72 x 96 MiB (:func:`apexw_hf.optim.offload.default_layout`).
            Smaller saves GPU memory and hides less of the copies behind backward (docs/gradient_release.md, "State
            offload", has the measured trade-off).
        nonfinite: what a non-finite gradient does. Either way a block of 256 elements whose gradient holds a NaN or an
            infinity (or a value whose square overflows fp32, which would make ``v`` infinite) is not updated (its
            parameter elements, moments and scales keep their values; every other block is updated as usual:
            :func:`apexw_hf.reference.nonfinite_blocks` says why per block) and is counted (:attr:`nonfinite_skipped`).
            ``"skip"`` (default): training goes on, and a warning names the first parameter that had one, at the next
            step on the CPU, within a few steps on a GPU (its counters are read without waiting for the device,
            :mod:`apexw_hf.optim.nonfinite`). ``"raise"``: the step that skipped raises ``FloatingPointError`` naming
            the parameter, after its update (one host-device synchronization per step).

    Example:
        >>> import torch
        >>> from apexw_hf import ApexW
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = ApexW(model.parameters(), lr=1e-3, state_format="8bit")
        >>> model(torch.randn(3, 4)).sum().backward()
        >>> opt.step(); opt.zero_grad()
        >>> opt.state_bytes()  # 10 one-byte codes per moment, 2 bf16 m scales, 2 fp32 v scales, 2 fp32 steps
        40
    """

    def __init__(
        self,
        params: Iterable,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        state_format: str = "compact",
        maximize: bool = False,
        amsgrad: bool = False,
        seed: int = 0,
        param_rounding: str = "stochastic",
        engine: str = "auto",
        gradient_release: bool = False,
        max_grad_norm: float | None = None,
        release_bucket_size: int | None = None,
        tied_grad_offload: bool = False,
        state_offload: bool = False,
        offload_piece_mib: int | None = None,
        nonfinite: str = "skip",
    ):
        if amsgrad:
            raise ValueError("amsgrad=True is not supported by ApexW; use torch.optim.AdamW(amsgrad=True)")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
            raise ValueError(f"seed must be an int in [0, 2**32), got {seed!r}")
        self._check_release_args(gradient_release, max_grad_norm, release_bucket_size, tied_grad_offload)
        self._nonfinite = NonfiniteGuard(self, nonfinite)
        self._param_index: dict[torch.Tensor, int] = {}
        self._group_index: dict[int, tuple[int, int]] = {}
        self._devices_of: dict[int, tuple[list, bool]] = {}  # id(group["params"]) -> (that list, spans devices)
        self._engine = None
        self._cpu_engine = None
        # (id(group), bucket) -> (the state mapping, params, their state dicts, their tensor indices): what the
        # engines are handed, looked up once per parameter list (see _engine_args)
        self._engine_args_of: dict[tuple, tuple] = {}
        self._release: GradientRelease | None = None
        self._offload: StateOffload | None = None
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            state_format=state_format,
            maximize=maximize,
            param_rounding=param_rounding,
            engine=engine,
            seed=seed,
        )
        self._check_hparams(defaults)
        super().__init__(params, defaults)
        if not isinstance(state_offload, bool):
            raise TypeError(f"state_offload must be a bool, got {state_offload!r}")
        if offload_piece_mib is not None and not _is_positive_int(offload_piece_mib):
            raise ValueError(
                f"offload_piece_mib must be an int >= 1 (MiB) or None (the default), got {offload_piece_mib!r}"
            )
        if offload_piece_mib is not None and not state_offload:
            raise ValueError(
                "offload_piece_mib is for state_offload=True (the size of the pieces the state streams through the "
                "GPU in); set state_offload=True or drop it"
            )
        if state_offload:
            needed = self._check_offload()
            if offload_piece_mib is None:
                piece_bytes, slots = default_layout(needed)
                self._offload = StateOffload(self, slots, piece_bytes)
            else:
                self._offload = StateOffload(self, piece_bytes=offload_piece_mib * 2**20)
        if gradient_release:
            self._release = GradientRelease(self, release_bucket_size, max_grad_norm, tied_grad_offload)
            self._release.sync_hooks()
            # torch.amp.GradScaler.step then hands the step to this optimizer (with grad_scale set) instead of
            # unscaling gradients that no longer exist; step() refuses it with a clear error.
            self._step_supports_amp_scaling = True

    # ---- validation ------------------------------------------------------------------------------------------

    @staticmethod
    def _check_release_args(gradient_release, max_grad_norm, bucket_size, tied_grad_offload=False) -> None:
        if not isinstance(gradient_release, bool):
            raise TypeError(f"gradient_release must be a bool, got {gradient_release!r}")
        if not isinstance(tied_grad_offload, bool):
            raise TypeError(f"tied_grad_offload must be a bool, got {tied_grad_offload!r}")
        if tied_grad_offload and not gradient_release:
            raise ValueError(
                "tied_grad_offload=True is for gradient_release=True (without release the tied weight's gradient is "
                "summed on the GPU and kept to step() with all the others); set gradient_release=True or drop it"
            )
        if max_grad_norm is not None:
            norm = _as_float("max_grad_norm", max_grad_norm)
            if not norm > 0.0 or norm == float("inf"):
                raise ValueError(f"invalid max_grad_norm {max_grad_norm!r}: must be a finite float > 0, or None")
            if not gradient_release:
                raise ValueError(
                    "max_grad_norm is for gradient_release=True, where the gradients are gone by step(); without "
                    "release clip as usual with torch.nn.utils.clip_grad_norm_(params, max_norm) before step()"
                )
        if bucket_size is not None and not _is_positive_int(bucket_size):
            raise ValueError(
                f"release_bucket_size must be an int >= 1 (gradient elements) or None (the default, growing limit), "
                f"got {bucket_size!r}"
            )

    def _check_offload(self) -> int:
        """Refuse ``state_offload=True`` where it cannot stream (not the Triton engine, several devices) or where the
        host cannot hold the state, before anything is allocated. Returns the state's bytes (this rank's shards under
        FSDP2)."""
        from .offload import host_bytes_available, local_ranks

        devices = set()
        needed = 0
        sharded = False
        for group in self.param_groups:
            params = group["params"]
            sharded |= any(dt.is_dtensor(p) for p in params)
            if params and not engines.uses_triton(group["engine"], params):
                raise ValueError(
                    f"state_offload=True streams the state through the Triton kernels on a GPU, and a param group of "
                    f"{params[0].device} parameters with engine={group['engine']!r} runs on the plain-PyTorch engine "
                    "(its state is in host memory already when it trains on the CPU). Put the model on a CUDA GPU "
                    "with triton installed, or turn state_offload off."
                )
            off_gpu = sorted({str(p.device) for p in params if p.device.type != "cuda"})
            if off_gpu and not (off_gpu == ["cpu"] and _interpreted()):
                raise ValueError(
                    f"state_offload=True streams the state through the Triton kernels on a GPU, and a param group has "
                    f"parameters on {', '.join(off_gpu)} (FSDP2's CPUOffloadPolicy keeps the shards there), where the "
                    "kernels run only under the Triton interpreter. Put the model on a CUDA GPU (under FSDP2 without "
                    "CPUOffloadPolicy: state_offload keeps the optimizer state in host memory by itself), or turn "
                    "state_offload off."
                )
            devices.update(p.device for p in params)
            meta = torch.device("meta")
            needed += sum(st.state_tensor_bytes(st.init_state(p, group["state_format"], device=meta)) for p in params)
        if len(devices) > 1:
            raise ValueError(
                f"state_offload=True streams the state of parameters on one device; got {sorted(map(str, devices))}. "
                "Put the trained parameters on one GPU, or turn state_offload off."
            )
        available = host_bytes_available()
        # FSDP2: every rank on this host keeps its shards' state in the same host memory, about as much as this one
        ranks = local_ranks() if sharded else 1
        if available is not None and needed * ranks > available:
            total = needed * ranks
            who = "" if ranks == 1 else f" ({ranks} ranks on this host, {needed} bytes of shards' state each)"
            raise ValueError(
                f"state_offload=True needs {total / 2**30:.2f} GiB ({total} bytes) of host memory for the optimizer "
                f"state{who}, and the host has {available / 2**30:.2f} GiB available. Use a smaller state_format "
                "('4bit': about 1.06 bytes per parameter, '8bit' about 2.02), free host memory, shard over more "
                "hosts, or turn state_offload off."
            )
        return needed

    @staticmethod
    def _check_hparams(group: dict) -> None:
        lr = _as_float("lr", group["lr"])
        if not lr >= 0.0:
            raise ValueError(f"invalid learning rate {lr}: must be >= 0")
        eps = _as_float("eps", group["eps"])
        if not eps >= 0.0:
            raise ValueError(f"invalid eps {eps}: must be >= 0")
        wd = _as_float("weight_decay", group["weight_decay"])
        if not wd >= 0.0:
            raise ValueError(f"invalid weight_decay {wd}: must be >= 0")
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        for i, b in enumerate(betas):
            b = _as_float(f"betas[{i}]", b)
            if not 0.0 <= b < 1.0:
                raise ValueError(f"invalid beta{i + 1} {b}: must be in [0, 1)")
        for key, allowed in (
            ("state_format", ref.STATE_FORMATS),
            ("param_rounding", ref.PARAM_ROUNDINGS),
            ("engine", ENGINES),
        ):
            if group[key] not in allowed:
                raise ValueError(f"unknown {key} {group[key]!r}; allowed: {', '.join(map(repr, allowed))}")
        if not isinstance(group["maximize"], bool):
            raise TypeError(f"maximize must be a bool, got {group['maximize']!r}")

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if group["seed"] != self.defaults["seed"]:
            raise ValueError("seed is per optimizer, not per param group")
        self._check_hparams(group)
        for p in group["params"]:
            if p.is_complex():
                raise TypeError(
                    f"ApexW supports real floating-point parameters only, got a {p.dtype} parameter; optimize "
                    "torch.view_as_real(p) instead (AdamW on the real view is torch.optim.AdamW's complex update)"
                )
            if not p.is_floating_point():
                raise TypeError(f"ApexW supports real floating-point parameters only, got a {p.dtype} parameter")
            if p.dtype not in PARAM_DTYPES:
                raise TypeError(f"unsupported parameter dtype {p.dtype}; allowed: float32, bfloat16, float16")
            self._param_index[p] = len(self._param_index)

    # ---- state ---------------------------------------------------------------------------------------------

    def state_bytes(self) -> int:
        """Exact bytes of every tensor held in ``self.state`` (moments, scales, step counters; this rank's shards).

        The same accounting as :func:`apexw_hf.optimizer_state_bytes` applies to any optimizer.
        """
        from ..accounting import optimizer_state_bytes

        return optimizer_state_bytes(self)

    @property
    def state_offload(self) -> bool:
        """Whether the state lives in host memory and streams through device buffers (the ``state_offload``
        argument)."""
        return self._offload is not None

    def staging_bytes(self) -> int:
        """Bytes of the device buffers that ``state_offload`` streams the state through (0 without it).
        :func:`apexw_hf.accounting.optimizer_state_placement` adds them to the state on the device."""
        return 0 if self._offload is None else self._offload.device_bytes()

    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        if self._offload is not None:
            return self._offload.host_state(p, group)
        state = self.state[p]
        if not state:
            state.update(st.init_state(p, group["state_format"]))
        return state

    def dequantized_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """Parameter ``p``'s optimizer state decoded to fp32, for any ``state_format``.

        Args:
            p: a parameter of this optimizer's param groups.

        Returns:
            ``{"step", "exp_avg", "exp_avg_sq"}``: ``step`` a 0-dim fp32 CPU tensor (as in ``torch.optim.AdamW``), the
            moments fp32 tensors shaped like ``p`` on ``p``'s device, decoded with :mod:`apexw_hf.reference` (bf16
            widened exactly; 8-bit and 4-bit codes times their block scales). They are copies: later steps do not
            change them. For an FSDP2 (``DTensor``) parameter the moments are this rank's local shard, plain tensors
            shaped like ``p.to_local()``. A parameter not stepped yet gives zeros and step 0, the state its first step
            starts from.

        Raises:
            TypeError: ``p`` is not a tensor. ValueError: ``p`` is not a parameter of this optimizer.

        Example:
            >>> import torch
            >>> from apexw_hf import ApexW8bit
            >>> p = torch.nn.Parameter(torch.ones(300))
            >>> opt = ApexW8bit([p])
            >>> p.grad = torch.ones(300); opt.step()
            >>> opt.dequantized_state(p)["exp_avg"].dtype
            torch.float32
        """
        self._check_own_param(p, "dequantized_state")
        if self._offload is not None:
            self._offload.sync()
        out = st.dequantized(self.state.get(p, {}), p)
        # offloaded state decodes in host memory: the moments go to the parameter's device, as documented
        return {k: v if k == "step" else v.to(dt.local(p).device) for k, v in out.items()}

    def to_torch_adamw_state_dict(self) -> dict[str, Any]:
        """This optimizer's state as a ``torch.optim.AdamW`` state dict, to leave ApexW mid-training.

        ``torch.optim.AdamW(params, ...).load_state_dict(opt.to_torch_adamw_state_dict())`` over the same parameters,
        in the same groups, continues the run with torch's optimizer. The moments are fp32 (:meth:`dequantized_state`;
        torch casts them to the parameter dtype on load, as for its own checkpoints); the param groups carry torch
        AdamW's keys (lr, betas, eps, weight_decay, maximize, and amsgrad=False, foreach=None, capturable=False,
        differentiable=False, fused=None, decoupled_weight_decay=True: the defaults of a torch AdamW for these
        parameters) and not ApexW's own (state_format, engine, param_rounding, seed). Parameters that were never
        stepped have no entry, as in torch. The way back needs nothing special: :meth:`load_state_dict` converts a
        torch AdamW state dict into each group's format. FSDP2 (``DTensor``) parameters get ``DTensor`` moments with
        the parameter's placements.

        Returns:
            ``{"state": {index: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [...]}``, indices numbered as
            ``state_dict()`` numbers them; new tensors, independent of this optimizer.

        Example:
            >>> import torch
            >>> from apexw_hf import ApexW8bit
            >>> model = torch.nn.Linear(4, 2)
            >>> opt = ApexW8bit(model.parameters(), lr=1e-3)
            >>> model(torch.randn(3, 4)).sum().backward(); opt.step()
            >>> torch_opt = torch.optim.AdamW(model.parameters())
            >>> torch_opt.load_state_dict(opt.to_torch_adamw_state_dict())
            >>> torch_opt.param_groups[0]["lr"]
            0.001
        """
        if self._offload is not None:
            self._offload.sync()
        state, groups, index = {}, [], 0
        for group in self.param_groups:
            ids = list(range(index, index + len(group["params"])))
            index += len(ids)
            out = {key: copy.deepcopy(group[key]) for key in ("lr", "betas", "eps", "weight_decay", "maximize")}
            out.update(_TORCH_ADAMW_FLAGS)
            out["params"] = ids
            if "param_names" in group:
                out["param_names"] = list(group["param_names"])
            groups.append(out)
            for i, p in zip(ids, group["params"]):
                if self.state.get(p):
                    entry = st.dequantized(self.state[p], p)
                    state[i] = dt.wrap_state(entry, p) if dt.is_dtensor(p) else entry
        return {"state": state, "param_groups": groups}

    def _check_own_param(self, p, caller: str) -> None:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{caller} takes a parameter tensor, got {type(p).__name__}")
        if not any(q is p for group in self.param_groups for q in group["params"]):
            raise ValueError(
                f"{caller}: the {type(p).__name__} of shape {tuple(p.shape)} and dtype {p.dtype} is not a parameter "
                "of this optimizer's param groups; pass one of the tensors given to the optimizer"
            )

    # ---- step ----------------------------------------------------------------------------------------------

    def _tensor_index(self, p: torch.Tensor) -> int:
        """``p``'s position in the flattened param groups: selects its random streams.

        Wrappers may replace the parameter objects after construction (Accelerate's FSDP2 preparation swaps each
        parameter for its sharded DTensor in place in ``param_groups``); the index then is rebuilt from the groups,
        positions unchanged, and the replaced tensors are no longer referenced here.
        """
        idx = self._param_index.get(p)
        if idx is None:
            flat = [q for group in self.param_groups for q in group["params"]]
            self._param_index = {q: i for i, q in enumerate(flat)}
            idx = self._param_index.get(p)
            if idx is None:
                raise KeyError("a tensor that is not a parameter of this optimizer's param groups")
        return idx

    def _triton_engine(self):
        return engines.triton_engine(self)

    def _torch_engine(self):
        return engines.torch_engine(self)

    @property
    def engine_stats(self) -> dict[str, dict]:
        """The engines that have stepped this optimizer's parameters so far, by name, with their diagnostics:
        ``"triton"``: ``{"grad_moves": steps whose gradients were at new addresses}`` (host time,
        :mod:`apexw_hf.engines.triton.engine`); ``"torch"``: ``{"numba_used": whether any chunk ran on the fused numba
        loop}``. An engine that never ran is absent. New dicts: reading them changes nothing.

        Example:
            >>> import torch
            >>> from apexw_hf import ApexW
            >>> p = torch.nn.Parameter(torch.ones(3))
            >>> opt = ApexW([p], engine="torch")
            >>> p.grad = torch.ones(3); opt.step()
            >>> sorted(opt.engine_stats)
            ['torch']
        """
        out = {}
        if self._engine is not None:
            out["triton"] = {"grad_moves": self._engine.grad_moves}
        if self._cpu_engine is not None:
            out["torch"] = {"numba_used": bool(self._cpu_engine.numba_used)}
        return out

    @property
    def gradient_release(self) -> bool:
        """Whether parameters are updated inside ``backward()`` (the ``gradient_release`` argument)."""
        return self._release is not None

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """With ``gradient_release``: the global L2 norm of the gradients before clipping, this step's once its
        backward pass has run, else the last step's (a 0-dim fp32 tensor on the parameters' device; reading it does
        not synchronize). ``None`` without release or before the first step."""
        return None if self._release is None else self._release.current_norm()

    def before_backward(self, loss: torch.Tensor, model) -> int:
        """With ``tied_grad_offload``: call before ``loss.backward()`` in a plain training loop (Accelerate's
        ``backward``, and so the Trainer, calls it). Finds where ``loss``'s graph first sends a gradient to a tied
        weight of ``model`` (a module or a list of modules) and hooks it, so that part of the gradient waits in host
        memory. Returns the number of tied weights hooked; does nothing (0) without ``tied_grad_offload``."""
        if self._release is None or self._release.offload is None:
            return 0
        return self._release.prepare_backward(loss, model)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``torch.optim.Optimizer.zero_grad``. With ``gradient_release``, a backward pass that did not reach
        ``step()`` (it raised: out of memory, say) is given up here: its gradients still waiting for a launch are
        dropped, the tensors it updated keep their update, and the next backward pass starts a new step."""
        super().zero_grad(set_to_none=set_to_none)
        if self._release is not None:
            self._release.abandon_step()
        if self._offload is not None:
            self._offload.abandon_step()

    def remove_release_hooks(self) -> None:
        """Remove the gradient-release hooks from the parameters; the optimizer then works as without release."""
        if self._release is not None:
            self._release.finish_step()
            self._release.remove_hooks()
            self._release = None
            self.__dict__.pop("_step_supports_amp_scaling", None)

    def _group_slot(self, p: torch.Tensor) -> tuple[int, int]:
        """``(group index, index in the group's params)`` of ``p``: O(1) per call (gradient release asks it for every
        gradient inside backward), checked against the current ``param_groups`` and rebuilt when they changed."""
        slot = self._group_index.get(id(p))
        if slot is not None:
            gi, pi = slot
            groups = self.param_groups
            if gi < len(groups):
                params = groups[gi]["params"]
                if pi < len(params) and params[pi] is p:
                    return slot
        self._group_index = {
            id(q): (gi, pi) for gi, g in enumerate(self.param_groups) for pi, q in enumerate(g["params"])
        }
        slot = self._group_index.get(id(p))
        if slot is None:
            raise KeyError("a tensor that is not a parameter of this optimizer's param groups")
        return slot

    def _step_params(self, group: dict, params: list, grads: list, bucket: object = None, grad_scale=None) -> None:
        """Step ``params`` of ``group`` with ``grads``, through the engine that ``group`` and the parameters' device
        choose. ``grad_scale``: what :meth:`apexw_hf.engines.Engine.step_group` takes (gradient release's clip); a
        callable is called once, also for a group over several devices (then here, with ``None``, and each device's
        engine gets the tensor it returns)."""
        if self._offload is not None:
            self._step_offloaded(group, params, grads, bucket, grad_scale)
            return
        if not self._spans_devices(group):
            self._run_engine(group, params, grads, bucket, grad_scale)
            return
        # a group over several devices (the Trainer's groups of a model dispatched over GPUs): each device's tensors
        # in their own launch, cached under their own bucket name
        if callable(grad_scale):
            grad_scale = grad_scale(None)
        by_device: dict[torch.device, tuple[list, list]] = {}
        for p, g in zip(params, grads):
            entry = by_device.setdefault(p.device, ([], []))
            entry[0].append(p)
            entry[1].append(g)
        for device, (ps, gs) in by_device.items():
            self._run_engine(group, ps, gs, (bucket, device), grad_scale)

    def _step_offloaded(self, group: dict, params: list, grads: list, bucket: object, grad_scale) -> None:
        """``_step_params`` with ``state_offload``: the launch updates the state staged on the device for it (FSDP2:
        the local shards' state)."""
        key = tuple(map(id, params))  # the offload's name of this launch (a release flush may span two groups)
        stager = self._offload.stager(group, key)
        self._run_engine(group, params, grads, bucket, grad_scale, stager)

    def _run_engine(self, group: dict, params: list, grads: list, bucket: object, grad_scale, stager=None) -> None:
        """The one call of an engine: ``step_group`` with the state dicts, tensor indices and non-finite counters of
        ``params``."""
        engine = engines.engine_for(self, group, params)
        states, indices = self._engine_args(engine, group, params, grads, bucket)
        engine.step_group(
            group,
            params,
            grads,
            states,
            indices,
            bucket=bucket,
            grad_scale=grad_scale,
            stager=stager,
            nonfinite=self._nonfinite,
        )

    def _engine_args(self, engine, group: dict, params: list, grads: list, bucket: object) -> tuple[list, list]:
        """The state dicts and tensor indices of ``params`` for ``engine.step_group``, the states created (in the
        group's format, or in host memory with ``state_offload``) where missing, after ``engine.check`` (so a bad
        gradient or hyperparameter creates no state). Looked up once per ``(group, bucket)`` and parameter list: a
        call with the same parameters (an identity check, C speed) reuses the lists, so a step of hundreds of small
        tensors pays no per-tensor lookup. ``load_state_dict``, which replaces the state dicts, drops them; a dict put
        into ``self.state`` by other means (``opt.state[p] = {...}``) is seen once the parameter list changes."""
        key = (id(group), bucket)
        hit = self._engine_args_of.get(key)
        if (
            hit is not None
            and hit[0] is self.state
            and len(hit[1]) == len(params)
            and all(map(operator.is_, params, hit[1]))
        ):
            return hit[2], hit[3]
        engine.check(group, params, grads)
        states = [self._init_state(p, group) for p in params]
        indices = [self._tensor_index(p) for p in params]
        self._engine_args_of[key] = (self.state, list(params), states, indices)
        return states, indices

    def _spans_devices(self, group: dict) -> bool:
        """Whether ``group``'s parameters sit on more than one device (looked up once per params list)."""
        params = group["params"]
        entry = self._devices_of.get(id(params))
        if entry is None or entry[0] is not params:
            entry = self._devices_of[id(params)] = (params, len({p.device for p in params}) > 1)
        return entry[1]

    @torch.no_grad()
    def step(self, closure=None):
        """Perform one optimization step; ``closure`` re-evaluates the model and returns the loss.

        With ``gradient_release`` the parameters were updated during ``backward()``: this closes the step (updates
        any parameter whose gradient was set without a backward pass, records :attr:`grad_norm`).
        """
        if self._release is not None and getattr(self, "grad_scale", None) is not None:
            raise RuntimeError(
                "gradient_release=True cannot run under a GradScaler (fp16 mixed precision): the scaled gradients are "
                "applied in backward, before the scaler can unscale them or skip a step. Train in bf16 (bf16=True / "
                "mixed_precision='bf16'), or turn gradient_release off for fp16."
            )
        if self._release is not None:
            self._release.sync_hooks()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._release is not None:
            self._release.finish_step()
            if self._offload is not None:
                self._offload.end_step()
            self._nonfinite.end_step()
            return loss
        for group in self.param_groups:
            params = group["params"]
            grads = list(map(_GRAD, params))  # one C-level pass: the per-tensor host cost of many small tensors
            if any(map(operator.is_, grads, repeat(None))):
                params = [p for p, g in zip(params, grads) if g is not None]
                grads = [g for g in grads if g is not None]
            if not params:
                continue
            self._step_params(group, params, grads)
        if self._offload is not None:
            self._offload.end_step()
        self._nonfinite.end_step()
        return loss

    @property
    def nonfinite_skipped(self) -> int:
        """The optimizer steps in which at least one block was not updated because its gradient was not finite
        (``nonfinite`` argument), since construction, summed over the parameters' devices; under FSDP2 this rank's.
        Reading it waits for the device (read it when logging, not every step)."""
        return self._nonfinite.total()

    def set_parameter_names(self, model) -> None:
        """Name parameters in the warnings and errors about non-finite gradients by their names in ``model`` (a module;
        looked up when a message is due, so parameters replaced later, as FSDP2 does, are found too; the module is held
        through a weak reference). Not needed when the optimizer was built from ``model.named_parameters()``; the
        Trainer callback calls it."""
        ref = weakref.ref(model)

        def names() -> dict[int, str]:
            m = ref()
            return {} if m is None else {id(p): n for n, p in m.named_parameters()}

        self._nonfinite.names = names

    def nonfinite_report(self, names=None) -> int:
        """:attr:`nonfinite_skipped`, and a warning if blocks were skipped since the last report or warning, naming the
        first such parameter by ``names`` (``id(param) -> name``, e.g. ``{id(p): n for n, p in
        model.named_parameters()}``, or a function returning it) or by the param groups' ``param_names``. Waits for
        the device; the Trainer callback calls it when it logs."""
        return self._nonfinite.report(names)

    # ---- checkpoints ---------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.Optimizer.state_dict``, each param group also carrying ``exp_avg_mv_version`` (the 4-bit
        format version of its entries, :data:`apexw_hf.formats.MV4_VERSION_KEY`); with ``gradient_release`` also
        ``"gradient_release"``: the last global gradient norm and partial sums (floats), which the next step's clipping
        uses, so a resumed run clips as an unbroken one (a JSON copy also goes into the first param group, which
        torch.distributed.checkpoint keeps)."""
        if self._offload is not None:
            self._offload.sync()  # the host copies hold every update (they are what the state dict holds)
        out = super().state_dict()
        for group in out["param_groups"]:  # versions 3 and 4 of 4-bit codes have the same tensors: say which
            group[st.MV4_VERSION_KEY] = st.MV4_VERSION
        if self._release is not None:
            out["gradient_release"] = self._release.state()
        return out

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # torch.optim.Optimizer.__getstate__ keeps only defaults, state and param_groups: a deepcopy or an unpickled
        # copy starts without the caches, which rebuild from the param groups (the positions are the same).
        self.__dict__.setdefault("_param_index", {})
        self.__dict__.setdefault("_group_index", {})
        self.__dict__.setdefault("_devices_of", {})
        self.__dict__.setdefault("_engine", None)
        self.__dict__.setdefault("_cpu_engine", None)
        self.__dict__["_engine_args_of"] = {}  # the state dicts are new
        # Hooks live on the parameters, not in the pickled state: a copy steps in step(), without release.
        self.__dict__.setdefault("_release", None)
        self.__dict__.setdefault("_offload", None)
        # the mode is not in the pickled state either: a copy skips non-finite gradients (the default) and counts anew
        if self.__dict__.get("_nonfinite") is None:
            self._nonfinite = NonfiniteGuard(self, "skip")
        # torch.optim.Optimizer.__setstate__ (run by load_state_dict, deepcopy and unpickling) adds
        # differentiable=False to the defaults for optimizers pickled before that flag existed. ApexW has no
        # differentiable mode; kept, the key would reach every param group added later and every resumed state dict.
        self.defaults.pop("differentiable", None)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of ApexW (any format) or of ``torch.optim.AdamW``, keeping every dtype.

        ``torch.optim.Optimizer.load_state_dict`` casts floating state to the parameter dtype, which would turn bf16
        moments and the 8-bit and 4-bit scales into fp32 (or fp32 moments of bf16 parameters into bf16). Here each
        tensor keeps its saved dtype and moves to its parameter's device; moments stored in another format than the
        group's ``state_format`` (a torch AdamW checkpoint, or a changed format) are converted.

        The rest is ``torch.optim.Optimizer``'s contract: load-state-dict pre-hooks run first on a shallow copy (and
        may return a replacement), group hyperparameters come from the state dict, state keys that are not parameter
        ids are kept as they are, and post-hooks run once the state is in place. Everything is checked and converted
        before anything changes, so a bad state dict leaves this optimizer as it was.

        Args:
            state_dict: from :meth:`state_dict` of an ApexW or a ``torch.optim.AdamW`` over the same parameters.

        Raises:
            ValueError: the param groups differ in number or size, ``amsgrad`` state, moments of the wrong shape or
                layout, or a hyperparameter that ApexW rejects.
        """
        state_dict = state_dict.copy()
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        saved_groups = state_dict["param_groups"]
        saved_counts = [len(g["params"]) for g in saved_groups]
        our_counts = [len(g["params"]) for g in self.param_groups]
        if saved_counts != our_counts:
            raise ValueError(
                f"the state dict has param groups of sizes {saved_counts} but this optimizer has {our_counts}; "
                "it was saved from a different model or parameter grouping"
            )
        for g in saved_groups:
            if g.get("amsgrad"):
                raise ValueError("cannot load a state dict with amsgrad=True: ApexW has no max_exp_avg_sq")
        mv4_version = {pid: st.saved_mv4_version(g) for g in saved_groups for pid in g["params"]}
        groups = []
        for saved, ours in zip(saved_groups, self.param_groups):
            # the gradient-release copy in the first group is read by release.py's load hook, not a hyperparameter
            skip = (*_TORCH_ONLY_KEYS, GROUP_STATE_KEY, st.MV4_VERSION_KEY)
            group = copy.deepcopy({k: v for k, v in saved.items() if k != "params" and k not in skip})
            group["params"] = ours["params"]
            if "param_names" in ours and "param_names" not in group:
                group["param_names"] = ours["param_names"]
            for key, value in self.defaults.items():
                group.setdefault(key, value)
            self._check_hparams(group)
            groups.append(group)
        owner = {pid: (p, g) for saved, g in zip(saved_groups, groups) for pid, p in zip(saved["params"], g["params"])}
        state = defaultdict(dict)
        for key, entry in state_dict["state"].items():
            if isinstance(key, torch.Tensor) or key not in owner:
                state[key] = entry  # torch keeps state that belongs to no parameter as it is
                continue
            p, group = owner[key]
            # offloaded state is converted on the host: on the parameter's device the whole state dict would be there
            like = p if self._offload is None else dt.host_stand_in(p)
            converted = st.convert_state(
                entry,
                like,
                group["state_format"],
                seed=group["seed"],
                tensor_index=self._tensor_index(p),
                mv4_version=mv4_version[key],
            )
            if converted:
                state[p] = converted
        release_state = state_dict.get("gradient_release")
        if self._release is not None:
            self._release.check_saved(release_state)  # before anything is replaced
        if self._offload is not None:
            self._offload.invalidate()  # before the host tensors its copies read and write are replaced
            host = self._offload.load_host
            state = defaultdict(dict, {k: host(k, v) if isinstance(k, torch.Tensor) else v for k, v in state.items()})
        self.__setstate__({"state": state, "param_groups": groups})
        self._group_index = {}
        if self._release is not None:
            first = next((p for g in self.param_groups for p in g["params"]), None)
            self._release.load(release_state, None if first is None else dt.local(first).device)
        for engine in engines.engines_of(self):
            engine.invalidate()
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)
