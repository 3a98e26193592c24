"""A rank of a real megatron-core island driving `MegatronDiLoCoSync` (run by `launch.run_ranks`).

    python sync_worker.py names   SPEC_JSON [SPEC_JSON ...]   # world 1: global names of each config
    python sync_worker.py exact   SPEC_JSON                   # masters read and written bit for bit
    python sync_worker.py error   SPEC_JSON                   # a rank-0 failure raises on every rank
    python sync_worker.py train   SPEC_JSON STEPS             # a learner against the syncer in YETO_DILOCO_*
    python sync_worker.py swift   SPEC_JSON STEPS             # the same through the ms-swift callback

Every mode reports a JSON dict through `launch.report`.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from islands import IslandSpec, init_island, rank_info, teardown
from launch import report

from yeto_plugins.megatron.masters import sub_optimizers
from yeto_plugins.megatron.probe import megatron_logit_probe
from yeto_plugins.megatron.store import IslandError, Slot, shard_of
from yeto_plugins.megatron.sync import MegatronDiLoCoSync

OFFLINE = {"syncer": "127.0.0.1:9", "key": "k" * 32}  # never dialled: these modes do not start()


def spec_of(text: str) -> IslandSpec:
    return IslandSpec(**json.loads(text))


def moments(optimizer: Any) -> list[torch.Tensor]:
    out = []
    for o in sub_optimizers(optimizer):
        for state in o.optimizer.state.values():
            out += [v.detach().clone() for k, v in sorted(state.items()) if torch.is_tensor(v) and v.numel() > 1]
    return out


def reference_values(sync: MegatronDiLoCoSync) -> dict[str, torch.Tensor]:
    """Values every rank can make alike: seeded by the tensor's global name."""
    out = {}
    for spec in sync.store.specs:
        seed = int.from_bytes(hashlib.sha256(spec.name.encode()).digest()[:6], "little")
        out[spec.name] = torch.randn(spec.shape, generator=torch.Generator().manual_seed(seed))
    return out


def check_rank(sync: MegatronDiLoCoSync, values: dict[str, torch.Tensor], what: str) -> list[str]:
    """This rank's masters and parameters against the whole values: [] when all bits match."""
    problems = []
    for lp, m in zip(sync.store.local, sync.store.masters, strict=True):
        shape, tp_dim, stride = sync.store._shapes[lp.global_name]
        whole = values[lp.global_name].reshape(-1).float()
        mine = shard_of(whole, Slot(lp.global_name, shape, 0, whole.numel(), tp_dim, stride), lp.shard)
        if m.owned is not None:
            start, end = m.owned
            if not torch.equal(m.read()[: end - start].reshape(-1), mine[start:end]):
                problems.append(f"{what}: master of {lp.local_name} differs")
        if not torch.equal(lp.param.detach().reshape(-1), mine.to(lp.param.dtype)):
            problems.append(f"{what}: parameter {lp.local_name} differs")
    return problems


def share(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, 0)
    return box[0]


def probe_logits(island: Any, sync: MegatronDiLoCoSync) -> list[list[float]] | None:
    """The consensus probe, run by every rank together on the island's current weights; rank 0's
    logits (None elsewhere, where the probe returns an empty tensor)."""
    probe = megatron_logit_probe(island.model_chunks, sync.store.group, tokens=12)
    assert probe is not None
    with torch.no_grad():
        logits = probe()
    assert all(chunk.training for chunk in island.model_chunks), "the probe left the model in eval mode"
    if sync.rank != 0:
        assert logits.numel() == 0
        return None
    return logits.tolist()


def mode_names(specs: list[str]) -> None:
    """Each config's global names, and its probe logits on the weights `reference_values` names."""
    out, logits = [], []
    for text in specs:
        island = init_island(spec_of(text))
        sync = MegatronDiLoCoSync(island.model_chunks, island.optimizer, **OFFLINE)
        out.append(sync.names)
        sync.write_all(reference_values(sync))
        logits.append(probe_logits(island, sync))
        sync.close()
        teardown()
    report({"names": out, "logits": logits})


def mode_exact(text: str) -> None:
    island = init_island(spec_of(text))
    for _ in range(2):  # masters now hold more than their bf16 parameters say
        island.train_step()
    sync = MegatronDiLoCoSync(island.model_chunks, island.optimizer, **OFFLINE)
    sync.store.chunk_elems = 8192  # many batches per transfer (the 1 MiB minimum would be one)
    before = moments(island.optimizer)
    read = share(sync.read_all())  # rank 0 gathered them; every rank checks its own part
    problems = check_rank(sync, read, "read")
    written = reference_values(sync)
    sync.write_all(written if sync.rank == 0 else None)
    problems += check_rank(sync, written, "write")
    after = moments(island.optimizer)
    if len(before) != len(after) or not all(torch.equal(a, b) for a, b in zip(before, after, strict=True)):
        problems.append("optimizer moments changed")
    again = sync.read_all()
    if again is not None and any(not torch.equal(again[k], written[k].float()) for k in written):
        problems.append("read after write differs")
    logits = probe_logits(island, sync)  # the consensus probe on the written weights
    loss = island.train_step()
    report({"names": sync.names, "problems": problems, "moments": len(before), "loss": loss, "logits": logits,
            **rank_info()})
    sync.close()
    teardown()


