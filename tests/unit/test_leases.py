"""The one rule for committed tensors: a commit writes a copy of whatever a reader still reads."""

from __future__ import annotations

import pytest
import torch

from syncer.core.leases import Leases, fresh_copy

pytestmark = pytest.mark.unit


def test_a_leased_tensor_is_replaced_by_a_copy_and_only_while_the_lease_holds() -> None:
    leases = Leases()
    params, momentum = [torch.ones(8), torch.ones(8)], [torch.zeros(8), torch.zeros(8)]
    reading = [True]
    leases.take(1, "param", lambda: reading[0])
    old = params[1]
    moved = leases.writable(1, {"param": params, "momentum": momentum, "accum": None})
    assert set(moved) == {"param"} and params[1] is moved["param"] is not old and torch.equal(params[1], old)
    params[1].add_(5.0)
    assert torch.equal(old, torch.ones(8))  # the reader's tensor is never written again
    assert momentum[1] is momentum[1] and leases.copied == [(1, "param")]
    leases.take(0, "momentum", lambda: reading[0])
    reading[0] = False  # the reader finished before the commit
    kept = momentum[0]
    assert leases.writable(0, {"param": params, "momentum": momentum}) == {} and momentum[0] is kept


def test_several_readers_of_one_tensor_and_the_accumulator() -> None:
    leases = Leases()
    accum = [torch.arange(4.0)]
    first, second = [True], [True]
    leases.take(0, "accum", lambda: first[0])
    leases.take(0, "accum", lambda: second[0])
    first[0] = False
    assert leases.leased(0, "accum")  # one reader is enough
    moved = leases.writable(0, {"accum": accum})
    assert torch.equal(moved["accum"], torch.arange(4.0)) and not leases.leased(0, "accum")
    with pytest.raises(AssertionError):
        leases.take(0, "grads", lambda: True)


@pytest.mark.parametrize("shape", [(0,), (3,), (1 << 16,), (4, 1 << 12)])
def test_fresh_copies_share_no_memory(shape: tuple[int, ...]) -> None:
    t = torch.randn(shape)
    c = fresh_copy(t)
    assert c.shape == t.shape and torch.equal(c, t)
    if t.numel():
        c.add_(1.0)
        assert not torch.equal(c, t)
