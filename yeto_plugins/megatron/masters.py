"""Read and write the fp32 master of a Megatron parameter, whichever optimizer holds it.

DiLoCo must sync the masters, never the bf16 parameters: the bf16 copy is a rounding of the
master (and with `overlap_param_gather` it is even stale at step end on ranks that do not own
it). Each `Master` knows the slice `[start, end)` of the parameter's flat (TP-local) view that
this rank holds the authoritative master of, or `None`:

* **DistributedOptimizer**: this DP rank's shard (`_get_model_param_range_map(p)["param"]`);
  the master is the optimizer's own parameter (`optimizer.param_groups[g]["params"][i]`), the
  fp32 copy of a bf16 parameter or a view of an fp32 one. With a precision-aware optimizer the
  master sits in the optimizer state (`master_param`); with CPU offload (HybridDeviceOptimizer)
  it is the host copy. With several optimizer instances only instance 0 answers.
* **Non-distributed optimizers** hold whole masters on every DP rank; DP rank 0 answers.
* A tensor every TP rank holds whole (a layer norm) is answered by TP rank 0 only.

So across the island every element of every global tensor has exactly one answering rank;
`sync` checks that before the first round. Writing sets the master slice and the whole model
parameter (rounded to its dtype) on every rank that holds it; Adam moments are never touched.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from yeto_plugins.megatron.names import LocalParam


@dataclass
class Master:
    owned: tuple[int, int] | None  # [start, end) of the flat local parameter this rank answers for
    read: Callable[[], torch.Tensor]  # the owned slice as f32 (a view or a fresh tensor)
    write_slice: Callable[[torch.Tensor], None]  # store an f32 tensor of the owned slice's length


def sub_optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _is_distributed(o: Any) -> bool:
    return hasattr(o, "_get_model_param_range_map") and hasattr(o, "model_param_group_index_map")


def _precision_aware(o: Any) -> bool:
    config = getattr(o, "config", None)
    return bool(getattr(config, "use_precision_aware_optimizer_no_fp8_or_ds_fp8",
                        getattr(config, "use_precision_aware_optimizer", False)))


def _distributed_master(o: Any, p: torch.nn.Parameter, answers: bool) -> Master:
    if p not in o.model_param_gbuf_map:  # no part of it is sharded to this DP rank
        return Master(None, _nothing, _nothing_written)
    r = o._get_model_param_range_map(p)["param"]
    if r.size == 0 or not answers:
        return Master(None, _nothing, _nothing_written)
    owned = (int(r.start), int(r.end))
    g, i = o.model_param_group_index_map[p]
    inner = o.optimizer
    shard = inner.param_groups[g]["params"][i]
    hybrid = type(inner).__name__ == "HybridDeviceOptimizer"
    if hybrid:
        host = inner.param_to_fp32_param.get(shard)
        if host is None:
            host = inner.gpu_params_map_cpu_copy.get(shard, shard)
        if host.dtype != torch.float32:
            raise ValueError("CPU-offloaded optimizer without fp32 masters: set optimizer_offload_fraction with "
                             "param_update_in_fp32 (use_precision_aware_optimizer) so DiLoCo reads exact masters")
        def write_host(v: torch.Tensor) -> None:
            host.copy_(v.to(host.device))

        return Master(owned, lambda: host, write_host)
    if _precision_aware(o):
        def read() -> torch.Tensor:
            return o._get_main_param_and_optimizer_states(p)["param"].float()

        def write(v: torch.Tensor) -> None:
            o._set_main_param_and_optimizer_states(p, {"param": v.to(shard.device)})  # sets master_param only

        return Master(owned, read, write)
    def write_shard(v: torch.Tensor) -> None:
        shard.detach().copy_(v.to(shard.device))

    return Master(owned, lambda: shard.detach(), write_shard)


def _whole_master(o: Any, p: torch.nn.Parameter, answers: bool) -> Master:
    """Float16OptimizerWithFloat16Params (fp32_from_float16_groups) or an fp32 optimizer."""
    master: torch.Tensor = p
    for model_group, master_group in zip(getattr(o, "float16_groups", []), getattr(o, "fp32_from_float16_groups", []),
                                         strict=True):
        for mp, ms in zip(model_group, master_group, strict=True):
            if mp is p:
                master = ms
    if not answers:
        return Master(None, _nothing, _nothing_written)
    flat = master.detach().view(-1)

    def write_whole(v: torch.Tensor) -> None:
        flat.copy_(v.to(flat.device))

    return Master((0, p.numel()), lambda: flat, write_whole)


def _nothing() -> torch.Tensor:
    raise AssertionError("this rank answers for no part of the parameter")


def _nothing_written(_: torch.Tensor) -> None:
    raise AssertionError("this rank answers for no part of the parameter")


def _holds(o: Any, p: torch.nn.Parameter) -> bool:
    if _is_distributed(o):  # its buffers hold every parameter, also those with no shard on this rank
        return any(p in getattr(b, "param_to_bucket", ()) for b in getattr(o, "buffers", ()))
    groups = list(getattr(o, "float16_groups", [])) + list(getattr(o, "fp32_from_fp32_groups", []))
    if not groups:
        groups = [g["params"] for g in getattr(getattr(o, "optimizer", None), "param_groups", [])]
    return any(q is p for g in groups for q in g)


def masters(params: Sequence[LocalParam], optimizer: Any) -> list[Master]:
    """One `Master` per local parameter (aliases answer for nothing: their original does)."""
    from megatron.core import parallel_state as ps

    dp_rank = ps.get_data_parallel_rank(with_context_parallel=True)
    edp_rank = ps.get_expert_data_parallel_rank()
    subs = sub_optimizers(optimizer)
    out: list[Master] = []
    for lp in params:
        owner = next((o for o in subs if _holds(o, lp.param)), None)
        if owner is None:
            raise ValueError(f"parameter {lp.local_name!r} is trainable but no optimizer holds it")
        # A tensor every TP rank holds whole is answered by TP rank 0; an alias by its original.
        answers = not lp.alias and (lp.tp_dim >= 0 or lp.tp_rank == 0)
        if _is_distributed(owner):
            answers = answers and getattr(owner, "distributed_optimizer_instance_id", 0) == 0
            out.append(_distributed_master(owner, lp.param, answers))
        else:
            answers = answers and (edp_rank if lp.expert else dp_rank) == 0
            out.append(_whole_master(owner, lp.param, answers))
    return out


def write_parameter(lp: LocalParam, master: Master, values: torch.Tensor) -> None:
    """Install `values` (the whole flat TP-local tensor, f32) into the master slice this rank
    answers for and into the model parameter itself, as the optimizer step would have."""
    with torch.no_grad():
        if master.owned is not None:
            start, end = master.owned
            master.write_slice(values[start:end])
        lp.param.detach().view(-1).copy_(values.to(lp.param.device))  # rounds to the parameter's dtype
