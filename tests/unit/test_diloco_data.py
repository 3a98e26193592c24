"""compare_diloco's texts, model families, schedules and matrix cells: what each arm trains."""

import itertools
import math
import re
from dataclasses import asdict

import pytest
import torch

from benchmarks import diloco_data, diloco_matrix
from benchmarks.compare_diloco import _same, base_shape, parse
from benchmarks.diloco_arm import Arm, Shape


def test_constant_schedule_is_hf_constant_with_warmup() -> None:
    factors = [diloco_data.lr_factor("constant", 20, 288, step) for step in range(288)]
    assert factors[:21] == [min(1.0, (step + 1) / 21) for step in range(21)]
    assert set(factors[20:]) == {1.0}


def test_cosine_schedule_decays_to_a_tenth_at_the_last_step() -> None:
    factors = [diloco_data.lr_factor("cosine", 20, 288, step) for step in range(289)]
    assert factors[19] < 1.0 and factors[20] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(factors[20:]))
    assert factors[288] == pytest.approx(diloco_data.COSINE_FLOOR)
    assert factors[154] == pytest.approx(0.55, abs=0.01)  # half way down the cosine


def test_unknown_names_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown schedule 'linear'"):
        diloco_data.lr_factor("linear", 20, 288, 30)
    with pytest.raises(ValueError, match="unknown family 'bert'"):
        diloco_data.build_model("bert", 32, 1, 16, 0)
    with pytest.raises(ValueError, match="unknown corpus 'wiki'"):
        diloco_data.corpus_bytes("wiki")


def test_gpt2_family_has_learned_positions_layer_norm_gelu_and_tied_embeddings() -> None:
    model = diloco_data.build_model("gpt2", 32, 2, 16, seed=3)
    config = model.config
    assert (config.n_embd, config.n_layer, config.n_positions, config.vocab_size) == (32, 2, 16, 256)
    assert config.activation_function.startswith("gelu")
    assert model.transformer.wpe.weight.shape == (16, 32)  # learned positions
    assert isinstance(model.transformer.ln_f, torch.nn.LayerNorm)
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    again = diloco_data.build_model("gpt2", 32, 2, 16, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))
    x = torch.randint(0, 256, (2, 16))
    assert math.isfinite(model(input_ids=x, labels=x).loss.item())


def test_neox_family_has_partial_rotary_layer_norm_parallel_residual_and_untied_embeddings() -> None:
    model = diloco_data.build_model("neox", 32, 2, 16, seed=3)
    config = model.config
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (32, 2, 256)
    assert config.rope_parameters["partial_rotary_factor"] == 0.25 and config.use_parallel_residual
    assert isinstance(model.gpt_neox.final_layer_norm, torch.nn.LayerNorm)
    assert model.get_output_embeddings().weight.data_ptr() != model.gpt_neox.embed_in.weight.data_ptr()  # untied
    again = diloco_data.build_model("neox", 32, 2, 16, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))
    x = torch.randint(0, 256, (2, 16))
    assert math.isfinite(model(input_ids=x, labels=x).loss.item())


def test_matrix_runs_its_longer_cells_on_the_two_families_the_defaults_were_measured_on() -> None:
    cells = diloco_matrix.all_cells()
    assert {c.family for c in cells if c.m == 2 and c.h == 24} == set(diloco_data.FAMILIES)
    assert {c.family for c in cells if c.m > 2 or c.h > 24} == set(diloco_matrix.DEEP_FAMILIES) == {"llama", "gpt2"}
    assert [c.name for c in diloco_matrix.pick("neox-*")] == [
        "neox-help-constant-h24-m2", "neox-help-cosine-h24-m2", "neox-code-constant-h24-m2", "neox-code-cosine-h24-m2"]


