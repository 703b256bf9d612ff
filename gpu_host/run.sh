#!/usr/bin/env bash
# Run ktflow's KT 0.7 path on a GPU + AMX host without network (see gpu_host/README.md).
#
#   gpu_host/run.sh STEP...      steps: setup bf16 rawint4 killresume-bf16 convert-bf16 convert-rawint4
#                                       losscheck-bf16 losscheck-rawint4 collect   (or: all)
#                                probe (gpu_host/probe.py: ktflow's host probe, kt-kernel's SFT kernels at the fitted
#                                       models' shapes, into results/probe-HOST.json; THREADS=T, PROBE_METHODS=RAWINT4)
#                                probe-sweep (gpu_host/probe_sweep.py: the probe's ratio against its repeats, experts
#                                       and tokens at the Kimi-K2.5 slice's shape, into build/gpu-host/probe-sweep;
#                                       THREADS=T, POINTS=a,b; points already measured are skipped)
#                                bigger than the GPU (gpu_host/big.py; one device call each, in this order):
#                                       fixture-big sft-big hf-big convert-big kill-big resume-big report-big
#                                       big-reduced (the same code at reduced size: fixture, 4 KT steps, convert)
#                                       sft-big takes GPUS=N and THREADS=T (a store and results name of their own)
#                                       serve-prep-big serve-big (after sft-big; METHODS=RAWINT4,AMXINT8 by default):
#                                       what `ktflow serve` prepares, then each method served and load-benchmarked
#                                       pack-big (build/gpu-host/big/results into $RESULTS_OUT/big-results.tar.gz)
#                                Kimi-K2.5 at its true geometry, a slice of N MoE layers (gpu_host/kimi_slice.py):
#                                       slice-fixture-N slice-sft-N (GPUS=N, THREADS=T, AS_WRITTEN=1: the recipe's
#                                       batch split, not the shaper's) slice-whole (the whole model's
#                                       plan, calibrated from the slice runs) slice-convert-N slice-serve-prep-N
#                                       slice-serve-N (RAWINT4, concurrency 1 and 8) slice-clean-N (its model removed)
#                                       pack-slice (build/gpu-host/slice results into $RESULTS_OUT/slice-results.tar.gz)
#                                merged serving at Kimi-K2.5's geometry (gpu_host/merged_serving.py; results in
#                                       build/gpu-host/merged/results): merged-fixture (MOE_LAYERS=N, else the depth
#                                       the disk allows; VIEW_ROOT=/dev/shm/ktflow-views: the served models' views in
#                                       RAM, for every merged step) merged-adapter (RANDOM_ADAPTER=1: random LoRA, no training)
#                                       merged-merge (METHOD=M, default RAWINT4) merged-levers-GROUP (engine gpu threads
#                                       methods combo) merged-load (ONLY=lora,merged,base) merged-alternate (merged
#                                       and base with the chosen settings started in turn: STARTS=4, FIRST=base)
#                                       merged-check-NAME (bf16, rawint4: served = trained for each merged format;
#                                       ONLY=merged-BF16,... some of its servers) merged-report merged-clean
#                                       pack-merged (the results into $RESULTS_OUT/merged-results.tar.gz)
#                                serving with SGLang (sglang-kt 0.7.2 + KT CPU experts + the converted adapter):
#                                       serve-setup  serve-jit (sglang's Marlin MoE kernel for GPU experts, built
#                                       once: minutes of nvcc; serve-jit-bg and serve-jit-wait: the same beside
#                                       other steps)  serve-NAME (ktflow's serve stage)  serve-cli-NAME (`ktflow serve`:
#                                       the SFT run in this machine's store, converted, quantized for AMXINT8, served)
#                                       promotion-NAME (serve_check.py promotion: promote, a base server, a candidate
#                                       judged beside production, promote, rollback, on the real server)
#                                       pack-adapter-NAME (the converted adapter into $RESULTS_OUT, for later calls)
#                                       int8-NAME (ktflow quantize-int8 of NAME's BF16 base, T=1: $B/store/int8/NAME;
#                                       the serve stage writes the .kt layout sglang-kt's AMXINT8 expert LoRA path
#                                       reads itself, once, into the store)
#
# Inputs (made on a machine with network, carried in ignored paths):
#   build/gpu-host/parts/bundle.tar.gz.NN   gpu_host/build_bundle.py (the KT training toolchain)
#   build/gpu-host/inputs/                  gpu_host/make_inputs.py (tiny models + records)
#   build/gpu-host/serve-parts/serve.tar.xz.NN  gpu_host/build_serve_bundle.py (the SGLang serving toolchain)
#   build/gpu-host/serve-inputs/converted/NAME  a converted adapter from an earlier call (pack-adapter-NAME), used
#                                           by serve-NAME when this machine has not trained NAME itself
# GPUS=N trains on N GPUs (--set sft.gpus=N) into build/gpu-host/store-gpusN, results in build/gpu-host/results/gpusN.
# Outputs: build/gpu-host/store (runs, adapters, converted adapters), build/gpu-host/results
# (timings.jsonl, loss reports, key summaries); RESULTS_OUT=DIR also gets results.tar.gz.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO"
B=build/gpu-host
# GPUS=N (default 1): train with `--set sft.gpus=N` (the recipe's batch kept, each GPU an equal share), in a
# store and a results folder of their own (store-gpusN, results/gpusN), so 1- and N-GPU runs sit side by side
GPUS=${GPUS:-1}
TAG=""
[ "$GPUS" = 1 ] || TAG="-gpus$GPUS"
RES=$B/results${TAG:+/gpus$GPUS}
mkdir -p "$RES"
PY="$REPO/$B/bundle/bin/python"
export KTFLOW_SRC="$REPO" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

