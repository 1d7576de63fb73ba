#!/usr/bin/env bash
# Backend names as of 2026-12-03: 'sage8' was the Gluon loop, 'sage8_triton' the Triton loop; since
# 2026-12-04 'sage8' is the Triton loop and the Gluon loop is 'sage8_gluon' (sage8_triton matches nothing).
# The sage8 v3 checks on ONE H200, in two back-to-back device calls (the machine keeps ignored
# build outputs while it stays warm):
#
#   bash benchmarks/h200_kernels_v3.sh part1   # starts the SageAttention 2 build (setsid, ~4 min),
#                                              # GPU kernel tests, accuracy tables (~6 min)
#   bash benchmarks/h200_kernels_v3.sh part2   # waits for the build, SageAttention 2 rows, speed (~4 min)
#
# Needs: .whl/ (sageattention 1.0.6, fa3-fwd 0.0.3, diffusers 0.42.1, importlib_metadata) and
# .third_party/SageAttention-2.2.0-src.tar.gz, both carried (see ../shared/third_party/README.md).
# SageAttention 2 is built into .sa2build/ (git-ignored, never carried, so a second call finds it).
set -u -o pipefail
cd "$(dirname "$0")/.."
. benchmarks/h200_env.sh
OUTD=${OUT:-benchmarks/results}
mkdir -p "$OUTD"
h200_setup .whl
export PYTHONPATH=$PYTHONPATH:$SA2:$PWD/.sa2build/meta

if [ "${1:-part1}" = final ]; then
  # the shipped v3: every GPU test of the kernels and the core, then the loop orderings timed
  timeout 330 python3 -m pytest tests/core/test_gpu_core.py tests/core/test_gpu_fa3.py tests/core/test_kernel_sage8.py \
      tests/core/test_kernel_accuracy.py -rs -q -s -p no:cacheprovider 2>&1 | tee "$OUTD/gpu-tests_h200_v3.log" \
      | grep -E "\[accuracy\]|FAIL|Error|passed|failed" | tail -40
  timeout 150 python3 -m benchmarks.kernels --out "$OUTD" --theme kernels-v3 --heads 14,56,7 --no-error --iters 20 \
      --warmup 3 --budget-s 130 --kernels 'sdpa_cudnn,fa3_fp8_prequant,dense:sage8,dense:sage8_triton,variant:*' \
      2>&1 | tail -30
elif [ "${1:-part1}" = part1 ]; then
  # its own session, so the build outlives this call; its log is read by part2
  sa2_ready || [ -d .sa2build ] || sa2_start setsid
  timeout 270 python3 -m pytest tests/core/test_kernel_sage8.py tests/core/test_kernel_accuracy.py -rs -q -s \
      -p no:cacheprovider 2>&1 | tee "$OUTD/gpu_tests_kernels.log" | grep -E "\[accuracy\]|PASS|FAIL|Error|passed|failed" | tail -60
  timeout 200 python3 -m benchmarks.accuracy --out "$OUTD" --budget-s 180 --kernels \
      sdpa,fa3,sage,sage8,sage8_triton,sage8:v2-running,sage8_triton:v2-running \
      2>&1 | tail -80
else
  # part2: self-contained (a machine released between the calls loses the build)
  sa2_ready || sa2_start
  for i in $(seq 1 60); do sa2_ready && break; sleep 5; done
  sa2_path  # 2.x before the 1.0.6 wheel
  sa2_ready && echo "SageAttention 2 built" || { echo "SageAttention 2 NOT built:"; tail -20 .sa2build/build.log; }
  timeout 150 python3 -m benchmarks.accuracy --out "$OUTD" --theme accuracy-sage2 --drift-layers 0 --budget-s 130 \
      --kernels sdpa,sage2_direct,sage8,sage8_triton 2>&1 | tail -100
  timeout 200 python3 -m benchmarks.kernels --out "$OUTD" --heads 14,56,7 --no-error --iters 20 --warmup 3 \
      --budget-s 180 --kernels 'sdpa_cudnn,sage2_direct,fa3_fp8_prequant,dense:sage8,dense:sage8_triton,variant:*' \
      2>&1 | tail -40
fi
