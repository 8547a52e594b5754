#!/usr/bin/env bash
# On the build machine (network access): NIXL for a CUDA 13 GPU host, for the disaggregated
# prefill/decode phases (run_pd.sh): the nixl and nixl-cu13 wheels (the version the cpu/gpu
# extras pin) without the expert-parallel kernels and the examples vLLM's NixlConnector does
# not use -> .gpukit/nixl/nixl.tar.xz (~17 MB, git-ignored).
set -euo pipefail
ROOT=$(git rev-parse --show-toplevel)
cd "$ROOT"
V=${NIXL_VERSION:-1.5.1}
B=.gpukit/build-nixl
rm -rf $B && mkdir -p $B/site .gpukit/cache/nixl .gpukit/nixl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d .gpukit/cache/nixl "nixl==$V" "nixl-cu13==$V" 2>&1 \
  | grep -v "^WARNING" || true
for w in .gpukit/cache/nixl/nixl-$V-*.whl .gpukit/cache/nixl/nixl_cu13-$V-*.whl; do
  unzip -q -o "$w" -d $B/site; done
rm -rf $B/site/nixl_ep* $B/site/nixl_cu13-*.data $B/site/nixl_cu13.scripts \
  $B/site/nixl_cu13.libs/ucx/libucx_perftest*
tar -C $B/site --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -cf - . \
  | xz -6 -T0 > .gpukit/nixl/nixl.tar.xz
ls -l .gpukit/nixl
