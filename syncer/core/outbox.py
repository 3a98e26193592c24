"""What the syncer sends its learners (DESIGN §6.1, §7.4): each committed fragment's new version
(exact f32, or a bf16 downlink delta), the full state on join and reconnect, the consensus
figures, and the final cut. Everything here is a `Send` effect: the shell queues it on the
learner's connection group, whose own sender thread writes it, so nothing waits on a peer. An
exact fragment goes out as `Send(committed=f)`: the shell reads the committed values without a
copy and leases them until the send is done (`leases.py`).
"""

from __future__ import annotations

import dataclasses

from syncer.core.effects import FaultPoint, Send
from syncer.core.lifecycle import Life
from syncer.core.links import Link
from syncer.core.rounds import last_of_fragment
from syncer.core.run_state import RunState
from yeto_core.codecs import F32
from yeto_core.wire.messages import BCAST_FULL, BCAST_LAST, BCAST_MERGED, Bcast, Final


class Outbox:
    def __init__(self, run: RunState) -> None:
        self.shared = run

    def broadcast(self, round_id: int, f: int, merged: set[int]) -> None:
        """The new version of fragment f to every learner: exact f32, or a bf16 downlink delta,
        flagged MERGED for the learners whose push it merged (they rebase on it, DESIGN §3.3).
        The `mid-bcast` fault point falls between the first learner's send and the others'."""
        run, state, downlink = self.shared, self.shared.state, self.shared.downlink
        assert state is not None and run.layout is not None and downlink is not None
        version = state.versions[f]
        links = list(run.links.values())
        last = last_of_fragment(round_id, run.layout.num_fragments, run.settings.total_rounds)
        closing = BCAST_LAST if last else 0  # a sweep stops waiting for this fragment's next pull
        if any(link.bcast_delta for link in links):
            delta = downlink.commit(f, version, state.params[f], last=last)
            delta_msg = Bcast(f, version, round_id, delta.flags | closing, 0, 0, delta.codec, delta.digest)
        else:
            downlink.anchors[f] = None  # nobody follows the chain: restart it with a FULL later
        if len(links) < 2:
            run.emit(FaultPoint("mid-bcast"))
        for n, link in enumerate(links):
            mine = BCAST_MERGED if link.learner_id in merged else 0
            if link.bcast_delta:
                run.emit(Send(link.peer, dataclasses.replace(delta_msg, flags=delta_msg.flags | mine), delta.payload))
            else:
                run.emit(Send(link.peer, Bcast(f, version, round_id, BCAST_FULL | mine | closing, 0, 0, F32.wire_id),
                              committed=f))
            if n == 0 and len(links) > 1:
                run.emit(FaultPoint("mid-bcast", drain=True))

    def send_consensus(self, round_id: int) -> None:
        """The consensus figures after a commit, to every learner that takes them."""
        if self.shared.consensus is None:
            return
        msg = self.shared.consensus.message(round_id)
        for link in list(self.shared.links.values()):
            if link.consensus:
                self.shared.emit(Send(link.peer, msg))

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
            total = self.shared.settings.total_rounds
            mine |= BCAST_LAST if last_round >= 0 and last_of_fragment(last_round, state.num_fragments, total) else 0
            if link.bcast_delta:
                held = downlink.anchors[i] is not None
                b = downlink.full(i) if held else downlink.commit(i, version, state.params[i])
                self.shared.emit(Send(link.peer, Bcast(i, version, round_id, b.flags | mine, 0, 0, b.codec, b.digest),
                                      b.payload))
            else:
                msg = Bcast(i, version, round_id, BCAST_FULL | mine, 0, 0, F32.wire_id)
                self.shared.emit(Send(link.peer, msg, committed=i))

    def send_final(self, link: Link) -> None:
        """The final cut, every fragment exact, to one learner."""
        assert self.shared.state is not None
        p = self.shared.state.num_fragments
        for i in range(p):
            msg = Final(i, self.shared.state.versions[i], p, self.shared.state.next_round, 0, 0, F32.wire_id)
            self.shared.emit(Send(link.peer, msg, committed=i))
        lives = self.shared.lives
        if lives.get(link.learner_id) in (Life.TRAINING, Life.FINISHED):  # one that said goodbye stays QUIT
            lives.move(link.learner_id, Life.CUT_SENT, self.shared.now)
