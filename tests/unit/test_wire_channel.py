"""The pure wire below the sockets, in memory, on a made-up clock: framing, striping, deadlines
and the control channel of a live connection group."""

from __future__ import annotations

import pytest

from yeto_core.wire.channel import ControlChannel
from yeto_core.wire.errors import ProtocolError
from yeto_core.wire.framing import FrameReader, chunk_head, data_frame_header, parse_chunk_head
from yeto_core.wire.liveness import Liveness, StreamMotion
from yeto_core.wire.messages import HEADER, Bye, Error, Heartbeat, MsgType, Pull, encode_frame
from yeto_core.wire.striping import Striper

pytestmark = pytest.mark.timeout(30)

FRAMES = [Pull(3, 0, 1, 7), Heartbeat(1, 5), Error(2, "no"), Bye("done")]


def stream_of(*msgs: object) -> bytes:
    return b"".join(encode_frame(m) for m in msgs)  # type: ignore[arg-type]


# -- framing ----------------------------------------------------------------------------------


@pytest.mark.parametrize("piece", [1, 3, 17, 1 << 16])
def test_frames_come_out_whole_however_the_bytes_are_cut(piece: int) -> None:
    data = stream_of(*FRAMES)
    reader = FrameReader()
    kinds = []
    for i in range(0, len(data), piece):
        reader.feed(data[i : i + piece])
        while (frame := reader.next_frame()) is not None:
            kinds.append(frame[0])
    assert kinds == [m.TYPE for m in FRAMES]
    assert reader.rest() == b"" and reader.bytes_wanted() == HEADER.size


def test_the_reader_never_asks_for_a_byte_past_the_frame_in_hand() -> None:
    data = stream_of(Pull(1, 0, 0, 0)) + b"group bytes"
    reader = FrameReader()
    at = 0
    while (frame := reader.next_frame()) is None:
        want = reader.bytes_wanted()
        assert want > 0 and at + want <= len(data) - len(b"group bytes")
        reader.feed(data[at : at + want])
        at += want
    assert frame[0] is MsgType.PULL and reader.rest() == b""


def test_a_header_is_judged_before_its_body_is_waited_for() -> None:
    reader = FrameReader(max_body=8)
    reader.feed(stream_of(Error(2, "a reason far longer than eight bytes"))[: HEADER.size])
    with pytest.raises(ProtocolError, match="exceeds the 8-byte bound"):
        reader.next_frame()
    refusing = FrameReader()
    refusing.feed(stream_of(Bye("x"))[: HEADER.size])

    def accept(kind: MsgType) -> None:
        raise ProtocolError(f"not now: {kind.name}")

    with pytest.raises(ProtocolError, match="not now: BYE"):
        refusing.next_frame(accept=accept)


def test_a_chunk_on_the_control_stream_is_refused() -> None:
    reader = FrameReader()
    reader.feed(chunk_head(1, 4, 0, 4) + b"abcd")
    with pytest.raises(ProtocolError, match="only valid on data streams"):
        reader.next_frame()


def test_a_chunk_head_reads_back_as_written() -> None:
    raw = chunk_head(7, 1 << 40, 4 << 20, 1234)
    kind, length = data_frame_header(raw[: HEADER.size], "rx0")
    assert kind is MsgType.CHUNK
    head = parse_chunk_head(length, raw[HEADER.size :])
    assert (head.transfer, head.total, head.offset, head.nbytes) == (7, 1 << 40, 4 << 20, 1234)
    assert data_frame_header(stream_of(Error(2, "no"))[: HEADER.size], "rx0")[0] is MsgType.ERROR
    with pytest.raises(ProtocolError, match="rx0: expected a CHUNK frame, got PULL"):
        data_frame_header(stream_of(Pull(1, 0, 0, 0))[: HEADER.size], "rx0")


# -- striping ---------------------------------------------------------------------------------


def test_round_robin_deals_chunks_in_turn_across_transfers() -> None:
    s = Striper(3, "rr")
    assert [i for i, _, _ in s.plan(10, 4)] == [0, 1, 2]
    assert [i for i, _, _ in s.plan(4, 4)] == [0]
    assert s.plan(10, 4) == [(1, 0, 4), (2, 4, 4), (0, 8, 2)]  # on from where the last one stopped
    assert s.backlog == [10, 8, 6]


