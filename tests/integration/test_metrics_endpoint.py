"""The syncer's `/metrics` (`--metrics-port`) in a real run: it parses with prometheus-client's own parser, and
its counters equal the tape's counts; off unless asked for; a port it cannot bind is one line. The run's tape is
then plotted with `yeto-plot`. An island's own `/metrics` counts what its session did, asks for its token when it
has one, and an address it cannot serve on is one line naming the setting."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import ROOT, Procs, base_env, commits, read_tape, start_syncer, wait_until
from prometheus_client.parser import text_string_to_metric_families

from syncer.tools.plot import PLOTS
from yeto_core.island import IslandSession
from yeto_core.learner import LearnerSession
from yeto_core.net.stream import Stream
from yeto_core.settings import LearnerSettings, SettingsError, load_settings
from yeto_core.wire.messages import Challenge, Error, Heartbeat, encode_frame

pytestmark = pytest.mark.integration
METRICS_LINE = re.compile(r"^yeto syncer metrics on (http://\S+/metrics)$", re.MULTILINE)
ROUNDS = 6


def scrape(url: str, token: str | None = None) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def knock(address: str) -> None:
    """Dial the syncer, read its CHALLENGE, answer with a frame that is no HELLO, read its ERROR."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        stream = Stream(sock, "stranger")
        assert isinstance(stream.read_message(), Challenge)
        sock.sendall(encode_frame(Heartbeat(0, 0)))
        answer = stream.read_message()
        assert isinstance(answer, Error) and "expected HELLO" in answer.reason, answer


