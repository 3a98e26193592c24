"""Downlink deltas (DESIGN §7.4): the syncer's and the learner's anchors stay bit-identical, in
every delta codec, and what a code could not carry goes out with the next broadcast."""

import itertools
import logging

import pytest
import torch
from pydantic import ValidationError

from yeto_core.codecs import BF16
from yeto_core.downlink import (
    DELTA,
    DOWNLINK_BLOCK,
    DOWNLINK_DTYPES,
    FULL,
    AnchorMismatch,
    DownlinkChains,
    DownlinkDecoder,
    DownlinkEncoder,
    anchor_digest,
    downlink_codec,
    downlink_codec_by_id,
)
from yeto_core.quant import ERROR_BOUNDS
from yeto_core.sections import LinkSettings

DELTA_CODECS = [name for name in DOWNLINK_DTYPES if name != "f32"]

pytestmark = pytest.mark.unit


def test_a_hundred_delta_broadcasts_keep_both_anchors_bit_identical() -> None:
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(1000, generator=g)
    enc, dec = DownlinkEncoder(1, full_every=1000), DownlinkDecoder(1)
    kinds = []
    for version in range(1, 101):
        theta = theta + 0.01 * torch.randn(1000, generator=g)  # an outer step
        b = enc.commit(0, version, theta)
        kinds.append(b.flags)
        got = dec.apply(0, version, b.flags, b.payload, b.digest)
        assert enc.anchors[0] is not None and torch.equal(got, enc.anchors[0])
        assert anchor_digest(got) == b.digest
    assert kinds[0] == FULL and set(kinds[1:]) == {DELTA}
    # the anchor tracks θ to within bf16 rounding of each step, without drifting away
    assert float((got - theta).abs().max()) < 1e-3


def test_full_refreshes_every_n_versions_and_for_the_last_one() -> None:
    enc = DownlinkEncoder(1, full_every=4)
    flags = [enc.commit(0, v, torch.full((8,), float(v))).flags for v in range(1, 10)]
    assert flags == [FULL, DELTA, DELTA, FULL, DELTA, DELTA, DELTA, FULL, DELTA]
    assert enc.commit(0, 10, torch.zeros(8), last=True).flags == FULL


def test_a_delta_is_half_the_bytes_of_a_full_send() -> None:
    enc = DownlinkEncoder(1, full_every=100)
    full = enc.commit(0, 1, torch.ones(1024))
    delta = enc.commit(0, 2, torch.ones(1024) * 1.5)
    assert len(full.payload) == 4096 and len(delta.payload) == 2048


def test_an_injected_anchor_mismatch_is_detected_and_a_full_send_resyncs() -> None:
    enc, dec = DownlinkEncoder(1, full_every=1000), DownlinkDecoder(1)
    b = enc.commit(0, 1, torch.arange(16.0))
    dec.apply(0, 1, b.flags, b.payload, b.digest)
    held = dec.anchors[0]
    assert held is not None
    held[3] += 1e-3  # corrupt the learner's anchor
    b = enc.commit(0, 2, torch.arange(16.0) * 1.1)
    with pytest.raises(AnchorMismatch, match="SHA-256 differs"):
        dec.apply(0, 2, b.flags, b.payload, b.digest)
    with pytest.raises(AnchorMismatch, match="does not follow"):  # no anchor now: deltas cannot apply
        b = enc.commit(0, 3, torch.arange(16.0) * 1.2)
        dec.apply(0, 3, b.flags, b.payload, b.digest)
    full = enc.full(0)  # what a reconnect sends
    got = dec.apply(0, 3, full.flags, full.payload, full.digest)
    assert enc.anchors[0] is not None and torch.equal(got, enc.anchors[0])
    b = enc.commit(0, 4, torch.arange(16.0) * 1.3)
    assert torch.equal(dec.apply(0, 4, b.flags, b.payload, b.digest), enc.anchors[0])


def test_a_skipped_version_is_a_mismatch() -> None:
    enc, dec = DownlinkEncoder(1, full_every=1000), DownlinkDecoder(1)
    b = enc.commit(0, 1, torch.ones(4))
    dec.apply(0, 1, b.flags, b.payload, b.digest)
    enc.commit(0, 2, torch.ones(4) * 2)  # never delivered
    b = enc.commit(0, 3, torch.ones(4) * 3)
    with pytest.raises(AnchorMismatch, match="v3 does not follow the anchor held \\(v1\\)"):
        dec.apply(0, 3, b.flags, b.payload, b.digest)


@pytest.mark.parametrize("name", DELTA_CODECS)
def test_every_delta_codec_keeps_both_anchors_bit_identical_and_within_one_codes_error_of_theta(name: str) -> None:
    codec = downlink_codec(name)
    assert codec is not None
    g = torch.Generator().manual_seed(1)
    theta = torch.randn(1000, generator=g)
    enc, dec = DownlinkEncoder(1, full_every=0, codec=codec), DownlinkDecoder(1, codec)
    for version in range(1, 61):
        before = enc.anchors[0].clone() if enc.anchors[0] is not None else None
        theta = theta + 0.01 * torch.randn(1000, generator=g)
        b = enc.commit(0, version, theta)
        assert b.flags == (FULL if version == 1 else DELTA)
        got = dec.apply(0, version, b.flags, b.payload, b.digest)
        assert enc.anchors[0] is not None and torch.equal(got, enc.anchors[0])
        if before is not None:
            # Error feedback: what is left, Θ − anchor, is this code's own error on Θ − the old
            # anchor (bounded per block by its absmax), never an error carried from earlier codes.
            diff = (theta - before).view(-1, 8 if name == "bf16" else 1)
            left = (theta - got).abs().max()
            bound = (2.0 ** -8 if name == "bf16" else ERROR_BOUNDS[name]) * float(diff.abs().max()) * 1.01 + 1e-6
            assert float(left) <= bound, (version, float(left), bound)


