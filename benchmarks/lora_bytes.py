"""Bytes on the wire per push: LoRA vs full fine-tuning, measured on real runs.

    python -m benchmarks.lora_bytes [--rounds 16] [--lora-r 4] [--hidden 128] [--layers 4]

Two runs of the same two HF learners (`examples/hf_tiny_llama.py`, the main job's model) against
the real syncer: full fine-tuning, then LoRA (rank r on q_proj/v_proj). Each learner reports the
payload bytes it pushed and how many pushes; the last line is
`ratio lora/full bytes per push = X`, after the ratio of synced parameters (the syncer's checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "hf_tiny_llama.py"
LISTENING = re.compile(r"^yeto syncer listening on (\S+):(\d+)\s*$", re.M)


def run(tmp: Path, tag: str, args: argparse.Namespace, lora_r: int) -> dict[str, float]:
    key = tmp / "key"
    key.write_text(secrets.token_hex(32))
    key.chmod(0o600)  # a key file others may read is warned about
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("YETO_")}
    ckpt = tmp / f"{tag}.safetensors"
    syncer = subprocess.Popen([sys.executable, "-m", "syncer", "--host", "127.0.0.1", "--port", "0", "--learners", "2",
                               "--quorum", "2", "--fragments", "4", "--total-rounds", str(args.rounds),
                               "--sync-interval-steps", "8", "--checkpoint", str(ckpt), "--key-file", str(key)],
                              cwd=ROOT, env=base_env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    learners: list[subprocess.Popen[str]] = []
    try:
        assert syncer.stdout is not None
        m = LISTENING.match(syncer.stdout.readline())
        if m is None:
            raise RuntimeError("the syncer did not start")
        model = ["--hidden", str(args.hidden), "--layers", str(args.layers), "--seq-len", "64", "--batch-size", "8"]
        for i in range(2):
            env = {**base_env, "YETO_DILOCO_SYNCER": f"{m.group(1)}:{m.group(2)}", "YETO_DILOCO_KEY_FILE": str(key),
                   "YETO_DILOCO_LEARNER_ID": str(i), "YETO_DILOCO_SYNC_INTERVAL": "8", "OMP_NUM_THREADS": "1"}
            learners.append(subprocess.Popen(
                [sys.executable, str(EXAMPLE), "--output-dir", str(tmp / f"{tag}-{i}"), "--max-steps", "5000",
                 "--lora-r", str(lora_r), *model], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, text=True))
        finals = []
        for p in learners:
            out, _ = p.communicate(timeout=args.timeout)
            for line in out.splitlines():
                try:
                    event = json.loads(line)
                except ValueError:
                    continue  # the Trainer's own prints
                if isinstance(event, dict) and event.get("event") == "eval" and event.get("phase") == "final":
                    finals.append(event)
        syncer.wait(timeout=60)
    finally:
        for p in [*learners, syncer]:
            if p.poll() is None:
                p.kill()
                p.wait()
    if len(finals) != 2:
        raise RuntimeError(f"{tag}: the learners did not finish")
    pushes = sum(f["pushes"] for f in finals)
    nbytes = sum(f["bytes_pushed"] for f in finals)
    synced = sum(t.numel() for name, t in load_file(str(ckpt)).items() if name.startswith("param/"))
    return {"pushes": pushes, "bytes": nbytes, "per_push": nbytes / max(pushes, 1), "synced": synced}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--lora-r", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args(argv)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="yeto-lora-bytes-") as tmp:
        full = run(Path(tmp), "full", args, 0)
        lora = run(Path(tmp), "lora", args, args.lora_r)
    print(f"{'run':6} {'synced params':>14} {'pushes':>7} {'bytes pushed':>14} {'bytes/push':>12}")
    for tag, r in (("full", full), ("lora", lora)):
        print(f"{tag:6} {r['synced']:14,.0f} {r['pushes']:7.0f} {r['bytes']:14,.0f} {r['per_push']:12,.0f}")
    print(f"ratio lora/full synced params = {lora['synced'] / full['synced']:.4f}")
    print(f"done in {time.time() - t0:.0f} s")
    print(f"ratio lora/full bytes per push = {lora['per_push'] / full['per_push']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
