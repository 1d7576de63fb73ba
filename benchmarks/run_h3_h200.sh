#!/usr/bin/env bash
# The real H3 on ONE H200, in one go, <= 4.5 minutes (each step capped by
# `timeout`, with a --budget-s below the cap so a slow step leaves partial results):
#
#   bash benchmarks/run_h3_h200.sh      # from the repo root; .whl/ holds the wheels the H200
#                                       # image lacks: diffusers 0.42.1 (and, for their rows,
#                                       # fa3-fwd, sageattention)
#
# Steps (caps): h3_model.py (225 s: one block and 4 blocks + refiner at h3-ref, W = 1, every
# attention path eager, four compiled; refiner alone; enable_ulysses overhead; served step at 8
# layers x 3 steps) | scaling.py --modeled for the real block, N = 1 and 4 (45 s). Expected ~4 min.
# Results: with $OUT set (the device tool) into $OUT, else benchmarks/results/.
set -u -o pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
RES=${OUT:-benchmarks/results}
mkdir -p "$RES"
LOG="$RES/run_h3_h200.log"
: >"$LOG"
log() { echo "[run_h3_h200 $(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }
START=$(date +%s)
if ls .whl/*.whl >/dev/null 2>&1; then
    timeout 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl 2>&1 | tee -a "$LOG" || log "WARNING: wheel install failed"
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee -a "$LOG" || true
"$PY" -c "import torch, triton, diffusers; print('torch', torch.__version__, 'triton', triton.__version__, 'diffusers', diffusers.__version__)" 2>&1 | tee -a "$LOG"

step() {  # step NAME SECONDS CMD...: a hard cap, the exit status logged, never abort the script
    local name=$1 cap=$2; shift 2
    log "START $name (cap ${cap}s): $*"
    local t0=$(date +%s)
    timeout --kill-after=10 "$cap" "$@" 2>&1 | tee -a "$LOG"
    log "END $name rc=${PIPESTATUS[0]} in $(( $(date +%s) - t0 ))s"
}

step h3-model 225 "$PY" -m benchmarks.h3_model --out "$RES" --budget-s 190
step scaling-modeled 45 "$PY" -m benchmarks.scaling --modeled --bandwidth-gbs 360 --ranks 1,4 \
    --overlap 1,4 --backends sdpa,sage8 --out "$RES" --budget-s 35 --iters 5 --warmup 1
log "done in $(( $(date +%s) - START ))s; results in $RES"
