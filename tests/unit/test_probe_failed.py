"""A link too slow to join (DESIGN §7.6): `yeto_core` raises `ProbeFailed` and never exits a process;
the plugins that start an island inside a trainer's process exit with its code, 75, after its one
line (`yeto_plugins.exits`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from learner_harness import hand_fed

from yeto_core.probe import PROBE_EXIT_CODE, ProbeResult
from yeto_core.refusal import ProbeFailed
from yeto_core.settings import LearnerSettings
from yeto_core.wire.errors import WireError
from yeto_plugins.exits import island_exit

pytestmark = pytest.mark.unit


def slow(**settings: Any) -> ProbeFailed:
    s, link, _, said = hand_fed([("w", torch.zeros(2))], **settings)
    link.measured = ProbeResult(12.5, 3.0)
    with pytest.raises(ProbeFailed) as failed:
        s.start()
    assert said == [] and link.layout is None  # nothing said, never dialed
    return failed.value


def test_probe_failed_names_what_was_measured_against_which_minimum_and_carries_exit_code_75() -> None:
    up = slow(wan_probe_min_mbps=100)
    assert up.exit_code == PROBE_EXIT_CODE == 75 and up.learner_id == 0
    assert str(up) == ("yeto learner 0: too slow to join: link to 127.0.0.1:9 measured 12.5 Mbit/s up and 3.0 "
                       "Mbit/s down; YETO_DILOCO_WAN_PROBE_MIN_MBPS=100, YETO_DILOCO_WAN_PROBE_MIN_DOWN_MBPS=0")
    assert str(up).endswith(up.reason) and "\n" not in str(up)
    down = slow(wan_probe_min_down_mbps=10, learner_id=3)
    assert str(down).startswith("yeto learner 3: too slow to join:") and down.exit_code == 75


def test_a_probe_that_cannot_measure_fails_the_same_way() -> None:
    s, link, _, _ = hand_fed([("w", torch.zeros(2))], wan_probe_min_mbps=1)

    def broken(nbytes: int) -> ProbeResult:
        raise WireError("connection reset")

    link.measure = broken  # type: ignore[method-assign]
    with pytest.raises(ProbeFailed, match=r"too slow to join: the bandwidth probe to 127.0.0.1:9 failed "
                                          r"\(connection reset\)"):
        s.start()


def test_a_fast_link_joins() -> None:
    s, link, _, _ = hand_fed([("w", torch.zeros(2))], wan_probe_min_mbps=100, wan_probe_min_down_mbps=100)
    link.bcast(0, 0, 0, torch.zeros(2))
    s.start()
    assert s.stats.probe == ProbeResult(1000.0, 1000.0) and link.layout is not None


def test_a_plugin_exits_75_with_the_one_line_and_lets_every_other_error_through(
        capsys: pytest.CaptureFixture[str]) -> None:
    settings = LearnerSettings(syncer="h:1", key="k" * 32, learner_id=2)
    with pytest.raises(SystemExit) as exited, island_exit():
        raise ProbeFailed(settings, "link to h:1 measured 1.0 Mbit/s up")
    assert exited.value.code == 75
    assert capsys.readouterr().err == "yeto learner 2: too slow to join: link to h:1 measured 1.0 Mbit/s up\n"
    with pytest.raises(ValueError, match="other"), island_exit():
        raise ValueError("other")
    with island_exit():
        pass
    assert capsys.readouterr().err == ""


def test_the_hf_callback_ends_the_process_with_75_when_its_island_may_not_join(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    import transformers

    from yeto_plugins.hf import callback

    settings = LearnerSettings(syncer="h:1", key="k" * 32)

    class TooSlow:
        def start(self, first_step: int = 0) -> None:
            raise ProbeFailed(settings, "link to h:1 measured 1.0 Mbit/s up")

    monkeypatch.setattr(callback, "build_island", lambda *a, **kw: TooSlow())
    yeto = callback.YetoDiLoCo(syncer="h:1", key="k" * 32)
    args = transformers.TrainingArguments(output_dir="/nonexistent-unused", use_cpu=True, report_to=[])
    with pytest.raises(SystemExit) as exited:
        yeto.on_train_begin(args, transformers.TrainerState(), transformers.TrainerControl(),
                            model=torch.nn.Linear(2, 2))
    assert exited.value.code == 75
    assert capsys.readouterr().err.splitlines() == ["yeto learner 0: too slow to join: link to h:1 measured 1.0 "
                                                    "Mbit/s up"]
