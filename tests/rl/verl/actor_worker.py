"""One rank of verl's real ``ActorRolloutRefWorker`` on CPU: K PPO actor updates, each followed by a weight sync.

Run under torchrun, one process per rank::

    python -m torch.distributed.run --standalone --nproc_per_node N tests/rl/verl/actor_worker.py \\
        --model DIR --iterations K --out DIR [--seed S] [--override KEY=VALUE ...]

with ``VERL_PLATFORM=cpu`` (selects the platform ``cpu_platform`` registers) and ``VERL_ENGINE_DEVICE=cuda``
in the environment. Every rank writes ``rank{R}.json`` into ``--out``: per iteration, the update's metrics, the
SHA-256 of every tensor the rollout received and of every full actor parameter. Rank 0 also writes the final
``rollout_weights.safetensors`` and ``actor_params.safetensors``.

What is verl's and what is the harness's: the worker, the FSDP2 engine, the optimizer, the PPO loss, the batch
conversion (``left_right_2_no_padding``), the per-rank split (``BatchData.chunk``) and the weight sync are
verl's own code; the harness supplies the process group, the config overrides a CPU needs, the synthetic
batch the driver would have built from a rollout, and the rollout that records what it is sent.

The pieces are importable (``compose_config``, ``build_worker``, ``synthetic_batch``, ``run_iteration``) so a
test can drive a subclass of the worker, for example one whose ``actor_worker_cls`` is a ``TrainingWorker``
subclass. Import this module only with ``tests/rl/verl`` on ``sys.path``: the two registrations below must run
before any verl module resolves its platform.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cpu_platform  # first: registers the "cpu" platform before verl resolves one (see its docstring)
import cpu_rollout  # registers the ("cpu_test", "async") rollout that ActorRolloutRefWorker.init_model builds
import torch
import torch.distributed as dist
import verl
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, open_dict
from safetensors.torch import save_file
from tensordict import TensorDict
from tiny_model import EOS_TOKEN_ID, PAD_TOKEN_ID, SPECIAL_TOKENS, VOCAB_SIZE
from torch.distributed.tensor import DTensor
from verl import DataProto
from verl.protocol import BatchData
from verl.utils import tensordict_utils as tu
from verl.utils.metric import reduce_metrics
from verl.utils.model import compute_position_id_with_mask
from verl.workers.engine_workers import ActorRolloutRefWorker
from verl.workers.utils.padding import left_right_2_no_padding

if TYPE_CHECKING:  # importing it resolves verl's platform (transformer_impl.py:89): types only
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

VERL_CONFIG_DIR = Path(verl.__file__).parent / "trainer" / "config"
# The sequences per micro-batch on each rank: with the default batch a single rank accumulates gradients over
# two micro-batches, two ranks take one each.
MICRO_BATCH_SIZE_PER_RANK = 2
# Large enough that one AdamW step visibly moves every weight of a randomly initialised model.
LEARNING_RATE = 1e-3


@dataclass(frozen=True)
class BatchShape:
    """The global batch of one PPO iteration, the size of one mini-batch, so each iteration is one optimizer step."""

    sequences: int = 4
    prompt_length: int = 6
    response_length: int = 5


DEFAULT_SHAPE = BatchShape()


def compose_config(
    model_dir: str | Path,
    iterations: int,
    world_size: int,
    shape: BatchShape = DEFAULT_SHAPE,
    overrides: Sequence[str] = (),
) -> DictConfig:
    """verl's own ``ppo_trainer`` config with what a CPU run needs; ``overrides`` (hydra syntax) come last.

    FSDP1 does not run on CPU (verl wraps with ``sync_module_states=True``, transformer_impl.py:444, which torch
    refuses for CPU modules), so the actor uses FSDP2, and fp32 throughout: no bf16 autocast on CPU
    (transformer_impl.py:1559-1565). Attention is eager, as flash attention needs CUDA. verl's default packed
    input (``use_remove_padding``) stays: it passes no attention mask, only position ids that restart per
    sequence (transformer_impl.py:1182-1273), from which transformers builds a block-diagonal causal mask
    (transformers/masking_utils.py:881-888), so eager attention keeps the sequences apart.
    """
    ref = "actor_rollout_ref"
    cpu_overrides = [
        f"{ref}.model.path='{model_dir}'",
        f"+{ref}.model.override_config.attn_implementation=eager",
        f"{ref}.actor.strategy=fsdp2",
        # Nothing to gain from inductor on CPU, and it needs a C compiler at run time.
        f"{ref}.actor.use_torch_compile=False",
        f"{ref}.actor.fsdp_config.use_torch_compile=False",
        # fp32 weights and fp32 compute, reduction and buffers: the default param_dtype is bf16.
        f"{ref}.actor.fsdp_config.model_dtype=fp32",
        f"+{ref}.actor.fsdp_config.mixed_precision={{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}}",
        f"{ref}.actor.ppo_mini_batch_size={shape.sequences}",
        f"{ref}.actor.ppo_micro_batch_size_per_gpu={MICRO_BATCH_SIZE_PER_RANK}",
        f"{ref}.actor.optim.lr={LEARNING_RATE}",
        # A constant LR without warm-up: equal steps, whatever total_training_steps says.
        f"{ref}.actor.optim.lr_scheduler_type=constant",
        f"{ref}.actor.optim.lr_warmup_steps=0",
        f"{ref}.rollout.name={cpu_rollout.ROLLOUT_NAME}",
        f"{ref}.rollout.mode={cpu_rollout.ROLLOUT_MODE}",
        f"{ref}.rollout.tensor_model_parallel_size=1",
        # The recording rollout holds no memory to free or resume.
        f"{ref}.rollout.free_cache_engine=False",
        f"{ref}.rollout.log_prob_micro_batch_size_per_gpu={MICRO_BATCH_SIZE_PER_RANK}",
        f"{ref}.rollout.prompt_length={shape.prompt_length}",
        f"{ref}.rollout.response_length={shape.response_length}",
        f"trainer.n_gpus_per_node={world_size}",
        "trainer.device=cpu",
    ]
    with initialize_config_dir(config_dir=str(VERL_CONFIG_DIR), version_base=None):
        config = compose(config_name="ppo_trainer", overrides=[*cpu_overrides, *overrides])
    # verl's driver derives the number of optimizer steps from the dataset and writes it into the optimizer
    # config before the workers are built (verl/trainer/ppo/v1/trainer_base.py:767-782,
    # verl/trainer/ppo/ray_trainer.py:435-447); here the run length is known up front.
    with open_dict(config):
        config.trainer.total_training_steps = iterations
        config.actor_rollout_ref.actor.optim.total_training_steps = iterations
    return config


def init_process_group() -> None:
    """gloo, from torchrun's environment, before the worker exists.

    Without a process group ``TrainingWorker`` creates one (verl/workers/engine_workers.py:89) with the backend
    ``"cpu:gloo,<device>:<backend>"`` (verl/utils/distributed.py:83-98), which on this platform reads
    ``"cpu:gloo,cpu:gloo"`` and which torch refuses (one backend per device type).
    """
    if not dist.is_initialized():
        dist.init_process_group(backend="gloo")


def build_worker(
    model_dir: str | Path,
    iterations: int,
    shape: BatchShape = DEFAULT_SHAPE,
    worker_cls: type[ActorRolloutRefWorker] = ActorRolloutRefWorker,
    overrides: Sequence[str] = (),
) -> ActorRolloutRefWorker:
    """The actor-and-rollout worker with its model, optimizer and rollout built, as the driver leaves it.

    ``worker_cls`` may be a subclass, e.g. one whose ``actor_worker_cls`` replaces ``TrainingWorker``
    (verl/workers/engine_workers.py:459, instantiated at :644). Methods decorated with ``@register`` call
    straight through when invoked in-process (verl/single_controller/base/decorator.py:424-442).
    """
    if not cpu_platform.platform_is_selected():
        raise RuntimeError("set VERL_PLATFORM=cpu: without it verl falls back to CUDA on this host")
    init_process_group()
    config = compose_config(model_dir, iterations, dist.get_world_size(), shape, overrides)
    worker = worker_cls(config.actor_rollout_ref, role="actor_rollout")
    worker.init_model()
    return worker


def synthetic_batch(
    iteration: int,
    seed: int = 0,
    dp_rank: int = 0,
    dp_size: int = 1,
    shape: BatchShape = DEFAULT_SHAPE,
    mini_batch_size: int | None = None,
) -> TensorDict:
    """This rank's share of a deterministic PPO batch, in the form ``update_actor`` receives from the driver.

    The global batch depends only on ``(seed, iteration)``, so every rank builds the same one and keeps the
    slice that verl's dispatch would send it (``BatchData.chunk``, verl/single_controller/base/decorator.py:71-88).
    The steps mirror ``RayPPOTrainer._update_actor`` (verl/trainer/ppo/ray_trainer.py:1327-1369): a left-padded
    prompt and right-padded response per sequence, converted to nested tensors by ``left_right_2_no_padding``.

    ``old_log_probs`` sit near ``-log(vocab)``, what a freshly initialised model assigns every token, so the
    PPO ratio starts near 1, inside the clip range, where the clipped objective still has a gradient.
    ``mini_batch_size`` (global, default the whole batch) below the batch size makes several optimizer steps.
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + iteration)
    n, p, r = shape.sequences, shape.prompt_length, shape.response_length
    first_word = len(SPECIAL_TOKENS)

    prompt_lengths = torch.randint(2, p + 1, (n,), generator=generator)
    response_lengths = torch.randint(1, r + 1, (n,), generator=generator)
    prompt_mask = (torch.arange(p) >= p - prompt_lengths[:, None]).long()  # left padding
    response_mask = (torch.arange(r) < response_lengths[:, None]).long()  # right padding
    prompts = torch.randint(first_word, VOCAB_SIZE, (n, p), generator=generator) * prompt_mask
    responses = torch.randint(first_word, VOCAB_SIZE, (n, r), generator=generator) * response_mask
    # End each response on EOS, as a finished generation would, and keep the padding at the pad id.
    responses[torch.arange(n), response_lengths - 1] = EOS_TOKEN_ID
    prompts[prompt_mask == 0] = PAD_TOKEN_ID
    responses[response_mask == 0] = PAD_TOKEN_ID

    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    uniform_log_prob = -math.log(VOCAB_SIZE)
    old_log_probs = (uniform_log_prob + 0.01 * torch.randn(n, r, generator=generator)) * response_mask
    advantages = torch.randn(n, r, generator=generator) * response_mask

    batch = DataProto.from_dict(
        tensors={
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": compute_position_id_with_mask(attention_mask),
            "response_mask": response_mask,
            "old_log_probs": old_log_probs.float(),
            "advantages": advantages.float(),
        },
        meta_info={"temperature": 1.0, "multi_turn": False},
    )
    batch_td = left_right_2_no_padding(batch.to_tensordict())
    mini_batch_size = n if mini_batch_size is None else mini_batch_size
    tu.assign_non_tensor(
        batch_td,
        calculate_entropy=False,
        distillation_use_topk=False,
        distillation_only=False,
        global_batch_size=mini_batch_size,
        mini_batch_size=mini_batch_size,
        epochs=1,
        seed=seed,
        dataloader_kwargs={"shuffle": False},
        compute_loss=True,
    )
    share = BatchData(batch_td).chunk(chunks=dp_size)[dp_rank]
    # The chunk comes back consolidated and locked, and train_mini_batch pops keys from what it receives
    # (engine_workers.py:254-259). Under Ray the share reaches the worker pickled, which unlocks it: do the same.
    return pickle.loads(pickle.dumps(share))


