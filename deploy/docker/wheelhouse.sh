#!/usr/bin/env bash
# Fills a wheelhouse for an offline image build (deploy/docker/Dockerfile, OFFLINE=1): every
# wheel gpumesh and the chosen variant need, plus the build requirements of gpumesh's own wheel,
# for the image's Python and platform. Run it on a machine that reaches a package index (or a
# mirror: PIP_INDEX_URL), carry the folder to the air-gapped side, build with it.
#
#   deploy/docker/wheelhouse.sh [--variant sim|cpu|cuda] [--python 3.11]
#                               [--platform manylinux_2_36_x86_64] DIR
#
# --python    the image's Python (major.minor; default 3.11, Debian bookworm's and the
#             default base image's)
# --platform  the image's wheel platform (default manylinux_2_36_x86_64: glibc 2.36, x86-64;
#             pip also takes every older manylinux wheel for it)
# Needs python3 (3.11+, for tomllib) with pip on this machine; the wheels are downloaded, never
# built here, so the host's own Python version does not matter beyond that.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
variant=sim
pyver=3.11
platform=manylinux_2_36_x86_64
while [ $# -gt 0 ]; do
  case "$1" in
    --variant) variant=$2; shift 2 ;;
    --python) pyver=$2; shift 2 ;;
    --platform) platform=$2; shift 2 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    -*) echo "wheelhouse.sh: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
[ $# -eq 1 ] || { echo "usage: wheelhouse.sh [--variant V] [--python X.Y] [--platform P] DIR" >&2
                  exit 2; }
out=$1
case "$variant" in
  sim) extra="" ;; cpu) extra=cpu ;; cuda) extra=gpu ;;
  *) echo "wheelhouse.sh: --variant must be sim, cpu or cuda" >&2; exit 2 ;;
esac
mkdir -p "$out"

# pyproject.toml's build requirements and the runtime requirements of the variant
reqs=$(python3 - "$ROOT/pyproject.toml" "$extra" <<'EOF'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    data = tomllib.load(f)
reqs = list(data["build-system"]["requires"]) + list(data["project"]["dependencies"])
if sys.argv[2]:
    reqs += data["project"]["optional-dependencies"][sys.argv[2]]
print("\n".join(reqs))
EOF
)
abi="cp${pyver/./}"
mapfile -t req_list <<<"$reqs"
# pip takes --platform literally: list every glibc a manylinux_2_N platform also runs
platforms=(--platform "$platform" --platform any)
if [[ $platform =~ ^manylinux_2_([0-9]+)_(.+)$ ]]; then
  for ((n = BASH_REMATCH[1] - 1; n >= 5; n--)); do
    platforms+=(--platform "manylinux_2_${n}_${BASH_REMATCH[2]}")
  done
  platforms+=(--platform "manylinux2014_${BASH_REMATCH[2]}" --platform "manylinux2010_${BASH_REMATCH[2]}"
              --platform "manylinux1_${BASH_REMATCH[2]}")
fi
python3 -m pip download --quiet --only-binary=:all: --dest "$out" \
  --python-version "$pyver" --implementation cp --abi "$abi" --abi abi3 --abi none \
  "${platforms[@]}" "${req_list[@]}"
echo "wheelhouse.sh: $(ls "$out"/*.whl | wc -l) wheels in $out (variant $variant," \
     "Python $pyver, $platform)" >&2
