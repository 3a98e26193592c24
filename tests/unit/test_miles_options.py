"""Miles options a yeto island cannot account for stop it at its join, named, before it touches the model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from yeto_core.settings import SettingsError
from yeto_plugins.miles.hook import MilesIsland, steps_per_rollout, tokens_per_step

pytestmark = pytest.mark.unit

ARGS = {"global_batch_size": 64, "seq_length": 512, "rollout_batch_size": 16, "n_samples_per_prompt": 8,
        "num_steps_per_rollout": None, "num_rollout": 3}


def test_a_dynamic_global_batch_is_refused_by_name_before_the_island_is_built() -> None:
    args = SimpleNamespace(**ARGS, use_dynamic_global_batch_size=True)
    with pytest.raises(SettingsError, match="--use-dynamic-global-batch-size") as err:
        MilesIsland(args, model=[], optimizer=None)  # neither is touched: the refusal comes first
    assert "run the island without it" in str(err.value) and "\n" not in str(err.value)


def test_a_fixed_global_batch_gives_the_counts_the_island_uses() -> None:
    args = SimpleNamespace(**ARGS, use_dynamic_global_batch_size=False)
    assert tokens_per_step(args) == 64 * 512 and steps_per_rollout(args) == 16 * 8 // 64


@pytest.mark.parametrize("adapters", [2, 8])
def test_multi_lora_is_refused_by_name(adapters: int) -> None:
    args = SimpleNamespace(**ARGS, multi_lora_n_adapters=adapters)
    with pytest.raises(SettingsError, match="--multi-lora-n-adapters") as err:
        MilesIsland(args, model=[], optimizer=None)
    assert "run one adapter per island" in str(err.value) and "\n" not in str(err.value)


def test_no_multi_lora_is_no_refusal() -> None:
    from yeto_plugins.miles.hook import refuse_unaccounted

    refuse_unaccounted(SimpleNamespace(**ARGS, multi_lora_n_adapters=0, use_dynamic_global_batch_size=False))


def test_a_hooked_actor_without_the_settings_stops_naming_the_variable_and_the_fix(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in [n for n in os.environ if n.startswith("YETO_")]:
        monkeypatch.delenv(name)
    with pytest.raises(SettingsError, match="YETO_DILOCO_SYNCER is required") as err:
        MilesIsland(SimpleNamespace(**ARGS), model=[], optimizer=None)
    assert "--train-env-vars" in str(err.value) and "\n" not in str(err.value)
