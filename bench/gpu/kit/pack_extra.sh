#!/usr/bin/env bash
# On the build machine (network access): pack the wheels of bench/gpu/kit/gpu-extra.txt for the
# GPU host into .gpukit/extra/extra.tar.xz (git-ignored; ~5 MiB, grpcio's cygrpc is most of it).
#
# Packed apart from the vLLM kit (prepare_kit.sh's EXTRA_REQ would rebuild the kit): the kit
# stays as built and this pack is rebuilt in seconds. bench/gpu/kit/run_mesh_gpu.sh unpacks it
# into the kit's folder after the kit.
#   bash bench/gpu/kit/pack_extra.sh     then copy .gpukit/one .gpukit/tools .gpukit/extra with
#                                        the checkout
set -euo pipefail
ROOT=$(git rev-parse --show-toplevel)
cd "$ROOT"
REQ=bench/gpu/kit/gpu-extra.txt
K=.gpukit
PY=${PY:-python3}
git check-ignore -q $K/extra/x || { echo "ERROR: $K is not git-ignored (run bench/gpu/kit/prepare_kit.sh first)"; exit 1; }
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform linux_x86_64 --platform manylinux2014_x86_64"
for n in $(seq 5 39); do PLAT="$PLAT --platform manylinux_2_${n}_x86_64"; done
mkdir -p $K/cache/extra $K/extra
$PY -m pip download -q --no-deps $PLAT -d $K/cache/extra -r $REQ 2>&1 | grep -v "^WARNING: Location" || true
S=$K/build-extra
rm -rf $S && mkdir -p $S
$PY -m pip install -q --no-deps --no-index --no-compile $PLAT --find-links $K/cache/extra \
  --target $S -r $REQ 2>&1 | grep -v -E "^WARNING: (Location|Running pip)" || true
test -f $S/grpc/__init__.py -a -f $S/smg_grpc_proto/__init__.py -a -f $S/pytest_asyncio/__init__.py
find $S -name __pycache__ -type d -prune -exec rm -rf {} +
rm -rf $S/bin
# Smaller: type stubs, licence texts and grpc's TLS root bundle (read only when a TLS
# channel is made; every channel of the GPU bench is plaintext loopback) stay here: -215 KB.
find $S \( -name '*.pyi' -o -name 'LICENSE*' \) -type f -delete
rm -f $S/grpc/_cython/_credentials/roots.pem
# smg_grpc_proto loads its generated modules lazily: only vLLM's (and common) are used here;
# grpc's legacy beta/framework API is never imported (grpc/__init__ does not load it).
rm -rf $S/smg_grpc_proto/proto $S/grpc/beta $S/grpc/framework
find $S/smg_grpc_proto/generated -type f \( -name 'sglang_*' -o -name 'tokenspeed_*' \
  -o -name 'trtllm_*' -o -name 'mlx_*' \) -delete
tar -C $S --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -cf - . | xz -9e -T0 > $K/extra/extra.tar.xz
(cd $K/extra && sha256sum extra.tar.xz > SHA256SUMS)
ls -l $K/extra
