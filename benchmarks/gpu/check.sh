#!/usr/bin/env bash
# The GPU check of the merges and the codecs, one short script (under 5 minutes on one GPU):
#
#     bash benchmarks/gpu/check.sh            # from the repository root, in the env with yeto installed
#
# 1. the unit tests that need CUDA (codecs and HeLoCo on cuda, next to the CPU), and the iso tests;
# 2. benchmarks/gpu/merge_check.py: each codec from and into cuda tensors (the same bytes and values
#    as the CPU, and the time ratio); average, RDA and iso merged on cuda against the same merge on
#    the CPU (within the stated bounds, and the time ratio); iso in a pool of one worker per visible
#    GPU, bit-identical to one GPU worker and within the bound of the CPU;
# 3. the main job with the syncer on cuda (YETO_SYNCER_DEVICE=cuda) and two CPU learners, 48 steps
#    each: both learners end bit-identical with the syncer's final checkpoint;
# 4. the same with --merge iso and its SVDs in worker processes on the GPUs.
# Output under $WORK (a temporary directory unless set); exit 0 only if every step passed.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PYTHON:-python}
WORK=${WORK:-$(mktemp -d "${TMPDIR:-/tmp}/yeto-gpu-check.XXXXXX")}
cd "$ROOT"
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 2)" \
    || { echo "no CUDA device visible to $PY: this check needs one" >&2; exit 2; }
GPUS=$("$PY" -c "import torch; print(','.join(f'cuda:{i}' for i in range(torch.cuda.device_count())))")
echo "workdir $WORK; GPUs: $GPUS"
nvidia-smi -L || true

echo "== 1. unit tests on cuda"
"$PY" -m pytest -q -p no:cacheprovider tests/unit/test_codecs.py tests/unit/test_correction.py \
    tests/unit/test_iso_merge.py tests/unit/test_iso_pool.py tests/unit/test_merge.py 2>&1 | tail -5

echo "== 2. codecs and merges on cuda against the CPU"
"$PY" benchmarks/gpu/merge_check.py --mib "${MIB:-64}" --learners 4 --repeat 3 | tee "$WORK/merge_check.txt"

echo "== 3. the main job with the syncer on cuda"
YETO_SYNCER_DEVICE=cuda "$PY" examples/main_job.py --max-steps 48 --no-baseline --run-dir "$WORK/main-job" \
    | tail -8 | tee "$WORK/main_job.txt"
grep -q "merge on cuda" "$WORK/main-job/syncer.log" || { echo "the syncer did not merge on cuda" >&2; exit 1; }

echo "== 4. the main job, --merge iso with one SVD worker per GPU"
YETO_SYNCER_DEVICE=cuda YETO_SYNCER_ISO_WORKER_DEVICES="$GPUS" "$PY" examples/main_job.py --max-steps 48 \
    --no-baseline --merge iso --run-dir "$WORK/main-job-iso" | tail -8 | tee "$WORK/main_job_iso.txt"
grep -q "iso workers ready" "$WORK/main-job-iso/syncer.log" || { echo "no iso workers started" >&2; exit 1; }
echo "gpu check: ok ($WORK)"
