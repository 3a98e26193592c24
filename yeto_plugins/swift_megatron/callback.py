"""`YetoMegatronCallback`: the ms-swift Megatron callback that makes `megatron sft` one DiLoCo island (DESIGN §1.5).

    megatron sft ... --callbacks yeto_diloco \
        --external_plugins <yeto>/yeto_plugins/swift_megatron/plugin/swift_plugin.py

swift builds every callback as `cls(trainer)` once the model, the optimizer and a resumed
checkpoint exist, and calls events with no arguments except `on_log(logs)` and
`on_save(output_dir)`. Settings come only from `YETO_DILOCO_*`: swift refuses unknown flags.

One `sync.step(tokens)` per optimizer step, from `on_step_end`. swift runs the user's callbacks
before the `print` and `default_flow` it appends itself, and `default_flow.on_step_end` decides
whether this step saves, so whatever yeto installs here is what swift saves.

Tokens per step = samples the optimizer trained × `args.seq_length`. The samples are the step's
increase of Megatron's LR scheduler counter, which swift advances by `global_batch_size` only
when the update succeeded, so a skipped step (fp16 overflow, NaN gradients) counts zero. Without
that scheduler every step counts `global_batch_size`. `seq_length` (`packing_length` or
`max_length`) is an upper bound per sample: with padding-free batches and no packing a sample
holds fewer tokens. Islands with the same data settings are weighted alike all the same.

Stopping: swift trains `while state.iteration < args.train_iters`, so the step that installs the
syncer's final cut sets `args.train_iters = state.iteration`; `default_flow` then marks that step
for saving. When the trainer reaches `train_iters` first, the final cut is fetched at that last
step, also before swift's save: swift saves nothing after `on_train_end`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from yeto_core.settings import LearnerSettings, load_settings

# MegatronCallback's events (swift/megatron/callbacks/base.py); the auto-attach wrapper forwards each.
EVENTS = ("on_train_begin", "on_train_end", "on_step_begin", "on_step_end", "on_log",
          "on_eval_begin", "on_eval_end", "on_eval_step", "on_save")


class SyncCore(Protocol):
    """What the callback needs of `MegatronDiLoCoSync` (every method is collective)."""

    @property
    def stats(self) -> Any: ...

    @property
    def final(self) -> bool: ...

    def start(self) -> None: ...
    def step(self, tokens: int, *, last: bool = False) -> bool: ...
    def finish(self) -> bool: ...
    def close(self) -> None: ...


SyncFactory = Callable[[Any, Any, LearnerSettings], SyncCore]


def megatron_sync(model: Any, optimizer: Any, settings: LearnerSettings) -> SyncCore:
    # Imported here: the sync core pulls in torch.distributed and megatron.core, which swift
    # loads anyway, but which importing the plugin file must not require.
    from yeto_plugins.megatron.sync import MegatronDiLoCoSync

    sync: SyncCore = MegatronDiLoCoSync(model, optimizer, settings)
    return sync


def scheduler_samples(trainer: Any) -> int | None:
    """Samples the optimizer has stepped on so far (Megatron's `OptimizerParamScheduler.num_steps`)."""
    num_steps = getattr(getattr(trainer, "opt_param_scheduler", None), "num_steps", None)
    return None if num_steps is None else int(num_steps)


def sequence_length(args: Any) -> int:
    """Tokens per sample swift trains with: `seq_length` (= `packing_length or max_length`)."""
    n = getattr(args, "seq_length", None) or getattr(args, "max_length", None)
    if not isinstance(n, int) or n <= 0:
        raise ValueError(f"yeto_diloco needs the trainer's args.seq_length (or max_length) to count tokens, got {n!r}")
    return n


class YetoMegatronCallback:
    """Duck-typed `MegatronCallback`; `register()` mixes in swift's own base class when swift is there.

    swift passes only the trainer. `settings` (instead of `YETO_DILOCO_*`) and `sync_factory`
    (instead of `megatron_sync`, the real `MegatronDiLoCoSync`) serve tests and embedding.
    """

    def __init__(self, trainer: Any, *, settings: LearnerSettings | None = None,
                 sync_factory: SyncFactory | None = None) -> None:
        # What MegatronCallback.__init__ sets; not super().__init__, which is object's without swift.
        self.trainer = trainer
        self.args = trainer.args
        self.state = trainer.state
        self.sync: SyncCore | None = None
        self._settings = settings
        self._sync_factory = sync_factory
        self._seq_length = 0
        self._samples_seen: int | None = None

    @property
    def final_installed(self) -> bool:
        return self.sync is not None and self.sync.final

    def on_train_begin(self) -> None:
        # Settings are read here, not in __init__, so a bad value stops the run at the start of
        # training with one line naming the variable, on every rank alike.
        settings = self._settings if self._settings is not None else load_settings(LearnerSettings)
        self._seq_length = sequence_length(self.args)
        self._samples_seen = scheduler_samples(self.trainer)
        factory = self._sync_factory or megatron_sync
        self.sync = factory(self.trainer.wrapped_models, self.trainer.optimizer, settings)
        self.sync.start()

    def on_step_end(self) -> None:
        if self.sync is None:
            return
        last = self.state.iteration >= self.args.train_iters
        if self.sync.step(self._step_samples() * self._seq_length, last=last):
            self.args.train_iters = self.state.iteration  # swift's loop ends here, and default_flow saves

    def on_train_end(self) -> None:
        if self.sync is None:
            return
        try:
            self.sync.finish()  # idempotent: waits only when training ended before its last step
        finally:
            self.sync.close()

    def on_log(self, logs: dict[str, Any]) -> None:
        if self.sync is not None:
            s = self.sync.stats
            logs["yeto_pushes"] = s.pushes
            logs["yeto_installs"] = s.installs
            logs["yeto_seconds"] = round(s.in_yeto_s, 3)  # this rank's training thread inside yeto

    def on_step_begin(self) -> None:
        pass

    def on_eval_begin(self) -> None:
        pass

    def on_eval_end(self) -> None:
        pass

    def on_eval_step(self) -> None:
        pass

    def on_save(self, output_dir: str | None = None) -> None:
        pass

    def _step_samples(self) -> int:
        seen = scheduler_samples(self.trainer)
        if seen is None or self._samples_seen is None:
            return int(self.args.global_batch_size)
        samples, self._samples_seen = seen - self._samples_seen, seen
        return max(samples, 0)
