"""Hostile bytes against a real syncer: one ERROR frame, the socket closed, and everyone else
served on (DESIGN §7.1, §7.2, §9.3). The honest learner is a framework-free `LearnerSession` over a
small torch module, so no HF import is needed."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import (
    Island,
    Procs,
    Syncer,
    assert_closed,
    checkpoint_params,
    dial,
    hello,
    join_raw,
    read_until_error,
    start_syncer,
    syncer_exit_code,
    wait_until,
)

from syncer.durability.checkpoint import load_checkpoint
from yeto_core.codecs import F32
from yeto_core.wire.errors import ErrorCode
from yeto_core.wire.messages import HEADER, MAGIC, PROTOCOL_VERSION, Error, MsgType, Push

pytestmark = pytest.mark.integration

ROUNDS = 24


def send_garbage(port: int, fingerprint: bytes, key: bytes) -> Error:
    stream, _ = dial(port)
    try:
        stream.sock.sendall(b"GET / HTTP/1.1\r\nHost: syncer\r\n\r\n")
        err = read_until_error(stream)
        assert err.code is ErrorCode.PROTOCOL and "magic" in err.reason, err
        assert_closed(stream)
        return err
    finally:
        stream.close()


def send_hello_with_wrong_mac(port: int, fingerprint: bytes, key: bytes) -> Error:
    stream, challenge = dial(port)
    try:
        stream.send_frame(hello(0, fingerprint, challenge.nonce, secrets.token_bytes(32)))  # a key nobody holds
        err = read_until_error(stream)
        assert err.code is ErrorCode.AUTH and "HMAC" in err.reason, err
        assert_closed(stream)
        return err
    finally:
        stream.close()


def send_replayed_hello(port: int, fingerprint: bytes, key: bytes) -> Error:
    """A HELLO signed with the right key for one connection, replayed on another: its MAC covers
    the first connection's challenge nonce, so the second refuses it (an eavesdropper cannot
    reuse a learner's handshake)."""
    first, challenge = dial(port)
    first.close()  # the honest connection whose HELLO was captured
    replay, _ = dial(port)
    try:
        replay.send_frame(hello(5, fingerprint, challenge.nonce, key))
        err = read_until_error(replay)
        assert err.code is ErrorCode.AUTH and "HMAC" in err.reason, err
        assert_closed(replay)
        return err
    finally:
        replay.close()


def send_oversize_header(port: int, fingerprint: bytes, key: bytes) -> Error:
    stream, _ = dial(port)
    try:
        stream.sock.sendall(HEADER.pack(MAGIC, PROTOCOL_VERSION, int(MsgType.HELLO), 0, 0xFFFF_FFF0))
        err = read_until_error(stream)
        assert err.code is ErrorCode.PROTOCOL and "exceeds" in err.reason, err
        assert_closed(stream)
        return err
    finally:
        stream.close()


def send_oversize_transfer(port: int, fingerprint: bytes, key: bytes) -> Error:
    """A peer holding the key and the right layout announces a 1 TiB push: refused before any
    allocation, with an ERROR on its control stream, and its connection group closed."""
    peer = join_raw(port, key, 7, fingerprint)
    try:
        time.sleep(0.3)  # let the syncer start the group before it hears the announcement
        peer.control.send_frame(Push(0, 1, 0, 0, 1, 1, 0, transfer=1, nbytes=1 << 40, codec=F32.wire_id))
        err = read_until_error(peer.control)
        assert err.code is ErrorCode.PROTOCOL and "exceeds" in err.reason, err
        assert_closed(peer.control)
        return err
    finally:
        peer.close()


HOSTILE: dict[str, Callable[[int, bytes, bytes], Error]] = {
    "garbage-first-frame": send_garbage,
    "hello-with-wrong-mac": send_hello_with_wrong_mac,
    "replayed-hello": send_replayed_hello,
    "oversize-frame-header": send_oversize_header,
}


def run_island_through(syncer: Syncer, key_file: Path, attack: Callable[[int, bytes, bytes], Error]) -> None:
    key = key_file.read_bytes().strip()
    island = Island(syncer, key_file)
    assert syncer.checkpoint is not None
    try:
        # Before any model is pinned: the syncer refuses the attacker and then takes the honest learner.
        attack(syncer.port, bytes(32), key)
        assert syncer.proc.poll() is None, syncer.proc.tail()
        island.start()
        assert island.session.link.refused is None
        island.train_until(lambda: len(syncer.commits()) >= 3, 60, "3 committed rounds")
        # Mid-run: the model is pinned and rounds are under way.
        attack(syncer.port, island.fingerprint, key)
        assert syncer.proc.poll() is None, syncer.proc.tail()
        island.train_until(lambda: False, 90, "the final cut")
        assert island.finished and island.session.stats.final_installed
    finally:
        island.close()
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()

    records = syncer.tape_records()
    done = [r for r in records if r["event"] == "commit"]
    assert [r["round"] for r in done] == list(range(ROUNDS))
    assert all(r["learners"] == [0] for r in done)
    assert load_checkpoint(syncer.checkpoint).finalized
    ckpt = checkpoint_params(syncer.checkpoint)
    for name, param in island.model.named_parameters():
        assert torch.equal(param.detach(), ckpt[name]), f"{name} differs from the final checkpoint"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_first_frame_is_refused_and_the_syncer_serves_on(procs: Procs, key_file: Path, kind: str) -> None:
    syncer = start_syncer(procs, key_file=key_file, learners=1, quorum=1, fragments=4, total_rounds=ROUNDS)
    run_island_through(syncer, key_file, HOSTILE[kind])
    assert "refused" in syncer.proc.stderr() or "handshake with" in syncer.proc.stderr()


@pytest.mark.timeout(120)
def test_authenticated_peer_announcing_an_oversize_transfer_is_cut_off(procs: Procs, key_file: Path) -> None:
    syncer = start_syncer(procs, key_file=key_file, learners=1, quorum=1, fragments=4, total_rounds=ROUNDS)
    key = key_file.read_bytes().strip()
    island = Island(syncer, key_file)
    assert syncer.checkpoint is not None
    try:
        island.start()
        island.train_until(lambda: len(syncer.commits()) >= 3, 60, "3 committed rounds")
        err = send_oversize_transfer(syncer.port, island.fingerprint, key)
        assert "1099511627776" in err.reason, err
        wait_until(lambda: "learner 7 left" in syncer.proc.stderr(), 20, "the syncer to drop the attacker",
                   on_timeout=syncer.proc.tail)
        island.train_until(lambda: False, 90, "the final cut")
        assert island.session.stats.final_installed
    finally:
        island.close()
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()
    done = [r for r in syncer.tape_records() if r["event"] == "commit"]
    assert [r["round"] for r in done] == list(range(ROUNDS))
    assert all(r["learners"] == [0] for r in done)
    ckpt = checkpoint_params(syncer.checkpoint)
    for name, param in island.model.named_parameters():
        assert torch.equal(param.detach(), ckpt[name]), f"{name} differs from the final checkpoint"
