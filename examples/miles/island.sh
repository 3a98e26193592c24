#!/usr/bin/env bash
# One Miles RL island (GRPO on SGLang rollouts, Megatron actor) that is a yeto learner.
# Usage, from a Miles checkout with yeto installed in its environment (pip install <yeto checkout>):
#   SYNCER=10.0.0.5:7070 LEARNER_ID=0 RL_MODE=sweep HF=/models/Qwen2.5-0.5B-Instruct \
#   REF=/models/Qwen2.5-0.5B-Instruct_torch_dist DATA=/data/island0.parquet bash <yeto>/examples/miles/island.sh
# RL_MODE=stream: Miles' own `python train.py` with yeto's before-train-step hook (a boundary every H/P steps).
# RL_MODE=sweep|overlap: Miles' driver through `python -m yeto_plugins.miles.train` (a sweep after each
# rollout's training). Every other flag is an ordinary Miles flag (see Miles' own example scripts).
# Not run here: it needs GPUs, SGLang and Miles.
set -euo pipefail
: "${SYNCER:?set SYNCER=HOST:PORT of the syncer}"
: "${HF:?set HF to the model's HF checkpoint directory}"
: "${REF:?set REF to its torch_dist (Megatron) checkpoint directory}"
: "${DATA:?set DATA to this island's prompt parquet}"
MODE=${RL_MODE:-sweep}
export YETO_DILOCO_SYNCER=$SYNCER
export YETO_DILOCO_KEY_FILE=${KEY_FILE:-yeto.key}
export YETO_DILOCO_LEARNER_ID=${LEARNER_ID:-0}
export YETO_DILOCO_RL_MODE=$MODE
export PYTHONUNBUFFERED=1
# Miles' training actors are Ray actors: on a Ray cluster started before this run they do not inherit
# this shell's environment, so the settings go to them through Miles' --train-env-vars as well (a
# --train-env-vars of your own in "$@" replaces this one: put the YETO_DILOCO_* variables in it too).
TRAIN_ENV=$(python -c 'import json, os; print(json.dumps({k: v for k, v in os.environ.items() if k.startswith("YETO_DILOCO_")}))')

if [ "$MODE" = stream ]; then DRIVER=(python train.py); else DRIVER=(python -m yeto_plugins.miles.train); fi
MODEL_ARGS_LINE=$(python miles/utils/external_utils/model_args_utils.py "${MODEL_NAME:-qwen2.5-0.5B}")
read -ra MODEL_ARGS <<< "$MODEL_ARGS_LINE"

"${DRIVER[@]}" "${MODEL_ARGS[@]}" \
    --custom-megatron-before-train-step-hook-path yeto_plugins.miles.hook.before_train_step \
    --hf-checkpoint "$HF" --ref-load "$REF" \
    --prompt-data "$DATA" --input-key messages --label-key label --apply-chat-template --rollout-shuffle \
    --rm-type math --num-rollout "${ROLLOUTS:-100}" --rollout-batch-size 32 --n-samples-per-prompt 8 \
    --rollout-max-response-len 1024 --rollout-temperature 1 --global-batch-size 256 \
    --advantage-estimator grpo --eps-clip 0.2 --eps-clip-high 0.28 \
    --optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 \
    --tensor-model-parallel-size 1 --use-dynamic-batch-size --max-tokens-per-gpu 9216 \
    --actor-num-nodes 1 --actor-num-gpus-per-node "${GPUS:-8}" --colocate \
    --rollout-num-gpus-per-engine 1 --sglang-mem-fraction-static 0.7 \
    --attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32 \
    --attention-softmax-in-fp32 --train-env-vars "$TRAIN_ENV" "$@"
