set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl2/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout 200 python3 -m pytest tests/core/test_gpu_core.py tests/core/test_gpu_fa3.py tests/core/test_kernel_sage8.py tests/core/test_kernel_accuracy.py -rs -q -p no:cacheprovider > $OUT/gpu-tests.log 2>&1; tail -3 $OUT/gpu-tests.log
for v in base:0:0 mk:1:0 mkcdt:1:1; do
  IFS=: read name mk cdt <<< "$v"
  TORCHINDUCTOR_MULTI_KERNEL=$mk TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=$cdt timeout 130 python3 -m benchmarks.h3_fp8 --out $OUT --sections block --modes compiled --compiled fp8fast:sage8,fp8fast:none@w4,bf16:native --profile fp8fast:sage8 --budget-s 120 --theme h3-fp8-ind-$name > $OUT/ind-$name.log 2>&1
  echo "== $name"; grep -oE "'path': '[^']*'|'median_ms': [0-9.]+|'min_ms': [0-9.]+|'wall_s': [0-9.]+|'reason': '.{0,150}" $OUT/ind-$name.log | paste -sd' ' | sed "s/'path'/\n/g"
done
