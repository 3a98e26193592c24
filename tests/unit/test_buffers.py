"""The receive-buffer pool: a buffer comes back only when nothing references it any more."""

from __future__ import annotations

import gc
import mmap
import resource
from pathlib import Path

import numpy as np
import pytest
import torch

from yeto_core.buffers import MIN_POOLED_BYTES, BufferPool, fault_in, fresh_array

pytestmark = pytest.mark.unit

SIZE = 2 * MIN_POOLED_BYTES


def address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def test_a_released_buffer_is_handed_out_again() -> None:
    pool = BufferPool()
    first = pool.take(SIZE)
    where = address(first)
    del first
    gc.collect()
    assert pool.idle_bytes == SIZE
    again = pool.take(SIZE)
    assert address(again) == where
    assert (pool.allocated, pool.reused) == (1, 1)
    assert pool.idle_bytes == 0


def test_a_buffer_held_through_a_slice_or_a_tensor_is_not_reused() -> None:
    pool = BufferPool()
    buf = pool.take(SIZE)
    piece = buf[100:200]
    tensor = torch.frombuffer(buf, dtype=torch.float32)
    tensor.fill_(1.5)
    del buf
    gc.collect()
    other = pool.take(SIZE)  # the first one is still referenced: a second allocation
    assert address(other) != tensor.data_ptr()
    memoryview(other).cast("B")[:] = b"\0" * SIZE
    assert bool((tensor == 1.5).all()), "a buffer in use was handed out again"
    del other, piece
    gc.collect()
    assert pool.idle_bytes == SIZE  # `other` came back; `tensor` still holds the first
    del tensor
    gc.collect()
    assert pool.idle_bytes == 2 * SIZE


def test_sizes_are_kept_apart_and_small_buffers_are_not_pooled() -> None:
    pool = BufferPool()
    big = pool.take(SIZE)
    del big
    gc.collect()
    other_size = pool.take(SIZE + 8)
    assert pool.allocated == 2 and pool.reused == 0
    small = pool.take(MIN_POOLED_BYTES - 1)
    assert len(small) == MIN_POOLED_BYTES - 1
    del small, other_size
    gc.collect()
    assert pool.idle_bytes == 2 * SIZE + 8


def test_idle_buffers_are_capped() -> None:
    pool = BufferPool(max_idle_bytes=SIZE)
    a, b = pool.take(SIZE), pool.take(SIZE)
    del a, b
    gc.collect()
    assert pool.idle_bytes == SIZE  # the second one was freed, not kept
    pool.clear()
    assert pool.idle_bytes == 0


def _minor_faults_writing(view: memoryview) -> int:
    """Page faults this thread takes writing every page of `view` once."""
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    np.frombuffer(view, dtype=np.uint8)[:: mmap.PAGESIZE] = 7
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


def test_reserved_buffers_come_out_in_order_already_faulted_in() -> None:
    """Learner 0's INIT: its buffers are allocated when the model is pinned and faulted in ahead
    of the transfer, so the receiving thread writes into resident pages."""
    pool = BufferPool(max_idle_bytes=0)  # reserved buffers are spoken for: not held to the idle cap
    sizes = [4 * SIZE, 2 * SIZE, 4 * SIZE, MIN_POOLED_BYTES - 8]  # the last too small to pool
    pool.reserve(sizes)
    assert pool.wait_reserved(timeout=30)
    assert pool.allocated == 3 and pool.idle_bytes == 10 * SIZE
    first, second, third = (pool.take(n) for n in sizes[:3])
    assert [len(first), len(second), len(third)] == sizes[:3] and pool.reused == 3 and pool.allocated == 3
    if pool.faulted_ahead:  # the kernel faults ranges in on request (Linux 5.14 and later)
        assert pool.faulted_ahead == 3
        assert _minor_faults_writing(first) < len(first) // mmap.PAGESIZE // 10
    else:
        assert _minor_faults_writing(first) >= len(first) // mmap.PAGESIZE // 2  # faulted in by the write
    pool.take(4 * SIZE)  # the reserve is spent: a new buffer
    assert pool.allocated == 4
    fresh = memoryview(fresh_array(4 * SIZE, huge=False))  # type: ignore[arg-type]
    assert _minor_faults_writing(fresh) >= len(fresh) // mmap.PAGESIZE // 2  # not faulted in: a fault a page


def test_faulting_in_changes_no_byte_of_a_buffer_being_filled() -> None:
    pool = BufferPool()
    pool.reserve([SIZE])
    taken = pool.take(SIZE)  # handed out at once, perhaps while the thread still faults it in
    np.frombuffer(taken, dtype=np.uint8)[:] = 0x5A
    assert pool.wait_reserved(timeout=30)
    assert bool((np.frombuffer(taken, dtype=np.uint8) == 0x5A).all())
    assert fault_in(np.frombuffer(taken, dtype=np.uint8)) in (True, False)
    assert bool((np.frombuffer(taken, dtype=np.uint8) == 0x5A).all())


def test_large_buffers_are_writable_anonymous_memory_small_ones_plain_numpy() -> None:
    big, small = fresh_array(SIZE), fresh_array(MIN_POOLED_BYTES - 1)
    assert isinstance(big.base, memoryview) and isinstance(big.base.obj, mmap.mmap)
    assert big.flags.writeable and len(big) == SIZE
    assert small.base is None and small.flags.writeable
    view = memoryview(big)  # type: ignore[arg-type]
    assert not view.readonly
    torch.frombuffer(view, dtype=torch.float32).fill_(3.0)
    assert float(np.frombuffer(view, dtype=np.float32).sum()) == 3.0 * SIZE / 4


def test_settling_frees_what_a_reserve_left_unused_down_to_the_cap() -> None:
    pool = BufferPool(max_idle_bytes=SIZE)
    early = pool.take(2 * SIZE)  # a transfer that began before the reserve: a buffer of its own
    pool.reserve([2 * SIZE, 2 * SIZE])
    assert pool.wait_reserved(timeout=30)
    late = pool.take(2 * SIZE)
    assert pool.idle_bytes == 2 * SIZE  # one reserved buffer left over, above the cap
    pool.settle()
    assert pool.idle_bytes == 0 and len(early) == len(late) == 2 * SIZE


def _vm_flags(array: np.ndarray) -> set[str]:
    """The kernel's flags for the mapping that holds `array` (Linux's /proc/self/smaps)."""
    start = array.ctypes.data
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if lo <= start < hi:
                flags = next(x for x in lines[i + 1:] if x.startswith("VmFlags:"))
                return set(flags.split()[1:])
    raise AssertionError("no mapping holds the array")


@pytest.mark.skipif(not Path("/proc/self/smaps").exists() or not hasattr(mmap, "MADV_HUGEPAGE"),
                    reason="the kernel's mapping flags are Linux's")
def test_pooled_buffers_ask_for_huge_pages_and_reserved_ones_do_not() -> None:
    pool = BufferPool()
    pooled = np.frombuffer(pool.take(SIZE), dtype=np.uint8)
    pool.reserve([2 * SIZE])
    reserved = np.frombuffer(pool.take(2 * SIZE), dtype=np.uint8)
    if Path("/sys/kernel/mm/transparent_hugepage/enabled").exists():  # a kernel with huge pages takes the advice
        assert "hg" in _vm_flags(pooled)  # MADV_HUGEPAGE: used round after round
    assert "hg" not in _vm_flags(reserved)  # faulted in once, ahead, without synchronous compaction
    assert pool.wait_reserved(timeout=30)
