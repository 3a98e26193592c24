"""Nested settings, flat names: each section's field is set by one variable, flag or argument,
explicit values still win over the environment, and every error names what the user wrote."""


import pytest
from pydantic import BaseModel

from syncer.service import cli
from tests.unit.clean_env import clean_env  # noqa: F401 - autouse: no YETO_* variable leaks in
from yeto_core.sections import ConsensusSettings, LinkSettings, MergeSettings, Section, StreamSettings
from yeto_core.setting_names import flat_fields, flat_of, flat_value, nest
from yeto_core.settings import LearnerSettings, SettingsError, SyncerSettings, load_settings

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("cls", [LearnerSettings, SyncerSettings])
def test_every_field_of_every_section_has_exactly_one_flat_name(cls: type[BaseModel]) -> None:
    fields = flat_fields(cls)
    paths = [field.path for field in fields.values()]
    assert len(set(paths)) == len(paths)
    expected = set()
    for name, info in cls.model_fields.items():
        kind = info.annotation
        section = kind if isinstance(kind, type) and issubclass(kind, Section) else None
        expected |= {(name, sub) for sub in section.model_fields} if section else {(name,)}
    assert set(paths) == expected
    assert not {"link", "consensus", "island", "streams", "merging"} & set(fields)  # a section is no setting


def test_flat_names_where_the_component_calls_a_field_otherwise() -> None:
    learner, syncer = flat_fields(LearnerSettings), flat_fields(SyncerSettings)
    assert learner["wan_stall_timeout_s"].path == ("link", "stall_timeout_s")
    assert learner["wan_stream_schedule"].path == ("link", "stream_schedule")
    assert learner["consensus_every"].path == ("consensus", "every")
    assert learner["collective_timeout_s"].path == ("island", "collective_timeout_s")
    assert syncer["heartbeat_s"].path == ("streams", "heartbeat_s")
    assert syncer["outer_lr"].path == ("merging", "outer_lr")
    # The stream rules are written once, for both ends: the learner's link extends the syncer's streams.
    assert issubclass(LinkSettings, StreamSettings)
    ours, theirs = (learner["heartbeat_s"].info, syncer["heartbeat_s"].info)
    assert (ours.default, ours.description, ours.metadata) == (theirs.default, theirs.description, theirs.metadata)


def test_the_environment_reaches_the_sections(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("YETO_DILOCO_SYNCER", "127.0.0.1:7000")
    monkeypatch.setenv("YETO_DILOCO_WAN_STALL_TIMEOUT_S", "9")
    monkeypatch.setenv("yeto_diloco_consensus_every", "0")  # case does not matter, as for any variable
    monkeypatch.setenv("YETO_DILOCO_RL_MODE", "sweep")
    learner = load_settings(LearnerSettings)
    assert (learner.link.stall_timeout_s, learner.consensus.every, learner.link.rl_mode) == (9.0, 0, "sweep")
    assert learner.sweeps and flat_value(learner, "wan_stall_timeout_s") == 9.0
    monkeypatch.setenv("YETO_SYNCER_OUTER_LR", "0.4")
    monkeypatch.setenv("YETO_SYNCER_PEER_TIMEOUT_S", "12")
    syncer = load_settings(SyncerSettings)
    assert syncer.merging == MergeSettings(outer_lr=0.4) and syncer.streams == StreamSettings(peer_timeout_s=12)


def test_explicit_values_win_over_the_environment_field_by_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("YETO_DILOCO_SYNCER", "127.0.0.1:7000")
    monkeypatch.setenv("YETO_DILOCO_HEARTBEAT_S", "3")
    monkeypatch.setenv("YETO_DILOCO_DATA_STREAMS", "5")
    learner = load_settings(LearnerSettings, heartbeat_s=1.5)
    assert (learner.link.heartbeat_s, learner.link.data_streams) == (1.5, 5)  # the rest of the section stays read
    whole = LearnerSettings(link=LinkSettings(data_streams=1))  # a section given whole is given whole
    assert (whole.link.heartbeat_s, whole.link.data_streams) == (2.0, 1)
    both = LearnerSettings(link=LinkSettings(data_streams=1), overlap=False)  # a flat value lands in it
    assert (both.link.data_streams, both.link.overlap) == (1, False)
    monkeypatch.setenv("YETO_SYNCER_MERGE", "average")
    assert load_settings(SyncerSettings, flags=True, merge="iso").merging.merge == "iso"


@pytest.mark.parametrize(("given", "env", "needle"), [
    ({"heartbeat_s": -1}, {}, "argument heartbeat_s=-1: Input should be greater than 0"),
    ({}, {"YETO_DILOCO_CONSENSUS_TOP_K": "0"}, "YETO_DILOCO_CONSENSUS_TOP_K='0': Input should be greater than"),
    ({}, {"YETO_DILOCO_WAN_STALL_TIMEOUT_S": "inf"}, "YETO_DILOCO_WAN_STALL_TIMEOUT_S='inf'"),
    ({"rl_mode": "overlap", "overlap": False}, {}, "argument rl_mode='overlap': overlap trains on"),
    ({}, {"YETO_DILOCO_RL_MODE": "overlap", "YETO_DILOCO_OVERLAP": "false"}, "YETO_DILOCO_RL_MODE='overlap'"),
    ({"stall_timeout_s": 1}, {}, "argument stall_timeout_s=1: Extra inputs are not permitted"),
])
def test_a_bad_learner_value_in_a_section_names_what_the_user_wrote(
        monkeypatch: pytest.MonkeyPatch, given: dict[str, object], env: dict[str, str], needle: str) -> None:
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(SettingsError) as err:
        load_settings(LearnerSettings, syncer="h:1", **given)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_a_bad_syncer_value_in_a_section_names_its_flag_or_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SettingsError, match=r"^--outer-momentum=1\.0: Input should be less than 1$"):
        load_settings(SyncerSettings, flags=True, outer_momentum=1.0)
    with pytest.raises(SettingsError, match=r"^--iso-worker-devices='cpu': iso workers need --merge iso"):
        load_settings(SyncerSettings, flags=True, iso_worker_devices="cpu")
    monkeypatch.setenv("YETO_SYNCER_WAN_STREAM_SCHEDULE", "fastest")
    with pytest.raises(SettingsError, match=r"^YETO_SYNCER_WAN_STREAM_SCHEDULE='fastest': Input should be"):
        load_settings(SyncerSettings)


