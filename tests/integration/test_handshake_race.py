"""Regression: learner 0's MANIFEST follows WELCOME on the control stream, and its data streams may
attach before the syncer has read it. The group must not start reading the control stream until
the handshake thread has the manifest (a race that once corrupted the control stream's framing)."""

from __future__ import annotations

import dataclasses
import queue
import time
from pathlib import Path

import pytest
import torch
from conftest import Procs, dial, start_syncer

from yeto_core.codecs import F32, tensor_bytes
from yeto_core.layout import TensorSpec, build_layout
from yeto_core.net.group import ConnectionGroup
from yeto_core.wire import auth
from yeto_core.wire.messages import (
    CHUNK_BYTES,
    HELLO_SENDS_MANIFEST,
    Attach,
    Bcast,
    Hello,
    Init,
    Manifest,
    Message,
    Welcome,
)

pytestmark = pytest.mark.integration


@pytest.mark.timeout(60)
def test_data_streams_attaching_before_the_manifest_is_read(procs: Procs, key_file: Path) -> None:
    syncer = start_syncer(procs, key_file=key_file, learners=1, quorum=1, fragments=4, total_rounds=4)
    key = key_file.read_bytes().strip()
    specs = [TensorSpec("embed.weight", (32, 8), "float32", embedding=True)] + [
        TensorSpec(f"layers.{i}.w", (8, 8), "float32") for i in range(6)]
    layout = build_layout(specs, 4)
    control, challenge = dial(syncer.port)
    h = Hello(0, 1, layout.fingerprint, F32.wire_id, CHUNK_BYTES, HELLO_SENDS_MANIFEST, auth.new_nonce())
    control.send_frame(dataclasses.replace(h, mac=auth.sign(key, auth.HELLO_LABEL, challenge.nonce, h.signed_part())))
    welcome = control.read_message()
    assert isinstance(welcome, Welcome), welcome
    data, data_challenge = dial(syncer.port)  # the data stream attaches first ...
    data.send_frame(Attach(welcome.token, 0, auth.sign(key, auth.ATTACH_LABEL, data_challenge.nonce, welcome.token,
                                                       bytes([0]))))
    time.sleep(0.5)
    control.send_frame(Manifest(4, "binpack", tuple(specs)))  # ... and the manifest comes late
    inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
    closed: list[str] = []
    group = ConnectionGroup(control, [data], name="raw-learner0", on_message=lambda m, p: inbox.put(m),
                            on_close=closed.append, max_payload=lambda: 1 << 20)
    group.start()
    try:
        for frag in layout.fragments:
            group.send(Init(frag.index, 0, 0, F32.wire_id), tensor_bytes(torch.zeros(frag.numel)))
        cut: set[int] = set()
        deadline = time.monotonic() + 20
        while len(cut) < 4 and time.monotonic() < deadline:
            try:
                msg = inbox.get(timeout=0.5)
            except queue.Empty:
                continue
            if isinstance(msg, Bcast):
                cut.add(msg.fragment)
        assert cut == {0, 1, 2, 3}, (cut, closed, syncer.proc.tail())
        assert not closed, closed
    finally:
        group.close("test done")
        group.join(5.0)
    assert "bad frame magic" not in syncer.proc.stderr()
