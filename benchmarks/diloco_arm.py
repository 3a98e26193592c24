"""One arm of `compare_diloco.py` for its seeds: train, evaluate, report as JSON.

    python -m benchmarks.diloco_arm '{"arm": {...}, "shape": {...}, "seeds": [0, 1, 2], "workdir": "..."}'

Each seed is a run of its own, one after the other in this process (one import of torch and
transformers for all of them), reported as one JSON line when it ends.

Three kinds of arm, on the shape's text, model family and learning-rate schedule
(`diloco_data.py`; by default the main job's data, byte tokens of Python's English help texts,
and a Llama built from a config, at a constant learning rate after a warm-up):

* `dp` — synchronous data parallel: one model, global batch M·b, M·b sequences per step;
* `alone` — one island, batch b, on shard 0 of M (what an island reaches without the others);
* `yeto` — M islands, batch b each, each on its own shard, joined by the real syncer
  (`python -m syncer` in a subprocess on 127.0.0.1) through real `LearnerSession`s.

Every arm takes the same number of optimizer steps, so `dp` and `yeto` train on equal tokens.
A yeto arm runs one of two ways:

* **lockstep** (the default): `YETO_DILOCO_LOCKSTEP=1`, the islands stepped in one thread in a
  fixed order, a syncer that waits for every learner and launches rounds unthrottled: round k is
  answered at boundary k and merged into every island at the next step, so the same seed gives
  the same numbers bit for bit however loaded the machine is;
* **unpaced** (`unpaced`): as a user runs it. Every island trains on a thread of its own at the
  speed the machine gives it; the syncer runs its shipped pacing (`--sync-interval-steps H`),
  quorum and grace, so pushes arrive late, rounds close without a slow member and installs land
  between any two steps. A seed is then not reproducible bit for bit; its mean over seeds is.

`slow` makes the last island that many times slower (it sleeps `slow − 1` times its own compute
after each step). Unpaced with `fleet_budget`, the islands share M·steps optimizer steps and each
trains until they are taken, so the slow island contributes what its speed allows and the fleet
still sees the tokens of every other arm (`fleet_share` < 1 takes only that share, for a fleet
stopped early); with `lockstep_threads`, every island takes its `steps`
and waits for the slow one at every round (the lock-step reference). The inner
loop is the HF Trainer's defaults as the example sets them (AdamW, no weight decay, gradient
clipping at 1.0, the shape's schedule after a linear warm-up). With `share_momentum` in its
learner settings each island hands its AdamW to its session, as the HF callback hands over the
Trainer's (DESIGN §3.9).

The global model's held-out loss is taken along the way from the fragments' anchors (the merged
values every island last installed, identical on all of them) and at the end from the final
cut every island installed.
"""

from __future__ import annotations

import copy
import fcntl
import json
import os
import re
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from benchmarks import diloco_data
from benchmarks.procs import stop

ROOT = Path(__file__).resolve().parents[1]
LISTENING = re.compile(r"^yeto syncer listening on (\S+):(\d+)\s*$")
FRAGMENTS = 4
EVAL_BATCH = 32
CURVE_POINTS = 6  # a run is cut in this many equal pieces; the held-out loss is taken at every cut
WALL_POINTS = 24  # threaded arms: the global model is also taken every steps/WALL_POINTS steps of island 0,
# on past `steps` when a fleet budget lets it, for the loss against seconds of training (`wall_curve`)


Trained = tuple[int, list[bool]]  # (tokens trained by all islands, whether each installed the final cut)


@dataclass(frozen=True)
class Shape:
    """The model, data and step budget every arm of a comparison shares."""

    hidden: int = 128
    layers: int = 2
    seq_len: int = 64
    batch: int = 16  # b: sequences per island and step
    steps: int = 288  # optimizer steps of every arm
    lr: float = diloco_data.FAMILY_LR["llama"]  # the default family's rate, where its dp does best (FAMILY_LR)
    warmup: int = 20  # then the schedule
    family: str = "llama"  # diloco_data.FAMILIES
    corpus: str = "help"  # diloco_data.CORPORA
    schedule: str = "constant"  # diloco_data.SCHEDULES: constant, or cosine down to 10% at the last step
    h: int = 24  # H: inner steps per fragment round trip (YETO_DILOCO_SYNC_INTERVAL, the syncer's pacing)
    lora_r: int = 8  # LoRA arms: adapter rank on the attention's four projections
    lora_lr: float = 3e-3
    lora_base_steps: int = 144  # LoRA arms start from the full model trained this long (dp, batch 2b)


