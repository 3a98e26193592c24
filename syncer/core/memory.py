"""What a resumed syncer remembers of the run besides the model (DESIGN §4.6, §4.7, §6.2), kept in
the checkpoint's `extra` metadata:

* `members`: the learners that trained on the run's model. A resumed syncer waits for each, as
  for one that left while training, before it finalizes, and hands it the final cut.
* `merged_rounds`: for the recent rounds a late push may still name, the learners whose answer
  to each is merged. A push sent twice is refused, never carried into a later round and counted
  again, by a resumed syncer as by the one that merged it.

Both are written into the state as fresh objects, never changed in place, so a background
checkpoint's snapshot of `extra` keeps what it copied.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from syncer.durability.checkpoint import SyncerState

MEMBERS = "members"  # state.extra: the learners that trained on the model
MERGED_ROUNDS = "merged_rounds"  # state.extra: [[round, [learner, ...]], ...], oldest round first

log = logging.getLogger("yeto.syncer")


def members(state: SyncerState) -> list[int]:
    return list(state.extra.get(MEMBERS, []))


def add_members(state: SyncerState, learners: Iterable[int]) -> None:
    """`learners` train on this run's model: a resumed syncer waits for them too."""
    known = members(state)
    joined = sorted(set(known) | set(learners))
    if joined != known:
        state.extra[MEMBERS] = joined


def merged_horizon(state: SyncerState, max_base_lag: int) -> int:
    """The oldest round whose merged answers still matter: a push answering an older round lags
    its fragment's next merge by more than `max_base_lag` versions and is refused for that alone.
    (A round r of fragment f merged at version v; its answers have base v, and once the run is at
    round n the fragment is at version v + ⌈(n − r)/P⌉. Kept: two rounds of every fragment more.)"""
    return state.next_round - state.num_fragments * (max_base_lag + 2)


def keep_merged(state: SyncerState, merged_rounds: dict[int, set[int]], max_base_lag: int) -> None:
    """Forget the rounds before the horizon in `merged_rounds` (in place), and write what is left
    into the state for the next checkpoint: at most P·(max_base_lag + 2) rounds, each with the
    learners it merged."""
    horizon = merged_horizon(state, max_base_lag)
    for old in [r for r in merged_rounds if r < horizon]:
        del merged_rounds[old]
    state.extra[MERGED_ROUNDS] = [[r, sorted(merged_rounds[r])] for r in sorted(merged_rounds)]


def merged_rounds_of(state: SyncerState) -> dict[int, set[int]]:
    """What a checkpoint remembers of who each recent round merged (empty for one written before
    it was kept, or holding something else under the key, which is said and ignored)."""
    kept = state.extra.get(MERGED_ROUNDS, [])
    well_formed = isinstance(kept, list) and all(
        isinstance(item, list) and len(item) == 2 and type(item[0]) is int and isinstance(item[1], list)
        and all(type(lid) is int for lid in item[1]) for item in kept)
    if not well_formed:
        log.warning("the checkpoint's %r metadata is not [[round, [learner, ...]], ...]; ignored", MERGED_ROUNDS)
        return {}
    return {r: set(learners) for r, learners in kept}
