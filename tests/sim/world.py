"""One seeded, simulated run of yeto: a syncer, M learners, a network and the faults the seed draws.

`simulate(seed)` draws everything from the seed (the run's shape and settings, the network's
delays, each learner's pace, the fault schedule), runs it on the simulated clock, and returns a
`Run` that `invariants.check` judges. Faults:

* ``drop``: a learner's connection is cut (it redials; the syncer hears of it after a delay);
* ``crash``: a learner process dies and a new one (fresh weights, the same id) starts later;
* ``syncer``: the syncer dies and restarts with ``--resume`` from its last durable checkpoint;
* ``freeze``: a learner stops stepping (and reading) for a while, its link up;
* ``intruder``: a process with the wrong key dials as one of the learners;
* ``slow``: one learner steps several times slower than the rest;
* ``duplicate``: a learner's next push arrives twice, as from a client that sent it again.

Some runs also start a *stranger* first: a process with the right key and another model, as an id
beyond the fleet's, that joins before learner 0 pins the model and is refused when it does.

The wire varies too: the push codec (f32, bf16 or a quantized one) and full or delta broadcasts.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import random
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from pydantic import SecretStr

from syncer.durability.checkpoint import SyncerState, load_checkpoint
from tests.sim.learner_node import SimLink, Trained, train
from tests.sim.network import Latency
from tests.sim.scheduler import Actor, Scheduler
from tests.sim.syncer_node import SyncerNode
from yeto_core.codecs import codec_by_name
from yeto_core.learner import LearnerSession
from yeto_core.sections import ConsensusSettings, LinkSettings
from yeto_core.settings import LearnerSettings, SyncerSettings

KEY = b"s" * 32
WRONG_KEY = b"w" * 32
SHAPES = ((6, 4), (4,), (5, 3))
DELTA_DOWNLINKS = ("bf16", "int8", "int4", "int4-log")
STRANGER_SHAPES = ((6, 4), (4,), (5, 4))  # another model: one tensor of another shape
HORIZON_S = 4 * 3600.0  # simulated seconds; a run still going then is stuck


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str
    at: float  # simulated seconds after the start
    learner: int = 0
    lasts: float = 0.0


@dataclasses.dataclass
class Scenario:
    seed: int
    learners: int
    fragments: int
    interval: int  # H
    steps: int
    step_s: list[float]
    syncer: dict[str, Any]
    learner: dict[str, Any]
    latency: dict[str, float]
    faults: list[Fault]
    stranger: bool = False  # a process of another model dials first (module docstring)
    mixed_downlinks: bool = False  # learners take different downlink delta codecs (`downlink_of`)

    @classmethod
    def draw(cls, seed: int) -> Scenario:
        rng = random.Random(seed)
        m = rng.choice([2, 2, 3, 3, 4, 5])
        p = rng.choice([1, 2, 3])
        h = rng.choice([2, 4, 6]) * p
        steps = rng.randint(3, 6) * h
        step_s = [rng.uniform(0.05, 0.2) for _ in range(m)]
        faults: list[Fault] = []
        span = steps * max(step_s)
        for _ in range(rng.choice([0, 1, 1, 2, 3, 4])):
            kind = rng.choice(["drop", "drop", "crash", "syncer", "freeze", "intruder", "slow", "duplicate"])
            at = rng.uniform(0.0, span)
            who = rng.randrange(m)
            if kind == "slow":
                step_s[who] *= rng.uniform(2.0, 5.0)
                continue
            faults.append(Fault(kind, at, who, rng.uniform(0.2, 8.0)))
        syncer = {
            "learners": m, "fragments": p, "sync_interval_steps": h,
            "pipeline": rng.randint(1, max(1, min(p, 2))),
            "grace_s": rng.choice([0.0, 0.5, 2.0]),
            "checkpoint_every": rng.choice([1, 1, 2, 3]),
            "round_timeout_s": rng.choice([5.0, 30.0]),
            "rejoin_wait_s": rng.choice([0.0, 10.0]),
            "max_base_lag": rng.choice([0, 1, 2]),
            "outer_optimizer": rng.choice(["nesterov", "nesterov", "delayed-nesterov"]),
            "merge": rng.choice(["rda", "rda", "average"]),
            "total_rounds": rng.choice([0, 0, 0, p * rng.randint(2, 5)]),
            "carry_answers_round": rng.random() < 0.3,
        }
        learner: dict[str, Any] = {
            "overlap": rng.random() < 0.7,
            "final_flush": rng.random() < 0.5,
            "merge_alpha": rng.choice([0.0, 0.0, 0.5]),
            "blocking": rng.choice(["", "", "0"]),
            "wire_dtype": rng.choice(["f32", "f32", "bf16", "int8", "int4", "e3m0"]),
            "push_block": rng.choice([8, 128]),
            "downlink_dtype": rng.random(),  # a draw, made a dtype below
            "lockstep": rng.random() < 0.1,  # every island waits for every round: the syncer's quorum is M
        }
        delta_draw = learner["downlink_dtype"]
        mixed_downlinks = False
        if delta_draw < 0.3:  # a delta downlink; from the same draw: its codec, and whether learners mix codecs
            k = int(delta_draw / 0.3 * 2 * len(DELTA_DOWNLINKS))
            learner["downlink_dtype"] = DELTA_DOWNLINKS[k % len(DELTA_DOWNLINKS)]
            mixed_downlinks = k >= len(DELTA_DOWNLINKS)
        else:
            learner["downlink_dtype"] = "f32"
        if learner["lockstep"]:
            syncer["quorum"] = m
        latency = {"base_s": rng.uniform(0.0005, 0.05), "jitter_s": rng.uniform(0.0, 0.05),
                   "bytes_per_s": rng.choice([1e4, 1e5, 1e7])}
        # Drawn last, so every other draw of a seed is what it was before this setting existed.
        learner["answer_on_arrival"] = rng.random() < 0.7  # most answer on arrival, the rest at their boundaries
        stranger = rng.random() < 0.15
        return cls(seed, m, p, h, steps, step_s, syncer, learner, latency, sorted(faults, key=lambda f: f.at),
                   stranger, mixed_downlinks)

    def downlink_of(self, learner_id: int) -> str:
        """Learner `learner_id`'s downlink dtype: the fleet's, or with mixed downlinks the odd
        learners on the next delta codec (learners of different codecs on their own chains)."""
        base = self.learner["downlink_dtype"]
        if not self.mixed_downlinks or learner_id % 2 == 0:
            return str(base)
        return DELTA_DOWNLINKS[(DELTA_DOWNLINKS.index(base) + 1) % len(DELTA_DOWNLINKS)]


@dataclasses.dataclass
class Run:
    """What happened: for `invariants.check`."""

    scenario: Scenario
    finished: bool
    end_s: float
    trained: list[Trained]
    incarnations: list[SyncerNode]
    resumed_from: list[SyncerState | None]  # per incarnation: the checkpoint it resumed from
    commits: list[tuple[int, int, list[torch.Tensor], list[int], dict[str, int]]]  # (incarnation, next_round, ...)
    final_state: SyncerState | None
    checkpoint: Path
    intruders: list[Trained]
    strangers: list[Trained]


class World:
    def __init__(self, scenario: Scenario, workdir: Path) -> None:
        self.scenario = sc = scenario
        self.rng = random.Random(scenario.seed ^ 0x5EED)
        self.sim = Scheduler()
        self.latency = Latency(random.Random(scenario.seed ^ 0x1A7E), **sc.latency)
        self.checkpoint = workdir / "syncer.ckpt"
        self.syncer_settings = SyncerSettings(key=SecretStr(KEY.decode()), device="cpu", checkpoint=self.checkpoint,
                                              decode_threads=1, **sc.syncer)
        self.node: SyncerNode | None = None
        self.incarnations: list[SyncerNode] = []
        self.resumed_from: list[SyncerState | None] = []
        self.commits: list[tuple[int, int, list[torch.Tensor], list[int], dict[str, int]]] = []
        self.trained: list[Trained] = []
        self.intruders: list[Trained] = []
        self.strangers: list[Trained] = []
        self.actors: list[Actor] = []
        self.procs: dict[int, tuple[Actor, SimLink, Trained]] = {}
        self.processes = 0
        self._settings: dict[bytes, LearnerSettings] = {}
        self.start = self.sim.now

    # -- processes -------------------------------------------------------------------------------
    def start_syncer(self, *, resume: bool) -> None:
        state = None
        if resume and self.checkpoint.exists():
            state = load_checkpoint(self.checkpoint, expect_backend=self._backend())
        node = SyncerNode(self.sim, self.latency, self.rng, self.syncer_settings, key=KEY,
                          incarnation=len(self.incarnations), state=state, on_commit=self._committed)
        self.node = node
        self.incarnations.append(node)
        self.resumed_from.append(copy.deepcopy(state))  # the syncer writes its state in place

    def _learner_settings(self, key: bytes) -> LearnerSettings:
        """Read once per key (reading the environment takes milliseconds); each learner gets a copy with its id."""
        if key not in self._settings:
            self._settings[key] = LearnerSettings(  # H unset: the syncer's, learned at the handshake
                syncer="127.0.0.1:9", key=SecretStr(key.decode()), init_timeout_s=600.0, final_timeout_s=600.0,
                blocking_timeout_s=60.0, lockstep_timeout_s=30.0, link=LinkSettings(reconnect_max_s=2.0),
                consensus=ConsensusSettings(every=0),
                **self.scenario.learner)
        return self._settings[key]

    def _backend(self) -> str:
        from syncer.core.links import backend_id

        return backend_id(self.syncer_settings.merging)

    def _committed(self, node: SyncerNode) -> None:
        state = node.state
        assert state is not None
        self.commits.append((node.incarnation, state.next_round, [p.clone() for p in state.params],
                             list(state.versions), dict(state.ledger)))

    def start_learner(self, learner_id: int, *, key: bytes = KEY, steps: int | None = None,
                      shapes: tuple[tuple[int, ...], ...] = SHAPES) -> Trained:
        sc = self.scenario
        process = self.processes
        self.processes += 1
        rng = random.Random(sc.seed * 1_000_003 + process)
        base = self._learner_settings(key)
        link_settings = base.link.model_copy(update={"downlink_dtype": sc.downlink_of(learner_id)})
        settings = base.model_copy(update={"learner_id": learner_id, "link": link_settings})
        generator = torch.Generator().manual_seed(rng.getrandbits(31))
        weights = [torch.randn(shape, generator=generator) for shape in shapes]
        codec = codec_by_name(settings.wire_dtype, block=settings.push_block)
        link = SimLink(self.sim, self.latency, rng, settings, codec, lambda: self.node, process)
        session = LearnerSession(settings, [(f"t{i}", w) for i, w in enumerate(weights)], link=link,
                                 clock=self.sim.clock, say=lambda line: None)
        out = Trained(process, learner_id)
        freeze = None
        for f in sc.faults:
            if f.kind == "freeze" and f.learner == learner_id and key == KEY:
                freeze = (int(f.at / sc.step_s[learner_id]), f.lasts)
        actor = Actor(self.sim, f"learner{learner_id}.p{process}",
                      lambda a: train(a, session, link, out, weights, steps=sc.steps if steps is None else steps,
                                      step_s=sc.step_s[learner_id % sc.learners],
                                      tokens_per_step=64 + 16 * learner_id, rng=rng, freeze=freeze))
        link.actor = actor
        (self.strangers if shapes != SHAPES else self.trained if key == KEY else self.intruders).append(out)
        self.actors.append(actor)
        self.procs[process] = (actor, link, out)
        actor.start()
        return out

    # -- faults ----------------------------------------------------------------------------------
    def schedule_faults(self) -> None:
        for fault in self.scenario.faults:
            self.sim.at(self.start + fault.at, functools.partial(self._fault, fault))

    def _fault(self, fault: Fault) -> None:
        live = self._live(fault.learner)
        if fault.kind == "drop":
            if live is not None:  # its connection, or the one still in its handshake
                live[1].cut("simulated link failure", quick=False, detect_s=min(fault.lasts, 5.0))
        elif fault.kind == "crash":
            if live is not None and not live[2].final_installed:
                actor, link, out = live
                actor.kill()
                out.crashed = True
                link.cut("learner crashed", quick=True)
                left = self.scenario.steps - out.steps
                self.sim.after(fault.lasts, functools.partial(self._restart, fault.learner, max(left, 1)))
        elif fault.kind == "syncer":
            node = self.node
            if node is not None and node.alive and not node.done:
                node.crash()
                self.node = None
                self.sim.after(fault.lasts, lambda: self.start_syncer(resume=True))
        elif fault.kind == "duplicate":
            if live is not None:
                live[1].duplicate_next_push = True
        elif fault.kind == "intruder":
            self.start_learner(fault.learner, key=WRONG_KEY)

    def _restart(self, learner_id: int, steps: int) -> None:
        self.start_learner(learner_id, steps=steps)

    def _live(self, learner_id: int) -> tuple[Actor, SimLink, Trained] | None:
        """The process now running as `learner_id` (the last started that has not ended)."""
        for process in sorted(self.procs, reverse=True):
            actor, link, out = self.procs[process]
            if out.learner_id == learner_id and not out.ended and link.settings.key is not None \
                    and link.me.key == KEY:
                return actor, link, out
        return None

    # -- the run ---------------------------------------------------------------------------------
    def run(self) -> Run:
        self.start_syncer(resume=False)
        if self.scenario.stranger:
            self.start_learner(self.scenario.learners, shapes=STRANGER_SHAPES)
        for lid in range(self.scenario.learners):
            self.start_learner(lid)
        self.schedule_faults()
        finished = self.sim.run(until=self.start + HORIZON_S, done=self._over)
        node = self.incarnations[-1]
        return Run(self.scenario, finished, self.sim.now - self.start, self.trained, self.incarnations,
                   self.resumed_from, self.commits, node.state if node.done else None, self.checkpoint,
                   self.intruders, self.strangers)

    def _over(self) -> bool:
        node = self.node
        return node is not None and node.done and all(a.finished for a in self.actors)


def simulate(seed: int, judge: Callable[[Run], list[str]]) -> list[str]:
    """Run seed `seed` and return what `judge` finds wrong with it (while its files still exist)."""
    memory = Path("/dev/shm")  # checkpoints are written and fsynced for real; in memory when it can
    with tempfile.TemporaryDirectory(prefix="yeto-sim-", dir=memory if memory.is_dir() else None) as workdir:
        world = World(Scenario.draw(seed), Path(workdir))
        try:
            return judge(world.run())
        finally:
            for actor in world.actors:  # no thread of this run outlives it
                actor.kill()
