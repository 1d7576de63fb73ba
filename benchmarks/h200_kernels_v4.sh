#!/usr/bin/env bash
# Backend names as of 2026-12-03: 'sage8' was the Gluon loop, 'sage8_triton' the Triton loop; since
# 2026-12-04 'sage8' is the Triton loop and the Gluon loop is 'sage8_gluon' (sage8_triton matches nothing).
# The sage8 v4 checks (tracker issue 16) on ONE H200, in back-to-back device calls (the machine keeps
# ignored build outputs while it stays warm, ~30 s). On 2026-12-03 they measured the P V split
# experiment (two N = D/2 wgmmas, since removed: KERNEL_NOTES.md v4); run now, they measure v3.
#
#   bash benchmarks/h200_kernels_v4.sh part1   # starts the SageAttention 2 build (setsid, ~4 min);
#                                              # GPU tests, loop variants at 14 heads, accuracy (~7 min)
#   bash benchmarks/h200_kernels_v4.sh part2   # waits for the build; SageAttention 2 beside sage8:
#                                              # accuracy and speed at 14, 56, 7 heads (~6 min)
#   bash benchmarks/h200_kernels_v4.sh ncu     # stall reasons of the v2 and v3 loops (Nsight Compute, ~20 s)
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
KERN='sdpa_cudnn,fa3_fp8_prequant,dense:sage8,dense:sage8_triton,variant:sage8:*'

if [ "${1:-part1}" = part1 ]; then
  sa2_ready || sa2_start setsid
  timeout 300 python3 -m pytest tests/core/test_gpu_core.py tests/core/test_gpu_fa3.py tests/core/test_kernel_sage8.py \
      tests/core/test_kernel_accuracy.py -rs -q -s -p no:cacheprovider 2>&1 | tee "$OUTD/gpu-tests_h200_v4.log" \
      | grep -E "\[accuracy\]|FAIL|Error|passed|failed" | tail -40
  timeout 100 python3 -m benchmarks.kernels --out "$OUTD" --theme kernels-v4-variants --heads 14 --no-error \
      --iters 20 --warmup 3 --budget-s 90 --kernels "$KERN" 2>&1 | tail -16
  timeout 170 python3 -m benchmarks.accuracy --out "$OUTD" --theme accuracy-v4 --budget-s 150 \
      --kernels sdpa,fa3,sage8,sage8_triton,sage8:v2-running --drift-backends fa3,sage8 2>&1 | tail -60
elif [ "$1" = ncu ]; then
  for c in '{"pv_accum":"running","add_magic":false}' '{}'; do
    echo "== GluonConfig overrides $c"
    timeout 120 ncu --clock-control none --kernel-name _attn_ws_kernel --launch-skip 2 --launch-count 1 --csv \
        --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,smsp__cycles_active.avg' \
        python3 -m benchmarks.sage8_ncu "$c" 2>/dev/null | awk -F'","' 'NF>5 {print $(NF-2)"="$NF}' | tr -d '"' \
        | sort -t= -k2 -g -r | head -14
  done
else
  sa2_ready || ls "$SA2" >/dev/null 2>&1 || sa2_start ""
  for i in $(seq 1 70); do sa2_ready && break; sleep 5; done
  sa2_path  # 2.x before the 1.0.6 wheel
  sa2_ready && echo "SageAttention 2 built" || { echo "SageAttention 2 NOT built:"; tail -20 .sa2build/build.log; }
  timeout 230 python3 -m benchmarks.kernels --out "$OUTD" --theme kernels-v4-sa2 --heads 14,56,7 --no-error \
      --iters 20 --warmup 3 --budget-s 210 --kernels "sage2_direct,$KERN" 2>&1 | tail -40
  timeout 150 python3 -m benchmarks.accuracy --out "$OUTD" --theme accuracy-v4-sage2 --drift-layers 0 --budget-s 130 \
      --kernels sdpa,sage2_direct,sage8,sage8_triton 2>&1 | tail -60
fi
