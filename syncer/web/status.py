"""`StatusBoard`: what the live status page shows, kept from the tape's records as they are made.

Like the metrics (`syncer/service/metrics.py`), the board listens to the event tape on the coordinator's
thread, and hears the bytes on the wire from the shell (`syncer/service/traffic.py`); the web server's
threads read it through `snapshot()`, a plain JSON-ready dict (`/status.json`). So what the page
shows is what the tape says, and the same run's tape yields the same figures after the fact.

The snapshot holds the run's shape, each learner (state, connection generation, last push,
tokens merged, how many versions behind its last merged push was, bytes per second in and out
over the last minute), each fragment (version, last commit, staleness), the last rounds with
their decisions and reasons, and per-commit points for the page's sparklines.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from syncer.core.records import wire_bits

RECENT_ROUNDS = 25  # rows of the page's round table
SERIES_POINTS = 600  # commits kept for the sparklines
RATE_WINDOW_S = 60.0  # link rates are averaged over this window


@dataclass
class _Learner:
    state: str = "joined"
    generation: int = 0
    joins: int = 0
    joined_at: float = 0.0
    last_push_at: float | None = None
    pushes: int = 0
    carried: int = 0
    refused: int = 0
    not_waited_for: int = 0
    tokens: int = 0
    lag: int | None = None  # versions the fragment had moved past the base of the last merged push
    done_step: int | None = None
    traffic: dict[str, collections.deque[tuple[float, int]]] = field(
        default_factory=lambda: {"in": collections.deque(), "out": collections.deque()})
    total_bytes: dict[str, int] = field(default_factory=lambda: {"in": 0, "out": 0})


@dataclass
class _Fragment:
    version: int = 0
    last_commit: float | None = None
    learners: list[int] = field(default_factory=list)


class StatusBoard:
    def __init__(self, shape: Mapping[str, Any], num_fragments: int, clock: Callable[[], float] = time.time) -> None:
        self.shape = dict(shape)
        self._clock = clock
        self._lock = threading.Lock()
        self._started = clock()
        self._phase = "waiting for learner 0's initial weights"
        self._learners: dict[int, _Learner] = {}
        self._fragments = [_Fragment() for _ in range(num_fragments)]
        self._rounds: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT_ROUNDS)
        self._series: collections.deque[dict[str, Any]] = collections.deque(maxlen=SERIES_POINTS)
        self._counts = {"committed": 0, "retried": 0, "abandoned": 0, "carried": 0, "refused": 0}
        self._final: dict[str, Any] | None = None

    # -- the tape's records (coordinator thread) -------------------------------------------------
    def observe(self, record: Mapping[str, Any]) -> None:
        event = record.get("event")
        t = float(record.get("t", self._clock()))
        with self._lock:
            if event == "commit":
                self._commit(record, t)
            elif event in ("join", "left", "done", "replaced"):
                self._membership(str(event), record, t)
            elif event == "init":
                self._phase = "running"
                for fragment in self._fragments:
                    fragment.last_commit = t
            elif event == "carry":
                self._counts["carried"] += 1
                self._learner(record.get("learner")).carried += 1
            elif event == "refused":
                self._counts["refused"] += 1
                self._learner(record.get("learner")).refused += 1
            elif event in ("retry", "abandon"):
                self._counts["retried" if event == "retry" else "abandoned"] += 1
                self._rounds.append({"t": t, "round": record.get("round"), "attempt": record.get("attempt"),
                                     "fragment": record.get("fragment"), "decision": event,
                                     "reason": record.get("reason", ""), "learners": record.get("answered", [])})
            elif event == "final":
                self._phase = "finalizing"
                self._final = {"t": t, "rounds": record.get("rounds"), "reason": record.get("reason")}

    def _learner(self, learner_id: Any) -> _Learner:
        lid = int(learner_id) if learner_id is not None else -1
        if lid not in self._learners:
            self._learners[lid] = _Learner(joined_at=self._clock())
        return self._learners[lid]

    def _membership(self, event: str, rec: Mapping[str, Any], t: float) -> None:
        learner = self._learner(rec.get("learner"))
        if event == "join":
            learner.state, learner.generation, learner.joined_at = "connected", int(rec.get("generation", 0)), t
            learner.joins += 1
        elif event == "left":
            if int(rec.get("generation", learner.generation)) == learner.generation:
                learner.state = "gone" if learner.state != "done" else "done"
        elif event == "done":
            learner.state, learner.done_step = "done", rec.get("step")

    def _commit(self, rec: Mapping[str, Any], t: float) -> None:
        self._counts["committed"] += 1
        f = int(rec.get("fragment", 0))
        version = int(rec.get("version", 0))
        learners = list(rec.get("learners", []))
        if 0 <= f < len(self._fragments):
            self._fragments[f] = _Fragment(version, t, learners)
        bases = list(rec.get("base_versions", []))
        for i, (lid, tokens) in enumerate(zip(learners, rec.get("tokens", []), strict=False)):
            learner = self._learner(lid)
            learner.pushes += 1
            learner.tokens += int(tokens)
            learner.last_push_at = t
            if i < len(bases):
                learner.lag = max(0, version - 1 - int(bases[i]))
        for lid in rec.get("not_waited_for", []):
            self._learner(lid).not_waited_for += 1
        carried = rec.get("carried", [])
        bits = wire_bits(dict(rec))
        self._rounds.append({
            "t": t, "round": rec.get("round"), "attempt": rec.get("attempt"), "fragment": f, "version": version,
            "decision": "commit", "reason": rec.get("reason", ""), "learners": learners, "carried": carried,
            "not_waited_for": rec.get("not_waited_for", []), "wait_ms": rec.get("wait_ms"),
            "grace_ms": rec.get("grace_ms"), "merge_ms": rec.get("merge_ms"),
            "bits_up": None if bits is None else round(bits[0], 3),
            "bits_down": None if bits is None else round(bits[1], 3)})
        self._series.append({"t": t, "round": rec.get("round"), "tokens": sum(int(x) for x in rec.get("tokens", [])),
                             "consensus_js": rec.get("consensus_js")})

    # -- the shell's figures (any thread) ---------------------------------------------------------
    def traffic(self, direction: str, learner_id: int, codec: str, nbytes: int) -> None:
        now = self._clock()
        with self._lock:
            learner = self._learner(learner_id)
            window = learner.traffic[direction]
            window.append((now, nbytes))
            learner.total_bytes[direction] += nbytes
            while window and window[0][0] < now - RATE_WINDOW_S:
                window.popleft()

    def broadcast_done(self, seconds: float) -> None:
        """Broadcast times are the metrics' (`broadcast_seconds`); the page does not show them."""

    # -- the web server's threads ----------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        now = self._clock()
        with self._lock:
            learners = [self._learner_view(lid, learner, now) for lid, learner in sorted(self._learners.items())
                        if lid >= 0]
            fragments = [{"fragment": i, "version": f.version, "learners": f.learners,
                          "last_commit_age_s": None if f.last_commit is None else round(now - f.last_commit, 3)}
                         for i, f in enumerate(self._fragments)]
            return {
                "now": now, "started": self._started, "uptime_s": round(now - self._started, 3),
                "phase": self._phase, "shape": self.shape, "counts": dict(self._counts),
                "learners": learners, "fragments": fragments,
                "rounds": list(reversed(self._rounds)), "series": list(self._series), "final": self._final,
            }

    @staticmethod
    def _learner_view(lid: int, learner: _Learner, now: float) -> dict[str, Any]:
        rates = {}
        for direction, window in learner.traffic.items():
            recent = [n for at, n in window if at >= now - RATE_WINDOW_S]
            span = min(RATE_WINDOW_S, max(1.0, now - learner.joined_at))
            rates[direction] = round(sum(recent) / span, 1)
        return {
            "learner": lid, "state": learner.state, "generation": learner.generation, "joins": learner.joins,
            "pushes": learner.pushes, "tokens": learner.tokens, "carried": learner.carried,
            "refused": learner.refused, "not_waited_for": learner.not_waited_for, "lag": learner.lag,
            "last_push_age_s": None if learner.last_push_at is None else round(now - learner.last_push_at, 3),
            "bytes_in": learner.total_bytes["in"], "bytes_out": learner.total_bytes["out"],
            "in_bytes_per_s": rates["in"], "out_bytes_per_s": rates["out"], "done_step": learner.done_step,
        }
