"""A rank of an FSDP2 island (`fully_shard` on gloo, CPU) run by `tests/mcore/launch.run_ranks`.

    python fsdp_worker.py exact    # reads and writes through ProcessGroupStore are exact; moments kept
    python fsdp_worker.py train    # a lone learner against the syncer in YETO_DILOCO_*, lock-stepped
    python fsdp_worker.py moments  # the shared first moment read and changed by every rank (FSDP2, DDP)

With WORLD_SIZE 1 `train` runs the same schedule as one plain process (no FSDP), the reference.
Every rank reports a JSON dict through `launch.report`.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mcore"))
from launch import end_rank, report

from yeto_core.conductor import Outcome
from yeto_core.layout import build_layout
from yeto_core.learner import LearnerSession
from yeto_core.moments import decode_moment, encode_moment, moment_bound
from yeto_core.settings import LearnerSettings, load_settings
from yeto_plugins.torch_dist.store import ProcessGroupStore

GLOBAL_BATCH = 16


def build(world: int) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 4))
    target = torch.randn(8, 4)
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    return model, target


def batch(step: int, rank: int, world: int) -> torch.Tensor:
    """This rank's rows of the step's global batch (the same global batch for any world size)."""
    x = torch.randn(GLOBAL_BATCH, 8, generator=torch.Generator().manual_seed(1000 + step))
    rows = GLOBAL_BATCH // world
    return x[rank * rows : (rank + 1) * rows]


def train_step(model: torch.nn.Module, target: torch.Tensor, opt: torch.optim.Optimizer, step: int, rank: int,
               world: int) -> None:
    x = batch(step, rank, world)
    loss = torch.nn.functional.mse_loss(model(x), x @ target)
    opt.zero_grad()
    loss.backward()  # FSDP2 averages the gradients over the ranks: the global batch's mean
    opt.step()


def full(p: torch.Tensor) -> torch.Tensor:
    return (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()


def share(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, 0)
    return box[0]


def mode_exact(rank: int, world: int) -> None:
    model, target = build(world)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(3):
        train_step(model, target, opt, step, rank, world)
    named = list(model.named_parameters())
    ids = [id(p) for _, p in named]
    moments = [v.detach().clone() for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()]
    store = ProcessGroupStore(named)
    fragment = build_layout(store.specs, 1).fragments[0]
    problems = []
    box: dict[str, torch.Tensor] = {}

    def gather() -> bool:
        box["read"] = store.gather(fragment)
        return False

    store.run(gather if rank == 0 else None)
    read = share(box.get("read"))
    before = {name: full(p).float().clone() for name, p in named}
    for slot in fragment.slots:
        if not torch.equal(read[slot.offset : slot.offset + slot.numel].view(slot.shape), before[slot.name]):
            problems.append(f"read: {slot.name} differs from its full tensor")
    new = torch.randn(fragment.numel, generator=torch.Generator().manual_seed(7))
    for alpha in (0.0, 0.5):
        base = {name: full(p).float().clone() for name, p in named}
        store.run((lambda a=alpha: store.install(fragment, new.clone(), a)) if rank == 0 else None)  # type: ignore[misc]
        for slot in fragment.slots:
            glob = new[slot.offset : slot.offset + slot.numel].view(slot.shape)
            want = glob if alpha == 0.0 else base[slot.name].mul(alpha).add(glob, alpha=1.0 - alpha)
            if not torch.equal(full(dict(named)[slot.name]).float(), want):
                problems.append(f"write alpha={alpha}: {slot.name} is not what was installed")
    if [id(p) for _, p in model.named_parameters()] != ids:
        problems.append("the parameter objects changed")
    after = [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()]
    if len(after) != len(moments) or not all(torch.equal(a, b) for a, b in zip(after, moments, strict=True)):
        problems.append("optimizer moments changed")
    train_step(model, target, opt, 3, rank, world)  # still trains with the installed shards

    # The consensus probe: rank 0 leads, every rank runs the forward pass (FSDP2 all-gathers in it).
    probe_x = torch.randn(5, 8, generator=torch.Generator().manual_seed(11))
    lead = store.island_probe(lambda: model(probe_x))

    def probe() -> bool:
        with torch.no_grad():
            box["probe"] = lead()
        return False

    store.run(probe if rank == 0 else None)
    plain, _ = build(1)
    plain.load_state_dict({name: full(p).float() for name, p in named})
    if rank == 0 and not torch.allclose(box["probe"], plain(probe_x), rtol=0, atol=1e-6):
        problems.append("the island's probe differs from the same weights in one process")
    store.close()
    report({"problems": problems, "sharded": store.sharded, "moments": len(moments)})


def mode_moments(rank: int, world: int) -> None:
    """An FSDP2 island (moments sharded like their parameters) and a DDP-like one (every rank the
    same full replica, trained on the whole batch): rank 0 reads the whole moment, and a change it
    makes reaches every rank's shard or replica exactly."""
    report({"problems": [p for kind in ("fsdp2", "ddp") for p in moments_problems(kind, rank, world)]})


