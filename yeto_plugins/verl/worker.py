"""`YetoTrainingWorker`: verl's actor training worker, with its island's DiLoCo learner inside.

verl 0.9.1's `ActorRolloutRefWorker` builds its actor as `self.actor_worker_cls(config=...)`
(`verl/workers/engine_workers.py:644`), then calls `reset()` (`:645`, which initializes the
engine), and per RL iteration `update_actor` → `self.actor.train_mini_batch` (`:713-716`), which
runs `train_batch` once per optimizer step (`:314`); the driver then pushes the actor's live
parameters to the rollout engine with `update_weights` (`:728`, reading
`engine.get_per_tensor_param()`). This subclass hooks the same three methods, on every rank:

* `reset`: once the engine is built, the island joins the syncer and installs the initial cut,
  so the first rollout already runs the run's initial policy;
* `train_batch`: one optimizer step of `global_token_num` tokens (all-gathered over DP, `:291-303`)
  is accounted; with `rl_mode=stream` that is the ordinary DiLoCo boundary (a fragment every
  H/P steps), with `sweep`/`overlap` the step is only counted;
* `train_mini_batch`: at the end of each RL iteration, before `update_weights`, `sweep` and
  `overlap` sweep every fragment (`IslandSession.end_iteration`); on the last iteration (verl's
  `total_training_steps`, which its driver sets to the number of iterations) the island asks for
  the final cut and installs it, so the last `update_weights` and checkpoint carry it;
* `load_checkpoint`: verl resumes (`trainer.resume_mode`, `auto` by default) after the workers are
  built (`verl/trainer/ppo/v1/trainer_base.py:392`, `:850-883`), so its checkpoint overwrites the
  weights the island installed at its join. The island then joins again, which installs the
  syncer's current global weights over the checkpoint's (its optimizer moments and scheduler stay),
  and counts on from the checkpoint's iteration (`global_step_N`, as verl names it, `:876`), so the
  run's last iteration still installs the final cut.

Every install writes the engine's own parameters in place (FSDP2 `DTensor` shards through
`ProcessGroupStore`, or Megatron's fp32 masters and parameters through `MegatronDiLoCoSync`), so
`update_weights` hands the rollout exactly what the island holds and the optimizer's moments are
kept. Once the final cut is in, later optimizer steps run with learning rate 0: verl's driver
runs its remaining iterations, and the final weights stay what the rollout serves.
"""

from __future__ import annotations

import logging
import re
import sys
from typing import Any, ClassVar

from verl.single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn, register
from verl.utils import tensordict_utils as tu
from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

from yeto_core.island import IslandSession
from yeto_core.settings import LearnerSettings, SettingsError, load_settings
from yeto_plugins.builder import build_island
from yeto_plugins.exits import island_exit

log = logging.getLogger("yeto.verl")

ON_TRAIN_MESH = make_nd_compute_dataproto_dispatch_fn(mesh_name="train")  # as TrainingWorker's own methods
ON_FINAL = "the remaining steps leave the weights as they are"


def attach() -> None:
    """Make the actor of every `ActorRolloutRefWorker` built from now on a `YetoTrainingWorker`.
    Settings that do not validate are kept and raised when the actor is built."""
    try:
        YetoTrainingWorker.settings = load_settings(LearnerSettings)
    except SettingsError as exc:
        YetoTrainingWorker.settings_error = exc
        print(f"yeto: {exc}", file=sys.stderr, flush=True)
    ActorRolloutRefWorker.actor_worker_cls = YetoTrainingWorker


def is_megatron(engine: Any) -> bool:
    return any(cls.__name__ == "MegatronEngine" for cls in type(engine).__mro__)


class YetoTrainingWorker(TrainingWorker):
    settings: ClassVar[LearnerSettings | None] = None
    settings_error: ClassVar[SettingsError | None] = None

    def __init__(self, config: Any) -> None:
        if self.settings_error is not None:
            raise self.settings_error
        if self.settings is None:
            raise SettingsError("YetoTrainingWorker is attached by yeto_plugins.verl.entry (set YETO_DILOCO_*)")
        super().__init__(config)
        self.island: IslandSession | None = None
        self.iterations = 0

    @property
    def final(self) -> bool:
        """The final cut is installed: the weights stay as they are."""
        return self.island is not None and self.island.final

    # -- the hooks -----------------------------------------------------------------------------
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def reset(self) -> None:
        super().reset()
        if self.island is None:
            with self.engine.train_mode():  # the parameters where the engine trains them (not offloaded)
                self.island = self._join()

    @register(dispatch_mode=ON_TRAIN_MESH, blocking=False)
    def train_batch(self, data: Any) -> Any:
        tokens = sum(tu.get(data, key="global_token_num") or ())
        if self.final:
            self._hold_weights()
        output = super().train_batch(data)
        if self.island is not None:
            self.island.step(int(tokens))
        return output

    @register(dispatch_mode=ON_TRAIN_MESH, blocking=False)
    def train_mini_batch(self, data: Any) -> Any:
        output = super().train_mini_batch(data)
        self.iterations += 1
        island = self.island
        if island is None:
            return output
        total = self.optimizer_config.total_training_steps
        last = total is not None and 0 < total <= self.iterations
        if not island.final:
            with self.engine.train_mode():
                island.end_iteration(last=last)
        if last:
            island.close()
        return output

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str, hdfs_path: str | None = None, del_local_after_load: bool = False) -> Any:
        output = super().load_checkpoint(local_path, hdfs_path, del_local_after_load)
        resumed = re.search(r"global_step_(\d+)", str(local_path))
        if resumed:
            self.iterations = int(resumed.group(1))
        if self.island is not None:  # the checkpoint's weights are this island's past: take the run's present
            self.island.close()
            with self.engine.train_mode():
                self.island = self._join()
        return output

    # -- internals -----------------------------------------------------------------------------
    def _join(self) -> IslandSession:
        settings = self.settings
        assert settings is not None
        engine = self.engine
        if is_megatron(engine):  # verl's Megatron engine: the same core as ms-swift's (GPU only)
            island = build_island(settings, engine.module, optimizer=engine.optimizer, on_final=ON_FINAL)
        else:
            strategy = getattr(self.engine_config, "strategy", None)
            if strategy != "fsdp2":
                raise SettingsError(f"yeto's verl worker reads and writes FSDP2 (DTensor) or Megatron parameters; "
                                    f"this actor runs strategy {strategy!r}: set actor_rollout_ref.actor.strategy="
                                    "fsdp2")
            # FSDP2 shards are DTensors: always the collective store, even for an island of one rank
            island = build_island(settings, engine.module, collective=True, on_final=ON_FINAL)
            if settings.share_momentum:  # DESIGN §3.9: the FSDP2 moments are DTensors, read by every rank
                island.share_momentum(engine.optimizer)
        total = self.optimizer_config.total_training_steps
        if total is None or total <= 0:
            log.warning("yeto: verl set no total_training_steps: the island gets the final cut only when the syncer "
                        "ends the run")
        with island_exit():  # a link too slow to join ends the actor with code 75 and one line
            island.start()
        return island

    def _hold_weights(self) -> None:
        """After the final cut: the optimizer steps with learning rate 0, so the parameters stay
        bit for bit what they are (its scheduler sets the rate again after every step)."""
        for group in self.engine.optimizer.param_groups:
            group["lr"] = 0.0
