"""One round's merge (syncer/merge/round_merge.py) and payload checks (syncer/core/payload.py) against the pure
pieces they compose."""

import pytest
import torch

from syncer.core.payload import decode_delta, finite_f32_part, payload_problem, payload_screen
from syncer.core.rounds import Answer
from syncer.merge.correction import HelocoConfig
from syncer.merge.fused import PLAN_CHUNK
from syncer.merge.merge import (
    Segment,
    learner_weights,
    merge_deltas,
    outer_gradient,
    segment_sq_norms,
)
from syncer.merge.outer import STEP_CHUNK, Nesterov, make_outer_optimizer, nesterov_step
from syncer.merge.round_merge import MergeWorkspace, merge_round, screen_step
from syncer.tools.plan_memory import PLAN_ELEMENTS, STEP_TEMP_ELEMENTS
from yeto_core.codecs import BF16, F32, codec_by_name, tensor_bytes
from yeto_core.layout import TensorSpec, build_layout
from yeto_core.wire.messages import Init, Push

pytestmark = pytest.mark.unit

SEGMENTS = [Segment(0, 6, rda=True), Segment(6, 4, rda=True)]


def answers(seed: int = 0) -> list[Answer]:
    g = torch.Generator().manual_seed(seed)
    return [Answer(lid, 1, tokens=100 * (lid + 1), steps=4, delta=torch.randn(10, generator=g), base_version=0)
            for lid in (1, 0)]  # out of order on purpose


def test_merge_round_is_weights_then_merge_then_the_outer_step() -> None:
    params, momentum = torch.randn(10), torch.zeros(10)
    ref_params, ref_momentum = params.clone(), momentum.clone()
    out = merge_round(answers(), params=params, momentum=momentum, outer_state={}, segments=SEGMENTS,
                      outer=Nesterov(), heloco=None)
    ordered = sorted(answers(), key=lambda a: a.learner_id)
    w = learner_weights([a.tokens for a in ordered], [a.steps for a in ordered])
    merged = merge_deltas(torch.stack([a.delta for a in ordered]), w.float(), SEGMENTS)
    nesterov_step(ref_params, ref_momentum, outer_gradient(merged))
    assert [a.learner_id for a in out.answers] == [0, 1]
    assert out.weights == pytest.approx([0.2, 0.8])  # tokens² / steps: 100²/4 vs 200²/4
    assert torch.equal(params, ref_params) and torch.equal(momentum, ref_momentum)


def test_heloco_is_a_no_op_while_the_momentum_is_zero() -> None:
    p1, m1 = torch.ones(10), torch.zeros(10)
    p2, m2 = torch.ones(10), torch.zeros(10)
    merge_round(answers(), params=p1, momentum=m1, outer_state={}, segments=SEGMENTS, outer=Nesterov(), heloco=None)
    merge_round(answers(), params=p2, momentum=m2, outer_state={}, segments=SEGMENTS, outer=Nesterov(),
                heloco=HelocoConfig(momentum_scale=0.1))
    assert torch.equal(p1, p2)


def test_merge_threads_give_the_same_bits() -> None:
    p1, m1 = torch.ones(10), torch.full((10,), 0.5)
    p2, m2 = torch.ones(10), torch.full((10,), 0.5)
    cfg = HelocoConfig(momentum_scale=0.1)
    merge_round(answers(3), params=p1, momentum=m1, outer_state={}, segments=SEGMENTS, outer=Nesterov(), heloco=cfg)
    merge_round(answers(3), params=p2, momentum=m2, outer_state={}, segments=SEGMENTS, outer=Nesterov(), heloco=cfg,
                threads=3)
    assert torch.equal(p1, p2) and torch.equal(m1, m2)


def test_delayed_nesterov_keeps_its_window_in_the_outer_state() -> None:
    state: dict[str, object] = {}
    outer = make_outer_optimizer("delayed-nesterov", lr=0.7, momentum=0.9, delay=3)
    params, momentum = torch.zeros(10), torch.zeros(10)
    merge_round(answers(), params=params, momentum=momentum, outer_state=state, segments=SEGMENTS, outer=outer,
                heloco=None)
    assert state["delayed_nesterov.count"] == 1 and torch.count_nonzero(momentum) == 0


