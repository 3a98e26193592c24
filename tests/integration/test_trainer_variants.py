"""The HF callback under the `TrainingArguments` scripts set (DESIGN §1.4): gradient accumulation,
bf16 weights, epochs instead of `max_steps`, evaluation and checkpoints during training, a decaying
schedule, another optimizer with clipping, plain SGD. Two islands of each end with the syncer's
final cut, bit-identical to each other and to the checkpoint (bf16 weights: to it rounded to
bf16), and learn.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import (
    ROOT,
    Procs,
    assert_bit_identical,
    checkpoint_params,
    learner_env,
    start_syncer,
    syncer_exit_code,
    wait_all,
)

pytestmark = pytest.mark.integration

LEARNER = ROOT / "tests" / "integration" / "variant_learner.py"
VARIANTS = {
    "gradient-accumulation": {"gradient_accumulation_steps": 3},
    "bf16-weights": {"dtype": "bf16"},
    "epochs": {"max_steps": -1, "num_train_epochs": 1},
    "evaluation-during-training": {"eval_strategy": "steps", "eval_steps": 7},
    "cosine-schedule": {"lr_scheduler_type": "cosine", "warmup_steps": 5},
    "checkpoints-during-training": {"save_strategy": "steps", "save_steps": 10},
    "adafactor-clipped": {"optim": "adafactor", "max_grad_norm": 0.5},
    "sgd": {"optim": "sgd", "learning_rate": 0.05},
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_two_islands_under_the_variant_end_with_the_final_cut(procs: Procs, key_file: Path, variant: str) -> None:
    from transformers import AutoModelForCausalLM

    syncer = start_syncer(procs, key_file=key_file, learners=2, quorum=2, fragments=4, total_rounds=12)
    learners = []
    for i in range(2):
        out = procs.workdir / f"learner{i}"
        env = learner_env(syncer, key_file, i)
        env["TRAINER_VARIANT"] = json.dumps(VARIANTS[variant])
        learners.append(procs.start(f"learner{i}", [sys.executable, str(LEARNER), str(out)], env=env, output_dir=out))
    assert wait_all(learners, timeout=150) == [0, 0], procs.tails()
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()
    assert syncer.checkpoint is not None
    reference = checkpoint_params(syncer.checkpoint)
    for lp in learners:
        (final,) = lp.events("eval", phase="final")
        assert final["final_cut"] is True and final["loss"] < final["first"], lp.tail()
        assert lp.output_dir is not None
        state = AutoModelForCausalLM.from_pretrained(lp.output_dir).state_dict()
        missing = sorted(set(reference) - set(state))
        assert not missing, f"{variant} {lp.name}: the saved model lacks synced tensors {missing}"
        weights = {name: state[name] for name in reference}
        assert_bit_identical(weights, {name: t.to(weights[name].dtype) for name, t in reference.items()},
                             f"{variant} {lp.name}")
