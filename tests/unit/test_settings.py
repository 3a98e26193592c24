"""Settings: explicit arguments beat the environment; a bad value names its variable."""

import os
from pathlib import Path

import pytest
from pydantic import BaseModel

from tests.unit.clean_env import clean_env  # noqa: F401 - autouse: no YETO_* variable leaks in
from yeto_core.sections import DEFAULT_SYNC_INTERVAL, Schedule
from yeto_core.setting_names import flat_fields
from yeto_core.settings import (
    FINAL_CHECKPOINT_S,
    IsoWorkerSettings,
    LearnerSettings,
    SettingsError,
    SyncerSettings,
    load_settings,
    parse_address,
)

pytestmark = pytest.mark.unit


def test_learner_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("YETO_DILOCO_SYNCER", "127.0.0.1:7000")
    monkeypatch.setenv("YETO_DILOCO_LEARNER_ID", "3")
    monkeypatch.setenv("YETO_DILOCO_MERGE_ALPHA", "0.25")
    s = load_settings(LearnerSettings)
    assert s.address == ("127.0.0.1", 7000) and s.learner_id == 3 and s.merge_alpha == 0.25


def test_explicit_arguments_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("YETO_DILOCO_SYNCER", "127.0.0.1:7000")
    monkeypatch.setenv("YETO_DILOCO_SYNC_INTERVAL", "48")
    s = load_settings(LearnerSettings, syncer="10.1.2.3:9", sync_interval=12)
    assert s.syncer == "10.1.2.3:9" and s.sync_interval == 12