stamp() {  # stamp NAME START_EPOCH RC
  python3 -c 'import json,sys,time; print(json.dumps({"step":sys.argv[1],"seconds":round(time.time()-float(sys.argv[2]),1),"rc":int(sys.argv[3])}))' "$@" >>"$RES/timings.jsonl"
}
# NAME -> recipe and store: bf16, rawint4 (store build/gpu-host/store); bf16-resumed: the bf16 recipe in
# its own store (build/gpu-host/store-kill), killed mid-run and resumed.
recipe_of() { echo "gpu_host/tiny-kt-${1%-resumed}.yaml"; }
store_of() { case "$1" in *-resumed) echo "$B/store-kill$TAG" ;; *) echo "$B/store$TAG" ;; esac; }
run_dir() {  # the newest run directory of NAME
  { ls -td "$(store_of "$1")"/runs/tiny-kt-"${1%-resumed}"-* 2>/dev/null || true; } | { grep -v "\.lock$" || true; } | head -1
}
gpu_mem_watch() {  # peak GPU memory (MiB) of each GPU the step uses, comma-separated, while it runs
  ( peak=(); while sleep 0.5; do
      mapfile -t m < <(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -"$GPUS")
      for i in "${!m[@]}"; do [ "${m[$i]:-0}" -gt "${peak[$i]:-0}" ] && peak[$i]=${m[$i]}; done
      (IFS=,; echo "${peak[*]}") >"$RES/gpu_peak_$1.mib"; done ) &
  WATCH=$!
}

step_setup() {
  local t=$(date +%s)
  if [ ! -x "$PY" ] || ! cmp -s "$B/parts/bundle.sha256" "$B/bundle/.parts.sha256"; then
    rm -rf "$B/bundle"
    cat "$B"/parts/bundle.tar.gz.* | tee >(sha256sum | awk '{print $1"  bundle.tar.gz"}' >"$B/.got.sha256") | tar xz -C "$B"
    cmp -s "$B/.got.sha256" "$B/parts/bundle.sha256" || { echo "bundle parts corrupt"; exit 2; }
    cp "$B/parts/bundle.sha256" "$B/bundle/.parts.sha256"
  fi
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    grep -o -w 'amx_[a-z0-9]*' /proc/cpuinfo | sort -u | tr '\n' ' '; echo; nproc
    "$PY" -c 'import torch, transformers, peft, accelerate, llamafactory, kt_kernel; print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__, "accelerate", accelerate.__version__, "kt_kernel", kt_kernel.__version__)'
  } | tee "$RES/host.txt"
  stamp setup "$t" 0
}