def run_iteration(worker: ActorRolloutRefWorker, batch: TensorDict) -> dict[str, float]:
    """One PPO update of the actor, then the colocated weight sync into the rollout; returns the metrics."""
    output = worker.update_actor(batch)
    metrics = reduce_metrics(tu.get(output, "metrics")) if output is not None else {}
    asyncio.run(worker.update_weights(mode="naive"))
    return {name: float(value) for name, value in metrics.items()}


def actor_engine(worker: ActorRolloutRefWorker) -> FSDPEngine:
    """The FSDP engine inside the worker's actor, once ``init_model`` has built it."""
    assert worker.actor is not None, "init_model() builds the actor"
    return worker.actor.engine  # type: ignore[return-value]  # typed as BaseEngine; strategy=fsdp2 makes it FSDP


def actor_full_params(worker: ActorRolloutRefWorker) -> dict[str, torch.Tensor]:
    """Every actor parameter, unsharded, read from the FSDP2 module itself.

    Deliberately not through ``engine.get_per_tensor_param()``, the sync's own source
    (verl/workers/engine/fsdp/transformer_impl.py:977-1061), so comparing with the rollout checks the sync
    against the model. ``full_tensor()`` is a collective: every rank must call this, in step.
    """
    state = actor_engine(worker).module.state_dict()
    return {
        name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().to("cpu", copy=True)
        for name, value in state.items()
    }