@pytest.mark.timeout(120)
@pytest.mark.parametrize("codec", ["f32", "int4"])
def test_a_runs_metrics_are_the_tapes_counts(procs: Procs, key_file: Path, codec: str) -> None:
    """`codec`: the learners' pushes and downlink (f32: exact broadcasts)."""
    syncer = start_syncer(procs, key_file=key_file, learners=2, quorum=2, fragments=2, total_rounds=ROUNDS,
                          extra=["--metrics-port", "0", "--sync-interval-steps", "2"])
    found = METRICS_LINE.search(syncer.proc.stdout())
    assert found, syncer.proc.stdout()
    knock(syncer.address)  # a stranger that sends a HEARTBEAT instead of HELLO: refused before it joins
    tensors = {lid: torch.zeros(8) for lid in (0, 1)}
    settings = {lid: load_settings(LearnerSettings, syncer=syncer.address, key_file=key_file, learner_id=lid,
                                   sync_interval=2, consensus_every=0, reconnect_max_s=1, wire_dtype=codec,
                                   downlink_dtype=codec) for lid in (0, 1)}
    sessions = {lid: LearnerSession(settings[lid], [("w", tensors[lid][:4]), ("v", tensors[lid][4:])])
                for lid in (0, 1)}
    try:
        starting = [threading.Thread(target=s.start) for s in sessions.values()]
        for thread in starting:
            thread.start()
        for thread in starting:
            thread.join(60)

        def train() -> bool:  # a step on each island, until every round committed (the syncer then waits for DONE)
            for lid, session in sessions.items():
                tensors[lid].add_(0.01 * (lid + 1))
                session.step(tokens=64 * (lid + 1))
            return len(commits(read_tape(syncer.tape))) >= ROUNDS

        wait_until(train, 60, f"{ROUNDS} committed rounds", interval=0.01)
        metrics = scrape(found.group(1))
        tape = read_tape(syncer.tape)
        done = commits(tape)
        assert metrics[("yeto_syncer_rounds_committed_total", ())] == len(done) == ROUNDS
        for lid in ("0", "1"):
            mine = [c["tokens"][c["learners"].index(int(lid))] for c in done if int(lid) in c["learners"]]
            assert metrics[("yeto_syncer_learner_answered_total", (("learner", lid),))] == len(mine)
            assert metrics[("yeto_syncer_learner_tokens_merged_total", (("learner", lid),))] == sum(mine)
            assert metrics[("yeto_syncer_learner_joins_total", (("learner", lid),))] == sum(
                1 for r in tape if r["event"] == "join" and str(r["learner"]) == lid)
        assert metrics[("yeto_syncer_learners_connected", ())] == 2
        assert metrics[("yeto_syncer_merge_seconds_count", ())] == ROUNDS
        assert metrics[("yeto_syncer_handshakes_refused_total", (("reason", "protocol"),))] == 1
        pushed_in_total, sent_bulk_total = 0.0, 0.0
        for lid, session in sessions.items():  # every push of every committed round is in: its bytes, exactly
            session.pump(0.0)
            session.sync.push_in_flight()
            pushed = session.stats.bytes_pushed
            received = {labels: v for (name, labels), v in metrics.items()
                        if name == "yeto_syncer_learner_received_bytes_total" and ("learner", str(lid)) in labels}
            bulk = sum(v for labels, v in received.items() if ("codec", "control") not in labels)
            init = 8 * 4 if lid == 0 else 0  # learner 0 also uploaded the initial weights, 8 f32 values
            assert pushed > 0 and bulk == pushed + init, (lid, received, pushed)
            pushed_in_total += pushed
            sent = {labels: v for (name, labels), v in metrics.items()
                    if name == "yeto_syncer_learner_sent_bytes_total" and ("learner", str(lid)) in labels}
            assert sent[(("codec", "control"), ("learner", str(lid)))] > 0, sent  # the PULLs, at least
            assert sent[(("codec", "f32"), ("learner", str(lid)))] >= 8 * 4, sent  # the initial cut at least
            sent_bulk_total += sum(v for labels, v in sent.items() if ("codec", "control") not in labels)
        # The tape's bytes are the wire's: every merged push, and every commit's broadcast. The rest
        # of the bulk that went out is the full state each join sent (8 values), and the final cut
        # to a learner whose DONE the last broadcast already brought (8 values, 0 or 1 each).
        assert sum(c["bytes_in"] for c in done) == pushed_in_total == metrics[
            ("yeto_syncer_commit_payload_bytes_total", (("direction", "up"),))]
        broadcast = sum(c["bytes_out"] for c in done)
        assert broadcast == metrics[("yeto_syncer_commit_payload_bytes_total", (("direction", "down"),))]
        joins = sum(1 for r in tape if r["event"] == "join")
        assert sent_bulk_total - broadcast - joins * 8 * 4 in (0, 8 * 4, 2 * 8 * 4), (sent_bulk_total, broadcast)
        assert all(c["numel"] == 4 and c["receivers"] == 2 for c in done)
        # 4 values a fragment: an int4 payload is a block-size header, a scale and 2 code bytes
        # (20 bits a value); each fragment's chain began with the initial cut's FULL, and its last
        # version goes out FULL too (32 bits), so the final cut is exact.
        per_value = 32.0 if codec == "f32" else 8 * (4 + 4 + 2) / 4
        assert metrics[("yeto_syncer_wire_bits_per_parameter", (("direction", "up"),))] == per_value
        last = done[-1]
        assert metrics[("yeto_syncer_wire_bits_per_parameter", (("direction", "down"),))] == 8 * last[
            "bytes_out"] / 4 / 2
        downs = [8 * c["bytes_out"] / 4 / 2 for c in done]
        assert downs == [32.0 if codec == "f32" or c["version"] == ROUNDS // 2 else per_value for c in done]

        def broadcasts_timed() -> bool:
            return scrape(found.group(1))[("yeto_syncer_broadcast_seconds_count", ())] == ROUNDS

        wait_until(broadcasts_timed, 20, "every commit's broadcast timed")
        for f in ("0", "1"):
            last = max(c["version"] for c in done if str(c["fragment"]) == f)
            assert metrics[("yeto_syncer_fragment_version", (("fragment", f),))] == last
        finishing = [threading.Thread(target=s.finish) for s in sessions.values()]
        for thread in finishing:
            thread.start()
        for thread in finishing:
            thread.join(60)
    finally:
        for session in sessions.values():
            session.close()
    # The same run's tape, drawn: `yeto-plot` writes its six PNGs (900 x 450) of the real records.
    plots = procs.workdir / "plots"
    plotted = subprocess.run([sys.executable, "-m", "syncer.tools.plot", str(syncer.tape), "--out", str(plots)],
                             cwd=ROOT, env=base_env(), capture_output=True, text=True, timeout=90)
    assert plotted.returncode == 0 and "6 plots" in plotted.stdout, plotted.stderr
    for name in PLOTS:
        header = (plots / f"{name}.png").read_bytes()[:24]
        assert header[:8] == b"\x89PNG\r\n\x1a\n" and (header[16:20], header[20:24]) == (
            (900).to_bytes(4, "big"), (450).to_bytes(4, "big")), name
        assert (plots / f"{name}.png").stat().st_size > 10_000, name


@pytest.mark.timeout(60)
def test_metrics_are_off_unless_asked_for_and_a_taken_port_is_one_line(procs: Procs, key_file: Path) -> None:
    syncer = start_syncer(procs, key_file=key_file, learners=1, quorum=1)
    assert "metrics" not in syncer.proc.stdout()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "syncer", "--port", "0", "--key-file", str(key_file),
                               "--metrics-port", str(port)], cwd=ROOT, env=base_env(), capture_output=True, text=True,
                              timeout=50)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    want = f"yeto syncer: cannot serve metrics on 127.0.0.1:{port} (--metrics-port): Address already in use"
    assert lines[-1] == want


