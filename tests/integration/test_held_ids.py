"""A learner id held by a live, heartbeating learner is never handed to a newcomer (DESIGN §9.4):
an authenticated peer that claims it, naming no process instance (all zeros) or another one, is
refused at its handshake (DUPLICATE, naming where the holder connects from), and the holder
trains on with its rounds committing."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from conftest import Island, Procs, assert_closed, dial, start_syncer, syncer_exit_code

from yeto_core.codecs import F32
from yeto_core.wire import auth
from yeto_core.wire.errors import ErrorCode
from yeto_core.wire.messages import CHUNK_BYTES, INSTANCE_BYTES, Error, Hello

pytestmark = pytest.mark.integration

ROUNDS = 16
NO_INSTANCE = bytes(INSTANCE_BYTES)
ANOTHER_PROCESS = b"\x5a" * INSTANCE_BYTES


def claim(port: int, key: bytes, learner_id: int, fingerprint: bytes, instance: bytes) -> tuple[Error, int]:
    """A hand-made, authenticated HELLO for `learner_id` from process `instance`: the syncer's
    answer (it must be an ERROR, then the end of the connection) and this peer's own port."""
    control, challenge = dial(port)
    try:
        h = Hello(learner_id, 1, fingerprint, F32.wire_id, CHUNK_BYTES, 0, auth.new_nonce(), instance=instance)
        control.send_frame(dataclasses.replace(h, mac=auth.sign(key, auth.HELLO_LABEL, challenge.nonce,
                                                                 h.signed_part())))
        answer = control.read_message()
        assert isinstance(answer, Error), f"the impostor was answered {answer}"
        assert_closed(control)
        return answer, control.sock.getsockname()[1]
    finally:
        control.close()


@pytest.mark.timeout(120)
def test_an_impostor_on_a_live_learners_id_is_refused_and_the_holder_trains_on(procs: Procs, key_file: Path) -> None:
    syncer = start_syncer(procs, key_file=key_file, learners=1, quorum=1, fragments=2, total_rounds=ROUNDS)
    key = key_file.read_bytes().strip()
    island = Island(syncer, key_file)
    try:
        island.start()
        island.train_until(lambda: len(syncer.commits()) >= 2, 60, "2 committed rounds")
        for instance in (NO_INSTANCE, ANOTHER_PROCESS):
            error, own_port = claim(syncer.port, key, 0, island.fingerprint, instance)
            assert error.code is ErrorCode.DUPLICATE, error
            holder = re.search(r"learner id 0 is held by another live process, connected from 127\.0\.0\.1:(\d+)",
                               error.reason)
            assert holder is not None and int(holder.group(1)) != own_port, error.reason
        committed = len(syncer.commits())
        island.train_until(lambda: len(syncer.commits()) >= committed + 2, 60, "2 more commits")
        assert island.session.link.refused is None
        island.train_until(lambda: False, 90, "the final cut")
    finally:
        island.close()
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()
    records = syncer.tape_records()
    assert [r["round"] for r in records if r["event"] == "commit"] == list(range(ROUNDS))
    assert all(r["generations"] == [1] for r in records if r["event"] == "commit"), "the holder lost its link"
    assert [r["generation"] for r in records if r["event"] == "join"] == [1]
    assert "learner 0 replaced" not in syncer.proc.stderr()
