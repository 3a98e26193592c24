"""The consensus probe of a Megatron island (DESIGN §8.1): the model's logits on the fixed probe
batch, whatever the island's tensor, pipeline, context or data parallel layout.

Every rank runs the probe together (the conductor's PROBE op, `yeto_core.conductor`): one
forward-only microbatch through megatron-core's own pipeline schedule
(`megatron/core/pipeline_parallel/schedules.py`, `get_forward_backward_func`, with
`collect_non_loss_data=True` so the last stage keeps the output instead of a loss). The last
stage holds the logits split over the vocabulary across tensor-parallel ranks; they are gathered
(`tensor_parallel.gather_from_tensor_model_parallel_region`) and the one last-stage rank with
tensor, data and context parallel rank 0 sends them to the island's rank 0 over the island's
gloo group, where the learner session summarizes them. Every island of a run probes the same
token ids, so islands with different layouts are compared on equal terms.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from yeto_core.consensus_report import probe_ids

log = logging.getLogger("yeto.megatron")


def _gpt_attribute(chunks: Sequence[torch.nn.Module], name: str) -> int | None:
    """An int attribute of the GPT model inside the wrappers (DDP, Float16Module), if any."""
    for chunk in chunks:
        for module in chunk.modules():
            value = getattr(module, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def megatron_logit_probe(chunks: Sequence[torch.nn.Module], group: Any, tokens: int,
                         ) -> Callable[[], torch.Tensor] | None:
    """A callable every rank of the island runs together; on the island's rank 0 it returns the
    logits [T, V] on the fixed probe batch (elsewhere an empty tensor). None, with a warning, for
    a model whose vocabulary size cannot be read."""
    vocab = _gpt_attribute(chunks, "vocab_size")
    if vocab is None:
        log.warning("consensus probe off: the Megatron model has no vocab_size")
        return None
    limit = _gpt_attribute(chunks, "max_sequence_length")
    length = min(tokens, limit) if limit else tokens
    ids = probe_ids(vocab, length)
    lead = dist.get_global_rank(group, 0)

    def forward_step(data: Iterator[dict[str, torch.Tensor]], model: Any) -> tuple[Any, Any]:
        batch = next(data)
        output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"])
        return output, lambda out, non_loss_data=False: out  # forward only: keep the logits

    def probe() -> torch.Tensor:
        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel
        from megatron.core.pipeline_parallel import get_forward_backward_func

        device = next(chunks[0].parameters()).device
        batch = {
            "tokens": ids.to(device),
            "position_ids": torch.arange(length, device=device).unsqueeze(0),
            "attention_mask": ~torch.ones(1, 1, length, length, dtype=torch.bool, device=device).tril(),
        }
        modes = [chunk.training for chunk in chunks]
        for chunk in chunks:
            chunk.eval()
        try:
            data: Any = iter([batch]) if len(chunks) == 1 else [iter([batch]) for _ in chunks]
            collected = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=data, model=list(chunks), num_microbatches=1,
                seq_length=length, micro_batch_size=1, forward_only=True, collect_non_loss_data=True)
        finally:
            for chunk, mode in zip(chunks, modes, strict=True):
                chunk.train(mode)
        source = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 and \
            ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
        logits = None
        if ps.is_pipeline_last_stage():
            logits = collected[0]
            if logits.shape[-1] != vocab:  # split over the vocabulary across tensor-parallel ranks
                logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
            logits = logits[0].float().cpu()
        # Which rank holds the whole logits: every rank learns it from one tiny all-reduce.
        me = dist.get_rank()
        holder = torch.tensor([me if source else -1], dtype=torch.int64)
        dist.all_reduce(holder, op=dist.ReduceOp.MAX, group=group)
        src = int(holder.item())
        if me == src and src != lead:
            assert logits is not None
            dist.send(logits.contiguous(), lead, group=group)
        if me != lead:
            return torch.empty(0)
        if src == lead:
            assert logits is not None
            return logits
        received = torch.empty(length, vocab, dtype=torch.float32)
        dist.recv(received, src, group=group)
        return received

    return probe
