"""HMAC-SHA256 challenge–response: the exact construction, and what must not verify."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
from typing import Any

import pytest

from yeto_core.wire import auth
from yeto_core.wire.messages import CHUNK_BYTES, MAC_BYTES, NONCE_BYTES, TOKEN_BYTES, Hello

pytestmark = pytest.mark.unit

KEY = b"secret key"
NONCE = bytes(range(32))


def test_labels_are_pinned_and_distinct() -> None:
    assert auth.HELLO_LABEL == b"yeto-hello-v1"
    assert auth.WELCOME_LABEL == b"yeto-welcome-v1"
    assert auth.ATTACH_LABEL == b"yeto-attach-v1"


def test_sign_is_hmac_sha256_over_label_and_length_prefixed_parts() -> None:
    parts = (NONCE, b"", b"hello body")
    expected = hmac.new(
        KEY,
        auth.HELLO_LABEL + b"".join(len(p).to_bytes(4, "little") + p for p in parts),
        hashlib.sha256,
    ).digest()
    assert auth.sign(KEY, auth.HELLO_LABEL, *parts) == expected
    assert len(expected) == MAC_BYTES


def test_sign_golden_digests() -> None:
    # Checked against an independent HMAC-SHA256 tool over the same bytes.
    assert auth.sign(KEY, auth.HELLO_LABEL, NONCE, b"hello body").hex() == (
        "97a4fa7519aa6b8a05f229a91c233870c0f264f99d720b0ef739d44d3ed9d83e"
    )
    assert auth.sign(KEY, auth.ATTACH_LABEL).hex() == (
        "b96ceba4be2f9ff8189d24d38be9ae7d04452ff85cc962862d8f1ab73395c7c2"
    )


def test_verify_accepts_the_right_key() -> None:
    mac = auth.sign(KEY, auth.HELLO_LABEL, NONCE, b"part")
    assert auth.verify(KEY, mac, auth.HELLO_LABEL, NONCE, b"part")


def test_verify_rejects_a_wrong_key() -> None:
    mac = auth.sign(b"other key", auth.HELLO_LABEL, NONCE, b"part")
    assert not auth.verify(KEY, mac, auth.HELLO_LABEL, NONCE, b"part")


def test_verify_rejects_a_wrong_nonce() -> None:
    mac = auth.sign(KEY, auth.HELLO_LABEL, NONCE, b"part")
    other = bytes([NONCE[0] ^ 1]) + NONCE[1:]
    assert not auth.verify(KEY, mac, auth.HELLO_LABEL, other, b"part")


@pytest.mark.parametrize("modified", [b"parT", b"part\0", b"par", b""])
def test_verify_rejects_a_modified_part(modified: bytes) -> None:
    mac = auth.sign(KEY, auth.HELLO_LABEL, NONCE, b"part")
    assert not auth.verify(KEY, mac, auth.HELLO_LABEL, NONCE, modified)


def test_verify_rejects_a_modified_or_truncated_mac() -> None:
    mac = auth.sign(KEY, auth.HELLO_LABEL, NONCE, b"part")
    flipped = bytes([mac[0] ^ 0x80]) + mac[1:]
    assert not auth.verify(KEY, flipped, auth.HELLO_LABEL, NONCE, b"part")
    assert not auth.verify(KEY, mac[:-1], auth.HELLO_LABEL, NONCE, b"part")
    assert not auth.verify(KEY, b"", auth.HELLO_LABEL, NONCE, b"part")


def test_a_mac_for_one_label_does_not_verify_under_another() -> None:
    mac = auth.sign(KEY, auth.HELLO_LABEL, NONCE, b"part")
    assert not auth.verify(KEY, mac, auth.ATTACH_LABEL, NONCE, b"part")
    assert not auth.verify(KEY, mac, auth.WELCOME_LABEL, NONCE, b"part")


def test_length_prefixing_separates_part_boundaries() -> None:
    assert auth.sign(KEY, auth.HELLO_LABEL, b"ab", b"c") != auth.sign(KEY, auth.HELLO_LABEL, b"a", b"bc")
    assert auth.sign(KEY, auth.HELLO_LABEL, b"abc") != auth.sign(KEY, auth.HELLO_LABEL, b"ab", b"c")
    assert auth.sign(KEY, auth.HELLO_LABEL) != auth.sign(KEY, auth.HELLO_LABEL, b"")
    assert auth.sign(KEY, auth.HELLO_LABEL, b"") != auth.sign(KEY, auth.HELLO_LABEL, b"", b"")
    # Without the prefixes these would all be the same HMAC input.
    mac = auth.sign(KEY, auth.HELLO_LABEL, b"ab", b"c")
    assert not auth.verify(KEY, mac, auth.HELLO_LABEL, b"a", b"bc")
    assert not auth.verify(KEY, mac, auth.HELLO_LABEL, b"abc")


def test_verify_compares_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    mac = auth.sign(KEY, auth.ATTACH_LABEL, NONCE, b"token", b"\x00")
    assert auth.verify(KEY, mac, auth.ATTACH_LABEL, NONCE, b"token", b"\x00")
    assert not auth.verify(KEY, b"\0" * MAC_BYTES, auth.ATTACH_LABEL, NONCE, b"token", b"\x00")
    assert len(calls) == 2
    assert calls[0] == (mac, mac)
    assert calls[1] == (mac, b"\0" * MAC_BYTES)


def test_nonces_and_tokens_are_fresh_and_sized() -> None:
    nonces = {auth.new_nonce() for _ in range(64)}
    tokens = {auth.new_token() for _ in range(64)}
    assert len(nonces) == 64 and all(len(n) == NONCE_BYTES for n in nonces)
    assert len(tokens) == 64 and all(len(t) == TOKEN_BYTES for t in tokens)


# -- the constructions the handshake uses ----------------------------------------------------


def _hello() -> Hello:
    return Hello(3, 2, bytes(range(0x20, 0x40)), 1, CHUNK_BYTES, 0, bytes(range(0x40, 0x60)))


def test_hello_mac_covers_every_field_but_itself() -> None:
    hello = _hello()
    signed = dataclasses.replace(hello, mac=auth.sign(KEY, auth.HELLO_LABEL, NONCE, hello.signed_part()))
    # signed_part is the encoded body up to (not including) the mac.
    assert signed.encode() == signed.signed_part() + signed.mac
    assert signed.signed_part() == hello.signed_part()
    assert auth.verify(KEY, signed.mac, auth.HELLO_LABEL, NONCE, signed.signed_part())
    changes: dict[str, Any] = {
        "learner_id": 4,
        "data_streams": 3,
        "fingerprint": bytes(32),
        "wire_dtype": 2,
        "chunk_bytes": CHUNK_BYTES // 2,
        "flags": 1,
        "client_nonce": bytes(32),
        "push_block": 64,
        "instance": b"\x01" * 16,
        "downlink_dtype": 4,
    }
    assert set(changes) | {"mac"} == {f.name for f in dataclasses.fields(Hello)}
    for field, value in changes.items():
        forged = dataclasses.replace(signed, **{field: value})
        assert not auth.verify(KEY, forged.mac, auth.HELLO_LABEL, NONCE, forged.signed_part()), field


def test_a_recorded_hello_does_not_verify_under_a_new_challenge() -> None:
    hello = _hello()
    mac = auth.sign(KEY, auth.HELLO_LABEL, NONCE, hello.signed_part())
    assert not auth.verify(KEY, mac, auth.HELLO_LABEL, auth.new_nonce(), hello.signed_part())


def test_welcome_mac_binds_client_nonce_token_and_generation() -> None:
    client_nonce, token = bytes(range(0x40, 0x60)), bytes(range(16))
    mac = auth.sign(KEY, auth.WELCOME_LABEL, client_nonce, token, (5).to_bytes(4, "little"))
    assert auth.verify(KEY, mac, auth.WELCOME_LABEL, client_nonce, token, (5).to_bytes(4, "little"))
    assert not auth.verify(KEY, mac, auth.WELCOME_LABEL, client_nonce, token, (6).to_bytes(4, "little"))
    assert not auth.verify(KEY, mac, auth.WELCOME_LABEL, client_nonce, bytes(16), (5).to_bytes(4, "little"))
    assert not auth.verify(KEY, mac, auth.WELCOME_LABEL, bytes(32), token, (5).to_bytes(4, "little"))


def test_attach_mac_binds_the_stream_index() -> None:
    token = bytes(range(16))
    mac = auth.sign(KEY, auth.ATTACH_LABEL, NONCE, token, bytes([0]))
    assert auth.verify(KEY, mac, auth.ATTACH_LABEL, NONCE, token, bytes([0]))
    assert not auth.verify(KEY, mac, auth.ATTACH_LABEL, NONCE, token, bytes([1]))
