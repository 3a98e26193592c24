"""`yeto-plan --probe` measures the link with yeto's bandwidth probe against a real syncer and plans
with what it measured; a wrong key is one line and exit code 2, and the syncer keeps serving."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, Procs, base_env, start_syncer

from syncer.tools.plan_cli import main

pytestmark = pytest.mark.integration


def plan(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "syncer.tools.plan_cli", *argv], cwd=ROOT, env=base_env(),
                          capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(120)
def test_plan_probes_a_running_syncer(procs: Procs, key_file: Path, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    syncer = start_syncer(procs, key_file=key_file, learners=1, quorum=1, fragments=1, total_rounds=4,
                          extra=["--init-timeout-s", "60"])
    common = ["--preset", "7b", "--lora-r", "8", "--islands", "3", "--step-s", "2", "--probe-mib", "4",
              "--probe", syncer.address]
    done = plan(*common, "--key-file", str(key_file), "--json")  # the real command, in a process of its own
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    islands = doc["islands"]
    assert len(islands) == 3 and len({(i["up_bps"], i["down_bps"]) for i in islands}) == 1  # one host, measured once
    assert islands[0]["up_bps"] > 10e6 / 8 and islands[0]["down_bps"] > 10e6 / 8  # loopback is far faster
    assert doc["recommended"]["choice"]["sync_interval"] >= 24

    assert main([*common, "--key-file", str(key_file)]) == 0  # the table, in this process (no second start-up)
    assert f"link measured by the bandwidth probe to {syncer.address}" in capsys.readouterr().out

    wrong = tmp_path / "wrong.key"
    wrong.write_text(secrets.token_hex(32))
    wrong.chmod(0o600)
    assert main([*common, "--key-file", str(wrong)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"yeto-plan: --probe {syncer.address}: the bandwidth probe failed")
    assert "wrong key" in err and err.count("\n") == 1, err
    assert syncer.proc.popen.poll() is None, "the syncer must keep serving after probes"
