#!/usr/bin/env bash
# On the GPU host: the front-door and cache-aware phases in one invocation (from the repo root).
#
#   BENCH_ARGS='--rounds 4 --warmup 4 --seconds 10' bash bench/gpu/kit/run_doors.sh PHASES
#       PHASES e.g. doors05 | doors7 | uneq05 | prefix05 | prefix7 | prefix05,prefix7
#
# 1. the vLLM kit: installed from .gpukit/one when present, else it must already be in
#    /tmp/site (an earlier run on this host installed it; /tmp/site/.kit-installed says so);
# 2. .gpukit/doors (vllm serve's deps, nginx) and .gpukit/smg (SMG), when present, unpacked over
#    /tmp/site (bench/gpu/kit/pack_doors.sh builds both; each is skipped when installed);
# 3. bench/gpu/kit/run_mesh_gpu.sh PHASES with GPU_TEST=0 (the GPU test module is not run) and
#    BENCH_ARGS; results accumulate in /tmp/gpumesh-gpu/res across runs on the host, and each
#    run copies them to $OUT (default /tmp/gpumesh-out).
set -uo pipefail
if [ ! -d .gpukit/one ] && ! grep -q '^site ' /tmp/site/.kit-installed 2>/dev/null; then
  echo "NO KIT: .gpukit/one not carried and /tmp/site has none (the machine was not warm)"; exit 3
fi
mkdir -p /tmp/site
touch /tmp/site/.kit-installed
for pack in .gpukit/doors/doors.tar.xz .gpukit/smg/smg.tar.xz; do
  [ -f "$pack" ] || { echo "pack $pack not carried"; continue; }
  sum=$(sha256sum "$pack" | cut -c1-16)
  if grep -qx "pack $sum" /tmp/site/.kit-installed; then echo "pack $pack already in /tmp/site"
  else tar -C /tmp/site -xJf "$pack" && echo "pack $sum" >> /tmp/site/.kit-installed \
    && echo "pack $pack unpacked"; fi
done
export GPUMESH_NGINX=/tmp/site/.ngx/usr/sbin/nginx
LD_LIBRARY_PATH=/tmp/site/.ngx/usr/lib/x86_64-linux-gnu $GPUMESH_NGINX -v 2>&1 | head -1
PYTHONPATH=/tmp/site python3 -c "import smg.smg_rs; print('smg importable')" 2>&1 | tail -1
GPU_TEST=0 exec bash bench/gpu/kit/run_mesh_gpu.sh "$@"
