"""Families yeto was not written against: two HF islands of each, built from its config by the
example's `--model-type`, end bit-identical with the syncer's checkpoint, and `yeto-export` of that
checkpoint loads back as the same model (DESIGN §1.4, §6.5).

Each family brings a shape of its own: GPT-2's fused Conv1D projections and learned positions,
GPT-NeoX's fused QKV, Mixtral's and Qwen3-MoE's 3-D expert tensors and routers (which
`save_pretrained` writes back out per expert, under other names than the parameters'), Mamba's
state-space parameters, Gemma-2's soft-capped logits, OPT's offset positions.
`YETO_TEST_FAMILIES=qwen2,bloom,...` runs the test on those model types instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import (
    EXAMPLE,
    ROOT,
    TINY_MODEL,
    Procs,
    assert_bit_identical,
    base_env,
    checkpoint_params,
    eval_loss,
    model_dir,
    start_learner,
    start_syncer,
    syncer_exit_code,
    wait_all,
)

pytestmark = pytest.mark.integration

FAMILIES = os.environ.get("YETO_TEST_FAMILIES", "gpt2,gpt_neox,mixtral,qwen3_moe,mamba,gemma2,opt").split(",")


def loaded(directory: Path, names: set[str]) -> dict:
    """The model `from_pretrained` builds from `directory`, its tensors of `names` (a tied one
    appears under both of its names in the model's state and once in the checkpoint)."""
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(directory).state_dict()
    missing = sorted(names - set(state))
    assert not missing, f"{directory}: the saved model lacks synced tensors {missing}"
    return {name: state[name] for name in names}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("family", FAMILIES)
def test_two_islands_of_the_family_end_identical_and_export(procs: Procs, key_file: Path, family: str) -> None:
    from syncer.tools.export import export

    syncer = start_syncer(procs, key_file=key_file, learners=2, quorum=2, fragments=4, total_rounds=12)
    learners = [start_learner(procs, syncer, key_file, i, max_steps=3000, model_args=(*TINY_MODEL, "--model-type",
                                                                                    family)) for i in range(2)]
    assert wait_all(learners, timeout=150) == [0, 0], procs.tails()
    assert syncer_exit_code(syncer) == 0, syncer.proc.tail()
    assert syncer.checkpoint is not None
    reference = checkpoint_params(syncer.checkpoint)
    for lp in learners:
        first, last = eval_loss(lp, "initial"), eval_loss(lp, "final")
        assert last["final_cut"] is True, lp.tail()
        assert last["loss"] < first["loss"], f"{lp.name}: loss did not fall ({first['loss']} -> {last['loss']})"
        assert_bit_identical(loaded(model_dir(lp), set(reference)), reference, f"{family} {lp.name}")

    exported = procs.workdir / "exported"
    export(syncer.checkpoint, str(model_dir(learners[0])), exported)
    assert_bit_identical(loaded(exported, set(reference)), reference, f"{family} yeto-export")


@pytest.mark.timeout(120)
def test_an_unknown_model_type_is_one_line_and_exit_2(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(EXAMPLE), "--output-dir", str(tmp_path), "--no-sync", "--model-type",
                          "no_such_family"], cwd=ROOT, env=base_env(), capture_output=True, text=True, timeout=100)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        "hf_tiny_llama: --model-type no_such_family: not a model type this transformers knows (AutoConfig.for_model)"]
