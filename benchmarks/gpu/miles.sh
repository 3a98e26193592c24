#!/usr/bin/env bash
# GPU check: two Miles islands (colocated SGLang engine, Megatron actor) and a local syncer, 3 rollouts,
# once streaming through yeto's hook (`python train.py`) and once sweeping through yeto's driver
# (`python -m yeto_plugins.miles.train`).
#
#     MILES=/path/to/miles HF=/models/Qwen2.5-0.5B-Instruct REF=/models/Qwen2.5-0.5B-Instruct_torch_dist \
#     DATA=/data/gsm8k/train.parquet bash benchmarks/gpu/miles.sh
#
# Needs: NVIDIA GPUs (ISLAND_GPUS each island, default 1), Miles' environment with yeto installed, the
# model's HF and torch_dist checkpoints and a prompt parquet on local disk (nothing is downloaded).
# Checks, per mode: both islands exit 0 and log the final cut installed; Miles' own
# --check-weight-update-equal holds (every engine weight equals what the actor sent, and the engine's
# weight version moved with each update); the syncer commits its rounds and exits 0; and both islands'
# last saved HF checkpoints (Miles' --save-hf, taken after the last rollout's training, when the final
# cut is in) are equal tensor by tensor, i.e. both serve the syncer's one final policy.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
: "${MILES:?set MILES to a Miles checkout}" "${HF:?}" "${REF:?}" "${DATA:?}"
ROLLOUTS=${ROLLOUTS:-3}
FRAGMENTS=${FRAGMENTS:-2}
GPUS=${ISLAND_GPUS:-1}
WORK=${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/yeto-miles-gpu.XXXXXX")}
command -v nvidia-smi >/dev/null || { echo "no nvidia-smi: this check needs NVIDIA GPUs" >&2; exit 2; }
python -c "import miles, yeto_plugins.miles" || { echo "install yeto into Miles' environment" >&2; exit 2; }
[ "$(nvidia-smi -L | wc -l)" -ge $((2 * GPUS)) ] || { echo "need $((2 * GPUS)) GPUs (ISLAND_GPUS=$GPUS per island)" >&2; exit 2; }
PIDS=()
cleanup() { for pid in "${PIDS[@]}"; do kill -- "-$pid" 2>/dev/null || true; done; for i in 0 1; do ray stop --address "127.0.0.1:$((6390 + i))" >/dev/null 2>&1 || true; done; }
trap cleanup EXIT
head -c 32 /dev/urandom | base64 > "$WORK/yeto.key"

run_mode() {  # $1: stream | sweep
    local mode=$1 dir=$WORK/$1 pacing
    mkdir -p "$dir"
    if [ "$mode" = stream ]; then pacing=(--sync-interval-steps 4); else pacing=(--sync-interval-steps 0); fi
    setsid python -m syncer --host 127.0.0.1 --port 0 --learners 2 --quorum 2 --fragments "$FRAGMENTS" \
        --pipeline "$FRAGMENTS" "${pacing[@]}" --total-rounds $((ROLLOUTS * FRAGMENTS)) --key-file "$WORK/yeto.key" \
        --checkpoint "$dir/syncer.safetensors" --tape "$dir/tape.jsonl" > "$dir/syncer.log" 2>&1 &
    local syncer=$! address=""
    PIDS+=("$syncer")
    for _ in $(seq 600); do
        address=$(sed -n 's/^yeto syncer listening on \(.*\)$/\1/p' "$dir/syncer.log"); [ -n "$address" ] && break; sleep 0.1
    done
    [ -n "$address" ] || { cat "$dir/syncer.log"; exit 1; }
    local islands=()
    for i in 0 1; do
        local devices
        devices=$(seq -s, $((i * GPUS)) $((i * GPUS + GPUS - 1)))
        CUDA_VISIBLE_DEVICES=$devices ray start --head --port $((6390 + i)) --dashboard-port $((8270 + i)) \
            --num-gpus "$GPUS" --disable-usage-stats --temp-dir "$dir/ray$i" > "$dir/ray$i.log" 2>&1
        (cd "$MILES" && CUDA_VISIBLE_DEVICES=$devices RAY_ADDRESS=127.0.0.1:$((6390 + i)) SYNCER=$address \
            KEY_FILE=$WORK/yeto.key LEARNER_ID=$i RL_MODE=$mode HF=$HF REF=$REF DATA=$DATA ROLLOUTS=$ROLLOUTS GPUS=$GPUS \
            setsid bash "$ROOT/examples/miles/island.sh" --check-weight-update-equal \
            --save "$dir/ckpt$i" --save-interval 1 --save-hf "$dir/hf$i/{}" --rollout-batch-size 8 \
            --global-batch-size 64) > "$dir/island$i.log" 2>&1 &
        PIDS+=($!)
        islands+=($!)
    done
    for i in 0 1; do
        wait "${islands[$i]}" || { echo "$mode island $i failed:"; tail -60 "$dir/island$i.log"; exit 1; }
        grep -q "final cut installed" "$dir/island$i.log" || { echo "$mode island $i has no final cut"; exit 1; }
        ray stop --address "127.0.0.1:$((6390 + i))" >/dev/null 2>&1 || true
    done
    wait "$syncer" || { echo "$mode: the syncer failed:"; tail -40 "$dir/syncer.log"; exit 1; }
    python - "$dir" "$((ROLLOUTS - 1))" <<'PY'
import json, sys
from pathlib import Path
import torch
from safetensors.torch import load_file
work, last = Path(sys.argv[1]), sys.argv[2]
commits = [r for r in map(json.loads, open(work / "tape.jsonl")) if r["event"] == "commit"]
assert commits, "no round committed"
def saved(i):
    out = {}
    for f in sorted((work / f"hf{i}" / last).glob("*.safetensors")):
        out.update(load_file(str(f)))
    assert out, f"island {i} saved no HF checkpoint for rollout {last}"
    return out
a, b = saved(0), saved(1)
assert a.keys() == b.keys(), "the islands saved different tensors"
differ = [k for k in a if not torch.equal(a[k], b[k])]
assert not differ, f"the islands' final weights differ in {differ[:5]}"
print(f"{work.name}: {len(commits)} rounds; both islands saved the same final weights ({len(a)} tensors)")
PY
}
run_mode stream
run_mode sweep
echo "Miles GPU check passed ($ROLLOUTS rollouts, both modes)"
