"""The shell's own figures (`syncer/service/traffic.py`): wire sizes by codec, broadcast timing, ticket callbacks."""

from __future__ import annotations

import threading

from syncer.service.traffic import CONTROL, BroadcastTimer, wire_size
from yeto_core.codecs import F32, codec_by_name
from yeto_core.net.tickets import SendTicket
from yeto_core.wire.messages import HEADER, Bcast, Heartbeat, Pull, Push


def test_a_bulk_message_counts_its_payload_under_its_codec() -> None:
    int4 = codec_by_name("int4")
    push = Push(round=3, attempt=0, fragment=1, base_version=2, tokens=64, steps=4, step_us=0, transfer=9,
                nbytes=1000, codec=int4.wire_id)
    assert wire_size(push, 1000) == ("int4", 1000)
    assert wire_size(push, None) == ("int4", 1000)  # the header's own count when the payload is not at hand
    bcast = Bcast(0, 1, 0, 0, 0, 4096, F32.wire_id)
    assert wire_size(bcast, 4096) == ("f32", 4096)


def test_a_control_frame_counts_its_header_and_body() -> None:
    beat = Heartbeat(1, 2)
    assert wire_size(beat, None) == (CONTROL, HEADER.size + 16)  # two u64
    pull = Pull(5, 0, 1, 0)
    assert wire_size(pull, None) == (CONTROL, HEADER.size + len(pull.encode()))


def test_a_ticket_calls_back_once_done_and_at_once_when_already_done() -> None:
    seen: list[SendTicket] = []
    ticket = SendTicket(2)
    ticket.add_done_callback(seen.append)
    ticket.chunk_sent()
    assert seen == []
    ticket.chunk_sent()
    assert seen == [ticket]
    ticket.fail("late")  # already done: no second call, no error recorded
    assert seen == [ticket] and ticket.ok
    ticket.add_done_callback(seen.append)
    assert seen == [ticket, ticket]
    failed = SendTicket(3)
    failed.add_done_callback(seen.append)
    failed.fail("closed")
    assert seen[-1] is failed and failed.error == "closed"


def test_a_broadcast_is_timed_until_its_last_send_is_done() -> None:
    now = [10.0]
    times: list[float] = []
    tickets = [SendTicket(1), SendTicket(2), SendTicket(1)]
    BroadcastTimer(tickets, times.append, clock=lambda: now[0])
    now[0] = 10.5
    tickets[0].chunk_sent()
    tickets[2].fail("learner left")  # a learner that dropped does not hold the broadcast up
    tickets[1].chunk_sent()
    assert times == []
    now[0] = 11.25
    finisher = threading.Thread(target=tickets[1].chunk_sent)  # done on another thread, as a sender's
    finisher.start()
    finisher.join(5)
    assert times == [1.25]
