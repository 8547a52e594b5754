#!/usr/bin/env bash
# On a GPU host, from the root of the checkout: disaggregated prefill/decode on CUDA. Two vLLM
# engines share GPU 0 (gpu_memory_utilization 0.4 each), a prefill engine and a decode engine
# with the node roles' NixlConnector; `gpumesh bench kv-transfer` measures what the hand-over
# costs per prompt token and checks that a disaggregated greedy answer equals the aggregated
# one token for token.
#
#   bash bench/gpu/kit/run_pd.sh OUTDIR [SHAPES]      SHAPES: 0.5b,7b (default 0.5b)
#
# Needs the vLLM kit (host_env.sh) and NIXL for CUDA 13, packed by pack_nixl.sh into
# .gpukit/nixl/nixl.tar.xz (unpacked into SITE once per host). About 2-3 minutes per shape on
# a fresh host.
set -uo pipefail
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
OUTDIR=${1:?usage: run_pd.sh OUTDIR [SHAPES]}
SHAPES=${2:-0.5b}
ENGINE=vllm SITE=${SITE:-/tmp/site} W=${RESULTS_DIR:-$PWD/bench-results/gpu}
mkdir -p "$W/logs" "$OUTDIR"
source bench/gpu/kit/host_env.sh || exit 1
pack=.gpukit/nixl/nixl.tar.xz
if [ -f "$pack" ]; then
  sum=$(sha256sum "$pack" | cut -c1-16)
  grep -qx "nixl $sum" "$SITE/.kit-installed" || { tar -C "$SITE" -xJf "$pack" \
    && echo "nixl $sum" >> "$SITE/.kit-installed"; }
fi
python3 -c "import nixl; from nixl._api import nixl_agent; print('nixl importable')" || exit 1
rc=0
for shape in ${SHAPES//,/ }; do
  echo "== kv-transfer $shape ($(elapsed)s)"
  timeout -k 10 ${PD_TIMEOUT:-300} python3 -m gpumesh_bench.overhead.kv_transfer \
    --model "$MODELS/qwen-$shape-dummy" --dummy --lengths ${LENGTHS:-128,512,1024,2048,4000} \
    --trials ${TRIALS:-5} --vocab 150000 --identical ${IDENTICAL:-32} \
    --out "$OUTDIR/transfer-cuda-$shape.json" > "$OUTDIR/kv-transfer-$shape.log" 2>&1
  r=$?; [ $r -ne 0 ] && rc=$r
  grep -E "tokens|Error|error" "$OUTDIR/kv-transfer-$shape.log" | grep -v INFO | tail -20
  echo "kv-transfer $shape rc=$r"
done
exit $rc
