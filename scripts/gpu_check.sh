#!/usr/bin/env bash
# The GPU run (device machine: one H200, no network). Installs the carried wheels (.whl/:
# grpcio-health-checking, pytest-timeout), runs the gpu-marked tests and the collective
# benchmark, and leaves logs in $OUT (or ./gpu-out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi -L | tee "$OUT/gpu.txt"
python3 -c "import cupy, grpc, google.protobuf as p; from cupy.cuda import nccl; print('cupy', cupy.__version__, 'nccl', nccl.get_version(), 'grpc', grpc.__version__, 'protobuf', p.__version__, 'bf16', hasattr(cupy, 'bfloat16'), 'avg', hasattr(nccl, 'NCCL_AVG'), 'split', hasattr(nccl.NcclCommunicator, 'commSplit'))" | tee -a "$OUT/gpu.txt"
python3 -m pytest -m gpu -v -s -p no:cacheprovider tests/test_gpu.py tests/test_conformance.py 2>&1 | tee "$OUT/gpu-tests.log"
tests_rc=${PIPESTATUS[0]}
python3 benchmarks/collectives.py 2>&1 | tee "$OUT/collectives.log"
echo "gpu tests exit code: $tests_rc"
exit "$tests_rc"