def test_shards_are_contiguous_and_disjoint_and_held_out_is_thinned() -> None:
    for corpus in diloco_data.CORPORA:
        whole = diloco_data.shard(corpus, 64, 0, 1)
        parts = [diloco_data.shard(corpus, 64, i, 4) for i in range(4)]
        assert sum(len(p) for p in parts) <= len(whole)
        assert torch.equal(parts[0][0], whole[0])
        held = diloco_data.held_out(corpus, 64)
        assert 100 < len(held) <= diloco_data.EVAL_BLOCKS
        assert int(held.max()) < 256
    assert len(diloco_data.corpus_bytes("code")) == diloco_data.CODE_BYTES
    # The help text's held-out split is under the cap: the single-shape benchmark's numbers stay as they were.
    assert len(diloco_data.held_out("help", 64)) < diloco_data.EVAL_BLOCKS


def test_matrix_cells_cover_the_issue_and_pick_by_glob() -> None:
    cells = diloco_matrix.all_cells()
    names = [c.name for c in cells]
    assert len(set(names)) == len(names)
    m2 = [c for c in cells if c.m == 2 and c.h == 24]
    assert {(c.family, c.corpus, c.schedule) for c in m2} == {
        (f, c, s) for f in diloco_data.FAMILIES for c in diloco_data.CORPORA for s in diloco_data.SCHEDULES}
    assert {c.m for c in cells} == {2, 4, 8} and {c.h for c in cells} == {24, 96}
    assert any(c.slow for c in cells)
    assert [c.name for c in diloco_matrix.pick("gpt2-*-h96-m2")] == ["gpt2-help-constant-h96-m2",
                                                                   "gpt2-help-cosine-h96-m2"]
    with pytest.raises(ValueError, match="matches no cell"):
        diloco_matrix.pick("resnet-*")
    long = diloco_matrix.Cell("llama", "code", "cosine", 24, 8).shape(Shape())
    assert (long.steps, long.family, long.corpus, long.schedule) == (576, "llama", "code", "cosine")
    gpt2 = diloco_matrix.Cell("gpt2", "help", "constant", 24, 2)
    assert gpt2.shape(Shape()).lr == diloco_data.FAMILY_LR["gpt2"] != long.lr == diloco_data.FAMILY_LR["llama"]
    assert gpt2.shape(Shape(), lr=1e-3).lr == 1e-3  # --lr wins over the family's
    kinds = {a.name.split(":")[1]: a for a in diloco_matrix.Cell("gpt2", "help", "constant", 24, 2).arms()}
    wire = {f"wire-{key}{tail}" for key in diloco_matrix.WIRE_PAIRS for tail in ("", "-unpaced")}
    assert set(kinds) == {"dp", "alone", "yeto", "yeto-unpaced", *wire} and kinds["yeto-unpaced"].unpaced
    assert {k for k, a in kinds.items() if a.in_default_run} == {"dp", "alone", "yeto", "yeto-unpaced"}
    assert kinds["wire-i4i2-unpaced"].unpaced and kinds["wire-i4i2"].learner == {"wire_dtype": "int4",
                                                                                  "downlink_dtype": "int2"}
    slow = {a.name.split(":")[1]: a for a in diloco_matrix.Cell("llama", "code", "constant", 24, 4, True).arms()}
    assert slow["drop"].learners == 3 and slow["drop"].shards == 4
    assert slow["wait"].lockstep_threads and slow["wait"].slow == slow["yeto-slow"].slow == 4
    assert slow["yeto-slow"].fleet_budget and slow["drop"].fleet_budget and not slow["wait"].fleet_budget
    # In the time four islands, one at 1/4 speed, take 4·576 steps, three at full speed take 3·709.
    assert slow["drop-time"].learners == 3 and slow["drop-time"].shards == 4 and slow["drop-time"].fleet_budget
    assert round(slow["drop-time"].fleet_share * 4 * 576) == 2127 == 3 * 709
    assert slow["drop"].fleet_share == slow["yeto-slow"].fleet_share == 1.0
    long = slow["yeto-slow-long"]  # yeto-slow trained on, past equal tokens
    assert long.fleet_share == diloco_matrix.LONG_SHARE > 1 and long.fleet_budget and long.unpaced
    assert (long.slow, long.learners) == (slow["yeto-slow"].slow, slow["yeto-slow"].learners)


