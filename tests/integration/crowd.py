"""A crowd of connections that never finish what they start, for the flood tests.

Each of `size` connections sends the next byte of `trickle` once a second (never a whole frame
or request head) and is reopened when the server cuts it; the number opened in all is bounded.
Connections the server has not accepted yet complete in its kernel backlog, so they count as open.
"""

from __future__ import annotations

import socket
import threading
import time


class Crowd:
    def __init__(self, port: int, size: int, *, trickle: bytes = b"\x00", source: str = "127.0.0.1",
                 per_pass: int = 20, max_connections: int = 20_000) -> None:
        """`trickle`: the bytes sent one a second, from the start again when used up (empty: the
        crowd stays silent); `per_pass`: new connections per pass, ten passes a second."""
        self.port = port
        self.trickle = trickle
        self.source = source
        self.per_pass = per_pass
        self.max_connections = max_connections
        self.opened = 0
        self.cut = 0
        self._socks: list[tuple[socket.socket, float, int] | None] = [None] * size
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="crowd", daemon=True)

    def __enter__(self) -> Crowd:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for entry in self._socks:
            if entry is not None:
                entry[0].close()

    def open_now(self) -> int:
        return sum(entry is not None for entry in self._socks)

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            budget = self.per_pass
            for i, entry in enumerate(self._socks):
                if entry is None:
                    if self.opened >= self.max_connections or budget <= 0:
                        continue
                    budget -= 1
                    try:
                        sock = socket.create_connection(("127.0.0.1", self.port), timeout=0.5,
                                                        source_address=(self.source, 0))
                    except OSError:
                        continue
                    sock.setblocking(False)
                    self.opened += 1
                    self._socks[i] = (sock, now - 1.0, 0)
                    continue
                sock, last, sent = entry
                if self._gone(sock):
                    self._drop(i, sock)
                elif self.trickle and now - last >= 1.0:
                    at = sent % len(self.trickle)
                    try:
                        sock.send(self.trickle[at:at + 1])
                        self._socks[i] = (sock, now, sent + 1)
                    except OSError:
                        self._drop(i, sock)
            self._stop.wait(0.1)

    def _drop(self, i: int, sock: socket.socket) -> None:
        sock.close()
        self.cut += 1
        self._socks[i] = None

    @staticmethod
    def _gone(sock: socket.socket) -> bool:
        """EOF or reset from the server (whatever it sends first is read and dropped)."""
        try:
            while True:
                if not sock.recv(65536):
                    return True
        except BlockingIOError:
            return False
        except OSError:
            return True
