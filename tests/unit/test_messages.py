"""Wire messages: round trips, pinned bytes, and every way a body can be malformed."""

from __future__ import annotations

import dataclasses
import struct
import tracemalloc
from collections.abc import Callable

import pytest

from yeto_core.layout import TensorSpec
from yeto_core.wire import messages
from yeto_core.wire.codec import MAX_LIST_ITEMS, MAX_STR_BYTES, BodyWriter
from yeto_core.wire.errors import ErrorCode, ProtocolError
from yeto_core.wire.messages import (
    BCAST_FULL,
    CHUNK_BYTES,
    CHUNK_HEADER,
    HEADER,
    HELLO_SENDS_MANIFEST,
    MAGIC,
    MAX_CONTROL_BODY,
    MAX_PROBE_BYTES,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    UNKNOWN,
    Attach,
    Bcast,
    BwProbe,
    Bye,
    Challenge,
    Consensus,
    Done,
    Error,
    Final,
    Heartbeat,
    Hello,
    Init,
    Manifest,
    Message,
    MsgType,
    ProbeReport,
    Pull,
    Push,
    Welcome,
    decode_body,
    encode_frame,
    parse_header,
)

pytestmark = pytest.mark.unit

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1

# Distinct byte runs, so a field that lands in the wrong place shows up in the hex.
NONCE = bytes(range(0x00, 0x20))
FPRINT = bytes(range(0x20, 0x40))
CNONCE = bytes(range(0x40, 0x60))
MAC = bytes(range(0x60, 0x80))
TOKEN = bytes(range(0xA0, 0xB0))

NONCE_HEX = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"
FPRINT_HEX = "202122232425262728292a2b2c2d2e2f303132333435363738393a3b3c3d3e3f"
CNONCE_HEX = "404142434445464748494a4b4c4d4e4f505152535455565758595a5b5c5d5e5f"
MAC_HEX = "606162636465666768696a6b6c6d6e6f707172737475767778797a7b7c7d7e7f"
TOKEN_HEX = "a0a1a2a3a4a5a6a7a8a9aaabacadaeaf"


@dataclasses.dataclass(frozen=True)
class Golden:
    """One fixed message, its 12-byte header, and its body as (reader field name, hex) spans in order."""

    msg: Message
    header: str
    body: tuple[tuple[str, str], ...]

    @property
    def frame(self) -> bytes:
        return bytes.fromhex(self.header + "".join(h for _, h in self.body))

    @property
    def body_bytes(self) -> bytes:
        return bytes.fromhex("".join(h for _, h in self.body))


