#!/usr/bin/env bash
# Two RL islands of verl's real actor on this machine's CPUs, linked by a local syncer.
# Usage, from the checkout after `bash scripts/setup.sh` (which builds .venv-verl):
#     RL_MODE=sweep ITERATIONS=3 bash examples/verl/cpu_islands.sh        # or RL_MODE=overlap / stream
# (KEEP=1 keeps the work directory with the logs, the syncer's tape and the checkpoints.)
#
# verl's PPO driver (`python -m verl.trainer.main_ppo`) needs GPUs for its rollout; this runs what the
# CPU tests run instead: per island, verl's own ActorRolloutRefWorker (FSDP2 on gloo ranks, PPO
# updates, verl's weight sync) under torchrun, fed synthetic PPO batches, with a small CPU rollout
# registered in verl's rollout registry that records what verl sends it. Island 0 has 2 ranks,
# island 1 one. yeto attaches through its `verl.plugins` entry point, on YETO_DILOCO_* alone.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PYTHON:-$ROOT/.venv-verl/bin/python}
HARNESS=$ROOT/tests/rl/verl
MODE=${RL_MODE:-sweep}
ITERATIONS=${ITERATIONS:-3}
FRAGMENTS=2
WORK=$(mktemp -d "${TMPDIR:-/tmp}/yeto-verl.XXXXXX")
PIDS=()
cleanup() { for pid in "${PIDS[@]}"; do kill -- "-$pid" 2>/dev/null || true; done; }   # by process group
trap cleanup EXIT
[ -x "$PY" ] || { echo "no $PY: run 'bash scripts/setup.sh' first (it builds .venv-verl)" >&2; exit 2; }

echo "workdir $WORK (mode $MODE, $ITERATIONS iterations)"
PYTHONPATH=$HARNESS "$PY" -c "import sys, tiny_model; tiny_model.write_tiny_qwen2(sys.argv[1])" "$WORK/model"
head -c 32 /dev/urandom | base64 > "$WORK/yeto.key"

SWEEP_FLAGS=(--sync-interval-steps 0)
[ "$MODE" = stream ] && SWEEP_FLAGS=(--sync-interval-steps 4)
setsid "$PY" -m syncer --host 127.0.0.1 --port 0 --learners 2 --quorum 2 --fragments $FRAGMENTS \
    --pipeline $FRAGMENTS "${SWEEP_FLAGS[@]}" --total-rounds $((ITERATIONS * FRAGMENTS)) --device cpu \
    --key-file "$WORK/yeto.key" --checkpoint "$WORK/syncer.safetensors" --tape "$WORK/tape.jsonl" \
    > "$WORK/syncer.log" 2>&1 &
PIDS+=($!)
SYNCER_PID=$!
for _ in $(seq 600); do
    ADDRESS=$(sed -n 's/^yeto syncer listening on \(.*\)$/\1/p' "$WORK/syncer.log")
    [ -n "$ADDRESS" ] && break
    sleep 0.1
done
[ -n "${ADDRESS:-}" ] || { cat "$WORK/syncer.log"; exit 1; }
echo "syncer on $ADDRESS"

ISLANDS=()
for LEARNER in 0 1; do
    RANKS=$((2 - LEARNER))
    env VERL_PLATFORM=cpu VERL_ENGINE_DEVICE=cuda VERL_USE_EXTERNAL_PLUGINS=auto OMP_NUM_THREADS=1 \
        GLOO_SOCKET_IFNAME=lo MASTER_ADDR=127.0.0.1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
        YETO_DILOCO_SYNCER="$ADDRESS" YETO_DILOCO_KEY_FILE="$WORK/yeto.key" YETO_DILOCO_LEARNER_ID=$LEARNER \
        YETO_DILOCO_RL_MODE="$MODE" YETO_DILOCO_SYNC_INTERVAL=4 YETO_DILOCO_CONSENSUS_EVERY=0 \
        setsid "$PY" -m torch.distributed.run --standalone --nproc_per_node=$RANKS "$HARNESS/island_worker.py" \
        --model "$WORK/model" --iterations "$ITERATIONS" --out "$WORK/island$LEARNER" --seed $LEARNER \
        > "$WORK/island$LEARNER.log" 2>&1 &
    PIDS+=($!)
    ISLANDS+=($!)
done
tail -n +1 -f "$WORK/syncer.log" --pid "$SYNCER_PID" | grep --line-buffered -E "committed|final|finished" &
for i in 0 1; do
    wait "${ISLANDS[$i]}" || { echo "island $i failed:"; tail -40 "$WORK/island$i.log"; exit 1; }
done
wait "$SYNCER_PID" || { echo "the syncer failed:"; tail -40 "$WORK/syncer.log"; exit 1; }

"$PY" - "$WORK" <<'PY'
import json, sys
from pathlib import Path
import torch
from safetensors.torch import load_file
work = Path(sys.argv[1])
final = {k.removeprefix("param/"): v for k, v in load_file(str(work / "syncer.safetensors")).items()
         if k.startswith("param/")}
for island in (0, 1):
    rollout = load_file(str(work / f"island{island}" / "rollout_weights.safetensors"))
    same = rollout.keys() == final.keys() and all(torch.equal(rollout[k], final[k]) for k in final)
    report = json.loads((work / f"island{island}" / "rank0.json").read_text())
    print(f"island {island}: {report['pushes']} pushes, {report['installs']} installs, final cut "
          f"{'installed' if report['final_installed'] else 'MISSING'}; its rollout holds the syncer's final "
          f"weights bit for bit: {same}")
    if not same or not report["final_installed"]:
        sys.exit(1)
PY
[ -n "${KEEP:-}" ] || rm -rf "$WORK"   # KEEP=1 keeps the logs, the tape and the checkpoints
