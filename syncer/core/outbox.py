"""What the syncer sends its learners (DESIGN §6.1, §7.4): each committed fragment's new version
(exact f32, or a downlink delta in the codec each learner asked for), the full state on join and
reconnect, the consensus figures, and the final cut. Everything here is a `Send` effect: the shell queues it on the
learner's connection group, whose own sender thread writes it, so nothing waits on a peer. An
exact fragment goes out as `Send(committed=f)`: the shell reads the committed values without a
copy and leases them until the send is done (`leases.py`).

Delta broadcasts follow the downlink anchors (`yeto_core.downlink.DownlinkChains`, a chain per
codec in use), which the outbox keeps: it decides
whether a version goes out FULL or as a delta and asks the shell to encode it (`effects.Encode`,
answered by `events.Encoded`); the sends that carry it wait in the stream for the answer
(`RunState.later`). A learner that joins gets a copy of each anchor (`Send(anchor=f)`), made
first where the chain had none.
"""

from __future__ import annotations

from syncer.core.effects import Encode, FaultPoint, Send
from syncer.core.events import Encoded
from syncer.core.lifecycle import Life
from syncer.core.links import Link
from syncer.core.rounds import last_of_fragment
from syncer.core.run_state import RunState
from yeto_core.codecs import F32, Codec
from yeto_core.downlink import Broadcast
from yeto_core.wire.messages import BCAST_FULL, BCAST_LAST, BCAST_MERGED, Bcast, Final


