"""The initial cut (DESIGN §4.2): learner 0's MANIFEST pins the model (`initial_state`), its INIT
fragments become the committed values, and once every fragment is in, the cut is checkpointed,
recorded and sent to every learner connected.

An INIT payload is the shell's to look at (`effects.CheckInit`, an ask): it comes back as the
fragment's values on the merge device, checked finite (`events.InitChecked`), and only then is it
taken in. An INIT after the cut is ignored by design: learner 0 sends MANIFEST and INIT again with
each new connection group until it has the cut, so an upload cut off midway is replayed.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from syncer.core import records
from syncer.core.effects import CheckInit, Checkpoint, FaultPoint, Log, StallTimeout
from syncer.core.events import InitChecked
from syncer.core.links import Link, Phase, backend_id
from syncer.core.memory import add_members
from syncer.core.outbox import Outbox
from syncer.core.run_state import RunState
from syncer.durability.checkpoint import SyncerState
from yeto_core.codecs import F32
from yeto_core.layout import Layout
from yeto_core.sections import MergeSettings
from yeto_core.wire.errors import ErrorCode
from yeto_core.wire.messages import Init

log = logging.getLogger("yeto.syncer")

INIT_EXIT_CODE = 3  # no complete INIT from learner 0 in time


def lazy_zeros(numel: int, device: torch.device) -> torch.Tensor:
    """Zeros that cost nothing until written. On the CPU, numpy's calloc maps the kernel's zero
    pages, where torch.zeros would fault in and clear every page while learner 0's INIT streams
    in (150 ms for a 256 MiB model here); a fragment's pages are faulted in by its first merge."""
    if device.type == "cpu":
        return torch.from_numpy(np.zeros(numel, dtype=np.float32))
    return torch.zeros(numel, dtype=torch.float32, device=device)


def initial_state(layout: Layout, merging: MergeSettings, device: torch.device) -> SyncerState:
    """The global state a pinned model starts from: version 0 everywhere, zero momentum, and no
    params yet (each INIT fragment's buffer becomes its fragment's)."""
    p = layout.num_fragments
    params = [torch.empty(0, dtype=torch.float32, device=device) for _ in layout.fragments]
    momentum = [lazy_zeros(f.numel, device) for f in layout.fragments]
    delayed = merging.outer_optimizer == "delayed-nesterov"
    return SyncerState(
        specs=list(layout.specs), num_fragments=p, pattern=layout.pattern, fingerprint=layout.fingerprint,
        backend=backend_id(merging), params=params, momentum=momentum, versions=[0] * p,
        next_round=0, ledger={}, finalized=False,
        outer_accum=[lazy_zeros(m.numel(), device) for m in momentum] if delayed else None,
        outer_count=[0] * p if delayed else [], merged_by=[(-1, []) for _ in range(p)],
        extra={"outer_lr": merging.outer_lr, "outer_momentum": merging.outer_momentum,
               "outer_momentum_warmup": merging.outer_momentum_warmup},
    )


class InitialCut:
    def __init__(self, run: RunState, outbox: Outbox, *, now: float) -> None:
        self.shared = run
        self.outbox = outbox
        self.started = now
        self.received: set[int] = set()  # fragments of learner 0's INIT taken in so far

    def timed_out(self, now: float) -> bool:
        """No complete INIT in time: the run gives up (exit code `INIT_EXIT_CODE`)."""
        limit = self.shared.settings.init_timeout_s
        if now - self.started <= limit:
            return False
        log.error("no complete INIT from learner 0 within %.0f s; giving up", limit)
        return True

    def on_init(self, link: Link, msg: Init, payload: memoryview | None, screened: bool | None) -> None:
        run = self.shared
        if run.phase is not Phase.WAIT_INIT or run.layout is None or run.state is None:
            return  # a replayed INIT after the initial cut: ignored by design
        if link.learner_id != 0:
            run.refuse(link, ErrorCode.PROTOCOL, "only learner 0 sends INIT")
            return
        if msg.fragment >= run.layout.num_fragments or msg.codec != F32.wire_id:
            run.refuse(link, ErrorCode.PROTOCOL, f"INIT names fragment {msg.fragment} with codec {msg.codec}")
            return
        numel = run.layout.fragments[msg.fragment].numel
        if payload is None or len(payload) != numel * 4:
            run.refuse(link, ErrorCode.PROTOCOL, f"INIT of fragment {msg.fragment} has "
                       f"{0 if payload is None else len(payload)} bytes, expected {numel * 4}")
            return
        if screened is False:  # the transport's screen found NaN or Inf as the chunks landed
            self._nonfinite(link, msg.fragment)
            return
        run.emit(CheckInit(link.peer, msg.fragment, payload, screened))

    def checked(self, ev: InitChecked) -> None:
        """The shell's answer to `CheckInit`: the fragment's values, or None (NaN or Inf)."""
        run = self.shared
        link = run.links.get(ev.learner_id)
        if link is None or link.generation != ev.generation or run.state is None or run.layout is None:
            return
        if ev.values is None:
            self._nonfinite(link, ev.fragment)
            return
        run.state.params[ev.fragment] = ev.values
        self.received.add(ev.fragment)
        if len(self.received) == run.layout.num_fragments:
            self._cut()
        else:
            run.emit(FaultPoint("mid-init"))

    def _nonfinite(self, link: Link, fragment: int) -> None:
        self.shared.refuse(link, ErrorCode.REFUSED, f"INIT of fragment {fragment} contains NaN or Inf")

    def _cut(self) -> None:
        run = self.shared
        assert run.state is not None
        run.phase = Phase.RUNNING
        add_members(run.state, run.links)
        run.emit(Checkpoint())
        run.record(records.Init(run.state.num_fragments, run.state.fingerprint.hex()))
        run.emit(Log(f"initial cut ready: broadcasting {run.state.num_fragments} fragments to {len(run.links)} "
                     "learners"))
        for link in list(run.links.values()):
            run.emit(StallTimeout(link.peer, run.settings.streams.stall_timeout_s))
            self.outbox.send_full_state(link)
