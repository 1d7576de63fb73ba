#!/usr/bin/env bash
# One driver for the runs on ONE H200 (the device tool), by what they measure:
#
#   bash benchmarks/h200.sh decode      # benchmarks.vae_decode: precision, seconds, W = 4 model, mux (~3 min)
#   bash benchmarks/h200.sh job         # benchmarks.serve_h3_gpu: 8 of 50 blocks x 3 steps (~3 min)
#   bash benchmarks/h200.sh job-full    # the full-size job (50 blocks, 2 steps) beside diffusers' t2va (~6 min)
#   bash benchmarks/h200.sh job-full-compiled  # the full-size job compiled, bf16 linears (~2 min)
#   bash benchmarks/h200.sh job-full-fp8       # the full-size job compiled, FP8 linears (~2 min)
#   bash benchmarks/h200.sh decode-mux  # only its MP4 rows, streamed at the W = 4 decode's pace (~20 s)
#   bash benchmarks/h200.sh fp8-tests   # tests/integrations/test_fp8_gpu.py (cap 90 s)
#   bash benchmarks/h200.sh fp8         # benchmarks.h3_fp8: FP8 vs bf16 linears, the real block (cap 285 s)
#   bash benchmarks/h200.sh decode job  # several, in order
#
# From the repo root, with the wheels the image lacks in ${WHEELS:-.whl} (diffusers 0.42.1, av,
# starlette, uvicorn; torchao 0.18.0 for fp8). Results go to $OUT (the device tool) or
# benchmarks/results/, with a log.
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
                      --jobs 1 --diffusers on --compile off --theme serve-h3-job-full \
                      --budget-s 520 ;;
        job-full-compiled) run 280 job-full-compiled python3 -m benchmarks.serve_h3_gpu \
                      --layers 50 --steps 2 --jobs 1 --diffusers off --compile on \
                      --theme serve-h3-job-full-compiled --budget-s 250 ;;
        job-full-fp8) run 280 job-full-fp8 python3 -m benchmarks.serve_h3_gpu --layers 50 \
                      --steps 2 --jobs 1 --diffusers off --compile on --linear-precision fp8 \
                      --theme serve-h3-job-full-fp8 --budget-s 250 ;;
        decode-mux) run 120 decode-mux python3 -m benchmarks.vae_decode --skip precision time \
                        --mux-pace-s "${MUX_PACE_S:-0.218}" --theme vae-decode-mux ;;
        fp8-tests) echo "[h200 $(date -u +%T)] fp8-tests" | tee -a "$LOG"
                   timeout 90 python3 -m pytest tests/integrations/test_fp8_gpu.py -rs -q -s \
                       -p no:cacheprovider 2>&1 | grep -v "Failed to load" \
                       | tee "$RES/fp8-gpu-tests_h200_$(date -u +%F).log" | tail -25 ;;
        fp8) run 285 fp8 python3 -m benchmarks.h3_fp8 --budget-s "${BUDGET:-265}" ;;
        *) echo "unknown run '$what' (see the header of $0)" >&2
           exit 2 ;;
    esac
done
