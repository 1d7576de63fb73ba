#!/usr/bin/env bash
# Every benchmark run on ONE H200 (the device tool), by what it measures. From the repository root:
#
#   bash benchmarks/h200.sh [--dry-run] SUBCOMMAND [SUBCOMMAND ...]   # run in order; a failed step
#                                                                     # does not stop the next one
#   tests               GPU tests of the core and the kernels -> gpu-tests_<gpu>_<date>.log      (~5 min)
#   fp8-tests           tests/integrations/test_fp8_gpu.py, test_weight_sharding_gpu.py -> fp8-gpu-tests_<gpu>_<date>.log (~2 min)
#   kernels             kernels: every kernel at W = 4, 1, 8, 2: speed, error, bridge overhead   (~2 min)
#   kernels-side        kernels: sage8 vs SageAttention 2 vs cuDNN side by side, each half apart (~5 min + build)
#   accuracy            accuracy: every kernel against float64, served-DiT drift                 (~3 min)
#   accuracy-sage2      accuracy: sage8 beside SageAttention 2                                   (~2.5 min + build)
#   kernels-variants    kernels: sage8's non-default configs (variant:*) beside cuDNN and FA3    (~2.5 min)
#   ncu                 dev/sage8_ncu under Nsight Compute: stall reasons, v2 loop vs v3 loop    (~1 min)
#   sage8-dev           dev/sage8_dev: hang-guarded Gluon variants, SASS, ceilings               (~4.5 min)
#   alltoall            alltoall: pack/unpack bandwidth, packed vs separate, 4 gloo ranks        (~1 min)
#   scaling             scaling: modeled for N = 1, 2, 4, 8, then measured on 4 gloo ranks       (~2.5 min)
#   h3                  h3_model: the real H3, every attention path; its block's scaling modeled (~4.5 min)
#   fp8                 h3_fp8: FP8 vs bf16 linears on the real block, W = 4 modeled             (~5 min)
#   serve-overhead      serve_overhead: per-request overhead at one h3 layer, load 1/4/50        (~2 min)
#   serve-step          launch/serve.py --once, 8 layers x 3 steps, eager then --compile         (~5 min)
#   decode              vae_decode: precision, seconds by batch, W = 4 modeled, MP4              (~3 min)
#   decode-mux          vae_decode: only the MP4 rows, streamed at the W = 4 decode's pace      (~20 s)
#   job                 serve_h3_gpu: the served job, 8 of 50 blocks x 3 steps                  (~3 min)
#   job-full            serve_h3_gpu: 50 blocks x 2 steps beside diffusers' t2va                (~6 min)
#   job-full-compiled   serve_h3_gpu: 50 blocks x 2 steps compiled, bf16 linears                (~2 min)
#   job-full-fp8        serve_h3_gpu: 50 blocks x 2 steps compiled, FP8 linears                 (~2 min)
#   job-full-fp8fast    serve_h3_gpu: the same, FP8 linears with fast accumulation              (~2 min)
#   job-outside         serve_h3_gpu: the served step with every block the identity (job_model) (~2 min)
#   job-decode-eager    serve_h3_gpu: the served job, 8 x 3, its decode eager (as before)        (~3 min)
#   decode-compiled     vae_decode_compiled: compiled vs eager fp16 decode at h3-ref, W = 1      (~4 min)
#   memory              h3_memory: full-size H3 as rank 0 of W = 4, 8 (fake PG), bf16 and FP8   (~6 min)
#   memory-ranks        h3_memory: the same as the last rank (3 of 4, 7 of 8), bf16 linears       (~3 min)
#   job-tree            the served 8 x 3 job, eager decode, from this tree and then from the older tree
#                       in TREE (default .pre45: `mkdir -p .pre45 && git archive COMMIT dist_attn benchmarks
#                       configs | tar -x -C .pre45`, git-ignored, carried): each MP4's SHA-256, compared (~2 min)
#   layer-ab            dev/layer_ab: one Ulysses layer at h3-ref (rank 0 of a fake W = 4, and W = 1) from this
#                       tree and the older one in TREE (default .pre47: `mkdir -p .pre47 && git archive 57a7c8c
#                       dist_attn | tar -x -C .pre47`, the tree before the hub split; git-ignored, carried) (~3 min)
#   cute-a              CuTe DSL, call 1 of 2: copy its wheels and the first half of the cu13 library
#                       wheel (carry .whl: split -b 46000000, see below) to /tmp/cute-wheels       (~5 s)
#   cute-b              CuTe DSL, call 2 of 2 (at once, carry .whl2): join the halves, install into
#                       /tmp/site; later steps then see cutlass (PYTHONPATH adds its dsl_packages) (~20 s)
#   cute-check          dev/sage8_cute_check: the CuTe loop and its variants (CUTE_VARIANTS, ';'-separated
#                       CuteConfig changes) against the Triton loop, float64, cuDNN; each config's
#                       cases in a child process killed after 60 s if hung, then each timed in a child (~5-8 min)
#   cute-tests          tests/core/test_kernel_sage8_cute.py on the GPU (opted in)   -> cute-gpu-tests_<gpu>_<date>.log (~2 min)
#   cute-ncu-src        dev/sage8_ncu under Nsight Compute's source counters: the CuTe loop's stall samples
#                       per SASS instruction (CUTE_NCU_VARIANT, default {}) -> cute-ncu-src_*.{ncu-rep,csv} (~2 min)
#   cute-ncu            dev/sage8_ncu under Nsight Compute: the CuTe loop's stall reasons, MUFU (xu) and
#                       tensor-pipe use, default config vs CUTE_NCU_VARIANT (JSON; default P in shared memory) (~1 min)
#   cute-accuracy       accuracy: sdpa, the Triton loop and the CuTe loop against float64 (needs
#                       diffusers: WHEELS=".whl2 .gw" on cute-b's call)              (~3.5 min)
#   all                 every subcommand above but cute-*, in this order (~80 min: several device calls)
#
# --dry-run prints each step's command and cap without setting up or running anything.
# CuTe DSL (the cute extra): its cu13 library wheel (~92 MB) is more than one call carries (64 MiB),
# so it travels in two halves: here, `split -b 46000000 nvidia_cutlass_dsl_libs_cu13-*.whl
# .whl/cu13part.` puts part .aa with nvidia-cutlass-dsl, -libs-base and -libs-core in .whl and part
# .ab in .whl2 (move it there; both git-ignored). Call 1 (carry .whl): `bash benchmarks/h200.sh
# cute-a`; call 2 at once, before the machine is released (carry .whl2):
# `WHEELS=.whl2 bash benchmarks/h200.sh cute-b cute-check` (WHEELS may name several folders, e.g.
# ".whl2 .gw", carried together). The machine keeps /tmp/site between warm calls.
# Needs: ${WHEELS:-.whl}/*.whl, the wheels the image lacks (installed into /tmp/site; the machine
# reaches no package index): diffusers 0.42.1, av, starlette, uvicorn, torchao 0.18.0 (fp8),
# sageattention 1.0.6 and fa3-fwd 0.0.3 (their rows), importlib_metadata. kernels-side and
# accuracy-sage2 ("+ build": ~4.5 min) build SageAttention 2.2 from
# .third_party/SageAttention-2.2.0-src.tar.gz (../shared/third_party/README.md; carried) into
# .sa2build/ (git-ignored, so never carried and kept on the machine between calls; started in the
# background when either is asked for, so it overlaps the steps before it). Results and h200.log
# go to $OUT (the device tool) or benchmarks/results/.
# Knobs: SA2_EARLY=1 (start the SageAttention 2 build now, for a later warm call's kernels-side;
# carry .third_party), BUDGET (fp8's --budget-s), PROFILE (fp8's --profile: block paths whose kernels it lists),
# COMPILED (fp8's --compiled: its compiled block paths, in order), MUX_PACE_S (decode-mux), EXTRA ('pattern,': more kernels in
# kernels-side), ACC_KERNELS (accuracy's --kernels), PYTHON (python3).
set -u -o pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
RES=${OUT:-benchmarks/results}
LOG="$RES/h200.log"
SA2=$PWD/.sa2build/SageAttention
TODAY=$(date -u +%F)
# the GPU in the names of the logs written here (the device tool may lend an H100 for an H200)
HW=$( (nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || true) | head -1 |
      grep -oiE 'h100|h200|b200|a100' | tr 'A-Z' 'a-z' || true)
