"""Where gridcomm's per-call time goes in a real loop (device machine, world size 1).

``overhead_probe.py`` times gridcomm's call path with NCCL replaced by a no-op: about 0.3 us. In
``collectives.py``'s real loop the same path costs 0.5-0.8 us more than the raw call. This probe
times, interleaved round by round on one real 1-rank communicator, variants of the call path that
differ by one thing each, so the gap can be placed:

- ``raw``: the call written by hand on the NcclCommunicator (as collectives.py's raw peer);
- ``forward``: a Python function with gridcomm's signature that makes raw's reads and call, no
  checks: the cost of one more Python frame;
- ``forward+table``: that, plus the dtype's table lookup (``by_op[op][id(dtype)]``);
- ``forward+attrs``: the frame plus the other checks (contiguity, sizes, the out dtype);
- ``backend``: gridcomm's backend method, called on the backend;
- ``gridcomm``: the method through the Communicator, as users call it.

Run twice in one process: with a communicator from ``init_process_group`` (its heartbeats on the
background thread), then with a bare backend after ``stop()``, to tell the call path from what
runs beside it.

    python benchmarks/callpath_probe.py [--rounds 21] [--calls 1000]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import cupy  # noqa: E402
from cupy.cuda import nccl  # noqa: E402

import gridcomm  # noqa: E402
from gridcomm._backends import nccl as gridcomm_nccl  # noqa: E402

F32, SUM = nccl.NCCL_FLOAT32, nccl.NCCL_SUM


def raw_communicator() -> Any:
    as_bytes, as_tuple = gridcomm_nccl.id_forms(gridcomm_nccl.new_unique_id())
    try:
        return nccl.NcclCommunicator(1, as_bytes, 0)
    except TypeError:  # older CuPy takes a tuple of signed chars
        return nccl.NcclCommunicator(1, as_tuple, 0)


def variants(raw: Any, backend: Any, comm: Any, x: Any, y: Any) -> dict[str, Callable[[], None]]:
    stream = cupy.cuda.get_current_stream

    def forward(in_array: Any, out_array: Any, op: str = "sum", stream_arg: Any = None) -> None:
        raw.allReduce(in_array.data.ptr, out_array.data.ptr, in_array.size, F32, SUM,
                      stream().ptr if stream_arg is None else stream_arg.ptr)

    by_op = backend._reduce_by_id
    backend.ready()  # nccl4py: its split done, so the function and handle read here are NCCL's own
    ar, c = backend._nccl_all_reduce, backend._c

    def table(in_array: Any, out_array: Any, op: str = "sum", stream_arg: Any = None) -> None:
        nccl_type, mult, code = by_op[op][id(in_array.dtype)]
        raw.allReduce(in_array.data.ptr, out_array.data.ptr, in_array.size * mult, nccl_type, code,
                      stream().ptr if stream_arg is None else stream_arg.ptr)

    def attrs(in_array: Any, out_array: Any, op: str = "sum", stream_arg: Any = None) -> None:
        dtype = in_array.dtype
        count = in_array.size
        if not (in_array._c_contiguous and out_array._c_contiguous and out_array.size == count
                and out_array.dtype is dtype):
            raise AssertionError("not reached")
        raw.allReduce(in_array.data.ptr, out_array.data.ptr, count, F32, SUM,
                      stream().ptr if stream_arg is None else stream_arg.ptr)

    out = {
        "raw": lambda: raw.allReduce(x.data.ptr, y.data.ptr, x.size, F32, SUM, stream().ptr),
        "forward": lambda: forward(x, y, "sum"),
        "forward+table": lambda: table(x, y, "sum"),
        "forward+attrs": lambda: attrs(x, y, "sum"),
        "backend": lambda: backend.all_reduce(x, y, "sum"),
        # The engine's own call on gridcomm's communicator (nccl4py: nccl.bindings.nccl.all_reduce).
        f"raw-{backend.engine}": lambda: ar(x.data.ptr, y.data.ptr, x.size, F32, SUM, c, stream().ptr),
    }
    if comm is not None:
        out["gridcomm"] = lambda: comm.all_reduce(x, y, "sum")
    return out


def block(fn: Callable[[], None], calls: int) -> float:
    cupy.cuda.runtime.deviceSynchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    cupy.cuda.runtime.deviceSynchronize()
    return (time.perf_counter() - t0) / calls


def measure(impls: dict[str, Callable[[], None]], rounds: int, calls: int) -> dict[str, list[float]]:
    for fn in impls.values():
        block(fn, calls)
    names = list(impls)
    samples: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            samples[name].append(block(impls[name], calls))
    return samples


def report(title: str, samples: dict[str, list[float]]) -> None:
    base = samples["raw"]
    print(f"\n#### {title}\n")
    print("| variant | us per call, median [min..max] | /raw (medians) | /raw, median of per-round ratios |")
    print("| --- | --- | ---: | ---: |")
    for name, values in samples.items():
        med = statistics.median(values)
        per_round = statistics.median(a / b for a, b in zip(values, base, strict=True))
        print(f"| {name} | {med * 1e6:.2f} [{min(values) * 1e6:.2f}..{max(values) * 1e6:.2f}] "
              f"| {med / statistics.median(base):.3f} | {per_round:.3f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--calls", type=int, default=1000)
    args = ap.parse_args()
    x = cupy.ones(1, dtype=cupy.float32)
    y = cupy.zeros(1, dtype=cupy.float32)

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    comm = gridcomm.init_process_group(1, 0, backend="nccl", host="127.0.0.1", port=port, timeout_s=60)
    try:
        raw = raw_communicator()
        print(f"Python threads with the communicator: {threading.active_count()}")
        samples = measure(variants(raw, comm._backend, comm, x, y), args.rounds, args.calls)
        report("with the communicator's background threads (init_process_group)", samples)
    finally:
        comm.stop()

    backend = gridcomm_nccl.NcclBackend(1, 0, gridcomm_nccl.new_unique_id())
    print(f"\nPython threads after stop() (the process's gRPC loop thread stays): {threading.active_count()}")
    samples = measure(variants(raw, backend, None, x, y), args.rounds, args.calls)
    report("bare backend, after stop()", samples)
    backend.destroy()
    raw.destroy()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
