#!/usr/bin/env bash
# The syncer for two ms-swift Megatron islands. Run it on a host both islands can reach.
# Usage, from the yeto checkout (or with yeto installed): bash examples/swift_megatron/syncer.sh
# TOTAL_ROUNDS=0 (the default) finalizes when the islands finish their --train_iters.
set -euo pipefail
KEY_FILE=${KEY_FILE:-yeto.key}
[ -s "$KEY_FILE" ] || head -c 32 /dev/urandom | base64 > "$KEY_FILE"   # copy this file to every island

python -m syncer --host 0.0.0.0 --port "${PORT:-7070}" \
    --learners 2 --quorum 2 --fragments 8 \
    --sync-interval-steps 24 --total-rounds "${TOTAL_ROUNDS:-0}" \
    --checkpoint yeto-state.safetensors --tape yeto-tape.jsonl --key-file "$KEY_FILE"
