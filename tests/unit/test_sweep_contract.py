"""A learner that sweeps (RL iterations: every fragment at once, DESIGN §3.4) tells the syncer so in
HELLO, and a syncer whose round schedule cannot serve it refuses it at once, naming the flag."""

from __future__ import annotations

import pytest

from syncer.core.links import sweep_problem
from yeto_core.wire.connection import SWEEP_FLAGS
from yeto_core.wire.messages import HELLO_SWEEP_OVERLAP, HELLO_SWEEPS

pytestmark = pytest.mark.unit


def test_each_rl_mode_has_its_hello_flags() -> None:
    assert SWEEP_FLAGS == {"stream": 0, "sweep": HELLO_SWEEPS, "overlap": HELLO_SWEEPS | HELLO_SWEEP_OVERLAP}


def test_a_streaming_learner_fits_any_schedule() -> None:
    assert sweep_problem(0, fragments=4, pipeline=1, sync_interval_steps=24) is None


def test_sweeps_need_rounds_unpaced_by_learner_steps() -> None:
    assert sweep_problem(HELLO_SWEEPS, fragments=4, pipeline=1, sync_interval_steps=0) is None
    problem = sweep_problem(HELLO_SWEEPS, fragments=4, pipeline=4, sync_interval_steps=24)
    assert problem is not None and "--sync-interval-steps 24" in problem and "--sync-interval-steps 0" in problem


def test_overlap_needs_every_fragment_of_a_sweep_in_flight() -> None:
    flags = HELLO_SWEEPS | HELLO_SWEEP_OVERLAP
    assert sweep_problem(flags, fragments=4, pipeline=4, sync_interval_steps=0) is None
    assert sweep_problem(flags, fragments=4, pipeline=8, sync_interval_steps=0) is None
    problem = sweep_problem(flags, fragments=4, pipeline=2, sync_interval_steps=8)
    assert problem is not None and "--pipeline 2" in problem and "--pipeline 4" in problem
    assert "--sync-interval-steps 8" in problem  # both named, in one line