# Header: "YETO" 59 45 54 4f | version 02 | type | flags 0000 | body length u32 LE.
GOLDEN = [
    Golden(
        Challenge(NONCE, 4, "binpack", 24),
        "5945544f" "03" "01" "0000" "33000000",  # 51-byte body
        (
            ("nonce", NONCE_HEX),
            ("num_fragments", "04000000"),
            ("pattern", "07000000" "62696e7061636b"),  # u32 length 7, "binpack"
            ("sync_interval", "18000000"),  # H = 24
        ),
    ),
    Golden(
        Hello(7, 2, FPRINT, 2, CHUNK_BYTES, HELLO_SENDS_MANIFEST, CNONCE, MAC, 128, TOKEN, 4),
        "5945544f" "03" "02" "0000" "83000000",  # 131-byte body
        (
            ("learner_id", "07000000"),
            ("data_streams", "02"),
            ("fingerprint", FPRINT_HEX),
            ("wire_dtype", "02"),
            ("chunk_bytes", "00004000"),  # 0x00400000 = 4 MiB
            ("flags", "01000000"),
            ("client_nonce", CNONCE_HEX),
            ("push_block", "80000000"),  # 128
            ("instance", TOKEN_HEX),
            ("downlink_dtype", "04"),  # int4
            ("mac", MAC_HEX),
        ),
    ),
    Golden(
        Welcome(TOKEN, 3, True, MAC),
        "5945544f" "03" "03" "0000" "35000000",  # 53-byte body
        (
            ("token", TOKEN_HEX),
            ("generation", "03000000"),
            ("initial_cut_ready", "01"),
            ("mac", MAC_HEX),
        ),
    ),
    Golden(
        Attach(TOKEN, 1, MAC),
        "5945544f" "03" "04" "0000" "31000000",  # 49-byte body
        (
            ("token", TOKEN_HEX),
            ("index", "01"),
            ("mac", MAC_HEX),
        ),
    ),
    Golden(
        Error(ErrorCode.LAYOUT, "bad fp"),
        "5945544f" "03" "05" "0000" "0c000000",  # 12-byte body
        (
            ("code", "0300"),  # u16 LAYOUT = 3
            ("reason", "06000000" "626164206670"),  # "bad fp"
        ),
    ),
    Golden(
        Manifest(2, "strided", (TensorSpec("emb", (8, 4), "float32", True), TensorSpec("b", (), "bfloat16"))),
        "5945544f" "03" "07" "0000" "4a000000",  # 74-byte body
        (
            ("num_fragments", "02000000"),
            ("pattern", "07000000" "73747269646564"),  # "strided"
            ("specs", "02000000"),  # u32 count
            ("name", "03000000" "656d62"),  # "emb"
            ("rank", "02"),
            ("shape", "0800000000000000"),
            ("shape", "0400000000000000"),
            ("dtype", "07000000" "666c6f61743332"),  # "float32"
            ("embedding", "01"),
            ("name", "01000000" "62"),  # "b"
            ("rank", "00"),  # a scalar: no shape entries follow
            ("dtype", "08000000" "62666c6f61743136"),  # "bfloat16"
            ("embedding", "00"),
        ),
    ),
    Golden(
        Init(1, 5, 4096, 1),
        "5945544f" "03" "08" "0000" "15000000",  # 21-byte body
        (
            ("fragment", "01000000"),
            ("transfer", "0500000000000000"),
            ("nbytes", "0010000000000000"),  # 4096
            ("codec", "01"),
        ),
    ),
    Golden(
        Pull(0x0102030405060708, 2, 3, 9),
        "5945544f" "03" "09" "0000" "14000000",  # 20-byte body
        (
            ("round", "0807060504030201"),  # u64 little-endian
            ("attempt", "02000000"),
            ("fragment", "03000000"),
            ("version", "09000000"),
        ),
    ),
    Golden(
        Push(10, 2, 3, 9, 123456789, 24, 250000, 6, 1024, 2),
        "5945544f" "03" "0a" "0000" "35000000",  # 53-byte body
        (
            ("round", "0a00000000000000"),
            ("attempt", "02000000"),
            ("fragment", "03000000"),
            ("base_version", "09000000"),
            ("tokens", "15cd5b0700000000"),  # 123456789 = 0x075bcd15
            ("steps", "18000000"),  # 24
            ("step_us", "90d00300"),  # 250000 = 0x0003d090
            ("transfer", "0600000000000000"),
            ("nbytes", "0004000000000000"),  # 1024
            ("codec", "02"),
        ),
    ),
    Golden(
        Bcast(3, 10, 10, BCAST_FULL, 7, 2048, 1, bytes(range(32))),
        "5945544f" "03" "0b" "0000" "45000000",  # 69-byte body
        (
            ("fragment", "03000000"),
            ("version", "0a000000"),
            ("round", "0a00000000000000"),
            ("flags", "01000000"),
            ("transfer", "0700000000000000"),
            ("nbytes", "0008000000000000"),  # 2048
            ("codec", "01"),
            ("digest", bytes(range(32)).hex()),  # SHA-256 of the anchor it leads to
        ),
    ),
    Golden(
        Final(3, 11, 4, 40, 8, 2048, 1),
        "5945544f" "03" "0c" "0000" "25000000",  # 37-byte body
        (
            ("fragment", "03000000"),
            ("version", "0b000000"),
            ("num_fragments", "04000000"),
            ("rounds", "2800000000000000"),  # 40
            ("transfer", "0800000000000000"),
            ("nbytes", "0008000000000000"),
            ("codec", "01"),
        ),
    ),
    Golden(
        Heartbeat(5, 240),
        "5945544f" "03" "0d" "0000" "10000000",  # 16-byte body
        (
            ("seq", "0500000000000000"),
            ("step", "f000000000000000"),
        ),
    ),
    Golden(
        Bye("final cut installed"),
        "5945544f" "03" "0e" "0000" "17000000",  # 23-byte body
        (("reason", "13000000" "66696e616c2063757420696e7374616c6c6564"),),
    ),
    Golden(
        Done(1000),
        "5945544f" "03" "0f" "0000" "08000000",  # 8-byte body
        (("step", "e803000000000000"),),
    ),
    Golden(
        BwProbe(1 << 20, 2 << 20, bytes(range(32))),
        "5945544f" "03" "10" "0000" "30000000",  # 48-byte body
        (
            ("up", "0000100000000000"),  # 1 MiB
            ("down", "0000200000000000"),  # 2 MiB
            ("mac", bytes(range(32)).hex()),
        ),
    ),
    Golden(
        ProbeReport(240, 9, b"\x01\x02\x03"),
        "5945544f" "03" "11" "0000" "17000000",  # 23-byte body
        (
            ("step", "f000000000000000"),
            ("installed", "0900000000000000"),
            ("summary", "03000000" "010203"),  # u32 length, then the consensus summary's bytes
        ),
    ),
    Golden(
        Consensus(10, 2, 0.5, (1.0, UNKNOWN)),
        "5945544f" "03" "12" "0000" "28000000",  # 40-byte body
        (
            ("round", "0a00000000000000"),
            ("learners", "02000000"),
            ("js", "000000000000e03f"),  # f64 0.5
            ("fragment_l2", "02000000" "000000000000f03f" "000000000000f0bf"),  # 2 items: 1.0, -1.0 (unknown)
        ),
    ),
]

