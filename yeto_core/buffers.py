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

Memory that must be new (learner 0's INIT, which becomes the syncer's parameters) is `reserve`d as
soon as its sizes are known: allocated at once and faulted in on a thread of its own, ahead of
the transfer, so `recv_into` finds resident pages instead of taking a fault per page on the
receiving thread (at 4 GiB that fault was three quarters of the INIT's time, `benchmarks/scale.py`).

Large buffers are anonymous mappings whose huge-page advice is chosen here rather than left to
numpy (which advises every large array). Pooled buffers ask for huge pages: they are used round
after round, and a 512 MiB `recv_into` ran ~10% faster into them. A reserve asks for none: where
the kernel's THP `defrag` setting is `madvise` (a common default) a fault in an advised region
compacts memory synchronously, and fresh advised buffers faulted in at 0.4–0.9 GB/s on some runs
against 2–4 GB/s unadvised, on one machine; a reserve is faulted in once, while the INIT is on its
way, and speed then is all that counts.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import sys
import threading
import weakref
from collections.abc import Callable, Sequence

import numpy as np

DEFAULT_IDLE_BYTES = 1 << 30  # at most this many bytes of finished buffers are kept for reuse
MIN_POOLED_BYTES = 1 << 20  # smaller buffers are cheap to fault in; not worth keeping


# Linux 5.14+: fault a range in as if written, leaving its contents as they are (so a thread may
# fill the buffer while another faults it in). Older kernels refuse it: nothing is faulted ahead.
_MADV_POPULATE_WRITE = 23


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    # Through ctypes, which lets go of the GIL for the call: faulting in 512 MiB takes a quarter of
    # a second, and the receiving threads need the GIL between their recv_into calls meanwhile.
    if not sys.platform.startswith("linux"):  # the advice's number is Linux's
        return None
    try:  # the process's own symbols, libc's among them (no library search, no subprocess)
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _libc_madvise()


def fresh_array(nbytes: int, *, huge: bool = True) -> np.ndarray:
    """`nbytes` of new memory, not zero-filled by us: an anonymous private mapping from
    `MIN_POOLED_BYTES` up (plain numpy below that), unmapped when the last reference to it goes.
    `huge`: advised for transparent huge pages, for a buffer that is used again and again (the
    module docstring says what that costs its first touch, and why a reserve asks for none)."""
    if nbytes < MIN_POOLED_BYTES or not hasattr(mmap, "MAP_ANONYMOUS"):
        return np.empty(nbytes, dtype=np.uint8)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # a kernel built without huge pages refuses the advice
            mapping.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(mapping, dtype=np.uint8)


def fault_in(array: np.ndarray) -> bool:
    """Make `array`'s pages resident without changing a byte of it; False where the kernel
    cannot (then the first write to each page faults it in, as it would have anyway)."""
    if _MADVISE is None or array.nbytes == 0:
        return False
    start = array.ctypes.data
    aligned = start - start % mmap.PAGESIZE
    return _MADVISE(aligned, array.nbytes + (start - aligned), _MADV_POPULATE_WRITE) == 0


def receive_buffer(nbytes: int) -> memoryview:
    """A writable buffer that is not zero-filled: every byte is about to be overwritten by
    `recv_into`, and zero-filling a fresh 64 MiB buffer costs twice the transfer itself."""
    return memoryview(fresh_array(nbytes))  # type: ignore[arg-type]


class BufferPool:
    """Buffers by exact size; `take` reuses a finished one or allocates."""

    def __init__(self, max_idle_bytes: int = DEFAULT_IDLE_BYTES) -> None:
        self.max_idle_bytes = max_idle_bytes
        self._lock = threading.Lock()
        self._free: dict[int, list[np.ndarray]] = {}
        self._idle_bytes = 0
        self.reused = 0  # counters for tests and benchmarks
        self.allocated = 0
        self.faulted_ahead = 0  # reserved buffers made resident before anything was written to them
        self._prefaulting: threading.Thread | None = None

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
                base = fresh_array(nbytes)
                self.allocated += 1
        view = base[:]  # a new array object over the same memory: its death returns `base`
        weakref.finalize(view, self._give_back, base)
        return memoryview(view)  # type: ignore[arg-type]

    def reserve(self, sizes: Sequence[int]) -> None:
        """Transfers of these sizes are about to arrive, in this order: allocate a buffer for each
        now (beyond the idle cap: they are spoken for) and fault them in, in that order, on a
        thread of its own. A `take` gets them first to last, faulted in or not yet: the thread
        and `recv_into` may work on one buffer at once, since faulting in changes no byte."""
        pooled = [n for n in sizes if n >= MIN_POOLED_BYTES]
        if not pooled:
            return
        ahead = [fresh_array(n, huge=False) for n in pooled]
        with self._lock:
            for base in reversed(ahead):  # `take` pops from the end: the first size comes out first
                self._free.setdefault(base.nbytes, []).append(base)
                self._idle_bytes += base.nbytes
            self.allocated += len(ahead)
        self._prefaulting = threading.Thread(target=self._fault_in_all, args=(ahead,), name="yeto-fault-in",
                                             daemon=True)
        self._prefaulting.start()

    def _fault_in_all(self, ahead: list[np.ndarray]) -> None:
        for base in ahead:
            if not fault_in(base):
                return
            with self._lock:
                self.faulted_ahead += 1

    def wait_reserved(self, timeout: float | None = None) -> bool:
        """Whether the reserved buffers are all faulted in (or the kernel could not), waiting up
        to `timeout` seconds for the thread: for tests and benchmarks."""
        thread = self._prefaulting
        if thread is not None:
            thread.join(timeout)
        return thread is None or not thread.is_alive()

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

    def settle(self) -> None:
        """Free idle buffers beyond the cap: those of a `reserve` that went unused (a transfer that
        began before the reserve did, so it took a buffer of its own)."""
        with self._lock:
            for free in self._free.values():
                while free and self._idle_bytes > self.max_idle_bytes:
                    self._idle_bytes -= free.pop().nbytes

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._idle_bytes = 0


RECEIVE_POOL = BufferPool()  # one per process: every connection group's transfers draw on it
