"""An unmodified HF script joins a run with only `YETO_DILOCO_AUTO_ATTACH=1` and the syncer's
address in its environment (DESIGN §1.4), and ends with the final cut on disk when it relies on
the Trainer's own saving. Without the variable it imports nothing of yeto, whatever other
`YETO_DILOCO_*` variables are set."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    Proc,
    Procs,
    assert_bit_identical,
    base_env,
    checkpoint_params,
    learner_env,
    model_tensors,
    start_syncer,
    syncer_exit_code,
    wait_all,
)

pytestmark = pytest.mark.integration

ROUNDS = 8
MAX_STEPS = 2000  # far beyond what ROUNDS need: the syncer's final cut must end training

# Plain HF: no yeto import, no callback. It reports what it saw as one JSON line.
SCRIPT = """
import json, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

out, max_steps = sys.argv[1], int(sys.argv[2])
trainer_saves = sys.argv[3:] == ["trainer-saves"]  # like swift sft: only the Trainer's own checkpoints
torch.set_num_threads(1)
torch.manual_seed(0)
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                     tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
model = LlamaForCausalLM(config)
blocks = torch.randint(0, 64, (16, 32), generator=torch.Generator().manual_seed(1))  # 512 tokens
data = [{"input_ids": b, "labels": b, "attention_mask": torch.ones_like(b)} for b in blocks]
args = TrainingArguments(output_dir=out, max_steps=max_steps, per_device_train_batch_size=4, learning_rate=1e-3,
                         save_strategy="steps" if trainer_saves else "no", save_steps=max_steps, report_to=[],
                         use_cpu=True, disable_tqdm=True, logging_steps=50)
trainer = Trainer(model=model, args=args, train_dataset=data)
result = trainer.train()
if not trainer_saves:
    model.save_pretrained(out)
print(json.dumps({"event": "done", "steps": result.global_step,
                  "callbacks": [type(cb).__name__ for cb in trainer.callback_handler.callbacks],
                  "yeto_modules": sorted(m for m in sys.modules if m.startswith(("yeto", "syncer")))}))
"""


def start_script(procs: Procs, tmp_path: Path, name: str, env: dict[str, str], max_steps: int,
                 *extra: str) -> Proc:
    script = tmp_path / "plain_hf_train.py"
    if not script.exists():
        script.write_text(SCRIPT)
    out = tmp_path / f"{name}-model"
    # A fresh interpreter: what is under test is its start-up (the .pth hook) and what it imports.
    return procs.start(name, [sys.executable, str(script), str(out), str(max_steps), *extra], env=env,
                       output_dir=out, fresh=True)


def done_line(proc: Proc) -> dict[str, Any]:
    found = proc.events("done")
    assert len(found) == 1, proc.tail()
    return found[0]


@pytest.mark.timeout(120)
def test_an_unmodified_hf_script_joins_with_only_the_environment(procs: Procs, key_file: Path,
                                                                 tmp_path: Path) -> None:
    syncer = start_syncer(procs, key_file=key_file, learners=1, quorum=1, fragments=4, total_rounds=ROUNDS)
    env = learner_env(syncer, key_file, 0, auto_attach=1)
    learner = start_script(procs, tmp_path, "learner0", env, MAX_STEPS)

    assert wait_all([learner], timeout=90) == [0], procs.tails()
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()
    done = done_line(learner)
    assert done["callbacks"][0] == "YetoDiLoCo" and done["callbacks"].count("YetoDiLoCo") == 1, done
    assert 0 < done["steps"] < MAX_STEPS, f"the final cut did not end training\n{learner.tail()}"

    assert [r["round"] for r in syncer.commits()] == list(range(ROUNDS)), syncer.proc.tail()
    assert syncer.checkpoint is not None and learner.output_dir is not None
    assert_bit_identical(model_tensors(learner.output_dir), checkpoint_params(syncer.checkpoint),
                         "learner 0 vs the syncer's final checkpoint")


@pytest.mark.timeout(90)
def test_without_the_variable_the_script_never_imports_yeto(procs: Procs, key_file: Path, tmp_path: Path) -> None:
    # Nothing set, or the syncer's address and key without the variable (or with it false): nothing
    # of yeto is imported, nothing attaches, and the script trains alone.
    nothing = base_env()
    unset = base_env({"YETO_DILOCO_SYNCER": "127.0.0.1:9", "YETO_DILOCO_KEY_FILE": str(key_file)})
    runs = [start_script(procs, tmp_path, "nothing", nothing, 3),
            start_script(procs, tmp_path, "unset", unset, 3),
            start_script(procs, tmp_path, "false", {**unset, "YETO_DILOCO_AUTO_ATTACH": "0"}, 3)]
    assert wait_all(runs, timeout=75) == [0, 0, 0], procs.tails()
    for proc in runs:
        done = done_line(proc)
        assert done["steps"] == 3, done
        assert done["yeto_modules"] == [], f"{proc.name}: {done['yeto_modules']}"
        assert "YetoDiLoCo" not in done["callbacks"], done
        assert proc.output_dir is not None and (proc.output_dir / "model.safetensors").exists()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ends", ["at-the-final-cut", "at-max-steps"])
def test_a_script_that_relies_on_the_trainers_saving_ends_with_the_final_cut_on_disk(
        procs: Procs, key_file: Path, tmp_path: Path, ends: str) -> None:
    # The Trainer saves only at max_steps (save_steps = max_steps), as `swift sft` does: the step
    # that installs the final cut must save too, whether the syncer ends the run or max_steps does.
    early = ends == "at-the-final-cut"
    max_steps = MAX_STEPS if early else 12
    syncer = start_syncer(procs, key_file=key_file, learners=1, quorum=1, fragments=4,
                          total_rounds=ROUNDS if early else None)
    env = learner_env(syncer, key_file, 0, auto_attach=1)
    learner = start_script(procs, tmp_path, "learner0", env, max_steps, "trainer-saves")

    assert wait_all([learner], timeout=90) == [0], procs.tails()
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()
    steps = done_line(learner)["steps"]
    assert (0 < steps < max_steps) if early else steps == max_steps, learner.tail()
    said = [line for line in learner.stderr().splitlines() if "final cut installed at step" in line]
    assert len(said) == 1 and f"final cut installed at step {steps}" in said[0], learner.tail()
    assert "training stops and the Trainer saves it" in said[0], said
    assert learner.output_dir is not None and syncer.checkpoint is not None
    saved = learner.output_dir / f"checkpoint-{steps}"
    assert_bit_identical(model_tensors(saved), checkpoint_params(syncer.checkpoint),
                         f"{saved.name} vs the syncer's final checkpoint")
    history = json.loads((saved / "trainer_state.json").read_text())["log_history"]
    last = [entry for entry in history if entry.get("step") == steps and "yeto_pushes" in entry]
    assert last and last[-1]["yeto_final_cut"] == 1 and last[-1]["yeto_installs"] > 0, history
