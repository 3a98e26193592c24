"""Two RL islands of verl's real actor against the real syncer, and what they leave behind.

Island A is learner 0 on two FSDP2 ranks, island B learner 1 on one rank; each runs `island_worker.py`
under torchrun with its own batches. `run_islands` starts the syncer and both, waits for all three, and
returns the islands' per-rank reports with the syncer's tape and final checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from processes import HERE, Syncer, island_env, start_syncer, stopped_at_exit, torchrun
from safetensors.torch import load_file

ISLAND = HERE / "island_worker.py"
RANKS = {0: 2, 1: 1}  # learner id -> ranks of its island
DEADLINE_S = 200.0


@dataclass
class Finished:
    syncer: Syncer
    reports: dict[int, list[dict[str, Any]]]  # learner id -> its ranks' reports, rank order
    outs: dict[int, Path]

    def tape(self) -> list[dict[str, Any]]:
        lines = self.syncer.tape.read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def commits(self) -> list[dict[str, Any]]:
        return [r for r in self.tape() if r["event"] == "commit"]

    def checkpoint(self) -> dict[str, torch.Tensor]:
        """The syncer's final `param/<name>` tensors, by model tensor name."""
        tensors = load_file(str(self.syncer.checkpoint))
        return {k.removeprefix("param/"): v for k, v in tensors.items() if k.startswith("param/")}

    def saved(self, learner: int, what: str) -> dict[str, torch.Tensor]:
        """Rank 0's final `actor_params` or `rollout_weights` of island `learner`."""
        return load_file(str(self.outs[learner] / f"{what}.safetensors"))


def run_islands(workdir: Path, model: Path, *, iterations: int, syncer_flags: tuple[str, ...],
                **settings: object) -> Finished:
    syncer = start_syncer(workdir, "--quorum", "2", *syncer_flags)
    outs = {learner: workdir / f"island{learner}" for learner in RANKS}
    with stopped_at_exit(syncer.run) as running:
        for learner, ranks in RANKS.items():
            env = island_env(syncer, learner, **settings)
            args = ["--model", str(model), "--iterations", str(iterations), "--out", str(outs[learner]),
                    "--seed", str(learner)]
            running.append(torchrun(ISLAND, ranks, args, workdir / f"island{learner}.log", env,
                                    name=f"island {learner}"))
        islands = running[1:]
        for island in islands:
            code = island.wait(DEADLINE_S)
            if code != 0:
                pytest.fail(f"{island.name} exited with {code}\n" + "\n".join(r.tail() for r in running))
        code = syncer.run.wait(60)
        assert code == 0, syncer.run.tail()
    reports = {learner: [json.loads((outs[learner] / f"rank{r}.json").read_text()) for r in range(ranks)]
               for learner, ranks in RANKS.items()}
    return Finished(syncer, reports, outs)


def assert_equal_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], where: str) -> None:
    assert got.keys() == want.keys(), where
    differing = sorted(name for name in want if not torch.equal(got[name], want[name]))
    assert not differing, f"{where}: {differing} differ"
