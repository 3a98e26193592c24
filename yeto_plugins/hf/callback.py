"""`YetoDiLoCo`: the HF Trainer callback that makes a Trainer run one DiLoCo island (SPEC §5.1).

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

Under torchrun (DDP, or FSDP2 with DTensor parameters) the island is all of its processes: rank 0
talks to the syncer and every rank takes part in its reads and writes (`island.py`), so every
rank stops at the same step holding the same merged weights.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from yeto_core.learner import LearnerSession
from yeto_core.settings import LearnerSettings, load_settings
from yeto_plugins.hf.consensus import consensus_logs, logit_probe
from yeto_plugins.hf.island import ProcessGroupStore

log = logging.getLogger("yeto.hf")


def embedding_names(model: torch.nn.Module) -> set[str]:
    """Names of the input embedding's parameters (a tied LM head shares the same tensor)."""
    getter = getattr(model, "get_input_embeddings", None)
    emb = getter() if callable(getter) else None
    if emb is None:
        return set()
    ids = {id(p) for p in emb.parameters()}
    return {name for name, p in model.named_parameters() if id(p) in ids}


def synced_parameters(model: torch.nn.Module, tuning: str) -> list[tuple[str, torch.Tensor]]:
    """The tensors an island syncs. Frozen tensors and buffers never cross the wire; with LoRA
    (`tuning="lora"`, or `"auto"` on a model with adapters) only the adapter tensors do, and other
    trainable tensors (e.g. PEFT's `modules_to_save`) stay local to each island."""
    trainable: list[tuple[str, torch.Tensor]] = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    adapters = [(name, p) for name, p in trainable if "lora_" in name]
    if tuning == "lora" and not adapters:
        raise ValueError("YETO_DILOCO_TUNING=lora, but the model has no trainable LoRA adapter tensors "
                         "(names with 'lora_'); use tuning='full' or wrap the model with PEFT first")
    if tuning == "lora" or (tuning == "auto" and adapters):
        local = [name for name, _ in trainable if "lora_" not in name]
        if local:
            log.warning("LoRA tuning: %d trainable tensor(s) that are not adapters stay local to this island "
                        "(e.g. %s); use tuning='full' to sync them too", len(local), local[0])
        return adapters
    return trainable


class YetoDiLoCo(TrainerCallback):
    """Keyword arguments are `LearnerSettings` fields; they win over `YETO_DILOCO_*`."""

    def __init__(self, **settings: Any) -> None:
        self.settings: LearnerSettings = load_settings(LearnerSettings, **settings)
        self.settings.read_key()  # a missing or short key fails building the Trainer, not its first step
        self.session: LearnerSession | None = None  # on rank 0 of a multi-process island only
        self.store: ProcessGroupStore | None = None  # a multi-process (DDP, FSDP2) island
        self.final_installed = False
        self._finish_asked = False  # finish() ran at the last step: on_train_end must not wait twice
        self.pushes = self.installs = 0  # rank 0's counts, known on every rank
        self._tokens_seen = 0

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: torch.nn.Module | None = None, **kwargs: Any) -> None:
        if model is None:
            raise ValueError("YetoDiLoCo needs the model; the Trainer passes it to callbacks")
        if args.include_num_input_tokens_seen != "non_padding":
            # The syncer weights islands by trained tokens; padding is not training. The Trainer
            # sums the count over an island's processes, so every rank sees the island's total.
            args.include_num_input_tokens_seen = "non_padding"
        named = synced_parameters(model, self.settings.tuning)
        self._tokens_seen = int(state.num_input_tokens_seen)
        probe = logit_probe(model, self.settings.consensus_tokens) if self.settings.consensus_every else None
        if args.world_size > 1:  # DDP or FSDP2: rank 0 talks to the syncer, the others follow
            s = self.settings
            self.store = ProcessGroupStore(named, embedding_names(model), timeout_s=s.collective_timeout_s,
                                           heartbeat_s=min(5.0, s.collective_timeout_s / 4))
            probe = self.store.island_probe(probe) if probe is not None else None
            if self.store.rank == 0:
                self.session = LearnerSession(s, store=self.store, probe=probe)
            self._together(lambda session: session.start())
            return
        self.session = LearnerSession(self.settings, named, embedding_names=embedding_names(model), probe=probe)
        self.session.start()

    def _together(self, call: Callable[[LearnerSession], bool | None]) -> bool:
        """Run a session call; in a multi-process island rank 0 runs it and every rank follows
        its reads and writes, and every rank returns its answer."""
        if self.store is None:
            return bool(self.session is not None and call(self.session))

        def encode(answer: bool | None) -> tuple[int, int, int]:
            assert self.session is not None
            return int(bool(answer)), self.session.stats.pushes, self.session.stats.installs

        session = self.session
        answer, self.pushes, self.installs = self.store.run(
            (lambda: call(session)) if session is not None else None, encode)
        return bool(answer)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> TrainerControl:
        if self.session is None and self.store is None:
            return control
        seen = int(state.num_input_tokens_seen)
        tokens, self._tokens_seen = seen - self._tokens_seen, seen
        if self._together(lambda session: session.step(tokens)):
            self._final_cut(args, state, control, "")
        elif 0 < state.max_steps <= state.global_step:
            self._finish_asked = True
            if self._together(lambda session: session.finish()):
                self._final_cut(args, state, control, f" (max_steps {state.max_steps} reached first)")
        return control

    def _final_cut(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, why: str) -> None:
        """Stop at this step, and have the Trainer log, save and evaluate the final model here."""
        self.final_installed = True
        control.should_training_stop = True
        control.should_log = True
        saves = args.save_strategy != "no"
        control.should_save = control.should_save or saves
        control.should_evaluate = control.should_evaluate or args.eval_strategy != "no"
        log.warning("yeto learner %d: final cut installed at step %d%s; training stops%s", self.settings.learner_id,
                    state.global_step, why, " and the Trainer saves it" if saves else "")

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if self.session is None and self.store is None:
            return
        try:
            if not self._finish_asked:
                self.final_installed = self._together(lambda session: session.finish())
        finally:
            if self.session is not None:
                self.session.close()
            if self.store is not None:
                self.store.close()

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if (self.session is not None or self.store is not None) and logs is not None:
            figures: dict[str, Any] = {
                "yeto_pushes": self.session.stats.pushes if self.session is not None else self.pushes,
                "yeto_installs": self.session.stats.installs if self.session is not None else self.installs,
            }
            if self.session is not None:  # SPEC §2.7: the syncer's latest consensus figures
                figures.update(consensus_logs(self.session.stats))
            if self.final_installed:
                figures["yeto_final_cut"] = 1
            logs.update(figures)
            # The Trainer appended a copy of `logs` to its history before calling us: the figures
            # reach `trainer_state.json` only through that entry.
            history = state.log_history
            if history and history[-1].get("step") == state.global_step:
                history[-1].update(figures)
