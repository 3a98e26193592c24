"""The bandwidth probe (DESIGN §7.6) against the real syncer: it measures, it is sealed with the key,
and a learner whose link is below its minimum exits with code 75 saying what it measured (the session
raises `ProbeFailed`; the script, which owns its process, prints it and exits with its code)."""

from __future__ import annotations

import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, Procs, base_env, start_syncer

from yeto_core.probe import PROBE_EXIT_CODE, measure_link
from yeto_core.wire.errors import ErrorCode, Refused

pytestmark = pytest.mark.integration

SCRIPT = """
import sys
import torch
from yeto_core.learner import LearnerSession
from yeto_core.refusal import ProbeFailed
from yeto_core.settings import LearnerSettings, load_settings
model = torch.nn.Linear(4, 4)
session = LearnerSession(load_settings(LearnerSettings), list(model.named_parameters()))
try:
    session.start()
except ProbeFailed as exc:
    print(exc, file=sys.stderr)
    sys.exit(exc.exit_code)
session.close()
print("joined")
"""


@pytest.mark.timeout(90)
def test_probe_measures_and_a_too_slow_island_exits_75(procs: Procs, key_file: Path) -> None:
    syncer = start_syncer(procs, key_file=key_file, learners=1, quorum=1, fragments=1, total_rounds=4,
                          extra=["--init-timeout-s", "60"])
    key = key_file.read_bytes().strip()
    result = measure_link(("127.0.0.1", syncer.port), key, up_bytes=8 << 20, down_bytes=8 << 20)
    assert result.up_mbps > 10 and result.down_mbps > 10, result  # loopback is far faster than this

    with pytest.raises(Refused) as refused:
        measure_link(("127.0.0.1", syncer.port), secrets.token_bytes(32), up_bytes=1 << 20, down_bytes=0)
    assert refused.value.code is ErrorCode.AUTH and "bandwidth probe" in refused.value.reason

    env = base_env({"YETO_DILOCO_SYNCER": syncer.address, "YETO_DILOCO_KEY_FILE": str(key_file),
                    "YETO_DILOCO_LEARNER_ID": "0", "YETO_DILOCO_WAN_PROBE_MIN_MBPS": "1e9",
                    "YETO_DILOCO_WAN_PROBE_MIB": "4"})
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == PROBE_EXIT_CODE, out.stderr
    assert "too slow to join: link to" in out.stderr and "Mbit/s up" in out.stderr, out.stderr
    assert "YETO_DILOCO_WAN_PROBE_MIN_MBPS=1e+09" in out.stderr, out.stderr
    assert "joined" not in out.stdout
    assert syncer.proc.popen.poll() is None, "the syncer must keep serving after probes"