# Extremes and odd values next to the golden ones: every field at its widest, empty strings, non-ASCII.
EXTREMES: list[Message] = [
    BwProbe(MAX_PROBE_BYTES, 0),
    Challenge(b"\xff" * 32, U32_MAX, "", U32_MAX),
    Challenge(NONCE, 1, "strided-ünïcødé-✓", 0),  # H 0: the syncer does not pace by steps
    Hello(U32_MAX, 255, FPRINT, 255, U32_MAX, U32_MAX, CNONCE),  # default all-zero mac
    Hello(0, 1, b"\0" * 32, 1, CHUNK_BYTES, 0, b"\0" * 32, b"\xff" * 32),
    Welcome(TOKEN, U32_MAX, False, MAC),
    Welcome(b"\0" * 16, 0, True),
    Attach(TOKEN, 255, MAC),
    Attach(b"\xff" * 16, 0),
    *(Error(code, f"reason for {code.name} ✓") for code in ErrorCode),
    Error(ErrorCode.PROTOCOL, ""),
    Manifest(1, "binpack", ()),
    Manifest(U32_MAX, "", (TensorSpec("λ.weight", (U64_MAX, 0, 1), "float16", False),)),
    Init(U32_MAX, U64_MAX, U64_MAX, 255),
    Init(0, 0, 0, 0),
    Pull(U64_MAX, U32_MAX, U32_MAX, U32_MAX),
    Pull(0, 0, 0, 0),
    Push(U64_MAX, U32_MAX, U32_MAX, U32_MAX, U64_MAX, U32_MAX, U32_MAX, U64_MAX, U64_MAX, 255),
    Push(0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
    Bcast(U32_MAX, U32_MAX, U64_MAX, U32_MAX, U64_MAX, U64_MAX, 255, b"\xff" * 32),
    Bcast(0, 0, 0, 0, 0, 0, 0),
    Final(U32_MAX, U32_MAX, U32_MAX, U64_MAX, U64_MAX, U64_MAX, 255),
    Final(0, 0, 1, 0, 0, 0, 1),
    Heartbeat(U64_MAX, U64_MAX),
    Heartbeat(0, 0),
    Bye(""),
    Bye("leaving ✓"),
    Done(U64_MAX),
    Done(0),
    ProbeReport(U64_MAX, U64_MAX, b"\xff" * 4096),
    ProbeReport(0, 0, b""),
    Consensus(U64_MAX, U32_MAX, 1.0, ()),
    Consensus(0, 0, UNKNOWN, (0.0, UNKNOWN, 1e300)),
]

SAMPLES: list[Message] = [g.msg for g in GOLDEN] + EXTREMES


def _id(value: object) -> str:
    return type(value).__name__


def _golden_id(g: Golden) -> str:
    return type(g.msg).__name__


def test_samples_cover_every_message_type() -> None:
    assert {type(g.msg) for g in GOLDEN} == set(MESSAGE_TYPES.values())
    assert {type(m) for m in EXTREMES} == set(MESSAGE_TYPES.values())
    assert set(MESSAGE_TYPES) == set(MsgType) - {MsgType.CHUNK}
    for kind, cls in MESSAGE_TYPES.items():
        assert cls.TYPE is kind


def test_bulk_messages_are_exactly_the_ones_with_a_transfer() -> None:
    bulk = {cls for cls in MESSAGE_TYPES.values() if cls.BULK}
    assert bulk == {Init, Push, Bcast, Final}
    for cls in bulk:
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        assert {"transfer", "nbytes", "codec"} <= names


@pytest.mark.parametrize("msg", SAMPLES, ids=_id)
def test_round_trip(msg: Message) -> None:
    assert type(msg).decode(msg.encode()) == msg
    assert type(msg).decode(memoryview(msg.encode())) == msg


@pytest.mark.parametrize("msg", SAMPLES, ids=_id)
def test_frame_round_trip(msg: Message) -> None:
    frame = encode_frame(msg)
    kind, length = parse_header(frame[: HEADER.size])
    assert kind is msg.TYPE
    assert length == len(frame) - HEADER.size
    assert decode_body(kind, memoryview(frame)[HEADER.size :]) == msg


@pytest.mark.parametrize("msg", SAMPLES, ids=_id)
def test_messages_are_frozen(msg: Message) -> None:
    field = dataclasses.fields(msg)[0].name  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(msg, field, None)


@pytest.mark.parametrize("g", GOLDEN, ids=_golden_id)
def test_golden_frame(g: Golden) -> None:
    assert encode_frame(g.msg) == g.frame
    assert g.msg.encode() == g.body_bytes
    assert type(g.msg).decode(g.body_bytes) == g.msg


@pytest.mark.parametrize("g", GOLDEN, ids=_golden_id)
def test_golden_header_layout(g: Golden) -> None:
    frame = g.frame
    magic, version, mtype, flags, length = HEADER.unpack(frame[: HEADER.size])
    assert (magic, version, mtype, flags) == (MAGIC, PROTOCOL_VERSION, int(g.msg.TYPE), 0)
    assert length == len(g.body_bytes) == len(frame) - 12


@pytest.mark.parametrize("g", GOLDEN, ids=_golden_id)
def test_truncated_body_names_message_and_field(g: Golden) -> None:
    body = g.body_bytes
    name = g.msg.TYPE.name
    # The field whose bytes a cut falls into is the one the error must name.
    owner: list[str] = []
    for field, hexed in g.body:
        owner += [field] * (len(hexed) // 2)
    assert len(owner) == len(body)
    for cut in range(len(body)):
        with pytest.raises(ProtocolError) as info:
            type(g.msg).decode(body[:cut])
        assert str(info.value) == f"{name}: body ends inside field '{owner[cut]}'", cut


@pytest.mark.parametrize("g", GOLDEN, ids=_golden_id)
@pytest.mark.parametrize("extra", [b"\0", b"\x01\x02\x03"])
def test_trailing_bytes_are_refused(g: Golden, extra: bytes) -> None:
    with pytest.raises(ProtocolError, match=rf"^{g.msg.TYPE.name}: {len(extra)} unexpected trailing bytes"):
        type(g.msg).decode(g.body_bytes + extra)


# -- frame headers ---------------------------------------------------------------------------


def _header(magic: bytes = MAGIC, version: int = PROTOCOL_VERSION, mtype: int = 9, flags: int = 0,
            length: int = 20) -> bytes:
    return HEADER.pack(magic, version, mtype, flags, length)


def test_header_is_twelve_bytes() -> None:
    assert HEADER.size == 12
    assert CHUNK_HEADER.size == 24
    assert _header() == bytes.fromhex("5945544f" "03" "09" "0000" "14000000")


def test_parse_header_accepts_a_good_header() -> None:
    assert parse_header(_header()) == (MsgType.PULL, 20)
    assert parse_header(memoryview(_header())) == (MsgType.PULL, 20)


def test_parse_header_ignores_flags() -> None:
    assert parse_header(_header(flags=0xFFFF)) == (MsgType.PULL, 20)


@pytest.mark.parametrize("magic", [b"YETI", b"\0\0\0\0", b"yeto", b"GET "])
def test_parse_header_rejects_bad_magic(magic: bytes) -> None:
    with pytest.raises(ProtocolError, match="bad frame magic"):
        parse_header(_header(magic=magic))


@pytest.mark.parametrize("version", [0, 1, 2, 4, 255])
def test_parse_header_rejects_other_versions(version: int) -> None:
    # Version 1's CHALLENGE lacks H, version 2's HELLO the downlink dtype: a peer of either side is
    # turned away on its first frame, both named.
    assert PROTOCOL_VERSION == 3
    with pytest.raises(ProtocolError, match=rf"^protocol version {version} is not supported \(this side speaks 3\)$"):
        parse_header(_header(version=version))


@pytest.mark.parametrize("mtype", [0, 19, 200, 255])
def test_parse_header_rejects_unknown_types(mtype: int) -> None:
    with pytest.raises(ProtocolError, match=f"unknown frame type {mtype}"):
        parse_header(_header(mtype=mtype))


def test_parse_header_bounds_control_bodies() -> None:
    assert parse_header(_header(mtype=MsgType.MANIFEST, length=MAX_CONTROL_BODY)) == (
        MsgType.MANIFEST,
        MAX_CONTROL_BODY,
    )
    with pytest.raises(ProtocolError, match=f"MANIFEST frame of {MAX_CONTROL_BODY + 1} bytes exceeds"):
        parse_header(_header(mtype=MsgType.MANIFEST, length=MAX_CONTROL_BODY + 1))
    with pytest.raises(ProtocolError, match="exceeds"):
        parse_header(_header(mtype=MsgType.PULL, length=U32_MAX))


def test_parse_header_applies_a_tighter_bound() -> None:
    assert parse_header(_header(length=64), max_body=64) == (MsgType.PULL, 64)
    with pytest.raises(ProtocolError, match="PULL frame of 65 bytes exceeds the 64-byte bound"):
        parse_header(_header(length=65), max_body=64)


def test_parse_header_bounds_chunks_by_the_chunk_size() -> None:
    limit = CHUNK_HEADER.size + CHUNK_BYTES
    assert parse_header(_header(mtype=MsgType.CHUNK, length=limit)) == (MsgType.CHUNK, limit)
    # The chunk bound holds whatever max_body the caller passes.
    assert parse_header(_header(mtype=MsgType.CHUNK, length=limit), max_body=1024) == (MsgType.CHUNK, limit)
    with pytest.raises(ProtocolError, match=f"CHUNK frame of {limit + 1} bytes exceeds the {limit}-byte bound"):
        parse_header(_header(mtype=MsgType.CHUNK, length=limit + 1))


def test_chunk_is_not_a_control_message() -> None:
    with pytest.raises(ProtocolError, match="only valid on data streams"):
        decode_body(MsgType.CHUNK, b"\0" * CHUNK_HEADER.size)


def test_encode_frame_refuses_an_oversize_body(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(messages, "MAX_CONTROL_BODY", 16)
    encode_frame(Heartbeat(1, 2))  # exactly 16 bytes
    with pytest.raises(ValueError, match="PULL body of 20 bytes exceeds 16"):
        encode_frame(Pull(1, 2, 3, 4))


# -- bounded strings and lists ---------------------------------------------------------------

STRING_MESSAGES = [
    pytest.param(lambda s: Challenge(NONCE, 1, s, 24), id="Challenge.pattern"),
    pytest.param(lambda s: Error(ErrorCode.REFUSED, s), id="Error.reason"),
    pytest.param(lambda s: Bye(s), id="Bye.reason"),
    pytest.param(lambda s: Manifest(1, s, ()), id="Manifest.pattern"),
    pytest.param(lambda s: Manifest(1, "binpack", (TensorSpec(s, (1,), "float32"),)), id="Manifest.name"),
    pytest.param(lambda s: Manifest(1, "binpack", (TensorSpec("w", (1,), s),)), id="Manifest.dtype"),
]


@pytest.mark.parametrize("make", STRING_MESSAGES)
def test_string_at_the_bound_round_trips(make: Callable[[str], Message]) -> None:
    msg = make("s" * MAX_STR_BYTES)
    assert type(msg).decode(msg.encode()) == msg


@pytest.mark.parametrize("make", STRING_MESSAGES)
@pytest.mark.parametrize("text", ["s" * (MAX_STR_BYTES + 1), "é" * (MAX_STR_BYTES // 2 + 1)], ids=["ascii", "utf8"])
def test_string_over_the_bound_is_refused_on_encode(make: Callable[[str], Message], text: str) -> None:
    # The bound counts UTF-8 bytes, not characters.
    with pytest.raises(ValueError, match=f"exceeds the {MAX_STR_BYTES}-byte bound"):
        make(text).encode()


_U32 = struct.Struct("<I")

# (message class, body bytes before the length prefix, field the reader names)
STRING_PREFIXES = [
    pytest.param(Challenge, NONCE + _U32.pack(1), "CHALLENGE", "pattern", id="Challenge.pattern"),
    pytest.param(Error, b"\x01\x00", "ERROR", "reason", id="Error.reason"),
    pytest.param(Bye, b"", "BYE", "reason", id="Bye.reason"),
    pytest.param(Manifest, _U32.pack(1), "MANIFEST", "pattern", id="Manifest.pattern"),
    pytest.param(Manifest, BodyWriter().u32(1).string("p").u32(1).getvalue(), "MANIFEST", "name",
                 id="Manifest.name"),
    pytest.param(Manifest, BodyWriter().u32(1).string("p").u32(1).string("w").u8(0).getvalue(), "MANIFEST",
                 "dtype", id="Manifest.dtype"),
]


@pytest.mark.parametrize(("cls", "prefix", "what", "field"), STRING_PREFIXES)
def test_string_over_the_bound_is_refused_on_decode(cls: type[Message], prefix: bytes, what: str,
                                                    field: str) -> None:
    body = prefix + _U32.pack(MAX_STR_BYTES + 1) + b"s" * (MAX_STR_BYTES + 1)
    expected = f"{what}: field '{field}' claims {MAX_STR_BYTES + 1} bytes (bound {MAX_STR_BYTES})"
    with pytest.raises(ProtocolError) as info:
        cls.decode(body)
    assert str(info.value) == expected


@pytest.mark.parametrize(("cls", "prefix", "what", "field"), STRING_PREFIXES)
def test_huge_string_claim_is_refused_before_allocating(cls: type[Message], prefix: bytes, what: str,
                                                        field: str) -> None:
    # A 4 GiB claim with no bytes behind it: the bound is checked before anything is read or allocated.
    body = prefix + _U32.pack(U32_MAX)
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        with pytest.raises(ProtocolError, match=rf"^{what}: field '{field}' claims {U32_MAX} bytes \(bound"):
            cls.decode(body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak - base < 256 * 1024


def test_invalid_utf8_is_a_protocol_error() -> None:
    body = _U32.pack(2) + b"\xc3\x28"
    with pytest.raises(ProtocolError, match="BYE: field 'reason' is not valid UTF-8"):
        Bye.decode(body)


def test_manifest_list_over_the_bound_is_refused() -> None:
    body = BodyWriter().u32(1).string("binpack").u32(MAX_LIST_ITEMS + 1).getvalue()
    with pytest.raises(ProtocolError, match=f"MANIFEST: list 'specs' claims {MAX_LIST_ITEMS + 1} items"):
        Manifest.decode(body)


def test_manifest_list_claim_larger_than_the_body_fails_cleanly() -> None:
    body = BodyWriter().u32(1).string("binpack").u32(MAX_LIST_ITEMS).getvalue()
    with pytest.raises(ProtocolError, match="MANIFEST: body ends inside field 'name'"):
        Manifest.decode(body)


@pytest.mark.parametrize(("name", "dtype"), [("", "float32"), ("w", "torch.float32"), ("w", "")])
def test_manifest_with_an_invalid_spec_is_a_protocol_error(name: str, dtype: str) -> None:
    w = BodyWriter().u32(1).string("binpack").u32(1)
    w.string(name).u8(1).u64(4).string(dtype).u8(0)
    with pytest.raises(ProtocolError, match="MANIFEST"):
        Manifest.decode(w.getvalue())


# -- fixed-size fields -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: Challenge(NONCE[:31], 1, "binpack", 24), id="Challenge.nonce"),
        pytest.param(lambda: Hello(0, 1, FPRINT[:31], 1, CHUNK_BYTES, 0, CNONCE), id="Hello.fingerprint"),
        pytest.param(lambda: Hello(0, 1, FPRINT, 1, CHUNK_BYTES, 0, CNONCE + b"x"), id="Hello.client_nonce"),
        pytest.param(lambda: Hello(0, 1, FPRINT, 1, CHUNK_BYTES, 0, CNONCE, MAC[:1]), id="Hello.mac"),
        pytest.param(lambda: Hello(0, 1, FPRINT, 1, CHUNK_BYTES, 0, CNONCE, MAC, 0, TOKEN[:15]), id="Hello.instance"),
        pytest.param(lambda: Welcome(TOKEN[:15], 1, True), id="Welcome.token"),
        pytest.param(lambda: Attach(TOKEN, 0, b""), id="Attach.mac"),
    ],
)
def test_fixed_fields_of_the_wrong_size_are_refused_on_encode(make: Callable[[], Message]) -> None:
    with pytest.raises(ValueError, match=r"expected (16|32) bytes"):
        make().encode()


# -- ERROR codes -----------------------------------------------------------------------------


@pytest.mark.parametrize("raw", [0, 8, 99, 0xFFFF])
def test_error_with_an_unknown_code_decodes_to_protocol(raw: int) -> None:
    body = BodyWriter().u16(raw).string("something odd").getvalue()
    msg = Error.decode(body)
    assert msg.code is ErrorCode.PROTOCOL
    assert msg.reason == f"(unknown error code {raw}) something odd"


def test_error_codes_are_pinned() -> None:
    assert {c.name: int(c) for c in ErrorCode} == {
        "PROTOCOL": 1, "AUTH": 2, "LAYOUT": 3, "CONTRACT": 4, "REFUSED": 5, "SHUTDOWN": 6, "DUPLICATE": 7,
    }
    assert {c for c in ErrorCode if c.permanent} == {ErrorCode.AUTH, ErrorCode.LAYOUT, ErrorCode.CONTRACT,
                                                    ErrorCode.DUPLICATE}


def test_message_type_numbers_are_pinned() -> None:
    assert {t.name: int(t) for t in MsgType} == {
        "CHALLENGE": 1, "HELLO": 2, "WELCOME": 3, "ATTACH": 4, "ERROR": 5, "CHUNK": 6, "MANIFEST": 7, "INIT": 8,
        "PULL": 9, "PUSH": 10, "BCAST": 11, "FINAL": 12, "HEARTBEAT": 13, "BYE": 14, "DONE": 15, "BW_PROBE": 16,
        "PROBE_REPORT": 17, "CONSENSUS": 18,
    }


# -- MANIFEST at scale -----------------------------------------------------------------------


def test_manifest_with_many_specs_round_trips() -> None:
    dtypes = ("float32", "bfloat16", "float16")
    specs = tuple(
        TensorSpec(
            f"model.layers.{i // 8}.part{i % 8}.weight",
            tuple((i * 7 + k) % 4099 + 1 for k in range(i % 5)),  # ranks 0..4
            dtypes[i % 3],
            embedding=i == 0,
        )
        for i in range(20_000)
    )
    msg = Manifest(32, "binpack", specs)
    body = msg.encode()
    assert len(body) <= MAX_CONTROL_BODY
    back = Manifest.decode(body)
    assert back == msg
    assert back.specs[0].embedding and not back.specs[1].embedding
    assert {len(s.shape) for s in back.specs} == {0, 1, 2, 3, 4}
    frame = encode_frame(msg)
    kind, length = parse_header(frame[: HEADER.size])
    assert decode_body(kind, frame[HEADER.size : HEADER.size + length]) == msg


def test_a_probe_larger_than_the_bound_is_refused_on_decode() -> None:
    body = BodyWriter().u64(MAX_PROBE_BYTES + 1).u64(0).fixed(bytes(32), 32).getvalue()
    with pytest.raises(ProtocolError, match="BW_PROBE asks for"):
        BwProbe.decode(body)


# -- the consensus messages (DESIGN §8) --------------------------------------------------------------


def test_a_probe_summary_larger_than_the_bound_is_refused() -> None:
    from yeto_core.consensus import MAX_SUMMARY_BYTES

    with pytest.raises(ValueError, match="exceeds"):
        ProbeReport(1, 1, bytes(MAX_SUMMARY_BYTES + 1)).encode()
    body = BodyWriter().u64(1).u64(1).u32(MAX_SUMMARY_BYTES + 1).getvalue()
    with pytest.raises(ProtocolError, match="PROBE_REPORT: field 'summary' claims"):
        ProbeReport.decode(body)


@pytest.mark.parametrize(("js", "l2", "what"), [
    (float("nan"), (), "'js'"), (1.5, (), "'js'"), (-0.5, (), "'js'"),
    (0.1, (float("inf"),), "'fragment_l2'"), (0.1, (float("nan"),), "'fragment_l2'"), (0.1, (-2.0,), "'fragment_l2'"),
])
def test_consensus_with_values_that_are_no_distance_is_refused(js: float, l2: tuple[float, ...], what: str) -> None:
    w = BodyWriter().u64(1).u32(2).f64(js).u32(len(l2))
    for v in l2:
        w.f64(v)
    with pytest.raises(ProtocolError, match=f"CONSENSUS: field {what}"):
        Consensus.decode(w.getvalue())


def test_consensus_fragment_list_is_bounded_before_reading() -> None:
    body = BodyWriter().u64(1).u32(2).f64(0.1).u32(messages.MAX_CONSENSUS_FRAGMENTS + 1).getvalue()
    with pytest.raises(ProtocolError, match="list 'fragment_l2' claims"):
        Consensus.decode(body)
