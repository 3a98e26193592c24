"""A tiny real megatron-core 0.16.1 island on CPU gloo ranks, for tests.

Run under `launch.run_ranks` (or any launcher that sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``
and ``MASTER_PORT``). On every rank::

    island = init_island(IslandSpec(tp=2, pp=2))   # gloo + parallel_state + GPTModel + DDP + optimizer
    loss = island.train_step()                      # float on the last pipeline stage, else None
    ...
    teardown()

What is real: ``parallel_state`` groups (with gloo twins), ``GPTModel`` from the local (non-TE)
layer spec, ``Float16Module`` for bf16, Megatron ``DistributedDataParallel`` with its contiguous
grad buffers, ``get_megatron_optimizer`` (a ``ChainedOptimizer`` of ``DistributedOptimizer`` s, or
of ``Float16OptimizerWithFloat16Params`` / ``FP32Optimizer`` without the distributed optimizer),
the ``get_forward_backward_func`` schedules and ``finalize_model_grads``. What is not: CUDA;
`cpu_shim` answers megatron's CUDA calls with CPU ones.

CPU-specific choices, each forced by a CUDA-only path in megatron-core:

* ``model_parallel_cuda_manual_seed`` reads the CUDA RNG state, so the RNG tracker is the
  inference one (its ``fork()`` is a no-op) and dropout is 0. Weights are initialised on the CPU
  (``use_cpu_initialization``) from ``torch.manual_seed(seed + 100 * pp_rank + 10 * ep_rank)``;
  DDP's ``broadcast_params`` then makes DP replicas equal (experts differ across EP ranks).
* Fusions (bias-activation, bias-dropout, masked softmax, RoPE, persistent layer norm, gradient
  accumulation) are off: their kernels are CUDA/Apex only.
* MoE uses ``SequentialMLP`` experts and the ``allgather`` token dispatcher; ``alltoall`` creates
  a ``torch.cuda.Stream`` and cannot run on CPU.

Combinations verified on 4 CPU ranks (3 steps, falling loss, equal loss on every last-stage rank):
TP2×DP2 and TP2×PP2 with bf16 params + DistributedOptimizer (fp32 masters); bf16=False (fp32
params, DistributedOptimizer over fp32 shards); distributed_optimizer=False with bf16
(Float16OptimizerWithFloat16Params, full fp32 masters on every rank); tied_embeddings with PP2;
swiglu with TP2; MoE with EP2 (4 experts, TP1: dense DP 4, expert DP 2); and PP2×EP2 MoE with
swiglu and tied embeddings. A TP2×DP2 island matches one rank training the same global batch
(fp32: to 1e-6; bf16: to ~2e-4), and repeated runs give bit-identical losses and parameters.
See test_fixture.py.

Does not work on CPU: MoE with TP > 1. ``MoELayer`` refuses tensor parallelism without sequence
parallelism in training, and the local spec's ``WrappedTorchNorm`` refuses sequence parallelism
(it needs TransformerEngine or Apex norms); `init_island` raises ValueError for it. Nor does the
``alltoall`` dispatcher (``torch.cuda.Stream``), nor overlapped grad reduce / param gather (untried:
they rely on CUDA streams and events).

Importing: ``tests/mcore`` has no ``__init__.py`` and is not named ``megatron`` on purpose.
megatron-core's ``megatron`` is a namespace package, and pytest's default import mode puts
``tests/`` on ``sys.path``, so a package ``tests/megatron`` would shadow it. Test modules
here import their neighbours by their plain names (``from islands import ...``), as
``tests/integration`` does with ``conftest``; workers run as scripts from this directory.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import cpu_shim
import torch
import torch.distributed as dist
import torch.nn.functional as F


@dataclass(frozen=True)
class IslandSpec:
    """One island's parallel layout, model size and training settings.

    The data-parallel size is what is left: ``WORLD_SIZE / (tp * pp)`` for dense parameters and
    ``WORLD_SIZE / (ep * pp)`` for expert parameters (MoE islands need tp=1 on CPU).
    """

    tp: int = 1  # tensor-parallel size
    pp: int = 1  # pipeline-parallel size (layers must divide evenly)
    ep: int = 1  # expert-parallel size (needs experts > 0)
    experts: int = 0  # MoE experts per layer; 0 builds a dense model
    layers: int = 4
    hidden: int = 64
    heads: int = 4
    ffn: int = 128  # dense MLP width; each expert gets ffn // 2
    vocab: int = 256
    seq: int = 16
    bf16: bool = True  # bf16 params and activations (fp32 masters in the optimizer); False: all fp32
    distributed_optimizer: bool = True  # DistributedOptimizer (sharded masters) vs one per rank
    tied_embeddings: bool = False  # share the input embedding with the output layer
    swiglu: bool = False  # gated SiLU MLP instead of GeLU
    seed: int = 1234  # weights and data
    micro_batch: int = 2  # sequences per microbatch
    micro_batches: int = 2  # microbatches per step on each DP rank
    lr: float = 1e-3


@dataclass
class Island:
    """The Megatron objects of one rank of a built island, plus a deterministic training step."""

    spec: IslandSpec
    config: Any  # TransformerConfig
    model_chunks: list[Any]  # DDP-wrapped chunks, what a trainer's `wrapped_models` holds
    optimizer: Any  # MegatronOptimizer (a ChainedOptimizer)
    dp_rank: int  # this rank's dense data-parallel rank (decides its data)
    dp_size: int
    step: int = 0  # optimizer steps taken
    last_step_info: dict[str, Any] = field(default_factory=dict)  # from the last `train_step`

    @property
    def tokens_per_step(self) -> int:
        """Tokens one optimizer step of the whole island consumes (all DP ranks)."""
        return self.dp_size * self.spec.micro_batches * self.spec.micro_batch * self.spec.seq

    def train_step(self) -> float | None:
        """One optimizer step on this step's data; the island's mean loss on the last PP stage.

        The loss is averaged over this rank's microbatches and then over the DP group, so every
        last-stage rank returns the same value. Other stages return None.
        """
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        spec = self.spec
        for chunk in self.model_chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        first = self.dp_rank * spec.micro_batches
        batches = [microbatch(spec, self.step, first + i) for i in range(spec.micro_batches)]
        losses = get_forward_backward_func()(
            forward_step_func=_forward_step,
            data_iterator=iter(batches),
            model=self.model_chunks,
            num_microbatches=spec.micro_batches,
            seq_length=spec.seq,
            micro_batch_size=spec.micro_batch,
            forward_only=False,
        )  # grads are reduced by config.finalize_model_grads_func at the end of the schedule
        update_successful, grad_norm, _ = self.optimizer.step()
        self.step += 1
        self.last_step_info = {"update_successful": bool(update_successful), "grad_norm": _float(grad_norm)}
        if not ps.is_pipeline_last_stage():
            return None
        loss = torch.stack([m["lm loss"] for m in losses]).mean().reshape(1)
        dist.all_reduce(loss, group=ps.get_data_parallel_group())
        return float(loss) / self.dp_size


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def microbatch(spec: IslandSpec, step: int, index: int) -> dict[str, torch.Tensor]:
    """Microbatch `index` of the island's global batch at `step`.

    DP rank ``d`` trains on microbatches ``d * micro_batches`` to ``(d + 1) * micro_batches - 1``,
    and its TP/PP/EP peers draw the same ones. A global batch therefore holds the same sequences
    whatever the DP size, so an island with DP 2 and 2 microbatches sees what one with DP 1 and 4
    microbatches sees. Each sequence is an arithmetic progression modulo the vocabulary with a
    random start and stride: the next token is predictable from the context, so loss falls fast.
    """
    digest = hashlib.sha256(f"{spec.seed}/{step}/{index}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    start = torch.randint(0, spec.vocab, (spec.micro_batch, 1), generator=gen)
    stride = torch.randint(1, 8, (spec.micro_batch, 1), generator=gen)
    seq = (start + stride * torch.arange(spec.seq + 1)) % spec.vocab
    return {
        "tokens": seq[:, :-1].contiguous(),
        "labels": seq[:, 1:].contiguous(),
        "position_ids": torch.arange(spec.seq).expand(spec.micro_batch, spec.seq).contiguous(),
        "attention_mask": ~torch.ones(1, 1, spec.seq, spec.seq, dtype=torch.bool).tril(),  # True = masked
        "loss_mask": torch.ones(spec.micro_batch, spec.seq),
    }


def _forward_step(data_iterator: Iterator[dict[str, torch.Tensor]], model: Any) -> tuple[Any, Any]:
    # Every stage draws the microbatch; only the first uses tokens and only the last uses labels.
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])

    def loss_func(per_token: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = batch["loss_mask"]
        loss = (per_token.float() * mask).sum() / mask.sum()
        # The schedule divides `loss` in place by the microbatch count; report a copy.
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func


def init_island(spec: IslandSpec, *, timeout_s: float = 60.0) -> Island:
    """Join the gloo world from the environment and build `spec` on this rank.

    `timeout_s` bounds every collective, so a lost peer fails the rank instead of hanging it.
    """
    cpu_shim.install()  # before megatron is imported: some modules bind torch names at import
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    if spec.ep > 1 and spec.experts == 0:
        raise ValueError("ep > 1 needs experts > 0")
    if spec.experts and spec.tp > 1:
        # MoELayer refuses TP without sequence parallelism in training, and the local spec's
        # WrappedTorchNorm refuses sequence parallelism (it needs TransformerEngine or Apex).
        raise ValueError("MoE with tp > 1 cannot train on CPU: it needs sequence parallelism, which needs TE/Apex")
    if spec.layers % spec.pp:
        raise ValueError(f"{spec.layers} layers do not split over pp={spec.pp}")
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    ps.initialize_model_parallel(
        tensor_model_parallel_size=spec.tp,
        pipeline_model_parallel_size=spec.pp,
        expert_model_parallel_size=spec.ep,
        distributed_timeout_minutes=max(1, round(timeout_s / 60)),
        create_gloo_process_groups=True,
    )
    # model_parallel_cuda_manual_seed needs the CUDA RNG; the inference tracker's fork() is a no-op.
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    pp_rank, ep_rank = ps.get_pipeline_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    torch.manual_seed(spec.seed + 100 * pp_rank + 10 * ep_rank)

    dtype = torch.bfloat16 if spec.bf16 else torch.float32
    moe: dict[str, Any] = {}
    if spec.experts:
        moe = dict(
            num_moe_experts=spec.experts,
            moe_ffn_hidden_size=spec.ffn // 2,
            moe_router_topk=2,
            moe_token_dispatcher_type="allgather",  # alltoall needs torch.cuda.Stream
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=1e-2,
            moe_grouped_gemm=False,
        )
    config = TransformerConfig(
        num_layers=spec.layers,
        hidden_size=spec.hidden,
        num_attention_heads=spec.heads,
        ffn_hidden_size=spec.ffn,
        tensor_model_parallel_size=spec.tp,
        pipeline_model_parallel_size=spec.pp,
        expert_model_parallel_size=spec.ep,
        sequence_parallel=False,  # the local spec's torch LayerNorm refuses it
        use_cpu_initialization=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=spec.bf16,
        add_bias_linear=False,
        gated_linear_unit=spec.swiglu,
        activation_func=F.silu if spec.swiglu else F.gelu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        **moe,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(num_experts=spec.experts or None, moe_grouped_gemm=False),
        vocab_size=spec.vocab,
        max_sequence_length=spec.seq,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=spec.tied_embeddings,
        position_embedding_type="rope",
    )
    module = Float16Module(config, model) if spec.bf16 else model  # bf16 in, fp32 logits/loss out
    ddp = DistributedDataParallel(
        config=config,
        ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            overlap_param_gather=False,
            use_distributed_optimizer=spec.distributed_optimizer,
        ),
        module=module,
    )
    ddp.broadcast_params()  # DP replicas start equal; EP ranks keep their own experts
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=spec.lr,
            weight_decay=0.0,
            adam_beta2=0.95,
            clip_grad=1.0,
            bf16=spec.bf16,
            params_dtype=dtype,
            use_distributed_optimizer=spec.distributed_optimizer,
        ),
        [ddp],
    )
    # What Megatron-LM's training loop wires up: DP reduce-scatter/all-reduce, tied-embedding
    # all-reduce across pipeline stages, and loss scaling (a no-op for bf16).
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return Island(
        spec=spec,
        config=config,
        model_chunks=[ddp],
        optimizer=optimizer,
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
    )


def rank_info() -> dict[str, int]:
    """This rank's coordinates in the initialised parallel state."""
    from megatron.core import parallel_state as ps

    return {
        "rank": dist.get_rank(),
        "tp": ps.get_tensor_model_parallel_rank(),
        "pp": ps.get_pipeline_model_parallel_rank(),
        "dp": ps.get_data_parallel_rank(),
        "dp_size": ps.get_data_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_rank(),
        "expert_dp_size": ps.get_expert_data_parallel_world_size(),
    }


def teardown() -> None:
    """Destroy the parallel state and the process group; remove the CPU shim."""
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    cpu_shim.uninstall()
