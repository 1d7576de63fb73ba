#!/usr/bin/env bash
# dev: the compiled H3 block under inductor options, one GPU, each variant in its own process.
#   bash benchmarks/dev/inductor_probe.sh NAME:ENV=V[,ENV=V...] ...   e.g.  base:  ma:TORCHINDUCTOR_MAX_AUTOTUNE=1
# Needs the wheels installed into /tmp/site (benchmarks/h200.sh does it); results -> $OUT.
set -u
export PYTHONPATH=/tmp/site:$PWD NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
ROWS=${ROWS:-fp8fast:sage8,fp8fast:none@w4,bf16:native}
for v in "$@"; do
  name=${v%%:*}; envs=${v#*:}
  echo "== $name ($envs)"
  env ${envs//,/ } timeout "${CAP:-200}" python3 -m benchmarks.h3_fp8 --out "$OUT" --sections block \
      --modes compiled --compiled "$ROWS" --budget-s "$((${CAP:-200} - 15))" --theme "h3-fp8-ind-$name" \
      > "$OUT/ind-$name.log" 2>&1
  grep -oE "'path': '[^']*'|'median_ms': [0-9.]+|'min_ms': [0-9.]+|'wall_s': [0-9.]+|'reason': '.{0,150}" \
      "$OUT/ind-$name.log" | paste -sd' ' | sed "s/'path'/\n/g"
done
