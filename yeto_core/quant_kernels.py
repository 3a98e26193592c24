"""Compiled loops of the block-quantized codecs (`quant.py`), when numba is installed (`yeto[fast]`).

Each codec written as torch ops makes about a dozen passes over the values (absolute value,
block maximum, division, rounding, clamping, nibble packing…): 0.1–0.2× a memory copy. The loops
of `quant_loops.py` make about three quick passes over each block while it is in cache, and
release the GIL: `run` cuts the blocks into one range per torch thread and runs the ranges on a
small pool of Python threads. (Numba's own thread layer is left alone: its default one may not be
entered from two threads at once, and the syncer decodes on several.)

They are the same arithmetic, operation for operation, in float32 (the same division by the
scale, the same round-half-even, the same exponent read for the level codecs, the same product
for decode), so the bytes and the values are the bits of the torch path whatever the number of
threads: each block is one range's. `quant.py` uses them for CPU tensors when `AVAILABLE`; the
tests hold both paths to the same bits.

They compile once per machine (numba's cache) and load on first use in a process (about 0.7 s
with numba's import), so importing yeto never waits for a compiler.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

AVAILABLE = importlib.util.find_spec("numba") is not None
KINDS = {"int8": 0, "int4": 1, "e3m0": 2, "int4-log": 3, "int2": 4}
MIN_BLOCKS_PER_RANGE = 2048  # a range below ~256K values costs more to hand over than it saves
_kernels: dict[str, Any] = {}
_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None


def kernels() -> dict[str, Any]:
    """The compiled encode and decode (compiled, or loaded from the cache, on the first call)."""
    with _lock:
        if not _kernels:
            from yeto_core import quant_loops  # lazy: imports numba

            _kernels.update(encode_linear=quant_loops.encode_linear, encode_level=quant_loops.encode_level,
                            encode_int2=quant_loops.encode_int2, decode=quant_loops.decode)
    return _kernels


def run(kernel: str, nblocks: int, threads: int, *args: Any) -> None:
    """`kernel` over blocks [0, nblocks), cut into at most `threads` ranges run side by side."""
    fn = kernels()[kernel]
    ranges = min(threads, max(1, nblocks // MIN_BLOCKS_PER_RANGE))
    if ranges <= 1:
        fn(*args, 0, nblocks)
        return
    cuts = [nblocks * k // ranges for k in range(ranges + 1)]
    pool = _pool()
    futures = [pool.submit(functools.partial(fn, *args, cuts[k], cuts[k + 1])) for k in range(1, ranges)]
    fn(*args, cuts[0], cuts[1])  # the calling thread takes the first range
    for f in futures:
        f.result()


def _forget_pool() -> None:
    """In a forked child: the parent's pool threads are not there (a new pool starts on demand)."""
    global _executor, _lock
    _executor, _lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def _pool() -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=max(1, (os.cpu_count() or 2) - 1),
                                           thread_name_prefix="yeto-codec")
        return _executor