sft_argv() { echo "-m ktflow.cli sft $(recipe_of "$1") --set store.root=../$(store_of "$1")${TAG:+ --set sft.gpus=$GPUS}"; }
sft() {  # sft NAME -> ktflow sft gpu_host/tiny-kt-NAME.yaml, as a user starts it
  # shellcheck disable=SC2046
  "$PY" $(sft_argv "$1") 2>&1 | tee -a "$RES/sft-$1.log"
  return "${PIPESTATUS[0]}"
}

step_train() {  # train NAME
  local t=$(date +%s) rc=0
  gpu_mem_watch "$1"
  sft "$1" || rc=$?
  kill "$WATCH" 2>/dev/null || true
  stamp "sft-$1" "$t" "$rc"
  return "$rc"
}

step_killresume() {  # killresume NAME: kill -9 the whole training mid-run, then rerun ktflow sft
  local name=$1-resumed t=$(date +%s) rc=0
  rm -rf "$(store_of "$name")"
  gpu_mem_watch "$name"
  # shellcheck disable=SC2046
  setsid "$PY" $(sft_argv "$name") >"$RES/sft-$name-killed.log" 2>&1 &
  local pid=$!
  local deadline=$(( $(date +%s) + 400 ))
  # wait for checkpoint-24 to be complete and a step past it logged, then kill mid-step
  until [ -n "$(run_dir "$name")" ] && [ -f "$(run_dir "$name")/output/checkpoint-24/trainer_state.json" ] \
        && grep -q '"current_steps": 2[6-9]' "$(run_dir "$name")/output/trainer_log.jsonl" 2>/dev/null; do
    sleep 0.5
    if ! kill -0 "$pid" 2>/dev/null; then echo "training ended before the kill point"; tail -30 "$RES/sft-$name-killed.log"; return 1; fi
    [ "$(date +%s)" -lt "$deadline" ] || { echo "kill point not reached"; kill -9 -- -"$pid"; return 1; }
  done
  kill -9 -- -"$pid"
  wait "$pid" 2>/dev/null || true
  local killed_at
  killed_at=$(tail -1 "$(run_dir "$name")/output/trainer_log.jsonl")
  echo "{\"killed_after\": $killed_at}" >"$RES/kill-$name.json"
  ls "$(run_dir "$name")/output" >>"$RES/kill-$name.json"
  ls -la "$(run_dir "$name")"/output/checkpoint-* >"$RES/kill-$name-checkpoints.txt" 2>&1 || true
  stamp "sft-$name-until-kill" "$t" 0
  t=$(date +%s)
  sft "$name" || rc=$?
  kill "$WATCH" 2>/dev/null || true
  stamp "sft-$name-resume" "$t" "$rc"
  return "$rc"
}

adapter_of() { echo "$(run_dir "$1")/adapter"; }
base_of() { python3 -c 'import sys,yaml; print("gpu_host/" + yaml.safe_load(open(sys.argv[1]))["source"]["local_path"])' "$(recipe_of "$1")"; }

step_convert() {  # convert NAME
  local name=$1 t=$(date +%s) rc=0 base
  base=$(base_of "$name")
  "$PY" gpu_host/kt_summary.py "$(adapter_of "$name")" >"$RES/kt-adapter-$name.txt" 2>&1 || true
  "$PY" -m ktflow.cli convert-lora "$(adapter_of "$name")" "$(store_of "$name")/converted/$name" --base "$base" \
      --serve-python "$PY" 2>&1 | tee "$RES/convert-$name.log" || rc=$?
  [ "$rc" = 0 ] && "$PY" gpu_host/kt_summary.py "$(store_of "$name")/converted/$name" >"$RES/converted-$name.txt" 2>&1 || true
  stamp "convert-$name" "$t" "$rc"
  return "$rc"
}

step_losscheck() {  # losscheck NAME
  local name=$1 t=$(date +%s) base
  base=$(base_of "$name")
  if [ "$name" = rawint4 ]; then  # the served base of a RAWINT4 run: ktflow's bit-exact BF16 of the INT4 source
    "$PY" -m ktflow.cli dequantize "$base" "$B/store/bf16-$name" 2>&1 | tail -3
    base="$B/store/bf16-$name"
  fi
  "$PY" gpu_host/loss_check.py tokens "$(run_dir "$name")" "$RES/tokens-$name.json"
  for v in ${LOSSCHECK_VARIANTS:-base full no-experts transposed}; do
    python3 gpu_host/loss_check.py loss "$base" "$(store_of "$name")/converted/$name" "$RES/tokens-$name.json" --variant "$v" \
        --json "$RES/loss-$name-$v.json" || echo "variant $v failed"
  done
  stamp "losscheck-$name" "$t" 0
}

