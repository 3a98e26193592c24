"""HMAC-SHA256 challenge–response (DESIGN §7.2, PROTOCOL §4.3).

The syncer opens every stream with a fresh 32-byte nonce. The learner answers with
HMAC(key, label | nonce | what it claims), so a recorded HELLO cannot be replayed on another
connection, and the syncer answers WELCOME with HMAC over the learner's own nonce, so a learner
also knows it reached a syncer holding the same key. Comparisons are constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from yeto_core.wire.messages import NONCE_BYTES, TOKEN_BYTES

HELLO_LABEL = b"yeto-hello-v1"
WELCOME_LABEL = b"yeto-welcome-v1"
ATTACH_LABEL = b"yeto-attach-v1"
PROBE_LABEL = b"yeto-probe-v1"


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def new_token() -> bytes:
    return secrets.token_bytes(TOKEN_BYTES)


def sign(key: bytes, label: bytes, *parts: bytes) -> bytes:
    mac = hmac.new(key, label, hashlib.sha256)
    for part in parts:
        mac.update(len(part).to_bytes(4, "little"))
        mac.update(part)
    return mac.digest()


def verify(key: bytes, mac: bytes, label: bytes, *parts: bytes) -> bool:
    return hmac.compare_digest(sign(key, label, *parts), mac)
