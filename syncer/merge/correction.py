"""HeLoCo delta correction: stale learner deltas realigned with the outer momentum (DESIGN §5.4).

HeLoCo ("HeLoCo: Efficient asynchronous low-communication training under data and device
heterogeneity", arXiv:2606.00271) uses the outer momentum as the reference for where training is
heading and corrects each incoming pseudo-gradient per block b (here: per model tensor, one
``Segment`` of the fragment's flat buffer) before the outer step. With Δ_b the pseudo-gradient
block and m_b the momentum block:

    c_b    = ⟨Δ_b, m_b⟩ / (‖Δ_b‖ ‖m_b‖)                  cosine alignment
    conf_b = ‖Δ_b‖ / (‖Δ_b‖ + κ ‖m_b‖ + ε)               confidence
    keep      c_b ≥ c_ok:      Δ̂_b = Δ_b
    shrink    c_b < 0:         Δ̂_b = Δ_b − β_b c_b ‖Δ_b‖ m̂_b,   β_b = min(k_s (−c_b) conf_b, β_max)
    reorient  0 ≤ c_b < c_ok:  Δ̂_b = ‖Δ_b‖ ũ_b / max(‖ũ_b‖, ε),
                               ũ_b = (1 − λ_b) Δ̂u_b + λ_b m̂_b,  λ_b = min(k_d (1 − c_b) conf_b, 1)

(m̂_b = m_b/‖m_b‖, Δ̂u_b = Δ_b/‖Δ_b‖). Shrinking removes the fraction β_b of the block's component
against the momentum and leaves the rest; reorienting turns the block part of the way toward the
momentum and keeps its length.

Sign convention. The paper's pseudo-gradient is Δ = θ_start − θ_end, which is yeto's −d for a
learner delta d = θ_local − anchor, and its momentum accumulates those Δ exactly as yeto's
momentum buffer accumulates outer gradients −merged d (``outer.nesterov_step``). The rules
above are unchanged when Δ and m are both negated, so a learner delta is corrected in its own
sign: d̂ = −correct(−d, m). In yeto terms c_b = −⟨d_b, m_b⟩/(‖d_b‖ ‖m_b‖): a delta that moves
the way the momentum has been moving the parameters has c_b > 0 and is kept.

Momentum scale. The paper's momentum is an exponential average, m ← μ m + (1 − μ) G, while
yeto's buffer follows torch's SGD, m ← μ m + g, and is 1/(1 − μ) times longer. Only the
confidence depends on the momentum's length; ``HelocoConfig.momentum_scale`` multiplies ‖m_b‖
there, so the syncer passes 1 − μ to reproduce the paper's confidence.

Where it applies. The paper corrects every incoming pseudo-gradient before it joins the update;
yeto corrects each learner's delta row before ``merge.merge_deltas`` merges the rows. With no
momentum yet (the first round of a fragment) there is no reference and nothing changes; the same
holds per block for a zero momentum block or a zero delta block. The paper's optional per-worker
delay weight ρ_t (1 when unused) is left out: yeto's merge weights already weigh learners, and
late pushes are bounded by ``--max-base-lag``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from syncer.merge.merge import _NORM_BLOCK, Segment, _check_segments, _row_sq_norms

__all__ = ["HelocoConfig", "heloco_correct"]

# Elements per product pass of the dot product: a multiple of the norm block, cache-sized.
_DOT_CHUNK = 64 * _NORM_BLOCK


@dataclass(frozen=True, slots=True)
class HelocoConfig:
    """The constants of HeLoCo's per-block correction.

    The defaults are yeto's choices within the ranges the rules need (the paper's tuned values
    were not available when this was written): every threshold and cap keeps a correction
    partial, so a block is never flipped or replaced wholesale by the momentum.
    """

    keep_threshold: float = 0.2
    """c_ok: blocks whose cosine with the momentum is at least this pass through unchanged."""
    shrink_strength: float = 1.0
    """k_s: how fast the shrink factor β_b grows with the anti-alignment −c_b and confidence."""
    shrink_cap: float = 0.5
    """β_max in [0, 1]: the largest fraction of an opposing component that is removed."""
    reorient_strength: float = 0.5
    """k_d: how fast the turn λ_b toward the momentum grows with 1 − c_b and confidence."""
    kappa: float = 1.0
    """κ: weight of the momentum's norm in conf_b; larger values trust a delta less."""
    eps: float = 1e-8
    """ε: keeps conf_b and the reoriented direction's normalisation finite."""
    momentum_scale: float = 1.0
    """Factor turning the given momentum buffer into the paper's averaged one in conf_b;
    1 − μ for yeto's undamped buffer, 1.0 for a buffer that already is an average."""

    def __post_init__(self) -> None:
        checks = [
            ("keep_threshold", 0.0 <= self.keep_threshold <= 1.0, "in [0, 1]"),
            ("shrink_strength", self.shrink_strength >= 0.0, ">= 0"),
            ("shrink_cap", 0.0 <= self.shrink_cap <= 1.0, "in [0, 1]"),
            ("reorient_strength", self.reorient_strength >= 0.0, ">= 0"),
            ("kappa", self.kappa >= 0.0, ">= 0"),
            ("eps", self.eps > 0.0, "> 0"),
            ("momentum_scale", self.momentum_scale > 0.0, "> 0"),
        ]
        for name, ok, rule in checks:
            value = getattr(self, name)
            if not ok or not math.isfinite(value):
                raise ValueError(f"HelocoConfig: {name} must be finite and {rule}, got {value}")


