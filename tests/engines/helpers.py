"""The oracle of the engine tests: a step by ``reference.adamw_step_ref_`` tensor by tensor, and the bit-for-bit
comparison of two optimizers' parameters and state."""

import torch

from apexw_hf import ApexW, reference

from ..optim.helpers import same_bits


@torch.no_grad()
def reference_step(opt: ApexW) -> None:
    """One step of ``opt`` by the per-tensor reference (the oracle)."""
    for group in opt.param_groups:
        b1, b2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = opt._init_state(p, group)
            state["step"] += 1
            t = int(state["step"].item())
            scalars = reference.StepScalars.make(
                lr=float(group["lr"]), beta1=b1, beta2=b2, eps=group["eps"], weight_decay=group["weight_decay"], step=t
            )
            reference.adamw_step_ref_(
                p,
                p.grad,
                state,
                fmt=group["state_format"],
                scalars=scalars,
                seed=group["seed"],
                tensor_index=opt._tensor_index(p),
                step=t,
                maximize=group["maximize"],
                param_rounding=group["param_rounding"],
            )


def assert_same(opt_a, params_a, opt_b, params_b):
    for i, (a, b) in enumerate(zip(params_a, params_b)):
        assert same_bits(a.detach(), b.detach()), f"param {i} {tuple(a.shape)} {a.dtype}"
        sa, sb = opt_a.state.get(a, {}), opt_b.state.get(b, {})
        assert sa.keys() == sb.keys(), i
        for key in sa:
            assert same_bits(sa[key], sb[key]), f"param {i} {tuple(a.shape)} state {key}"
