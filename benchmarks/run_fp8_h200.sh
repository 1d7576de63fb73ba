#!/usr/bin/env bash
# Issue 25 (FP8 linear layers) on ONE H200, in one device call of <= 5 minutes:
#
#   bash benchmarks/run_fp8_h200.sh            # tests (cap 90 s), then the benchmark (cap 285 s)
#   TESTS=0 bash benchmarks/run_fp8_h200.sh    # the benchmark only
#
# WHEELS (default .whl/) must hold what the H200 image lacks: torchao 0.18.0
# (torchao-0.18.0-cp310-abi3-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl, `pip download
# torchao==0.18.0 --no-deps`; it needs torch >= 2.11), diffusers 0.42.1 and, for their rows,
# sageattention / fa3-fwd (the sage8 backend is in the repository and needs neither).
# Results: into $OUT (the device tool) or benchmarks/results/: h3-fp8_h200_<date>.{json,md,png}
# and fp8-gpu-tests_h200_<date>.log.
set -u -o pipefail
cd "$(dirname "$0")/.."
. benchmarks/h200_env.sh
RES=${OUT:-benchmarks/results}
mkdir -p "$RES"
h200_setup "${WHEELS:-.whl}"
python3 -c "import torchao; print('torchao', torchao.__version__)" 2>&1 | grep -v "Failed to load"
if [ "${TESTS:-1}" = 1 ]; then
  timeout 90 python3 -m pytest tests/integrations/test_fp8_gpu.py -rs -q -s -p no:cacheprovider 2>&1 \
      | tee "$RES/fp8-gpu-tests_h200_$(date -u +%F).log" | grep -E "rel-L2|FAIL|Error|passed|failed|skipped" | tail -20
fi
timeout --kill-after=10 285 python3 -m benchmarks.h3_fp8 --out "$RES" --budget-s "${BUDGET:-265}" 2>&1 \
    | grep -v "Failed to load" | tail -60
