#!/usr/bin/env bash
# On the build machine (no network needed): make the vLLM kit (.gpukit/one/site.tar.xz, built
# by bench/gpu/kit/prepare_kit.sh) smaller, then print the size of what is copied to the GPU
# host (the tree, the kit, the tools and the extras of bench/gpu/kit/pack_extra.sh, as one tar).
#
# This drops mistral_common's two Tekken tokenizer tables (34 MB unpacked, ~2.9 MB packed),
# read only by MistralTokenizer.v3(is_tekken=True), i.e. never for the Qwen-shaped models the
# GPU bench serves, and pycountry's translations (pycountry/locales, 22 MB unpacked: gettext
# catalogues, read only when a country name is translated); nothing else in the kit changes.
#   bash bench/gpu/kit/prepare_kit.sh && bash bench/gpu/kit/slim_kit.sh && bash bench/gpu/kit/pack_extra.sh
# SHIP_LIMIT=BYTES (optional): fail when what is copied is larger.
# Idempotent (a slimmed kit is stamped in .gpukit/one/SLIM); ~7 min on 2 cores (xz -9e).
set -euo pipefail
ROOT=$(git rev-parse --show-toplevel)
cd "$ROOT"
K=.gpukit/one
LIMIT=${SHIP_LIMIT:-0}
copy_size() {  # the tree and the kit as one tar
  { git ls-files; git ls-files -o --exclude-standard
    find .gpukit/one .gpukit/tools .gpukit/extra .gpukit/doors -type f 2>/dev/null || true; } \
    | tar -T - -cf - 2>/dev/null | wc -c
}
[ -f $K/site.tar.xz ] || { echo "no $K/site.tar.xz: run bench/gpu/kit/prepare_kit.sh first"; exit 1; }
sum=$(sha256sum $K/site.tar.xz | cut -c1-16)
if [ -f $K/SLIM ] && [ "$(cat $K/SLIM)" = "$sum" ]; then
  echo "kit already slim ($sum)"
else
  echo "slimming $K/site.tar.xz ($(stat -c %s $K/site.tar.xz) bytes)..."
  xz -dc -T0 $K/site.tar.xz \
    | tar --delete --wildcards -f - ./mistral_common/data/tekken_240718.json \
      ./mistral_common/data/tekken_240911.json './pycountry/locales/*' \
    | xz -9e -T0 > $K/site.tar.xz.new
  # the slimmed archive must still hold vLLM and the tokenizer package, and not the tables
  listing=$(xz -dc -T0 $K/site.tar.xz.new | tar -tf -)
  grep -qx './vllm/__init__.py' <<<"$listing" && grep -qx './mistral_common/__init__.py' <<<"$listing" \
    && ! grep -q 'tekken_2407\|tekken_2409\|pycountry/locales/.' <<<"$listing" \
    || { echo "ERROR: slimmed archive is not as expected; kit left as it was"; rm -f $K/site.tar.xz.new; exit 1; }
  mv $K/site.tar.xz.new $K/site.tar.xz
  (cd $K && sha256sum site.tar.xz C_sm90.so.xz > SHA256SUMS)
  sha256sum $K/site.tar.xz | cut -c1-16 > $K/SLIM
  echo "slim: $(stat -c %s $K/site.tar.xz) bytes"
fi
size=$(copy_size)
echo "the tree and the kit: $size bytes"
[ "$LIMIT" = 0 ] || [ "$size" -le "$LIMIT" ] || { echo "ERROR: over SHIP_LIMIT ($LIMIT bytes)"; exit 1; }
