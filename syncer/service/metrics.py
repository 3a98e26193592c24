"""The syncer's Prometheus metrics (`--metrics-port`), made from the records of its event tape.

Every decision a metric counts is already a tape record's (DESIGN §6.4): a commit names its
learners, tokens, waits and merge time; a retry, an abandon, a carry, a refusal, a join and a
departure are records of their own. So the metrics observe each record as the coordinator appends
it (`EventTape.listeners`), on the coordinator's thread, and at the end of a run their counters
equal the tape's counts by construction, whether or not the tape is written to a file. Ages (a
fragment's staleness, a learner's last contact) are computed when scraped. Three figures are no
tape record's: the bytes on the wire and the broadcasts' durations (the coordinator reports them,
`syncer/service/traffic.py`) and connections turned away before they named a learner (the server).

Names follow Prometheus' conventions: a `yeto_syncer_` prefix, base units (`_seconds`, `_bytes`),
`_total` on counters. `metric_names()` lists them for the README.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from syncer.core.records import wire_bits

PREFIX = "yeto_syncer"
DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class SyncerMetrics:
    """The metrics of one syncer, in a registry of their own (several syncers may share a process in tests)."""

    def __init__(self, num_fragments: int, clock: Callable[[], float] = time.time) -> None:
        self.registry = CollectorRegistry()
        self._clock = clock
        self._fragments = num_fragments
        self._lock = threading.Lock()
        self._last_commit: dict[int, float] = {}
        self._last_seen: dict[str, float] = {}
        r = self.registry

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(f"{PREFIX}_{name}", doc, labels, registry=r)

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(f"{PREFIX}_{name}", doc, labels, registry=r)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(f"{PREFIX}_{name}", doc, registry=r, buckets=DURATION_BUCKETS)

        self.rounds_committed = counter("rounds_committed", "fragment rounds committed")
        self.rounds_retried = counter("rounds_retried", "round attempts that closed without a quorum and were retried")
        self.rounds_abandoned = counter("rounds_abandoned", "rounds given up (finalizing, or their fragment moved on)")
        self.fragment_version = gauge("fragment_version", "the fragment's committed version", ("fragment",))
        self.fragment_staleness = gauge("fragment_staleness_seconds", "time since the fragment's last commit",
                                        ("fragment",))
        self.fragment_l2 = gauge("fragment_l2", "mean L2 norm of the learners' deltas of the fragment's last commit",
                                 ("fragment",))
        self.answered = counter("learner_answered", "pushes merged into a commit", ("learner",))
        self.commit_bytes = counter("commit_payload_bytes", "payload bytes of the commits' merged pushes (up) and "
                                    "of their broadcasts to every learner (down)", ("direction",))
        self.wire_bits = gauge("wire_bits_per_parameter", "the last commit's bits per parameter per learner: a "
                               "merged push's (up), a broadcast to one learner (down)", ("direction",))
        self.carried = counter("learner_carried", "late pushes carried into a later round", ("learner",))
        self.refused = counter("learner_refused", "pushes or handshakes refused", ("learner", "code"))
        self.not_waited_for = counter("learner_not_waited_for", "commits that closed without waiting for the learner",
                                      ("learner",))
        self.tokens_merged = counter("learner_tokens_merged", "trained tokens of the learner's merged pushes",
                                     ("learner",))
        self.last_seen_age = gauge("learner_last_seen_age_seconds", "time since the learner's last merged push, join "
                                   "or DONE", ("learner",))
        self.connected = gauge("learners_connected", "learners with a live connection")
        self.joins = counter("learner_joins", "connections accepted (a reconnect counts again)", ("learner",))
        self.quorum_wait = histogram("quorum_wait_seconds", "from a round's launch to its quorum")
        self.grace = histogram("grace_seconds", "the adaptive grace a commit waited past its quorum")
        self.merge = histogram("merge_seconds", "one commit's merge")
        self.checkpoint = histogram("checkpoint_seconds", "a checkpoint write, as the commit that took it waited")
        self.consensus_js = gauge("consensus_js", "Jensen-Shannon distance between the learners' probe outputs")
        self.broadcast = histogram("broadcast_seconds", "from a commit's broadcast being queued until every learner's "
                                   "socket took it")
        self.received = counter("learner_received_bytes", "bytes from the learner: bulk payloads under their codec, "
                                "control frames as codec=control", ("learner", "codec"))
        self.sent = counter("learner_sent_bytes", "bytes to the learner: bulk payloads under their codec, control "
                            "frames as codec=control", ("learner", "codec"))
        self.handshakes_refused = counter("handshakes_refused", "connections turned away before they joined, by "
                                          "reason (auth, layout, contract, duplicate, protocol, deadline, crowd, "
                                          "broken ...)", ("reason",))
        from yeto_core.buffers import RECEIVE_POOL

        self.receive_buffers = gauge("receive_buffers_allocated", "pooled receive buffers allocated since start: a "
                                     "run past its first rounds reuses them and stops adding to it")
        self.receive_buffers.set_function(lambda: RECEIVE_POOL.allocated)
        self.faulted_ahead = gauge("receive_buffers_faulted_ahead", "receive buffers readied for learner 0's INIT "
                                   "and made resident before it arrived (one per fragment where the kernel can)")
        self.faulted_ahead.set_function(lambda: RECEIVE_POOL.faulted_ahead)
        for f in range(num_fragments):
            self.fragment_version.labels(str(f)).set(0)
            self.fragment_staleness.labels(str(f)).set_function(self._age_of(self._last_commit, f))
        self._handlers: dict[str, Callable[[Mapping[str, Any]], None]] = {
            "commit": self._commit, "retry": lambda _: self.rounds_retried.inc(),
            "abandon": lambda _: self.rounds_abandoned.inc(), "carry": self._carry, "refused": self._refused,
            "join": self._join, "left": self._left, "done": self._seen, "init": self._init,
        }

    # -- the tape's records ----------------------------------------------------------------------
    def observe(self, record: Mapping[str, Any]) -> None:
        handler = self._handlers.get(str(record.get("event")))
        if handler is not None:
            handler(record)

    def _commit(self, rec: Mapping[str, Any]) -> None:
        now = float(rec.get("t", self._clock()))
        self.rounds_committed.inc()
        fragment = rec.get("fragment")
        if fragment is not None:
            self.fragment_version.labels(str(fragment)).set(rec.get("version", 0))
            with self._lock:
                self._last_commit[int(fragment)] = now
            l2 = (rec.get("fragment_l2") or [])
            if int(fragment) < len(l2) and l2[int(fragment)] is not None:
                self.fragment_l2.labels(str(fragment)).set(l2[int(fragment)])
        for learner, tokens in zip(rec.get("learners", []), rec.get("tokens", []), strict=False):
            self.answered.labels(str(learner)).inc()
            self.tokens_merged.labels(str(learner)).inc(tokens)
            self._touch(learner, now)
        for learner in rec.get("not_waited_for", []):
            self.not_waited_for.labels(str(learner)).inc()
        for name, key in ((self.quorum_wait, "wait_ms"), (self.grace, "grace_ms"), (self.merge, "merge_ms"),
                          (self.checkpoint, "checkpoint_ms")):
            if rec.get(key) is not None:
                name.observe(float(rec[key]) / 1000.0)
        if rec.get("consensus_js") is not None:
            self.consensus_js.set(rec["consensus_js"])
        bits = wire_bits(dict(rec))
        if bits is not None:
            for direction, key, value in (("up", "bytes_in", bits[0]), ("down", "bytes_out", bits[1])):
                self.commit_bytes.labels(direction).inc(int(rec[key]))
                self.wire_bits.labels(direction).set(value)

    def _carry(self, rec: Mapping[str, Any]) -> None:
        self.carried.labels(str(rec.get("learner"))).inc()

    def _refused(self, rec: Mapping[str, Any]) -> None:
        self.refused.labels(str(rec.get("learner")), str(rec.get("code", "PUSH"))).inc()

    def _join(self, rec: Mapping[str, Any]) -> None:
        learner = rec.get("learner")
        self.joins.labels(str(learner)).inc()
        self._touch(learner, float(rec.get("t", self._clock())))
        self.connected.inc()

    def _left(self, _rec: Mapping[str, Any]) -> None:
        self.connected.dec()

    def _seen(self, rec: Mapping[str, Any]) -> None:
        self._touch(rec.get("learner"), float(rec.get("t", self._clock())))

    def _init(self, rec: Mapping[str, Any]) -> None:
        now = float(rec.get("t", self._clock()))  # the initial cut: every fragment's version 0
        with self._lock:
            for f in range(self._fragments):
                self._last_commit.setdefault(f, now)

    # -- what the shell reports (`syncer/service/traffic.py`) and the server's refusals -------------------
    def traffic(self, direction: str, learner_id: int, codec: str, nbytes: int) -> None:
        (self.received if direction == "in" else self.sent).labels(str(learner_id), codec).inc(nbytes)

    def broadcast_done(self, seconds: float) -> None:
        self.broadcast.observe(seconds)

    def handshake_refused(self, reason: str) -> None:
        self.handshakes_refused.labels(reason).inc()

    # -- ages ------------------------------------------------------------------------------------
    def _touch(self, learner: Any, when: float) -> None:
        key = str(learner)
        with self._lock:
            first = key not in self._last_seen
            self._last_seen[key] = when
        if first:
            self.last_seen_age.labels(key).set_function(self._age_of(self._last_seen, key))

    def _age_of(self, table: dict[Any, float], key: Any) -> Callable[[], float]:
        def age() -> float:
            with self._lock:
                at = table.get(key)
            return 0.0 if at is None else max(0.0, self._clock() - at)
        return age


def metric_names() -> list[tuple[str, str, str, str]]:
    """(name, type, labels, help) of every metric, in definition order: the README's table."""
    metrics = SyncerMetrics(1)
    labels = {m._name: ", ".join(m._labelnames) for m in vars(metrics).values()
              if isinstance(m, (Counter, Gauge, Histogram))}
    return [(family.name + ("_total" if family.type == "counter" else ""), family.type, labels.get(family.name, ""),
             family.documentation) for family in metrics.registry.collect()]


def readme_table() -> str:
    rows = [f"| `{name}` | {kind} | {labels} | {doc} |" for name, kind, labels, doc in metric_names()]
    return "\n".join(["| metric | type | labels | meaning |", "|---|---|---|---|", *rows])
