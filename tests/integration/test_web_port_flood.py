"""Nobody can stop a run through the syncer's web port (`--metrics-port`), which is private unless asked.

* A crowd of 200 connections trickling HTTP header bytes at the web port of a syncer under
  `ulimit -n 128` (with a checkpoint and a tape): the port's connection cap leaves the rest of
  the crowd in the kernel's backlog, so a learner still joins, rounds commit, checkpoints are
  written and the run finalizes with exit 0; the syncer's threads and CPU stay flat meanwhile,
  and once the crowd leaves the port answers again.
* `--host 0.0.0.0` publishes the learners' port, not the web port: that stays on 127.0.0.1 unless
  `--metrics-host` says otherwise. With `--metrics-token-file`, `/metrics` is 401 without the
  token and 200 with it (as Prometheus sends it, or as a browser's Basic password); a token file
  that cannot be read is one line and exit 2.
"""

from __future__ import annotations

import base64
import os
import re
import socket
import sys
import time
import urllib.error
import urllib.request
from email.message import Message
from pathlib import Path

import pytest
from conftest import Island, Procs, Syncer, start_syncer, syncer_exit_code, wait_until
from crowd import Crowd
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.integration
URL_LINE = re.compile(r"^yeto syncer metrics on http://([^:/\s]+):(\d+)/metrics$", re.MULTILINE)
DESCRIPTORS = 128
CROWD = 200
ROUNDS = 8
# An HTTP head that never ends, sent a byte a second by each of the crowd.
TRICKLED_HEAD = b"GET /status.json HTTP/1.1\r\nHost: localhost\r\nX-Trickle: " + b"a" * 100_000


def proc_figures(pid: int) -> tuple[int, int, float]:
    """A process's open descriptors, threads and CPU seconds so far."""
    threads = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                   if line.startswith("Threads:"))
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    return len(os.listdir(f"/proc/{pid}/fd")), threads, cpu


def web_port(syncer: Syncer) -> tuple[str, int]:
    found = URL_LINE.search(syncer.proc.stdout())
    assert found, syncer.proc.stdout()
    return found.group(1), int(found.group(2))


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.mark.timeout(180)
def test_a_trickling_crowd_at_the_web_port_stops_nothing(procs: Procs, key_file: Path) -> None:
    syncer = start_syncer(procs, key_file=key_file, learners=1, quorum=1, fragments=2, total_rounds=ROUNDS,
                          max_descriptors=DESCRIPTORS, extra=["--metrics-port", "0"])
    host, port = web_port(syncer)
    pid = syncer.proc.pid
    descriptors, threads, _ = proc_figures(pid)
    island = Island(syncer, key_file, 0)
    try:
        with Crowd(port, CROWD, trickle=TRICKLED_HEAD, per_pass=40) as crowd:
            # More than the syncer's descriptors: a server that accepted them all would run out.
            wait_until(lambda: crowd.opened >= DESCRIPTORS + 8, 30, "the crowd at the web port",
                       on_timeout=syncer.proc.tail)
            flooded = time.time()
            time.sleep(1.0)
            _, _, cpu_before = proc_figures(pid)
            time.sleep(2.0)  # the crowd trickles; the learner has not come yet
            flood_descriptors, flood_threads, cpu_after = proc_figures(pid)
            assert cpu_after - cpu_before < 0.5, f"the syncer spent {cpu_after - cpu_before:.2f} s of CPU in 2 s"
            assert flood_threads <= threads, (threads, flood_threads)
            assert flood_descriptors <= descriptors + 32, (descriptors, flood_descriptors)  # the cap's worth
            island.start()  # joins through the flood
            island.train_until(lambda: len(syncer.commits()) >= ROUNDS // 2, 90, "rounds committed in the flood")
            assert syncer.proc.poll() is None, syncer.proc.tail()
            assert syncer.checkpoint is not None and syncer.checkpoint.stat().st_mtime >= flooded
            assert crowd.opened >= CROWD and crowd.open_now() >= CROWD // 2, "the crowd was not all there"
        wait_until(lambda: answers(f"http://{host}:{port}/status.json"), 15, "the web port to answer after the crowd",
                   on_timeout=syncer.proc.tail)
        island.train_until(lambda: island.finished, 90, "the final cut")
    finally:
        island.close()
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()
    assert [c["round"] for c in syncer.commits()] == list(range(ROUNDS))
    cap_lines = [line for line in syncer.proc.stderr().splitlines() if "its cap" in line]
    assert 1 <= len(cap_lines) <= 3, cap_lines  # the flood is logged per burst, not per connection


def listening_address(port: int) -> str:
    """The IPv4 address a listening TCP socket on `port` is bound to, from /proc/net/tcp."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, _, hex_port = local.partition(":")
        if int(hex_port, 16) == port and state == "0A":  # LISTEN
            return socket.inet_ntoa(bytes.fromhex(address)[::-1])
    raise AssertionError(f"nothing listens on port {port}")


def scrape(url: str, *headers: tuple[str, str]) -> tuple[int, str, Message]:
    """Status, body and headers (looked up in any case) of a GET."""
    request = urllib.request.Request(url, headers=dict(headers))
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode(), response.headers
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), exc.headers


@pytest.mark.timeout(90)
def test_the_web_port_stays_on_loopback_and_asks_for_its_token(procs: Procs, key_file: Path, tmp_path: Path) -> None:
    token_file = tmp_path / "web.token"
    token_file.write_text("prometheus-reads-this-3f9a\n")
    token_file.chmod(0o600)
    syncer = start_syncer(procs, key_file=key_file, learners=1, quorum=1, checkpoint_name=None,
                          extra=["--host", "0.0.0.0", "--metrics-port", "0", "--metrics-token-file", str(token_file)])
    host, port = web_port(syncer)
    assert (syncer.host, host) == ("0.0.0.0", "127.0.0.1")  # the learners' port is published, the page is not
    assert listening_address(port) == "127.0.0.1"
    assert listening_address(syncer.port) == "0.0.0.0"
    url = f"http://127.0.0.1:{port}/metrics"
    code, body, headers = scrape(url)
    assert code == 401 and headers["WWW-Authenticate"] == 'Basic realm="yeto", charset="UTF-8"', (code, headers)
    assert "yeto_syncer" not in body
    assert scrape(url, ("Authorization", "Bearer wrong"))[0] == 401
    code, body, _ = scrape(url, ("Authorization", "Bearer prometheus-reads-this-3f9a"))
    assert code == 200 and "yeto_syncer_rounds_committed_total" in {
        s.name for family in text_string_to_metric_families(body) for s in family.samples}
    browser = "Basic " + base64.b64encode(b"me:prometheus-reads-this-3f9a").decode()
    code, body, _ = scrape(f"http://127.0.0.1:{port}/", ("Authorization", browser))
    assert code == 200 and "<html" in body.lower()
    assert "has no token" not in syncer.proc.stderr()

    missing = tmp_path / "no-such.token"
    refused = procs.start("syncer-bad-token", [sys.executable, "-m", "syncer", "--port", "0", "--key-file",
                                               str(key_file), "--metrics-port", "0", "--metrics-token-file",
                                               str(missing)])
    assert refused.wait(60) == 2
    assert refused.stderr().strip().splitlines() == [
        f"yeto syncer: --metrics-token-file={missing}: cannot read the token file (No such file or directory)"]
