#!/usr/bin/env bash
# One verl GRPO island (`python -m verl.trainer.main_ppo`, vLLM or SGLang rollout) that is a yeto learner.
# Usage: SYNCER=HOST:7070 LEARNER_ID=0 MODEL=/models/Qwen2.5-0.5B-Instruct DATA=/data/island0 \
#            bash examples/verl/island_gpu.sh            (then LEARNER_ID=1 with its own DATA elsewhere)
# DATA holds train.parquet and val.parquet in verl's RL format (prompt, data_source, reward_model.ground_truth).
# Nothing here patches verl: installing yeto registers its `verl.plugins` entry point, and the
# YETO_DILOCO_* variables make the actor's training worker yeto's. Not run here (it needs GPUs).
set -euo pipefail
: "${SYNCER:?set SYNCER=HOST:PORT of the syncer}"
: "${MODEL:?set MODEL to a local model directory}"
: "${DATA:?set DATA to this island's directory with train.parquet and val.parquet}"
LEARNER_ID=${LEARNER_ID:-0}
ITERATIONS=${ITERATIONS:-100}

export YETO_DILOCO_SYNCER=$SYNCER
export YETO_DILOCO_KEY_FILE=${KEY_FILE:-yeto.key}
export YETO_DILOCO_LEARNER_ID=$LEARNER_ID
export YETO_DILOCO_RL_MODE=${RL_MODE:-sweep}       # stream | sweep | overlap
export VERL_USE_EXTERNAL_PLUGINS=auto

python -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files="$DATA/train.parquet" data.val_files="$DATA/val.parquet" \
    data.train_batch_size="${BATCH:-64}" data.max_prompt_length=256 data.max_response_length=256 \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.actor.strategy=fsdp2 \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size="${BATCH:-64}" \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.rollout.name="${ROLLOUT:-vllm}" \
    actor_rollout_ref.rollout.n=4 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.gpu_memory_utilization="${GPU_MEMORY:-0.5}" \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
    trainer.n_gpus_per_node="${GPUS:-1}" trainer.nnodes=1 \
    trainer.total_training_steps="$ITERATIONS" \
    trainer.logger='["console"]' trainer.save_freq=-1 \
    trainer.project_name=yeto trainer.experiment_name="island-$LEARNER_ID" "$@"
