"""The run planner's arithmetic (`syncer/tools/plan.py`, `syncer/tools/plan_cli.py`) against hand-computed cases,
the yeto code it mirrors (layout, codecs, frames, model shapes), its refusals, and the CLI."""

from __future__ import annotations

import json
import struct
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from syncer.tools.plan import (
    GIB,
    Choice,
    Island,
    Model,
    PlanError,
    Search,
    Setup,
    SyncerHost,
    Tensor,
    bcast_wire_bytes,
    fragment_params,
    island_memory,
    moment_bytes,
    on_the_wire,
    predict,
    push_wire_bytes,
    recommend,
)
from syncer.tools.plan_cli import main
from syncer.tools.plan_memory import RUNTIME_BYTES
from syncer.tools.plan_model import PRESETS, decoder_tensors, lora_tensors
from syncer.tools.plan_wire import DOWNLINKS, PUSH_CODECS, payload_bytes
from yeto_core.codecs import codec_by_name
from yeto_core.layout import TensorSpec, build_layout
from yeto_core.wire.messages import CHUNK_HEADER, HEADER, Bcast, Pull, Push, encode_frame
from yeto_plugins.torch_dist.modules import embedding_names, synced_parameters

pytestmark = pytest.mark.unit

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}


def flat_model(*numels: int) -> Model:
    tensors = tuple(Tensor(f"layers.{i}.w", n) for i, n in enumerate(numels))
    return Model("flat", tensors, sum(numels))


def two_islands(rate: float = 1e6, step_s: float = 0.1) -> tuple[Island, ...]:
    return (Island(rate, rate, step_s), Island(rate, rate, step_s))


HOST = SyncerHost(memory_bytes=64 * GIB, merge_bps=1e9, commit_s=0.005)


# ---- model shapes -----------------------------------------------------------------------------------


def test_preset_parameter_counts_are_llama_2s() -> None:
    # Llama-2-7B: embed 32000·4096 = 131,072,000; a layer: attention 4·4096² = 67,108,864, MLP
    # 3·4096·11008 = 135,266,304, two norms 8,192 → 202,383,360, ×32 = 6,476,267,520; final norm
    # 4,096; untied head 131,072,000. Total 6,738,415,616.
    assert sum(t.numel for t in decoder_tensors(PRESETS["7b"])) == 6_738_415_616
    # Llama-2-70B: embed 262,144,000; a layer: q, o 8192² = 67,108,864 each, k, v 1024·8192 = 8,388,608
    # each (8 KV heads of 128), MLP 3·8192·28672 = 704,643,072, norms 16,384 → 855,654,400, ×80 =
    # 68,452,352,000; norm 8,192; head 262,144,000. Total 68,976,648,192.
    assert sum(t.numel for t in decoder_tensors(PRESETS["70b"])) == 68_976_648_192


def test_lora_adapter_counts_by_hand() -> None:
    # r = 16 on q, k, v, o of the 7B: r·(in + out) = 16·8192 per projection, ×4, ×32 layers.
    assert sum(t.numel for t in lora_tensors(PRESETS["7b"], 16, ("q_proj", "k_proj", "v_proj", "o_proj"))) == \
        16 * 8192 * 4 * 32
    # the 70B: q, o 16·(8192 + 8192) = 262,144; k, v 16·(8192 + 1024) = 147,456 → 819,200 a layer, ×80.
    assert sum(t.numel for t in lora_tensors(PRESETS["70b"], 16, ("q_proj", "k_proj", "v_proj", "o_proj"))) == \
        65_536_000