@dataclass(frozen=True)
class Arm:
    """One way of training. `learner` holds `LearnerSettings` fields, `syncer` extra syncer flags:
    only what differs from the shipped defaults."""

    name: str
    kind: str  # "dp" | "alone" | "yeto"
    learners: int = 2  # M
    lora: bool = False
    learner: dict[str, Any] = field(default_factory=dict)
    syncer: list[str] = field(default_factory=list)
    note: str = ""
    in_default_run: bool = True  # False: only when named by --arms
    unpaced: bool = False  # yeto: islands on threads of their own, the syncer's own pacing (not lockstep)
    slow: int = 1  # yeto: the last island is this many times slower than the others
    lockstep_threads: bool = False  # yeto with `slow`: lockstep, every island on a thread of its own
    shards: int = 0  # data shards (0: one per island); more leaves the last shards untrained
    fleet_budget: bool = False  # unpaced: the islands share max(M, shards)·steps optimizer steps, each
    # training until they are taken, so arms of islands at different speeds see equal tokens
    fleet_share: float = 1.0  # with fleet_budget: the share of that budget the fleet takes
    cell: str = ""  # the matrix cell this arm belongs to ("": the single-shape comparison)


def lr_factor(shape: Shape, step: int) -> float:
    """The learning rate of optimizer step `step` (from 0) as a share of `lr`."""
    return diloco_data.lr_factor(shape.schedule, shape.warmup, shape.steps, step)


class Trainee:
    """One model with its optimizer, schedule and its shard's batches (the inner loop)."""

    def __init__(self, model: torch.nn.Module, blocks: torch.Tensor, batch: int, lr: float, shape: Shape,
                 seed: int) -> None:
        self.model = model
        self.blocks = blocks
        self.batch = batch
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=lr, weight_decay=0.0)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, partial(lr_factor, shape))
        self.order = self._order(torch.Generator().manual_seed(seed))

    def _order(self, gen: torch.Generator) -> Iterator[torch.Tensor]:
        while True:  # a fresh permutation of the shard every epoch, as a shuffling sampler does
            perm = torch.randperm(len(self.blocks), generator=gen)
            for start in range(0, len(perm) - self.batch + 1, self.batch):
                yield perm[start : start + self.batch]

    def step(self) -> int:
        """One optimizer step; returns the tokens it trained on."""
        x = self.blocks[next(self.order)]
        loss = self.model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return x.numel()


