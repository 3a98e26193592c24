"""How much slower an HF Trainer's step gets with a yeto island attached.

    python -m benchmarks.stall [--models main,llama60m] [--pairs 2] [--steps 72] [--out DIR]
    python -m benchmarks.stall --quick             # the main job's model, one pair, 30 steps
    python -m benchmarks.stall --share-momentum    # the islands' optimizer moments shared (DESIGN §3.9)

For each model, runs of the same Trainer alternate in one process, without yeto and with the
`YetoDiLoCo` callback (a real `python -m syncer` of one learner on 127.0.0.1, H = 24, P = 4, the
shipped settings), `--pairs` times, so both arms see the same machine. The Trainer's process (its
training thread, and yeto's link threads beside it) is pinned to core 0 and the syncer to the other
cores, since a real island does not share its machine with the syncer (`--no-pin` does not), and
training uses `--threads` torch threads (1). Each step's time is the wall
time between one `on_step_end` and the next, measured by a callback that runs before yeto's: it
holds the forward, backward and optimizer step and everything yeto's callback did after the
previous step (a fragment read, θ − anchor, an install). The first two steps of a run (start-up,
the initial cut) and its last (the final cut) are left out. It prints the median and p99 step time
of each arm, their ratios, and the share of the yeto run's time its training thread spent inside
yeto (the island's own `in_yeto_s`, which its /metrics and the Trainer's logs show as
`yeto_seconds`). The last line is `stall at H=24: median +X%, p99 ×Y (model)` for the model with
the larger median stall.

Models (built from configs, byte-level vocabulary, trained on the standard library's source):
* `main`: the main job's Llama (hidden 128, 4 layers, 0.75M parameters), batch 16 × 128 tokens;
* `llama60m`: a Llama of hidden 768, 8 layers, MLP 2048 (57M parameters), batch 2 × 64 tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.ingest import ProbedSyncer

MODELS: dict[str, dict[str, int]] = {
    "main": {"hidden": 128, "layers": 4, "mlp": 336, "batch": 16, "seq": 128},
    "llama60m": {"hidden": 768, "layers": 8, "mlp": 2048, "batch": 2, "seq": 64},
}
H, FRAGMENTS = 24, 4
SKIP_HEAD, SKIP_TAIL = 2, 1


def build(spec: dict[str, int], seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=spec["hidden"], intermediate_size=spec["mlp"],
                         num_hidden_layers=spec["layers"], num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=spec["seq"], tie_word_embeddings=True, bos_token_id=None,
                         eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


class Blocks(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Byte blocks of the standard library's source: enough for any run here, made on the spot."""

    def __init__(self, seq: int, count: int) -> None:
        import sysconfig

        text = bytearray()
        for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
            text += path.read_bytes()
            if len(text) >= seq * count:
                break
        self.blocks = torch.frombuffer(text[: seq * count], dtype=torch.uint8).long().view(count, seq)

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def one_run(spec: dict[str, int], steps: int, workdir: Path, syncer_env: dict[str, str] | None) -> dict[str, Any]:
    """One Trainer run of `steps` steps; with `syncer_env`, the YetoDiLoCo callback joins that syncer."""
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.ends.append(time.perf_counter())

    clock = StepClock()
    callbacks: list[Any] = [clock]
    yeto = None
    saved = {k: os.environ.get(k) for k in (syncer_env or {})}
    try:
        if syncer_env is not None:
            os.environ.update(syncer_env)
            from yeto_plugins.hf import YetoDiLoCo

            yeto = YetoDiLoCo()
            callbacks.append(yeto)  # after the clock: its work lands in the next step's interval
        targs = TrainingArguments(output_dir=str(workdir), max_steps=steps, per_device_train_batch_size=spec["batch"],
                                  learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=10_000,
                                  save_strategy="no", report_to=[], use_cpu=True, dataloader_num_workers=0,
                                  disable_tqdm=True, seed=0)
        trainer = Trainer(model=build(spec, 0), args=targs, train_dataset=Blocks(spec["seq"], steps * spec["batch"]),
                          callbacks=callbacks)
        trainer.remove_callback(PrinterCallback)  # its log lines would interleave with the benchmark's
        started = time.perf_counter()
        trainer.train()
        total = time.perf_counter() - started
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    gaps = [b - a for a, b in zip(clock.ends, clock.ends[1:], strict=False)]
    out: dict[str, Any] = {"step_s": gaps[SKIP_HEAD - 1 : len(gaps) - SKIP_TAIL], "total_s": total}
    if yeto is not None:
        assert yeto.island is not None
        stats = yeto.island.stats
        out.update(in_yeto_s=stats.in_yeto_s, pushes=stats.pushes, final=yeto.final_installed,
                   moments_shared=0 if stats.learner is None else stats.learner.moments_shared)
    return out