def test_a_llama_takes_gpt2s_and_neoxs_parts_one_by_one() -> None:
    plain = diloco_data.build_model("llama", 32, 2, 16, seed=3)
    assert not any(name.endswith(".bias") for name, _ in plain.named_parameters())
    biased = diloco_data.build_model("llama+bias", 32, 2, 16, seed=3)
    layer = biased.model.layers[0]
    assert layer.self_attn.q_proj.bias is not None and layer.mlp.up_proj.bias is not None
    every = diloco_data.build_model("llama+" + "+".join(diloco_data.LLAMA_PARTS), 32, 2, 16, seed=3)
    config = every.config
    assert config.hidden_act == "gelu" and config.intermediate_size == 4 * 32
    assert config.num_key_value_heads == config.num_attention_heads and not config.tie_word_embeddings
    assert isinstance(every.model.norm, torch.nn.LayerNorm) and every.model.norm.bias is not None
    assert all(isinstance(layer.input_layernorm, torch.nn.LayerNorm) for layer in every.model.layers)
    assert every.get_output_embeddings().weight.data_ptr() != every.model.embed_tokens.weight.data_ptr()
    # A part that draws no weights leaves the rest as the plain Llama's: the same seed, the same start.
    normed = diloco_data.build_model("llama+ln", 32, 2, 16, seed=3)
    drawn = {n: p for n, p in plain.named_parameters() if "norm" not in n}
    assert all(torch.equal(p, drawn[n]) for n, p in normed.named_parameters() if "norm" not in n)
    x = torch.randint(0, 256, (2, 16))
    assert math.isfinite(every(input_ids=x, labels=x).loss.item())
    assert diloco_data.family_lr("llama+bias+ln") == diloco_data.FAMILY_LR["llama"]


