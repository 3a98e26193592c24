"""An island's own Prometheus `/metrics` (`YETO_DILOCO_METRICS_PORT`, rank 0 only).

The trainer's logs already carry the `yeto_*` figures; a scraper that watches every island beside
the syncer reads them here. A collector reads the learner session's counters when scraped: nothing
is copied on the training thread, and a scrape reads plain numbers the training thread writes. The
HTTP shell (`yeto_core.web_server`) bounds what a client may cost the trainer's process, and asks
for a token when `YETO_DILOCO_METRICS_TOKEN_FILE` names one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from yeto_core.buffers import RECEIVE_POOL
from yeto_core.learner_state import LearnerStats
from yeto_core.store import FRAGMENT_POOL
from yeto_core.web_server import Reply, WebServer, web_app

PREFIX = "yeto_learner"
# (name, type, help, read): every figure of `LearnerStats` a dashboard plots, in base units.
FIGURES: tuple[tuple[str, str, str, Callable[[LearnerStats], float | None]], ...] = (
    ("steps", "counter", "optimizer steps accounted", lambda s: s.steps),
    ("tokens", "counter", "trained tokens accounted", lambda s: s.tokens),
    ("pushes", "counter", "pushes that went out whole", lambda s: s.pushes),
    ("push_failures", "counter", "pushes that failed on the wire", lambda s: s.push_failures),
    ("pushed_bytes", "counter", "wire bytes of the pushes that went out", lambda s: s.bytes_pushed),
    ("replays", "counter", "pushes sent again when the syncer re-pulled their round", lambda s: s.replays),
    ("nonfinite_deltas", "counter", "pulls not answered because the delta held NaN or Inf",
     lambda s: s.nonfinite_deltas),
    ("installs", "counter", "merged fragments installed", lambda s: s.installs),
    ("round_trips", "counter", "pushes whose round's merge was installed", lambda s: s.round_trips),
    ("round_trip_steps", "counter", "steps trained from each such push to that install (÷ round_trips: the mean)",
     lambda s: s.round_trip_steps),
    ("rebases", "counter", "overlap installs that dropped a merged push from the weights", lambda s: s.rebases),
    ("moments_shared", "counter", "installs that took the fleet's optimizer first moment (DESIGN §3.9)",
     lambda s: s.moments_shared),
    ("blocked_seconds", "counter", "time steps waited for blocking fragments", lambda s: s.blocked_s),
    ("training_thread_seconds", "counter", "the training thread's time inside yeto (step and sweep calls, "
     "waits included)", lambda s: s.in_yeto_s),
    ("lockstep_misses", "counter", "lockstep waits that ran out of time", lambda s: s.lockstep_misses),
    ("connections", "counter", "connections to the syncer made (a reconnect counts again)",
     lambda s: len(s.connected_generations)),
    ("buffers_allocated", "gauge", "pooled fragment and receive buffers this process allocated: a run past its first "
     "rounds reuses them and stops adding to it", lambda s: RECEIVE_POOL.allocated + FRAGMENT_POOL.allocated),
    ("final_installed", "gauge", "1 once the syncer's final cut is installed", lambda s: int(s.final_installed)),
    ("consensus_js", "gauge", "the syncer's latest Jensen-Shannon distance between the learners",
     lambda s: s.consensus_js),
)


class LearnerCollector(Collector):
    def __init__(self, stats: Callable[[], LearnerStats], learner_id: int) -> None:
        self._stats = stats
        self._learner = str(learner_id)

    def collect(self) -> Iterator[Any]:
        stats = self._stats()
        for name, kind, doc, read in FIGURES:
            value = read(stats)
            family: CounterMetricFamily | GaugeMetricFamily
            if kind == "counter":
                family = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=["learner"])
            else:
                family = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=["learner"])
            if value is not None:
                family.add_metric([self._learner], float(value))
            yield family
        l2 = GaugeMetricFamily(f"{PREFIX}_fragment_l2", "mean L2 norm of the merged deltas of the fragment's last "
                               "commit, as the syncer reported it", labels=["learner", "fragment"])
        for f, value in enumerate(list(stats.fragment_l2)):
            if value is not None:
                l2.add_metric([self._learner, str(f)], float(value))
        yield l2


class LearnerMetricsServer:
    """`/metrics` of one learner on a daemon thread (with `token`, only for who sends it); `port` is
    the bound one. Raises OSError when the address cannot be bound."""

    def __init__(self, stats: Callable[[], LearnerStats], learner_id: int, host: str, port: int, *,
                 token: bytes | None = None) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(LearnerCollector(stats, learner_id))
        routes = {"/metrics": lambda: Reply(CONTENT_TYPE_LATEST, generate_latest(self.registry))}
        self._server = WebServer(web_app(routes, token=token), host, port, name="yeto-learner-metrics")
        self.port = self._server.port

    def close(self) -> None:
        self._server.close()


def readme_table() -> str:
    """The README's list of an island's metrics."""
    rows = [f"| `{PREFIX}_{name}{'_total' if kind == 'counter' else ''}` | {kind} | {doc} |"
            for name, kind, doc, _ in FIGURES]
    rows.append(f"| `{PREFIX}_fragment_l2` | gauge | mean L2 norm of the merged deltas of the fragment's last commit "
                "(label fragment) |")
    return "\n".join(["| metric (label learner) | type | meaning |", "|---|---|---|", *rows])
