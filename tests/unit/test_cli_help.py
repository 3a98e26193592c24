"""The syncer's flags come from its settings: `--help` shows each field's description and default,
flags win over the environment, and the former millisecond names still work, with a warning."""

import logging
import re

import pytest

from syncer.service import cli
from tests.unit.clean_env import clean_env  # noqa: F401 - autouse: no YETO_* variable leaks in
from yeto_core.setting_names import flat_fields, flat_value
from yeto_core.settings import SettingsError, SyncerSettings, load_settings

pytestmark = pytest.mark.unit


def help_entries(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """`--help`, one entry per flag (its help joined into one line), from a terminal wide enough
    that argparse wraps nothing."""
    monkeypatch.setenv("COLUMNS", "1000")
    entries: dict[str, str] = {}
    flag = ""
    for line in cli.build_parser().format_help().splitlines():
        m = re.match(r"  (--[a-z-]+)(.*)", line)
        if m:
            flag = m.group(1)
            entries[flag] = m.group(2)
        elif flag and line.startswith("    "):
            entries[flag] += line
    return {f: " ".join(text.split()) for f, text in entries.items()}


def settings_from_main(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> SyncerSettings:
    """The settings `cli.main` builds from `argv`, taken before it starts anything."""
    built: list[SyncerSettings] = []

    def build_then_stop(cls: type[SyncerSettings], **explicit: object) -> SyncerSettings:
        built.append(load_settings(cls, **explicit))
        raise SettingsError("stop here")

    monkeypatch.setattr(cli, "load_settings", build_then_stop)
    assert cli.main(argv) == 2
    return built[0]


def test_every_setting_is_a_flag_with_its_description_and_default(monkeypatch: pytest.MonkeyPatch) -> None:
    entries = help_entries(monkeypatch)
    flags = {name: flat.info for name, flat in flat_fields(SyncerSettings).items() if name not in cli.NOT_FLAGS}
    assert len(flags) > 40 and "key" not in flags and "outer_lr" in flags and "wan_stall_timeout_s" in flags
    for name, field in flags.items():
        flag = "--" + name.replace("_", "-")
        assert flag in entries, f"{name} has no flag"
        assert field.description, f"{name} has no description for its help"
        expected = f"{field.description} (default {cli.shown_default(name, field.default)})"
        assert expected in entries[flag], f"{flag}: {entries[flag]!r}"
    assert "--key" not in entries and "--key-file" in entries and "--log-level" in entries


@pytest.mark.parametrize(("flag", "shown"), [
    ("--round-timeout-s", "(default 120 s)"), ("--grace-s", "(default 5 s)"), ("--outer-lr", "0.49 for 8) (default 0)"),
    ("--learners", "(default 2)"), ("--pattern", "(default binpack)"), ("--checkpoint", "(default none)"),
    ("--resume", "(default off)"), ("--wan-stall-timeout-s", "(0: off) (default 0 s)"),
])
def test_defaults_read_as_values_and_durations(monkeypatch: pytest.MonkeyPatch, flag: str, shown: str) -> None:
    assert help_entries(monkeypatch)[flag].endswith(shown)


def test_flags_default_to_not_given() -> None:
    args = vars(cli.build_parser().parse_args([]))
    assert {k: v for k, v in args.items() if v is not None} == {"log_level": "INFO"}


def test_a_flag_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("YETO_SYNCER_GRACE_S", "3")
    monkeypatch.setenv("YETO_SYNCER_PATTERN", "strided")
    assert settings_from_main([], monkeypatch).grace_s == 3.0
    settings = settings_from_main(["--grace-s", "0.5", "--pattern", "binpack", "--resume"], monkeypatch)
    assert (settings.grace_s, settings.pattern, settings.resume) == (0.5, "binpack", True)


@pytest.mark.parametrize(("argv", "env"), [(["--grace-ms", "250"], {}), ([], {"YETO_SYNCER_GRACE_MS": "250"})])
def test_the_former_millisecond_name_is_read_in_seconds_with_a_warning(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, argv: list[str],
        env: dict[str, str]) -> None:
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    with caplog.at_level(logging.WARNING, logger="yeto.settings"):
        assert settings_from_main(argv, monkeypatch).grace_s == 0.25
    warnings = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert len(warnings) == 1 and ("--grace-s" in warnings[0] or "YETO_SYNCER_GRACE_S" in warnings[0]), warnings


@pytest.mark.parametrize(("argv", "env", "new", "seconds"), [
    (["--min-round-interval-ms", "300"], {}, "min_round_interval_s", 0.3),
    ([], {"YETO_SYNCER_MIN_ROUND_INTERVAL_MS": "300"}, "min_round_interval_s", 0.3),
    (["--wan-stall-timeout", "7"], {}, "wan_stall_timeout_s", 7.0),
    ([], {"YETO_SYNCER_WAN_STALL_TIMEOUT": "7"}, "wan_stall_timeout_s", 7.0),
])
def test_every_former_name_still_works(monkeypatch: pytest.MonkeyPatch, argv: list[str], env: dict[str, str],
                                       new: str, seconds: float) -> None:
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert flat_value(settings_from_main(argv, monkeypatch), new) == pytest.approx(seconds)


def test_a_former_name_beside_its_new_one_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SettingsError, match="--grace-ms and --grace-s are both given"):
        load_settings(SyncerSettings, flags=True, grace_ms=250.0, grace_s=1.0)
    monkeypatch.setenv("YETO_SYNCER_GRACE_MS", "250")
    monkeypatch.setenv("YETO_SYNCER_GRACE_S", "1")
    with pytest.raises(SettingsError, match="YETO_SYNCER_GRACE_MS and YETO_SYNCER_GRACE_S are both set"):
        load_settings(SyncerSettings)


def test_a_flag_beats_a_former_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("YETO_SYNCER_GRACE_MS", "250")
    assert load_settings(SyncerSettings, flags=True, grace_s=1.0).grace_s == 1.0


@pytest.mark.parametrize(("argv", "env", "needle"), [
    (["--grace-s", "-1"], {}, "--grace-s=-1.0: Input should be greater than or equal to 0"),
    ([], {"YETO_SYNCER_GRACE_S": "-1"}, "YETO_SYNCER_GRACE_S='-1': Input should be greater than or equal to 0"),
    (["--grace-ms", "-5"], {}, "--grace-ms=-5.0: Input should be greater than or equal to 0"),
    ([], {"YETO_SYNCER_GRACE_MS": "soon"}, "YETO_SYNCER_GRACE_MS='soon': expected a number"),
    ([], {"YETO_SYNCER_ROUND_TIMEOUT_S": "0"}, "YETO_SYNCER_ROUND_TIMEOUT_S='0': Input should be greater than 0"),
])
def test_a_bad_value_names_its_flag_or_variable(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                                argv: list[str], env: dict[str, str], needle: str) -> None:
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert cli.main(argv) == 2
    assert needle in capsys.readouterr().err


def test_a_value_of_the_wrong_type_is_named_by_argparse(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--grace-s", "soon"])
    assert "argument --grace-s: invalid float value: 'soon'" in capsys.readouterr().err


def test_former_variables_are_not_reported_as_unknown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("YETO_SYNCER_WAN_STALL_TIMEOUT", "2")
    assert load_settings(SyncerSettings).streams.stall_timeout_s == 2.0
    monkeypatch.setenv("YETO_SYNCER_GRACE_M", "2")
    with pytest.raises(SettingsError, match="YETO_SYNCER_GRACE_M is not a yeto setting; did you mean"):
        load_settings(SyncerSettings)