def test_h_is_the_syncers_unless_a_learner_sets_it_to_check(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_settings(LearnerSettings, syncer="h:1").sync_interval is None  # learned at the handshake
    syncer = load_settings(SyncerSettings, fragments=8, sync_interval_steps=0)
    assert syncer.schedule == Schedule(8, "binpack", 0)
    assert SyncerSettings().sync_interval_steps == DEFAULT_SYNC_INTERVAL
    monkeypatch.setenv("YETO_DILOCO_SYNC_INTERVAL", "12")
    assert load_settings(LearnerSettings, syncer="h:1").sync_interval == 12


@pytest.mark.parametrize(("var", "value", "needle"), [
    ("YETO_DILOCO_MERGE_ALPHA", "2", "YETO_DILOCO_MERGE_ALPHA='2'"),
    ("YETO_DILOCO_WIRE_DTYPE", "fp8", "YETO_DILOCO_WIRE_DTYPE='fp8'"),
    ("YETO_DILOCO_DATA_STREAMS", "0", "YETO_DILOCO_DATA_STREAMS='0'"),
    ("YETO_DILOCO_SYNCER", "nohost", "YETO_DILOCO_SYNCER='nohost'"),
    ("YETO_DILOCO_CONNECT_TIMEOUT_S", "inf", "YETO_DILOCO_CONNECT_TIMEOUT_S='inf': Input should be a finite number"),
    ("YETO_DILOCO_FINAL_TIMEOUT_S", "nan", "YETO_DILOCO_FINAL_TIMEOUT_S='nan'"),
])
def test_a_bad_value_names_the_variable(monkeypatch: pytest.MonkeyPatch, var: str, value: str, needle: str) -> None:
    monkeypatch.setenv("YETO_DILOCO_SYNCER", "127.0.0.1:7000")
    monkeypatch.setenv(var, value)
    with pytest.raises(SettingsError) as err:
        load_settings(LearnerSettings)
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_syncer_is_named() -> None:
    with pytest.raises(SettingsError, match="YETO_DILOCO_SYNCER is required"):
        load_settings(LearnerSettings)


def test_key_sources(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("k" * 32 + "\n")
    s = load_settings(LearnerSettings, syncer="h:1", key_file=key_file)
    assert s.read_key() == b"k" * 32
    with pytest.raises(SettingsError, match="exactly one of YETO_DILOCO_KEY or YETO_DILOCO_KEY_FILE"):
        load_settings(LearnerSettings, syncer="h:1").read_key()
    with pytest.raises(SettingsError, match="at least 16 bytes"):
        load_settings(LearnerSettings, syncer="h:1", key="short").read_key()
    with pytest.raises(SettingsError, match="cannot read the key file"):
        load_settings(LearnerSettings, syncer="h:1", key_file=tmp_path / "missing").read_key()


@pytest.mark.parametrize("change", ["overwritten", "removed"])
def test_the_key_file_is_read_once(change: str, tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("k" * 32)
    learner = load_settings(LearnerSettings, syncer="h:1", key_file=key_file)
    syncer = load_settings(SyncerSettings, key_file=key_file)
    assert learner.read_key() == syncer.read_key() == b"k" * 32
    if change == "overwritten":
        key_file.write_text("x" * 32)
    else:
        key_file.unlink()
    assert learner.read_key() == syncer.read_key() == b"k" * 32
    assert learner.endpoint().key == b"k" * 32


def test_syncer_quorum_cannot_exceed_learners(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("YETO_SYNCER_QUORUM", "5")
    with pytest.raises(SettingsError, match="quorum 5 exceeds learners 2"):
        load_settings(SyncerSettings, learners=2)
    assert load_settings(SyncerSettings, learners=3, quorum=0).effective_quorum == 3


@pytest.mark.parametrize(("learners", "quorum"), [(1, 1), (2, 2), (3, 3), (4, 3), (5, 4), (8, 6), (16, 12)])
def test_the_default_quorum_lets_a_quarter_of_the_fleet_miss_a_round(learners: int, quorum: int) -> None:
    assert load_settings(SyncerSettings, learners=learners).effective_quorum == quorum
    assert load_settings(SyncerSettings, learners=learners, quorum=learners).effective_quorum == learners


@pytest.mark.parametrize(("text", "expected"), [("a:1", ("a", 1)), ("[::1]:7000", ("::1", 7000)),
                                                 ("10.0.0.1:65535", ("10.0.0.1", 65535))])
def test_parse_address(text: str, expected: tuple[str, int]) -> None:
    assert parse_address(text) == expected


@pytest.mark.parametrize("text", ["a", "a:0", "a:70000", ":80", "a:b"])
def test_parse_address_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_address(text)


def test_a_misspelt_variable_is_named_with_the_setting_it_resembles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("YETO_DILOCO_SYNCER", "127.0.0.1:7000")
    monkeypatch.setenv("YETO_DILOCO_SYNC_INTERVL", "3")
    with pytest.raises(SettingsError, match="YETO_DILOCO_SYNC_INTERVL is not a yeto setting; did you mean "
                                            "YETO_DILOCO_SYNC_INTERVAL"):
        load_settings(LearnerSettings)
    monkeypatch.delenv("YETO_DILOCO_SYNC_INTERVL")
    monkeypatch.setenv("YETO_SYNCER_QUORAM", "2")
    with pytest.raises(SettingsError, match="YETO_SYNCER_QUORAM is not a yeto setting; did you mean YETO_SYNCER_QUO"):
        load_settings(SyncerSettings)


def test_a_sharded_syncer_address_is_refused_up_front(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SettingsError, match=r"YETO_DILOCO_SYNCER=.*sharded syncer .* is not supported"):
        monkeypatch.setenv("YETO_DILOCO_SYNCER", "10.0.0.1:7000,10.0.0.2:7000")
        load_settings(LearnerSettings, key="k" * 32)


def test_an_infinite_syncer_timeout_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("YETO_SYNCER_HANDSHAKE_TIMEOUT_S", "inf")
    with pytest.raises(SettingsError, match="YETO_SYNCER_HANDSHAKE_TIMEOUT_S='inf': Input should be a finite number"):
        load_settings(SyncerSettings)
    monkeypatch.delenv("YETO_SYNCER_HANDSHAKE_TIMEOUT_S")
    with pytest.raises(SettingsError, match="--round-timeout-s=inf"):
        load_settings(SyncerSettings, flags=True, round_timeout_s=float("inf"))


def test_a_key_file_others_can_read_is_warned_about(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("k" * 32)
    key_file.chmod(0o644)
    with caplog.at_level("WARNING", logger="yeto.settings"):
        assert load_settings(LearnerSettings, syncer="h:1", key_file=key_file).read_key() == b"k" * 32
    assert any("readable by other users (mode 644)" in r.getMessage() and "chmod 600" in r.getMessage()
               for r in caplog.records), caplog.text
    caplog.clear()
    key_file.chmod(0o600)
    with caplog.at_level("WARNING", logger="yeto.settings"):
        load_settings(LearnerSettings, syncer="h:1", key_file=key_file).read_key()
    assert not caplog.records


def test_a_key_file_given_by_flag_is_named_by_the_flag(tmp_path: Path) -> None:
    short = tmp_path / "short.key"
    short.write_text("short")
    settings = load_settings(SyncerSettings, flags=True, key_file=short)
    with pytest.raises(SettingsError, match=r"^--key-file=.*short.key: the key must be at least 16 bytes, got 5$"):
        settings.read_key(key_file_flag=True)
    with pytest.raises(SettingsError, match=r"^YETO_SYNCER_KEY_FILE=.*short.key: the key must be at least 16"):
        settings.read_key()


def test_each_section_carries_its_settings_and_their_defaults_do_not_drift() -> None:
    from yeto_core.sections import ConsensusSettings, Endpoint, IslandSettings, LinkSettings, MergeSettings
    from yeto_core.settings import LearnerSettings, SyncerSettings

    learner = LearnerSettings(syncer="10.0.0.2:7070", key="k" * 32, learner_id=3)
    assert learner.consensus == ConsensusSettings() and learner.island == IslandSettings()
    assert SyncerSettings().merging == MergeSettings().for_learners(2) == MergeSettings(outer_lr=0.7)
    assert learner.link == LinkSettings()
    assert learner.endpoint() == Endpoint(("10.0.0.2", 7070), b"k" * 32, 3)
    tuned = LearnerSettings(syncer="h:1", key="k" * 32, data_streams=4, wan_stall_timeout_s=9, collective_timeout_s=8,
                            consensus_every=0, wan_stream_schedule="adaptive")
    assert (tuned.link.data_streams, tuned.link.stall_timeout_s, tuned.link.stream_schedule) == (4, 9.0, "adaptive")
    assert tuned.island.heartbeat_s == 2.0 and tuned.consensus.every == 0
    assert SyncerSettings(outer_lr=0.3, merge="average").merging.outer_lr == 0.3


@pytest.mark.parametrize(("learners", "lr"), [(1, 0.7), (2, 0.7), (3, 0.6325), (4, 0.5886), (8, 0.4950),
                                              (16, 0.4162)])
def test_the_outer_lr_left_unset_shortens_with_the_fleet(learners: int, lr: float) -> None:
    from yeto_core.sections import default_outer_lr
    from yeto_core.settings import SyncerSettings

    assert default_outer_lr(learners) == pytest.approx(lr, abs=5e-5)
    assert SyncerSettings(learners=learners).merging.outer_lr == default_outer_lr(learners)
    # One set by name is kept whatever M, and the checkpoint records the lr stepped by, not the 0.
    assert SyncerSettings(learners=learners, outer_lr=0.7).merging.outer_lr == 0.7
    assert SyncerSettings(learners=learners, outer_lr=0).merging.outer_lr == default_outer_lr(learners)


def test_the_outer_lr_resolved_from_the_environment_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    from yeto_core.settings import SyncerSettings

    monkeypatch.setenv("YETO_SYNCER_LEARNERS", "8")
    assert SyncerSettings().merging.outer_lr == pytest.approx(0.4950, abs=5e-5)
    monkeypatch.setenv("YETO_SYNCER_OUTER_LR", "0.6")
    assert SyncerSettings().merging.outer_lr == 0.6
    assert SyncerSettings(outer_lr=0).merging.outer_lr == pytest.approx(0.4950, abs=5e-5)  # a flag wins


def test_a_learners_final_wait_outlasts_the_syncers_finalization() -> None:
    # DESIGN §4.7: from the last DONE, the rejoin wait, the final checkpoint and the hold of the cut,
    # all within the second half of the learner's wait (the first may go to settling its pushes).
    learner = LearnerSettings(syncer="h:1", key="k" * 32)
    syncer = SyncerSettings()
    assert (learner.final_timeout_s, syncer.rejoin_wait_s, syncer.final_timeout_s) == (300, 60, 60)  # the README's
    assert learner.final_timeout_s / 2 >= syncer.rejoin_wait_s + FINAL_CHECKPOINT_S + syncer.final_timeout_s


def numeric_fields(cls: type[BaseModel]) -> list[tuple[str, str]]:
    """(flat name, annotation) of every number a settings class reads, its sections' included."""
    out = []
    for name, flat in flat_fields(cls).items():
        kind = str(flat.info.annotation)
        if "int" in kind or "float" in kind:
            out.append((name, kind))
    return out


ABSURD = [(cls, name) for cls in (LearnerSettings, SyncerSettings, IsoWorkerSettings)
          for name, _ in numeric_fields(cls)]
assert {"heartbeat_s", "outer_lr", "consensus_every"} <= {name for _, name in ABSURD}  # the sections' too


@pytest.mark.parametrize(("cls", "name"), ABSURD, ids=[f"{c.__name__}.{n}" for c, n in ABSURD])
def test_every_number_has_an_upper_bound_and_an_absurd_value_is_named(
        cls: type, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # 10^12 overflows timers (seconds) and would allocate without end as a count: each is refused
    # with one line naming the variable, whatever the setting is.
    prefix = str(cls.model_config["env_prefix"])  # type: ignore[attr-defined]
    if cls is LearnerSettings:
        monkeypatch.setenv("YETO_DILOCO_SYNCER", "127.0.0.1:7000")
    variable = f"{prefix}{name.upper()}"
    monkeypatch.setenv(variable, "1000000000000")
    with pytest.raises(SettingsError) as caught:
        load_settings(cls)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{variable}='1000000000000': "), message


@pytest.mark.parametrize(("variable", "meant"), [
    ("YETO_SYNCR_QUORUM", "YETO_SYNCER_QUORUM"),
    ("YETO_SYNC_QUORUM", "YETO_SYNCER_QUORUM"),
    ("YETO_DILCO_SYNC_INTERVAL", "YETO_DILOCO_SYNC_INTERVAL"),
    ("YETODILOCO_SYNC_INTERVAL", "YETO_DILOCO_SYNC_INTERVAL"),
    ("YETO_DILOCOO_LEARNER_ID", "YETO_DILOCO_LEARNER_ID"),
    ("YETO_ISO_WROKER_THREADS", "YETO_ISO_WORKER_THREADS"),
])
def test_a_misspelt_prefix_is_named_with_the_setting_it_resembles(
        variable: str, meant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("YETO_DILOCO_SYNCER", "127.0.0.1:7000")
    monkeypatch.setenv(variable, "5")
    cls = next(c for c in (LearnerSettings, SyncerSettings, IsoWorkerSettings)
               if meant.startswith(str(c.model_config["env_prefix"])))  # type: ignore[attr-defined]
    with pytest.raises(SettingsError, match=f"^{variable} is not a yeto setting; did you mean {meant}\\?$"):
        load_settings(cls)


def test_variables_of_other_tools_and_of_other_sections_are_not_taken_for_misspellings(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in ("YETO_PROBE", "YETO_TEST_RESULT_DIR", "YETO_ISO_WORKER_THREADS",
                     "YETO_DILOCO_SYNC_INTERVAL"):
        monkeypatch.setenv(variable, "1")
    assert load_settings(SyncerSettings).quorum == 0
    monkeypatch.setenv("YETO_SYNCER_QUORUM", "1")
    assert load_settings(LearnerSettings, syncer="h:1").sync_interval == 1


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "gpu", "cpu:0:1"])
def test_a_device_that_is_not_one_is_named(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("YETO_SYNCER_DEVICE", device)
    with pytest.raises(SettingsError, match=f"^YETO_SYNCER_DEVICE='{device}': expected auto, cpu, cuda or cuda:N$"):
        load_settings(SyncerSettings)


@pytest.mark.parametrize("where", ["/dev/zero", "/dev/null", "directory", "fifo", "huge"])
def test_a_key_file_is_a_small_regular_file(where: str, tmp_path: Path) -> None:
    path = Path(where)
    if where == "directory":
        path = tmp_path
    elif where == "fifo":
        path = tmp_path / "fifo"
        os.mkfifo(path)  # a read of it would block until a writer came
    elif where == "huge":
        path = tmp_path / "huge"
        with path.open("wb") as f:
            f.truncate(1 << 30)  # sparse: 1 GiB that costs no disk
    settings = load_settings(SyncerSettings, key_file=path)
    with pytest.raises(SettingsError, match=f"^YETO_SYNCER_KEY_FILE={path}: (not a regular file|.*is not a key)"):
        settings.read_key()
