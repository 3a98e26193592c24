"""What the syncer sends its learners (DESIGN §6.1, §7.4): each committed fragment's new version
(exact f32, or a bf16 downlink delta), the full state on join and reconnect, the consensus
figures, and the final cut. Every send is queued on the learner's connection group, whose own
sender thread writes it: nothing here waits on a peer.
"""

from __future__ import annotations

import dataclasses

import torch

from syncer.leases import Leases
from syncer.links import Link
from syncer.run_state import RunState
from yeto_core.codecs import F32, tensor_bytes
from yeto_core.faults import FAULT_SEND_WAIT_S
from yeto_core.wire.buffers import BufferPool
from yeto_core.wire.messages import BCAST_FULL, BCAST_MERGED, Bcast, Final
from yeto_core.wire.transport import SendTicket

SNAPSHOT_POOL = BufferPool()  # host copies of fragments for cuda sends, recycled once unused


class Outbox:
    def __init__(self, run: RunState, leases: Leases) -> None:
        self.shared = run
        self.leases = leases

    def fragment_bytes(self, index: int) -> memoryview:
        """Fragment `index`'s committed values for the sender threads of every learner.

        On the CPU these are the parameters' own bytes, with no copy: whoever sends them takes a
        lease on them (`sending`), so the next commit of the fragment writes a copy if a send
        still reads them (`leases.py`). Elsewhere (cuda) they are copied to host memory, into a
        recycled buffer: a fresh 64 MiB one faults in every page during the copy (20–25 ms against
        4 ms into a warm one, here).
        """
        assert self.shared.state is not None
        params = self.shared.state.params[index].detach()
        if params.numel() == 0:
            return memoryview(b"")
        if params.device.type == "cpu":
            return tensor_bytes(params)
        snapshot = SNAPSHOT_POOL.take(params.numel() * 4)
        torch.frombuffer(snapshot, dtype=torch.float32).copy_(params.reshape(-1))
        return snapshot

    def sending(self, index: int, ticket: SendTicket) -> SendTicket:
        """A send of `fragment_bytes(index)`: on the CPU it reads the parameters themselves until
        its ticket is done, so it holds a lease on them."""
        assert self.shared.state is not None
        if self.shared.state.params[index].device.type == "cpu" and not ticket.done.is_set():
            self.leases.take(index, "param", lambda: not ticket.done.is_set())
        return ticket

    def broadcast(self, round_id: int, f: int, merged: set[int]) -> None:
        """The new version of fragment f to every learner: exact f32, or a bf16 downlink delta,
        flagged MERGED for the learners whose push it merged (they rebase on it, DESIGN §3.3)."""
        run, state, downlink = self.shared, self.shared.state, self.shared.downlink
        assert state is not None and run.layout is not None and downlink is not None
        version = state.versions[f]
        links = list(run.links.values())
        if any(link.bcast_delta for link in links):
            total = run.settings.total_rounds
            last = bool(total) and round_id + run.layout.num_fragments >= total  # the fragment's last version
            b = downlink.commit(f, version, state.params[f], last=last)
            delta_msg = Bcast(f, version, round_id, b.flags, 0, 0, b.codec, b.digest)
        else:
            downlink.anchors[f] = None  # nobody follows the chain: restart it with a FULL later
        exact: memoryview | None = None
        if len(links) < 2:
            run.faults.point("mid-bcast")
        for n, link in enumerate(links):
            mine = BCAST_MERGED if link.learner_id in merged else 0
            if link.bcast_delta:
                ticket = link.group.send(dataclasses.replace(delta_msg, flags=delta_msg.flags | mine), b.payload)
            else:
                exact = self.fragment_bytes(f) if exact is None else exact
                ticket = self.sending(f, link.group.send(
                    Bcast(f, version, round_id, BCAST_FULL | mine, 0, 0, F32.wire_id), exact))
            if n == 0 and len(links) > 1 and run.faults.armed("mid-bcast"):
                ticket.wait(FAULT_SEND_WAIT_S)  # so that "sent to some learners" holds when the point fires
                run.faults.point("mid-bcast")

    def send_consensus(self, round_id: int) -> None:
        """The consensus figures after a commit, to every learner that takes them."""
        if self.shared.consensus is None:
            return
        msg = self.shared.consensus.message(round_id)
        for link in list(self.shared.links.values()):
            if link.consensus:
                link.group.send(msg)

    def send_full_state(self, link: Link) -> None:
        """Every fragment, FULL: on join and reconnect (a delta learner gets the shared anchor).
        Each names the round of the fragment's last commit, flagged MERGED when that commit merged
        this learner's push: a learner that lost the round's own BCAST (a dropped link, a syncer
        killed mid-broadcast) rebases on it exactly as on that BCAST."""
        state, downlink = self.shared.state, self.shared.downlink
        assert state is not None and downlink is not None
        for i in range(state.num_fragments):
            version = state.versions[i]
            last_round, merged = state.merged_by[i]
            mine = BCAST_MERGED if link.learner_id in merged else 0
            round_id = last_round if last_round >= 0 else state.next_round
            if link.bcast_delta:
                held = downlink.anchors[i] is not None
                b = downlink.full(i) if held else downlink.commit(i, version, state.params[i])
                link.group.send(Bcast(i, version, round_id, b.flags | mine, 0, 0, b.codec, b.digest), b.payload)
            else:
                msg = Bcast(i, version, round_id, BCAST_FULL | mine, 0, 0, F32.wire_id)
                self.sending(i, link.group.send(msg, self.fragment_bytes(i)))

    def send_final(self, link: Link, *, wait_s: float = 0.0) -> None:
        assert self.shared.state is not None
        p = self.shared.state.num_fragments
        for i in range(p):
            msg = Final(i, self.shared.state.versions[i], p, self.shared.state.next_round, 0, 0, F32.wire_id)
            ticket = self.sending(i, link.group.send(msg, self.fragment_bytes(i)))
            if wait_s:
                ticket.wait(wait_s)
        link.final_sent = True
