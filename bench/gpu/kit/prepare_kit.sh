#!/usr/bin/env bash
# Build, on a machine with network access to PyPI (no GPU needed), the vLLM 0.26.0
# kit that a GPU host installs without network or a vLLM install of its own
# (kit_install.sh): for Python 3.12 and torch 2.11.0 built for CUDA 13 on the host.
# Idempotent: reruns only when this script, fatbin_prune.py or kit-requirements.txt
# changed (or FORCE=1). Needs python3 with pip, unzip, xz, tar, sha256sum. Takes
# ~6 min on 2 cores (xz -9e).
#
# Output (all under the git-ignored .gpukit/, never committed):
#   .gpukit/cache/vllm/   vllm-0.26.0 wheel (304 MB; VLLM_WHEEL=path reuses one)
#   .gpukit/cache/deps/   the 55 pinned dependency wheels (40 MB)
#   .gpukit/build/site/   staging site-packages tree (~425 MB)
#   .gpukit/one/          the kit (~57 MiB): site.tar.xz (vllm minus
#                         _C, FA3, all deps) + C_sm90.so.xz (_C with non-sm_90
#                         SASS blanked, see fatbin_prune.py)
#   .gpukit/orig/         optional (~53 MiB): the untouched _C (C_orig.so.xz),
#                         for a run with vLLM's own binary (GPUs other than sm_90)
#
# Run it from the root of the checkout that is copied to the GPU host (the kit
# lands in its .gpukit/). MAX_KIT=BYTES (optional): fail when a payload folder
# is larger.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(git rev-parse --show-toplevel)
cd "$ROOT"
K=.gpukit
PY=${PY:-python3}
REQ=$HERE/kit-requirements.txt
# EXTRA_REQ=FILE adds a project's own small runtime deps (grpcio-health-checking, ...) to the kit.
if [ -n "${EXTRA_REQ:-}" ]; then
  mkdir -p .gpukit && cat "$HERE/kit-requirements.txt" "$EXTRA_REQ" > .gpukit/requirements.txt && REQ=$ROOT/.gpukit/requirements.txt
fi
VLLM_VERSION=0.26.0
WHL=vllm-$VLLM_VERSION-cp38-abi3-manylinux_2_28_x86_64.whl
MAX_KIT=${MAX_KIT:-0}   # largest payload folder accepted (bytes); 0 = any

EXCL=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$EXCL")"
grep -qxF '/.gpukit/' "$EXCL" 2>/dev/null || echo '/.gpukit/' >> "$EXCL"
git check-ignore -q $K/x || { echo "ERROR: $K is not ignored by git"; exit 1; }

stamp=$(cat "$0" "$HERE/fatbin_prune.py" "$REQ" | sha256sum | cut -c1-16)
if [ -z "${FORCE:-}" ] && [ -f $K/one/STAMP ] && [ "$(cat $K/one/STAMP)" = "$stamp" ]; then
  mkdir -p $K/tools && cp "$HERE"/*.sh "$HERE"/*.py "$HERE"/*.txt $K/tools/
  echo "kit up to date ($stamp); tools in $K/tools"; ls -l $K/one $K/orig; exit 0
fi

PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform linux_x86_64 --platform manylinux1_x86_64 --platform manylinux2010_x86_64 --platform manylinux2014_x86_64"
for n in $(seq 5 39); do PLAT="$PLAT --platform manylinux_2_${n}_x86_64"; done

# 1. wheels
mkdir -p $K/cache/vllm $K/cache/deps
if [ ! -f $K/cache/vllm/$WHL ]; then
  if [ -n "${VLLM_WHEEL:-}" ] && [ -f "$VLLM_WHEEL" ]; then cp "$VLLM_WHEEL" $K/cache/vllm/$WHL
  else $PY -m pip download -q --no-deps $PLAT -d $K/cache/vllm vllm==$VLLM_VERSION; fi
fi
$PY -m pip download -q --no-deps $PLAT -d $K/cache/deps -r "$REQ" 2>&1 | grep -v "^WARNING: Location" || true

# 2. staging tree: vllm minus what a dense model on sm_90 never loads
#    (FA2 .so 305 MB: Hopper uses FA3; _moe_C 48 MB: MoE only, imported in a
#    try; vllm-rs 43 MB: Rust API-server frontend; deep_gemm + fmha_sm100:
#    FP8 MoE / Blackwell, found via find_spec only) + the pinned deps
S=$K/build/site
rm -rf $K/build && mkdir -p $S
unzip -q $K/cache/vllm/$WHL -d $S -x 'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' \
  'vllm/_moe_C_stable_libtorch.abi3.so' 'vllm/vllm-rs' 'vllm/third_party/deep_gemm/*' \
  'vllm/third_party/fmha_sm100/*'
$PY -m pip install -q --no-deps --no-index --no-compile $PLAT --find-links $K/cache/deps \
  --target $S -r "$REQ" 2>&1 | grep -v "^WARNING: Location" || true
test -f $S/pydantic/__init__.py -a -f $S/xgrammar/__init__.py -a -f $S/zmq/__init__.py
find $S -name __pycache__ -type d -prune -exec rm -rf {} +

# 3. payloads
$PY "$HERE/fatbin_prune.py" prune $S/vllm/_C_stable_libtorch.abi3.so $K/build/C_sm90.so 90
rm -rf $K/one $K/orig && mkdir -p $K/one $K/orig
tar -C $S --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 \
  --exclude=./vllm/_C_stable_libtorch.abi3.so -cf - . | xz -9e -T0 > $K/one/site.tar.xz
xz -9e -T0 -c $K/build/C_sm90.so > $K/one/C_sm90.so.xz
xz -6 -T0 -c $S/vllm/_C_stable_libtorch.abi3.so > $K/orig/C_orig.so.xz
(cd $K/one && sha256sum site.tar.xz C_sm90.so.xz > SHA256SUMS)
(cd $K/orig && sha256sum C_orig.so.xz > SHA256SUMS)
for d in $K/one $K/orig; do
  sz=$(du -sb $d | cut -f1)
  echo "$d: $sz bytes ($((sz / 1048576)) MiB)"
  [ "$MAX_KIT" = 0 ] || [ "$sz" -le "$MAX_KIT" ] || { echo "ERROR: $d exceeds MAX_KIT ($MAX_KIT bytes)"; exit 1; }
done
echo "$stamp" > $K/one/STAMP
ls -l $K/one $K/orig
mkdir -p $K/tools && cp "$HERE"/*.sh "$HERE"/*.py "$HERE"/*.txt $K/tools/
echo "tools copied to $K/tools (copy it to the GPU host with $K/one)"
