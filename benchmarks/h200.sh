#!/usr/bin/env bash
# One driver for the runs on ONE H200 (the device tool), by what they measure:
#
#   bash benchmarks/h200.sh decode      # benchmarks.vae_decode: precision, seconds, W = 4 model, mux (~3 min)
#   bash benchmarks/h200.sh job         # benchmarks.serve_h3_gpu: 8 of 50 blocks x 3 steps (~3 min)
#   bash benchmarks/h200.sh job-full    # the full-size job (50 blocks, 2 steps) beside diffusers' t2va (~6 min)
#   bash benchmarks/h200.sh decode job  # several, in order
#
# From the repo root, with the wheels the image lacks in ${WHEELS:-.whl} (diffusers 0.42.1, av,
# starlette, uvicorn). Results go to $OUT (the device tool) or benchmarks/results/, with a log.
set -u -o pipefail
cd "$(dirname "$0")/.."
. benchmarks/h200_env.sh
RES=${OUT:-benchmarks/results}
mkdir -p "$RES"
LOG="$RES/h200.log"
h200_setup "${WHEELS:-.whl}" >>"$LOG" 2>&1  # not in a pipe: it exports PYTHONPATH
tail -3 "$LOG"
run() {  # run CAP_S NAME CMD...: one step, capped, logged; a failed step does not stop the rest
    local cap=$1 name=$2; shift 2
    echo "[h200 $(date -u +%T)] $name: $*" | tee -a "$LOG"
    timeout "$cap" "$@" --out "$RES" 2>&1 | grep -v "torchao\|Enum subclass\|it/s]" | tee -a "$LOG"
    echo "[h200 $(date -u +%T)] $name exited ${PIPESTATUS[0]}" | tee -a "$LOG"
}
for what in "$@"; do
    case $what in
        decode) run 280 decode python3 -m benchmarks.vae_decode --budget-s 250 ;;
        job) run 280 job python3 -m benchmarks.serve_h3_gpu --layers 8 --steps 3 --jobs 1 \
                 --diffusers off --theme serve-h3-job-8x3 --budget-s 250 ;;
        job-full) run 560 job-full python3 -m benchmarks.serve_h3_gpu --layers 50 --steps 2 \
                      --jobs 1 --diffusers on --theme serve-h3-job-full --budget-s 520 ;;
        *) echo "unknown run '$what' (decode, job, job-full)" >&2; exit 2 ;;
    esac
done