@pytest.mark.parametrize(("var", "needle"), [
    ("YETO_DILOCO_CONSENSUS_EVRY", "did you mean YETO_DILOCO_CONSENSUS_EVERY?"),
    ("YETO_DILOCO_LINK__HEARTBEAT_S", "did you mean YETO_DILOCO_HEARTBEAT_S?"),  # pydantic's nested form is not ours
    ("YETO_DILOCO_LINK", "did you mean YETO_DILOCO_KEY?"),  # a section is no setting
])
def test_a_misspelt_or_nested_name_is_refused_with_the_flat_name_it_resembles(
        monkeypatch: pytest.MonkeyPatch, var: str, needle: str) -> None:
    monkeypatch.setenv(var, "2")
    with pytest.raises(SettingsError, match=f"^{var} is not a yeto setting") as err:
        load_settings(LearnerSettings, syncer="h:1")
    assert needle in str(err.value)


def test_the_syncers_flags_cover_its_sections() -> None:
    args = cli.build_parser().parse_args(["--outer-lr", "0.3", "--heartbeat-s", "1", "--wan-stall-timeout-s", "4"])
    settings = load_settings(SyncerSettings, flags=True, **{k: v for k, v in vars(args).items() if k != "log_level"})
    assert settings.merging.outer_lr == 0.3
    args = cli.build_parser().parse_args(["--learners", "8"])  # no lr given: M's
    unset = load_settings(SyncerSettings, flags=True, **{k: v for k, v in vars(args).items() if k != "log_level"})
    assert unset.merging.outer_lr == 0.7 * (2 / 8) ** 0.25
    assert (settings.streams.heartbeat_s, settings.streams.stall_timeout_s) == (1.0, 4.0)
    text = cli.build_parser().format_help()  # a section's flags under its heading, after the syncer's own
    merging, streams = text.index(f"\n{MergeSettings.heading}:"), text.index(f"\n{StreamSettings.heading}:")
    first = [text.index(f"\n  --{name}") for name in ("learners", "heartbeat-s", "outer-lr")]
    assert first[0] < streams < first[1] < merging < first[2]


def test_nest_and_flat_of_are_inverse_on_every_name() -> None:
    for flat, field in flat_fields(SyncerSettings).items():
        nested = nest(SyncerSettings, {flat: 1})
        assert (nested[field.path[0]][field.path[1]] if len(field.path) == 2 else nested[flat]) == 1
        assert flat_of(SyncerSettings, field.path) == flat
    assert flat_of(SyncerSettings, ("merging", "outer_lr")) == "outer_lr"
    assert flat_of(LearnerSettings, ("consensus", "consensus_every")) == "consensus_every"  # by its alias
    assert nest(LearnerSettings, {"consensus": ConsensusSettings(top_k=3), "consensus_every": 0}) == {
        "consensus": {"every": 0, "top_k": 3, "tokens": 64}}


def test_the_learners_endpoint_is_derived_from_its_settings() -> None:
    learner = LearnerSettings(syncer="[::1]:7000", key="k" * 32, learner_id=5)
    me = learner.endpoint()
    assert (me.address, me.key, me.learner_id) == (("::1", 7000), b"k" * 32, 5)
    assert learner.endpoint() == me