def mode_error(text: str) -> None:
    island = init_island(spec_of(text))
    sync = MegatronDiLoCoSync(island.model_chunks, island.optimizer, **OFFLINE)
    from yeto_core.layout import build_layout

    fragment = build_layout(sync.store.specs, 1).fragments[0]
    try:  # a payload of the wrong size: rank 0 refuses it before announcing the write
        sync.store.run(lambda: sync.store.install(fragment, torch.zeros(3), 0.0))
    except (IslandError, ValueError) as exc:
        message = f"{type(exc).__name__}: {exc}"
    else:
        message = "no error"
    read = sync.read_all()  # the island still works afterwards
    report({"error": message, "still_reads": read is not None or sync.rank != 0})
    sync.close()
    teardown()


def mode_train(text: str, steps: int) -> None:
    island = init_island(spec_of(text))
    sync = MegatronDiLoCoSync(island.model_chunks, island.optimizer)  # settings from YETO_DILOCO_*
    try:
        sync.start()
    except Exception as exc:  # e.g. refused by the syncer: every rank must get here
        report({"error": f"{type(exc).__name__}: {exc}", **rank_info()})
        teardown()
        return
    stopped_at, losses = None, []
    for step in range(1, steps + 1):
        loss = island.train_step()
        if loss is not None:
            losses.append(loss)
        if sync.step(island.tokens_per_step):
            stopped_at = step
            break
    final = sync.stats.final_installed or sync.finish()
    values = share(sync.read_all())
    problems = check_rank(sync, values, "final")
    digest = {k: hashlib.sha256(v.float().numpy().tobytes()).hexdigest() for k, v in values.items()}
    report({"stopped_at": stopped_at, "final": final, "problems": problems, "digest": digest, "losses": losses,
            "pushes": sync.stats.pushes, "installs": sync.stats.installs, **rank_info()})
    sync.close()
    teardown()


class SwiftLikeTrainer:
    """The attributes swift's Megatron trainer gives its callbacks, around a real island, and
    its step loop (swift/megatron/trainers/base.py): on_step_begin, train_step, the scheduler
    advanced by the global batch on a successful update, iteration += 1, on_step_end."""

    def __init__(self, island: Any, train_iters: int) -> None:
        from types import SimpleNamespace

        self.island = island
        self.wrapped_models = island.model_chunks
        self.optimizer = island.optimizer
        self.opt_param_scheduler = SimpleNamespace(num_steps=0)
        batch = island.dp_size * island.spec.micro_batches * island.spec.micro_batch
        self.args = SimpleNamespace(train_iters=train_iters, seq_length=island.spec.seq, global_batch_size=batch)
        self.state = SimpleNamespace(iteration=0, consumed_train_samples=0)
        self.losses: list[float] = []

    def train(self, callback: Any) -> None:
        callback.on_train_begin()
        while self.state.iteration < self.args.train_iters:
            callback.on_step_begin()
            loss = self.island.train_step()
            if loss is not None:
                self.losses.append(loss)
            if self.island.last_step_info["update_successful"]:
                self.opt_param_scheduler.num_steps += self.args.global_batch_size
            self.state.iteration += 1
            callback.on_step_end()
        callback.on_train_end()


def mode_swift(text: str, steps: int) -> None:
    from yeto_plugins.swift_megatron.callback import YetoMegatronCallback

    class Checked(YetoMegatronCallback):
        def on_train_end(self) -> None:
            assert isinstance(self.sync, MegatronDiLoCoSync)
            self.values = share(self.sync.read_all())  # what every rank holds when training ends
            super().on_train_end()

    island = init_island(spec_of(text))
    trainer = SwiftLikeTrainer(island, steps)
    callback = Checked(trainer)  # settings from YETO_DILOCO_*, the real sync core
    trainer.train(callback)
    sync = callback.sync
    assert isinstance(sync, MegatronDiLoCoSync)
    digest = {k: hashlib.sha256(v.float().numpy().tobytes()).hexdigest() for k, v in callback.values.items()}
    report({"stopped_at": trainer.state.iteration if trainer.args.train_iters < steps else None,
            "final": callback.final_installed, "problems": check_rank(sync, callback.values, "final"),
            "digest": digest, "losses": trainer.losses, "pushes": sync.stats.pushes, "installs": sync.stats.installs,
            "tokens_per_step": trainer.args.global_batch_size * trainer.args.seq_length, **rank_info()})
    teardown()


if __name__ == "__main__":
    mode, rest = sys.argv[1], sys.argv[2:]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if mode == "names":
        mode_names(rest)
    elif mode == "exact":
        mode_exact(rest[0])
    elif mode == "error":
        mode_error(rest[0])
    elif mode == "train":
        mode_train(rest[0], int(rest[1]))
    elif mode == "swift":
        mode_swift(rest[0], int(rest[1]))

    else:
        raise SystemExit(f"unknown mode {mode}")