HW=${HW:-gpu}
ALL=(tests fp8-tests kernels kernels-side accuracy accuracy-sage2 kernels-variants ncu sage8-dev
     alltoall scaling h3 fp8 serve-overhead serve-step decode decode-mux job job-full
     job-full-compiled job-full-fp8 job-full-fp8fast job-outside job-decode-eager decode-compiled
     memory memory-ranks)
CUTE=(cute-a cute-b cute-check cute-tests cute-accuracy cute-ncu cute-ncu-src)  # named only, never by "all"
TREES=(job-tree layer-ab)  # named only: they need an older tree carried in (TREE)
DRY=0

say() { echo "[h200 $(date -u +%T)] $*" | tee -a "$LOG"; }

quiet() { grep -v "torchao\|Enum subclass\|it/s]\|Failed to load"; }

# run CAP NAME [--log FILE] [--to FILE] CMD...: one step under a time cap, logged (--log: its output
# also into FILE; --to: its stdout into FILE, its stderr into FILE.err); prints the last lines
run() {
    local cap=$1 name=$2 log="" to=""
    shift 2
    [ "$1" = --log ] && { log=$2; shift 2; }
    [ "$1" = --to ] && { to=$2; shift 2; }
    if [ "$DRY" = 1 ]; then
        echo "$name (cap ${cap}s): $*${log:+ | tee $log}${to:+ > $to}"
        return 0
    fi
    say "$name: $*"
    if [ -n "$to" ]; then
        timeout --kill-after=10 "$cap" "$@" >"$to" 2>"$to.err"
        say "$name exited $?"
        tail -5 "$to.err"
        return 0
    fi
    timeout --kill-after=10 "$cap" "$@" 2>&1 | tee ${log:+"$log"} | quiet | tee -a "$LOG" | tail -60
    say "$name exited ${PIPESTATUS[0]}"
}

