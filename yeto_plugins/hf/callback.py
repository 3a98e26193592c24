"""`YetoDiLoCo`: the HF Trainer callback that makes a Trainer run one DiLoCo island (SPEC §5.1).

    trainer.add_callback(YetoDiLoCo())                  # settings from YETO_DILOCO_*
    trainer.add_callback(YetoDiLoCo(syncer="10.0.0.5:7070", key_file="key", learner_id=1))

One DiLoCo boundary check per optimizer step, from `on_step_end` (it fires after the optimizer
step, the scheduler step and zero_grad). The callback reports the true number of trained tokens
(the Trainer's non-padding count: the attention mask's sum) and stops training at the step that
installed the syncer's final cut. When the Trainer reaches `max_steps` first, `on_train_end`
asks the syncer for the final cut and installs it before the script saves the model.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from yeto_core.learner import LearnerSession
from yeto_core.settings import LearnerSettings, load_settings

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
        self.session: LearnerSession | None = None
        self.final_installed = False
        self._tokens_seen = 0

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: torch.nn.Module | None = None, **kwargs: Any) -> None:
        if model is None:
            raise ValueError("YetoDiLoCo needs the model; the Trainer passes it to callbacks")
        if args.world_size > 1:
            raise ValueError(f"YetoDiLoCo runs single-process islands; this Trainer has world_size={args.world_size}")
        if args.include_num_input_tokens_seen != "non_padding":
            # The syncer weights islands by trained tokens; padding is not training.
            args.include_num_input_tokens_seen = "non_padding"
        named = synced_parameters(model, self.settings.tuning)
        self.session = LearnerSession(self.settings, named, embedding_names=embedding_names(model))
        self.session.start()
        self._tokens_seen = int(state.num_input_tokens_seen)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> TrainerControl:
        if self.session is None:
            return control
        seen = int(state.num_input_tokens_seen)
        tokens, self._tokens_seen = seen - self._tokens_seen, seen
        if self.session.step(tokens):
            self.final_installed = True
            control.should_training_stop = True
        return control

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if self.session is None:
            return
        try:
            self.final_installed = self.session.finish()
        finally:
            self.session.close()

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if self.session is not None and logs is not None:
            s = self.session.stats
            logs["yeto_pushes"] = s.pushes
            logs["yeto_installs"] = s.installs
