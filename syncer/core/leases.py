"""One rule for the committed fragment tensors: nothing writes a tensor that someone still reads.

A commit writes a fragment's params, momentum and outer accumulator in place, and its broadcast's
encode moves the fragment's downlink anchors in place. Two kinds of
reader read committed tensors on threads of their own: a connection group's sender streaming a
fragment's bytes without a copy (`outbox.py`), and a background checkpoint writing its snapshot
(`snapshots.py`). Each takes a lease on the tensors it reads, a predicate that is true while it
still reads them. Before a commit writes fragment f, `writable` replaces every leased tensor of
f in the run's state by a fresh copy: the commit writes the copy and the readers finish on the
old tensor, which nothing writes again. On a fast link every lease has ended long before the
fragment's next commit, and nothing is copied.

Leases are taken and checked on the coordinator's thread only; a lease only ever goes from
reading to done, so a lease seen done stays done.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from yeto_core.buffers import BufferPool

KINDS = ("param", "momentum", "accum")  # and a downlink chain's anchors, "downlink<codec id>"
Reading = Callable[[], bool]  # True while the reader may still read the tensor

COPY_POOL = BufferPool()  # host copies, recycled once no reader holds them (a warm buffer copies faster)


def fresh_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` that shares no memory with it: on the CPU into a recycled buffer."""
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return tensor.clone()
    out = torch.frombuffer(COPY_POOL.take(tensor.numel() * 4), dtype=torch.float32)
    return out.copy_(tensor.reshape(-1)).view(tensor.shape)


class Leases:
    def __init__(self) -> None:
        self._held: dict[tuple[int, str], list[Reading]] = {}
        self.copied: list[tuple[int, str]] = []  # (fragment, kind) of every copy made, oldest first

    def take(self, fragment: int, kind: str, reading: Reading) -> None:
        """A reader reads fragment `fragment`'s `kind` tensor while `reading()` is true."""
        assert kind in KINDS or kind.startswith("downlink"), kind
        self._held.setdefault((fragment, kind), []).append(reading)

    def leased(self, fragment: int, kind: str) -> bool:
        """Whether a reader still reads that tensor (the ended leases are dropped)."""
        key = (fragment, kind)
        live = [r for r in self._held.get(key, []) if r()]
        if live:
            self._held[key] = live
        else:
            self._held.pop(key, None)
        return bool(live)

    def fresh(self, fragment: int, kind: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (fragment `fragment`'s `kind`), safe to write in place: itself, or a copy of it
        while a reader still reads it."""
        if not self.leased(fragment, kind):
            return tensor
        self._held.pop((fragment, kind), None)  # the new tensor has no reader yet
        self.copied.append((fragment, kind))
        return fresh_copy(tensor)

    def writable(self, fragment: int, tensors: dict[str, list[torch.Tensor] | None]) -> dict[str, torch.Tensor]:
        """Make fragment `fragment`'s tensors of each kind (`tensors[kind]`, the state's lists)
        safe to write in place: each leased one is replaced in its list by a copy. Returns the
        tensors that were replaced, by kind, so holders of other references can follow."""
        moved: dict[str, torch.Tensor] = {}
        for kind, held in tensors.items():
            if held is not None and (copy := self.fresh(fragment, kind, held[fragment])) is not held[fragment]:
                held[fragment] = moved[kind] = copy
        return moved
