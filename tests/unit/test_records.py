"""The tape's records are types in the protocol and the same JSON objects on the tape."""

from __future__ import annotations

import dataclasses

import pytest

from syncer.core import records

pytestmark = pytest.mark.unit


def test_a_refusal_names_only_what_it_has_in_the_order_the_tape_always_had() -> None:
    assert records.Refused(2, code="LAYOUT", reason="r").as_dict() == {
        "event": "refused", "learner": 2, "code": "LAYOUT", "reason": "r"}
    assert list(records.Refused(2, round=5, reason="late").as_dict()) == ["event", "learner", "round", "reason"]
    assert list(records.Refused(2, round=5, reason="big", overflow=True).as_dict()) == [
        "event", "learner", "round", "reason", "overflow"]


def test_a_commit_flattens_its_consensus_fields_after_the_rest() -> None:
    commit = records.Commit(
        round=3, attempt=4, fragment=1, version=2, learners=[0, 1], generations=[1, 1], answered=[0, 1], carried=[],
        waited_for=[], not_waited_for=[], dropped=[], base_versions=[1, 1], grace_ms=0.0, weights=[0.5, 0.5],
        tokens=[8, 8], steps=[2, 2], ages=[0, 0], delta_norms=[1.0, 1.0], outer_grad_norm=1.0, merge_ms=0.1,
        wait_ms=2.0, reason="2 of 2", bytes_in=2 * 68, bytes_out=3 * 128 * 4, receivers=3, numel=128,
        extra={"consensus_js": None})
    keys = list(commit.as_dict())
    assert keys[:5] == ["event", "round", "attempt", "fragment", "version"]
    assert keys[-3:] == ["receivers", "numel", "consensus_js"] and "overflowed" not in keys
    overflowed = dataclasses.replace(commit, overflowed=[1]).as_dict()
    assert list(overflowed)[-3:] == ["numel", "overflowed", "consensus_js"]


def test_a_commits_wire_bits_are_per_parameter_and_per_learner_each_way() -> None:
    record = {"learners": [0, 1], "bytes_in": 2 * 68, "bytes_out": 3 * 128 * 4, "receivers": 3, "numel": 128}
    assert records.wire_bits(record) == (8 * 68 / 128, 32.0)  # int4 pushes of 128 values up, exact f32 down
    assert records.wire_bits({"learners": [0], "numel": 128}) is None  # a tape from before the bytes were kept


@pytest.mark.parametrize("kind", [records.Join, records.Left, records.Replaced, records.Refused, records.Done,
                                  records.Init, records.Launch, records.Carry, records.Retry, records.Abandon,
                                  records.Commit, records.Final])
def test_every_kind_is_a_record_with_its_own_event_name(kind: type[records.TapeRecord]) -> None:
    assert issubclass(kind, records.TapeRecord) and kind.EVENT and kind.EVENT.islower()
