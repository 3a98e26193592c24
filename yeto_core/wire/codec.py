"""Bounded binary readers and writers for message bodies.

Every variable-length field is length-prefixed and its length is checked against a bound
*before* anything is allocated, so a hostile or corrupt peer can never make us allocate more
than the bound. Integers are little-endian and fixed-width. There is no pickle or eval here.
"""

from __future__ import annotations

import struct

from yeto_core.wire.errors import ProtocolError

MAX_STR_BYTES = 64 * 1024
MAX_LIST_ITEMS = 1 << 20

_U8 = struct.Struct("<B")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_F64 = struct.Struct("<d")


class BodyWriter:
    """Appends fixed-width fields to a growing body."""

    __slots__ = ("_parts",)

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def _int(self, fmt: struct.Struct, v: int) -> BodyWriter:
        try:
            self._parts.append(fmt.pack(v))
        except struct.error as exc:
            raise ValueError(f"{v!r} does not fit a {fmt.size * 8}-bit unsigned field") from exc
        return self

    def u8(self, v: int) -> BodyWriter:
        return self._int(_U8, v)

    def u16(self, v: int) -> BodyWriter:
        return self._int(_U16, v)

    def u32(self, v: int) -> BodyWriter:
        return self._int(_U32, v)

    def u64(self, v: int) -> BodyWriter:
        return self._int(_U64, v)

    def f64(self, v: float) -> BodyWriter:
        self._parts.append(_F64.pack(v))
        return self

    def fixed(self, data: bytes, size: int) -> BodyWriter:
        if len(data) != size:
            raise ValueError(f"expected {size} bytes, got {len(data)}")
        self._parts.append(bytes(data))
        return self

    def string(self, s: str) -> BodyWriter:
        raw = s.encode("utf-8")
        if len(raw) > MAX_STR_BYTES:
            raise ValueError(f"string of {len(raw)} bytes exceeds the {MAX_STR_BYTES}-byte bound")
        self._parts.append(_U32.pack(len(raw)))
        self._parts.append(raw)
        return self

    def blob(self, data: bytes, bound: int) -> BodyWriter:
        if len(data) > bound:
            raise ValueError(f"blob of {len(data)} bytes exceeds the {bound}-byte bound")
        self._parts.append(_U32.pack(len(data)))
        self._parts.append(bytes(data))
        return self

    def getvalue(self) -> bytes:
        return b"".join(self._parts)


class BodyReader:
    """Reads fields back, naming the message and field on any malformation."""

    __slots__ = ("_buf", "_pos", "_what")

    def __init__(self, buf: bytes | memoryview, what: str) -> None:
        self._buf = memoryview(buf)
        self._pos = 0
        self._what = what

    def _take(self, n: int, field: str) -> memoryview:
        end = self._pos + n
        if end > len(self._buf):
            raise ProtocolError(f"{self._what}: body ends inside field '{field}'")
        view = self._buf[self._pos : end]
        self._pos = end
        return view

    def u8(self, field: str) -> int:
        return int(_U8.unpack(self._take(1, field))[0])

    def u16(self, field: str) -> int:
        return int(_U16.unpack(self._take(2, field))[0])

    def u32(self, field: str) -> int:
        return int(_U32.unpack(self._take(4, field))[0])

    def u64(self, field: str) -> int:
        return int(_U64.unpack(self._take(8, field))[0])

    def f64(self, field: str) -> float:
        return float(_F64.unpack(self._take(8, field))[0])

    def fixed(self, size: int, field: str) -> bytes:
        return bytes(self._take(size, field))

    def string(self, field: str) -> str:
        n = self.u32(field)
        if n > MAX_STR_BYTES:
            raise ProtocolError(f"{self._what}: field '{field}' claims {n} bytes (bound {MAX_STR_BYTES})")
        try:
            return str(self._take(n, field).tobytes().decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise ProtocolError(f"{self._what}: field '{field}' is not valid UTF-8") from exc

    def blob(self, bound: int, field: str) -> bytes:
        n = self.u32(field)
        if n > bound:
            raise ProtocolError(f"{self._what}: field '{field}' claims {n} bytes (bound {bound})")
        return bytes(self._take(n, field))

    def count(self, field: str, bound: int = MAX_LIST_ITEMS) -> int:
        n = self.u32(field)
        if n > bound:
            raise ProtocolError(f"{self._what}: list '{field}' claims {n} items (bound {bound})")
        return n

    def end(self) -> None:
        if self._pos != len(self._buf):
            extra = len(self._buf) - self._pos
            raise ProtocolError(f"{self._what}: {extra} unexpected trailing bytes")
