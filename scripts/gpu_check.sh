#!/usr/bin/env bash
# The GPU run (device machine: one or two H200s, no network). Installs the carried wheels (.whl/:
# grpcio-health-checking, grpcio-reflection, pytest-timeout, nccl4py), runs the gpu and multi_gpu tests with the NCCL
# engine GRIDCOMM_NCCL_ENGINE picks (auto: nccl4py where it loads), the world-size-1 conformance
# again with CuPy's binding (GRIDCOMM_NCCL_ENGINE=cupy), the per-call probes and the collective
# benchmark at world size 1 and, with 2+ GPUs, 2 (one process per GPU), and leaves logs in $OUT
# (or ./gpu-out): gpu.txt, gpu-tests.log, cupy-engine.log, probe.log (with nccl_record_cost.py), nccl-ranks.md/.json,
# collectives-wsN.md/.json.
# BENCH_ARGS adds arguments to both benchmark runs (e.g. "--rounds 5 --sweep-max 268435456").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
# NVLink multicast stays off on shared multi-GPU hosts (it can take the GPUs out of service).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
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
python3 - <<'PY' 2>&1 | tee -a "$OUT/gpu.txt"
from gridcomm._backends import nccl as _nccl
print("NCCL engine:", _nccl.engine(), "| setting:", _nccl.engine_setting(), "| nccl4py:",
      "loads" if _nccl.load_nccl4py() else f"not usable ({_nccl.nccl4py_why()})")
try:
    import nccl.core
    print("nccl4py", nccl.core.__version__, "libnccl", nccl.core.get_version().libnccl)
except Exception as exc:
    print("nccl4py:", repr(exc))
PY
# Several ranks on one GPU (tests/test_gpu_ranks.py, and test_gpu.py's 2-rank tests where GPUs are
# fewer) need NCCL >= 2.30 in both CuPy and nccl4py: NCCL_LIB, a libnccl.so.2 (e.g. the
# nvidia-nccl-cu13 wheel's nvidia/nccl/lib/libnccl.so.2), is preloaded for both; they skip, saying
# why, with an older NCCL.
if [ -n "${NCCL_LIB:-}" ]; then
  export LD_PRELOAD=$NCCL_LIB${LD_PRELOAD:+:$LD_PRELOAD} LD_LIBRARY_PATH=$(dirname "$NCCL_LIB")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
python3 -c "from gridcomm._backends import nccl as n; from gridcomm._backends.nccl import sharing as s; print('NCCL for several ranks per GPU:', s.version_text(n.nccl_version()))" 2>&1 | tee -a "$OUT/gpu.txt"
python3 -m pytest -m "gpu or multi_gpu" -v -s -p no:cacheprovider tests/test_gpu.py tests/test_gpu_ranks.py tests/test_gpu_hangs.py \
  tests/test_conformance.py 2>&1 | tee "$OUT/gpu-tests.log"
tests_rc=${PIPESTATUS[0]}
# CuPy's binding stays the engine where nccl4py is missing: its conformance too.
GRIDCOMM_NCCL_ENGINE=cupy python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/test_conformance.py 2>&1 \
  | tee "$OUT/cupy-engine.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || tests_rc=1
python3 benchmarks/overhead_probe.py 2>&1 | tee "$OUT/probe.log"
for engine in auto cupy; do
  GRIDCOMM_NCCL_ENGINE=$engine python3 benchmarks/callpath_probe.py --rounds 11 2>&1 | tee -a "$OUT/probe.log"
done
# The flight record's and GRIDCOMM_DEBUG=collectives' per-call cost on NCCL (world size 1).
python3 benchmarks/nccl_record_cost.py 2>&1 | tee -a "$OUT/probe.log"
# gridcomm against raw NCCL with 2 and 4 ranks (sharing GPUs where they are fewer): init and per call.
python3 benchmarks/nccl_ranks.py --json "$OUT/nccl-ranks.json" 2>&1 | tee "$OUT/nccl-ranks.md"
gpus=$(nvidia-smi -L | grep -c '^GPU')
bench_rc=0
for ws in 1 2; do
  [ "$gpus" -ge "$ws" ] || { echo "world size $ws not run: $gpus GPU(s)" | tee -a "$OUT/gpu.txt"; continue; }
  # shellcheck disable=SC2086 # BENCH_ARGS is a list of words
  python3 benchmarks/collectives.py --world-size "$ws" --json "$OUT/collectives-ws$ws.json" ${BENCH_ARGS:-} 2>&1 \
    | tee "$OUT/collectives-ws$ws.md"
  [ "${PIPESTATUS[0]}" -eq 0 ] || bench_rc=1
done
echo "gpu tests exit code: $tests_rc, benchmark exit code: $bench_rc"
[ "$tests_rc" -eq 0 ] && exit "$bench_rc"
exit "$tests_rc"
