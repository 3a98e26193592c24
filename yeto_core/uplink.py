"""What a learner sends the syncer in bulk: its pushes, and learner 0's INIT upload.

`PushEncoder` turns a `PushJob` into the PUSH frame and its payload: f32 deltas are their own
wire bytes (no copy), bf16 ones are rounded chunk by chunk by the data streams' sender threads
(`Bf16Parts`), and the quantized codecs encode into one reusable buffer per size, since a
learner has a single push in flight at a time. `upload_init` sends every fragment's initial
values over a connection group, with a progress bar, until done, interrupted or stopped.
`PushSender` is the thread that sends pushes; `InitRequest` asks the training thread for INIT.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from yeto_core.buffers import receive_buffer
from yeto_core.codecs import BF16, F32, Bf16Parts, Codec, tensor_bytes
from yeto_core.faults import FaultInjector
from yeto_core.layout import Layout
from yeto_core.link import Inbound, InitWanted, PushEnded, PushJob
from yeto_core.net.tickets import Concatenated, Payload, SendTicket
from yeto_core.wire.messages import PUSH_MOMENT, Init, Message, Push

log = logging.getLogger("yeto.client")

TICKET_POLL_S = 0.5  # how often a wait on a send looks whether the client is stopping


class Sends(Protocol):
    def send(self, msg: Message, payload: Payload | None = None) -> SendTicket: ...


class PushEncoder:
    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self._buffers: dict[int, memoryview] = {}

    def encode(self, job: PushJob) -> tuple[Push, Payload, int]:
        """The PUSH frame, its payload, and the payload's size on the wire: the delta, then the
        model's first moment in `MOMENT_CODEC` when the job carries it (`PUSH_MOMENT`, DESIGN §3.9)."""
        nbytes = self.codec.encoded_nbytes(job.delta.numel())
        payload: Payload
        if self.codec is F32:
            payload = tensor_bytes(job.delta)
        elif self.codec is BF16:
            payload = Bf16Parts(job.delta)
        else:
            payload = self._buffers.get(nbytes) or self._buffers.setdefault(nbytes, receive_buffer(nbytes))
            self.codec.encode(job.delta, payload)
        if job.moment is not None:
            payload, nbytes = Concatenated([payload, job.moment]), nbytes + len(job.moment)
        step_us = 0 if job.step_s is None else min(int(job.step_s * 1e6), 2**32 - 1)
        codec = self.codec.wire_id | (PUSH_MOMENT if job.moment is not None else 0)
        msg = Push(job.pull.round, job.pull.attempt, job.pull.fragment, job.base_version, job.tokens, job.steps,
                   step_us, 0, 0, codec)
        return msg, payload, nbytes


def wait_sent(ticket: SendTicket, stop: threading.Event) -> str | None:
    """Wait for `ticket`; its error, "client closing" when `stop` is set first, or None once sent."""
    while not ticket.done.wait(TICKET_POLL_S):
        if stop.is_set():
            return "client closing"
    return None if ticket.ok else ticket.error


def upload_init(group: Sends, layout: Layout, values: Sequence[torch.Tensor], *, stop: threading.Event,
                faults: FaultInjector) -> None:
    """Learner 0's INIT: every fragment's initial values, in order (replayed on each new
    connection group until the initial cut arrives; the syncer ignores repeats)."""
    from tqdm import tqdm  # local import: only learner 0 ever shows this bar

    total = sum(v.numel() * 4 for v in values)
    with tqdm(total=total, unit="B", unit_scale=True, desc="yeto INIT upload", disable=None, leave=False) as bar:
        for frag, vals in zip(layout.fragments, values, strict=True):
            payload = tensor_bytes(vals)
            error = wait_sent(group.send(Init(frag.index, 0, 0, F32.wire_id), payload), stop)
            if error == "client closing":
                return
            if error is not None:
                log.warning("learner 0: INIT upload interrupted (%s)", error)
                return
            bar.update(len(payload))
            if frag.index + 1 < len(values):
                faults.point("mid-init")
    log.info("learner 0: INIT of %d fragments (%.1f MB) uploaded", len(values), total / 1e6)


class InitRequest:
    """Learner 0's INIT values: asked of the training thread (`InitWanted`, answered with
    `answer`), because only it may read the model's weights, and awaited on the link thread."""

    def __init__(self) -> None:
        self._answers: queue.SimpleQueue[list[torch.Tensor] | None] = queue.SimpleQueue()

    def answer(self, values: list[torch.Tensor] | None) -> None:
        self._answers.put(values)

    def ask(self, post: Callable[[Inbound], None], *, reseed: bool, stop: threading.Event) -> list[torch.Tensor] | None:
        while not self._answers.empty():  # an answer left over from a connection that died meanwhile is stale
            self._answers.get_nowait()
        if reseed:
            log.warning("learner 0: the syncer has no model state; seeding it from this learner's current weights")
        post(InitWanted(reseed))
        while not stop.is_set():
            try:
                return self._answers.get(timeout=TICKET_POLL_S)
            except queue.Empty:
                continue
        return None


class PushSender:
    """The thread that encodes and sends pushes, so the training thread never waits on a socket.
    Each job ends with `job.done` set (and `job.error` on failure) and a `PushEnded` posted."""

    def __init__(self, codec: Codec, *, group: Callable[[], Sends | None], post: Callable[[Inbound], None],
                 stop: threading.Event, faults: FaultInjector, learner_id: int) -> None:
        self._encoder = PushEncoder(codec)
        self._group, self._post, self._stop, self._faults, self._learner_id = group, post, stop, faults, learner_id
        self._jobs: queue.SimpleQueue[PushJob | None] = queue.SimpleQueue()

    def submit(self, job: PushJob) -> None:
        self._jobs.put(job)

    def close(self) -> None:
        self._jobs.put(None)

    def run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._send(job)
            except Exception as exc:  # never let a push failure escape into training
                job.error = f"push failed: {exc}"
                log.exception("learner %d: push failed", self._learner_id)
            finally:
                job.done.set()
                self._post(PushEnded())

    def _send(self, job: PushJob) -> None:
        self._faults.point("before-push")
        group = self._group()
        if group is None:
            job.error = "no link to the syncer"
            return
        msg, payload, nbytes = self._encoder.encode(job)
        job.error = wait_sent(group.send(msg, payload), self._stop)
        if job.error is None:
            job.nbytes = nbytes
