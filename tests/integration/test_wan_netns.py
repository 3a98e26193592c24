"""WAN emulation (DESIGN §7.6): the syncer and two learners in separate network namespaces, across a
veth link shaped by tc. The run completes its rounds and every learner ends with the syncer's final
checkpoint, bit for bit. Skips, saying exactly what failed, where the machine cannot emulate the link."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import Procs, checkpoint_params, commits, read_tape, syncer_exit_code, wait_all
from netns import Shape, start_learner_in, start_syncer_in, wan_link
from safetensors.torch import load_file

pytestmark = pytest.mark.integration

ROUNDS = 16
LEARNER = Path(__file__).resolve().parent / "netns_learner.py"

SHAPES = {
    # A lossy WAN link (DESIGN §7.6): needs the kernel's netem qdisc.
    "netem-50mbit-20ms-loss0.5": Shape(rate="50mbit", delay="20ms", loss="0.5%"),
    # A rate limit alone (tbf), for kernels without netem.
    "tbf-20mbit": Shape(rate="20mbit"),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_learners_across_a_shaped_link_end_with_the_syncers_bits(procs: Procs, key_file: Path, shape: Shape) -> None:
    with wan_link(procs, shape) as link:
        syncer = start_syncer_in(procs, link, key_file=key_file, learners=2, quorum=2, fragments=4,
                                 total_rounds=ROUNDS)
        assert syncer.checkpoint is not None and syncer.tape is not None
        outs = [procs.workdir / f"learner{i}.safetensors" for i in range(2)]
        learners = [
            start_learner_in(procs, link, [sys.executable, str(LEARNER), "--syncer", syncer.address, "--key-file",
                                           str(key_file), "--learner-id", str(i), "--out", str(outs[i])],
                             name=f"learner{i}")
            for i in range(2)
        ]
        codes = wait_all(learners, 180)
        assert codes == [0, 0], procs.tails()
        assert syncer_exit_code(syncer) == 0, syncer.proc.tail()
        done = commits(read_tape(syncer.tape))
        assert [c["round"] for c in done] == list(range(ROUNDS)), procs.tails()
        reference = checkpoint_params(syncer.checkpoint)
        for i, out in enumerate(outs):
            params = load_file(str(out))
            assert set(params) == set(reference), f"learner {i}: {sorted(params)} vs {sorted(reference)}"
            for name, tensor in params.items():
                assert torch.equal(tensor, reference[name]), f"learner {i}: {name} differs from the final checkpoint"
        shaped = link.qdiscs()
        assert shape.kind in shaped, shaped
