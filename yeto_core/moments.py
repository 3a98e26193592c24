"""The optimizer's first moment, shared across islands (DESIGN §3.9).

Between rounds each island's optimizer keeps a first moment (Adam's `exp_avg`, SGD's
`momentum_buffer`) built from its own shard's gradients only. When a merged fragment is
installed, the island's parameters move to the fleet's, but that moment still points along the
island's own trajectory, and the next steps drift apart again from there. Sharing it removes
that: each push carries its fragment's moment, the syncer averages them with the merge's
weights, and the broadcast brings the average back, to be taken into that fragment's tensors as
their parameters take the fleet's. A push carries its own fragment's moment only. Every tensor's
moment with every push gets more back at short round trips, but at a late install (a round trip
of three steps) it cost loss in three cells of four, the fragment's own in one, and it costs P
times the fragment's bytes, syncer work and training-thread time (README, "What the GPT-2 gap
is"); the fragment's own costs 4.25 bits per value of the fragment each way, about one more
merge on the syncer, and a fragment's read and encode at a boundary. The moment is advice, not
state, so it travels in a 4-bit block code (`MOMENT_CODEC`) both ways, and each side keeps it in
that form until it is used.

The moment is an exponential average, m ← β·m + (1 − β)·g per step, so the average of the
moments at the push, m̄, replaces the island's own m_push by adding β^k·(m̄ − m_push) to the
moment it holds k steps later: the steps since the push stay in it exactly as they would have
on top of m̄. Nothing here touches the parameters, so islands stay bit-identical whether the
moment is shared or not.

Adam divides the moment by the island's own √v, so a fleet's moment must not outgrow what that v
can carry: a coordinate this island never saw a gradient for (a token absent from its shard, in an
input embedding untied from the output) has v = 0, and another island's moment there would step
it by m/ε. Adam's own moments satisfy |m| ≤ κ·√v, κ = (1 − β₁)/√((1 − β₂)(1 − β₁²/β₂)) (Cauchy–
Schwarz over the two exponential sums), so after the change each moment is clamped to that bound:
the fleet's moment can turn the island's steps, never make them longer than its own could be.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from yeto_core.codecs import quant_codec
from yeto_core.layout import Fragment, Layout
from yeto_core.setting_names import SettingsError
from yeto_core.store import fragment_buffer

FIRST_MOMENT_KEYS = ("exp_avg", "momentum_buffer")  # Adam and its kin; SGD with momentum
SECOND_MOMENT_KEY = "exp_avg_sq"  # Adam's: what bounds the first moment it divides
MOMENT_CODEC = quant_codec("int4")  # as good as f32 for the moment, measured (README)


def moment_nbytes(fragment: Fragment) -> int:
    """The wire bytes of a fragment's first moment: one `MOMENT_CODEC` payload."""
    return MOMENT_CODEC.encoded_nbytes(fragment.numel)


def max_bulk_bytes(layout: Layout) -> int:
    """The largest bulk payload either side may send: a fragment's f32 values and its moment."""
    return max((f.numel * 4 + moment_nbytes(f) for f in layout.fragments), default=0)


def _scratch(fragment: Fragment) -> torch.Tensor:
    """An f32 work buffer of the fragment's size, recycled from round to round (a fresh one would
    fault in every page at each boundary and each merge)."""
    return fragment_buffer(fragment.numel)


def encode_moment(moment: torch.Tensor) -> memoryview:
    """A fragment's flat f32 moment in its wire form."""
    out = memoryview(bytearray(MOMENT_CODEC.encoded_nbytes(moment.numel())))
    MOMENT_CODEC.encode(moment, out)
    return out


def decode_moment(fragment: Fragment, payload: memoryview, out: torch.Tensor | None = None) -> torch.Tensor:
    """A fragment's moment in f32 (into `out`, at least the fragment's size); ValueError for a bad
    block."""
    values = (torch.empty(fragment.numel, dtype=torch.float32) if out is None else out)[: fragment.numel]
    MOMENT_CODEC.decode(payload, values)
    return values


def moment_problem(fragment: Fragment, payload: memoryview) -> str | None:
    """Why a fragment's moment as received cannot be used (its size, a bad block, a scale that
    would decode to a value that is not finite), or None. Only the block scales are read: the
    values are decoded once, where they are used."""
    if len(payload) != moment_nbytes(fragment):
        return f"{len(payload)} bytes, expected {moment_nbytes(fragment)} for fragment {fragment.index}"
    return MOMENT_CODEC.problem(payload, fragment.numel)


