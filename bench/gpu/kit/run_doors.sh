#!/usr/bin/env bash
# On the GPU host, from the root of the checkout: the front-door and cache-aware phases.
#
#   BENCH_ARGS='--rounds 4 --warmup 4 --seconds 10' bash bench/gpu/kit/run_doors.sh PHASES
#       PHASES e.g. doors05 | doors7 | uneq05 | prefix05 | prefix7 | prefix05,prefix7
#
# 1. the vLLM kit: installed from .gpukit/one, or already installed in SITE (default /tmp/site)
#    by an earlier run on this host (SITE/.kit-installed lists what is there);
# 2. .gpukit/doors (vllm serve's deps, nginx) and .gpukit/smg (SMG), when present, unpacked into
#    SITE (bench/gpu/kit/pack_doors.sh builds both; each is skipped when already installed);
# 3. bench/gpu/kit/run_mesh_gpu.sh PHASES with GPU_TEST=0 (the GPU test module is not run) and
#    BENCH_ARGS: results land where that script says (bench-results/gpu/res by default).
set -uo pipefail
SITE=${SITE:-/tmp/site}
export SITE
if [ ! -d .gpukit/one ] && ! grep -q '^site ' "$SITE/.kit-installed" 2>/dev/null; then
  echo "NO KIT: no .gpukit/one in the checkout and none installed in $SITE (bench/gpu/kit/prepare_kit.sh)"; exit 3
fi
mkdir -p "$SITE"
touch "$SITE/.kit-installed"
for pack in .gpukit/doors/doors.tar.xz .gpukit/smg/smg.tar.xz; do
  [ -f "$pack" ] || { echo "pack $pack absent (bench/gpu/kit/pack_doors.sh)"; continue; }
  sum=$(sha256sum "$pack" | cut -c1-16)
  if grep -qx "pack $sum" "$SITE/.kit-installed"; then echo "pack $pack already in $SITE"
  else tar -C "$SITE" -xJf "$pack" && echo "pack $sum" >> "$SITE/.kit-installed" \
    && echo "pack $pack unpacked"; fi
done
export GPUMESH_NGINX=$SITE/.ngx/usr/sbin/nginx
LD_LIBRARY_PATH=$SITE/.ngx/usr/lib/x86_64-linux-gnu $GPUMESH_NGINX -v 2>&1 | head -1
PYTHONPATH=$SITE python3 -c "import smg.smg_rs; print('smg importable')" 2>&1 | tail -1
GPU_TEST=0 exec bash bench/gpu/kit/run_mesh_gpu.sh "$@"
