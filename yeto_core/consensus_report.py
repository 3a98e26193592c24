"""The learner's half of the consensus signal (DESIGN §8.1).

After the session installs merged fragments (at most once every `consensus_every` installs; the
initial cut does not count) it calls the trainer plugin's probe on the training thread, under
`torch.no_grad()`, summarizes the logits (`yeto_core.consensus.summarize`) and sends the summary
to the syncer as PROBE_REPORT. The syncer answers every commit with CONSENSUS (the learners'
mean pairwise Jensen–Shannon distance, the per-fragment L2 drift); the newest values land in the
session's stats for the plugin's logs. A probe that fails is logged once and switched off: a
metric never stops training.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from yeto_core.consensus import encode_summary, summarize
from yeto_core.sections import ConsensusSettings
from yeto_core.wire.messages import UNKNOWN, Consensus, Message, ProbeReport

log = logging.getLogger("yeto.consensus")

Probe = Callable[[], torch.Tensor]  # logits [T, V] of the island's model on the fixed probe batch
PROBE_SEED = 0x7965746F  # b"yeto": the same batch on every island, whatever the trainer's seed


def probe_ids(vocab: int, tokens: int, seed: int = PROBE_SEED) -> torch.Tensor:
    """The fixed probe batch, [1, tokens], from a private generator (the global RNG is untouched):
    every plugin's probe feeds its model these ids, so islands of any trainer compare alike."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (1, tokens), generator=generator)


class ConsensusReporter:
    def __init__(self, probe: Probe | None, settings: ConsensusSettings, *, learner_id: int = 0) -> None:
        self._probe = probe
        self.every = settings.every
        self.top_k = settings.top_k
        self.learner_id = learner_id
        self.enabled = probe is not None and settings.every > 0
        self.reports = 0
        self._mark: int | None = None  # installs counted when the last probe ran

    def after_installs(self, installs: int, installed: int, step: int, send: Callable[[Message], bool]) -> bool:
        """Probe and report if `consensus_every` installs happened since the last probe; True if sent.
        `installs` counts installs so far, `installed` sums the fragment versions now held."""
        if not self.enabled:
            return False
        if self._mark is None:
            self._mark = installs  # the installs before the first step are the initial cut
            return False
        if installs - self._mark < self.every:
            return False
        self._mark = installs
        try:
            with torch.no_grad():
                logits = self._probe()  # type: ignore[misc]
            body = encode_summary(summarize(logits, self.top_k))
        except Exception:
            log.exception("learner %d: the consensus probe failed; consensus reporting is off", self.learner_id)
            self.enabled = False
            return False
        if not send(ProbeReport(step, max(0, installed), body)):
            return False
        self.reports += 1
        return True


def known(value: float) -> float | None:
    return None if value == UNKNOWN else value


def metrics(msg: Consensus) -> tuple[float | None, list[float | None]]:
    """(JS distance, per-fragment L2) of a CONSENSUS message, None where not measured yet."""
    return known(msg.js), [known(v) for v in msg.fragment_l2]