@pytest.mark.parametrize("optimizer", ["nesterov", "delayed-nesterov"])
def test_the_fragments_version_counts_its_outer_steps_for_the_momentum_warmup(optimizer: str) -> None:
    # A resumed syncer continues the warm-up: the count is the version, which a checkpoint keeps.
    from syncer.durability.checkpoint import SyncerState
    from syncer.merge.round_merge import RoundMerger, fragment_segments
    from yeto_core.settings import SyncerSettings

    layout = build_layout((TensorSpec("w", (10,), "float32"),), 1, "binpack")
    merging = SyncerSettings(outer_optimizer=optimizer, outer_delay=1, outer_lr=0.5, outer_momentum=0.8,
                             outer_momentum_warmup=4).merging
    segments = fragment_segments(layout, merging.merge)[0]
    for version in (0, 2, 4, 9):
        m0 = torch.full((10,), 0.5)
        state = SyncerState(specs=list(layout.specs), num_fragments=1, pattern="binpack",
                            fingerprint=layout.fingerprint, backend="", params=[torch.ones(10)], momentum=[m0.clone()],
                            versions=[version], next_round=0, ledger={},
                            outer_accum=[torch.zeros(10)] if optimizer != "nesterov" else None,
                            outer_count=[0] if optimizer != "nesterov" else [])
        RoundMerger(merging).run(state, 0, answers(), segments)
        ref_p, ref_m = torch.ones(10), m0.clone()
        merge_round(answers(), params=ref_p, momentum=ref_m, outer_state={}, segments=segments,
                    outer=Nesterov(lr=0.5, momentum=0.8 * min(1.0, version / 4)), heloco=None)
        assert torch.equal(state.params[0], ref_p) and torch.equal(state.momentum[0], ref_m)


def push(codec_id: int, nbytes: int, steps: int = 2, fragment: int = 0) -> Push:
    return Push(0, 1, fragment, 0, 10, steps, 0, 1, nbytes, codec_id)


def test_payload_checks_name_the_problem() -> None:
    layout = build_layout([TensorSpec("w", (5,), "float32")], 1)
    zeros = memoryview(bytes(20))
    assert payload_problem(layout, push(F32.wire_id, 20), zeros, F32) is None
    assert "expected 20" in str(payload_problem(layout, push(F32.wire_id, 16), memoryview(bytes(16)), F32))
    assert "expected 10 (bf16)" in str(payload_problem(layout, push(BF16.wire_id, 20), zeros, BF16))
    assert "zero steps" in str(payload_problem(layout, push(F32.wire_id, 20, steps=0), zeros, F32))
    assert "does not exist" in str(payload_problem(layout, push(F32.wire_id, 20, fragment=3), zeros, F32))
    assert "differs from the session contract (f32, id 1)" in str(
        payload_problem(layout, push(BF16.wire_id, 10), memoryview(bytes(10)), F32))


def test_decode_refuses_nan_and_reads_bf16() -> None:
    layout = build_layout([TensorSpec("w", (4,), "float32")], 1)
    good = torch.tensor([1.0, -2.0, 0.5, 3.0])
    got = decode_delta(layout, push(F32.wire_id, 16), tensor_bytes(good.clone()), F32)
    assert isinstance(got, torch.Tensor) and torch.equal(got, good)
    bad = torch.tensor([1.0, float("nan"), 0.0, 0.0])
    assert "NaN or Inf" in str(decode_delta(layout, push(F32.wire_id, 16), tensor_bytes(bad), F32))
    encoded = bytearray(8)
    BF16.encode(good, memoryview(encoded))
    got = decode_delta(layout, push(BF16.wire_id, 8), memoryview(encoded), BF16)
    assert isinstance(got, torch.Tensor) and torch.equal(got, good)


