#!/usr/bin/env bash
# On a GPU host, from the root of the checkout: the engine profile and the simulator's fidelity
# check on CUDA (docs/simulator.md, "Fidelity").
#
#   RATES=100,100 POLICIES=least_request,predicted_latency,round_robin \
#     bash bench/gpu/kit/run_fidelity.sh OUTDIR
#
# 1. installs the vLLM kit and extras (host_env.sh, once per host);
# 2. `gpumesh calibrate --platform cuda` on one 0.5B engine at the validate run's engine
#    settings -> OUTDIR/profile-0.5b.toml;
# 3. `gpumesh sim validate` with two 0.5B engines sharing GPU 0 (gpu_memory_utilization 0.4
#    each), the shared-prefix and unique workloads, REQUESTS per run (default 2000) at RATES
#    (req/s per workload), the simulator on the calibrated profile -> OUTDIR/validate.{json,md}.
# CALIBRATE=0 skips step 2 (the simulator then fits a step model on the live engines first).
# Takes about 6-9 minutes on a fresh H100/H200 host (engine starts compile CUDA graphs).
set -uo pipefail
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
OUTDIR=${1:?usage: run_fidelity.sh OUTDIR}
ENGINE=vllm SITE=${SITE:-/tmp/site} W=${RESULTS_DIR:-$PWD/bench-results/gpu}
mkdir -p "$W/logs" "$OUTDIR"
source bench/gpu/kit/host_env.sh || exit 1
M=$MODELS/qwen-0.5b-dummy
ENGINE_ARGS=(--engine-arg load_format=dummy --engine-arg "tokenizer=$M/tokenizer"
             --engine-arg dtype=bfloat16 --engine-arg gpu_memory_utilization=0.4
             --engine-arg max_num_seqs=256 --engine-arg max_num_batched_tokens=8192)
PROFILE_ARGS=()
if [ "${CALIBRATE:-1}" = 1 ]; then
  echo "== calibrate ($(elapsed)s)"
  timeout -k 10 ${CALIBRATE_TIMEOUT:-240} python3 -m gpumesh.cli calibrate --platform cuda \
    --model "$M" --tokenizer "$M/tokenizer" --load-format dummy --dtype bfloat16 \
    --gpu-memory-utilization 0.4 --max-model-len 4096 --served-name m \
    --engine-arg max_num_seqs=256 --engine-arg max_num_batched_tokens=8192 \
    --batches 1,8,16,32,64,128,256 --held-out-batch 16 --prompts 128,512,1024,2048,3072 \
    --held-out-prompt 512 --contexts 64x1024,16x3072,32x512 --held-out-context 32x512 \
    --name cuda-0.5b --out "$OUTDIR/profile-0.5b.toml" > "$OUTDIR/calibrate.log" 2>&1
  echo "calibrate rc=$?"; tail -25 "$OUTDIR/calibrate.log"
  [ -s "$OUTDIR/profile-0.5b.toml" ] && PROFILE_ARGS=(--profile "$OUTDIR/profile-0.5b.toml")
fi
echo "== validate ($(elapsed)s)"
timeout -k 10 ${VALIDATE_TIMEOUT:-420} python3 -c "import sys; from gpumesh_bench.sim.cli import main; sys.exit(main(sys.argv[1:]))" validate --model "$M" --cores '' \
  "${ENGINE_ARGS[@]}" --max-model-len 4096 \
  --policies "${POLICIES:-least_request,predicted_latency,round_robin}" \
  --requests "${REQUESTS:-2000}" --rate "${RATES:-100,100}" "${PROFILE_ARGS[@]}" \
  --out "$OUTDIR" > "$OUTDIR/validate.log" 2>&1
echo "validate rc=$? ($(elapsed)s)"; tail -40 "$OUTDIR/validate.log"
[ -f "$OUTDIR/validate.md" ] && cat "$OUTDIR/validate.md"
