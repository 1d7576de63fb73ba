#!/usr/bin/env bash
# GPU tests + the serving-overhead benchmark at one h3-ref layer, on ONE H200 (the device tool).
#   bash benchmarks/gpu_checks.sh      # from the repo root; .whl/ holds sageattention-1.0.6
# Logs and result files go to $OUT (or benchmarks/results/ without it).
set -u -o pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
OUTD=${OUT:-benchmarks/results}
mkdir -p "$OUTD"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
timeout 330 python3 -m pytest tests/test_gpu_core.py tests/test_kernel_sage8.py -v -rs -p no:cacheprovider \
    2>&1 | tee "$OUTD/gpu_tests.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|Error" | tail -60
timeout 200 python3 -m benchmarks.serve_overhead --config configs/h3.toml --layers 1 --nproc 1 \
    --backend auto --requests 10 --warmup 2 --serve-arg=--ulysses-degree=1 --out-dir "$OUTD" 2>&1 | tail -22
