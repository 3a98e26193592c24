"""`yeto-plan` on absurd and malformed inputs: exit 2 and one line naming the flag or the config field,
before anything is sized by the bad value, so an absurd count costs neither memory nor time."""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path

import pytest
from peak_rss import run_measured

from syncer.tools import plan, plan_model
from syncer.tools.plan_cli import MAX_PROBE_MIB, main
from yeto_core import quant
from yeto_core.wire.messages import MAX_PROBE_BYTES

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]
ROOT = Path(__file__).resolve().parents[2]
TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}
LINKS = ["--up-mbps", "100", "--down-mbps", "100", "--step-s", "1", "--syncer-memory-gib", "64"]


def refused(capsys: pytest.CaptureFixture[str], argv: list[str], *says: str) -> None:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code  # type: ignore[assignment]
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1, (code, err)
    assert lines[0].startswith("yeto-plan: ") and all(s in lines[0] for s in says), lines


def config_dir(tmp_path: Path, content: object) -> Path:
    directory = tmp_path / "model"
    directory.mkdir()
    text = content if isinstance(content, str) else json.dumps(content)
    (directory / "config.json").write_text(text)
    return directory


def test_the_bounds_are_the_ones_yeto_enforces() -> None:
    assert MAX_PROBE_MIB << 20 == MAX_PROBE_BYTES and plan.MAX_BLOCK == quant.MAX_BLOCK


