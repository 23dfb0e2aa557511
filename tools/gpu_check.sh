#!/usr/bin/env bash
# The CUDA checks, on a lent GPU machine (no network there): installs the wheels carried
# in .whl/ (cp312: rocksdict, grpcio, protobuf, OpenTelemetry, etcd3aio; torch, numpy,
# xxhash and triton come with that machine's image) and the ucxx bundle for its CUDA major
# (.whl/ucx-cu<N>-py3.12.tar.xz, made by tools/ucx_bundle.sh), builds the native extension
# for its Python, and runs tests/gpu/test_cuda.py (UCX into and out of GPU memory among them),
# the device-hash tests (the Triton kernel compiled for the GPU) and the pool tests, then
# loadtest/bench_device_hash.py. Output under $OUT (or ./gpu-out).
#   run with carry [".whl"]: bash tools/gpu_check.sh
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 3
cuda=$(python3 -c "import torch; print((torch.version.cuda or '0').split('.')[0])")
bundle=.whl/ucx-cu$cuda-py$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])').tar.xz
if [ -f "$bundle" ]; then
  tar -xJf "$bundle" -C /tmp/site || exit 3
else
  echo "no $bundle: peer transfer over the gRPC fallback only" | tee "$OUT/no-ucx.txt"
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
{
  nvidia-smi -L
  python3 -c "import torch, grpc, google.protobuf as p; print('torch', torch.__version__, \
'cuda', torch.cuda.is_available(), 'grpc', grpc.__version__, 'protobuf', p.__version__)"
  python3 setup.py -q build_ext --inplace 2>&1 | tail -3 || true
  python3 -c "from kvstore import checksum; print('native checksum:', checksum.NATIVE)"
  python3 -c "import triton; print('triton', triton.__version__)"
  python3 -c "import ucxx, libucx; print('ucxx', ucxx.__version__, 'ucx', ucxx.get_ucx_version())"
} 2>&1 | tee "$OUT/env.txt"
timeout 400 python3 -m pytest -q -p no:cacheprovider --timeout 240 -o addopts=-ra \
  tests/gpu/test_cuda.py tests/gpu/test_device_hash.py tests/unit/test_pool.py 2>&1 | tee "$OUT/pytest.txt"
rc=${PIPESTATUS[0]}
# how fast the kernel verifies 64 x 2 MiB landed in GPU memory, against a device copy
timeout 120 python3 -m loadtest.bench_device_hash > "$OUT/bench_device_hash.json" \
  2> "$OUT/bench_device_hash.err"
# agent logs of the spawned agents, for a failure
find /tmp -maxdepth 6 -name agent.log -newer "$OUT/env.txt" 2>/dev/null | head -8 |
  while read -r f; do echo "== $f"; tail -40 "$f"; done > "$OUT/agent-logs.txt"
exit "$rc"
