"""A Ray cluster started before the job (`ray start --head`, then verl's driver connects to it) does not
hand the driver's environment to its workers; yeto's verl entry point carries the driver's `YETO_DILOCO_*`
in `ray.init`'s `runtime_env`, so the actor joins as an island instead of training alone without a word.
The key itself is not carried (Ray's dashboard shows a job's environment): the driver says so, and a
worker without a key stops at its start. Ray listens on every interface, so the cluster and the driver
run in a network namespace of their own with only loopback up."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(240)

SCENARIO = r"""
import json, os, signal, socket, subprocess, sys, tempfile, time
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
base = {k: v for k, v in os.environ.items() if not k.startswith("YETO_")}
head = subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--num-cpus", "1",
                         "--node-ip-address", "127.0.0.1", "--port", str(port), "--include-dashboard", "false",
                         "--disable-usage-stats", "--temp-dir", tempfile.mkdtemp(prefix="yr")], env=base,
                        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
DRIVER = '''
import json, os, sys
import ray
import verl  # loads verl's plugins, yeto's entry point among them, as verl's driver does
ray.init(address=sys.argv[1], runtime_env={"env_vars": {"YETO_DILOCO_LEARNER_ID": "5"}})
@ray.remote
def seen():
    return {k: v for k, v in os.environ.items() if k.startswith("YETO_")}
print(json.dumps(ray.get(seen.remote(), timeout=90)))
'''
cases = {
    "key_file": {"YETO_DILOCO_SYNCER": "127.0.0.1:7070", "YETO_DILOCO_KEY_FILE": "/nonexistent/yeto.key",
                 "YETO_DILOCO_LEARNER_ID": "1", "YETO_DILOCO_SYNC_INTERVAL": "12"},
    "inline_key": {"YETO_DILOCO_SYNCER": "127.0.0.1:7070", "YETO_DILOCO_KEY": "0123456789abcdef01"},
}
out = {}
try:
    for name, yeto in cases.items():
        for attempt in range(90):  # until the head accepts drivers
            run = subprocess.run([sys.executable, "-c", DRIVER, f"127.0.0.1:{port}"], env={**base, **yeto},
                                 capture_output=True, text=True, timeout=150)
            if run.returncode == 0 or attempt == 89 or "onnect" not in run.stderr:
                break
            time.sleep(1)
        lines = run.stdout.strip().splitlines()
        out[name] = {"rc": run.returncode, "seen": json.loads(lines[-1]) if run.returncode == 0 else None,
                     "stderr": run.stderr[-4000:]}
finally:
    os.killpg(head.pid, signal.SIGKILL)
    head.wait(30)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def drivers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.fail("this test runs Ray in a network namespace of its own: it needs `unshare` and `ip` (util-linux, "
                    "iproute2)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("YETO_", "RAY_"))}
    env["HOME"] = str(tmp_path_factory.mktemp("home"))  # Ray reads and writes ~/.ray (its auth token): not the user's
    run = subprocess.run(["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$0" -c "$1"', sys.executable,
                          SCENARIO], env=env, capture_output=True, text=True, timeout=220, start_new_session=True)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    report: dict[str, dict[str, object]] = json.loads(run.stdout.strip().splitlines()[-1])
    return report


def test_the_drivers_settings_reach_a_worker_of_a_cluster_started_before_the_job(
        drivers: dict[str, dict[str, object]]) -> None:
    got = drivers["key_file"]
    assert got["rc"] == 0, got["stderr"]
    # Every YETO_DILOCO_* of the driver; a value the job's own runtime_env gives wins.
    assert got["seen"] == {"YETO_DILOCO_SYNCER": "127.0.0.1:7070", "YETO_DILOCO_KEY_FILE": "/nonexistent/yeto.key",
                           "YETO_DILOCO_LEARNER_ID": "5", "YETO_DILOCO_SYNC_INTERVAL": "12"}, got
    assert "is not passed to Ray workers" not in str(got["stderr"])


def test_the_key_itself_stays_with_the_driver_which_says_what_to_use(drivers: dict[str, dict[str, object]]) -> None:
    got = drivers["inline_key"]
    assert got["rc"] == 0, got["stderr"]
    assert got["seen"] == {"YETO_DILOCO_SYNCER": "127.0.0.1:7070", "YETO_DILOCO_LEARNER_ID": "5"}, got
    assert "YETO_DILOCO_KEY is not passed to Ray workers" in str(got["stderr"]) and "KEY_FILE" in str(got["stderr"])
