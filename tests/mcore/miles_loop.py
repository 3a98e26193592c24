"""Miles' actor loop, reproduced around a real megatron-core island, for the Miles plugin's tests.

Miles cannot be installed here (it pins its own transformers, SGLang, Ray and Megatron-LM fork),
so these are its steps, in its order, from radixark/miles at 31f1ca9:

* `load_function`: ``miles/utils/misc.py:45-66`` (a dotted path, split at the last dot);
* `TensorBackuper`: ``_TensorBackuperNormal`` of ``miles/utils/tensor_backper.py:53-85`` — per tag,
  a CPU copy of every named local parameter (``backup``), copied back by ``restore``, read by ``get``;
  the source is the rank's own parameters (``named_params_and_buffers``, ``update_weight/common.py:289``);
* `MilesActor.train`: ``MegatronTrainRayActor.train_actor`` (``actor.py:464-619``): the backup
  restored into the parameters (``_switch_model``, ``:522``, ``:348-354``), the rollout's optimizer
  steps, then ``backup("actor")`` (``:595-596``); the backup is kept when Miles colocates, keeps a
  reference model or the old actor (``_enable_weight_backup``, ``:343-346``);
* `MilesActor.train_one_step`: ``model.py:405-628`` — grads zeroed (``:455``), the before-train-step
  hook called with Miles' positional signature (``:457-461``), forward/backward and
  ``optimizer.step()`` (``:560-624``, success asserted ``:627``), the scheduler stepped by the global
  batch (``:628``);
* `MilesActor.update_weights`: the colocated ``UpdateWeightFromTensor`` (``update_weight_from_tensor.py:263``)
  sends what the ``"actor"`` backup holds, not the live model; the "engine" here keeps a copy of it;
* `run_driver`: ``train.py:95-132`` per rollout from ``args.start_rollout_id`` (a resumed run's,
  else 0): generate (the island's deterministic batches stand in for rollout data), ``train``, then
  ``update_weights``; a `between` callable runs where ``python -m yeto_plugins.miles.train`` puts
  the sweep, at the end of ``RayTrainGroup.train``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import torch


def load_function(path: str) -> Callable[..., Any]:
    module_path, _, attr = path.rpartition(".")
    return getattr(importlib.import_module(module_path), attr)


def miles_args(num_rollout: int, steps_per_rollout: int, island: Any, hook: str, **extra: Any) -> SimpleNamespace:
    """The `args` fields Miles and the hook read, named as in ``miles/utils/arguments.py``."""
    global_batch = island.dp_size * island.spec.micro_batches * island.spec.micro_batch
    return SimpleNamespace(num_rollout=num_rollout, start_rollout_id=None, rollout_batch_size=global_batch,
                           n_samples_per_prompt=steps_per_rollout, global_batch_size=global_batch,
                           num_steps_per_rollout=None, seq_length=island.spec.seq, colocate=True, kl_coef=0.0,
                           use_kl_loss=False, keep_old_actor=False,
                           custom_megatron_before_train_step_hook_path=hook, **extra)


def named_params(model: list[Any]) -> Iterator[tuple[str, torch.Tensor]]:
    for index, chunk in enumerate(model):
        for name, param in chunk.named_parameters():
            yield f"{index}.{name}", param


class TensorBackuper:
    def __init__(self, source_getter: Callable[[], Iterator[tuple[str, torch.Tensor]]]) -> None:
        self._source_getter = source_getter
        self._backups: dict[str, dict[str, torch.Tensor]] = {}

    def backup(self, tag: str) -> None:
        store = self._backups.setdefault(tag, {})
        for name, param in self._source_getter():
            if name not in store:
                store[name] = torch.empty_like(param, device="cpu")
            store[name].copy_(param.detach())

    def restore(self, tag: str) -> None:
        held = self._backups[tag]
        with torch.no_grad():
            for name, param in self._source_getter():
                param.copy_(held[name])

    def get(self, tag: str) -> dict[str, torch.Tensor]:
        return self._backups[tag]


class MilesActor:
    def __init__(self, args: SimpleNamespace, island: Any) -> None:
        self.args, self.island = args, island
        self.model, self.optimizer = island.model_chunks, island.optimizer
        self.opt_param_scheduler = SimpleNamespace(num_steps=0)
        self.weights_backuper = TensorBackuper(lambda: named_params(self.model))
        if self.enable_weight_backup:
            self.weights_backuper.backup("actor")  # actor.py:233-234
        self.engine: dict[str, torch.Tensor] = {}
        self.losses: list[float] = []

    @property
    def enable_weight_backup(self) -> bool:
        return bool(self.args.kl_coef != 0 or self.args.use_kl_loss or self.args.keep_old_actor or self.args.colocate)

    def train(self, rollout_id: int, steps: int) -> None:
        if self.enable_weight_backup:
            self.weights_backuper.restore("actor")  # _switch_model("actor"), actor.py:522
        for step_id in range(steps):
            self.train_one_step(rollout_id, step_id)
        if self.enable_weight_backup:
            self.weights_backuper.backup("actor")  # actor.py:595-596

    def train_one_step(self, rollout_id: int, step_id: int) -> None:
        for chunk in self.model:  # _zero_grads, model.py:398-402 / :455
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        hook = load_function(self.args.custom_megatron_before_train_step_hook_path)
        hook(self.args, rollout_id, step_id, self.model, self.optimizer, self.opt_param_scheduler)
        loss = self.island.train_step()  # forward/backward + self.optimizer.step() (zeroes again: a no-op)
        assert self.island.last_step_info["update_successful"]  # model.py:627
        self.opt_param_scheduler.num_steps += self.args.global_batch_size  # model.py:628
        if loss is not None:
            self.losses.append(loss)

    def update_weights(self) -> None:
        source = self.weights_backuper.get("actor") if self.enable_weight_backup else dict(named_params(self.model))
        self.engine = {name: tensor.detach().clone() for name, tensor in source.items()}


def run_driver(actor: MilesActor, steps_per_rollout: int,
               between: Callable[[int], None] = lambda rollout_id: None,
               after: Callable[[int], None] = lambda rollout_id: None) -> None:
    actor.update_weights()  # train.py:52, before the loop
    for rollout_id in range(actor.args.start_rollout_id or 0, actor.args.num_rollout):
        actor.train(rollout_id, steps_per_rollout)
        between(rollout_id)
        actor.update_weights()
        after(rollout_id)