def test_decode_refuses_a_quantized_push_with_the_wrong_block_size() -> None:
    layout = build_layout([TensorSpec("w", (256,), "float32")], 1)
    sender, agreed = codec_by_name("int8", block=64), codec_by_name("int8", block=128)
    encoded = bytearray(sender.encoded_nbytes(256))
    sender.encode(torch.randn(256), memoryview(encoded))
    problem = decode_delta(layout, push(sender.wire_id, len(encoded)), memoryview(encoded), agreed)
    assert isinstance(problem, str) and "block size 64 in the payload, 128 agreed" in problem


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), -float("nan")])
def test_the_screen_fails_a_part_with_any_non_finite_value(bad: float) -> None:
    for where in (0, 517, 1023):
        values = torch.linspace(-1e3, 1e3, 1024)
        values[where] = bad
        assert finite_f32_part(tensor_bytes(values)) is False


def test_the_screen_passes_finite_parts_whose_sum_would_overflow() -> None:
    huge = torch.full((1024,), 3.0e38)  # finite values; their float32 sum is +Inf
    assert finite_f32_part(tensor_bytes(huge)) is True
    assert finite_f32_part(tensor_bytes(-huge)) is True
    assert finite_f32_part(memoryview(b"\x00\x00\x80")) is True  # not whole floats: refused for its size instead


def test_the_screen_checks_f32_pushes_and_init() -> None:
    assert payload_screen(push(F32.wire_id, 16)) is finite_f32_part
    assert payload_screen(Init(0, 1, 16, F32.wire_id)) is finite_f32_part
    assert payload_screen(push(BF16.wire_id, 8)) is None  # decoded and checked on the decode pool
    assert payload_screen(Init(0, 1, 8, BF16.wire_id)) is None  # refused for its codec by the coordinator


def test_decode_trusts_the_screens_verdict_on_f32_pushes() -> None:
    layout = build_layout([TensorSpec("w", (4,), "float32")], 1)
    good = torch.tensor([1.0, -2.0, 0.5, 3.0])
    got = decode_delta(layout, push(F32.wire_id, 16), tensor_bytes(good.clone()), F32, screened=True)
    assert isinstance(got, torch.Tensor) and torch.equal(got, good)
    problem = decode_delta(layout, push(F32.wire_id, 16), tensor_bytes(good.clone()), F32, screened=False)
    assert problem == "delta for fragment 0 contains NaN or Inf"
    bad = torch.tensor([1.0, float("inf"), 0.0, 0.0])  # unscreened (e.g. a carried push from before): checked here
    assert "NaN or Inf" in str(decode_delta(layout, push(F32.wire_id, 16), tensor_bytes(bad), F32, screened=None))


