#!/usr/bin/env bash
# On the GPU host, from the root of the checkout: the GPU measurement of the mesh.
#
#   bash bench/gpu/kit/run_mesh_gpu.sh [PHASES]        PHASES: comma list, default all
#     raw,raw7,rawdp05,eng05,eng7,p05,p05q,share,unequal,unequal2,tp05,p7,tp7,ab05,ab7,dp05,dp7,
#     msg05,msg7,fe05,fe7,vsraw05,vsraw7,doors05,doors7,uneq05,prefix05,prefix7
#     (see bench/gpu/__init__.py; eng05/eng7: the node's engine in a closed loop without gRPC;
#     msg05/msg7: the node's stream-message budget on and off on the same nodes; fe05/fe7: one
#     front-end process per node against several; vsraw05/vsraw7: the node and raw vLLM on the
#     same GPU, interleaved rounds)
#
# Steps:
# 1. ENGINE=vllm (the default): installs the vLLM kit (.gpukit/one, built by prepare_kit.sh and
#    slim_kit.sh) and the extras (.gpukit/extra, pack_extra.sh) into SITE (default /tmp/site),
#    each once per host (an installed kit is recognised by its checksum and skipped);
# 2. runs the GPU test module tests/gpu (pytest -m gpu) unless GPU_TEST=0;
# 3. runs `python -m gpumesh_bench.gpu run --phases PHASES` (routers with --workers, load from
#    gpumesh bench's multi-process generator) with BENCH_ARGS appended;
# 4. results land in RESULTS_DIR/res (default bench-results/gpu/res in the checkout, git-ignored):
#    results.json (every record; a later run adds its phases to the same file), summary.md,
#    plots.png; logs in RESULTS_DIR/logs. OUT=DIR also copies them there, with logs.tgz.
#
# How long: each phase starts its own engines (a 0.5B node is up in about a minute, a 7B one in
# about two; vLLM's compile cache makes later starts on the same host faster) and runs its
# rounds (20-75 s each); the default phases take up to about 20 minutes (the rough worst case of
# each phase: `need` in gpumesh_bench.gpu.cli). BUDGET=SECONDS bounds the run: a phase or round
# that would not fit in what is left is skipped, and said so in the results.
# RAW_TOOL (default .gpukit/tools/seed_table.py): a script that runs raw vLLM in a closed loop,
# the reference of the raw* and vsraw* phases (gpumesh_bench.gpu.reference: its arguments);
# without it those phases are skipped.
#
# Copy the checkout with its .gpukit/ folder (one, tools, extra; doors and smg for the
# front-door phases) to the GPU host, e.g. `rsync -a --exclude .venv ./ HOST:gpumesh/`, and run
#   ssh HOST 'cd gpumesh && bash bench/gpu/kit/run_mesh_gpu.sh raw,p05 2>&1 | tee log'
# ENGINE=sim runs the same phases on CPU with simulated nodes (no kit, no GPU) as a dry run:
#   ENGINE=sim GPU_TEST=0 bash bench/gpu/kit/run_mesh_gpu.sh p05,share
set -uo pipefail
T0=$(date +%s)
OUT=${OUT:-}                          # optional: a folder to copy the results and logs into
ENGINE=${ENGINE:-vllm}
GPU_TEST=${GPU_TEST:-1}
BUDGET=${BUDGET:-0}                   # seconds for this whole script; 0 = no bound
PHASES=${1:-raw,p05,share,unequal,tp05,p7,tp7}
SITE=${SITE:-/tmp/site}               # where the kit is installed on this host
W=${RESULTS_DIR:-$PWD/bench-results/gpu}   # results of every run, appended
mkdir -p "$W/logs"
elapsed() { echo $(( $(date +%s) - T0 )); }

source bench/gpu/kit/host_env.sh || exit 1

if [ "$GPU_TEST" = 1 ]; then
  echo "== tests/gpu ($(elapsed)s)"
  GPUMESH_GPU_ARTIFACTS=$W GPUMESH_TEST_LOGS=$W/logs/pytest-procs \
    timeout -k 10 300 python3 -m pytest -m gpu tests/gpu -q -x -p no:cacheprovider -o addopts="" \
    > "$W/logs/pytest.log" 2>&1
  rc=$?
  tail -15 "$W/logs/pytest.log"
  echo "== tests/gpu rc=$rc"
  [ "$ENGINE" = vllm ] && for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
fi

if [ "$BUDGET" -gt 0 ]; then
  left=$(( BUDGET - $(elapsed) - 15 )); left=$(( left > 30 ? left : 30 ))
  budget_args=(--budget "$left"); limit=(timeout -k 10 "$left"); bound="${left}s left"
else
  budget_args=(); limit=(); bound="no time bound"
fi
echo "== bench phases $PHASES ($(elapsed)s, $bound)"
RAW_TOOL=${RAW_TOOL:-.gpukit/tools/seed_table.py}   # the raw-vLLM reference (raw* and vsraw* phases)
[ -f "$RAW_TOOL" ] || RAW_TOOL=""
"${limit[@]}" python3 -m gpumesh_bench.gpu run --phases "$PHASES" \
  --engine "$ENGINE" --out "$W/res" --model-root $MODELS --raw-tool "$RAW_TOOL" "${budget_args[@]}" \
  ${BENCH_ARGS:-}
echo "== bench rc=$? ($(elapsed)s)"

if [ -n "$OUT" ]; then
  mkdir -p "$OUT"
  cp "$W/res/results.json" "$W/res/summary.md" "$OUT/" 2>/dev/null
  cp "$W/res/plots.png" "$OUT/" 2>/dev/null
  cp "$W/gpu_status_under_load.txt" "$OUT/" 2>/dev/null
  tar -czf "$OUT/logs.tgz" -C "$W" logs res/logs 2>/dev/null
  ls -la "$OUT"
fi
echo "== done ($(elapsed)s): results in $W/res"
