"""The optimizer's first moment, shared across islands (DESIGN §3.9).

Between rounds each island's optimizer keeps a first moment (Adam's `exp_avg`, SGD's
`momentum_buffer`) built from its own shard's gradients only. When a merged fragment is
installed, the island's parameters move to the fleet's, but that moment still points along the
island's own trajectory, and the next steps drift apart again from there. Sharing it removes
that: each push carries the moment of every synced tensor (every round, not only its own
fragment's: how often counts, README), the syncer averages them with the merge's weights, and
the broadcast brings the average back. The moment is advice, not state, so it travels in a
4-bit block code (`MOMENT_CODEC`) both ways.

The moment is an exponential average, m ← β·m + (1 − β)·g per step, so the average of the
moments at the push, m̄, replaces the island's own m_push by adding β^k·(m̄ − m_push) to the
moment it holds k steps later: the steps since the push stay in it exactly as they would have
on top of m̄. Nothing here touches the parameters, so islands stay bit-identical whether the
moment is shared or not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from yeto_core.codecs import Codec, codec_by_name
from yeto_core.layout import Fragment, Layout
from yeto_core.setting_names import SettingsError

FIRST_MOMENT_KEYS = ("exp_avg", "momentum_buffer")  # Adam and its kin; SGD with momentum
MOMENT_CODEC: Codec = codec_by_name("int4")  # as good as f32 for the moment, measured (README)


def moment_nbytes(layout: Layout) -> int:
    """The wire bytes of the whole model's first moment (every fragment, in fragment order)."""
    return MOMENT_CODEC.encoded_nbytes(layout.total_numel)


def max_bulk_bytes(layout: Layout) -> int:
    """The largest bulk payload either side may send: a fragment's f32 values and the model's moment."""
    return max(f.numel for f in layout.fragments) * 4 + moment_nbytes(layout)


def encode_moment(moment: torch.Tensor) -> memoryview:
    out = memoryview(bytearray(MOMENT_CODEC.encoded_nbytes(moment.numel())))
    MOMENT_CODEC.encode(moment, out)
    return out


def decode_moment(layout: Layout, payload: memoryview) -> torch.Tensor:
    """The model's moment from its wire bytes; ValueError for a bad block (a scale not finite)."""
    out = torch.empty(layout.total_numel, dtype=torch.float32)
    MOMENT_CODEC.decode(payload, out)
    return out


class MomentError(SettingsError):
    """`share_momentum` is set, but this island's optimizer or store cannot share a first moment."""


def torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a trainer's wrapper (accelerate's `AcceleratedOptimizer`, HF's
    and Lightning's wrappers keep it as `.optimizer`)."""
    for _ in range(4):
        if isinstance(optimizer, torch.optim.Optimizer) or not hasattr(optimizer, "optimizer"):
            break
        optimizer = optimizer.optimizer
    if not hasattr(optimizer, "state") or not hasattr(optimizer, "param_groups"):
        raise MomentError(f"YETO_DILOCO_SHARE_MOMENTUM: {type(optimizer).__name__} is not a torch optimizer")
    return optimizer


def first_moment_beta(group: dict[str, Any], name: str) -> float:
    """β of the first moment's exponential average in one param group: Adam's betas[0], SGD's momentum."""
    if "betas" in group:
        return float(group["betas"][0])
    if float(group.get("momentum", 0.0)) > 0.0:
        return float(group["momentum"])
    raise MomentError(f"YETO_DILOCO_SHARE_MOMENTUM: the optimizer's group of {name!r} keeps no first moment "
                      "(Adam's betas or SGD's momentum); unset it for this optimizer")


class OptimizerMoments:
    """The first moment of a torch optimizer's state for the synced tensors, by their names."""

    def __init__(self, optimizer: Any, named_params: Sequence[tuple[str, torch.Tensor]]) -> None:
        self.optimizer = torch_optimizer(optimizer)
        owner = {id(p): group for group in self.optimizer.param_groups for p in group["params"]}
        self._params: dict[str, torch.Tensor] = {}
        self._beta: dict[str, float] = {}
        for name, param in named_params:
            group = owner.get(id(param))
            if group is None:
                raise MomentError(f"YETO_DILOCO_SHARE_MOMENTUM: the synced tensor {name!r} is not among the "
                                  "optimizer's parameters")
            self._params[name] = param
            self._beta[name] = first_moment_beta(group, name)

    def _moment(self, name: str) -> torch.Tensor | None:
        state = self.optimizer.state.get(self._params[name])
        if not state:
            return None  # the optimizer has not stepped this tensor yet
        for key in FIRST_MOMENT_KEYS:
            moment = state.get(key)
            if isinstance(moment, torch.Tensor):
                return moment
        return None

    def gather(self, fragment: Fragment, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """The fragment's first moment as one flat f32 tensor (into `out`, if given); None until
        every tensor of it has one (before the optimizer's first step), or when any value is not
        finite."""
        out = torch.empty(fragment.numel, dtype=torch.float32) if out is None else out
        for slot in fragment.slots:
            moment = self._moment(slot.name)
            if moment is None or moment.numel() != slot.numel:
                return None
            out[slot.offset : slot.offset + slot.numel].copy_(moment.detach().reshape(-1))
        return out if bool(torch.isfinite(out).all()) else None

    def gather_all(self, layout: Layout) -> torch.Tensor | None:
        """Every fragment's moment, back to back in fragment order (None as `gather`)."""
        out = torch.empty(layout.total_numel, dtype=torch.float32)
        start = 0
        for fragment in layout.fragments:
            if self.gather(fragment, out[start : start + fragment.numel]) is None:
                return None
            start += fragment.numel
        return out

    def rebase_all(self, layout: Layout, merged: torch.Tensor, pushed: torch.Tensor, steps: int) -> None:
        """`rebase` every fragment from model-wide moments (fragment order, as `gather_all`)."""
        start = 0
        for fragment in layout.fragments:
            part = slice(start, start + fragment.numel)
            self.rebase(fragment, merged[part], pushed[part], steps)
            start += fragment.numel

    def rebase(self, fragment: Fragment, merged: torch.Tensor, pushed: torch.Tensor, steps: int) -> None:
        """m ← m + β^steps·(merged − pushed) for every tensor of the fragment: the moment the island
        would hold had it taken the fleet's `merged` moment instead of its own `pushed` one `steps`
        optimizer steps ago."""
        for slot in fragment.slots:
            moment = self._moment(slot.name)
            if moment is None or moment.numel() != slot.numel:
                continue
            part = slice(slot.offset, slot.offset + slot.numel)
            change = merged[part] - pushed[part]
            moment.add_(change.view(moment.shape).to(device=moment.device, dtype=moment.dtype),
                        alpha=self._beta[slot.name] ** max(0, steps))
