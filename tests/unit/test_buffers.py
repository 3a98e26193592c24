"""The receive-buffer pool: a buffer comes back only when nothing references it any more."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from yeto_core.buffers import MIN_POOLED_BYTES, BufferPool

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
