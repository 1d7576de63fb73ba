#!/usr/bin/env bash
# On ONE H200 (the device tool), from the repo root; logs and results go to $OUT (or
# benchmarks/results/ without it).
#   bash benchmarks/gpu_checks.sh          # GPU tests, then the serving part below
#   bash benchmarks/gpu_checks.sh serve    # serving only: serve_overhead at one h3-ref layer (with
#                                          # a load run), then one 8-layer h3-ref request eager
#                                          # and with --compile (3 steps each, W = 1)
# .whl/ holds the wheels the H200 image lacks: starlette and uvicorn (pure Python), diffusers 0.42.1
# (the served model is its MiniMaxH3Transformer3DModel), and sageattention-1.0.6 for the GPU tests.
set -u -o pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
OUTD=${OUT:-benchmarks/results}
mkdir -p "$OUTD"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/starlette-*.whl .whl/uvicorn-*.whl .whl/diffusers-*.whl \
    $([ "${1:-all}" = serve ] || ls .whl/sageattention-*.whl)
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
if [ "${1:-all}" != serve ]; then
  timeout 330 python3 -m pytest tests/core/test_gpu_core.py tests/core/test_kernel_sage8.py -v -rs \
      -p no:cacheprovider 2>&1 | tee "$OUTD/gpu_tests.log" \
      | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|Error" | tail -60
fi
timeout 120 python3 -m benchmarks.serve_overhead --config configs/h3.toml --layers 1 --nproc 1 \
    --requests 20 --warmup 3 --load 1,4,50 --load-requests 60 --load-seconds 15 \
    --label after-uvicorn --out-dir "$OUTD" 2>&1 | tail -26
for mode in eager compile; do
  flag=$([ $mode = compile ] && echo --compile)
  timeout 150 python3 launch/serve.py --config configs/h3.toml --once --layers 8 --steps 3 $flag \
      --log-level WARNING > "$OUTD/h3-8l-once-$mode.json" 2> "$OUTD/h3-8l-once-$mode.err"
  echo "once $mode: rc=$?"
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print('steps ms', r['step_latency_ms'], 'phases', r['phase_ms'])" \
      "$OUTD/h3-8l-once-$mode.json" || tail -5 "$OUTD/h3-8l-once-$mode.err"
done
