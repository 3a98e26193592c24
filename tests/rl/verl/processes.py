"""Processes for the verl tests: the shared ones (`tests/harness/trainer_processes.py`) with verl's CPU platform.

verl runs on the CPU platform `cpu_platform.py` registers; its FSDP engine is registered for cuda/npu only, so the
engine device is named cuda (see cpu_platform.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import trainer_processes as shared
from trainer_processes import REPOSITORY, Run, Syncer, start_syncer, stop, stopped_at_exit

__all__ = ["HARNESS_ENV", "HERE", "REPOSITORY", "Run", "Syncer", "island_env", "start", "start_syncer", "stop",
           "stopped_at_exit", "torchrun"]

HERE = Path(__file__).resolve().parent
HARNESS_ENV = {**shared.QUIET_ENV, "VERL_PLATFORM": "cpu", "VERL_ENGINE_DEVICE": "cuda"}


def start(name: str, argv: Sequence[str], log: Path, env: Mapping[str, str] | None = None) -> Run:
    return shared.start(name, argv, log, {**HARNESS_ENV, **(env or {})})


def torchrun(script: Path, ranks: int, args: Sequence[str], log: Path, env: Mapping[str, str] | None = None,
             name: str | None = None) -> Run:
    return shared.torchrun(script, ranks, args, log, {**HARNESS_ENV, **(env or {})}, name)


def island_env(syncer: Syncer, learner_id: int, **settings: object) -> dict[str, str]:
    """What makes a verl process an island: `YETO_DILOCO_*` (verl's entry point attaches on them)."""
    return {**shared.island_env(syncer, learner_id, **{"consensus_every": 0, **settings}),
            "VERL_USE_EXTERNAL_PLUGINS": "auto"}