def moments_problems(kind: str, rank: int, world: int) -> list[str]:
    problems: list[str] = []
    model, target = build(world if kind == "fsdp2" else 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.99))
    for step in range(3):
        train_step(model, target, opt, step, 0 if kind == "ddp" else rank, 1 if kind == "ddp" else world)
    named = list(model.named_parameters())
    store = ProcessGroupStore(named)
    moments = store.moments(opt)
    layout = build_layout(store.specs, 2)
    exp_avg = {name: opt.state[p]["exp_avg"] for name, p in named}
    before = {name: full(m).float().clone() for name, m in exp_avg.items()}  # every rank: a collective
    # the fleet's moment is clamped to κ·√v of the island's own second moment (DESIGN §3.9), shard by shard
    limit = {name: full(opt.state[p]["exp_avg_sq"]).float().sqrt() * moment_bound(opt.param_groups[0])
             for name, p in named}
    box: dict[str, Any] = {}

    def read() -> bool:
        box["wires"] = [moments.encode(fragment) for fragment in layout.fragments]
        return False

    store.run(read if rank == 0 else None)
    read_back = box.get("wires")
    wires = share(None if read_back is None or None in read_back else [bytes(w) for w in read_back])
    if wires is None:  # shared: every rank leaves here together
        store.close()
        return [f"{kind}: rank 0 read no moment"]
    for fragment, wire in zip(layout.fragments, wires, strict=True):
        exact = torch.cat([before[slot.name].reshape(-1) for slot in fragment.slots])
        if bytes(encode_moment(exact)) != wire:  # the optimizer's moment, read exactly, then encoded
            problems.append(f"{kind}: rank 0 read another moment than its optimizer's")
        mine = decode_moment(fragment, memoryview(wire))
        merged = encode_moment(mine + torch.linspace(-1, 1, fragment.numel))
        shift = decode_moment(fragment, merged) - mine

        def rebase(fragment: Any = fragment, merged: memoryview = merged, wire: bytes = wire) -> None:
            moments.rebase_wire(fragment, merged, memoryview(wire), 2)

        store.run(rebase if rank == 0 else None)
        for slot in fragment.slots:
            want = before[slot.name] + 0.8**2 * shift[slot.offset : slot.offset + slot.numel].view(slot.shape)
            want = torch.maximum(torch.minimum(want, limit[slot.name]), -limit[slot.name])
            if not torch.allclose(full(exp_avg[slot.name]).float(), want, rtol=0, atol=1e-6):
                problems.append(f"{kind}: rank {rank}: {slot.name}'s moment did not take the change")
    digest = hashlib.sha256(b"".join(full(m).float().numpy().tobytes() for m in exp_avg.values())).hexdigest()
    if share(digest) != digest:  # every rank compares its own with rank 0's
        problems.append(f"{kind}: rank {rank}'s moments differ from rank 0's")
    train_step(model, target, opt, 3, 0 if kind == "ddp" else rank, 1 if kind == "ddp" else world)
    store.close()
    return problems


def settle(session: LearnerSession, store: ProcessGroupStore, what: Callable[[LearnerSession], bool],
           deadline: float) -> None:
    """Rank 0: drain the syncer's messages (nothing is installed) until `what` holds."""
    while not what(session):
        if time.monotonic() > deadline:
            raise TimeoutError("lock step: the syncer did not answer in time")
        store.tick()
        session.pump(0.02)


def lock_step(s: LearnerSession, store: ProcessGroupStore, step: int, every: int) -> bool:
    """Rank 0, before a step: the schedule of lockstep.py for one learner. The last push has
    streamed and the BCAST of its round has arrived (it is installed at this step), and at a
    boundary the PULL it answers is there."""
    deadline = time.monotonic() + 60
    job = s.push
    if job is not None:
        settle(s, store, lambda s: job.done.is_set() or s.final_ready, deadline)
        f, v = job.pull.fragment, job.pull.version + 1
        settle(s, store, lambda s: s.final_ready or s.fragments[f].bcast_arrived_after(v - 1), deadline)
    if step % every == 0:
        settle(s, store, lambda s: s.final_ready or any(p.round == step // every - 1 for p in s.pending_pulls()),
               deadline)
    return False


def mode_train(rank: int, world: int) -> None:
    model, target = build(world)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    settings = load_settings(LearnerSettings, sync_interval=6, merge_alpha=0.0, answer_on_arrival=False)
    store = ProcessGroupStore(list(model.named_parameters()), island=settings.island)
    session = LearnerSession(settings, store=store) if rank == 0 else None
    store.run((lambda: session.start()) if session is not None else None)  # type: ignore[union-attr]
    be = 2  # H = 6 over 3 fragments: a boundary every 2 steps
    final, step = False, 0
    while not final and step < 500:
        step += 1
        # One collective call per step on every rank: rank 0 waits inside it, the others follow.
        store.run((lambda n=step: lock_step(session, store, n, be)) if session is not None else None)  # type: ignore[misc]
        train_step(model, target, opt, step, rank, world)
        outcome = store.run((lambda: Outcome(session.step(GLOBAL_BATCH))) if session is not None else None)  # type: ignore[union-attr]
        final = outcome.answer
    digest = hashlib.sha256(b"".join(full(p).float().numpy().tobytes() for _, p in model.named_parameters()))
    if session is not None:
        session.close()
    store.close()
    report({"final": final, "steps": step, "problems": [] if final else ["no final cut"],
            "digest": digest.hexdigest()})


if __name__ == "__main__":
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        {"exact": mode_exact, "train": mode_train, "moments": mode_moments}[sys.argv[1]](rank, world)
    finally:
        dist.destroy_process_group()
    end_rank()
