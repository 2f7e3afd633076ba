"""The clipping state of gradient release in the state dict: also in the first param group (as JSON), the copy that
torch.distributed.checkpoint keeps; taken out of the groups on load."""

from __future__ import annotations

import copy
import json

import torch

from apexw_hf import ApexW


def _trained(release=True):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    kw = dict(gradient_release=True, max_grad_norm=0.1, release_bucket_size=50) if release else {}
    opt = ApexW(model.parameters(), lr=1e-2, state_format="8bit", engine="torch", **kw)
    for t in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(t))
        model(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_group_copy_of_the_clipping_state_restores_it():
    model, opt = _trained()
    sd = opt.state_dict()
    assert json.loads(sd["param_groups"][0]["gradient_release_state"]) == sd["gradient_release"]
    assert len(sd["gradient_release"]["prev_partial_sumsq"]) > 1  # several buckets
    # torch.distributed.checkpoint keeps only "state" and "param_groups"
    dcp_like = {"state": sd["state"], "param_groups": sd["param_groups"]}
    before = copy.deepcopy(dcp_like)
    fresh = ApexW(
        model.parameters(),
        lr=1e-2,
        state_format="8bit",
        engine="torch",
        gradient_release=True,
        max_grad_norm=0.1,
        release_bucket_size=50,
    )
    fresh.load_state_dict(dcp_like)
    assert fresh._release.state() == opt._release.state()
    assert all("gradient_release_state" not in g for g in fresh.param_groups)  # not a hyperparameter
    assert dcp_like["param_groups"] == before["param_groups"]  # the caller's state dict is left as it was
    again = fresh.state_dict()  # the hooks outlive load_state_dict
    assert json.loads(again["param_groups"][0]["gradient_release_state"]) == again["gradient_release"]
    fresh._release.remove_hooks()
    opt._release.remove_hooks()


def test_state_dict_without_release_state_and_non_release_state_dicts_load():
    model, opt = _trained(release=False)
    sd = opt.state_dict()
    assert "gradient_release" not in sd and "gradient_release_state" not in sd["param_groups"][0]
    fresh = ApexW(model.parameters(), lr=1e-2, state_format="8bit", engine="torch", gradient_release=True)
    fresh.load_state_dict(sd)
    assert fresh._release.state() == {"prev_grad_norm": None, "prev_partial_sumsq": [], "prev_released_numel": 0}