@torch.no_grad()
def eval_loss(model: torch.nn.Module, blocks: torch.Tensor) -> float:
    """Mean next-token loss (nats/token) over `blocks`, in batches of EVAL_BATCH."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(blocks), EVAL_BATCH):
        x = blocks[start : start + EVAL_BATCH]
        total += float(model(input_ids=x, labels=x).loss) * len(x)
        count += len(x)
    model.train()
    return total / count


class Run:
    """What one arm needs: the data, the base model and the work directory."""

    def __init__(self, arm: Arm, shape: Shape, seed: int, workdir: Path) -> None:
        self.arm, self.shape, self.seed, self.workdir = arm, shape, seed, workdir
        m = arm.shards or arm.learners
        self.shards = [diloco_data.shard(shape.corpus, shape.seq_len, i, m) for i in range(m)]
        self.held_out = diloco_data.held_out(shape.corpus, shape.seq_len)
        self.everything = diloco_data.shard(shape.corpus, shape.seq_len, 0, 1)
        self.curve: list[tuple[int, float]] = []
        # (seconds of training, held-out loss, tokens trained by the fleet): threaded arms
        self.wall_curve: list[tuple[float, float, int]] = []

    def _build(self) -> torch.nn.Module:
        s = self.shape
        return diloco_data.build_model(s.family, s.hidden, s.layers, s.seq_len, self.seed)

    def model(self) -> torch.nn.Module:
        s = self.shape
        model = self._build()
        if not self.arm.lora:
            return model
        model.load_state_dict(self._lora_base())
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
        torch.manual_seed(self.seed)  # the adapters start alike on every island
        return get_peft_model(model, LoraConfig(r=s.lora_r, lora_alpha=2 * s.lora_r, lora_dropout=0.0,
                                                target_modules=targets))

    def _lora_base(self) -> dict[str, torch.Tensor]:
        """The full model trained `lora_base_steps` data-parallel steps: the start of every LoRA arm
        of this seed, made once per seed and shared through a file (the first arm writes it)."""
        s = self.shape
        path = self.workdir / (f"lora-base-{s.family}-{s.corpus}-{s.hidden}x{s.layers}-seq{s.seq_len}-"
                               f"{s.lora_base_steps}-seed{self.seed}.pt")
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if path.exists():
                return torch.load(path, weights_only=True)
            base = self._build()
            trainee = Trainee(base, self.everything, 2 * s.batch, s.lr, replace(s, steps=s.lora_base_steps),
                              seed=10_000 + self.seed)
            for _ in range(s.lora_base_steps):
                trainee.step()
            state = {k: v.detach().clone() for k, v in base.state_dict().items()}
            torch.save(state, path.with_suffix(".tmp"))
            os.replace(path.with_suffix(".tmp"), path)
            return state

    def curve_steps(self) -> set[int]:
        n = self.shape.steps
        return {round(n * i / CURVE_POINTS) for i in range(1, CURVE_POINTS)}

    # -- the arms ------------------------------------------------------------------------------
    def single(self, batch: int, blocks: torch.Tensor, tokens_per_step_scale: int = 1) -> dict[str, Any]:
        s = self.shape
        model = self.model()
        trainee = Trainee(model, blocks, batch, s.lora_lr if self.arm.lora else s.lr, s, seed=self.seed)
        self.curve.append((0, eval_loss(model, self.held_out)))
        tokens = 0
        points = self.curve_steps()
        for step in range(1, s.steps + 1):
            tokens += trainee.step()
            if step in points:
                self.curve.append((tokens, eval_loss(model, self.held_out)))
        return {"final_loss": eval_loss(model, self.held_out), "tokens": tokens, "steps": s.steps}

    def dp(self) -> dict[str, Any]:
        return self.single(self.arm.learners * self.shape.batch, self.everything)

    def alone(self) -> dict[str, Any]:
        return self.single(self.shape.batch, self.shards[0])

    def yeto(self) -> dict[str, Any]:
        from yeto_core.learner import LearnerSession
        from yeto_core.settings import LearnerSettings, load_settings
        from yeto_plugins.torch_dist.modules import embedding_names, synced_parameters

        s, m, arm = self.shape, self.arm.learners, self.arm
        threaded = arm.unpaced or arm.lockstep_threads
        key_file = self.workdir / f"{arm.name}-seed{self.seed}.key"
        key_file.write_text(secrets.token_hex(32))
        key_file.chmod(0o600)  # a key file others may read is warned about
        Path(self.workdir / f"{arm.name}-seed{self.seed}.tape").unlink(missing_ok=True)
        prefix = self.workdir / f"{arm.name}-seed{self.seed}"
        # Lockstep: every learner answers every round, launched as soon as asked. Unpaced: the
        # syncer's shipped quorum, grace and pacing.
        h = int(arm.learner.get("sync_interval", s.h))  # the syncer's H, which its learners take at the handshake
        lockstep = ["--quorum", str(m), "--sync-interval-steps", "0"]
        pacing = ["--sync-interval-steps", str(h)] if arm.unpaced else lockstep
        syncer = start_syncer(prefix, key_file, m, [*pacing, *arm.syncer])  # it starts while the models are built
        sessions: list[LearnerSession] = []
        try:
            lr = s.lora_lr if arm.lora else s.lr
            trainees = [Trainee(self.model(), self.shards[i], s.batch, lr, s, seed=self.seed * 1000 + i)
                        for i in range(m)]
            address = listening(syncer, prefix)
            for i, trainee in enumerate(trainees):
                model = trainee.model
                settings = load_settings(LearnerSettings, syncer=address, key_file=key_file, learner_id=i,
                                         lockstep=not arm.unpaced, **{**arm.learner, "sync_interval": h})
                sessions.append(LearnerSession(settings, synced_parameters(model, settings.tuning),
                                               embedding_names=embedding_names(model)))
                if settings.share_momentum:  # as the HF callback does with the Trainer's optimizer
                    sessions[-1].share_momentum(trainee.opt)
            together([session.start for session in sessions])
            viewer = copy.deepcopy(trainees[0].model)
            self.curve.append((0, self._global_loss(sessions[0], viewer)))
            began = time.monotonic()
            tokens, finals = (self._threaded if threaded else self._lockstep)(trainees, sessions, viewer)
            train_s = time.monotonic() - began
        finally:
            for session in sessions:
                session.close()
            stop(syncer)
            if syncer.stdout is not None:
                syncer.stdout.close()
        if not all(finals):
            raise RuntimeError(f"{arm.name}: not every island installed the final cut: {finals}")
        misses = sum(session.stats.lockstep_misses for session in sessions)
        if misses and not arm.unpaced:
            raise RuntimeError(f"{arm.name}: {misses} lockstep waits ran out of time; the run is not reproducible")
        first = trainees[0].model.state_dict()
        for n, trainee in enumerate(trainees[1:], 1):
            for name, value in trainee.model.state_dict().items():
                if not torch.equal(value, first[name]):
                    raise RuntimeError(f"{arm.name}: island {n}'s {name} differs from island 0's final cut")
        commits = [r for r in read_tape(self.workdir / f"{arm.name}-seed{self.seed}.tape")
                   if r.get("event") == "commit"]
        return {"final_loss": eval_loss(trainees[0].model, self.held_out), "tokens": tokens, "steps": s.steps,
                "rounds": len(commits), "pushes": sum(session.stats.pushes for session in sessions),
                "bytes_pushed": sum(session.stats.bytes_pushed for session in sessions),
                "island_steps": [session.stats.steps for session in sessions], "train_s": round(train_s, 2),
                "round_trip_steps": round_trip_steps(sessions), "wall_curve": self.wall_curve}

    def _lockstep(self, trainees: list[Trainee], sessions: list[Any], viewer: torch.nn.Module) -> Trained:
        """Every island's step k, in island order, on this thread: reproducible bit for bit."""
        tokens = 0
        points = self.curve_steps()
        for step in range(1, self.shape.steps + 1):
            for trainee, session in zip(trainees, sessions, strict=True):
                n = trainee.step()
                tokens += n
                if session.step(n):
                    raise RuntimeError(f"{self.arm.name}: the syncer finalized at step {step} of {self.shape.steps}")
            if step in points:
                self.curve.append((tokens, self._global_loss(sessions[0], viewer)))
        return tokens, together([session.finish for session in sessions])

    def _threaded(self, trainees: list[Trainee], sessions: list[Any], viewer: torch.nn.Module) -> Trained:
        """Every island on a thread of its own, as fast as it goes: `steps` each, or, with a
        `fleet_budget`, until the fleet together has taken `fleet_share` of max(M, shards)·steps."""
        s, arm = self.shape, self.arm
        last = len(trainees) - 1
        lock = threading.Lock()
        left = [round(arm.fleet_share * max(arm.learners, arm.shards) * s.steps)]
        tokens = [0] * len(trainees)
        points = self.curve_steps()
        every = max(1, s.steps // WALL_POINTS)
        snapshots: list[tuple[int, float, bool, list[torch.Tensor]]] = []
        began = time.monotonic()

        def may_step(step: int) -> bool:
            if not arm.fleet_budget:
                return step <= s.steps
            with lock:
                left[0] -= 1
                return left[0] >= 0

        def island(i: int) -> bool:
            trainee, session = trainees[i], sessions[i]
            slow = arm.slow if i == last else 1
            step = 1
            while may_step(step):
                t0 = time.monotonic()
                n = trainee.step()
                if slow > 1:
                    time.sleep((slow - 1) * (time.monotonic() - t0))
                tokens[i] += n
                if session.step(n):
                    raise RuntimeError(f"{arm.name}: the syncer finalized island {i} at step {step}")
                if i == 0 and (step in points or step % every == 0):  # taken now, evaluated after:
                    # an island never stops for it
                    snapshots.append((sum(tokens), time.monotonic() - began, step in points,
                                      [state.anchor.clone() for state in session.fragments]))
                step += 1
            return bool(session.finish())

        finals = together([partial(island, i) for i in range(len(trainees))], timeout_s=4 * 3600)
        for tokens_then, seconds, on_curve, anchors in snapshots:
            loss = self._global_loss(sessions[0], viewer, anchors)
            if on_curve:
                self.curve.append((tokens_then, loss))
            self.wall_curve.append((round(seconds, 2), loss, tokens_then))
        return sum(tokens), finals

    def _global_loss(self, session: Any, viewer: torch.nn.Module, anchors: list[torch.Tensor] | None = None) -> float:
        """Held-out loss of the global model: the merged value of every fragment, as installed
        (or as `anchors`, taken from the session earlier)."""
        params = dict(viewer.named_parameters())
        anchors = anchors or [state.anchor for state in session.fragments]
        with torch.no_grad():
            for fragment, anchor in zip(session.layout.fragments, anchors, strict=True):
                for slot in fragment.slots:
                    params[slot.name].copy_(anchor[slot.offset : slot.offset + slot.numel].view(slot.shape))
        return eval_loss(viewer, self.held_out)


def together(calls: list[Callable[[], Any]], timeout_s: float = 600) -> list[Any]:
    """Run the calls on threads of their own (learner 0's INIT, a final cut every island waits for)."""
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if errors:
        raise errors[0]
    return results


def round_trip_steps(sessions: list[Any]) -> float | None:
    """Mean steps an island trained from a push to the install of its round's merge (lockstep: 1)."""
    trips = sum(session.stats.round_trips for session in sessions)
    return round(sum(session.stats.round_trip_steps for session in sessions) / trips, 2) if trips else None


def read_tape(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def start_syncer(prefix: Path, key_file: Path, learners: int, extra: list[str]) -> subprocess.Popen:
    """The real syncer on 127.0.0.1 (a free port) for `learners`, pacing as `extra` says; the tape
    goes to `prefix`.tape."""
    argv = [sys.executable, "-m", "syncer", "--host", "127.0.0.1", "--port", "0", "--learners", str(learners),
            "--fragments", str(FRAGMENTS), "--device", "cpu", "--tape", f"{prefix}.tape", "--key-file", str(key_file),
            "--final-timeout-s", "30", "--log-level", "WARNING", *extra]
    env = {k: v for k, v in os.environ.items() if not k.startswith("YETO_")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    with open(f"{prefix}.syncer.log", "wb") as err:
        return subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err)


def listening(proc: subprocess.Popen, prefix: Path, timeout_s: float = 60.0) -> str:
    """The syncer's HOST:PORT once it prints its listening line; it is stopped if it does not."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline().decode(errors="replace")
        match = LISTENING.match(line)
        if match:
            return f"{match.group(1)}:{match.group(2)}"
        if not line and proc.poll() is not None:
            break
    stop(proc)
    raise RuntimeError(f"the syncer did not start: {Path(f'{prefix}.syncer.log').read_text(errors='replace')[-2000:]}")


def run_arm(arm: Arm, shape: Shape, seed: int, workdir: Path) -> dict[str, Any]:
    torch.set_num_threads(1)
    t0 = time.monotonic()
    run = Run(arm, shape, seed, workdir)
    out = getattr(run, arm.kind)()
    return {"arm": arm.name, "cell": arm.cell, "seed": seed, **out, "curve": run.curve,
            "wall_s": round(time.monotonic() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    job = json.loads((argv or sys.argv[1:])[0])
    arm = Arm(**job["arm"])
    for seed in job["seeds"]:
        result = run_arm(arm, Shape(**job["shape"]), int(seed), Path(job["workdir"]))
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["Arm", "Shape", "asdict", "run_arm"]
