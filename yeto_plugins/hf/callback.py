"""`YetoDiLoCo`: the HF Trainer callback that makes a Trainer run one DiLoCo island (DESIGN §1.4).

    trainer.add_callback(YetoDiLoCo())                  # settings from YETO_DILOCO_*
    trainer.add_callback(YetoDiLoCo(syncer="10.0.0.5:7070", key_file="key", learner_id=1))

One DiLoCo boundary check per optimizer step, from `on_step_end` (it fires after the optimizer
step, the scheduler step and zero_grad). The callback reports the true number of trained tokens
(the Trainer's non-padding count: the attention mask's sum) and stops training at the step that
installed the syncer's final cut. When the Trainer reaches `max_steps` first, that last step asks
the syncer for the final cut and installs it. Either way the step that installed the final cut
also asks the Trainer to log, save (unless `save_strategy="no"`) and evaluate (when it evaluates
at all), so a script that relies on the Trainer's own saving (`swift sft`, `run_clm.py`) ends
with the final model on disk; one WARNING line says so, and the `yeto_*` figures go into the
Trainer's log history (and with it `trainer_state.json`). A script that stops early for a reason
of its own gets the final cut from `on_train_end`, before it saves the model.

Under torchrun (DDP, FSDP2 with DTensor parameters, DeepSpeed ZeRO) the island is all of its
processes: `yeto_core.island.IslandSession` runs the learner on rank 0 and every rank takes part in
its reads and writes (`yeto_plugins.torch_dist.store`), so every rank stops at the same step holding the same merged
weights.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from yeto_core.island import IslandSession
from yeto_core.learner import LearnerSession
from yeto_core.moments import MomentError
from yeto_core.settings import LearnerSettings, load_settings
from yeto_plugins.builder import build_island
from yeto_plugins.exits import island_exit, settings_exit
from yeto_plugins.hf.consensus import consensus_logs


class YetoDiLoCo(TrainerCallback):
    """Keyword arguments are `LearnerSettings` fields; they win over `YETO_DILOCO_*`."""

    def __init__(self, **settings: Any) -> None:
        self.settings: LearnerSettings = load_settings(LearnerSettings, **settings)
        self.settings.read_key()  # a missing or short key fails building the Trainer, not its first step
        self.island: IslandSession | None = None
        self._tokens_seen = 0

    @property
    def final_installed(self) -> bool:
        return self.island is not None and self.island.final

    @property
    def session(self) -> LearnerSession | None:
        """The learner session (on rank 0 of a multi-process island only)."""
        return self.island.session if self.island is not None else None

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: torch.nn.Module | None = None, **kwargs: Any) -> None:
        if model is None:
            raise ValueError("YetoDiLoCo needs the model; the Trainer passes it to callbacks")
        if args.include_num_input_tokens_seen != "non_padding":
            # The syncer weights islands by trained tokens; padding is not training. The Trainer
            # sums the count over an island's processes, so every rank sees the island's total.
            args.include_num_input_tokens_seen = "non_padding"
        self._tokens_seen = int(state.num_input_tokens_seen)
        on_final = "training stops and the Trainer saves it" if args.save_strategy != "no" else "training stops"
        # DDP, FSDP2 or ZeRO (world_size > 1): the island is every process of the Trainer
        self.island = build_island(self.settings, model, collective=args.world_size > 1, on_final=on_final)
        if self.settings.share_momentum:
            with settings_exit():  # one line naming the setting, exit 2
                self._share_momentum(kwargs.get("optimizer"))
        with island_exit():  # a link too slow to join ends the process with code 75 and one line
            self.island.start(first_step=state.global_step)

    def _share_momentum(self, optimizer: Any) -> None:
        """Hand the Trainer's optimizer to the island, on every rank (DESIGN §3.9). The Trainer
        builds it before `on_train_begin` (`Trainer._prepare_for_training` updates the callback
        handler's references)."""
        if optimizer is None:
            raise MomentError("YETO_DILOCO_SHARE_MOMENTUM: the Trainer passed no optimizer to the callback")
        assert self.island is not None
        self.island.share_momentum(optimizer)  # every rank: an island of several reads it together

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> TrainerControl:
        if self.island is None:
            return control
        seen = int(state.num_input_tokens_seen)
        tokens, self._tokens_seen = seen - self._tokens_seen, seen
        if self.island.step(tokens, last=0 < state.max_steps <= state.global_step):
            # Stop at this step, and have the Trainer log, save and evaluate the final model here.
            control.should_training_stop = True
            control.should_log = True
            control.should_save = control.should_save or args.save_strategy != "no"
            control.should_evaluate = control.should_evaluate or args.eval_strategy != "no"
        return control

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if self.island is None:
            return
        try:
            self.island.finish()  # idempotent: waits only when training stopped early for a reason of its own
        finally:
            self.island.close()

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if self.island is not None and logs is not None:
            stats = self.island.stats
            figures: dict[str, Any] = {"yeto_pushes": stats.pushes, "yeto_installs": stats.installs,
                                       "yeto_seconds": round(stats.in_yeto_s, 3)}  # this rank's training thread
            if stats.learner is not None:  # DESIGN §8: the syncer's latest consensus figures (rank 0)
                figures.update(consensus_logs(stats.learner))
                if self.settings.share_momentum:  # DESIGN §3.9
                    figures["yeto_moments_shared"] = stats.learner.moments_shared
            if self.final_installed:
                figures["yeto_final_cut"] = 1
            logs.update(figures)
            # The Trainer appended a copy of `logs` to its history before calling us: the figures
            # reach `trainer_state.json` only through that entry.
            history = state.log_history
            if history and history[-1].get("step") == state.global_step:
                history[-1].update(figures)
