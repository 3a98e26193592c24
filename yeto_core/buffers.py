"""Receive buffers that are recycled once nobody holds them any more.

A bulk transfer is received with `recv_into` straight into one buffer. A fresh 64 MiB buffer
costs a page fault per page the kernel copies into (the memory is handed out lazily), which
measured as much as the transfer itself on loopback. So finished buffers are kept and handed
out again for the next transfer of the same size: a syncer receives one fragment-sized push per
learner per round, a learner one fragment-sized broadcast per round.

Nothing is ever returned by hand, which would make a use-after-return possible: the pool hands
out a *view* of a buffer it owns, and a finalizer on that view puts the buffer back on the free
list only when the last reference to the view is gone (the delivered memoryview, every slice of
it and every tensor made from it with `torch.frombuffer`). A buffer whose payload became a
long-lived tensor (an INIT adopted as the global parameters, an installed anchor) simply never
comes back.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

DEFAULT_IDLE_BYTES = 1 << 30  # at most this many bytes of finished buffers are kept for reuse
MIN_POOLED_BYTES = 1 << 20  # smaller buffers are cheap to fault in; not worth keeping


def receive_buffer(nbytes: int) -> memoryview:
    """A writable buffer that is not zero-filled: every byte is about to be overwritten by
    `recv_into`, and zero-filling a fresh 64 MiB buffer costs twice the transfer itself."""
    return memoryview(np.empty(nbytes, dtype=np.uint8))  # type: ignore[arg-type]


class BufferPool:
    """Buffers by exact size; `take` reuses a finished one or allocates."""

    def __init__(self, max_idle_bytes: int = DEFAULT_IDLE_BYTES) -> None:
        self.max_idle_bytes = max_idle_bytes
        self._lock = threading.Lock()
        self._free: dict[int, list[np.ndarray]] = {}
        self._idle_bytes = 0
        self.reused = 0  # counters for tests and benchmarks
        self.allocated = 0

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return self._idle_bytes

    def take(self, nbytes: int) -> memoryview:
        if nbytes < MIN_POOLED_BYTES:
            return receive_buffer(nbytes)
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                base = free.pop()
                self._idle_bytes -= nbytes
                self.reused += 1
            else:
                base = np.empty(nbytes, dtype=np.uint8)
                self.allocated += 1
        view = base[:]  # a new array object over the same memory: its death returns `base`
        weakref.finalize(view, self._give_back, base)
        return memoryview(view)  # type: ignore[arg-type]

    def _give_back(self, base: np.ndarray) -> None:
        with self._lock:
            if self._idle_bytes + base.nbytes > self.max_idle_bytes:
                return  # over the cap: let it be freed
            self._free.setdefault(base.nbytes, []).append(base)
            self._idle_bytes += base.nbytes

    def trim(self, keep: int) -> None:
        """Free the finished buffers beyond `keep` of each size: after a one-off burst (learner 0's
        INIT snapshot of every fragment) the pool need not hold what steady rounds never take."""
        with self._lock:
            for free in self._free.values():
                while len(free) > keep:
                    self._idle_bytes -= free.pop().nbytes

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._idle_bytes = 0


RECEIVE_POOL = BufferPool()  # one per process: every connection group's transfers draw on it
