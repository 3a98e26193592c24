"""The syncer's metrics from hand-written tape records: every counter is the count of its records."""

from __future__ import annotations

from pathlib import Path

import pytest

from syncer.service.metrics import SyncerMetrics, metric_names, readme_table

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def value(m: SyncerMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(f"yeto_syncer_{name}", labels)


def commit(round_id: int, fragment: int, t: float, **extra: object) -> dict[str, object]:
    return {"event": "commit", "round": round_id, "fragment": fragment, "version": round_id // 2 + 1, "t": t,
            "learners": [0, 1], "tokens": [100, 300], "not_waited_for": [], "wait_ms": 40.0, "grace_ms": 5.0,
            "merge_ms": 2.0, "fragment_l2": [0.5, 0.25], "consensus_js": 0.125, **extra}


def test_counters_follow_the_records_and_ages_are_taken_when_scraped() -> None:
    clock = Clock()
    m = SyncerMetrics(2, clock=clock)
    for lid in (0, 1):
        m.observe({"event": "join", "learner": lid, "generation": 1, "t": 990.0})
    m.observe({"event": "init", "t": 995.0})
    assert value(m, "fragment_staleness_seconds", fragment="1") == 5.0  # since the initial cut
    m.observe(commit(0, 0, 998.0, checkpoint_ms=12.0))
    m.observe({"event": "retry", "round": 1, "attempt": 1})
    m.observe({"event": "carry", "learner": 1, "round": 1})
    m.observe(commit(1, 1, 999.0, not_waited_for=[1], learners=[0], tokens=[50]))
    m.observe({"event": "abandon", "round": 2, "reason": "finalizing"})
    m.observe({"event": "refused", "learner": 1, "round": 2, "reason": "late"})
    m.observe({"event": "refused", "learner": 2, "code": "LAYOUT", "reason": "fingerprint"})
    m.observe({"event": "left", "learner": 1, "generation": 1, "reason": "gone"})
    m.observe({"event": "tape_gap", "lost": 3})  # not a metric: ignored
    assert value(m, "rounds_committed_total") == 2 and value(m, "rounds_retried_total") == 1
    assert value(m, "rounds_abandoned_total") == 1
    assert value(m, "fragment_version", fragment="0") == 1 and value(m, "fragment_version", fragment="1") == 1
    assert value(m, "learner_answered_total", learner="0") == 2 and value(m, "learner_answered_total", learner="1") == 1
    assert value(m, "learner_tokens_merged_total", learner="0") == 150
    assert value(m, "learner_tokens_merged_total", learner="1") == 300
    assert value(m, "learner_carried_total", learner="1") == 1
    assert value(m, "learner_not_waited_for_total", learner="1") == 1
    assert value(m, "learner_refused_total", learner="1", code="PUSH") == 1
    assert value(m, "learner_refused_total", learner="2", code="LAYOUT") == 1
    assert value(m, "learners_connected") == 1 and value(m, "learner_joins_total", learner="0") == 1
    assert value(m, "merge_seconds_count") == 2 and value(m, "merge_seconds_sum") == pytest.approx(0.004)
    assert value(m, "checkpoint_seconds_count") == 1 and value(m, "checkpoint_seconds_sum") == pytest.approx(0.012)
    assert value(m, "quorum_wait_seconds_sum") == pytest.approx(0.08)
    assert value(m, "fragment_l2", fragment="1") == 0.25 and value(m, "consensus_js") == 0.125
    clock.now = 1010.0
    assert value(m, "fragment_staleness_seconds", fragment="0") == 12.0
    assert value(m, "fragment_staleness_seconds", fragment="1") == 11.0
    assert value(m, "learner_last_seen_age_seconds", learner="0") == 11.0  # its last merged push
    assert value(m, "learner_last_seen_age_seconds", learner="1") == 12.0


def test_metric_names_follow_prometheus_conventions() -> None:
    names = metric_names()
    assert len(names) == len({n for n, *_ in names}) >= 15
    for name, kind, _labels, doc in names:
        assert name.startswith("yeto_syncer_") and doc, name
        assert name.endswith("_total") == (kind == "counter"), name
        assert not name.endswith(("_ms", "_milliseconds")), name  # base units


def test_the_readme_lists_every_metric_as_the_code_defines_it() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert readme_table() in readme, "README's metric table is stale: paste syncer.service.metrics.readme_table()"


def test_the_readme_lists_every_island_metric_as_the_code_defines_it() -> None:
    from yeto_core.learner_metrics import readme_table as island_table

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert island_table() in readme, "README's island metric table is stale: paste learner_metrics.readme_table()"


def test_an_islands_collector_reads_its_stats_when_scraped() -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from yeto_core.learner_metrics import LearnerCollector
    from yeto_core.learner_state import LearnerStats

    stats = LearnerStats(steps=12, tokens=768, pushes=3, bytes_pushed=4096, installs=5, round_trips=2,
                         round_trip_steps=9, consensus_js=None, fragment_l2=[0.5, None, 0.25])
    registry = CollectorRegistry()
    registry.register(LearnerCollector(lambda: stats, 7))
    stats.steps = 13  # read when scraped, not when registered
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}
    me = (("learner", "7"),)
    assert samples[("yeto_learner_steps_total", me)] == 13
    assert samples[("yeto_learner_tokens_total", me)] == 768
    assert samples[("yeto_learner_pushed_bytes_total", me)] == 4096
    assert samples[("yeto_learner_final_installed", me)] == 0
    assert samples[("yeto_learner_round_trips_total", me)] == 2
    assert samples[("yeto_learner_round_trip_steps_total", me)] == 9
    assert ("yeto_learner_consensus_js", me) not in samples  # no figure yet: no sample
    assert samples[("yeto_learner_fragment_l2", (("fragment", "0"), ("learner", "7")))] == 0.5
    assert ("yeto_learner_fragment_l2", (("fragment", "1"), ("learner", "7"))) not in samples