step_collect() {
  local t=$(date +%s)
  for name in bf16 rawint4 bf16-resumed; do
    d=$(run_dir "$name"); [ -n "$d" ] || continue
    mkdir -p "$RES/run-$name"
    cp "$d"/output/trainer_log.jsonl "$d"/output/training_loss.png "$d"/train.yaml "$d"/accelerate.yaml "$RES/run-$name/" 2>/dev/null || true
    cp "$d"/adapter/manifest.json "$d"/adapter/*.json "$RES/run-$name/" 2>/dev/null || true
    tail -60 "$d/train.log" >"$RES/run-$name/train.log.tail" 2>/dev/null || true
    ls -la "$d" "$d/output" "$d/adapter" >"$RES/run-$name/listing.txt" 2>&1 || true
  done
  stamp collect "$t" 0
  if [ -n "${RESULTS_OUT:-}" ]; then tar czf "$RESULTS_OUT/results.tar.gz" -C "$B" results; fi
}

# --------------------------------------------------------------------------- serving (SGLang)
SERVE_PY="$REPO/$B/serve/bin/python"
# sglang's Marlin MoE kernel (the GPU experts' GEMM of INT4 models), built by its first call (serve-jit, serve-jit-bg)
MARLIN_BUILD='import torch; from sglang.jit_kernel.moe_wna16_marlin import _jit_moe_wna16_marlin_module as m; m(torch.bfloat16)'

serve_env() {  # what the serving steps' server needs in its environment
  export TVM_FFI_CACHE_DIR="$REPO/$B/tvm-ffi-cache"   # SGLang's jit_kernel builds (nvcc, first start only)
  # sglang-kt checks its kernel distribution at start; the bundle's sgl_kernel is upstream sglang-kernel 0.4.4
  # (gpu_host/build_serve_bundle.py), which that check does not know
  export SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1
  # sgl_kernel's sm90 ops link libcudart/libcublas/libnvrtc .so.13: the host torch's CUDA 13 libraries
  local nv
  nv=$(python3 -c 'import glob, os, site; print(":".join(sorted({os.path.dirname(p) for sp in site.getsitepackages() for p in glob.glob(os.path.join(sp, "nvidia", "**", "lib*.so*"), recursive=True)})))')
  export LD_LIBRARY_PATH="${nv}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  mkdir -p "$TVM_FFI_CACHE_DIR"
}

step_serve_setup() {
  local t=$(date +%s)
  if [ ! -x "$SERVE_PY" ] || ! cmp -s "$B/serve-parts/serve.sha256" "$B/serve/.parts.sha256"; then
    rm -rf "$B/serve"
    cat "$B"/serve-parts/serve.tar.xz.* | tee >(sha256sum | awk '{print $1"  serve.tar.xz"}' >"$B/.serve.got.sha256") \
      | python3 -c 'import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode="r|xz").extractall(sys.argv[1], filter="tar")' "$B"
    cmp -s "$B/.serve.got.sha256" "$B/serve-parts/serve.sha256" || { echo "serve parts corrupt"; exit 2; }
    cp "$B/serve-parts/serve.sha256" "$B/serve/.parts.sha256"
  fi
  serve_env
  local rc=0
  "$SERVE_PY" gpu_host/serve_check.py env "$RES/serve-env.json" || rc=$?
  stamp serve-setup "$t" "$rc"
}

converted_of() {  # the converted adapter of NAME: this machine's convert-NAME, else one carried from an earlier call
  if [ -d "$B/store/converted/$1" ]; then echo "$B/store/converted/$1"; else echo "$B/serve-inputs/converted/$1"; fi
}

recipe_base() {  # the source checkpoint a recipe names (its relative paths mean the recipe's folder)
  python3 -c 'import os, sys, yaml; p = sys.argv[1]; print(os.path.join(os.path.dirname(p), yaml.safe_load(open(p))["source"]["local_path"]))' "$1"
}

step_serve() {  # serve VIA NAME; SERVE_RECIPE / SERVE_MODEL / SERVE_KT_WEIGHTS / SERVE_ADAPTER / SERVE_RECORDS /
                # SERVE_TOKENS / SERVE_SET override the defaults (the tiny-sglang-NAME recipe, its source, ...)
                # VIA cli: `ktflow serve RECIPE` finds, converts (and for AMXINT8 quantizes) everything itself in
                # the recipe's store; the paths below then only say where the queries read the tokenizer from
  local via=$1 name=$2 t=$(date +%s) rc=0 base src recipe kt
  recipe=${SERVE_RECIPE:-gpu_host/tiny-sglang-${name}.yaml}
  src=${SERVE_MODEL:-$(recipe_base "$recipe")}
  # the GPU side: the source checkpoint (ktflow's serve stage gives sglang-kt a view of it where sglang-kt cannot
  # load it as it is: the DeepSeek-V3 config fields a transformers-saved config lacks, the language model of a
  # Kimi-K2.5 checkpoint with a vision stand-in); the KT CPU experts: the source checkpoint itself (RAWINT4 reads
  # the Kimi INT4 tensors natively, BF16/AMXBF16 its BF16 experts), or SERVE_KT_WEIGHTS (AMXINT8: quantize-int8's
  # output, whose .kt layout the serve stage writes when the adapter carries an expert LoRA)
  base=$src
  kt=${SERVE_KT_WEIGHTS:-$src}
  local tokens=${SERVE_TOKENS:-}  # the training tokenization (losscheck-NAME's, or carried): the served loss too
  [ -z "$tokens" ] && [ -f "$RES/tokens-$name.json" ] && tokens="$RES/tokens-$name.json"
  [ -z "$tokens" ] && [ -f "$B/serve-inputs/tokens-$name.json" ] && tokens="$B/serve-inputs/tokens-$name.json"
  serve_env
  local sets=() s
  for s in ${SERVE_SET:-}; do sets+=(--set "$s"); done
  "$SERVE_PY" gpu_host/serve_check.py run --via "$via" --recipe "$recipe" --model "$base" --kt-weights "$kt" \
      --adapter "${SERVE_ADAPTER:-$(converted_of "$name")}" --records "${SERVE_RECORDS:-$B/inputs/data/train.jsonl}" \
      --out "$RES/serve-$via-$name" ${tokens:+--tokens "$tokens"} "${sets[@]}" 2>&1 | tee "$RES/serve-$via-$name.log" || rc=$?
  stamp "serve-$via-$name" "$t" "$rc"
  return "$rc"
}

step_promotion() {  # promotion NAME: serve_check.py promotion on tiny-sglang-NAME (SERVE_RECIPE / SERVE_SET /
                    # SERVE_RECORDS / SERVE_TOKENS as for serve-NAME): the trained run of this machine's store as v1,
                    # v1 without its expert LoRA as v2; promote, base server, judge v2 beside, promote v2, rollback
  local name=$1 t=$(date +%s) rc=0 recipe tokens
  recipe=${SERVE_RECIPE:-gpu_host/tiny-sglang-${name}.yaml}
  tokens=${SERVE_TOKENS:-$RES/tokens-$name.json}
  serve_env
  local sets=() s
  for s in ${SERVE_SET:-}; do sets+=(--set "$s"); done
  "$SERVE_PY" gpu_host/serve_check.py promotion --recipe "$recipe" --records "${SERVE_RECORDS:-$B/inputs/data/train.jsonl}" \
      --tokens "$tokens" --out "$RES/promotion-$name" "${sets[@]}" 2>&1 | tee "$RES/promotion-$name.log" || rc=$?
  stamp "promotion-$name" "$t" "$rc"
  return "$rc"
}

step_int8() {  # int8 NAME: ktflow quantize-int8 of NAME's BF16 base (T = INT8_T, default 1) into $B/store/int8/NAME
  # (serve-NAME with SERVE_KT_WEIGHTS=$B/store/int8/NAME: the serve stage writes the .kt layout itself;
  # serve-cli-NAME with serving.kt_method=AMXINT8 runs quantize-int8 itself, where the recipe's store keeps it)
  local name=$1 t=$(date +%s) rc=0 base out=$B/store/int8/$1
  base=$(base_of "$name")
  local py=${INT8_PY:-$PY}  # any python with kt-kernel + ktflow's deps: the KT bundle's, or the serving bundle's
  "$py" -m ktflow.cli quantize-int8 "$base" "$out" --threadpool-count "${INT8_T:-1}" --serve-python "$py" 2>&1 \
      | tee "$RES/quantize-int8-$name.log" || rc=$?
  [ "$rc" = 0 ] && { cp "$out/manifest.json" "$RES/int8-manifest-$name.json" 2>/dev/null || true; }
  stamp "int8-$name" "$t" "$rc"
  return "$rc"
}

step_pack_adapter() {  # pack-adapter NAME: the converted adapter, for a later call's serve-NAME
  local out=${RESULTS_OUT:-$RES}
  tar czf "$out/converted-$1.tar.gz" -C "$B/store" "converted/$1"
  ls -la "$out/converted-$1.tar.gz"
}

big() {  # big PHASE [ARGS...]: gpu_host/big.py; its results go to build/gpu-host/big*/results
  local t=$(date +%s) rc=0
  "$PY" gpu_host/big.py "$@" || rc=$?
  stamp "big $*" "$t" "$rc"
  return "$rc"
}

