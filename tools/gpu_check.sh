#!/usr/bin/env bash
# The CUDA checks, on a lent GPU machine (no network there): installs the wheels carried
# in .whl/ (cp312: rocksdict, grpcio, protobuf, OpenTelemetry, etcd3aio; torch, numpy and
# xxhash come with that machine's image; ucxx does not fit the carry limit, so the agents
# there fall back to gRPC for peer transfer), builds the native extension for its Python,
# and runs tests/test_cuda.py, the device-hash tests (the Triton kernel compiled for the
# GPU; triton comes with CUDA torch) and the pool tests. Output under $OUT (or ./gpu-out).
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
{
  nvidia-smi -L
  python3 -c "import torch, grpc, google.protobuf as p; print('torch', torch.__version__, \
'cuda', torch.cuda.is_available(), 'grpc', grpc.__version__, 'protobuf', p.__version__)"
  python3 setup.py -q build_ext --inplace 2>&1 | tail -3 || true
  python3 -c "from kvstore import checksum; print('native checksum:', checksum.NATIVE)"
  python3 -c "import triton; print('triton', triton.__version__)"
} 2>&1 | tee "$OUT/env.txt"
python3 -m pytest -q -p no:cacheprovider --timeout 300 -o addopts=-ra \
  tests/test_cuda.py tests/test_device_hash.py tests/test_pool.py 2>&1 | tee "$OUT/pytest.txt"
rc=${PIPESTATUS[0]}
# agent logs of the spawned agents, for a failure
find /tmp -maxdepth 6 -name agent.log -newer "$OUT/env.txt" 2>/dev/null | head -8 |
  while read -r f; do echo "== $f"; tail -40 "$f"; done > "$OUT/agent-logs.txt"
exit "$rc"
