"""What an island does when it may not join: the syncer refuses it for good, or its link is too slow.

A permanent refusal (wrong key, another model or layout, another session contract, or a learner
id that another live process holds) cannot be cured by redialing. By default the island stops:
its trainer gets `IslandRefused` at the next call into the session, so the process ends with the
refusal as its error and a non-zero exit instead of spending its whole step budget on a run it
never joins. `YETO_DILOCO_ALONE_IF_REFUSED=1` trains on alone instead (the old behaviour).
Transient failures (syncer down, network) never come here: the link redials.

A link measured below the island's minimum rate (DESIGN §7.6) raises `ProbeFailed` from `start`,
before the island joins. It carries the exit code the island's process should end with (75,
EX_TEMPFAIL: a supervisor may place the island elsewhere) and the one line that says why; the
code that owns the process (a plugin's entry into a trainer, `yeto_plugins.exits`; a script of
one's own) prints the line and exits with the code. yeto_core itself never prints it nor exits.
"""

from __future__ import annotations

from yeto_core.probe import PROBE_EXIT_CODE
from yeto_core.settings import LearnerSettings
from yeto_core.wire.errors import Refused


class IslandRefused(RuntimeError):
    """The syncer refused this island for good; the message says why and what to change."""

    def __init__(self, settings: LearnerSettings, refusal: Refused) -> None:
        super().__init__(f"yeto learner {settings.learner_id}: refused by the syncer at {settings.syncer} "
                         f"({refusal.code.name.lower()}): {refusal.reason}; this island stops "
                         "(YETO_DILOCO_ALONE_IF_REFUSED=1 trains it on alone instead)")
        self.refusal = refusal


def stop_if_refused(settings: LearnerSettings, refusal: Refused | None) -> bool:
    """Raise `IslandRefused` for a permanent refusal unless the island may train alone; True when
    it was refused and trains on alone."""
    if refusal is None:
        return False
    if settings.alone_if_refused:
        return True
    raise IslandRefused(settings, refusal)


class ProbeFailed(RuntimeError):
    """The link to the syncer is too slow for this island to join, or could not be measured.
    `str()` is the line for the user; `exit_code` what the island's process should exit with."""

    def __init__(self, settings: LearnerSettings, reason: str, *, exit_code: int = PROBE_EXIT_CODE) -> None:
        super().__init__(f"yeto learner {settings.learner_id}: too slow to join: {reason}")
        self.learner_id = settings.learner_id
        self.reason = reason
        self.exit_code = exit_code
