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
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
OUTD=${OUT:-benchmarks/results}
mkdir -p "$OUTD"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    2>&1 | tail -2
SA2=$PWD/.sa2build/SageAttention
export PYTHONPATH=/tmp/site:$PWD:$SA2:$PWD/.sa2build/meta
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"

sa2_ready() { ls "$SA2"/sageattention/_qattn_sm90*.so >/dev/null 2>&1; }

if [ "${1:-part1}" = final ]; then
  # the shipped v3: every GPU test of the kernels and the core, then the loop orderings timed
  timeout 330 python3 -m pytest tests/core/test_gpu_core.py tests/core/test_gpu_fa3.py tests/core/test_kernel_sage8.py \
      tests/core/test_kernel_accuracy.py -rs -q -s -p no:cacheprovider 2>&1 | tee "$OUTD/gpu-tests_h200_v3.log" \
      | grep -E "\[accuracy\]|FAIL|Error|passed|failed" | tail -40
  timeout 150 python3 -m benchmarks.kernels --out "$OUTD" --theme kernels-v3 --heads 14,56,7 --no-error --iters 20 \
      --warmup 3 --budget-s 130 --kernels 'sdpa_cudnn,fa3_fp8_prequant,dense:sage8,dense:sage8_triton,variant:*' \
      2>&1 | tail -30
elif [ "${1:-part1}" = part1 ]; then
  if ! sa2_ready && [ ! -d .sa2build ]; then
    mkdir -p .sa2build/meta/sageattention-2.2.0.dist-info
    printf 'Metadata-Version: 2.1\nName: sageattention\nVersion: 2.2.0\n' \
        > .sa2build/meta/sageattention-2.2.0.dist-info/METADATA
    tar -xzf .third_party/SageAttention-2.2.0-src.tar.gz -C .sa2build
    # its own session, so the build outlives this call; its log is read by part2
    (cd "$SA2" && setsid nohup env TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=12 EXT_PARALLEL=4 NVCC_APPEND_FLAGS="--threads=4" \
        python3 setup.py build_ext --inplace > ../build.log 2>&1 &)
    echo "SageAttention 2 build started in the background"
  fi
  timeout 270 python3 -m pytest tests/core/test_kernel_sage8.py tests/core/test_kernel_accuracy.py -rs -q -s \
      -p no:cacheprovider 2>&1 | tee "$OUTD/gpu_tests_kernels.log" | grep -E "\[accuracy\]|PASS|FAIL|Error|passed|failed" | tail -60
  timeout 200 python3 -m benchmarks.accuracy --out "$OUTD" --budget-s 180 --kernels \
      sdpa,fa3,sage,sage8,sage8_triton,sage8:v2-running,sage8_triton:v2-running \
      2>&1 | tail -80
else
  # part2: self-contained (a machine released between the calls loses the build)
  if ! sa2_ready; then
    rm -rf .sa2build && mkdir -p .sa2build/meta/sageattention-2.2.0.dist-info
    printf 'Metadata-Version: 2.1\nName: sageattention\nVersion: 2.2.0\n' \
        > .sa2build/meta/sageattention-2.2.0.dist-info/METADATA
    tar -xzf .third_party/SageAttention-2.2.0-src.tar.gz -C .sa2build
    (cd "$SA2" && env TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 EXT_PARALLEL=4 NVCC_APPEND_FLAGS="--threads=4" \
        python3 setup.py build_ext --inplace > ../build.log 2>&1 &)
  fi
  for i in $(seq 1 60); do sa2_ready && break; sleep 5; done
  export PYTHONPATH=$SA2:$PWD/.sa2build/meta:$PYTHONPATH  # 2.x before the 1.0.6 wheel
  sa2_ready && echo "SageAttention 2 built" || { echo "SageAttention 2 NOT built:"; tail -20 .sa2build/build.log; }
  timeout 150 python3 -m benchmarks.accuracy --out "$OUTD" --theme accuracy-sage2 --drift-layers 0 --budget-s 130 \
      --kernels sdpa,sage2_direct,sage8,sage8_triton 2>&1 | tail -100
  timeout 200 python3 -m benchmarks.kernels --out "$OUTD" --heads 14,56,7 --no-error --iters 20 --warmup 3 \
      --budget-s 180 --kernels 'sdpa_cudnn,sage2_direct,fa3_fp8_prequant,dense:sage8,dense:sage8_triton,variant:*' \
      2>&1 | tail -40
fi