def _dot(a: torch.Tensor, b: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """⟨a, b⟩ of two 1-D float32 tensors as a float64 scalar tensor, accurate like ``accurate_norm``.

    Products are formed in cache-sized chunks of ``scratch``, summed per ``_NORM_BLOCK`` block in
    float32, and the block sums are added in float64.
    """
    n = a.numel()
    total = torch.zeros((), dtype=torch.float64, device=a.device)
    for start in range(0, n, _DOT_CHUNK):
        stop = min(start + _DOT_CHUNK, n)
        prod = torch.mul(a[start:stop], b[start:stop], out=scratch[: stop - start])
        k = prod.numel() // _NORM_BLOCK
        body = k * _NORM_BLOCK
        if k:
            total += prod[:body].view(k, _NORM_BLOCK).sum(dim=1).double().sum()
        if body < prod.numel():
            total += prod[body:].sum().double()
    return total


def _coefficients(dd: float, mm: float, dm: float, config: HelocoConfig) -> tuple[float, float] | None:
    """(a, b) with d̂ = a·d + b·m for one block, from ‖d‖², ‖m‖² and ⟨d, m⟩; ``None`` keeps it."""
    d_norm = math.sqrt(dd)
    m_norm = math.sqrt(mm)
    if d_norm == 0.0 or m_norm == 0.0:
        return None
    # The paper's cosine between Δ = −d and m.
    c = max(-1.0, min(1.0, -dm / (d_norm * m_norm)))
    if c >= config.keep_threshold:
        return None
    conf = d_norm / (d_norm + config.kappa * config.momentum_scale * m_norm + config.eps)
    if c < 0.0:
        beta = min(config.shrink_strength * -c * conf, config.shrink_cap)
        # Δ̂ = Δ − β c ‖Δ‖ m̂ with Δ = −d:  d̂ = d + β c ‖d‖ m/‖m‖.
        return 1.0, beta * c * d_norm / m_norm
    lam = min(config.reorient_strength * (1.0 - c) * conf, 1.0)
    # ũ = (1 − λ)(−d/‖d‖) + λ m̂ has ‖ũ‖² = (1 − λ)² + λ² + 2λ(1 − λ)c; d̂ = −‖d‖ ũ/max(‖ũ‖, ε).
    u_norm = math.sqrt(max((1.0 - lam) ** 2 + lam**2 + 2.0 * lam * (1.0 - lam) * c, 0.0))
    denom = max(u_norm, config.eps)
    return (1.0 - lam) / denom, -lam * d_norm / (m_norm * denom)


def heloco_correct(
    delta: torch.Tensor,
    momentum: torch.Tensor,
    segments: Sequence[Segment],
    config: HelocoConfig,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One learner's fragment delta d, corrected per tensor against the outer momentum (HeLoCo).

    ``delta`` and ``momentum`` are float32 ``[N]`` on one device, ``delta`` a learner's
    θ − anchor and ``momentum`` the syncer's buffer of outer gradients for the fragment; the
    ``segments`` lie back to back over ``[0, N)``. Each block is kept, shrunk or reoriented as
    the module docstring sets out; kept blocks come back bit for bit. The float32 ``[N]`` result
    goes to ``out`` when given, which may be ``delta`` itself; ``momentum`` is only read.
    Norms and dot products are taken per block in float32 and combined in float64, and the
    host reads them once per call.
    """
    if delta.dim() != 1 or delta.dtype != torch.float32:
        raise ValueError(f"heloco_correct: delta must be a 1-D float32 tensor, got {delta.dtype} "
                         f"{tuple(delta.shape)}")
    if momentum.shape != delta.shape or momentum.dtype != torch.float32 or momentum.device != delta.device:
        raise ValueError(f"heloco_correct: momentum must match delta (float32 {tuple(delta.shape)} on "
                         f"{delta.device}), got {momentum.dtype} {tuple(momentum.shape)} on {momentum.device}")
    n = delta.numel()
    _check_segments("heloco_correct", n, segments, "the delta")
    if out is None:
        out = torch.empty_like(delta)
    elif out.shape != delta.shape or out.dtype != torch.float32 or out.device != delta.device:
        raise ValueError(f"heloco_correct: out must be a float32 [{n}] tensor on {delta.device}, got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}")
    live = [seg for seg in segments if seg.numel > 0]
    stats: list[torch.Tensor] = []
    if live:
        scratch = torch.empty(min(_DOT_CHUNK, max(seg.numel for seg in live)), device=delta.device)
        for seg in live:
            d = delta[seg.offset : seg.offset + seg.numel]
            m = momentum[seg.offset : seg.offset + seg.numel]
            stats.append(torch.cat([_row_sq_norms(d.unsqueeze(0)), _row_sq_norms(m.unsqueeze(0)),
                                    _dot(d, m, scratch).unsqueeze(0)]))
    host = torch.stack(stats).tolist() if stats else []
    in_place = out.data_ptr() == delta.data_ptr()
    for seg, (dd, mm, dm) in zip(live, host, strict=True):
        d = delta[seg.offset : seg.offset + seg.numel]
        dst = out[seg.offset : seg.offset + seg.numel]
        coef = _coefficients(dd, mm, dm, config)
        if coef is None:
            if not in_place:
                dst.copy_(d)
            continue
        a, b = coef
        m = momentum[seg.offset : seg.offset + seg.numel]
        if a == 1.0:
            torch.add(d, m, alpha=b, out=dst)
        else:
            torch.mul(d, a, out=dst)
            dst.add_(m, alpha=b)
    return out
