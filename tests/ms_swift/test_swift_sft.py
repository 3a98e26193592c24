"""The real `swift sft` command trains two islands through auto-attach, as the README's ms-swift recipe says.

Nothing of swift is patched and yeto is named nowhere on its command line: `YETO_DILOCO_AUTO_ATTACH=1` and the
syncer's address in each island's environment make swift's Trainer a learner (yeto's start-up hook,
`yeto-autoattach.pth`). The syncer ends the run after its rounds; each island stops at the step that installed
the final cut, and the checkpoint swift itself writes at that step is the syncer's final checkpoint, bit for bit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_swift_model import write_shards
from trainer_processes import Run, island_env, start, start_syncer, stopped_at_exit

ISLANDS = 2
ROUNDS = 6
H = 4  # inner steps per round of a fragment; 2 fragments: a boundary every 2 steps
MAX_STEPS = 400  # far beyond what ROUNDS need: the syncer's final cut must end training
SWIFT = Path(sys.executable).with_name("swift")  # the console script ms-swift installs into the venv
FINAL_LINE = "final cut installed at step"


def swift_sft(model: Path, data: Path, out: Path, seed: int) -> list[str]:
    """An ordinary `swift sft` line for a full fine-tune on the CPU; nothing in it names yeto."""
    return [str(SWIFT), "sft", "--model", str(model), "--model_type", "qwen2", "--template", "qwen2_5",
            "--dataset", str(data), "--tuner_type", "full", "--torch_dtype", "float32", "--use_cpu", "true",
            "--max_steps", str(MAX_STEPS), "--per_device_train_batch_size", "2", "--gradient_accumulation_steps",
            "1", "--max_length", "512", "--learning_rate", "1e-3", "--logging_steps", "5", "--seed", str(seed),
            "--dataset_num_proc", "1", "--dataloader_num_workers", "0", "--report_to", "none", "--check_model", "false",
            "--output_dir", str(out)]


def checkpoint_of(run: Run, out: Path) -> Path:
    """The checkpoint swift names as its last (`last_model_checkpoint: DIR`)."""
    said = [line.split("last_model_checkpoint: ", 1)[1].strip() for line in run.text().splitlines()
            if "last_model_checkpoint: " in line]
    assert len(said) == 1, run.tail()
    path = Path(said[0])
    assert path.parent.parent == out, path
    return path


@pytest.mark.timeout(300)
def test_two_swift_sft_islands_end_on_the_syncers_final_cut(swift_model: Path, tmp_path: Path) -> None:
    syncer = start_syncer(tmp_path, "--quorum", "2", "--total-rounds", str(ROUNDS), "--sync-interval-steps", str(H))
    shards = write_shards(tmp_path, ISLANDS)
    outs = [tmp_path / f"island{i}" for i in range(ISLANDS)]
    with stopped_at_exit(syncer.run) as running:
        for i in range(ISLANDS):
            env = island_env(syncer, i, auto_attach=1, sync_interval=H, final_timeout_s=120)
            running.append(start(f"swift sft {i}", swift_sft(swift_model, shards[i], outs[i], seed=i + 1),
                                 tmp_path / f"island{i}.log", env))
        islands = running[1:]
        for island in islands:
            assert island.wait(240) == 0, "\n".join(run.tail() for run in running)
        assert syncer.run.wait(60) == 0, syncer.run.tail()

    tape = [json.loads(line) for line in syncer.tape.read_text().splitlines() if line.strip()]
    assert [r["round"] for r in tape if r["event"] == "commit"] == list(range(ROUNDS)), syncer.run.tail()
    final = {k.removeprefix("param/"): v for k, v in load_file(str(syncer.checkpoint)).items()
             if k.startswith("param/")}
    for i, (island, out) in enumerate(zip(islands, outs, strict=True)):
        said = [line[line.index("yeto learner"):] for line in island.text().splitlines() if FINAL_LINE in line]
        assert len(said) == 1, island.tail()  # once per island
        step = int(said[0].split(FINAL_LINE, 1)[1].split(";")[0])
        assert 0 < step < MAX_STEPS and said[0].startswith(f"yeto learner {i}: "), said
        saved = checkpoint_of(island, out)
        assert saved.name == f"checkpoint-{step}", (saved, said)
        weights = load_file(str(saved / "model.safetensors"))
        assert weights.keys() == final.keys(), sorted(set(weights) ^ set(final))
        differ = [name for name, tensor in weights.items() if not torch.equal(tensor, final[name])]
        assert not differ, f"island {i}'s {saved.name} differs from the final checkpoint in {differ}"
        history = json.loads((saved / "trainer_state.json").read_text())["log_history"]
        last = [entry for entry in history if entry.get("step") == step and "yeto_pushes" in entry]
        assert last and last[-1]["yeto_final_cut"] == 1 and last[-1]["yeto_pushes"] > 0, history[-3:]
