#!/usr/bin/env bash
# On the GPU host: install the kit (prepare_kit.sh) into $SITE (default /tmp/site).
#   bash .gpukit/tools/kit_install.sh .gpukit/one [.gpukit/orig]
# A DIR that is absent is skipped (noted). site.tar.xz is unpacked; C_*.so.xz
# becomes vllm/_C_stable_libtorch.abi3.so (the last DIR given wins, so
# ".gpukit/one .gpukit/orig" ends with vLLM's untouched _C). Skips what an
# earlier run on the same host already installed, by checksum.
# Then: export PYTHONPATH=$SITE
set -euo pipefail
SITE=${SITE:-/tmp/site}
mkdir -p "$SITE"
touch "$SITE/.kit-installed"
unxz_to() {  # unxz_to FILE.xz -> stdout
  if command -v xz >/dev/null; then xz -dc -T0 "$1"
  else python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer, 1<<20)" "$1"; fi
}
for d in "$@"; do
  if [ ! -d "$d" ]; then echo "kit: $d absent, skipped"; continue; fi
  if [ -f "$d/site.tar.xz" ]; then
    sum=$(sha256sum "$d/site.tar.xz" | cut -c1-16)
    if grep -qx "site $sum" "$SITE/.kit-installed"; then echo "kit: site $sum already in $SITE"
    else
      t=$(date +%s%N); unxz_to "$d/site.tar.xz" | tar -C "$SITE" -xf -
      echo "site $sum" >> "$SITE/.kit-installed"
      echo "kit: site $sum unpacked in $(( ($(date +%s%N) - t) / 1000000 )) ms"
    fi
  fi
  for c in "$d"/C_*.so.xz; do
    [ -f "$c" ] || continue
    sum=$(sha256sum "$c" | cut -c1-16)
    if [ "$(tail -n1 "$SITE/.kit-C" 2>/dev/null)" = "$sum $(basename "$c")" ]; then echo "kit: $(basename "$c") already current"; continue; fi
    mkdir -p "$SITE/vllm"
    unxz_to "$c" > "$SITE/vllm/_C_stable_libtorch.abi3.so.tmp"
    mv "$SITE/vllm/_C_stable_libtorch.abi3.so.tmp" "$SITE/vllm/_C_stable_libtorch.abi3.so"
    echo "$sum $(basename "$c")" >> "$SITE/.kit-C"
    echo "kit: _C <- $(basename "$c") ($sum)"
  done
done
[ -f "$SITE/vllm/_C_stable_libtorch.abi3.so" ] || { echo "kit: no _C installed"; exit 1; }
[ -f "$SITE/vllm/__init__.py" ] || { echo "kit: no site installed"; exit 1; }