def test_adaptive_striping_moves_chunks_off_a_slow_stream() -> None:
    s = Striper(2, "adaptive")
    for _ in range(5):  # stream 1 is ten times slower
        s.plan(8, 4)
        s.sent(0, 4, 0.001)
        s.sent(1, 4, 0.01)
    streams = [i for i, _, _ in s.plan(40, 4)]
    assert streams.count(0) > 2 * streams.count(1)


def test_a_striper_refuses_what_it_cannot_do() -> None:
    with pytest.raises(ValueError, match="stream schedule 'fastest'"):
        Striper(2, "fastest")
    with pytest.raises(ValueError, match="at least one data stream"):
        Striper(0)


# -- deadlines --------------------------------------------------------------------------------


def test_a_silent_peer_is_declared_gone_after_its_timeout_and_not_before() -> None:
    live = Liveness(100.0, heartbeat_s=2, peer_timeout_s=30)
    assert live.verdict(130.0) is None
    assert live.verdict(130.5) == "no frame from the peer for 30 s"
    live.heard(129.0)
    assert live.verdict(130.5) is None and live.next_deadline() <= 159.0


def test_a_stream_stalled_mid_write_or_an_inbound_transfer_that_stopped_growing_fails() -> None:
    live = Liveness(0.0, heartbeat_s=2, peer_timeout_s=1e9, stall_timeout_s=5)
    moving = StreamMotion("rx0", sending=True, progress_at=9.0)
    stuck = StreamMotion("rx1", sending=True, progress_at=1.0)
    idle = StreamMotion("rx1", sending=False, progress_at=1.0)
    assert live.verdict(10.0, [moving, stuck]) == "rx1 stalled: unsent bytes made no progress for 5 s"
    assert live.verdict(10.0, [moving, idle]) is None  # nothing to send is not a stall
    old = StreamMotion("rx0", sending=False, progress_at=2.0)
    stopped = "g: an inbound message stopped growing for 5 s"
    assert live.verdict(10.0, [old], inbound_incomplete=True, group="g") == stopped
    assert live.verdict(10.0, [old], inbound_incomplete=False) is None
    assert Liveness(0.0, heartbeat_s=2, peer_timeout_s=1e9).verdict(10.0, [stuck]) is None  # the watchdog is off


# -- the control channel -----------------------------------------------------------------------


def test_the_channel_hands_over_messages_and_keeps_heartbeats_to_itself() -> None:
    ch = ControlChannel(0.0, heartbeat_s=2, peer_timeout_s=30)
    data = stream_of(*FRAMES)
    got = ch.receive_data(data[:5], 1.0) + ch.receive_data(data[5:], 2.0)
    assert got == [m for m in FRAMES if not isinstance(m, Heartbeat)]
    assert ch.silent_s(3.0) == 1.0


def test_one_heartbeat_is_due_at_a_time_and_each_carries_a_new_number() -> None:
    ch = ControlChannel(0.0, heartbeat_s=2, peer_timeout_s=30)
    first = ch.poll(0.0, step=lambda: 11).heartbeat
    assert first == Heartbeat(1, 11)
    assert ch.poll(0.5).heartbeat is None  # handed out, not written yet
    ch.sent(first, 1.0)
    assert ch.poll(2.9).heartbeat is None and ch.next_deadline() == 3.0
    ch.sent(Pull(0, 0, 0, 0), 2.5)  # any frame written counts as not quiet
    assert ch.poll(4.0).heartbeat is None
    assert ch.poll(4.5, step=lambda: 12).heartbeat == Heartbeat(2, 12)


def test_the_channel_declares_a_silent_peer_dead_with_the_reason() -> None:
    ch = ControlChannel(0.0, heartbeat_s=2, peer_timeout_s=30)
    ch.receive_data(stream_of(Heartbeat(1, 0)), 10.0)
    assert ch.poll(40.0).dead is None
    ch.heard(45.0)  # a chunk on a data stream
    assert ch.poll(75.0).dead is None
    assert ch.poll(75.5).dead == "no frame from the peer for 30 s"


def test_a_malformed_frame_is_a_protocol_error() -> None:
    ch = ControlChannel(0.0, heartbeat_s=2, peer_timeout_s=30)
    with pytest.raises(ProtocolError, match="bad frame magic"):
        ch.receive_data(b"NOPE" + bytes(HEADER.size - 4), 1.0)
