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
python3 - <<'PY' 2>&1 | tee -a "$OUT/gpu.txt"
import cupy, numpy
from cupy.cuda import nccl
print("commSplit doc:", (nccl.NcclCommunicator.commSplit.__doc__ or "")[:300])
print("NcclCommunicator doc:", (nccl.NcclCommunicator.__doc__ or "")[:200])
for probe in ("import ml_dtypes; print('ml_dtypes', ml_dtypes.__version__, numpy.dtype(ml_dtypes.bfloat16))",
              "print('cupy dtype bfloat16', cupy.dtype('bfloat16'))",
              "print('cupy.bfloat16', cupy.bfloat16)", "print('NCCL_BFLOAT16', nccl.NCCL_BFLOAT16)",
              "import cupy._core as c; print([n for n in dir(c) if 'bf' in n.lower()])"):
    try:
        exec(probe)
    except Exception as exc:
        print("probe failed:", probe[:40], repr(exc))
PY
python3 -m pytest -m gpu -v -s -p no:cacheprovider tests/test_gpu.py tests/test_conformance.py 2>&1 | tee "$OUT/gpu-tests.log"
tests_rc=${PIPESTATUS[0]}
python3 benchmarks/overhead_probe.py 2>&1 | tee "$OUT/probe.log"
python3 benchmarks/collectives.py 2>&1 | tee "$OUT/collectives.log"
echo "gpu tests exit code: $tests_rc"
exit "$tests_rc"