class Outbox:
    def __init__(self, run: RunState) -> None:
        self.shared = run
        # By (codec's wire id, fragment): Encodes asked and not answered yet; of those, the ones
        # whose broadcast sends wait for the payload; answered, for the broadcast sends waiting on them.
        self._encoding: set[tuple[int, int]] = set()
        self._for_sends: set[tuple[int, int]] = set()
        self._encoded: dict[tuple[int, int], Broadcast] = {}

    def broadcast(self, round_id: int, f: int, merged: set[int]) -> None:
        """The new version of fragment f to every learner: exact f32, or a downlink delta in the
        codec each asked for (one encode per codec in use), flagged MERGED for the learners whose
        push it merged (they rebase on it, DESIGN §3.3). The `mid-bcast` fault point falls between
        the first learner's send and the others'."""
        run, state, downlinks = self.shared, self.shared.state, self.shared.downlinks
        assert state is not None and run.layout is not None and downlinks is not None
        version = state.versions[f]
        links = list(run.links.values())
        last = last_of_fragment(round_id, run.layout.num_fragments, run.settings.total_rounds)
        in_use = {link.downlink.wire_id: link.downlink for link in links if link.downlink is not None}
        for wire_id, chain in downlinks.by_id.items():
            if wire_id not in in_use:
                chain.drop(f)
        for codec in in_use.values():
            chain = downlinks.of(codec)
            self._encode(codec, f, version, full=chain.full_at(f, version, last=last), for_sends=True)
        run.later(lambda: self._broadcast_sends(round_id, f, version, merged, links, last))

    def broadcast_bytes(self, round_id: int, f: int) -> int:
        """The payload bytes `broadcast` will send of fragment f's new version, to every learner:
        the exact fragment (4 bytes a value) or its codec's delta, FULL where that chain restarts."""
        run, state, downlinks = self.shared, self.shared.state, self.shared.downlinks
        assert state is not None and run.layout is not None and downlinks is not None
        numel = run.layout.fragments[f].numel
        last = last_of_fragment(round_id, run.layout.num_fragments, run.settings.total_rounds)
        total = 0
        for link in run.links.values():
            codec = link.downlink
            full = codec is None or downlinks.of(codec).full_at(f, state.versions[f], last=last)
            total += F32.encoded_nbytes(numel) if full or codec is None else codec.encoded_nbytes(numel)
        return total

    def _broadcast_sends(self, round_id: int, f: int, version: int, merged: set[int], links: list[Link],
                         last: bool) -> None:
        run = self.shared
        closing = BCAST_LAST if last else 0  # a sweep stops waiting for this fragment's next pull
        deltas = {wire_id: self._encoded.pop((wire_id, f)) for wire_id, g in list(self._encoded) if g == f}
        if len(links) < 2:
            run.emit(FaultPoint("mid-bcast"))
        for n, link in enumerate(links):
            mine = BCAST_MERGED if link.learner_id in merged else 0
            if link.downlink is not None:
                delta = deltas[link.downlink.wire_id]
                msg = Bcast(f, version, round_id, delta.flags | closing | mine, 0, 0, delta.codec, delta.digest)
                run.emit(Send(link.peer, msg, delta.payload))
            else:
                run.emit(Send(link.peer, Bcast(f, version, round_id, BCAST_FULL | mine | closing, 0, 0, F32.wire_id),
                              committed=f))
            if n == 0 and len(links) > 1:
                run.emit(FaultPoint("mid-bcast", drain=True))

    def _encode(self, codec: Codec, f: int, version: int, *, full: bool, for_sends: bool = False) -> None:
        state, downlinks = self.shared.state, self.shared.downlinks
        assert state is not None and downlinks is not None
        key = (codec.wire_id, f)
        self._encoding.add(key)
        if for_sends:
            self._for_sends.add(key)
        lent = None if full else downlinks.of(codec).anchors[f]
        self.shared.emit(Encode(f, version, full, state.params[f], codec, lent))

    def encoded(self, ev: Encoded) -> None:
        """The shell answered an `Encode`: the anchor it made is the chain's now."""
        downlinks = self.shared.downlinks
        assert downlinks is not None
        downlinks.by_id[ev.codec].install(ev.fragment, ev.anchor, ev.broadcast.digest, ev.version)
        key = (ev.codec, ev.fragment)
        self._encoding.discard(key)
        if key in self._for_sends:  # else the anchor alone was wanted: its payload is not kept
            self._for_sends.discard(key)
            self._encoded[key] = ev.broadcast

    def send_consensus(self, round_id: int) -> None:
        """The consensus figures after a commit, to every learner that takes them."""
        if self.shared.consensus is None:
            return
        msg = self.shared.consensus.message(round_id)
        for link in list(self.shared.links.values()):
            if link.consensus:
                self.shared.emit(Send(link.peer, msg))

    def send_full_state(self, link: Link) -> None:
        """Every fragment, FULL: on join and reconnect (a delta learner gets the shared anchor,
        made first for a fragment that has none). Each names the round of the fragment's last
        commit, flagged MERGED when that commit merged this learner's push: a learner that lost
        the round's own BCAST (a dropped link, a syncer killed mid-broadcast) rebases on it
        exactly as on that BCAST."""
        state, downlinks = self.shared.state, self.shared.downlinks
        assert state is not None and downlinks is not None
        if link.downlink is not None:
            chain = downlinks.of(link.downlink)
            for i in range(state.num_fragments):
                if not chain.held(i) and (link.downlink.wire_id, i) not in self._encoding:
                    self._encode(link.downlink, i, state.versions[i], full=True)
        self.shared.later(lambda: self._full_state_sends(link))

    def _full_state_sends(self, link: Link) -> None:
        state, downlinks = self.shared.state, self.shared.downlinks
        assert state is not None and downlinks is not None
        for i in range(state.num_fragments):
            version = state.versions[i]
            last_round, merged = state.merged_by[i]
            mine = BCAST_MERGED if link.learner_id in merged else 0
            round_id = last_round if last_round >= 0 else state.next_round
            total = self.shared.settings.total_rounds
            mine |= BCAST_LAST if last_round >= 0 and last_of_fragment(last_round, state.num_fragments, total) else 0
            if link.downlink is not None:
                digest = downlinks.of(link.downlink).digests[i]
                msg = Bcast(i, version, round_id, BCAST_FULL | mine, 0, 0, F32.wire_id, digest)
                self.shared.emit(Send(link.peer, msg, anchor=(i, link.downlink.wire_id)))
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