@pytest.mark.parametrize("optimizer", ["nesterov", "delayed-nesterov"])
def test_a_merge_workspace_changes_no_bit(optimizer: str) -> None:
    """Reused scratch (grown to the largest fragment, viewed smaller) gives the same bits as fresh
    tensors, merge after merge."""
    gen = torch.Generator().manual_seed(3)
    workspace = MergeWorkspace()
    outer = make_outer_optimizer(optimizer, lr=0.7, momentum=0.9, delay=2)
    states: dict[bool, list[dict]] = {False: [{}, {}], True: [{}, {}]}
    sizes = [96, 40]  # two fragments of different sizes share the workspace
    tensors = {reuse: [(torch.zeros(n), torch.zeros(n)) for n in sizes] for reuse in (False, True)}
    for round_id in range(6):
        f = round_id % 2
        n = sizes[f]
        segments = [Segment(0, n // 2, True), Segment(n // 2, n - n // 2, False)]
        answers = [Answer(i, 1, 100 * (i + 1), 2 + i, torch.randn(n, generator=gen), 0) for i in range(3)]
        outcomes = {}
        for reuse in (False, True):
            params, momentum = tensors[reuse][f]
            outcomes[reuse] = merge_round(answers, params=params, momentum=momentum, outer_state=states[reuse][f],
                                          segments=segments, outer=outer, heloco=None,
                                          workspace=workspace if reuse else None)
        assert outcomes[True].outer_grad_norm == outcomes[False].outer_grad_norm
        assert outcomes[True].delta_norms == outcomes[False].delta_norms
        for a, b in zip(tensors[True][f], tensors[False][f], strict=True):
            assert torch.equal(a, b), f"round {round_id}: a reused workspace changed the merge"


def test_a_finite_delta_that_would_overflow_the_fragment_is_left_out() -> None:
    # Plain average over one segment (the embedding's way): 3e38 is finite, yet the step's
    # momentum pull takes it past float32's range. The round merges without learner 1.
    segments = [Segment(0, 10, rda=False)]
    good = answers()
    huge = [a if a.learner_id == 0 else Answer(1, 1, 200, 4, torch.full((10,), 3e38), 0) for a in good]
    params, momentum = torch.randn(10), torch.full((10,), 1.0)
    ref_params, ref_momentum = params.clone(), momentum.clone()
    out = merge_round(huge, params=params, momentum=momentum, outer_state={}, segments=segments,
                      outer=Nesterov(lr=0.5, momentum=0.5), heloco=None)
    assert [a.learner_id for a in out.answers] == [0] and out.overflowed == {1: pytest.approx(3e38)}
    alone = [a for a in good if a.learner_id == 0]
    merge_round(alone, params=ref_params, momentum=ref_momentum, outer_state={}, segments=segments,
                outer=Nesterov(lr=0.5, momentum=0.5), heloco=None)
    assert torch.equal(params, ref_params) and torch.equal(momentum, ref_momentum)


def test_when_every_delta_would_overflow_nothing_is_written() -> None:
    params, momentum = torch.randn(10), torch.randn(10)
    before = params.clone(), momentum.clone()
    # Each alone already overflows: the step's g + 0.9·(0.9·m + g) passes 3.4e38 for |g| >= 2e38.
    huge = [Answer(lid, 1, 100, 4, torch.full((10,), -2e38 - 1e37 * lid), 0) for lid in (0, 1)]
    out = merge_round(huge, params=params, momentum=momentum, outer_state={}, segments=SEGMENTS,
                      outer=Nesterov(lr=1.0, momentum=0.9), heloco=None)
    assert out.answers == [] and sorted(out.overflowed) == [0, 1]
    assert torch.equal(params, before[0]) and torch.equal(momentum, before[1])


def test_past_the_bound_a_step_that_stays_finite_is_kept_bit_for_bit() -> None:
    # 1e38 with lr 0.5, momentum 0.5: the bound (1.5e38 + …) crosses the headroom only through
    # the momentum term; the real values stay finite, so the trial step on copies is kept.
    params, momentum = torch.zeros(4), torch.tensor([-2.3e38, 0.0, 0.0, 0.0])
    grad = torch.tensor([2e38, 1.0, 1.0, 1.0])
    ref_p, ref_m = params.clone(), momentum.clone()
    nesterov_step(ref_p, ref_m, grad, lr=0.5, momentum_coef=0.5)
    assert bool(torch.isfinite(ref_p).all())
    assert screen_step(Nesterov(lr=0.5, momentum=0.5), params, momentum, grad, {})
    assert torch.equal(params, ref_p) and torch.equal(momentum, ref_m)


def test_a_delta_whose_norm_overflows_float32_is_not_weighed() -> None:
    # 1e20 is far from float32's limit, but its square is not: RDA could only give it weight 0
    # and an infinite radius. It is left out before the merge and named.
    good = answers()
    odd = [a if a.learner_id == 0 else Answer(1, 1, 200, 4, torch.full((10,), 1e20), 0) for a in good]
    p1, m1 = torch.ones(10), torch.zeros(10)
    p2, m2 = torch.ones(10), torch.zeros(10)
    out = merge_round(odd, params=p1, momentum=m1, outer_state={}, segments=SEGMENTS, outer=Nesterov(), heloco=None)
    merge_round([a for a in good if a.learner_id == 0], params=p2, momentum=m2, outer_state={}, segments=SEGMENTS,
                outer=Nesterov(), heloco=None)
    assert out.overflowed == {1: pytest.approx(1e20)} and [a.learner_id for a in out.answers] == [0]
    assert torch.equal(p1, p2) and out.delta_norms == [pytest.approx(float(good[1].delta.norm()))]


@pytest.mark.parametrize("threads", [1, 3])
def test_rows_merge_to_the_bits_of_their_stack(threads: int) -> None:
    """The merge reads each push where it was received (M separate rows): the same bits as the
    rows stacked into one [M, N] tensor, serial or threaded, across chunk boundaries."""
    gen = torch.Generator().manual_seed(5)
    n = (1 << 20) + 4099  # one segment longer than a column chunk, with a ragged tail
    segments = [Segment(0, 1 << 20, rda=True), Segment(1 << 20, 4000, rda=False), Segment((1 << 20) + 4000, 99, True)]
    rows = [torch.randn(n, generator=gen) for _ in range(3)]
    w = torch.tensor([0.2, 0.3, 0.5])
    stacked = merge_deltas(torch.stack(rows), w, segments, threads=threads, negate=True)
    assert torch.equal(merge_deltas(rows, w, segments, threads=threads, negate=True), stacked)
    assert torch.equal(segment_sq_norms(rows, segments), segment_sq_norms(torch.stack(rows), segments))


def test_rows_of_another_length_or_dtype_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"row 1 is torch.float32 \(5,\)"):
        merge_deltas([torch.zeros(4), torch.zeros(5)], torch.tensor([0.5, 0.5]), [Segment(0, 4, True)])
    with pytest.raises(ValueError, match=r"row 0 is torch\.float64"):
        merge_deltas([torch.zeros(4, dtype=torch.float64)], torch.tensor([1.0]), [Segment(0, 4, True)])


def test_the_outer_step_a_chunk_at_a_time_changes_no_bit() -> None:
    gen = torch.Generator().manual_seed(9)
    n = 3 * STEP_CHUNK + 77
    params, momentum, grad = (torch.randn(n, generator=gen) for _ in range(3))
    ref_params, ref_momentum = params.clone(), momentum.clone()
    ref_momentum.mul_(0.9).add_(grad)
    ref_params.add_(torch.add(grad, ref_momentum, alpha=0.9), alpha=-0.7)
    nesterov_step(params, momentum, grad, lr=0.7, momentum_coef=0.9, scratch=torch.empty(STEP_CHUNK))
    assert torch.equal(params, ref_params) and torch.equal(momentum, ref_momentum)


@pytest.mark.parametrize("heloco", [False, True])
def test_a_merge_holds_no_copy_of_the_pushes_unless_heloco_corrects_them(heloco: bool) -> None:
    """The fused merge (the default) keeps three chunks in its workspace and nothing the size of the
    fragment; with HeLoCo the merged delta, a chunk of the step's temporary and a stacked copy of the
    deltas (M fragment-sized rows), as HeLoCo rewrites them; the pushes stay as they came."""
    n = 3 * STEP_CHUNK
    workspace = MergeWorkspace()
    gen = torch.Generator().manual_seed(2)
    pushes = [Answer(i, 1, 100, 2, torch.randn(n, generator=gen), 0) for i in range(3)]
    kept = [a.delta.clone() for a in pushes]
    merge_round(pushes, params=torch.zeros(n), momentum=torch.full((n,), 0.01), outer_state={},
                segments=[Segment(0, n, True)], outer=Nesterov(), heloco=HelocoConfig(0.1) if heloco else None,
                workspace=workspace)
    held = {name: buf.numel() for name, buf in workspace._buffers.items()}
    if heloco:
        assert held == {"merged": n, "step": STEP_CHUNK, "deltas": 3 * n}
    else:
        assert held == {"plan": PLAN_CHUNK, "fused": STEP_CHUNK, "step": STEP_CHUNK}
    assert all(torch.equal(a.delta, k) for a, k in zip(pushes, kept, strict=True))


def test_the_planner_counts_the_step_temporary_the_merge_uses() -> None:
    assert STEP_TEMP_ELEMENTS == STEP_CHUNK and PLAN_ELEMENTS == PLAN_CHUNK
