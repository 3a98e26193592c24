#!/usr/bin/env bash
# One ms-swift Megatron island (`megatron sft`) that is a yeto learner.
# Usage: SYNCER=HOST:7070 LEARNER_ID=0 bash examples/swift_megatron/island.sh    (then LEARNER_ID=1 elsewhere)
# Replace MODEL and DATASET (one shard per island) with your own; the flags after them are ordinary
# megatron sft flags, nothing yeto needs.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PLUGIN=$(cd "$HERE/../.." && pwd)/yeto_plugins/swift_megatron/plugin/swift_plugin.py
: "${SYNCER:?set SYNCER=HOST:PORT of the syncer}"
LEARNER_ID=${LEARNER_ID:-0}
MODEL=${MODEL:-Qwen/Qwen2.5-7B-Instruct}                        # placeholder: your model
DATASET=${DATASET:-"your/dataset-shard-$LEARNER_ID"}            # placeholder: this island's data

# swift refuses flags it does not know, so yeto is configured through the environment only.
export YETO_DILOCO_SYNCER=$SYNCER
export YETO_DILOCO_KEY_FILE=${KEY_FILE:-yeto.key}
export YETO_DILOCO_LEARNER_ID=$LEARNER_ID
# H comes from the syncer (its --sync-interval-steps) at the handshake; SYNC_INTERVAL, when set, is checked against it.
if [ -n "${SYNC_INTERVAL:-}" ]; then export YETO_DILOCO_SYNC_INTERVAL=$SYNC_INTERVAL; fi

NPROC_PER_NODE=${NPROC_PER_NODE:-8} \
megatron sft \
    --external_plugins "$PLUGIN" \
    --callbacks yeto_diloco \
    --model "$MODEL" \
    --dataset "$DATASET" \
    --tensor_model_parallel_size 2 \
    --micro_batch_size 1 \
    --global_batch_size 16 \
    --packing true \
    --max_length 4096 \
    --train_iters 10000 \
    --lr 1e-5 \
    --min_lr 1e-6 \
    --lr_warmup_fraction 0.05 \
    --finetune true \
    --save_steps 500 \
    --save_safetensors true \
    --output_dir "megatron_output/island-$LEARNER_ID"