def average_moments(fragment: Fragment, sent: Sequence[tuple[memoryview, float]]) -> memoryview:
    """The weighted average of a fragment's moments `sent` (wire form, weight), in their order, in
    wire form; the merge holds two of the fragment's f32 buffers beside the wire bytes."""
    total = sum(w for _, w in sent)
    mean, part = _scratch(fragment).zero_(), _scratch(fragment)
    for payload, weight in sent:
        mean.add_(decode_moment(fragment, payload, part), alpha=weight / total)
    return encode_moment(mean)


def warm_codec() -> threading.Thread:
    """Load `MOMENT_CODEC`'s compiled loops on a thread of their own (numba compiles, or loads from
    its cache, each loop on its first call: about half a second), so the first boundary that
    encodes a moment does not pay for it on the training thread."""
    def warm() -> None:
        out = torch.empty(2 * MOMENT_CODEC.block)
        MOMENT_CODEC.decode(encode_moment(out.zero_()), out)

    thread = threading.Thread(target=warm, name="yeto-moment-codec", daemon=True)
    thread.start()
    return thread


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


def moment_bound(group: dict[str, Any]) -> float | None:
    """κ with |m| ≤ κ·√v for the moments Adam keeps in `group` (module docstring); None where the
    group keeps no second moment (SGD), or its betas give no bound (β₁² ≥ β₂)."""
    if "betas" not in group:
        return None
    beta1, beta2 = (float(b) for b in group["betas"][:2])
    if not 0.0 <= beta1 * beta1 < beta2 < 1.0:
        return None
    return (1.0 - beta1) / ((1.0 - beta2) * (1.0 - beta1 * beta1 / beta2)) ** 0.5


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
        self._bound: dict[str, float | None] = {}
        for name, param in named_params:
            group = owner.get(id(param))
            if group is None:
                raise MomentError(f"YETO_DILOCO_SHARE_MOMENTUM: the synced tensor {name!r} is not among the "
                                  "optimizer's parameters")
            self._params[name] = param
            self._beta[name] = first_moment_beta(group, name)
            self._bound[name] = moment_bound(group)

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

    def encode(self, fragment: Fragment) -> memoryview | None:
        """The fragment's moment in its wire form; None as `gather`."""
        values = self.gather(fragment, _scratch(fragment))
        return None if values is None else encode_moment(values)

    def rebase_wire(self, fragment: Fragment, merged: memoryview, pushed: memoryview, steps: int) -> None:
        """`rebase` from the fragment's moments in their wire form."""
        fleet = decode_moment(fragment, merged, _scratch(fragment))
        own = decode_moment(fragment, pushed, _scratch(fragment))
        self.rebase(fragment, fleet, own, steps, out=fleet)

    def rebase(self, fragment: Fragment, merged: torch.Tensor, pushed: torch.Tensor, steps: int, *,
               out: torch.Tensor | None = None) -> None:
        """m ← m + β^steps·(merged − pushed) for every tensor of the fragment: the moment the island
        would hold had it taken the fleet's `merged` moment instead of its own `pushed` one `steps`
        optimizer steps ago. `out`: where to form the change (it may be `merged`)."""
        self.add(fragment, self.change(fragment, merged, pushed, steps, out=out))

    def change(self, fragment: Fragment, merged: torch.Tensor, pushed: torch.Tensor, steps: int, *,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """β^steps·(merged − pushed) for the fragment's tensors, each at its own group's β."""
        out = torch.sub(merged, pushed, out=out)
        for slot in fragment.slots:
            out[slot.offset : slot.offset + slot.numel].mul_(self._beta[slot.name] ** max(0, steps))
        return out

    def add(self, fragment: Fragment, change: torch.Tensor) -> None:
        """m ← m + change for every tensor of the fragment that has a moment."""
        for slot in fragment.slots:
            moment = self._moment(slot.name)
            if moment is None or moment.numel() != slot.numel:
                continue
            part = change[slot.offset : slot.offset + slot.numel]
            moment.add_(part.view(moment.shape).to(device=moment.device, dtype=moment.dtype))
            self.bound(slot.name, moment)

    def bound(self, name: str, moment: torch.Tensor) -> None:
        """Clamp `moment` of tensor `name` to κ·√v of the island's own second moment (module
        docstring), where its optimizer keeps one."""
        kappa = self._bound[name]
        state = self.optimizer.state.get(self._params[name])
        second = state.get(SECOND_MOMENT_KEY) if state else None
        if kappa is None or not isinstance(second, torch.Tensor) or second.shape != moment.shape:
            return
        limit = second.sqrt().mul_(kappa)
        torch.minimum(moment, limit, out=moment)
        torch.maximum(moment, limit.neg_(), out=moment)
