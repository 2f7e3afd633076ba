"""dequantized_state and to_torch_adamw_state_dict on FSDP2 (DTensor) parameters, gloo on CPU."""

import pytest
import torch
import torch.distributed as dist

from apexw_hf import ApexW
from apexw_hf import dtensor as dt
from apexw_hf import reference as ref

from . import workers as w

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch without distributed support")


def _export_and_continue(rank, world, store, out, fmt):
    from torch.distributed.tensor import DTensor

    w.init(rank, world, store)
    data = w.batches(6, rank, world)
    runs = {}
    for name in ("apexw", "torch"):
        model = w.sharded(world)
        opt = ApexW(model.parameters(), lr=3e-3, state_format=fmt)
        w.train(model, opt, data[:3])
        if name == "torch":
            checks = []
            sd = opt.to_torch_adamw_state_dict()
            for i, p in enumerate(model.parameters()):
                local = opt.dequantized_state(p)
                want_m, want_v = ref.load_moments(dt.local_view(opt.state[p], p), fmt, p.to_local().shape)
                exported = sd["state"][i]
                checks.append(
                    type(local["exp_avg"]) is torch.Tensor
                    and local["exp_avg"].shape == p.to_local().shape
                    and torch.equal(local["exp_avg"], want_m.float())
                    and torch.equal(local["exp_avg_sq"], want_v.float())
                    and isinstance(exported["exp_avg"], DTensor)
                    and exported["exp_avg"].placements == p.placements
                    and torch.equal(exported["exp_avg"].to_local(), local["exp_avg"])
                )
            opt = torch.optim.AdamW(model.parameters())
            opt.load_state_dict(sd)
            runs["checks"] = checks
        w.train(model, opt, data[3:])
        runs[name] = w.gathered_params(model)
    w.save_result(out, rank, runs)
    w.finish()


@pytest.mark.parametrize("fmt", ["fp32", "8bit", "4bit"])
def test_fsdp2_export_continues_in_torch_adamw(fmt):
    """Local-shard fp32 moments, DTensor moments in the export, and torch AdamW continuing from them."""
    for r in w.spawn(_export_and_continue, 2, fmt):
        assert r["checks"] and all(r["checks"])
        for a, b in zip(r["apexw"], r["torch"]):
            # fp32 state: torch's update and ApexW's agree to fp32 rounding; 8-bit: the same moments, a
            # different (unquantized) continuation, so only close; 4-bit: ApexW re-rounds the moments to powers of
            # two at each of the 3 steps (lr 3e-3), measured up to 0.016 apart, bound 10 lr
            tol = {
                "fp32": dict(rtol=1e-5, atol=1e-6),
                "8bit": dict(rtol=0, atol=5e-3),
                "4bit": dict(rtol=0, atol=3e-2),
            }
            torch.testing.assert_close(a, b, **tol[fmt])
