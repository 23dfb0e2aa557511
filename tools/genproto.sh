#!/usr/bin/env bash
# Regenerate the protobuf/gRPC Python code from proto/ into OUT (default: the repo root,
# which places it in kvstore/v1/). tests/unit/test_proto_fresh.py runs this into a temp dir and
# fails when the checked-in files differ.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$here}"
py="${PYTHON:-$here/.venv/bin/python}"
mkdir -p "$out/kvstore/v1"
cd "$here/proto"
"$py" -m grpc_tools.protoc -I. --python_out="$out" --grpc_python_out="$out" --pyi_out="$out" \
  kvstore/v1/*.proto
[ -f "$out/kvstore/v1/__init__.py" ] || echo '"""Generated protobuf code (tools/genproto.sh); do not edit."""' > "$out/kvstore/v1/__init__.py"