def global_token_count(batch: TensorDict) -> int:
    """Tokens (prompt and response) in the whole batch across ranks: what ``TrainingWorker.train_batch`` sees
    as ``sum(global_token_num)`` for a one-mini-batch iteration (verl/workers/engine_workers.py:293-301, 347)."""
    tokens = torch.tensor(int(batch["input_ids"].offsets()[-1]))
    dist.all_reduce(tokens)
    return int(tokens)


def recording_rollout(worker: ActorRolloutRefWorker) -> cpu_rollout.CpuTestRollout:
    rollout = worker.rollout
    assert isinstance(rollout, cpu_rollout.CpuTestRollout), f"unexpected rollout {type(rollout).__name__}"
    return rollout


def tensor_digest(tensor: torch.Tensor) -> str:
    """SHA-256 over dtype, shape and the raw bytes: equal digests mean bit-for-bit equal tensors."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    digest = hashlib.sha256(f"{flat.dtype}:{tuple(tensor.shape)}:".encode())
    digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: tensor_digest(tensor) for name, tensor in sorted(tensors.items())}


def train(model_dir: Path, iterations: int, out_dir: Path, seed: int, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The harness run: build, then per iteration update, sync and record; returns this rank's report."""
    shape = DEFAULT_SHAPE
    worker = build_worker(model_dir, iterations, shape, overrides=overrides)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    engine = actor_engine(worker)
    dp_rank, dp_size = engine.get_data_parallel_rank(), engine.get_data_parallel_size()

    rollout = recording_rollout(worker)
    records = []
    for iteration in range(iterations):
        batch = synthetic_batch(iteration, seed, dp_rank, dp_size, shape)
        metrics = run_iteration(worker, batch)
        records.append(
            {
                "iteration": iteration,
                "batch_tokens": global_token_count(batch),
                "metrics": metrics,
                "rollout_update_count": rollout.update_count,
                "rollout_digests": digests(rollout.weights),
                "actor_digests": digests(actor_full_params(worker)),
            }
        )

    final_actor = actor_full_params(worker)
    if rank == 0:
        save_file(rollout.weights, str(out_dir / "rollout_weights.safetensors"))
        save_file(final_actor, str(out_dir / "actor_params.safetensors"))
    report = {
        "rank": rank,
        "world_size": world_size,
        "iterations": len(records),
        # As the engine saw it when it built the LR scheduler (verl/workers/engine/fsdp/transformer_impl.py:503-534).
        "total_training_steps": engine.optimizer_config.total_training_steps,
        "per_iteration": records,
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report, indent=1, sort_keys=True))
    return report


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a local HF model directory (tiny_model.py)")
    parser.add_argument("--iterations", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True, help="where the per-rank reports go")
    parser.add_argument("--seed", type=int, default=0, help="selects the synthetic batches")
    parser.add_argument(
        "--override", action="append", default=[], metavar="KEY=VALUE", help="a hydra override, applied last"
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    try:
        train(args.model, args.iterations, args.out, args.seed, args.override)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