@pytest.mark.parametrize(("family", "says"), [
    ("llama+nope", "unknown part 'nope'"), ("gpt2+bias", "unknown family 'gpt2+bias'"),
    ("llama+ln+ln", "names a part twice"), ("bert", "unknown family 'bert'"),
])
def test_a_misspelt_family_is_refused_in_one_line(family: str, says: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        diloco_data.build_model(family, 32, 1, 16, 0)
    with pytest.raises(SystemExit) as exit_:
        parse(["--family", family])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--family" in err and says in err


def test_the_bench_model_of_another_family_takes_that_familys_rate() -> None:
    assert base_shape(parse(["--family", "gpt2"])).lr == diloco_data.FAMILY_LR["gpt2"]
    assert base_shape(parse(["--family", "gpt2", "--lr", "1e-3"])).lr == 1e-3
    assert base_shape(parse([])).lr == Shape().lr == diloco_data.FAMILY_LR["llama"]
    assert base_shape(parse(["--model", "main", "--family", "gpt2"])).lr == 3e-3  # its own rate
    assert base_shape(parse(["--family", "llama+gelu+wide"])).lr == diloco_data.FAMILY_LR["llama"]


def test_baselines_reuse_runs_recorded_before_a_field_was_added() -> None:
    arm = Arm("c:dp", "dp", learners=4, cell="c")
    recorded = {k: v for k, v in asdict(arm).items() if k != "fleet_budget"}  # written before the field
    assert _same(recorded, arm) and _same(asdict(Shape()), Shape())
    assert not _same(recorded, Arm("c:dp", "dp", learners=4, cell="c", fleet_budget=True))
    assert not _same({**recorded, "learners": 2}, arm) and not _same(None, arm)


def test_goal_rows_read_ratio_and_gap() -> None:
    cell = diloco_matrix.Cell("llama", "help", "constant", 24, 2)
    runs = {f"{cell.name}:dp": [{"final_loss": 1.0}], f"{cell.name}:alone": [{"final_loss": 1.2}],
            f"{cell.name}:yeto": [{"final_loss": 1.01, "train_s": 3.0}, {"final_loss": 1.03, "train_s": 5.0}],
            f"{cell.name}:yeto-unpaced": [{"final_loss": 1.1, "train_s": 2.0}]}
    rows = {r["arm"]: r for r in diloco_matrix.rows([cell], runs)}
    assert rows["yeto"]["ratio_dp"] == pytest.approx(1.02) and rows["yeto"]["gap_closed"] == pytest.approx(0.9)
    assert rows["yeto"]["met"] and rows["yeto"]["train_s"] == 4.0
    assert not rows["yeto-unpaced"]["met"] and rows["yeto-unpaced"]["gap_closed"] == pytest.approx(0.5)


def test_the_slow_cell_is_judged_at_equal_tokens_and_in_equal_time() -> None:
    cell = diloco_matrix.Cell("llama", "code", "constant", 24, 4, slow=True)
    runs = {f"{cell.name}:{arm}": [{"final_loss": loss, "train_s": s}]
            for arm, loss, s in (("yeto-slow", 1.52, 80.0), ("drop", 1.51, 90.0), ("drop-time", 1.53, 80.0),
                                 ("wait", 1.53, 440.0))}
    verdicts = {what.split(": ", 1)[1]: met for what, _, met in diloco_matrix.slow_verdicts([cell], runs)}
    assert verdicts == {"with the slow island beats without it, at equal tokens": False,
                        "with the slow island beats without it, in equal time": True,
                        "reaches lockstep's loss in less time": True}


def test_time_to_a_loss_is_interpolated_between_the_points_around_it() -> None:
    curve = [(10.0, 2.0, 100), (20.0, 1.6, 200), (30.0, 1.4, 300), (40.0, 1.5, 400)]
    assert diloco_matrix.time_to(curve, 1.5) == pytest.approx((25.0, 250.0))  # half way from 1.6 to 1.4
    assert diloco_matrix.time_to(curve, 1.4) == pytest.approx((30.0, 300.0))  # reached exactly at a point
    assert diloco_matrix.time_to(curve, 2.5) == (10.0, 100.0)  # below it from the first point
    assert diloco_matrix.time_to(curve, 1.3) is None  # never reached
    assert diloco_matrix.time_to([], 1.0) is None


def test_the_slow_cell_trained_on_is_judged_by_when_it_reaches_lockstep() -> None:
    cell = diloco_matrix.Cell("llama", "code", "constant", 24, 4, slow=True)
    base = {f"{cell.name}:{arm}": [{"final_loss": loss, "train_s": s, "tokens": 1000}]
            for arm, loss, s in (("yeto-slow", 1.54, 80.0), ("wait", 1.53, 440.0))}
    reach = [(60.0, 1.6, 800), (100.0, 1.52, 1200), (120.0, 1.51, 1500)]
    never = [(60.0, 1.6, 800), (120.0, 1.55, 1500)]

    def verdict(curves: list[list[tuple[float, float, int]]]) -> tuple[str, bool]:
        runs = {**base, f"{cell.name}:yeto-slow-long": [{"final_loss": c[-1][1], "train_s": c[-1][0], "wall_curve": c,
                                                         "tokens": c[-1][2]} for c in curves]}
        lines = {what.split(": ", 1)[1]: (said, met) for what, said, met in diloco_matrix.slow_verdicts([cell], runs)}
        assert not lines["reaches lockstep's loss in less time"][1]  # at equal tokens it stops short
        # the long arm has no row of the equal-token table
        assert {r["arm"] for r in diloco_matrix.rows([cell], runs)} == {"yeto-slow", "wait"}
        return lines["training on, reaches lockstep's loss sooner"]

    said, met = verdict([reach, reach])
    assert met and said == "1.5300 at 95 s (1.15x its tokens) vs 440 s"
    said, met = verdict([reach, never])
    assert not met and said == "1 of 2 seeds never reach 1.5300"
    late = [(60.0, 1.6, 800), (120.0, 1.55, 1400)]  # the final cut's model, at train_s, ends the curve
    runs = {**base, f"{cell.name}:yeto-slow-long": [{"final_loss": 1.50, "train_s": 130.0, "wall_curve": late,
                                                     "tokens": 1500}]}
    lines = {what.split(": ", 1)[1]: said for what, said, _ in diloco_matrix.slow_verdicts([cell], runs)}
    assert lines["training on, reaches lockstep's loss sooner"] == "1.5300 at 124 s (1.44x its tokens) vs 440 s"
