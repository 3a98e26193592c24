"""`examples/verl/cpu_islands.sh`, the CPU example of the verl README, runs as documented: a local syncer and two
islands of verl's real actor, and both rollouts end on the syncer's final checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from processes import REPOSITORY


@pytest.mark.timeout(300)
def test_the_cpu_example_ends_with_both_rollouts_on_the_final_cut(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("YETO_")}
    env.update({"PYTHON": sys.executable, "RL_MODE": "overlap", "ITERATIONS": "2", "TMPDIR": str(tmp_path)})
    done = subprocess.run(["bash", str(REPOSITORY / "examples" / "verl" / "cpu_islands.sh")], cwd=REPOSITORY,
                          env=env, capture_output=True, text=True, timeout=280, start_new_session=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert done.stdout.count("final cut installed; its rollout holds the syncer's final weights bit for bit: True") == 2
    assert "round 3 committed" in done.stdout, done.stdout  # the last sweep merged before the final cut
    assert not list(tmp_path.glob("yeto-verl.*")), "the example left its work directory behind"
