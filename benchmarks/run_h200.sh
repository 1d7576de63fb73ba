#!/usr/bin/env bash
# All dist_attn benchmarks on ONE H200, in one go (<= 7 minutes; every step has a `timeout` and a
# --budget-s a little below it, so a slow step leaves partial results and the next step still runs).
#
#   bash benchmarks/run_h200.sh            # from the repo root; .whl/ holds sageattention-1.0.6 and
#                                          # fa3-fwd (FA3 bf16/FP8 rows of kernels.py)
#
# Steps (wall-time caps): install sageattention (30 s) | kernels.py (130 s) | alltoall.py, 4 gloo
# ranks sharing the GPU (70 s) | scaling.py --modeled N=1,2,4,8 (70 s) | scaling.py measured,
# 4 gloo ranks sharing the GPU, few iterations (90 s). Worst case 390 s (6.5 min); expected ~5 min.
#
# Results: with $OUT set (the device tool), into a work folder, then packed as
# $OUT/benchmarks_results.tgz (unpack into benchmarks/results/) with the four .md tables and the log
# beside it (the tool returns at most 8 files); without $OUT, straight into benchmarks/results/.
set -u -o pipefail
cd "$(dirname "$0")/.."

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}

if [ -n "${OUT:-}" ]; then
    RES=$(mktemp -d /tmp/dist_attn_results.XXXX)
    LOG="$OUT/run_h200.log"
else
    RES=benchmarks/results
    LOG="$RES/run_h200.log"
fi
mkdir -p "$RES"
: >"$LOG"
log() { echo "[run_h200 $(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }
START=$(date +%s)

# sageattention 1.0.6 and fa3-fwd travel as wheels (the H200 machine reaches no package index)
if ls .whl/*.whl >/dev/null 2>&1; then
    timeout 30 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl 2>&1 | tee -a "$LOG" || log "WARNING: wheel install failed (sage rows will say why)"
else
    log "WARNING: no .whl/*.whl here: sageattention is not installed (sage rows will say why)"
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee -a "$LOG" || true
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" 2>&1 | tee -a "$LOG"

step() {  # step NAME SECONDS CMD... : run with a hard cap, log the exit status, never abort the script
    local name=$1 cap=$2; shift 2
    log "START $name (cap ${cap}s): $*"
    local t0=$(date +%s)
    timeout --kill-after=10 "$cap" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    log "END $name rc=$rc in $(( $(date +%s) - t0 ))s"
}

TR="$PY -m torch.distributed.run --standalone --nproc-per-node 4"

step kernels 130 "$PY" -m benchmarks.kernels --out "$RES" --budget-s 110 --iters 20 --warmup 3
step alltoall 70 $TR -m benchmarks.alltoall --backend gloo --out "$RES" --budget-s 50 \
    --iters 20 --warmup 1 --comm-iters 3
step scaling-modeled 70 "$PY" -m benchmarks.scaling --modeled --bandwidth-gbs 360 --ranks 1,2,4,8 \
    --overlap 1,2,4 --out "$RES" --budget-s 55 --iters 10 --warmup 2
step scaling-gloo4 90 $TR -m benchmarks.scaling --comm-backend gloo --ranks 1,2,4 --overlap 1,2,4 \
    --backends auto,sdpa --out "$RES" --budget-s 65 --iters 2 --warmup 1

if [ -n "${OUT:-}" ]; then
    tar -czf "$OUT/benchmarks_results.tgz" -C "$RES" . && cp "$RES"/*.md "$OUT"/ 2>/dev/null
    log "packed $(ls "$RES" | wc -l) files into \$OUT/benchmarks_results.tgz (tar -xzf it into benchmarks/results/)"
fi
log "done in $(( $(date +%s) - START ))s; results in $RES"
