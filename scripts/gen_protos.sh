#!/usr/bin/env bash
# Regenerates gpumesh/v1/*_pb2*.py from protos/. The generated files are committed;
# tests/test_protos_current.py fails when they are stale.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.}"
python -m grpc_tools.protoc -Iprotos --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" protos/gpumesh/v1/*.proto
