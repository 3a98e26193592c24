"""The syncer's half of the consensus signal (DESIGN §8.2, §8.3): how far apart the islands are.

`ConsensusBoard` keeps each connected learner's latest probe summary (PROBE_REPORT) and, after
every commit, reports

* `consensus_js`: the mean pairwise Jensen–Shannon distance (`yeto_core.consensus`) between the
  latest summaries of *comparable* learners: those whose summary was taken holding at least
  `newest − P` merged versions in total (P = fragments), `newest` being the most advanced
  summary's count. Each learner probes right after installing merged fragments, so this pairs
  learners at most about one round-robin of fragment rounds apart, and leaves out a learner that
  stopped reporting (finished, or probing switched off) once the others moved on;
* `fragment_l2`: per fragment, the mean L2 norm of the learners' deltas d = θ − anchor merged
  in that fragment's latest commit (their distance from the global value they started from).

The coordinator puts both into the commit's tape record and log line and sends them to the
learners as CONSENSUS. Plain bookkeeping: no sockets, no clocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from yeto_core.consensus import ProbeSummary, decode_summary, pairwise_js
from yeto_core.wire.messages import UNKNOWN, Consensus, ProbeReport


@dataclass(frozen=True)
class Report:
    summary: ProbeSummary
    installed: int  # sum of the fragment versions the learner held when it probed
    step: int


class ConsensusBoard:
    def __init__(self, num_fragments: int) -> None:
        self.num_fragments = num_fragments
        self.reports: dict[int, Report] = {}
        self.fragment_l2: list[float | None] = [None] * num_fragments
        self.js: float | None = None
        self.compared: list[int] = []
        self._stale = False  # a report arrived or left since `js` was computed

    def observe(self, learner_id: int, msg: ProbeReport) -> str | None:
        """Keep a learner's newest summary; the reason it is unusable, or None."""
        try:
            summary = decode_summary(msg.summary)
        except ValueError as exc:
            return f"probe summary of learner {learner_id}: {exc}"
        others = [(lid, r.summary) for lid, r in self.reports.items() if lid != learner_id]
        if others and (others[0][1].tokens, others[0][1].vocab) != (summary.tokens, summary.vocab):
            lid, other = others[0]
            return (f"probe summary of learner {learner_id} covers {summary.tokens} tokens over {summary.vocab} "
                    f"ids; learner {lid}'s covers {other.tokens} over {other.vocab} (islands must probe the same "
                    "batch of the same model)")
        self.reports[learner_id] = Report(summary, msg.installed, msg.step)
        self._stale = True
        return None

    def forget(self, learner_id: int) -> None:
        if self.reports.pop(learner_id, None) is not None:
            self._stale = True

    def comparable(self) -> dict[int, ProbeSummary]:
        if not self.reports:
            return {}
        newest = max(r.installed for r in self.reports.values())
        return {lid: r.summary for lid, r in sorted(self.reports.items())
                if newest - r.installed <= self.num_fragments}

    def on_commit(self, fragment: int, delta_norms: list[float]) -> dict[str, Any]:
        """Update after fragment `fragment` committed; the fields for its tape record."""
        if delta_norms:
            self.fragment_l2[fragment] = sum(delta_norms) / len(delta_norms)
        if self._stale:
            peers = self.comparable()
            self.js = pairwise_js(peers)
            self.compared = sorted(peers) if self.js is not None else []
            self._stale = False
        return {
            "consensus_js": None if self.js is None else round(self.js, 6),
            "consensus_learners": list(self.compared),
            "fragment_l2": [None if v is None else round(v, 6) for v in self.fragment_l2],
        }

    def message(self, round_id: int) -> Consensus:
        return Consensus(round_id, len(self.compared), UNKNOWN if self.js is None else min(max(self.js, 0.0), 1.0),
                         tuple(UNKNOWN if v is None else v for v in self.fragment_l2))

    def log_suffix(self) -> str:
        js = "n/a" if self.js is None else f"{self.js:.4f}"
        known = [v for v in self.fragment_l2 if v is not None]
        l2 = "n/a" if not known else f"{sum(known) / len(known):.4g}"
        return f", consensus JS {js}, fragment L2 mean {l2}"
