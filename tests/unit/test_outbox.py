"""What the syncer sends is what it committed: fragment bytes go out without a copy, and a commit
that would overwrite them while a send still reads them writes a copy instead (`leases.py`)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from syncer.leases import Leases
from syncer.outbox import Outbox
from yeto_core.wire.transport import SendTicket

pytestmark = pytest.mark.unit


def outbox(*params: torch.Tensor) -> tuple[Outbox, Leases]:
    leases = Leases()
    run = SimpleNamespace(state=SimpleNamespace(params=list(params)))
    return Outbox(run, leases), leases  # type: ignore[arg-type]


def commit(box: Outbox, leases: Leases, f: int) -> torch.Tensor:
    """What the coordinator does before it writes fragment f in place; the tensor it writes."""
    leases.writable(f, {"param": box.shared.state.params})
    return box.shared.state.params[f]


def test_fragment_bytes_are_the_parameters_own_memory() -> None:
    params = torch.randn(1 << 16)
    out = outbox(params)[0].fragment_bytes(0)
    assert np.shares_memory(np.frombuffer(out, dtype=np.float32), params.numpy())
    assert torch.equal(torch.frombuffer(out, dtype=torch.float32), params)


def test_a_commit_during_a_send_writes_a_copy_and_the_send_keeps_the_old_values() -> None:
    params = torch.randn(4, 1 << 14)
    box, leases = outbox(params)
    ticket = box.sending(0, SendTicket(3))  # three chunks still to go
    out = box.fragment_bytes(0)
    committed = params.clone()
    moved = commit(box, leases, 0)
    assert moved is not params and moved.shape == params.shape and torch.equal(moved, committed)
    moved.add_(1.0)  # the merge writes the fragment in place
    assert ticket._left == 3 and torch.equal(torch.frombuffer(out, dtype=torch.float32), committed.reshape(-1))
    assert leases.copied == [(0, "param")]
    assert commit(box, leases, 0) is moved  # the copy has no reader: the next commit writes it in place


def test_no_copy_once_every_send_is_done() -> None:
    params = torch.randn(1 << 14)
    box, leases = outbox(params)
    ticket = box.sending(0, SendTicket(1))
    box.fragment_bytes(0)
    ticket.chunk_sent()
    assert commit(box, leases, 0) is params and leases.copied == []


def test_an_empty_fragment_sends_no_bytes() -> None:
    assert len(outbox(torch.empty(0))[0].fragment_bytes(0)) == 0