@pytest.mark.parametrize(("flags", "says"), [
    (["--islands", "100000000"], "--islands 100000000: must be between 1 and 1024"),
    (["--islands", "0"], "--islands 0: must be between 1 and 1024"),
    (["--lora-r", "1000000000"], "--lora-r 1000000000: must be between 0 and 65536"),
    (["--h", "0", "--codec", "f32", "--downlink", "f32", "--fragments", "1", "--pipeline", "1"], "--h 0"),
    (["--h", "1000000000000"], "--h 1000000000000: must be between 1 and 1048576"),
    (["--h", "24", "--codec", "f32", "--downlink", "f32", "--fragments", "1000000000", "--pipeline", "1"],
     "--fragments 1000000000: must be between 1 and 4096"),
    (["--pipeline", "0"], "--pipeline 0"),
    (["--max-h", "1000000000000"], "--max-h 1000000000000"),
    (["--min-h", "100", "--max-h", "50"], "--min-h 100, --max-h 50: need 1 <= --min-h <= --max-h"),
    (["--push-block", "0"], "--push-block 0: must be between 1 and 1048576"),
    (["--probe-mib", "0", "--probe", "127.0.0.1:1"], "--probe-mib 0: must be between 1 and 1024"),
    (["--checkpoint-every", "-3"], "--checkpoint-every -3"),
    (["--checkpoint-every", "3", "--checkpoint-gbps", "0"], "--checkpoint-gbps 0: must be in (0, 1000000]"),
    (["--merge-gbps", "inf"], "--merge-gbps inf"),
    (["--rtt-ms", "nan"], "--rtt-ms nan"),
    (["--syncer-memory-gib", "1e300"], "--syncer-memory-gib 1e+300"),
    (["--tokens-per-step", "-1"], "--tokens-per-step -1"),
    (["--islands", "4", "--up-mbps", ",".join(["100"] * 100_000)], "--up-mbps: 100000 values for --islands 4"),
    (["--up-mbps", "1e300"], "--up-mbps '1e300': island 0's value 1e+300 must be a finite number > 0"),
    (["--islands", "x"], "argument --islands: invalid int value: 'x'"),
    (["--codec", "fp7"], "argument --codec: invalid choice: 'fp7'"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_a_flag_out_of_bounds_is_one_line_naming_it(capsys: pytest.CaptureFixture[str], flags: list[str],
                                                    says: str) -> None:
    argv = ["--preset", "7b", *LINKS, *flags]  # a flag given twice: the later wins
    refused(capsys, argv, says)


@pytest.mark.parametrize(("config", "says"), [
    ({**TINY, "num_hidden_layers": 10**9}, "config field num_hidden_layers = 1000000000: must be an integer between 1"),
    ({**TINY, "hidden_size": 10**12}, "config field hidden_size = 1000000000000"),
    ({**TINY, "vocab_size": 10**400}, "config field vocab_size = 1000000"),
    ({**TINY, "hidden_size": "64"}, "config field hidden_size = '64': must be an integer"),
    ({**TINY, "num_hidden_layers": True}, "config field num_hidden_layers = True"),
    ({**TINY, "intermediate_size": 176.5}, "config field intermediate_size = 176.5"),
    ({**TINY, "num_attention_heads": 0}, "config field num_attention_heads = 0"),
    ({**TINY, "num_attention_heads": 128}, "num_attention_heads = 128 is more than hidden_size = 64"),
    ({**TINY, "head_dim": -1}, "config field head_dim = -1"),
    ({k: v for k, v in TINY.items() if k != "vocab_size"}, "the config lacks the decoder field vocab_size"),
    ("[" * 100_000 + "]" * 100_000, "config.json is not readable JSON"),
    ('{"hidden_size": NaN}', "config field hidden_size = nan"),
    (" " * (1 << 20) + "{}", "config.json is 1048578 bytes"),
], ids=["layers", "hidden", "vocab-huge", "hidden-str", "layers-bool", "inter-float", "heads-zero", "heads-many",
        "head-dim", "missing", "deep", "nan", "huge"])
def test_a_bad_model_config_is_one_line_naming_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        config: object, says: str) -> None:
    model = config_dir(tmp_path, config)
    refused(capsys, ["--model", str(model), *LINKS], f"--model {model}", says)
    refused(capsys, ["--model", str(model), "--lora-r", "4", *LINKS], f"--model {model}", says)


def safetensors(path: Path, header: object) -> Path:
    raw = (header if isinstance(header, str) else json.dumps(header)).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    return path


@pytest.mark.parametrize(("header", "says"), [
    ({"w": {"dtype": "F32", "shape": ["a", 4], "data_offsets": [0, 16]}}, "tensor 'w' has the shape ['a', 4]"),
    ({"w": {"dtype": "F32", "shape": [-1, 4], "data_offsets": [0, 16]}}, "tensor 'w' has the shape [-1, 4]"),
    ({"w": {"dtype": "F32", "shape": [1] * 100, "data_offsets": [0, 4]}}, "at most 8 dimensions"),
    ({"w": {"dtype": "F32", "shape": [10**30], "data_offsets": [0, 4]}}, "has more than 281474976710656 elements"),
    ({"w": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, "tensor 'w' has the shape [True]"),
    ("[" * 100_000 + "]" * 100_000, "the safetensors header is not a JSON object"),
], ids=["str-dim", "negative-dim", "many-dims", "huge", "bool-dim", "deep"])
def test_a_bad_safetensors_header_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], header: object,
                                              says: str) -> None:
    model = safetensors(tmp_path / "model.safetensors", header)
    refused(capsys, ["--model", str(model), *LINKS], "--model", says)


def test_too_many_tensors_are_refused_before_they_are_listed(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plan_model, "MAX_TENSORS", 100)  # the bound is 2^18; the check is the same
    model = safetensors(tmp_path / "model.safetensors", {f"t{i}": {"shape": [1]} for i in range(500)})
    refused(capsys, ["--model", str(model), *LINKS], "500 tensors in the safetensors headers; at most 100")


def test_unusable_model_paths_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    refused(capsys, ["--model", "/dev/zero", *LINKS], "--model /dev/zero: the safetensors file is not a regular file")
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)  # opening it would wait for a writer forever
    refused(capsys, ["--model", str(fifo), *LINKS], "is not a regular file")
    refused(capsys, ["--model", str(tmp_path), *LINKS], "is not a regular file")  # a dir holding the FIFO
    (tmp_path / "cfg" / "config.json").mkdir(parents=True)
    refused(capsys, ["--model", str(tmp_path / "cfg"), *LINKS], "config.json is not a regular file")
    big = tmp_path / "big.safetensors"
    big.write_bytes(struct.pack("<Q", 1 << 40))
    refused(capsys, ["--model", str(big), *LINKS], f"a {1 << 40}-byte header is not a safetensors header")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss is in KiB on Linux")
@pytest.mark.parametrize("absurd", ["layers", "islands"])
def test_an_absurd_count_returns_at_once_in_bounded_memory(tmp_path: Path, absurd: str) -> None:
    """Before, 10^9 layers built a tensor list, and 10^8 islands a rate list, until the kernel killed it."""
    if absurd == "layers":
        model, says = ["--model", str(config_dir(tmp_path, {**TINY, "num_hidden_layers": 10**9}))], "num_hidden_layers"
    else:
        model, says = ["--preset", "70b", "--islands", "100000000"], "--islands 100000000"
    code, err, seconds, rss = run_measured([sys.executable, "-m", "syncer.tools.plan_cli", *model, *LINKS], ROOT)
    assert code == 2 and err.count("\n") == 1 and says in err and "Traceback" not in err, err
    assert rss < 200 << 20 and seconds < 60, (rss >> 20, seconds)
