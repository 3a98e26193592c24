"""The framework-free DiLoCo learner (SPEC §2.2–2.4, §2.8–2.9).

A trainer plugin hands `LearnerSession` its live trainable tensors (or a `TensorStore` that reads
and writes them where they live, e.g. across a Megatron island's ranks) and calls `step(tokens)`
once per optimizer step. The session never blocks a step on the network:

* **Anchors.** For every fragment the session keeps the f32 global value it last installed
  (the anchor) and that value's version. A push carries d = θ − anchor, never θ itself, plus
  the tokens and steps trained since the anchor (the syncer weights learners by tokens²/steps).
* **Schedule.** The syncer PULLs fragments round by round; the session answers at its
  boundaries, one every max(1, H // P) steps (streaming DiLoCo), gathering one fragment per
  boundary. A pull waits while a push is still streaming or while the fragment's anchor is
  older than the version the pull names (its BCAST has not been installed yet).
* **Background sender.** The delta is computed on the training thread (one memory pass); the
  client's sender thread encodes and streams it.
* **Installing.** A BCAST is installed in place (optimizer moments untouched) by rebasing,
  θ ← Θ + (θ − θ at the push) (`overlap`, the default: the steps trained while the round was in
  flight are kept), or by blending, θ ← α·θ_local + (1−α)·Θ (`merge_alpha`, 0: overwrite); the
  anchor becomes Θ. The very first cut overwrites, so every learner starts from learner 0's
  initial weights.
* **Lockstep** (`lockstep`, for reproducible experiments). Boundary k waits for the PULL of
  round k, and the next step waits for that round's BCAST: the schedule is a function of steps.
* **Finalization.** When all P FINAL cuts are in, they are installed exactly (no blending) and
  `step` returns True: training ends at that step, and every learner holds the syncer's bits.
  A learner that reaches its own step limit first sends DONE and waits (with a deadline) for
  the final cut in `finish`; with `final_flush` it first pushes what every fragment trained
  since its last push and waits for those rounds to merge.
* **Refusals.** A permanent refusal stops the island at its next call (`refusal.py`), unless
  `alone_if_refused` lets it train on alone.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch

from yeto_core.blocking import blocking_fragments
from yeto_core.client import Connected, Lost, PushJob, Received, SyncerClient
from yeto_core.codecs import codec_by_name
from yeto_core.consensus_report import ConsensusReporter, Probe, metrics
from yeto_core.layout import Layout, TensorSpec, build_layout
from yeto_core.probe import PROBE_EXIT_CODE, ProbeResult, measure_link
from yeto_core.refusal import stop_if_refused
from yeto_core.settings import LearnerSettings
from yeto_core.store import LocalStore, TensorStore, check_fragment_values, nonfinite_tensor
from yeto_core.wire.errors import ErrorCode, Refused, WireError
from yeto_core.wire.messages import BCAST_MERGED, Bcast, Bye, Consensus, Final, Pull

log = logging.getLogger("yeto.learner")


@dataclass
class FragmentState:
    anchor: torch.Tensor | None = None
    version: int = -1  # -1: nothing installed yet
    tokens_mark: int = 0  # learner-wide token / step counters when the anchor was installed
    steps_mark: int = 0


@dataclass
class LearnerStats:
    steps: int = 0
    tokens: int = 0
    pushes: int = 0
    push_failures: int = 0
    replays: int = 0  # pushes sent again, unchanged, when the syncer re-pulled their round
    nonfinite_deltas: int = 0  # pulls not answered: θ − anchor held NaN or Inf
    installs: int = 0
    rebases: int = 0  # overlap installs that dropped a merged push from θ (Mix1)
    blocked_s: float = 0.0  # time steps waited for blocking fragments (Mix2)
    lockstep_misses: int = 0  # lockstep waits that ran out of time: the schedule was no longer pinned
    final_installed: bool = False
    connected_generations: list[int] = field(default_factory=list)
    probe: ProbeResult | None = None
    consensus_js: float | None = None  # the syncer's latest JS distance between learners (SPEC §2.7)
    fragment_l2: list[float | None] = field(default_factory=list)  # per fragment: mean |θ − anchor| merged


class LearnerSession:
    def __init__(
        self,
        settings: LearnerSettings,
        named_params: Sequence[tuple[str, torch.Tensor]] | None = None,
        *,
        embedding_names: Collection[str] = (),
        store: TensorStore | None = None,
        probe: Probe | None = None,
    ) -> None:
        """Give either the live trainable tensors (`named_params`, one process holds them all)
        or a `store` that reads and writes them wherever they live."""
        if (named_params is None) == (store is None):
            raise ValueError("LearnerSession needs exactly one of named_params or store")
        self.settings = settings
        self.store: TensorStore = store if store is not None else LocalStore(named_params or (), embedding_names)
        self.specs: list[TensorSpec] = list(self.store.specs)
        self.codec = codec_by_name(settings.wire_dtype, block=settings.push_block)
        self.layout: Layout | None = None
        self.blocking: frozenset[int] = frozenset()  # fragments waited for at their boundary (Mix2)
        self.fragments: list[FragmentState] = []
        self.stats = LearnerStats()
        self._layout_lock = threading.Lock()
        self._init_cache: list[torch.Tensor] | None = None
        self._init_ready = threading.Event()  # learner 0: `_init_cache` read (or refused)
        self._pulls: dict[int, Pull] = {}
        self._pull_links: dict[int, int] = {}  # per fragment: the connection its pending PULL came on
        self._bcasts: dict[int, tuple[Bcast, torch.Tensor]] = {}
        self._finals: dict[int, tuple[Final, torch.Tensor]] = {}
        self._push: PushJob | None = None
        self._unconfirmed: dict[int, PushJob] = {}  # per fragment: pushed, its round's BCAST not installed yet
        self._links = 0  # connections made so far (the syncer's generation numbers restart with it)
        self._pushed_on: dict[int, int] = {}  # per fragment: the connection its unconfirmed push went out on
        self._pushed_at: dict[int, tuple[int, int]] = {}  # per fragment: (tokens, steps) counters at that push
        self._done_sent_generation: int | None = None
        self._generation: int | None = None
        self._last_step_at: float | None = None
        self._step_s: float | None = None
        self.consensus = ConsensusReporter(probe, every=settings.consensus_every, top_k=settings.consensus_top_k,
                                           learner_id=settings.learner_id)
        self.client = SyncerClient(
            address=settings.address,
            key=settings.read_key(),
            learner_id=settings.learner_id,
            layout_for=self._layout_for,
            codec=self.codec,
            data_streams=settings.data_streams,
            connect_timeout_s=settings.connect_timeout_s,
            heartbeat_s=settings.heartbeat_s,
            peer_timeout_s=settings.peer_timeout_s,
            reconnect_max_s=settings.reconnect_max_s,
            stall_timeout_s=settings.wan_stall_timeout_s,
            bcast_delta=settings.bcast_delta,
            overlap=settings.overlap,
            schedule=settings.wan_stream_schedule,
            init_values=self._initial_values if settings.learner_id == 0 else None,
            step=lambda: self.stats.steps,
        )

    # -- set-up ------------------------------------------------------------------------------
    def _layout_for(self, num_fragments: int, pattern: str) -> Layout:
        """Called by the client on every CHALLENGE: the layout to fingerprint in HELLO."""
        expected = self.settings.fragments
        if expected is not None and expected != num_fragments:
            raise Refused(ErrorCode.LAYOUT, f"the syncer splits the model into {num_fragments} fragments but "
                          f"YETO_DILOCO_FRAGMENTS={expected}")
        with self._layout_lock:
            if self.layout is None:
                try:
                    layout = build_layout(self.specs, num_fragments, pattern)
                    self.blocking = blocking_fragments(layout, self.settings.blocking)
                except ValueError as exc:
                    where = " (YETO_DILOCO_BLOCKING)" if "blocking" in str(exc) else ""
                    raise Refused(ErrorCode.LAYOUT, f"{exc}{where}") from exc
                self.layout = layout
                self.fragments = [FragmentState() for _ in range(num_fragments)]
            elif (self.layout.num_fragments, self.layout.pattern) != (num_fragments, pattern):
                raise Refused(ErrorCode.LAYOUT, f"the syncer now asks for {num_fragments} {pattern} fragments; "
                              f"this learner joined with {self.layout.num_fragments} {self.layout.pattern}")
            return self.layout

    def _initial_values(self) -> list[torch.Tensor] | None:
        """Learner 0's INIT payload, asked for whenever a syncer has no state yet.

        Before the first cut it is one snapshot of the initial weights, replayed on every new
        connection. A syncer that lost its state later (restarted without --resume) is seeded
        again from learner 0's current weights, so the run goes on instead of waiting forever.
        """
        reseed = self.client.initial_cut_received.is_set()
        if reseed:
            log.warning("learner 0: the syncer has no model state; seeding it from this learner's current weights")
            self._init_ready.clear()  # read afresh at the next step
        while not self._init_ready.wait(0.2):  # `_serve_init` reads it on the training thread
            if self.client.stopping:
                return None
        values = self._init_cache
        if reseed:
            self._init_cache = None  # a later reconnect reads the weights of then
        return values

    def _serve_init(self) -> None:
        """Learner 0, on the training thread: once the layout is known, read the INIT snapshot the
        link thread waits for (a sharded store reads collectively, so never from the link thread),
        refusing to start a run from NaN or Inf."""
        if self._init_ready.is_set() or self.settings.learner_id != 0 or self.layout is None:
            return
        try:
            values = [self._gather(i) for i in range(self.layout.num_fragments)]
            for fragment, part in zip(self.layout.fragments, values, strict=True):
                name = nonfinite_tensor(fragment, part)
                if name is None:
                    continue
                if not self.client.initial_cut_received.is_set():
                    raise ValueError(f"learner 0: the initial weights hold NaN or Inf (first in {name!r}); "
                                     "a run cannot start from them")
                print(f"yeto learner 0: the weights hold NaN or Inf (first in {name!r}); no INIT for the syncer "
                      "that lost its state", file=sys.stderr)
                values = []
                break
            self._init_cache = values or None
        finally:
            self._init_ready.set()  # the link thread sends the snapshot, or nothing after a refusal

    def start(self) -> None:
        """Connect, and wait (at most `init_timeout_s`) for the initial cut before training.

        With a minimum link rate set, the link is probed first; a too-slow island exits with
        code 75 and says what it measured, before it joins (so a supervisor can place it anew).
        """
        s = self.settings
        if s.wan_probe_min_mbps > 0 or s.wan_probe_min_down_mbps > 0:
            self._probe_link()
        self.client.start()
        deadline = time.monotonic() + self.settings.init_timeout_s
        while not self._all_installed():
            if self._final_ready():
                return  # joined a run that is finalizing: the first step installs the final cut
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("learner %d: no initial cut after %.0f s; training locally until it arrives",
                            self.settings.learner_id, self.settings.init_timeout_s)
                return
            if stop_if_refused(self.settings, self.client.refused):
                return
            self._serve_init()
            self.store.tick()
            self._drain(timeout=min(left, 0.5 if self._init_ready.is_set() or s.learner_id else 0.02))
            self._install_bcasts()
        self._init_cache = None
        log.info("learner %d: initial cut installed (%d fragments)", self.settings.learner_id,
                 len(self.fragments))

    def _probe_link(self) -> None:
        s = self.settings
        nbytes = s.wan_probe_mib << 20
        try:
            result = measure_link(s.address, s.read_key(), up_bytes=nbytes, down_bytes=nbytes)
        except (OSError, WireError) as exc:
            why = f"the bandwidth probe to {s.syncer} failed ({exc})"
        else:
            self.stats.probe = result
            log.info("learner %d: link to %s measured %.0f Mbit/s up, %.0f Mbit/s down", s.learner_id, s.syncer,
                     result.up_mbps, result.down_mbps)
            if result.up_mbps >= s.wan_probe_min_mbps and result.down_mbps >= s.wan_probe_min_down_mbps:
                return
            why = (f"link to {s.syncer} measured {result.up_mbps:.1f} Mbit/s up and {result.down_mbps:.1f} Mbit/s "
                   f"down; YETO_DILOCO_WAN_PROBE_MIN_MBPS={s.wan_probe_min_mbps:g}, "
                   f"YETO_DILOCO_WAN_PROBE_MIN_DOWN_MBPS={s.wan_probe_min_down_mbps:g}")
        print(f"yeto learner {s.learner_id}: too slow to join: {why}", file=sys.stderr, flush=True)
        raise SystemExit(PROBE_EXIT_CODE)

    def _all_installed(self) -> bool:
        return bool(self.fragments) and all(f.version >= 0 for f in self.fragments)

    @property
    def boundary_every(self) -> int:
        num = self.layout.num_fragments if self.layout else 1
        return max(1, self.settings.sync_interval // num)

    # -- the per-step entry point ------------------------------------------------------------
    def step(self, tokens: int) -> bool:
        """Account one optimizer step of `tokens` trained tokens; True means: stop training now."""
        self.stats.steps += 1
        self.stats.tokens += int(tokens)
        now = time.monotonic()
        if self._last_step_at is not None:  # EMA of the wall time per step, reported with pushes
            took = now - self._last_step_at
            self._step_s = took if self._step_s is None else 0.8 * self._step_s + 0.2 * took
        self._last_step_at = now
        stop_if_refused(self.settings, self.client.refused)
        self._serve_init()  # a syncer reached only after `start` gave up waiting still gets INIT
        self._drain(timeout=0.0)
        if self.settings.lockstep:  # the merge of the last boundary's push is installed at this step
            self._lockstep_wait(self._pushes_merged, "the merge of this island's last push")
        if self._final_ready():
            self._install_final()
            return True
        self._install_bcasts()
        self.consensus.after_installs(self.stats.installs, sum(f.version for f in self.fragments if f.version > 0),
                                      self.stats.steps, self.client.send_probe)
        if self.stats.steps % self.boundary_every == 0:
            if self.settings.lockstep:  # every boundary answers one round
                self._lockstep_wait(self._pull_answerable, f"a pull to answer at step {self.stats.steps}")
            self._boundary()
        return False

    def finish(self) -> bool:
        """Local training ended: push what each fragment trained since its last push (the final
        flush, `final_flush`), then ask for the final cut and install it; `final_timeout_s` bounds
        it all, and the flush gets at most half of it."""
        if self.stats.final_installed:
            return True
        if stop_if_refused(self.settings, self.client.refused) or self.layout is None:
            return False
        if self.settings.lockstep and not self.settings.final_flush:  # the syncer must not drop the last push
            self._lockstep_wait(self._pushes_merged, "the merge of this island's last push")
        started = time.monotonic()
        deadline = started + self.settings.final_timeout_s
        flushing = self.settings.final_flush
        while time.monotonic() < deadline:
            if stop_if_refused(self.settings, self.client.refused):
                return False
            self._serve_init()  # a syncer restarted without --resume meanwhile is seeded from here
            self.store.tick()
            if flushing and (self._flushed() or time.monotonic() > started + self.settings.final_timeout_s / 2):
                if not self._flushed():
                    log.warning("learner %d: the last steps of some fragments were not merged in time; asking for "
                                "the final cut without them", self.settings.learner_id)
                flushing = False
            needs_done = self._generation is not None and self._done_sent_generation != self._generation
            if not flushing and needs_done and self.client.send_done(self.stats.steps):
                self._done_sent_generation = self._generation
            self._drain(timeout=0.05 if flushing else 0.5)
            if self._final_ready():
                self._install_final()
                return True
            if flushing:  # every pull is a boundary now: nothing trains in between
                self._install_bcasts()
                self._boundary()
        log.warning("learner %d: the final cut did not arrive within %.0f s; keeping local weights",
                    self.settings.learner_id, self.settings.final_timeout_s)
        return False

    def sweep(self) -> bool:
        """A boundary for every fragment at once, for trainers whose steps come in phases (RL:
        rollouts, then updates): answer every PULL this learner holds, one push streaming at a
        time, then wait for those rounds' merges and install them; with `overlap` return as soon
        as the pushes are out (their merges are rebased in at later steps). `blocking_timeout_s`
        bounds it, after which training goes on. True when the final cut was installed."""
        if self.stats.final_installed:
            return True
        if stop_if_refused(self.settings, self.client.refused) or self.layout is None:
            return False
        deadline = time.monotonic() + self.settings.blocking_timeout_s
        swept: list[PushJob] = []
        while time.monotonic() < deadline and self.client.refused is None:
            self._serve_init()
            self._drain(timeout=0.0)
            if self._final_ready():
                self._install_final()
                return True
            self._install_bcasts()
            before = self._push
            self._boundary()
            if self._push is not None and self._push is not before:
                swept.append(self._push)
            if not self._push_in_flight() and not self._sweep_left():
                merged = all(self.fragments[j.pull.fragment].version > j.base_version for j in swept)
                if self.settings.overlap or merged:
                    return False
            self.store.tick()
            self._drain(timeout=0.05)
        if self.client.refused is None:
            log.warning("learner %d: sweep not done within %.0f s; training on", self.settings.learner_id,
                        self.settings.blocking_timeout_s)
        return False

    def _sweep_left(self) -> bool:
        """A PULL is held that a boundary can answer now, or once the BCAST it names is in."""
        for pull in self._pulls.values():
            state = self.fragments[pull.fragment]
            if state.version < pull.version:
                return True
            if state.version == pull.version and state.anchor is not None and self.stats.steps > state.steps_mark:
                return True
        return False

    def _flushed(self) -> bool:
        """Every fragment's anchor was installed after the last trained step: each step is in a
        merged round (DONE only then, so the syncer never drops an answer it has not decoded)."""
        return all(f.steps_mark == self.stats.steps or f.anchor is None for f in self.fragments)

    def close(self) -> None:
        reason = "final cut installed" if self.stats.final_installed else "learner stopped"
        self.client.close(reason)

    # -- inbox -------------------------------------------------------------------------------
    def _drain(self, timeout: float) -> None:
        block = timeout > 0
        while True:
            try:
                item = self.client.inbox.get(block=block, timeout=timeout if block else None)
            except queue.Empty:
                return
            block = False
            if isinstance(item, Connected):
                self._generation = item.generation
                self._links += 1
                self.stats.connected_generations.append(item.generation)
            elif isinstance(item, Lost):
                # Pending PULLs are kept: a boundary reached while the link is down still computes
                # its push (sent, or replayed when the syncer pulls the round again), so a
                # reconnect never moves an answer to a later boundary.
                self._generation = None
            elif isinstance(item, Received):
                self._accept(item)

    def _accept(self, item: Received) -> None:
        msg = item.msg
        if isinstance(msg, Pull):
            current = self._pulls.get(msg.fragment)
            newer_link = self._pull_links.get(msg.fragment) != self._links  # attempts restart with a syncer
            if current is None or newer_link or (msg.round, msg.attempt) > (current.round, current.attempt):
                self._pulls[msg.fragment] = msg
                self._pull_links[msg.fragment] = self._links
                self._replay(msg.fragment)
        elif isinstance(msg, Bcast):
            assert item.values is not None
            held = self._bcasts.get(msg.fragment)
            if held is None or msg.version >= held[0].version:
                self._bcasts[msg.fragment] = (msg, item.values)
        elif isinstance(msg, Final):
            assert item.values is not None
            self._finals[msg.fragment] = (msg, item.values)
        elif isinstance(msg, Bye):
            log.info("learner %d: syncer said goodbye (%s)", self.settings.learner_id, msg.reason)
        elif isinstance(msg, Consensus):
            self.stats.consensus_js, self.stats.fragment_l2 = metrics(msg)

    # -- installing --------------------------------------------------------------------------
    def _install_bcasts(self) -> None:
        for index, (msg, values) in sorted(self._bcasts.items()):
            state = self.fragments[index]
            sent = self._unconfirmed.get(index)
            marks = self._pushed_at.get(index)
            if msg.version != state.version:
                first = state.version < 0
                if self.settings.overlap and not first:
                    merged = self._rebase(index, msg, values, sent)
                    if not merged:
                        marks = None  # the progress before the push is still ours to push: keep the marks
                else:
                    self._install(index, values, alpha=0.0 if first else self.settings.merge_alpha)
                state.version = msg.version
                self.stats.installs += 1
            if sent is not None and state.version > sent.base_version:
                del self._unconfirmed[index]  # its round committed (with or without it): nothing to replay
                # Steps trained between the push and this install belong to the next push of this
                # fragment: each step is counted once per fragment, however long the round took.
                self._pushed_at.pop(index, None)
                if marks is not None:
                    state.tokens_mark, state.steps_mark = marks
        self._bcasts.clear()

    def _rebase(self, index: int, msg: Bcast, values: torch.Tensor, sent: PushJob | None) -> bool:
        """Overlap (SPEC §2.5, Mix1): θ ← Θ + (θ − base), and Θ becomes the anchor. `base` is θ
        at the push when Θ merged that push (the syncer flags it), else the old anchor: the
        progress Θ already holds is dropped once, the rest is kept for the next push. True when
        Θ merged this learner's push.

        A Θ more than one version past the push's base followed commits this learner never saw,
        and the flag speaks of the last of them only: the push counts as merged then, so at worst
        it is dropped (as an overwrite drops it), never added twice."""
        assert self.layout is not None
        state = self.fragments[index]
        assert state.anchor is not None
        merged = sent is not None and sent.base_version == state.version and (
            (bool(msg.flags & BCAST_MERGED) and msg.round == sent.pull.round) or msg.version > sent.base_version + 1)
        base = state.anchor
        if merged:
            assert sent is not None
            base = state.anchor + self._as_merged(sent.delta)
        fragment = self.layout.fragments[index]
        ahead = self._gather(index).sub_(base)
        if nonfinite_tensor(fragment, ahead) is not None:
            ahead.zero_()  # training diverged here: Θ replaces the diverged values, as an overwrite does
        self.store.install(fragment, ahead.add_(values), 0.0)
        state.anchor = values
        self.stats.rebases += int(merged)
        return merged

    def _as_merged(self, delta: torch.Tensor) -> torch.Tensor:
        """The delta as the syncer decoded it: with a lossy push codec the rounding error stays in
        θ − base and goes out with the next push (error feedback) instead of being lost."""
        if self.codec.name == "f32":
            return delta
        wire = bytearray(self.codec.encoded_nbytes(delta.numel()))
        self.codec.encode(delta, memoryview(wire))
        out = torch.empty_like(delta)
        self.codec.decode(memoryview(wire), out)
        return out

    def _install(self, index: int, values: torch.Tensor, *, alpha: float) -> None:
        assert self.layout is not None
        self.store.install(self.layout.fragments[index], values, alpha)
        state = self.fragments[index]
        state.anchor = values
        state.tokens_mark = self.stats.tokens
        state.steps_mark = self.stats.steps

    def _final_ready(self) -> bool:
        return bool(self.fragments) and len(self._finals) == len(self.fragments)

    def _install_final(self) -> None:
        assert self.layout is not None
        for index, (_, values) in self._finals.items():  # all or nothing: check every cut first
            check_fragment_values(self.layout.fragments[index], values)
        for index, (msg, values) in sorted(self._finals.items()):
            self._install(index, values, alpha=0.0)
            self.fragments[index].version = msg.version
        self.stats.final_installed = True
        rounds = next(iter(self._finals.values()))[0].rounds
        log.info("learner %d: final cut installed after %d rounds at step %d", self.settings.learner_id, rounds,
                 self.stats.steps)

    # -- pushing -----------------------------------------------------------------------------
    def _gather(self, index: int) -> torch.Tensor:
        assert self.layout is not None
        return self.store.gather(self.layout.fragments[index])

    def _push_in_flight(self) -> bool:
        """Whether the last push is still streaming; if it ended, account for it."""
        if self._push is None:
            return False
        if not self._push.done.is_set():
            return True
        if self._push.error:
            self.stats.push_failures += 1
            log.info("learner %d: push of fragment %d failed (%s)", self.settings.learner_id,
                     self._push.pull.fragment, self._push.error)
        else:
            self.stats.pushes += 1
        self._push = None
        return False

    def _replay(self, fragment: int) -> None:
        """The syncer pulls again a round this learner already answered (its connection dropped,
        or it restarted before committing the round): send the same delta, tokens and steps
        again, at once. The round then merges what it would have merged undisturbed, and the
        steps trained since are neither counted twice nor lost: they stay in θ − anchor."""
        sent, pull = self._unconfirmed.get(fragment), self._pulls.get(fragment)
        if sent is None or pull is None or pull.round != sent.pull.round:
            return
        if pull.attempt == sent.pull.attempt and self._pushed_on.get(fragment) == self._links:
            return  # the very pull it answered
        if pull.version != sent.base_version or self.fragments[fragment].version != sent.base_version:
            del self._unconfirmed[fragment]  # the base moved on: the old delta no longer applies
            self._pushed_at.pop(fragment, None)
            return
        if self._push_in_flight():
            return  # the next boundary answers this pull with a fresh delta instead
        job = PushJob(pull, sent.base_version, sent.tokens, sent.steps, sent.step_s, sent.delta)
        del self._pulls[fragment]
        self._push = self._unconfirmed[fragment] = job
        self._pushed_on[fragment] = self._links
        self.stats.replays += 1
        log.info("learner %d: round %d pulled again (attempt %d); pushing the same delta", self.settings.learner_id,
                 pull.round, pull.attempt)
        self.client.submit(job)

    def _boundary(self) -> None:
        if self._push_in_flight():
            return  # one push in flight at a time; pulls stay pending
        for pull in sorted(self._pulls.values(), key=lambda p: (p.round, p.attempt)):
            state = self.fragments[pull.fragment]
            if state.version > pull.version:
                del self._pulls[pull.fragment]  # that round was already committed without us
                continue
            steps = self.stats.steps - state.steps_mark
            if state.version < pull.version or steps == 0 or state.anchor is None:
                continue  # its BCAST is not installed yet, or nothing trained since
            delta = self._gather(pull.fragment).sub_(state.anchor)
            del self._pulls[pull.fragment]
            if not self._finite(pull, delta):
                continue
            job = PushJob(pull, state.version, self.stats.tokens - state.tokens_mark, steps, self._step_s, delta)
            self._push = self._unconfirmed[pull.fragment] = job
            self._pushed_on[pull.fragment] = self._links
            self._pushed_at[pull.fragment] = (self.stats.tokens, self.stats.steps)
            self.client.submit(job)
            if pull.fragment in self.blocking:
                self._wait_for_merge(job)
            return

    def _finite(self, pull: Pull, delta: torch.Tensor) -> bool:
        """A delta holding NaN or Inf is not sent: the syncer would refuse it after it crossed
        the link, and re-pulls would send it again. The round goes on without this learner; the
        fragment's next broadcast replaces the diverged values (with merge_alpha 0)."""
        assert self.layout is not None
        name = nonfinite_tensor(self.layout.fragments[pull.fragment], delta)
        if name is None:
            return True
        self.stats.nonfinite_deltas += 1
        message = (f"yeto learner {self.settings.learner_id}: the delta of fragment {pull.fragment} holds NaN or Inf "
                   f"(first in {name!r}); round {pull.round} is not answered: this island's training diverged")
        if self.stats.nonfinite_deltas == 1:  # once on stderr; every time in the log
            print(message, file=sys.stderr)
        log.error("%s", message)
        return False

    # -- lockstep (reproducible schedules) ------------------------------------------------------
    def _lockstep_wait(self, ready: Callable[[], bool], what: str) -> None:
        """Take in what the syncer sends, without installing it, until `ready()` (or the final
        cut is here). Past `lockstep_timeout_s` the island trains on and the miss is counted."""
        deadline = time.monotonic() + self.settings.lockstep_timeout_s
        while not ready() and not self._final_ready():
            if self.client.refused is not None:
                return
            if time.monotonic() > deadline:
                self.stats.lockstep_misses += 1
                log.warning("learner %d: lockstep: no %s within %.0f s; training on, the schedule is no longer "
                            "pinned to steps", self.settings.learner_id, what, self.settings.lockstep_timeout_s)
                return
            self._serve_init()
            self.store.tick()
            self._drain(timeout=0.05)

    def _pushes_merged(self) -> bool:
        """Every push sent has had its round's BCAST arrive (or installed)."""
        for f, job in self._unconfirmed.items():
            held = self._bcasts.get(f)
            arrived = held is not None and held[0].version > job.base_version
            if self.fragments[f].version <= job.base_version and not arrived:
                return False
        return True

    def _pull_answerable(self) -> bool:
        """No push is streaming and a pending PULL can be answered with the installed anchors."""
        if self._push_in_flight():
            return False
        return any(self.fragments[p.fragment].version == p.version for p in self._pulls.values())

    def _wait_for_merge(self, job: PushJob) -> None:
        """Mix2 (SPEC §2.6): block this step until the round of a blocking fragment is merged and
        installed (or the final cut is here, or `blocking_timeout_s` passed: then train on)."""
        f = job.pull.fragment
        started = time.monotonic()
        deadline = started + self.settings.blocking_timeout_s
        while self.fragments[f].version <= job.base_version and not self._final_ready():
            if time.monotonic() > deadline or self.client.refused is not None:
                log.warning("learner %d: blocking fragment %d not merged within %.0f s; training on",
                            self.settings.learner_id, f, self.settings.blocking_timeout_s)
                break
            self._serve_init()
            self.store.tick()
            self._drain(timeout=0.05)
            self._install_bcasts()
        self.stats.blocked_s += time.monotonic() - started