setup() {
    if [ "$DRY" = 1 ]; then
        echo "setup: install the *.whl of ${WHEELS:-.whl} into /tmp/site; PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD"
        return 0
    fi
    mkdir -p "$RES"
    local d w wheels=()
    for d in ${WHEELS:-.whl}; do  # WHEELS: one folder or several, space-separated
        for w in "$d"/*.whl; do [ -f "$w" ] && wheels+=("$w"); done
    done
    [ ${#wheels[@]} -gt 0 ] && "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "${wheels[@]}" 2>&1 | tail -2 | tee -a "$LOG"
    export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD  # a --target install: no .pth
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1 | tee -a "$LOG"
    "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" \
        2>&1 | tee -a "$LOG"
}

sa2_ready() { ls "$SA2"/sageattention/_qattn_sm90*.so >/dev/null 2>&1; }

sa2_start() {  # the SageAttention 2 build, ~4.5 min, in its own session: it outlives this call
    [ "$DRY" = 1 ] && { echo "sa2: build SageAttention 2 into .sa2build/ in the background"; return 0; }
    sa2_ready || [ -d "$SA2" ] && return 0
    [ -f .third_party/SageAttention-2.2.0-src.tar.gz ] || { say "no .third_party/SageAttention-2.2.0-src.tar.gz"; return 0; }
    rm -rf .sa2build && mkdir -p .sa2build/meta/sageattention-2.2.0.dist-info
    printf 'Metadata-Version: 2.1\nName: sageattention\nVersion: 2.2.0\n' \
        >.sa2build/meta/sageattention-2.2.0.dist-info/METADATA
    tar -xzf .third_party/SageAttention-2.2.0-src.tar.gz -C .sa2build
    (cd "$SA2" && setsid nohup env TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=14 EXT_PARALLEL=4 NVCC_APPEND_FLAGS="--threads=4" \
        "$PY" setup.py build_ext --inplace >../build.log 2>&1 &)
    say "SageAttention 2 build started"
}

sa2_wait() {  # up to 6 min for the build; then its registers (cuobjdump), or why it is missing
    [ "$DRY" = 1 ] && { echo "sa2: wait for the build (<= 6 min), then put it before any sageattention wheel"; return 0; }
    for _ in $(seq 1 90); do sa2_ready || [ ! -d "$SA2" ] && break; sleep 4; done  # none started: no wait
    if sa2_ready; then
        say "SageAttention 2 built"
        local cuobj
        cuobj=$("$PY" -c "import triton, os; print(os.path.join(os.path.dirname(triton.__file__), 'backends/nvidia/bin/cuobjdump'))")
        "$cuobj" -res-usage "$SA2"/sageattention/_qattn_sm90*.so 2>/dev/null | grep -A1 "attn_kernel" \
            | grep -E "REG|Function" | head -8 | cut -c1-200
    else
        say "SageAttention 2 NOT built:"; tail -20 .sa2build/build.log 2>/dev/null
    fi
}

sa2_env() { echo "PYTHONPATH=$SA2:$PWD/.sa2build/meta:${PYTHONPATH:-}"; }  # 2.x before the 1.0.6 wheel

ncu_stalls() {  # the largest stall ratios of one ncu --csv log
    awk -F'","' 'NF>5 {print $(NF-2)"="$NF}' "$1" | tr -d '"' | sort -t= -k2 -g -r | head -14
}

step() {
    local c i=0 mode
    case $1 in
    cute-a)
        run 30 cute-a bash -c 'mkdir -p /tmp/cute-wheels && cp "${WHEELS:-.whl}"/* /tmp/cute-wheels/ && ls /tmp/cute-wheels' ;;
    cute-b)  # unzipped, not pip --target: its wheels share one top folder, which --target skips
        run 90 cute-b bash -c 'cat /tmp/cute-wheels/cu13part.aa $(for d in ${WHEELS:-.whl2}; do [ -f "$d/cu13part.ab" ] && echo "$d/cu13part.ab"; done) > /tmp/cute-wheels/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl && rm /tmp/cute-wheels/cu13part.aa && for w in /tmp/cute-wheels/*.whl; do "$0" -m zipfile -e "$w" /tmp/site || exit 1; done && PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages "$0" -c "import cutlass.cute; print(cutlass.__version__)"' "$PY" ;;
    cute-ncu)  # the CuTe loop's default config, then CUTE_NCU_VARIANT (a JSON of CuteConfig changes)
        local c i=0
        for c in '{}' "${CUTE_NCU_VARIANT:-{\"p_smem\":true\}}"; do
            i=$((i + 1))
            run 150 "cute-ncu $c" --log "$RES/cute-ncu-$i-of-2_${HW}_$TODAY.csv" env DIST_ATTN_SAGE8_CUTE=1 \
                ncu --clock-control none --kernel-name regex:Sage8Cute --launch-skip 2 --launch-count 1 --csv \
                --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,smsp__cycles_active.avg,smsp__inst_executed_pipe_xu.sum,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active' \
                "$PY" -m benchmarks.dev.sage8_ncu "$c" cute
            [ "$DRY" = 1 ] || ncu_stalls "$RES/cute-ncu-$i-of-2_${HW}_$TODAY.csv"
        done ;;
    cute-ncu-src)  # the default config's stall samples per SASS instruction (Nsight's source page)
        local src='ncu --clock-control none --kernel-name regex:Sage8Cute --launch-skip 2 --launch-count 1 --section SourceCounters --section WarpStateStats --import-source no -f -o "$REP" "$0" -m benchmarks.dev.sage8_ncu "$VARIANT" cute && ncu -i "$REP.ncu-rep" --page source --csv --print-source sass > "$REP.csv" && wc -l "$REP.csv"'
        run 240 cute-ncu-src env DIST_ATTN_SAGE8_CUTE=1 REP="$RES/cute-ncu-src_${HW}_$TODAY" \
            VARIANT="${CUTE_NCU_VARIANT:-{\}}" bash -c "$src" "$PY" ;;
    cute-tests)
        run 300 cute-tests --log "$RES/cute-gpu-tests_${HW}_$TODAY.log" env DIST_ATTN_SAGE8_CUTE=1 "$PY" -m pytest \
            tests/core/test_kernel_sage8_cute.py -rs -q -s -p no:cacheprovider ;;
    cute-accuracy)  # needs diffusers (the real-H3 family): WHEELS=".whl2 .gw"
        run 220 cute-accuracy env DIST_ATTN_SAGE8_CUTE=1 "$PY" -m benchmarks.accuracy --out "$RES" \
            --theme accuracy-cute --budget-s 200 --kernels sdpa,sage8,sage8_cute --drift-backends sage8,sage8_cute ;;
    cute-check)
        run 520 cute-check "$PY" -m benchmarks.dev.sage8_cute_check --out "$RES" --isolate 60 \
            ${CUTE_VARIANTS:+--variants "$CUTE_VARIANTS"} ;;
    tests)
        run 330 tests --log "$RES/gpu-tests_${HW}_$TODAY.log" "$PY" -m pytest tests/core/test_gpu_core.py \
            tests/core/test_gpu_fa3.py tests/core/test_gpu_harness.py tests/core/test_kernel_sage8.py \
            tests/core/test_kernel_waves_gpu.py \
            tests/core/test_kernel_accuracy.py \
            -rs -q -s -p no:cacheprovider ;;
    fp8-tests)
        run 120 fp8-tests --log "$RES/fp8-gpu-tests_${HW}_$TODAY.log" "$PY" -m pytest \
            tests/integrations/test_fp8_gpu.py tests/integrations/test_weight_sharding_gpu.py \
            -rs -q -s -p no:cacheprovider ;;
    kernels)
        run 130 kernels "$PY" -m benchmarks.kernels --out "$RES" --budget-s 110 --iters 20 --warmup 3 ;;
    kernels-side)
        sa2_wait
        run 280 kernels-side env "$(sa2_env)" "$PY" -m benchmarks.kernels --out "$RES" --theme kernels-side \
            --heads 14,56,7 --no-error --iters 20 --warmup 3 --rounds 3 --budget-s 260 --kernels \
            "sdpa_cudnn,sage2_direct,dense:sage8,dense:sage8_gluon,sage2_quant,quant:sage8,sage2_attn,attn:sage8,${EXTRA:-}fa3_fp8_prequant" ;;
    accuracy)
        run 200 accuracy "$PY" -m benchmarks.accuracy --out "$RES" --budget-s 180 \
            --kernels "${ACC_KERNELS:-sdpa,fa3,sage8,sage8_gluon}" --drift-backends fa3,sage8 ;;
    accuracy-sage2)
        sa2_wait
        run 150 accuracy-sage2 env "$(sa2_env)" "$PY" -m benchmarks.accuracy --out "$RES" \
            --theme accuracy-sage2 --drift-layers 0 --budget-s 130 --kernels sdpa,sage2_direct,sage8,sage8_gluon ;;
    kernels-variants)
        run 150 kernels-variants "$PY" -m benchmarks.kernels --out "$RES" --theme kernels-variants \
            --heads 14,56,7 --no-error --iters 20 --warmup 3 --budget-s 130 \
            --kernels 'sdpa_cudnn,fa3_fp8_prequant,dense:sage8,dense:sage8_gluon,variant:*' ;;
    ncu)  # the v2 loop (P V summed in the FP8 MMA, no magic add) against the shipped config
        for c in '{"pv_accum":"running","add_magic":false}' '{}'; do
            i=$((i + 1))
            run 120 "ncu $c" --log "$RES/ncu-$i-of-2_${HW}_$TODAY.csv" ncu --clock-control none \
                --kernel-name _attn_ws_kernel --launch-skip 2 --launch-count 1 --csv --metrics \
                'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,smsp__cycles_active.avg' \
                "$PY" -m benchmarks.dev.sage8_ncu "$c"
            [ "$DRY" = 1 ] || ncu_stalls "$RES/ncu-$i-of-2_${HW}_$TODAY.csv"
        done ;;
    sage8-dev)
        run 290 sage8-dev "$PY" -m benchmarks.dev.sage8_dev --out "$RES" ;;
    alltoall)
        run 70 alltoall "$PY" -m torch.distributed.run --standalone --nproc-per-node 4 -m benchmarks.alltoall \
            --backend gloo --out "$RES" --budget-s 50 --iters 20 --warmup 1 --comm-iters 3 ;;
    scaling)
        run 70 scaling-modeled "$PY" -m benchmarks.scaling --modeled --bandwidth-gbs 360 --ranks 1,2,4,8 \
            --overlap 1,2,4 --out "$RES" --budget-s 55 --iters 10 --warmup 2
        run 90 scaling-gloo4 "$PY" -m torch.distributed.run --standalone --nproc-per-node 4 -m benchmarks.scaling \
            --comm-backend gloo --ranks 1,2,4 --overlap 1,2,4 --backends auto,sdpa --out "$RES" --budget-s 65 \
            --iters 2 --warmup 1 ;;
    h3)
        run 225 h3-model "$PY" -m benchmarks.h3_model --out "$RES" --budget-s 190
        run 45 h3-scaling-modeled "$PY" -m benchmarks.scaling --modeled --bandwidth-gbs 360 --ranks 1,4 \
            --overlap 1,4 --backends sdpa,sage8 --out "$RES" --budget-s 35 --iters 5 --warmup 1 ;;
    fp8)
        run $((${BUDGET:-330} + 25)) fp8 "$PY" -m benchmarks.h3_fp8 --out "$RES" --budget-s "${BUDGET:-330}" \
            ${PROFILE:+--profile "$PROFILE"} ${COMPILED:+--compiled "$COMPILED"} ${FP8_ARGS:-} ;;
    serve-overhead)
        run 120 serve-overhead "$PY" -m benchmarks.serve_overhead --config configs/h3.toml --layers 1 --nproc 1 \
            --requests 20 --warmup 3 --load 1,4,50 --load-requests 60 --load-seconds 15 --out-dir "$RES" ;;
    serve-step)
        for mode in eager compile; do
            run 150 "serve-step-$mode" --to "$RES/h3-8l-once-$mode.json" "$PY" launch/serve.py \
                --config configs/h3.toml --once --layers 8 --steps 3 $([ $mode = compile ] && echo --compile) \
                --log-level WARNING
            [ "$DRY" = 1 ] || "$PY" -c "import json, sys; r = json.load(open(sys.argv[1])); \
print('steps ms', r['step_latency_ms'], 'phases', r['phase_ms'])" "$RES/h3-8l-once-$mode.json" 2>/dev/null
        done ;;
    decode)
        run 280 decode "$PY" -m benchmarks.vae_decode --out "$RES" --budget-s 250 ;;
    decode-mux)
        run 120 decode-mux "$PY" -m benchmarks.vae_decode --out "$RES" --skip precision time \
            --mux-pace-s "${MUX_PACE_S:-0.218}" --theme vae-decode-mux ;;
    job)
        run 280 job "$PY" -m benchmarks.serve_h3_gpu --out "$RES" --layers 8 --steps 3 --jobs 1 --diffusers off \
            --theme serve-h3-job-8x3 --budget-s 250 ;;
    job-full)
        run 560 job-full "$PY" -m benchmarks.serve_h3_gpu --out "$RES" --layers 50 --steps 2 --jobs 1 \
            --diffusers on --compile off --theme serve-h3-job-full --budget-s 520 ;;
    job-full-compiled)
        run 280 job-full-compiled "$PY" -m benchmarks.serve_h3_gpu --out "$RES" --layers 50 --steps 2 --jobs 1 \
            --diffusers off --compile on --theme serve-h3-job-full-compiled --budget-s 250 ;;
    job-full-fp8)
        run 280 job-full-fp8 "$PY" -m benchmarks.serve_h3_gpu --out "$RES" --layers 50 --steps 2 --jobs 1 \
            --diffusers off --compile on --linear-precision fp8 --theme serve-h3-job-full-fp8 --budget-s 250 ;;
    job-full-fp8fast)
        run 280 job-full-fp8fast "$PY" -m benchmarks.serve_h3_gpu --out "$RES" --layers 50 --steps 2 --jobs 1 \
            --diffusers off --compile on --linear-precision fp8 --fp8-fast-accum \
            --theme serve-h3-job-full-fp8fast --budget-s 250 ;;
    job-outside)
        run 240 job-outside "$PY" -m benchmarks.serve_h3_gpu --out "$RES" --layers 1 --steps 3 --jobs 1 \
            --diffusers off --compile on --blocks identity --theme serve-h3-job-outside --budget-s 210 ;;
    job-decode-eager)
        run 280 job-decode-eager "$PY" -m benchmarks.serve_h3_gpu --out "$RES" --layers 8 --steps 3 --jobs 1 \
            --diffusers off --decode-compile off --theme serve-h3-job-8x3-decode-eager --budget-s 250 ;;
    decode-compiled)
        run 300 decode-compiled "$PY" -m benchmarks.vae_decode_compiled --out "$RES" --rounds 3 ;;
    memory)
        run 480 memory "$PY" -m benchmarks.h3_memory --out "$RES" --worlds 4 8 --precisions bf16 fp8 \
            --budget-s 420 ;;
    layer-ab)  # one Ulysses layer at h3-ref (fake W = 4, and W = 1) from this tree and ${TREE:-.pre47}
        run 400 layer-ab "$PY" -m benchmarks.dev.layer_ab --old "${TREE:-.pre47}" --new . --out "$RES" --rounds 5 ;;
    job-tree)  # the eager-decode 8 x 3 job from this tree, then from ${TREE:-.pre45}: their MP4s' SHA-256
        local d t n=0 res sums
        res=$RES && [[ $res = /* ]] || res=$PWD/$RES  # the runs start in their own tree
        for d in "$PWD" "$PWD/${TREE:-.pre45}"; do
            n=$((n + 1)) t=/tmp/job-tree-$n
            rm -rf "$t" && mkdir -p "$t"
            # an older tree's benchmark may lack --decode-compile (its decode is eager)
            run 200 "job-tree $n ($d)" env -C "$d" PYTHONPATH="/tmp/site:$d" TMPDIR="$t" "$PY" \
                -m benchmarks.serve_h3_gpu --out "$res" --layers 8 --steps 3 --jobs 1 --diffusers off \
                $([ "$n" = 1 ] && echo --decode-compile off) --theme "job-tree-$n" --budget-s 150
        done
        [ "$DRY" = 1 ] && return 0
        sums=$(sha256sum /tmp/job-tree-{1,2}/dist_attn_h3job_*/*.mp4 2>/dev/null)
        echo "$sums" | tee -a "$LOG"
        if grep -q job-tree-1/ <<<"$sums" && grep -q job-tree-2/ <<<"$sums" &&
            [ "$(cut -d' ' -f1 <<<"$sums" | sort -u | wc -l)" = 1 ]; then
            say "job-tree: every MP4 of both trees is identical"
        else
            say "job-tree: the MP4s DIFFER (or a run wrote none)"
        fi ;;
    memory-ranks)
        run 240 memory-ranks "$PY" -m benchmarks.h3_memory --out "$RES" --theme h3-memory-ranks \
            --worlds 4 8 --precisions bf16 --ranks -1 --budget-s 200 ;;
    esac
}

# the arguments: checked whole before anything runs, so a typo costs no device time
todo=()
for a in "$@"; do
    case $a in
    --dry-run) DRY=1 ;;
    -h | --help) sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    all) todo+=("${ALL[@]}") ;;
    *) if [[ " ${ALL[*]} ${CUTE[*]} ${TREES[*]} " == *" $a "* ]]; then todo+=("$a"); else
           echo "h200.sh: unknown subcommand '$a' (bash benchmarks/h200.sh --help lists them)" >&2; exit 2; fi ;;
    esac
done
[ ${#todo[@]} -gt 0 ] || { echo "h200.sh: no subcommand (bash benchmarks/h200.sh --help lists them)" >&2; exit 2; }
[ "$DRY" = 1 ] && LOG=/dev/null
setup
[[ " ${todo[*]} " == *" kernels-side "* || " ${todo[*]} " == *" accuracy-sage2 "* || ${SA2_EARLY:-0} = 1 ]] && sa2_start
for what in "${todo[@]}"; do step "$what"; done