@pytest.mark.timeout(90)
def test_an_island_serves_its_own_metrics_when_asked(procs: Procs, key_file: Path, tmp_path: Path) -> None:
    syncer = start_syncer(procs, key_file=key_file, learners=1, quorum=1, fragments=2, total_rounds=4,
                          extra=["--sync-interval-steps", "2"])
    token_file = tmp_path / "island.token"
    token_file.write_text("island-scrape-7c1e\n")
    token_file.chmod(0o600)
    weights = torch.zeros(8)
    settings = load_settings(LearnerSettings, syncer=syncer.address, key_file=key_file, learner_id=0,
                             sync_interval=2, consensus_every=0, metrics_port=0, metrics_token_file=token_file)
    island = IslandSession(settings, [("w", weights[:4]), ("v", weights[4:])])
    try:
        island.start()
        assert island.metrics is not None
        url = f"http://127.0.0.1:{island.metrics.port}/metrics"
        steps = 0
        while not island.stats.final_installed and steps < 400:
            weights.add_(0.01)
            steps += 1
            if island.step(tokens=32):
                break
            time.sleep(0.005)
        with pytest.raises(urllib.error.HTTPError, match="401"):
            scrape(url)
        with pytest.raises(urllib.error.HTTPError, match="401"):
            scrape(url, token="wrong")
        metrics = scrape(url, token="island-scrape-7c1e")
        stats = island.session.stats  # type: ignore[union-attr]
        mine = (("learner", "0"),)
        assert metrics[("yeto_learner_steps_total", mine)] == stats.steps == steps
        assert metrics[("yeto_learner_tokens_total", mine)] == 32 * steps
        assert metrics[("yeto_learner_pushes_total", mine)] == stats.pushes > 0
        assert metrics[("yeto_learner_pushed_bytes_total", mine)] == stats.bytes_pushed > 0
        assert metrics[("yeto_learner_installs_total", mine)] == stats.installs > 0
        assert metrics[("yeto_learner_round_trip_steps_total", mine)] == stats.round_trip_steps
        assert metrics[("yeto_learner_round_trips_total", mine)] == stats.round_trips > 0
        assert metrics[("yeto_learner_final_installed", mine)] == 1.0
    finally:
        island.close()
    with pytest.raises(OSError):  # closed with the island
        urllib.request.urlopen(url, timeout=2)


def test_an_islands_metrics_address_it_cannot_serve_on_is_one_line_naming_the_setting(key_file: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for host, setting, why in (("127.0.0.1", "PORT", "Address already in use"),
                                   ("192.0.2.1", "HOST", "Cannot assign requested address")):  # not this machine's
            settings = load_settings(LearnerSettings, syncer="127.0.0.1:1", key_file=key_file, learner_id=3,
                                     metrics_port=port, metrics_host=host)
            island = IslandSession(settings, [("w", torch.zeros(4))])
            try:
                with pytest.raises(SettingsError) as refused:
                    island.start()
            finally:
                island.close()
            assert str(refused.value) == (f"learner 3: cannot serve /metrics on {host}:{port} "
                                          f"(YETO_DILOCO_METRICS_{setting}): {why}")
