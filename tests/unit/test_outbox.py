"""The syncer's send snapshots: exact, immutable while held, and recycled once every send is done."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch

from syncer.outbox import SNAPSHOT_POOL, Outbox

pytestmark = pytest.mark.unit


def outbox(*params: torch.Tensor) -> Outbox:
    box = Outbox()
    box.state = SimpleNamespace(params=list(params))
    return box


def test_a_snapshot_holds_the_committed_values_and_does_not_follow_later_writes() -> None:
    params = torch.randn(1 << 20)
    box = outbox(params)
    snap = box._fragment_bytes(0)
    expected = params.clone()
    params.add_(1.0)  # the next commit writes the fragment in place
    assert torch.equal(torch.frombuffer(snap, dtype=torch.float32), expected)


def test_snapshot_buffers_come_back_only_after_the_last_slice_is_gone() -> None:
    box = outbox(torch.randn(1 << 20))
    snap = box._fragment_bytes(0)
    part = snap[4096:8192]  # what a queued CHUNK holds
    reused = SNAPSHOT_POOL.reused
    del snap
    gc.collect()
    again = box._fragment_bytes(0)  # the first buffer is still held by `part`: a new one
    assert SNAPSHOT_POOL.reused == reused
    del part, again
    gc.collect()
    box._fragment_bytes(0)
    assert SNAPSHOT_POOL.reused == reused + 1


def test_an_empty_fragment_snapshots_to_no_bytes() -> None:
    assert len(outbox(torch.empty(0))._fragment_bytes(0)) == 0
