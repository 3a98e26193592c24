"""A bad setting fails at start-up with one message that names it (DESIGN §1.6, yeto_core.settings)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import EXAMPLE, TINY_MODEL, Procs, base_env, learner_env, syncer_argv

pytestmark = pytest.mark.integration


def lines_naming(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if name in line]


@pytest.mark.timeout(120)
def test_bad_merge_alpha_and_bad_quorum_fail_with_one_clear_message(procs: Procs, key_file: Path,
                                                                     tmp_path: Path) -> None:
    # The example imports transformers (slow), so the syncer checks run while it starts.
    env = learner_env("127.0.0.1:9", key_file, 0, merge_alpha="2")
    example = procs.start("example", [sys.executable, str(EXAMPLE), "--output-dir", str(tmp_path / "out"),
                                      "--max-steps", "5", *TINY_MODEL], env=env)

    quorum_env = procs.start("syncer-env-quorum", syncer_argv(key_file=key_file, learners=2, quorum=None),
                             env=base_env({"YETO_SYNCER_QUORUM": "5"}))
    quorum_flag = procs.start("syncer-flag-quorum", syncer_argv(key_file=key_file, learners=2, quorum=5))
    short_key = tmp_path / "short.key"
    short_key.write_text("too-short")
    key_short = procs.start("syncer-short-key", syncer_argv(key_file=short_key))
    no_key = procs.start("syncer-no-key", syncer_argv(key_file=None))

    for proc, name, words in [
        (quorum_env, "YETO_SYNCER_QUORUM", ("quorum 5", "learners 2")),
        (quorum_flag, "--quorum", ("quorum 5", "learners 2")),
        (key_short, "--key-file", ("at least 16 bytes",)),  # the key came from the flag: errors name it
        (no_key, "YETO_SYNCER_KEY", ("KEY_FILE",)),
    ]:
        assert proc.wait(timeout=60) == 2, proc.tail()
        err = proc.stderr()
        assert "Traceback" not in err, proc.tail()
        named = lines_naming(err, name)
        assert len(named) == 1 and named[0].startswith("yeto syncer:"), proc.tail()
        assert all(w in named[0] for w in words), named[0]
        assert "listening" not in proc.stdout()

    code = example.wait(timeout=90)
    err = example.stderr()
    assert code != 0, example.tail()
    named = lines_naming(err, "YETO_DILOCO_MERGE_ALPHA")
    assert len(named) == 1, example.tail()
    assert "Traceback" not in err, f"the example let the settings error escape with a traceback\n{example.tail()}"
    assert "2" in named[0] and "1" in named[0], named[0]  # the value and the accepted bound
    assert not (tmp_path / "out" / "model.safetensors").exists()
