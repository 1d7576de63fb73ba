# Sourced (not run) by the benchmarks/h200_*.sh scripts, from the repository root on ONE H200 (the
# device tool). It sets the NCCL variables the machine needs and defines:
#   h200_setup WHEEL_DIR   install WHEEL_DIR/*.whl into /tmp/site (no network there), put /tmp/site
#                          and the repo on PYTHONPATH, print the GPU and the torch/triton versions
#   sa2_ready              SageAttention 2's sm90 extension is built in .sa2build/
#   sa2_start [setsid]     start that build from .third_party/SageAttention-2.2.0-src.tar.gz in the
#                          background (~4 min; with setsid it outlives the device call); the build
#                          is git-ignored and never carried
#   sa2_path               put the built SageAttention 2 before any installed sageattention wheel
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
SA2=$PWD/.sa2build/SageAttention

h200_setup() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$1"/*.whl 2>&1 | tail -2
  export PYTHONPATH=/tmp/site:$PWD
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
}

sa2_ready() { ls "$SA2"/sageattention/_qattn_sm90*.so >/dev/null 2>&1; }

sa2_start() {
  rm -rf .sa2build && mkdir -p .sa2build/meta/sageattention-2.2.0.dist-info
  printf 'Metadata-Version: 2.1\nName: sageattention\nVersion: 2.2.0\n' \
      > .sa2build/meta/sageattention-2.2.0.dist-info/METADATA
  tar -xzf .third_party/SageAttention-2.2.0-src.tar.gz -C .sa2build
  (cd "$SA2" && ${1:-} nohup env TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=14 EXT_PARALLEL=4 NVCC_APPEND_FLAGS="--threads=4" \
      python3 setup.py build_ext --inplace > ../build.log 2>&1 &)
  echo "SageAttention 2 build started $(date +%T)"
}

sa2_path() { export PYTHONPATH=$SA2:$PWD/.sa2build/meta:${PYTHONPATH:-}; }
