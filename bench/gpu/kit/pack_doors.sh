#!/usr/bin/env bash
# On the build machine (network access): pack what the front-door and cache-aware phases
# (doors05, doors7, uneq05, prefix05, prefix7) need on the GPU host beyond the vLLM kit and the
# extras, into git-ignored folders that are copied with the checkout:
#
#   .gpukit/doors/doors.tar.xz (~1.4 MB): vLLM's OpenAI server's missing Python deps (wheels of
#       bench/gpu/kit/doors-requirements.txt, installed into the kit's folder) and nginx (Debian's
#       nginx and libpcre2 packages, unpacked under .ngx/, run with its own lib/)
#   .gpukit/smg/smg.tar.xz (~21 MB): SMG's Python package with its Rust extension stripped of
#       debug symbols (106 MB -> 75 MB; `python -m smg launch`; needs setproctitle, in the kit)
#
# bench/gpu/kit/run_doors.sh unpacks both into the kit's folder (once per host, by checksum).
#   bash bench/gpu/kit/pack_doors.sh          (SMG from .smg-venv, or SMG_WHEEL=path)
set -euo pipefail
ROOT=$(git rev-parse --show-toplevel)
cd "$ROOT"
K=.gpukit
PY=${PY:-python3}
git check-ignore -q $K/doors/x || { echo "ERROR: $K is not git-ignored"; exit 1; }
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform linux_x86_64 --platform manylinux2014_x86_64"
for n in $(seq 5 39); do PLAT="$PLAT --platform manylinux_2_${n}_x86_64"; done

# 1. OpenAI server deps + nginx
B=$K/build-doors
rm -rf $B && mkdir -p $B/site $B/ngx $B/deb $K/cache/doors $K/doors
$PY -m pip download -q --no-deps $PLAT -d $K/cache/doors -r bench/gpu/kit/doors-requirements.txt 2>&1 \
  | grep -v "^WARNING: Location" || true
$PY -m pip install -q --no-deps --no-index --no-compile $PLAT --find-links $K/cache/doors \
  --target $B/site -r bench/gpu/kit/doors-requirements.txt 2>&1 | grep -v -E "^WARNING: (Location|Running pip)" || true
test -f $B/site/uvicorn/__init__.py -a -f $B/site/model_hosting_container_standards/__init__.py
rm -rf $B/site/bin
find $B/site -name __pycache__ -type d -prune -exec rm -rf {} +
(cd $B/deb && apt-get download nginx libpcre2-8-0 >/dev/null 2>&1) || { echo "ERROR: apt-get download nginx"; exit 1; }
for f in $B/deb/*.deb; do dpkg -x "$f" $B/ngx; done
rm -rf $B/ngx/usr/share $B/ngx/etc
test -x $B/ngx/usr/sbin/nginx
mv $B/ngx $B/site/.ngx
tar -C $B/site --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -cf - . | xz -9 -T0 > $K/doors/doors.tar.xz

# 2. SMG
S=$K/build-smg
rm -rf $S && mkdir -p $S $K/smg
if [ -n "${SMG_WHEEL:-}" ]; then
  unzip -q "$SMG_WHEEL" -d $S
else
  SITE=$(ls -d .smg-venv/lib/python3*/site-packages)
  cp -r "$SITE/smg" "$SITE"/smg-*.dist-info $S/
fi
find $S -name __pycache__ -type d -prune -exec rm -rf {} +
strip -s $S/smg/smg_rs.abi3.so
tar -C $S --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -cf - . | xz -9 -T0 > $K/smg/smg.tar.xz
ls -l $K/doors $K/smg