@pytest.mark.parametrize("config", [
    {**TINY, "tie_word_embeddings": True},
    {**TINY, "tie_word_embeddings": False, "attention_bias": True, "mlp_bias": True},
    {**TINY, "model_type": "qwen2", "tie_word_embeddings": False},
    {**TINY, "model_type": "qwen3", "head_dim": 32, "tie_word_embeddings": True},
    {**TINY, "model_type": "mistral", "tie_word_embeddings": False},
], ids=["llama-tied", "llama-biases", "qwen2", "qwen3", "mistral"])
def test_config_tensors_are_the_models_named_parameters(config: dict) -> None:
    cfg = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    expected = [(n, p.numel(), n in embedding_names(model)) for n, p in model.named_parameters()]
    assert [(t.name, t.numel, t.embedding) for t in decoder_tensors(cfg.to_dict())] == expected


def test_lora_tensors_are_the_adapters_peft_adds() -> None:
    from peft import LoraConfig, get_peft_model

    with torch.device("meta"):
        model = get_peft_model(LlamaForCausalLM(LlamaConfig(**TINY)),
                               LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    expected = [(n, p.numel()) for n, p in synced_parameters(model, "auto")]
    assert [(t.name, t.numel) for t in lora_tensors(TINY, 4, ("q_proj", "v_proj", "down_proj"))] == expected


# ---- layout, codecs and frames, against the code they mirror ----------------------------------------------


@pytest.mark.parametrize("pattern", ["binpack", "strided"])
def test_fragment_sizes_are_build_layouts(pattern: str) -> None:
    tensors = decoder_tensors({**TINY, "tie_word_embeddings": False})
    specs = [TensorSpec(t.name, (t.numel,), "float32", t.embedding) for t in tensors]
    model = Model("tiny", tuple(tensors), 0)
    for p in (1, 2, 3, 4, 7):
        try:
            want = tuple(f.numel for f in build_layout(specs, p, pattern).fragments)
        except ValueError:  # a fragment would be empty: the planner refuses it too
            with pytest.raises(PlanError, match=f"--fragments {p}"):
                fragment_params(model, p, pattern)
            continue
        assert fragment_params(model, p, pattern) == want, p


def test_fragment_zero_is_the_embedding_by_hand() -> None:
    # embedding 1000 alone; 500, 400, 300, 200 binpacked into 2: 500→a, 400→b, 300→b (700), 200→a (700).
    model = Model("m", (Tensor("emb", 1000, True), *(Tensor(f"t{n}", n) for n in (500, 400, 300, 200))), 2400)
    assert fragment_params(model, 3) == (1000, 700, 700)
    assert fragment_params(model, 1) == (2400,)
    with pytest.raises(PlanError, match="--fragments 6"):
        fragment_params(model, 6)


@pytest.mark.parametrize("codec", ["f32", "bf16", "int8", "int4", "e3m0", "int4-log"])
@pytest.mark.parametrize("block", [128, 7])
def test_payload_bytes_are_the_codecs(codec: str, block: int) -> None:
    for numel in (1, 7, 127, 128, 129, 1000, 4099):
        assert payload_bytes(codec, numel, block) == codec_by_name(codec, block=block).encoded_nbytes(numel)


def test_payload_bytes_by_hand() -> None:
    # 1000 values in blocks of 128: 7 full blocks and one of 104, a u32 header.
    assert payload_bytes("int8", 1000) == 4 + 7 * (4 + 128) + (4 + 104)  # 1036
    assert payload_bytes("int4", 1000) == 4 + 7 * (4 + 64) + (4 + 52)  # 536
    assert payload_bytes("bf16", 1000) == 2000


def test_frames_are_the_protocols() -> None:
    push = len(encode_frame(Push(0, 0, 0, 0, 0, 0, 0, 0, 0, 1)))
    bcast = len(encode_frame(Bcast(0, 0, 0, 0, 0, 0, 1, b"\0" * 32)))
    pull = len(encode_frame(Pull(0, 0, 0, 0)))
    chunk = HEADER.size + CHUNK_HEADER.size
    # 5 MiB of f32 is two 4 MiB chunks: the announcement, the payload, two chunk headers.
    n = 5 << 18
    assert push_wire_bytes("f32", n) == push + 4 * n + 2 * chunk
    assert bcast_wire_bytes("f32", n) == bcast + 4 * n + 2 * chunk + pull
    # a bf16 delta is 2.5 MiB (one chunk), plus the PULL; with a FULL every 8 versions, the mean
    # of seven deltas and one FULL.
    assert bcast_wire_bytes("bf16", n) == bcast + 2 * n + chunk + pull
    assert bcast_wire_bytes("bf16", n, full_every=8) == pytest.approx((7 * (bcast + 2 * n + chunk) +
                                                                       (bcast + 4 * n + 2 * chunk)) / 8 + pull)
    # block-quantized deltas: a block-size header, and per 128 values a scale and the codes
    for name, code_bytes in (("int8", 128), ("int4", 64), ("int2", 32)):
        assert bcast_wire_bytes(name, n) == bcast + 4 + (n // 128) * (4 + code_bytes) + chunk + pull


def test_line_bytes_by_hand() -> None:
    # 1000 full segments of 1448 payload bytes are 1000 frames of 1514; the other direction's
    # 28,960 bytes are 20 segments, acknowledged every second one: 10 ACKs of 66 bytes.
    assert on_the_wire(1_448_000, 28_960, 1448 / 1514) == pytest.approx(1_514_000 + 660)


# ---- one choice, by hand -------------------------------------------------------------------------------------


def test_a_link_bound_round_by_hand() -> None:
    # Four tensors of 1M values, P = 4: one per fragment. f32 push 4,000,000 bytes + PUSH frame 65 +
    # one chunk header 36 = 4,000,101; a broadcast 4,000,000 + 81 + 36 + the PULL 32 = 4,000,149.
    # Islands: 1 MB/s each way, step 0.1 s, H = 8: a boundary every 2 steps (0.2 s), pacing
    # (8/4)·0.1 = 0.2 s + 10 ms of throttle polling. Upload 4.000101 s, download 4.000149 s.
    # Merge (2 answers + 3 passes)·4 MB at 1 GB/s = 20 ms, + 5 ms commit. Latency: half a boundary
    # 0.1 + upload 4.000101 + 0.025 = 4.125101 s. Two rounds in flight queue their pushes on the same
    # links: a batch takes 0.125 + 2 × 4.000101 s, 4.000101 + 0.0625 = 4.062601 s a round, more than
    # the download.
    setup = Setup(flat_model(*[1_000_000] * 4), two_islands(), 2, HOST)
    pred = predict(setup, Choice(8, "f32", "f32", 4, 2))
    assert pred.push_bytes == 4_000_101 and pred.bcast_bytes == 4_000_149
    assert pred.compute_s == pytest.approx(0.2)
    assert pred.serial_s == pytest.approx(0.025)
    assert pred.latency_s == pytest.approx(4.125101)
    assert pred.round_s == pytest.approx(4.062601) and pred.bound == "latency/pipeline"
    assert pred.utilization == pytest.approx(0.2 / 4.062601)
    deeper = predict(setup, Choice(8, "f32", "f32", 4, 4))  # 4.000101 + 0.125 / 4 = 4.031351 s
    assert deeper.round_s == pytest.approx(4.031351)
    # A 0.5 s standing queue on the saturated downlink: each PULL waits it out behind the broadcasts,
    # latency 4.625101 s, a round 4.000101 + 0.625 / 2 = 4.312601 s.
    queued = predict(replace(setup, queue_s=0.5), Choice(8, "f32", "f32", 4, 2))
    assert queued.latency_s == pytest.approx(4.625101) and queued.round_s == pytest.approx(4.312601)
    assert pred.up_bytes_per_round == 2 * 4_000_101 and pred.down_bytes_per_round == 2 * 4_000_149
    mem = pred.memory
    # params + momentum 2·16 MB; pipeline 2 × 2 answers × 4 MB; workspace: the fused merge's chunks, each
    # the 4 MB fragment (within one chunk): the gradient's and the step's temporary at the commit, and a
    # planning chunk for each of two merges prepared ahead and the commit's own (the merge reads the
    # answers in place); one broadcast copy 4 MB; the runtime. The f32 answers are their receive buffers,
    # not counted twice.
    assert mem.total == pytest.approx(32e6 + 16e6 + 5 * 4e6 + 4e6 + RUNTIME_BYTES)
    assert mem.answers_in_flight == 16e6
    # Quantized pushes are held in their wire encoding until merged: the answers in flight are their
    # payloads.
    held = predict(setup, Choice(8, "int4", "f32", 4, 2)).memory
    assert held.answers_in_flight == 4 * payload_bytes("int4", 1_000_000, 128)
    assert held.total == pytest.approx(mem.total - 16e6 + held.answers_in_flight)
    # Learners that answer a PULL at their next step (`answer_on_arrival`) wait half a step, not half a
    # boundary: latency 0.05 + 4.000101 + 0.025 = 4.075101 s, a round 4.000101 + 0.075 / 2 s.
    arrival = predict(replace(setup, answer_on_arrival=True), Choice(8, "f32", "f32", 4, 2))
    assert arrival.latency_s == pytest.approx(4.075101) and arrival.round_s == pytest.approx(4.037601)


def test_a_compute_bound_round_by_hand() -> None:
    # The same model on 1 GB/s links: upload 4 ms, download 4 ms. Round = pacing 0.2 + 0.01 s;
    # latency 0.1 + 0.004 + 0.025 = 0.129 s over pipeline 2. Utilization 0.2 / 0.21.
    setup = Setup(flat_model(*[1_000_000] * 4), two_islands(rate=1e9), 2, HOST)
    pred = predict(setup, Choice(8, "f32", "f32", 4, 2))
    assert pred.bound == "compute" and pred.round_s == pytest.approx(0.21)
    assert pred.utilization == pytest.approx(0.2 / 0.21)
    assert pred.effective_interval == pytest.approx(8 * 0.21 / 0.2)


def test_quorum_and_a_straggler_by_hand() -> None:
    # Steps 20, 20 and 100 ms, H = 8, P = 4: boundaries 40, 40, 200 ms; pacing 2 × the median 20 ms
    # + 10 ms polling = 50 ms. Quorum 2: the round is 50 ms and the straggler answers one in 200/50 = 4.
    # Quorum 3: every round waits for its boundary, 200 ms.
    islands = (Island(1e9, 1e9, 0.02), Island(1e9, 1e9, 0.02), Island(1e9, 1e9, 0.1))
    model = flat_model(*[1000] * 4)
    decoupled = predict(Setup(model, islands, 2, HOST), Choice(8, "f32", "f32", 4, 2))
    assert decoupled.round_s == pytest.approx(0.05)
    assert decoupled.pushes_per_round == pytest.approx((1.0, 1.0, 0.25))
    lockstep = predict(Setup(model, islands, 3, HOST), Choice(8, "f32", "f32", 4, 2))
    assert lockstep.round_s == pytest.approx(0.2) and lockstep.bound == "compute"
    assert lockstep.pushes_per_round == (1.0, 1.0, 1.0)


def test_a_shared_syncer_link_by_hand() -> None:
    # Both islands behind one syncer link of 2 MB/s in and 1 MB/s out: 2 pushes of 4,000,101 bytes a
    # round = 4.000101 s in, 2 broadcasts of 4,000,149 = 8.000298 s out; each island's own link 1 GB/s.
    host = replace(HOST, link_in_bps=2e6, link_out_bps=1e6)
    pred = predict(Setup(flat_model(*[1_000_000] * 4), two_islands(rate=1e9), 2, host), Choice(8, "f32", "f32", 4, 4))
    assert pred.round_s == pytest.approx(8.000298) and pred.bound == "syncer link out"
    assert pred.syncer_in_s == pytest.approx(4.000101)
    # the pushes of a round share the link in: the round's upload is 4.000101 s, not 4 ms
    assert pred.latency_s == pytest.approx(0.1 + 4.000101 + 0.025)


# ---- the search and its refusals --------------------------------------------------------------------------------


def test_recommend_takes_a_small_interval_then_the_most_precise_codec() -> None:
    # 4M f32 values behind 1 MB/s links, 0.1 s steps: an f32 round trip of the model takes ~16 s
    # each way, so f32 needs H ≈ 170; int4 pushes and bf16 deltas bring it under 100.
    setup = Setup(flat_model(*[1_000_000] * 4), two_islands(), 2, HOST)
    search = Search(fragments=(4,), pipelines=(2,))
    best = recommend(setup, search).best
    assert best.utilization >= 0.95
    smallest = {(c, d): recommend(setup, replace(search, codecs=(c,), downlinks=(d,))).best.choice.sync_interval
                for c in PUSH_CODECS for d in DOWNLINKS}
    band = min(smallest.values()) * 1.1  # an H within 10% of the smallest counts as small
    assert best.choice.sync_interval == smallest[best.choice.codec, best.choice.downlink] <= band
    assert smallest["f32", "f32"] > 160 and best.choice.sync_interval < 100
    # every more precise combination needs a larger H than the band allows
    for (codec, downlink), h in smallest.items():
        if (PUSH_CODECS.index(codec), DOWNLINKS.index(downlink)) < (PUSH_CODECS.index(best.choice.codec),
                                                                    DOWNLINKS.index(best.choice.downlink)):
            assert h > band, (codec, downlink, h)
    # and nothing smaller than the chosen H would do with the chosen codec
    assert predict(setup, replace(best.choice, sync_interval=best.choice.sync_interval - 4)).utilization < 0.95


def test_a_fast_link_keeps_f32_at_the_smallest_interval() -> None:
    setup = Setup(flat_model(*[1_000_000] * 4), two_islands(rate=1e10, step_s=1.0), 2, HOST)
    best = recommend(setup, Search()).best
    assert (best.choice.sync_interval, best.choice.codec, best.choice.downlink) == (24, "f32", "f32")


def test_refuses_state_larger_than_the_host() -> None:
    setup = Setup(flat_model(*[1_000_000] * 4), two_islands(), 2, replace(HOST, memory_bytes=20e6))
    with pytest.raises(PlanError, match=r"--syncer-memory-gib .*state alone is"):
        recommend(setup, Search())


def test_refuses_when_no_interval_reaches_the_target() -> None:
    setup = Setup(flat_model(*[1_000_000] * 4), two_islands(rate=1e3), 2, HOST)
    with pytest.raises(PlanError, match=r"--max-h 256: no plan reaches utilization 0.95"):
        recommend(setup, Search(max_interval=256))


def test_refuses_a_run_too_short_for_one_round_trip() -> None:
    setup = Setup(flat_model(*[1_000_000] * 4), two_islands(), 2, HOST)
    with pytest.raises(PlanError, match=r"--steps 20: the smallest workable H"):
        recommend(setup, Search(run_steps=20))


@pytest.mark.parametrize(("islands", "quorum", "match"), [
    ((Island(0.0, 1e6, 0.1),), 1, "--up-mbps: island 0"),
    ((Island(1e6, 1e6, -1.0),), 1, "--step-s: island 0"),
    ((Island(1e6, 1e6, 0.1),), 2, "--quorum 2"),
    ((), 1, "--islands"),
])
def test_refuses_bad_islands(islands: tuple[Island, ...], quorum: int, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        predict(Setup(flat_model(1000, 1000), islands, quorum, HOST), Choice(8, "f32", "f32", 2, 1))


def test_shared_moments_add_the_fragments_moment_to_its_pushes_and_broadcasts_and_to_both_sides_memory() -> None:
    """The moment's bytes are the live sessions' (`moment_nbytes`), on the wire and in memory."""
    from yeto_core.layout import specs_from_named_tensors
    from yeto_core.moments import moment_nbytes

    numels = [1_000_003, 999_000, 1_200_000, 800_000]
    named = [(f"layers.{i}.w", torch.empty(n, device="meta")) for i, n in enumerate(numels)]
    setup = Setup(flat_model(*numels), two_islands(rate=1e9), 2, HOST)
    choice = Choice(24, "f32", "f32", 4, 2)
    plain, shared = predict(setup, choice), predict(replace(setup, share_momentum=True), choice)
    sizes = plain.fragment_params
    layout = build_layout(specs_from_named_tensors(named), 4, "binpack")
    assert sorted(f.numel for f in layout.fragments) == sorted(sizes)
    assert sorted(moment_bytes(n) for n in sizes) == sorted(moment_nbytes(f) for f in layout.fragments)
    moment = sum(moment_bytes(n) for n in sizes) / 4  # a mean fragment's, as push_bytes is a mean push
    assert 0.53 < moment / (sum(numels) / 4) < 0.54  # ≈ 4.3 bits a value of the fragment
    assert shared.push_bytes == pytest.approx(plain.push_bytes + moment)
    assert shared.bcast_bytes == pytest.approx(plain.bcast_bytes + moment)
    assert plain.serial_s < shared.serial_s < 2 * plain.serial_s  # a fragment's moments averaged: one more merge
    assert plain.memory.shared_moments == 0 and plain.island_memory.shared_moments == 0
    depth, largest = 2, moment_bytes(max(sizes))
    assert shared.memory.shared_moments == pytest.approx(largest * (depth * 2 + 2) + 8 * max(sizes))
    assert shared.island_memory.shared_moments == pytest.approx(largest * (depth + 1) + 8 * max(sizes))
    assert shared.memory.total - plain.memory.total == pytest.approx(shared.memory.shared_moments)


# ---- the command ---------------------------------------------------------------------------------------------------


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_on_an_hf_config_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    LlamaConfig(**TINY).save_pretrained(tmp_path)
    code, out, err = run(capsys, "--model", str(tmp_path), "--islands", "3", "--up-mbps", "100,50,20",
                         "--down-mbps", "100", "--step-s", "0.5")
    assert code == 0, err
    assert "recommended: H=24, push codec f32, downlink f32" in out
    assert "compute utilization" in out and "syncer memory:" in out and "shared moments" not in out
    code, out, err = run(capsys, "--model", str(tmp_path), "--islands", "3", "--up-mbps", "100", "--down-mbps", "100",
                         "--step-s", "0.5", "--share-momentum")
    assert code == 0, err
    assert out.count("+ shared moments") == 2  # the syncer's memory and an island's
    code, out, err = run(capsys, "--model", str(tmp_path), "--islands", "2", "--up-mbps", "100", "--down-mbps", "100",
                         "--step-s", "0.5", "--lora-r", "4", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["model"]["tuning"] == "lora"
    assert doc["model"]["synced_params"] == sum(t.numel for t in lora_tensors(TINY, 4, ("q_proj", "k_proj", "v_proj",
                                                                                        "o_proj")))
    assert doc["recommended"]["choice"]["sync_interval"] == 24


def test_cli_on_safetensors_reads_the_header_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "model.safetensors"
    save_file({"model.embed_tokens.weight": torch.zeros(256, 64), "model.layers.0.mlp.up_proj.weight":
               torch.zeros(176, 64), "model.layers.1.mlp.up_proj.weight": torch.zeros(176, 64)}, str(ckpt))
    code, out, err = run(capsys, "--model", str(ckpt), "--up-mbps", "100", "--down-mbps", "100", "--step-s", "1",
                         "--json", "--h", "24", "--codec", "int8", "--downlink", "f32", "--fragments", "3",
                         "--pipeline", "2")
    assert code == 0, err
    pred = json.loads(out)["prediction"]
    assert pred["fragment_params"] == [256 * 64, 176 * 64, 176 * 64]  # the embedding alone, then one each
    # a header promising 1e12 floats whose data is not there: only the header is read
    fake = tmp_path / "huge.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": [1_000_000, 1_000_000], "data_offsets": [0, 4 * 10**12]}})
    fake.write_bytes(struct.pack("<Q", len(header)) + header.encode())
    code, out, err = run(capsys, "--model", str(fake), "--up-mbps", "1000", "--down-mbps", "1000", "--step-s", "1",
                         "--syncer-memory-gib", "1")
    assert code == 2 and "state alone is 7450.6 GiB" in err and err.count("\n") == 1


def test_cli_counts_a_syncer_checkpoint_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "syncer.safetensors"
    save_file({"param/a": torch.zeros(100, 10), "momentum/a": torch.zeros(100, 10), "param/b": torch.zeros(50),
               "momentum/b": torch.zeros(50)}, str(ckpt))
    code, out, err = run(capsys, "--model", str(ckpt), "--up-mbps", "100", "--down-mbps", "100", "--step-s", "1",
                         "--json")
    assert code == 0, err
    assert json.loads(out)["model"]["synced_params"] == 1050


@pytest.mark.parametrize(("argv", "message"), [
    (["--preset", "7b", "--up-mbps", "0", "--down-mbps", "100", "--step-s", "1"], "--up-mbps '0': island 0's value"),
    (["--preset", "7b", "--up-mbps", "100", "--down-mbps", "100", "--step-s", "1", "--syncer-memory-gib", "16"],
     "--syncer-memory-gib 16.0: the syncer's state alone is 50.2 GiB"),
    (["--preset", "7b", "--islands", "4", "--up-mbps", "1,2", "--down-mbps", "1", "--step-s", "1"],
     "--up-mbps '1,2': 2 values for --islands 4"),
    (["--model", "/nonexistent/model", "--up-mbps", "1", "--down-mbps", "1", "--step-s", "1"], "--model"),
    (["--preset", "7b", "--step-s", "1"], "--up-mbps/--down-mbps: give the islands' rates, or --probe"),
    (["--preset", "7b", "--up-mbps", "1000", "--down-mbps", "1000", "--step-s", "1", "--syncer-memory-gib", "500",
      "--max-h", "64"], "--max-h 64: no plan reaches utilization 0.95"),
    *[(["--preset", "7b", "--up-mbps", "100", "--down-mbps", "100", "--step-s", "1", *flag], flag[0]) for flag in (
        ["--quorum", "-1"], ["--queue-ms", "-1"], ["--tcp-efficiency", "1.5"], ["--syncer-mbps", "0"],
        ["--target-utilization", "nan"], ["--step-s", "inf"], ["--steps", "0"])],
])
def test_cli_refusals_are_one_line_and_exit_2(argv: list[str], message: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("yeto-plan: ") and message in err and err.count("\n") == 1, err


def test_an_islands_memory_counts_anchors_work_buffers_and_one_payload_each_way() -> None:
    sizes = [1000, 3000, 2000]  # the largest fragment sizes every buffer
    f32 = island_memory(Choice(24, "f32", "f32", 3, 2), sizes)
    assert (f32.anchors, f32.work_buffers, f32.push_payload, f32.broadcast_receive) == (
        4.0 * 6000, 4.0 * 3 * 3000, 4.0 * 3000, 4.0 * 3000)
    assert f32.total == 4.0 * 6000 + 4.0 * 5 * 3000
    int8 = island_memory(Choice(24, "int8", "bf16", 3, 2), sizes)
    assert int8.push_payload == payload_bytes("int8", 3000) and int8.broadcast_receive == 2.0 * 3000
    assert int8.anchors == f32.anchors and int8.work_buffers == f32.work_buffers
