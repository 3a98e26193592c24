"""Raw loopback TCP: the baseline every transfer benchmark compares yeto against.

A plain receiver in its own process (`recv_into` one buffer allocated and touched up front) and
plain sender threads here, moving N bytes in 4 MiB `sendall` chunks striped round-robin over the
same number of streams as yeto uses, with no framing. Both ends cycle through a buffer of at most
`RING` bytes, so a multi-GiB baseline costs no more memory than a 256 MiB one: every page is
still written by `recv_into` (and read by `sendall`) exactly as a first transfer writes it.
`transfer(n, fresh=True)` receives into N bytes of memory new to the receiver instead, mapped
for the transfer and unmapped after it: what landing an upload that the receiver keeps costs
(the page faults), which the ring never pays.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

CHUNK = 4 * 1024 * 1024
RING = 64 * CHUNK  # bytes each end keeps; offsets wrap modulo this (a whole number of chunks)
SINK_ROLE = "__raw_sink__"
REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# The receiver (its own process, like the syncer)
# ---------------------------------------------------------------------------------------------
def _raw_sink(max_bytes: int, streams: int) -> int:
    buf = bytearray(min(max_bytes, RING))
    view = memoryview(buf)
    for off in range(0, len(buf), 4096):  # touch every page once, outside any timing
        buf[off] = 1
    lsock = socket.create_server(("127.0.0.1", 0))
    print(f"port {lsock.getsockname()[1]}", flush=True)
    conns: list[socket.socket] = [None] * streams  # type: ignore[list-item]
    for _ in range(streams):
        c, _peer = lsock.accept()
        idx = c.recv(1)
        conns[idx[0]] = c
    lsock.close()
    jobs = [queue.SimpleQueue[tuple[int, memoryview] | None]() for _ in range(streams)]
    ends: queue.SimpleQueue[tuple[float, int]] = queue.SimpleQueue()

    def worker(i: int) -> None:
        sock = conns[i]
        while True:
            job = jobs[i].get()
            if job is None:
                return
            nbytes, target = job
            got_total = 0
            for off in range(i * CHUNK, nbytes, streams * CHUNK):
                n = min(CHUNK, nbytes - off)
                at = off % len(target)
                got = 0
                while got < n:
                    k = sock.recv_into(target[at + got : at + n], n - got)
                    if k == 0:
                        ends.put((time.time(), -1))
                        return
                    got += k
                got_total += n
            ends.put((time.time(), got_total))

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(streams)]
    for t in threads:
        t.start()
    print("ready", flush=True)
    for line in sys.stdin:
        words = line.split()
        nbytes = int(words[0])
        if nbytes <= 0 or nbytes > max_bytes:
            break
        fresh = mmap.mmap(-1, nbytes) if words[1:] == ["fresh"] else None
        target = memoryview(fresh) if fresh is not None else view
        for q in jobs:
            q.put((nbytes, target))
        print("go", flush=True)
        results = [ends.get() for _ in range(streams)]
        if fresh is not None:
            target.release()
            fresh.close()
        if any(n < 0 for _, n in results) or sum(n for _, n in results) != nbytes:
            print("error", flush=True)
            return 1
        print(f"done {max(t for t, _ in results)!r}", flush=True)
    for q in jobs:
        q.put(None)
    return 0


class RawLoopback:
    """Sender side of the raw baseline; the receiver is a `_raw_sink` subprocess."""

    def __init__(self, max_bytes: int, streams: int) -> None:
        self.streams = streams
        self.src = bytearray(os.urandom(CHUNK)) * ((min(max_bytes, RING) + CHUNK - 1) // CHUNK)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.loopback", SINK_ROLE, str(max_bytes), str(streams)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, cwd=REPO,
        )
        self.socks: list[socket.socket] = []
        try:
            port = int(self._expect("port ").split()[1])
            for i in range(streams):
                s = socket.create_connection(("127.0.0.1", port))
                self.socks.append(s)
                s.sendall(bytes([i]))
            self._expect("ready")
        except BaseException:
            self.close()
            raise

    def _expect(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith(prefix):
            raise RuntimeError(f"raw receiver said {line!r}, expected {prefix!r}")
        return line

    def transfer(self, nbytes: int, *, fresh: bool = False) -> float:
        """Seconds from the first sendall to the receiver's last byte; `fresh`: received into
        memory new to the receiver (the module's docstring)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{nbytes}{' fresh' if fresh else ''}\n")
        self.proc.stdin.flush()
        self._expect("go")
        view = memoryview(self.src)
        errors: list[BaseException] = []

        def send(i: int) -> None:
            try:
                for off in range(i * CHUNK, nbytes, self.streams * CHUNK):
                    at = off % len(view)
                    self.socks[i].sendall(view[at : at + min(CHUNK, nbytes - off)])
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=send, args=(i,)) for i in range(self.streams)]
        t0 = time.time()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        end = self._expect("done ")
        if errors:
            raise RuntimeError(f"raw sender failed: {errors[0]}")
        return float(end.split()[1]) - t0

    def close(self) -> None:
        for s in self.socks:
            with contextlib.suppress(OSError):
                s.close()
        stop_process(self.proc)


def stop_process(proc: subprocess.Popen[Any]) -> None:
    """Terminate one child by its pid, escalating to SIGKILL; safe to call twice."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()




if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == SINK_ROLE:
    sys.exit(_raw_sink(int(sys.argv[2]), int(sys.argv[3])))
