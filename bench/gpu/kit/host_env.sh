#!/usr/bin/env bash
# Sourced by the GPU-host scripts (run_mesh_gpu.sh, run_fidelity.sh, run_pd.sh) from the root of
# the checkout: installs the vLLM kit and the extras once per host, exports the environment
# vLLM and gpumesh need there, and builds the dummy model folders. Expects SITE, ENGINE, W and
# an `elapsed` function from the caller.
# PYTHONSAFEPATH: `python -m` would put the checkout first on sys.path, where gpumesh/ has no
# router/ or node/ (they live beside it); the link tree below must win.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONSAFEPATH=1
# The packages as an install maps them (setup.py, bench/pyproject.toml), without pip: gpumesh
# with router/ and node/ as gpumesh.router and gpumesh.node, bench/ as gpumesh_bench. Links
# only, so module files still resolve into this checkout.
PY=$W/py
rm -rf "$PY" && mkdir -p "$PY/gpumesh"
for f in "$PWD"/gpumesh/*; do ln -s "$f" "$PY/gpumesh/"; done
ln -s "$PWD/router" "$PY/gpumesh/router" && ln -s "$PWD/node" "$PY/gpumesh/node" \
  && ln -s "$PWD/bench" "$PY/gpumesh_bench" || exit 1
if [ "$ENGINE" = vllm ]; then
  echo "== install ($(elapsed)s)"
  SITE=$SITE bash .gpukit/tools/kit_install.sh .gpukit/one > "$W/logs/install.log" 2>&1 \
    || { echo "KIT INSTALL FAILED"; cat "$W/logs/install.log"; exit 1; }
  if [ -f .gpukit/extra/extra.tar.xz ]; then
    sum=$(sha256sum .gpukit/extra/extra.tar.xz | cut -c1-16)
    if ! grep -qx "extra $sum" "$SITE/.kit-installed"; then
      tar -C "$SITE" -xJf .gpukit/extra/extra.tar.xz || { echo "EXTRA INSTALL FAILED"; exit 1; }
      echo "extra $sum" >> "$SITE/.kit-installed"
    fi
  elif ! grep -q '^extra ' "$SITE/.kit-installed"; then
    echo "NO EXTRAS: no .gpukit/extra and none installed in $SITE (bench/gpu/kit/pack_extra.sh)"; exit 1
  fi
  tail -3 "$W/logs/install.log"
  # vLLM 0.26 imports flashinfer for its sampler unless told not to (the kit leaves it out);
  # NVLink multicast off (NCCL's NVLS, torch's symmetric memory, NVSHMEM): the data-parallel
  # phases run independent engines, which need no collective across GPUs.
  export PYTHONPATH=$SITE:$PY:$PWD VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 NCCL_NVLS_ENABLE=0 \
    TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv,noheader
  # the host's CPUs (physical cores, sockets, NUMA) and which are local to each GPU (--pin)
  lscpu | grep -E '^(CPU\(s\)|Thread|Core|Socket|NUMA|Model name)' ; nvidia-smi topo -m | head -6
  for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do
    echo "leftover GPU process $p: killing it"; kill -9 "$p" 2>/dev/null; done
else
  export PYTHONPATH=$PY:$PWD
fi
python3 -c "import sys, grpc, google.protobuf as pb; print('python', sys.version.split()[0], 'grpcio', grpc.__version__, 'protobuf', pb.__version__)" || exit 1
[ "$ENGINE" = vllm ] && { python3 -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, 'gpus', torch.cuda.device_count())" || exit 1; }

# One model folder per shape for the test and every node: vLLM keys its compile cache on the
# model path, so later engine starts on this machine skip torch.compile.
MODELS=/tmp/gpumesh-models
python3 -m gpumesh_bench.gpu.dummy_model $MODELS/qwen-0.5b-dummy 0.5b && python3 -m gpumesh_bench.gpu.dummy_model $MODELS/qwen-7b-dummy 7b || exit 1
export GPUMESH_GPU_MODEL=$MODELS/qwen-0.5b-dummy