@pytest.mark.parametrize("name", DELTA_CODECS)
def test_what_a_code_leaves_out_goes_out_with_the_next_broadcast_until_the_anchor_is_theta(name: str) -> None:
    """Θ stops moving: each delta carries the rest of the last one's error, so the anchor closes on Θ
    (nothing is lost, only delayed) and both ends still hold the same bits."""
    codec = downlink_codec(name)
    assert codec is not None
    g = torch.Generator().manual_seed(2)
    enc, dec = DownlinkEncoder(1, full_every=0, codec=codec), DownlinkDecoder(1, codec)
    start = torch.randn(4096, generator=g)
    b = enc.commit(0, 1, start)
    dec.apply(0, 1, b.flags, b.payload, b.digest)
    theta = start + torch.randn(4096, generator=g) * torch.rand(4096, generator=g) ** 4  # heavy-tailed steps
    gaps = []
    for version in range(2, 40):
        b = enc.commit(0, version, theta)
        got = dec.apply(0, version, b.flags, b.payload, b.digest)
        assert enc.anchors[0] is not None and torch.equal(got, enc.anchors[0])
        gaps.append(float((theta - got).abs().max()))
    assert gaps[-1] <= 1e-5 * float(theta.abs().max()), gaps[-5:]
    assert all(later <= earlier * 1.0001 + 1e-12 for earlier, later in itertools.pairwise(gaps)), gaps


def test_with_full_every_zero_only_the_first_and_the_last_version_go_out_full() -> None:
    codec = downlink_codec("int4")
    assert codec is not None
    enc = DownlinkEncoder(1, full_every=0, codec=codec)
    flags = [enc.commit(0, v, torch.full((300,), float(v)), last=v == 40).flags for v in range(1, 41)]
    assert flags == [FULL] + [DELTA] * 38 + [FULL]


@pytest.mark.parametrize(("name", "bits"), [("bf16", 16.0), ("int8", 8.25), ("int4", 4.25), ("e3m0", 4.25),
                                            ("int4-log", 4.25), ("int2", 2.25)])
def test_a_delta_costs_its_codecs_bits_per_value(name: str, bits: float) -> None:
    codec = downlink_codec(name)
    assert codec is not None
    enc = DownlinkEncoder(1, full_every=0, codec=codec)
    n = DOWNLINK_BLOCK * 64
    enc.commit(0, 1, torch.ones(n))
    delta = enc.commit(0, 2, torch.ones(n) * 1.5)
    assert delta.flags == DELTA and delta.codec == codec.wire_id
    header = 0 if name == "bf16" else 4
    assert (len(delta.payload) - header) * 8 / n == bits


def test_each_codec_in_use_has_its_own_chain_and_learners_of_one_codec_share_it() -> None:
    chains = DownlinkChains(2, 0)
    int4, int8 = downlink_codec("int4"), downlink_codec("int8")
    assert int4 is not None and int8 is not None
    assert chains.of(int4) is chains.of(downlink_codec("int4"))  # type: ignore[arg-type]
    assert chains.of(int8) is not chains.of(int4)
    assert sorted(chains.by_id) == sorted([int4.wire_id, int8.wire_id])
    assert chains.of(int4).codec is int4


def test_a_wire_id_that_is_no_downlink_codec_is_refused() -> None:
    assert downlink_codec_by_id(1) is None and downlink_codec_by_id(0) is None
    assert downlink_codec_by_id(BF16.wire_id) is BF16
    with pytest.raises(ValueError, match="unknown codec wire id 99"):
        downlink_codec_by_id(99)
    with pytest.raises(ValueError, match="unknown downlink dtype 'int3'"):
        downlink_codec("int3")


def test_bcast_delta_still_asks_for_a_bf16_downlink_with_a_deprecation_line(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="yeto.settings"):
        link = LinkSettings(bcast_delta=True)
    assert link.downlink_dtype == "bf16" and link.delta_codec is BF16
    assert "YETO_DILOCO_BCAST_DELTA is deprecated; use YETO_DILOCO_DOWNLINK_DTYPE=bf16" in caplog.text
    assert LinkSettings(bcast_delta=True, downlink_dtype="bf16").downlink_dtype == "bf16"
    conflict = "BCAST_DELTA .* asks for a bf16 downlink and YETO_DILOCO_DOWNLINK_DTYPE for int4"
    with pytest.raises(ValidationError, match=conflict):
        LinkSettings(bcast_delta=True, downlink_dtype="int4")
    with pytest.raises(ValidationError, match="downlink_dtype"):
        LinkSettings(downlink_dtype="int3")  # type: ignore[arg-type]
    assert LinkSettings().delta_codec is None
