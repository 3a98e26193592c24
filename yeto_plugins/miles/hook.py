"""The Megatron side of a Miles island: Miles' before-train-step hook, and the sweep an actor runs.

Miles (radixark/miles at 31f1ca9) calls the function named by
``--custom-megatron-before-train-step-hook-path`` in every training rank as
``fn(args, rollout_id, step_id, model, optimizer, opt_param_scheduler)``, after zeroing the grads
and before the forward pass (``miles/backends/megatron_utils/model.py:455-461``), then runs the
forward/backward, ``optimizer.step()`` (``:624``, its success asserted at ``:627``) and
``opt_param_scheduler.step`` (``:628``). ``step_id`` counts from 0 within each rollout (``:776``).
There is no after-step hook, so the first call wraps ``optimizer.step`` on this rank: every
successful step is accounted right after it happened, the run's last one included, and a final cut
installed there is in the weights before Miles backs them up (``actor.py:595-596``).

The trap this module guards against: Miles' rollout and next training pass read a CPU backup of
the actor's weights (``TensorBackuper``, ``miles/utils/tensor_backper.py``), not the live model:
``train_actor`` restores it into the parameters before training (``actor.py:522``) and the
colocated updater sends it to the engine (``update_weight_from_tensor.py:263``). Installs inside
the training steps land before Miles' own ``backup("actor")`` (``actor.py:596``); an install after
it (a sweep after ``train``, before ``update_weights``) must refresh the backup, or the rollout gets
the pre-merge policy and the next training pass silently reverts the merge (`MilesIsland.sweep`).

Tokens: Miles counts samples, not tokens, per step (``args.global_batch_size``, or
``rollout_batch_size * n_samples_per_prompt // num_steps_per_rollout``); a step is accounted as
that many samples × ``args.seq_length``, an upper bound in the same unit on every Miles island.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from yeto_core.settings import LearnerSettings, SettingsError, load_settings
from yeto_plugins.megatron.sync import MegatronDiLoCoSync

log = logging.getLogger("yeto.miles")

_ISLAND: MilesIsland | None = None  # one per training process (a Miles actor rank)


def before_train_step(args: Any, rollout_id: int, step_id: int, model: Sequence[Any], optimizer: Any,
                      opt_param_scheduler: Any) -> None:
    """Miles' hook (signature of ``model.py:461``). The first call joins the island on every rank."""
    global _ISLAND
    if _ISLAND is None:
        _ISLAND = MilesIsland(args, model, optimizer)
    _ISLAND.at_step(rollout_id, step_id)


def current() -> MilesIsland:
    """The island this process joined through the hook (a sweep runs after the first training step)."""
    if _ISLAND is None:
        raise RuntimeError("yeto: no Miles island in this process: set --custom-megatron-before-train-step-hook-path "
                           "yeto_plugins.miles.hook.before_train_step")
    return _ISLAND


def steps_per_rollout(args: Any) -> int:
    """Optimizer steps per rollout, as Miles derives them (``data.py:464-466``, ``arguments.py:3431-3439``)."""
    if getattr(args, "num_steps_per_rollout", None):
        return int(args.num_steps_per_rollout)
    return max(1, int(args.rollout_batch_size) * int(args.n_samples_per_prompt) // int(args.global_batch_size))


def tokens_per_step(args: Any) -> int:
    return int(args.global_batch_size) * int(args.seq_length)


# Miles options an island cannot account for yet: each stops it at its join, named, instead of
# letting it weigh its pushes or find the run's last step wrongly.
UNACCOUNTED = {
    "use_dynamic_global_batch_size": (
        "--use-dynamic-global-batch-size varies the samples of each step and the steps of each rollout, which "
        "the island counts from --global-batch-size x --seq-length (its tokens per step, which weigh its pushes) "
        "and --rollout-batch-size x --n-samples-per-prompt / --global-batch-size (its steps per rollout)"),
    # multi-LoRA (miles/utils/args/configs/lora.py in later Miles): several adapters train in one actor, and an
    # island is one model: whose deltas it would push, and into which adapter a merge goes, is undefined.
    "multi_lora_n_adapters": (
        "--multi-lora-n-adapters trains several LoRA adapters in one actor, and an island syncs one model: "
        "run one adapter per island (a single LoRA, --lora-rank, syncs its trainable adapter weights)"),
}


def refuse_unaccounted(args: Any) -> None:
    """Raise `SettingsError` naming the first Miles option in `UNACCOUNTED` that `args` turns on."""
    for attr, why in UNACCOUNTED.items():
        if getattr(args, attr, False):
            raise SettingsError(f"yeto: Miles' {why}; run the island without it")


class MilesIsland:
    """The island's `MegatronDiLoCoSync` on this rank, driven at Miles' step and rollout boundaries."""

    def __init__(self, args: Any, model: Sequence[Any], optimizer: Any,
                 settings: LearnerSettings | None = None) -> None:
        refuse_unaccounted(args)
        self.args = args
        try:
            self.settings = settings if settings is not None else load_settings(LearnerSettings)
        except SettingsError as exc:  # the hook is named, so this actor is meant to be an island: never alone
            raise SettingsError(f"{exc} (a Miles training actor sees only the variables of --train-env-vars: put "
                                "the YETO_DILOCO_* settings there)") from None
        self.sync = MegatronDiLoCoSync(list(model), optimizer, self.settings,
                                       on_final="later steps leave the weights as they are")
        self.at: tuple[int, int] = (0, 0)  # (rollout_id, step_id) of the step under way
        self.sync.start()
        self._real_step = optimizer.step
        optimizer.step = self._step  # Miles has no after-step hook: the step itself reports back

    # -- Miles' calls ----------------------------------------------------------------------------
    def at_step(self, rollout_id: int, step_id: int) -> None:
        self.at = (rollout_id, step_id)

    @property
    def final(self) -> bool:
        """The final cut is installed: later steps leave the weights as they are."""
        return self.sync.final

    def _step(self, *args: Any, **kwargs: Any) -> Any:
        if self.sync.final:  # Miles asserts success (model.py:627); the weights stay the final cut
            return True, 0.0, 0
        outcome = self._real_step(*args, **kwargs)
        if outcome[0]:  # streaming: the run's last step waits for the final cut; the backup after it holds it
            self.sync.step(tokens_per_step(self.args), last=not self.sync.settings.sweeps and self.last_step_of_run())
        return outcome

    def sweep(self, rollout_id: int, backuper: Any | None) -> bool:
        """Every fragment swept (rl_mode sweep|overlap) right after `rollout_id`'s training, the final cut
        asked for after the run's last rollout, then the backup refreshed (`backuper`, when Miles
        keeps one) so that the rollout and the next training pass see what was installed. Every
        rank calls it. True once the final cut is installed."""
        self.sync.end_iteration(last=rollout_id >= int(self.args.num_rollout) - 1)
        if backuper is not None:
            backuper.backup("actor")
        return self.sync.final

    def last_step_of_run(self) -> bool:
        rollout_id, step_id = self.at
        return rollout_id >= int(self.args.num_rollout) - 1 and step_id >= steps_per_rollout(self.args) - 1

    def close(self) -> None:
        self.sync.close()
