#!/usr/bin/env bash
# Tracker issue 16, the last part (speed beside SageAttention 2), on ONE H200 in one device call:
# starts the SageAttention 2 build (setsid, ~4.5 min), meanwhile the GPU tests, a pre-pass check and
# the accuracy benchmark with the shipped kernels; then, built, SageAttention 2 beside sage8 at 14, 56
# and 7 heads in interleaved rounds, whole calls and each half (quantization / attention) apart.
#
#   bash benchmarks/h200_issue16.sh            # ~8 min (ACC=0: without the accuracy benchmark;
#                                              # EXTRA='pattern,': more kernels in the speed part)
#   bash benchmarks/h200_issue16.sh speed      # the side-by-side part only (build already there)
#
# Needs .whl2/ (sageattention 1.0.6, fa3-fwd 0.0.3, diffusers 0.42.1, importlib_metadata) and
# .third_party/SageAttention-2.2.0-src.tar.gz, both carried (../shared/third_party/README.md).
set -u -o pipefail
cd "$(dirname "$0")/.."
. benchmarks/h200_env.sh
OUTD=${OUT:-benchmarks/results}
TAG=${TAG:-2026-12-04b}
mkdir -p "$OUTD"
h200_setup .whl2
sa2_ready || [ -d "$SA2" ] || sa2_start setsid
if [ "${1:-all}" = all ]; then
  timeout 240 python3 -m pytest tests/core/test_gpu_core.py tests/core/test_gpu_fa3.py tests/core/test_kernel_sage8.py \
      tests/core/test_kernel_accuracy.py -rs -q -s -p no:cacheprovider 2>&1 | tee "$OUTD/gpu-tests_h200_$TAG.log" \
      | grep -E "\[accuracy\]|FAIL|Error|passed|failed" | tail -40
  [ "${ACC:-1}" = 1 ] && timeout 200 python3 -m benchmarks.accuracy --out "$OUTD" --theme "accuracy-final" --budget-s 180 \
      --kernels sdpa,fa3,sage8,sage8_gluon --drift-backends fa3,sage8 2>&1 | tail -45
fi
for i in $(seq 1 90); do sa2_ready && break; sleep 4; done
sa2_path  # 2.x before the 1.0.6 wheel
if sa2_ready; then
  echo "SageAttention 2 built $(date +%T)"
  CUOBJ=$(python3 -c "import triton, os; print(os.path.join(os.path.dirname(triton.__file__), 'backends/nvidia/bin/cuobjdump'))")
  "$CUOBJ" -res-usage "$SA2"/sageattention/_qattn_sm90*.so 2>/dev/null | grep -A1 "attn_kernel" | grep -E "REG|Function" \
      | head -8 | cut -c1-200
else
  echo "SageAttention 2 NOT built:"; tail -20 .sa2build/build.log
fi
timeout 280 python3 -m benchmarks.kernels --out "$OUTD" --theme "kernels-side" --heads 14,56,7 --no-error \
    --iters 20 --warmup 3 --rounds 3 --budget-s 260 \
    --kernels "sdpa_cudnn,sage2_direct,dense:sage8,dense:sage8_gluon,sage2_quant,quant:sage8,sage2_attn,attn:sage8,${EXTRA:-}fa3_fp8_prequant" \
    2>&1 | tail -30
