"""Run many seeds, each checked, across worker processes; a failure names its seed."""

from __future__ import annotations

import logging
import multiprocessing
import os
import traceback
from collections.abc import Iterable

REPLAY = ".venv/bin/python -m tests.sim --seed {seed} --verbose"


def replay_command(seed: int) -> str:
    return REPLAY.format(seed=seed)


def one_seed(seed: int, quiet: bool = True) -> list[str]:
    """The invariants seed `seed` broke (an exception is one)."""
    from tests.sim.invariants import check
    from tests.sim.world import simulate

    if quiet:
        logging.disable(logging.CRITICAL)
    try:
        return simulate(seed, check)
    except Exception:
        return [f"raised: {traceback.format_exc(limit=-6)}"]


def _worker_init() -> None:
    """A checkpoint's progress bar would make tqdm's default lock, a semaphore that outlives the pool."""
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def _quiet_seed(seed: int) -> tuple[int, list[str]]:
    return seed, one_seed(seed)


def run_seeds(seeds: Iterable[int], *, workers: int | None = None, quiet: bool = True) -> list[tuple[int, list[str]]]:
    seeds = list(seeds)
    workers = workers or len(os.sched_getaffinity(0))
    if workers <= 1 or len(seeds) <= 1:
        results = [(s, one_seed(s, quiet)) for s in seeds]
    else:
        with multiprocessing.get_context("spawn").Pool(workers, initializer=_worker_init) as pool:
            results = pool.map(_quiet_seed, seeds, chunksize=max(1, len(seeds) // (workers * 8)))
    return [(s, problems) for s, problems in results if problems]
