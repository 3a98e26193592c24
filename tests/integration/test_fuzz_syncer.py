"""Fuzzed connections against a real syncer while one honest learner trains (bounded count and time).

Random bytes after CHALLENGE, mutated HELLOs, and authenticated peers (they hold the key) sending
mutated frames on their control and data streams: the syncer stays up, its memory stays bounded,
and the honest learner completes every round and ends bit-identical to the final checkpoint."""

from __future__ import annotations

import contextlib
import importlib.util
import random
import socket
import threading
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch
from conftest import (
    Island,
    Procs,
    Syncer,
    checkpoint_params,
    dial,
    hello,
    join_raw,
    start_syncer,
    syncer_exit_code,
    wait_until,
)

from syncer.durability.checkpoint import load_checkpoint
from yeto_core.wire.messages import MsgType, encode_frame

pytestmark = pytest.mark.integration

ROUNDS = 24
CONNECTIONS = 300  # fuzzed connections in all
ATTACK_BUDGET_S = 25.0
RSS_BOUND_KIB = 1536 * 1024  # the syncer of a tiny model stays far below 1.5 GiB


def _oracles() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "unit" / "test_fuzz_frames.py"
    spec = importlib.util.spec_from_file_location("yeto_fuzz_oracles", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FZ = _oracles()
# Authenticated peers never send DONE: a key holder that says it finished legitimately changes the quorum.
PEER_SEEDS = [f for f, m in zip(FZ.SEED_FRAMES, FZ.SEED_MESSAGES, strict=False) if m.TYPE is not MsgType.DONE]


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _drain_briefly(sock: socket.socket) -> None:
    sock.settimeout(0.2)
    with contextlib.suppress(OSError):
        sock.recv(65536)


def fuzz_after_challenge(port: int, rng: random.Random, fingerprint: bytes, key: bytes) -> None:
    stream, _ = dial(port)
    try:
        with contextlib.suppress(OSError):
            stream.sock.sendall(FZ.random_input(rng))
            _drain_briefly(stream.sock)
    finally:
        stream.close()


def fuzz_hello(port: int, rng: random.Random, fingerprint: bytes, key: bytes) -> None:
    stream, challenge = dial(port)
    try:
        frame = encode_frame(hello(rng.randrange(1, 10), fingerprint, challenge.nonce, key, rng.randint(1, 2)))
        with contextlib.suppress(OSError):
            stream.sock.sendall(FZ.apply_ops(frame, FZ.random_ops(rng, 2)))
            _drain_briefly(stream.sock)
    finally:
        stream.close()


def fuzz_authenticated(port: int, rng: random.Random, fingerprint: bytes, key: bytes) -> None:
    peer = join_raw(port, key, rng.randrange(1, 10), fingerprint)
    try:
        time.sleep(0.05)
        with contextlib.suppress(OSError):
            for _ in range(rng.randint(1, 3)):
                target = peer.data[0] if rng.random() < 0.4 else peer.control
                seed = FZ.SEED_FRAMES[-1] if target is not peer.control else rng.choice(PEER_SEEDS)
                target.sock.sendall(FZ.apply_ops(seed, FZ.random_ops(rng, 3)))
            _drain_briefly(peer.control.sock)
    finally:
        peer.close()


ATTACKS = (fuzz_after_challenge, fuzz_after_challenge, fuzz_hello, fuzz_hello, fuzz_authenticated)


class Attacker(threading.Thread):
    def __init__(self, syncer: Syncer, fingerprint: bytes, key: bytes, seed: int) -> None:
        super().__init__(name="fuzz-attacker", daemon=True)
        self.syncer, self.fingerprint, self.key, self.rng = syncer, fingerprint, key, random.Random(seed)
        self.sent = 0
        self.errors: list[str] = []
        self.max_rss_kib = 0

    def run(self) -> None:
        deadline = time.monotonic() + ATTACK_BUDGET_S
        while self.sent < CONNECTIONS and time.monotonic() < deadline:
            attack = self.rng.choice(ATTACKS)
            try:
                attack(self.syncer.port, self.rng, self.fingerprint, self.key)
            except Exception as exc:  # the syncer refusing or dropping us is fine; note it for the report
                self.errors.append(f"{attack.__name__}: {type(exc).__name__}: {exc}")
            self.sent += 1
            if self.syncer.proc.poll() is not None:
                return
            if self.sent % 10 == 0:
                self.max_rss_kib = max(self.max_rss_kib, rss_kib(self.syncer.proc.pid))


@pytest.mark.timeout(120)
def test_fuzzed_connections_leave_the_syncer_and_the_honest_learner_unaffected(procs: Procs, key_file: Path) -> None:
    syncer = start_syncer(procs, key_file=key_file, learners=1, quorum=1, fragments=4, total_rounds=ROUNDS)
    key = key_file.read_bytes().strip()
    island = Island(syncer, key_file)
    assert syncer.checkpoint is not None
    started = time.monotonic()
    try:
        island.start()
        island.train_until(lambda: len(syncer.commits()) >= 2, 60, "2 committed rounds")
        rss_before = rss_kib(syncer.proc.pid)
        attacker = Attacker(syncer, island.fingerprint, key, seed=1234)
        attacker.start()
        # The island pauses mid-run until the attack is well under way: the run must not end first.
        wait_until(lambda: attacker.sent >= 50 or not attacker.is_alive(), ATTACK_BUDGET_S, "50 fuzzed connections")
        island.train_until(lambda: False, 90, "the final cut")
        attacker.join(ATTACK_BUDGET_S + 15)
        assert not attacker.is_alive(), "the attacker did not finish"
        assert island.finished and island.session.stats.final_installed
    finally:
        island.close()
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()
    print(f"fuzzed {attacker.sent} connections in {time.monotonic() - started:.1f} s; syncer RSS "
          f"{rss_before} KiB before, at most {attacker.max_rss_kib} KiB during; "
          f"{len(attacker.errors)} attacks ended with a client-side error")
    assert attacker.sent >= 50, attacker.errors[:5]
    assert attacker.max_rss_kib < RSS_BOUND_KIB, (rss_before, attacker.max_rss_kib)
    stderr = syncer.proc.stderr()
    for sign in ("Traceback", "internal error", "syncer error during handshake"):  # only the protocol's own errors
        assert sign not in stderr, syncer.proc.tail(80)

    done = [r for r in syncer.tape_records() if r["event"] == "commit"]
    assert [r["round"] for r in done] == list(range(ROUNDS))
    assert load_checkpoint(syncer.checkpoint).finalized
    ckpt = checkpoint_params(syncer.checkpoint)
    for name, param in island.model.named_parameters():
        assert torch.equal(param.detach(), ckpt[name]), f"{name} differs from the final checkpoint"
