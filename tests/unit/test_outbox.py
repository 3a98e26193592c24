"""What the syncer sends is what it committed: fragment bytes go out without a copy, and a commit
that would overwrite them while a send still reads them writes a copy instead (`leases.py`).
The shell performs the protocol's `Send(committed=f)` effects; these tests hand it sends whose
tickets they control."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from syncer.core.effects import Peer, Send
from syncer.core.leases import Leases
from syncer.durability.tape import EventTape
from syncer.service.coordinator import Coordinator
from yeto_core.net.tickets import SendTicket
from yeto_core.settings import SyncerSettings
from yeto_core.wire.messages import BCAST_FULL, Bcast

pytestmark = pytest.mark.unit

PEER = Peer(0, 1)


class HeldGroup:
    """A connection whose sends stay in flight until the test says so."""

    def __init__(self, chunks: int) -> None:
        self.chunks = chunks
        self.payloads: list[Any] = []

    def send(self, msg: Any, payload: Any = None) -> SendTicket:
        self.payloads.append(payload)
        return SendTicket(self.chunks)


class Shell:
    def __init__(self, *params: torch.Tensor, chunks: int = 0) -> None:
        self.co = Coordinator(SyncerSettings(device="cpu"), device=torch.device("cpu"), tape=EventTape(None))
        self.co._decoders.shutdown()
        self.co.protocol.shared.state = SimpleNamespace(params=list(params))  # type: ignore[assignment]
        self.group = HeldGroup(chunks)
        self.co.groups[PEER] = self.group  # type: ignore[assignment]

    @property
    def params(self) -> list[torch.Tensor]:
        return self.co.protocol.shared.state.params  # type: ignore[union-attr]

    @property
    def leases(self) -> Leases:
        return self.co.leases

    def sending(self, f: int) -> tuple[SendTicket, memoryview]:
        """The send of fragment f's committed values, as the shell performs it; its ticket and bytes."""
        ticket = self.co._send(Send(PEER, Bcast(f, 1, 0, BCAST_FULL, 0, 0, 0), committed=f), {})
        assert ticket is not None
        return ticket, self.group.payloads[-1]

    def commit(self, f: int) -> torch.Tensor:
        """What the shell does before a merge writes fragment f in place; the tensor it writes."""
        self.leases.writable(f, {"param": self.params})
        return self.params[f]


def test_fragment_bytes_are_the_parameters_own_memory() -> None:
    params = torch.randn(1 << 16)
    out = Shell(params).co.committed_bytes(0)
    assert np.shares_memory(np.frombuffer(out, dtype=np.float32), params.numpy())
    assert torch.equal(torch.frombuffer(out, dtype=torch.float32), params)


def test_a_commit_during_a_send_writes_a_copy_and_the_send_keeps_the_old_values() -> None:
    params = torch.randn(4, 1 << 14)
    shell = Shell(params, chunks=3)  # three chunks still to go
    ticket, out = shell.sending(0)
    committed = params.clone()
    moved = shell.commit(0)
    assert moved is not params and moved.shape == params.shape and torch.equal(moved, committed)
    moved.add_(1.0)  # the merge writes the fragment in place
    assert ticket._left == 3 and torch.equal(torch.frombuffer(out, dtype=torch.float32), committed.reshape(-1))
    assert shell.leases.copied == [(0, "param")]
    assert shell.commit(0) is moved  # the copy has no reader: the next commit writes it in place


def test_no_copy_once_every_send_is_done() -> None:
    params = torch.randn(1 << 14)
    shell = Shell(params, chunks=1)
    ticket, _ = shell.sending(0)
    ticket.chunk_sent()
    assert shell.commit(0) is params and shell.leases.copied == []


def test_an_empty_fragment_sends_no_bytes() -> None:
    assert len(Shell(torch.empty(0)).co.committed_bytes(0)) == 0