step_big_reduced() {  # the bigger-than-gpu code path at reduced size: streamed fixture, 4 KT RAWINT4 steps, convert
  rm -rf build/gpu-host/big-reduced
  big fixture --size reduced && big sft --size reduced && big convert --size reduced
}

kslice() {  # kslice PHASE N [ARGS...]: gpu_host/kimi_slice.py PHASE --moe-layers N
  local t=$(date +%s) rc=0 phase=$1 n=$2
  shift 2
  "$PY" gpu_host/kimi_slice.py "$phase" --moe-layers "$n" "$@" || rc=$?
  stamp "slice $phase $n $*" "$t" "$rc"
  return "$rc"
}

merged() {  # merged PHASE [ARGS...]: gpu_host/merged_serving.py (its servers in the serving toolchain)
  local t=$(date +%s) rc=0
  "$PY" gpu_host/merged_serving.py "$@" --serve-python "$SERVE_PY" || rc=$?
  stamp "merged $*" "$t" "$rc"
  return "$rc"
}

steps=("$@")
[ "${steps[0]:-}" = all ] && steps=(setup bf16 convert-bf16 losscheck-bf16 rawint4 convert-rawint4 losscheck-rawint4
                                     killresume-bf16 convert-bf16-resumed losscheck-bf16-resumed collect)
