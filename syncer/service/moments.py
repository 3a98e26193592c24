"""The shared first moment's relay (DESIGN §3.9): pushes bring each learner's optimizer first
moment of their fragment, the merge averages them, and the commit's broadcasts carry the average
back.

The moments are advice to the learners' optimizers, not state of the run: they are not
checkpointed, never touch the parameters, and a broadcast without one (a restart, a join, a
learner that stopped sending them) only means that island keeps its own moment for that round.
So the relay lives in the shell, beside the sends, and the protocol never sees it.
"""

from __future__ import annotations

import collections
import dataclasses

from syncer.core.rounds import Answer
from yeto_core.layout import Fragment
from yeto_core.moments import average_moments
from yeto_core.net.tickets import Concatenated, Payload
from yeto_core.wire.messages import BCAST_MOMENT, PUSH_MOMENT, Bcast, Push

HELD_MERGES = 2  # the rounds a syncer may have in flight (its pipeline): their broadcasts follow their merge


def merged_moment(fragment: Fragment, merged: list[Answer], weights: list[float]) -> memoryview | None:
    """The fragment's first moments the merged learners sent with their pushes, averaged with the
    merge's own weights over those that sent one, in learner-id order, in wire form; None when
    none did. A pure function of the merge."""
    sent = [(a.moment, w) for a, w in zip(merged, weights, strict=True) if a.moment is not None]
    return average_moments(fragment, sent) if sent else None


class MomentRelay:
    """Who sends moments, the averages of the last merges, and the broadcasts that carry them."""

    def __init__(self) -> None:
        self.sharing: set[int] = set()  # learners whose newest push carried a moment
        # (fragment, version) -> the merged moment of the commit that made that version, encoded
        self._merged: collections.OrderedDict[tuple[int, int], memoryview] = collections.OrderedDict()

    def heard(self, learner_id: int, msg: Push) -> None:
        """A push arrived: does its learner share its moment (its broadcasts will carry the average)?"""
        if msg.codec & PUSH_MOMENT:
            self.sharing.add(learner_id)
        else:
            self.sharing.discard(learner_id)

    def merged(self, fragment: int, version: int, moment: memoryview | None) -> None:
        """A merge made `version` of `fragment`; `moment`: the average of its learners' moments,
        in wire form."""
        self._merged.pop((fragment, version), None)
        if moment is None:
            return
        self._merged[(fragment, version)] = moment
        while len(self._merged) > HELD_MERGES:
            self._merged.popitem(last=False)

    def attach(self, learner_id: int, msg: Bcast, payload: Payload) -> tuple[Bcast, Payload]:
        """The broadcast as `learner_id` gets it: with the merged moment (`MOMENT_CODEC`) after the
        values when that learner shares its moment and the version was made by a merge that had moments."""
        moment = self._merged.get((msg.fragment, msg.version))
        if moment is None or learner_id not in self.sharing or msg.flags & BCAST_MOMENT:
            return msg, payload
        return (dataclasses.replace(msg, flags=msg.flags | BCAST_MOMENT),
                Concatenated([payload, moment]))
