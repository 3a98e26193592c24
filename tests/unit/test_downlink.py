"""Downlink deltas (DESIGN §7.4): the syncer's and the learner's anchors stay bit-identical."""

import pytest
import torch

from yeto_core.downlink import DELTA, FULL, AnchorMismatch, DownlinkDecoder, DownlinkEncoder, anchor_digest

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
