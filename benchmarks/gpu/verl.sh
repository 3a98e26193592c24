#!/usr/bin/env bash
# GPU check: two verl GRPO islands (`python -m verl.trainer.main_ppo`, vLLM rollout, FSDP2 actor) and a local
# syncer, 3 RL iterations in policy-sweep mode, then the proof that the rollouts served the syncer's final cut.
#
#     MODEL=/models/Qwen2.5-0.5B-Instruct bash benchmarks/gpu/verl.sh
#
# Needs: NVIDIA GPUs (one per island; with one GPU both islands share it), a Python with torch, verl 0.9.1,
# vllm and yeto installed (`pip install -e .` in that env), and the model in a local directory (nothing is
# downloaded). Checks: both islands exit 0 and say "final cut installed"; the syncer commits 3 sweeps of P
# rounds in order and exits 0; both islands' greedy validation generations of the last iteration (after the
# final cut reached the rollout through verl's `update_weights`) are identical, and vLLM loaded from the
# syncer's exported final cut generates the same text (benchmarks/gpu/verl_check.py).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PYTHON:-python}
: "${MODEL:?set MODEL to a local model directory, e.g. Qwen2.5-0.5B-Instruct}"
ITERATIONS=${ITERATIONS:-3}
FRAGMENTS=${FRAGMENTS:-2}
MODE=${RL_MODE:-sweep}
WORK=${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/yeto-verl-gpu.XXXXXX")}
command -v nvidia-smi >/dev/null || { echo "no nvidia-smi: this check needs NVIDIA GPUs" >&2; exit 2; }
"$PY" -c "import verl, vllm, yeto_plugins.verl" || { echo "install verl==0.9.1, vllm and yeto in $PY's env" >&2; exit 2; }
GPUS=$(nvidia-smi -L | wc -l)
if [ "$GPUS" -ge 2 ]; then DEVICES=(0 1); MEMORY=0.5; else DEVICES=(0 0); MEMORY=0.25; fi
echo "workdir $WORK; $GPUS GPU(s): islands on ${DEVICES[*]}, rollout memory share $MEMORY"
PIDS=()
cleanup() { for pid in "${PIDS[@]}"; do kill -- "-$pid" 2>/dev/null || true; done; }
trap cleanup EXIT

head -c 32 /dev/urandom | base64 > "$WORK/yeto.key"
for I in 0 1; do "$PY" "$ROOT/benchmarks/gpu/verl_check.py" data "$WORK/data$I" --island $I; done
setsid "$PY" -m syncer --host 127.0.0.1 --port 0 --learners 2 --quorum 2 --fragments "$FRAGMENTS" \
    --pipeline "$FRAGMENTS" --sync-interval-steps 0 --total-rounds $((ITERATIONS * FRAGMENTS)) \
    --key-file "$WORK/yeto.key" --checkpoint "$WORK/syncer.safetensors" --tape "$WORK/tape.jsonl" \
    > "$WORK/syncer.log" 2>&1 &
SYNCER_PID=$!
PIDS+=("$SYNCER_PID")
for _ in $(seq 600); do
    ADDRESS=$(sed -n 's/^yeto syncer listening on \(.*\)$/\1/p' "$WORK/syncer.log")
    [ -n "$ADDRESS" ] && break
    sleep 0.1
done
[ -n "${ADDRESS:-}" ] || { cat "$WORK/syncer.log"; exit 1; }

ISLANDS=()
for I in 0 1; do
    CUDA_VISIBLE_DEVICES=${DEVICES[$I]} SYNCER=$ADDRESS KEY_FILE=$WORK/yeto.key LEARNER_ID=$I MODEL=$MODEL \
    DATA=$WORK/data$I ITERATIONS=$ITERATIONS RL_MODE=$MODE GPU_MEMORY=$MEMORY BATCH=16 GPUS=1 \
    RAY_TMPDIR=$WORK/ray$I setsid bash "$ROOT/examples/verl/island_gpu.sh" \
        reward.custom_reward_function.path="$WORK/data$I/reward.py" \
        reward.custom_reward_function.name=compute_score \
        data.max_response_length=128 \
        trainer.test_freq="$ITERATIONS" trainer.val_before_train=False \
        trainer.validation_data_dir="$WORK/val$I" \
        trainer.default_local_dir="$WORK/ckpt$I" \
        > "$WORK/island$I.log" 2>&1 &
    PIDS+=($!)
    ISLANDS+=($!)
done
for I in 0 1; do
    wait "${ISLANDS[$I]}" || { echo "island $I failed:"; tail -60 "$WORK/island$I.log"; exit 1; }
    grep -q "final cut installed" "$WORK/island$I.log" || { echo "island $I has no final cut"; exit 1; }
done
wait "$SYNCER_PID" || { echo "the syncer failed:"; tail -40 "$WORK/syncer.log"; exit 1; }
grep -E "committed" "$WORK/syncer.log" | cut -c1-160

"$PY" - "$WORK/tape.jsonl" "$ITERATIONS" "$FRAGMENTS" <<'PY'
import json, sys
tape, iterations, fragments = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
commits = [r for r in map(json.loads, open(tape)) if r["event"] == "commit"]
assert [c["round"] for c in commits] == list(range(iterations * fragments)), [c["round"] for c in commits]
assert all(sorted(c["learners"]) == [0, 1] for c in commits), "a round merged one island only"
print(f"tape: {len(commits)} rounds, {iterations} sweeps of {fragments} fragments, both islands in each")
PY
"$PY" -m syncer.tools.export --checkpoint "$WORK/syncer.safetensors" --model "$MODEL" --output-dir "$WORK/final"
"$PY" "$ROOT/benchmarks/gpu/verl_check.py" compare --final "$WORK/final" --max-tokens 128 \
    --dumps "$WORK/val0/$ITERATIONS.jsonl" "$WORK/val1/$ITERATIONS.jsonl"
echo "verl GPU check passed ($MODE, $ITERATIONS iterations)"
