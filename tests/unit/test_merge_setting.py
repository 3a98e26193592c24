"""`--merge {rda,iso,average}`: which tensors RDA merges, and the backend id a checkpoint records."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from syncer.core.links import backend_id
from syncer.merge.round_merge import fragment_segments
from yeto_core.layout import TensorSpec, build_layout
from yeto_core.settings import SyncerSettings

pytestmark = pytest.mark.unit

SPECS = [TensorSpec("embed.weight", (8, 4), "float32", embedding=True), TensorSpec("layers.0.w", (4, 4), "float32"),
         TensorSpec("layers.0.b", (4,), "float32"), TensorSpec("layers.1.w", (4, 4), "float32")]


def segments(merge: str) -> list[list[bool]]:
    layout = build_layout(SPECS, 3, "binpack")
    return [[seg.rda for seg in frag] for frag in fragment_segments(layout, SyncerSettings(merge=merge).merging.merge)]


def test_rda_merges_every_tensor_the_embedding_too() -> None:
    assert segments("rda") == [[True], [True, True], [True]]


def test_average_merges_every_tensor_by_the_plain_weighted_average() -> None:
    assert segments("average") == [[False], [False, False], [False]]


def test_iso_merges_as_rda_does() -> None:
    assert segments("iso") == segments("rda")  # and flattens the matrices' spectra (tests/unit/test_iso_merge.py)


def test_the_backend_id_names_the_merge() -> None:
    ids = {backend_id(SyncerSettings(merge=m, delta_correction=c).merging) for m in ("rda", "iso", "average")
           for c in ("heloco", "none")}
    assert len(ids) == 6  # --resume refuses a checkpoint made with another merge
    assert backend_id(SyncerSettings(merge="rda", delta_correction="heloco", outer_optimizer="nesterov").merging) == (
        "rda-heloco-nesterov-v1")  # checkpoints written before the setting existed still resume


def test_an_unknown_merge_is_refused_with_the_setting_named() -> None:
    from yeto_core.settings import SettingsError, load_settings

    with pytest.raises(SettingsError, match="--merge='svd'"):
        load_settings(SyncerSettings, flags=True, merge="svd")


def test_the_shipped_outer_step_against_a_hand_reference() -> None:
    from syncer.merge.outer import STEPS_KEY, outer_optimizer

    s = SyncerSettings().merging
    assert (s.merge, s.outer_optimizer, s.outer_lr, s.outer_momentum, s.outer_momentum_warmup) == (
        "rda", "nesterov", 0.7, 0.5, 4)
    outer = outer_optimizer(s)
    param, momentum = torch.tensor([1.0, -2.0]), torch.zeros(2)
    close = partial(pytest.approx, rel=1e-6)  # 0.7 is not a binary fraction: float32 rounding
    outer.step(param, momentum, torch.tensor([0.5, 0.25]), {STEPS_KEY: 0})
    # step 0, μ = 0: m = g = [0.5, 0.25]; θ −= 0.7·g
    assert param.tolist() == close([0.65, -2.175]) and momentum.tolist() == [0.5, 0.25]
    outer.step(param, momentum, torch.tensor([-0.25, 0.5]), {STEPS_KEY: 1})
    # step 1, μ = 0.5·1/4: m = 0.125·[0.5, 0.25] + [−0.25, 0.5] = [−0.1875, 0.53125];
    # θ −= 0.7·(g + 0.125·m) = 0.7·[−0.2734375, 0.56640625]
    assert param.tolist() == close([0.84140625, -2.571484375]) and momentum.tolist() == [-0.1875, 0.53125]
    outer.step(param, momentum, torch.tensor([0.5, 0.0]), {STEPS_KEY: 4})
    # warmed up, μ = 0.5: m = 0.5·m + g = [0.40625, 0.265625]; θ −= 0.7·(g + 0.5·m) = 0.7·[0.703125, 0.1328125]
    assert param.tolist() == close([0.34921875, -2.664453125])
    assert momentum.tolist() == [0.40625, 0.265625]


def test_the_merger_steps_by_the_fleets_outer_lr() -> None:
    from syncer.merge.round_merge import RoundMerger

    assert RoundMerger(SyncerSettings(learners=2).merging).outer.lr == 0.7
    assert RoundMerger(SyncerSettings(learners=8).merging).outer.lr == pytest.approx(0.4950, abs=5e-5)
    assert RoundMerger(SyncerSettings(learners=8, outer_lr=0.7).merging).outer.lr == 0.7
    from syncer.merge.outer import outer_optimizer
    from yeto_core.sections import MergeSettings

    with pytest.raises(ValueError, match=r"for_learners"):
        outer_optimizer(MergeSettings())  # a section built alone has no M to resolve its lr from
    assert outer_optimizer(MergeSettings().for_learners(4)).lr == SyncerSettings(learners=4).merging.outer_lr
