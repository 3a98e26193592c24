"""The `verl.plugins` entry point (`[project.entry-points."verl.plugins"] yeto`).

verl imports every entry point of that group in every process that imports verl (the driver, the
task runner, each worker) and never calls anything in it (verl 0.9.1 `verl/__init__.py:55-76`),
so yeto attaches here, at import, and only where it is configured: any `YETO_DILOCO_*` variable
set. Without one this module imports nothing and changes nothing.

Attaching sets `ActorRolloutRefWorker.actor_worker_cls`, verl's own subclassing point for the
actor's inner training worker (`verl/workers/engine_workers.py:459`, used at `:644`), to
`YetoTrainingWorker`; the ref model and the critic keep verl's class. verl swallows a plugin's
errors at DEBUG (`verl/__init__.py:75-76`), so a failure to attach is printed to stderr here, and
settings that do not validate stop the run when the actor is built, with their own message
(`worker.attach`), instead of letting the island train on alone unnoticed.
"""

from __future__ import annotations

import sys

from yeto_core.settings import LearnerSettings, configured


def _attach() -> None:
    if not configured(LearnerSettings):
        return
    try:
        from yeto_plugins.verl.worker import attach

        attach()
    except Exception as exc:
        print(f"yeto: the verl plugin could not attach ({type(exc).__name__}: {exc}); this island would train "
              "without DiLoCo", file=sys.stderr, flush=True)
        raise


_attach()
