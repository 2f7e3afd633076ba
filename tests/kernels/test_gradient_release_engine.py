"""Gradient release on the Triton engine (GPU, or the interpreter on CPU): the same bits as step(), bucket plans."""

import pytest
import torch

from apexw_hf.optim import ApexW

from ..optim.test_gradient_release import groups, make, train
from .helpers import DEVICE


@pytest.mark.parametrize("fmt", ["compact", "8bit", "4bit"])
def test_release_on_the_triton_engine_is_bit_identical(fmt):
    a, b = make().to(DEVICE), make().to(DEVICE)
    oa = ApexW(groups(a), lr=2e-2, state_format=fmt, engine="triton")
    ob = ApexW(groups(b), lr=2e-2, state_format=fmt, engine="triton", gradient_release=True, release_bucket_size=700)
    train(a, oa, 3)
    train(b, ob, 3)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    # one launch plan per (group, bucket), no plan holding a tensor of another bucket (their step counters would go
    # stale)
    caches = list(ob._triton_engine()._cache.values())
    members = [i for c in caches for i in c.member_ids]
    assert len(caches) > 2 and len(members) == len(set(members))
