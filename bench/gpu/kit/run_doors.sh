#!/usr/bin/env bash
# Device side: the front-door phases in one `run` call (from the repo root).
#
#   bash bench/gpu/kit/run_doors.sh PHASES        e.g. doors05 | doors7 | uneq05,doors05
#
# 1. the vLLM kit: installed from .gpukit/one when carried, else it must already be in /tmp/site
#    (a machine still warm from a call that carried it: the kit and SMG do not fit one call);
# 2. .gpukit/doors (vllm serve's deps, nginx) and, when carried, .gpukit/smg (SMG) unpacked over
#    /tmp/site (bench/gpu/kit/pack_doors.sh builds both);
# 3. bench/gpu/kit/run_mesh_gpu.sh PHASES with GPU_TEST=0 (the GPU test module is not run) and
#    BENCH_ARGS (e.g. "--rounds 3 --warmup 3 --seconds 8"); results accumulate in
#    /tmp/gpumesh-gpu/res while the machine stays warm, and each call copies them to $OUT.
#
#   run(command="set -o pipefail; BENCH_ARGS='--rounds 3' bash bench/gpu/kit/run_doors.sh doors05 2>&1 | tee $OUT/log",
#       carry=[".gpukit/smg", ".gpukit/doors", ".gpukit/extra"], kind="nvidia-h200", timeout_s=600)
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
