"""GPU collective overhead and bandwidth: gridcomm vs raw NcclCommunicator vs cupyx NCCLBackend.

One process, one GPU (world size 1) until a multi-GPU machine is lent. Each implementation is
timed in interleaved rounds (so drift hits all alike); per-call times are medians over rounds,
with the spread (min..max of the round medians). Run on the device machine:

    python benchmarks/collectives.py [--rounds 7] [--calls 2000]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import cupy
from cupy.cuda import nccl

import gridcomm


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def time_calls(fn, calls: int) -> float:
    stream = cupy.cuda.get_current_stream()
    stream.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    stream.synchronize()
    return (time.perf_counter() - t0) / calls


def summarize(samples: list[float]) -> str:
    return f"{statistics.median(samples) * 1e6:8.2f} us  (spread {min(samples) * 1e6:.2f}..{max(samples) * 1e6:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    os.environ.setdefault("GRIDCOMM_BIND", "127.0.0.1")
    cupy.cuda.Device(0).use()
    cupy.zeros(1).sum()  # CUDA context up before any init is timed

    # ---------------------------------------------------------------- init times
    raw_init, grid_init = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        uid = nccl.get_unique_id()
        c = nccl.NcclCommunicator(1, uid, 0)
        raw_init.append(time.perf_counter() - t0)
        c.destroy()
        t0 = time.perf_counter()
        g = gridcomm.init_process_group(1, 0, backend="nccl", port=free_port())
        grid_init.append(time.perf_counter() - t0)
        g.stop()
    cupyx_init = None
    try:
        import cupyx.distributed

        t0 = time.perf_counter()
        cx = cupyx.distributed.init_process_group(1, 0, port=free_port())
        cupyx_init = time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001 - report and go on without the peer
        print(f"cupyx.distributed unavailable: {exc!r}")
        cx = None

    raw = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    comm = gridcomm.init_process_group(1, 0, backend="nccl", port=free_port())
    print(f"init: raw NCCL {statistics.median(raw_init) * 1e3:.1f} ms, gridcomm {statistics.median(grid_init) * 1e3:.1f}"
          f" ms (difference {(statistics.median(grid_init) - statistics.median(raw_init)) * 1e3:.1f} ms)"
          + (f", cupyx {cupyx_init * 1e3:.1f} ms" if cupyx_init is not None else ""))

    def run(label: str, size_bytes: int, calls: int) -> None:
        x = cupy.ones(size_bytes // 4, dtype=cupy.float32)
        y = cupy.empty_like(x)
        stream_ptr = cupy.cuda.get_current_stream().ptr
        impls = {
            "raw": lambda: raw.allReduce(x.data.ptr, y.data.ptr, x.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                                         cupy.cuda.get_current_stream().ptr),
            "gridcomm": lambda: comm.all_reduce(x, y, "sum"),
        }
        if cx is not None:
            impls["cupyx"] = lambda: cx.all_reduce(x, y, "sum")
        del stream_ptr
        for fn in impls.values():
            time_calls(fn, max(10, calls // 10))
        samples: dict[str, list[float]] = {k: [] for k in impls}
        for _ in range(args.rounds):
            for name, fn in impls.items():
                samples[name].append(time_calls(fn, calls))
        base = statistics.median(samples["raw"])
        print(f"all_reduce {label}:")
        for name, s in samples.items():
            ratio = statistics.median(s) / base
            extra = ""
            if size_bytes >= 1 << 20:
                extra = f"  algbw {size_bytes / statistics.median(s) / 1e9:.1f} GB/s"
            print(f"  {name:<9}{summarize(s)}  {ratio:.3f}x raw{extra}")

    run("4 B", 4, args.calls)
    run("64 KiB", 64 * 1024, args.calls)
    run("64 MiB", 64 * 1024 * 1024, 50)

    # ---------------------------------------------------------------- graph replay
    stream = cupy.cuda.Stream(non_blocking=True)
    x = cupy.ones(1, dtype=cupy.float32)
    y = cupy.empty_like(x)
    ops = 1000
    with stream:
        comm.all_reduce(x, y)
        stream.synchronize()
        stream.begin_capture()
        for _ in range(ops):
            comm.all_reduce(x, y)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        replay = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            graph.launch(stream)
            stream.synchronize()
            replay.append((time.perf_counter() - t0) / ops)
    print(f"graph replay of {ops} captured gridcomm all_reduce (4 B): {summarize(replay)} per op")
    comm.stop()


if __name__ == "__main__":
    main()