status=0
for s in "${steps[@]}"; do
  echo "=== $s"
  case "$s" in
    setup) step_setup ;;
    # before the NAME patterns below: convert-big is not step_convert's "big"
    fixture-big) big fixture || status=1 ;;
    sft-big) big sft --gpus "$GPUS" ${THREADS:+--threads "$THREADS"} || status=1 ;;
    serve-prep-big) big serve-prep ${METHODS:+--methods "$METHODS"} || status=1 ;;
    serve-big) serve_env; big serve --serve-python "$SERVE_PY" ${METHODS:+--methods "$METHODS"} || status=1 ;;
    hf-big) big hf || status=1 ;;
    convert-big) big convert || status=1 ;;
    kill-big) big kill || status=1 ;;
    resume-big) big resume || status=1 ;;
    report-big) big report ;;
    big-reduced) step_big_reduced || status=1 ;;
    probe) t=$(date +%s); rc=0; "$PY" gpu_host/probe.py ${THREADS:+--threads "$THREADS"} ${PROBE_METHODS:+--methods "$PROBE_METHODS"} --out "$RES" || rc=$?
           stamp probe "$t" "$rc"; [ "$rc" = 0 ] || status=1 ;;
    probe-sweep) t=$(date +%s); rc=0
                 "$PY" gpu_host/probe_sweep.py --python "$PY" ${THREADS:+--threads "$THREADS"} ${POINTS:+--points "$POINTS"} || rc=$?
                 stamp probe-sweep "$t" "$rc"; [ "$rc" = 0 ] || status=1 ;;
    slice-fixture-*) kslice fixture "${s#slice-fixture-}" || status=1 ;;
    slice-sft-*) written=(); [ "${AS_WRITTEN:-0}" = 1 ] && written=(--as-written)
                 kslice sft "${s#slice-sft-}" --gpus "$GPUS" ${THREADS:+--threads "$THREADS"} "${written[@]}" || status=1 ;;
    slice-whole) kslice whole 6 || status=1 ;;
    slice-convert-*) kslice convert "${s#slice-convert-}" || status=1 ;;
    slice-serve-prep-*) kslice serve-prep "${s#slice-serve-prep-}" || status=1 ;;
    slice-serve-*) serve_env; kslice serve "${s#slice-serve-}" --serve-python "$SERVE_PY" || status=1 ;;
    slice-clean-*) kslice clean "${s#slice-clean-}" ;;
    pack-slice) tar czf "${RESULTS_OUT:-$RES}/slice-results.tar.gz" -C "$B/slice" --exclude='*/model' --exclude='store*' \
                  --exclude='*/converted' --exclude=data/chat.jsonl . && ls -la "${RESULTS_OUT:-$RES}/slice-results.tar.gz" ;;
    merged-fixture) merged fixture ${MOE_LAYERS:+--moe-layers "$MOE_LAYERS"} || status=1 ;;
    merged-adapter) merged adapter ${RANDOM_ADAPTER:+--random} || status=1 ;;
    merged-merge) merged merge ${METHOD:+--method "$METHOD"} || status=1 ;;
    merged-levers-*) serve_env; merged levers --group "${s#merged-levers-}" ${LEVERS:+--levers "$LEVERS"} || status=1 ;;
    merged-load) serve_env; merged load ${ONLY:+--only "$ONLY"} || status=1 ;;
    merged-alternate) serve_env; merged alternate ${STARTS:+--starts "$STARTS"} ${FIRST:+--first "$FIRST"} || status=1 ;;
    merged-check-*) serve_env; merged check --name "${s#merged-check-}" ${ONLY:+--only "$ONLY"} || status=1 ;;
    merged-report) merged report || status=1 ;;
    merged-clean) merged clean ;;
    pack-merged) tar czf "${RESULTS_OUT:-$RES}/merged-results.tar.gz" -C "$B/merged" results \
                   && ls -la "${RESULTS_OUT:-$RES}/merged-results.tar.gz" ;;
    serve-setup) step_serve_setup || status=1 ;;
    # sglang's Marlin MoE kernel (GPU experts of INT4 models) compiled once into TVM_FFI_CACHE_DIR: minutes of nvcc
    serve-jit) serve_env; t=$(date +%s); rc=0
               "$SERVE_PY" -c "$MARLIN_BUILD" || rc=$?
               stamp serve-jit "$t" "$rc"; [ "$rc" = 0 ] || status=1 ;;
    # the same in the background (one nvcc process: a core), beside the steps after it; serve-jit-wait waits for it
    serve-jit-bg) serve_env
                  setsid nohup "$SERVE_PY" -c "$MARLIN_BUILD" > "$RES/serve-jit.log" 2>&1 < /dev/null & echo $! > "$B/serve-jit.pid" ;;
    serve-jit-wait) t=$(date +%s)
                    while [ -f "$B/serve-jit.pid" ] && kill -0 "$(cat "$B/serve-jit.pid")" 2>/dev/null; do sleep 5; done
                    stamp serve-jit-wait "$t" 0; tail -3 "$RES/serve-jit.log" 2>/dev/null ;;
    serve-cli-*) step_serve cli "${s#serve-cli-}" || status=1 ;;
    promotion-*) step_promotion "${s#promotion-}" || status=1 ;;
    serve-*) step_serve stage "${s#serve-}" || status=1 ;;
    pack-adapter-*) step_pack_adapter "${s#pack-adapter-}" || status=1 ;;
    int8-*) step_int8 "${s#int8-}" || status=1 ;;
    bf16|rawint4|bf16-resumed) step_train "$s" || status=1 ;;
    killresume-*) step_killresume "${s#killresume-}" || status=1 ;;
    convert-*) step_convert "${s#convert-}" || status=1 ;;
    losscheck-*) step_losscheck "${s#losscheck-}" || status=1 ;;
    collect) step_collect ;;
    pack-big) tar czf "${RESULTS_OUT:-$RES}/big-results.tar.gz" -C "$B/big" results && ls -la "${RESULTS_OUT:-$RES}/big-results.tar.gz" ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac
done
exit $status
