"""Errors of the wire layer. The message always says whose fault it is and what was wrong."""

from __future__ import annotations

from enum import IntEnum


class ErrorCode(IntEnum):
    """Codes carried by ERROR frames; permanent ones stop a learner from redialing."""

    PROTOCOL = 1  # malformed, oversize or unexpected frame
    AUTH = 2  # HMAC challenge-response failed (wrong key)
    LAYOUT = 3  # layout fingerprint or fragment count differs from the syncer's
    CONTRACT = 4  # session contract (dtype, chunk size, protocol version) not accepted
    REFUSED = 5  # a push or request was refused (stale, NaN, not a member ...)
    SHUTDOWN = 6  # the syncer is finishing or stopping
    DUPLICATE = 7  # another live connection group holds this learner id

    @property
    def permanent(self) -> bool:
        """Retrying with the same key and model cannot succeed."""
        return self in (ErrorCode.AUTH, ErrorCode.LAYOUT, ErrorCode.CONTRACT, ErrorCode.DUPLICATE)


class WireError(Exception):
    """Base class of every wire-level failure."""


class ProtocolError(WireError):
    """The peer sent bytes that do not follow the protocol (its fault)."""


class ConnectionClosed(WireError):
    """The connection ended, cleanly or not."""


class Refused(WireError):
    """A refusal with an ERROR code: the peer refused us, or (raised by a handshake check) we refuse
    the peer; `code` tells whether retrying can help."""

    def __init__(self, code: ErrorCode, reason: str) -> None:
        super().__init__(f"{code.name.lower()}: {reason}")
        self.code = code
        self.reason = reason