def pin(pid: int, cores: set[int]) -> None:
    """Every thread of `pid` onto `cores` (threads it starts later inherit the mask)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError, FileNotFoundError):
            os.sched_setaffinity(int(task.name), cores)


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def measure(name: str, spec: dict[str, int], args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    key = os.urandom(16).hex()
    key_file = tmp / "key"
    key_file.write_text(key)
    runs: dict[str, list[dict[str, Any]]] = {"without": [], "with": []}
    for pair in range(args.pairs):
        for arm in ("without", "with") if pair % 2 == 0 else ("with", "without"):
            workdir = tmp / f"{name}-{arm}-{pair}"
            workdir.mkdir()
            if arm == "without":
                runs[arm].append(one_run(spec, args.steps, workdir, None))
                continue
            syncer = ProbedSyncer(workdir, key_file, FRAGMENTS, "cpu", learners=1)
            if args.pin:
                pin(syncer.proc.pid, set(range(1, os.cpu_count() or 2)))
            try:
                env = {"YETO_DILOCO_SYNCER": f"127.0.0.1:{syncer.port}", "YETO_DILOCO_KEY_FILE": str(key_file),
                       "YETO_DILOCO_LEARNER_ID": "0", "YETO_DILOCO_SYNC_INTERVAL": str(H),
                       "YETO_DILOCO_SHARE_MOMENTUM": "true" if args.share_momentum else "false"}
                got = one_run(spec, args.steps, workdir, env)
            finally:
                syncer.close()
            if args.share_momentum and not got["moments_shared"]:
                raise RuntimeError(f"{name}: --share-momentum, but no install took the fleet's moment")
            if not got["final"] or got["pushes"] < FRAGMENTS:
                raise RuntimeError(f"{name}: the yeto run pushed {got['pushes']} times and installed the final cut: "
                                   f"{got['final']}")
            runs[arm].append(got)
            print(f"  {name} pair {pair}: with yeto {statistics.median(got['step_s']) * 1e3:.1f} ms median step, "
                  f"{got['pushes']} pushes, {got['in_yeto_s']:.2f} s of {got['total_s']:.1f} s in yeto", flush=True)
    without = [s for r in runs["without"] for s in r["step_s"]]
    with_ = [s for r in runs["with"] for s in r["step_s"]]
    in_yeto = sum(r["in_yeto_s"] for r in runs["with"]) / sum(r["total_s"] for r in runs["with"])
    params = sum(p.numel() for p in build(spec, 0).parameters())
    return {"model": name, "params": params, "median_without": statistics.median(without),
            "median_with": statistics.median(with_), "p99_without": p99(without), "p99_with": p99(with_),
            "median_ratio": statistics.median(with_) / statistics.median(without),
            "p99_ratio": p99(with_) / p99(without), "in_yeto_share": in_yeto, "steps_each": len(with_)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.stall", description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="main,llama60m", help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--pairs", type=int, default=2, help="runs of each arm, alternating (default 2)")
    ap.add_argument("--steps", type=int, default=72, help="steps per run (default 72: three rounds of H = 24)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the Trainer's core)")
    ap.add_argument("--no-pin", dest="pin", action="store_false",
                    help="do not pin the Trainer's process to core 0 and the syncer to the other cores")
    ap.add_argument("--out", type=Path, default=None, help="write stall.json here")
    ap.add_argument("--quick", action="store_true", help="the main job's model, one pair of 30-step runs")
    ap.add_argument("--share-momentum", action="store_true",
                    help="YETO_DILOCO_SHARE_MOMENTUM: every boundary reads and encodes its fragment's moment")
    args = ap.parse_args(argv)
    if args.quick:
        args.models, args.pairs, args.steps = "main", 1, 30
    names = [m.strip() for m in args.models.split(",") if m.strip()]
    if unknown := [m for m in names if m not in MODELS]:
        ap.error(f"--models: unknown {', '.join(unknown)}; accepted: {', '.join(MODELS)}")
    if args.pairs < 1 or args.steps < H // FRAGMENTS + SKIP_HEAD + SKIP_TAIL + 2:
        ap.error("--pairs must be >= 1 and --steps long enough for a push")
    args.pin = args.pin and (os.cpu_count() or 1) >= 2
    if args.pin:  # before torch starts its threads: they inherit core 0
        pin(os.getpid(), {0})
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    rows = []
    with tempfile.TemporaryDirectory(prefix="yeto-stall-") as tmp_dir:
        for name in names:
            tmp = Path(tmp_dir) / name
            tmp.mkdir()
            with contextlib.redirect_stderr(open(os.devnull, "w")):
                rows.append(measure(name, MODELS[name], args, tmp))
    print(f"{'model':<10} {'params':>8} {'median ms':>18} {'p99 ms':>18} {'median':>8} {'p99':>7} {'in yeto':>8}")
    for r in rows:
        print(f"{r['model']:<10} {r['params'] / 1e6:>7.1f}M {r['median_without'] * 1e3:>8.1f} → "
              f"{r['median_with'] * 1e3:>6.1f} {r['p99_without'] * 1e3:>8.1f} → {r['p99_with'] * 1e3:>6.1f} "
              f"{(r['median_ratio'] - 1) * 100:>+7.1f}% {r['p99_ratio']:>6.2f}x {r['in_yeto_share'] * 100:>7.1f}%")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "stall.json").write_text(json.dumps(rows, indent=1))
    worst = max(rows, key=lambda r: r["median_ratio"])
    print(f"stall at H={H}: median {(worst['median_ratio'] - 1) * 100:+.1f}%, p99 x{worst['p99_ratio']:.2f} "
          f"({worst['model']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
