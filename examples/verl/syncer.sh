#!/usr/bin/env bash
# The syncer for verl RL islands. Run it on a host every island can reach.
# Usage, from the yeto checkout (or with yeto installed): FRAGMENTS=4 ITERATIONS=100 bash examples/verl/syncer.sh
# Sweeps need the rounds unpaced (--sync-interval-steps 0) and overlap needs them all in flight
# (--pipeline >= --fragments); a syncer started otherwise refuses a sweeping island at once.
set -euo pipefail
KEY_FILE=${KEY_FILE:-yeto.key}
[ -s "$KEY_FILE" ] || head -c 32 /dev/urandom | base64 > "$KEY_FILE"   # copy this file to every island
FRAGMENTS=${FRAGMENTS:-4}
ITERATIONS=${ITERATIONS:-0}   # RL iterations of the islands; 0: finalize when they finish training

python -m syncer --host "${HOST:-0.0.0.0}" --port "${PORT:-7070}" \
    --learners "${LEARNERS:-2}" --quorum "${QUORUM:-2}" --fragments "$FRAGMENTS" --pipeline "$FRAGMENTS" \
    --sync-interval-steps 0 --total-rounds $((ITERATIONS * FRAGMENTS)) \
    --checkpoint "${STATE:-yeto-state.safetensors}" --tape "${TAPE:-yeto-tape.jsonl}" --key-file "$KEY_FILE"
