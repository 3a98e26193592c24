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

import importlib
import sys
from typing import Any

from yeto_core.setting_names import configured, environment_of
from yeto_core.settings import LearnerSettings

PREFIX = "YETO_DILOCO_"
SECRET = PREFIX + "KEY"  # the key itself: Ray keeps a job's runtime_env where its dashboard shows it


def _attach() -> None:
    if not configured(LearnerSettings):
        return
    try:
        from yeto_plugins.verl.worker import attach

        attach()
        carry_settings_to_ray()
    except Exception as exc:
        print(f"yeto: the verl plugin could not attach ({type(exc).__name__}: {exc}); this island would train "
              "without DiLoCo", file=sys.stderr, flush=True)
        raise


def carry_settings_to_ray() -> None:
    """Have every `ray.init` of this process pass its `YETO_DILOCO_*` variables to the job's workers
    (`runtime_env.env_vars`, values the caller gave kept). A local Ray that `ray.init` starts inherits
    them anyway; a cluster started before the job (`ray start --head`, then `main_ppo`) does not,
    and its actor would train alone without a word. verl's driver calls `ray.init(**kwargs)` on the
    module (verl 0.9.1 `verl/trainer/main_ppo.py:74`), after importing verl, which loaded this.
    The key itself is not carried (`SECRET`): a worker without it stops at its start, naming it."""
    try:
        ray: Any = importlib.import_module("ray")
    except ImportError:  # a process of verl's without Ray has no workers to tell
        return
    if getattr(ray.init, "yeto_carries", False):
        return
    original = ray.init

    def init(*args: Any, **kwargs: Any) -> Any:
        kwargs["runtime_env"] = with_settings(kwargs.get("runtime_env"), environment_of(LearnerSettings))
        return original(*args, **kwargs)

    init.yeto_carries = True  # type: ignore[attr-defined]
    ray.init = init


def with_settings(runtime_env: Any, settings: dict[str, str]) -> dict[str, Any]:
    """`runtime_env` (None, or Ray's dict) with the `YETO_DILOCO_*` `settings` added to its `env_vars`."""
    ours = {k: v for k, v in settings.items() if k != SECRET}
    if SECRET in settings:
        print(f"yeto: {SECRET} is not passed to Ray workers (Ray's dashboard shows a job's environment); a "
              f"cluster started before this job needs {PREFIX}KEY_FILE, readable on every node", file=sys.stderr,
              flush=True)
    merged = dict(runtime_env or {})
    merged["env_vars"] = {**ours, **dict(merged.get("env_vars") or {})}
    return merged


_attach()
