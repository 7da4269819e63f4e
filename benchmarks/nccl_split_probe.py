"""Which second communicator is cheapest after the abortable non-blocking init (issue 25, item 6)?

On the GPU machine, world size 1, one process: the time to a usable blocking communicator by
each route, medians of --reps with min..max, after a warm-up:

- ``cupy``: CuPy's blocking ncclCommInitRank (what a cupyx user has; "raw");
- ``nccl4py-blocking``: nccl4py's blocking init (raw too, but not abortable);
- ``nb``: the non-blocking init alone (abortable, but its calls can come back ncclInProgress);
- ``nb+split``: then ncclCommSplit to a blocking child, resources not shared (the engine today);
- ``nb+split-share``: the same with ``split_share=True`` (the child shares the parent's resources);
- ``nb+shrink-share``: ncclCommShrink excluding nobody, ``shrink_share=True``;
- ``nb+shrink``: ncclCommShrink excluding nobody, nothing shared.

For each route that makes a child it also checks the child (a 4 B all_reduce and a send/recv group
to itself, state after each), times 4 B all_reduce per call on it, and times tearing down: the
child's destroy then the parent's, and the child's abort with the parent alive.

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/nccl_split_probe.py [--reps 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import cupy
from cupy.cuda import nccl as cupy_nccl
from nccl_nonblocking_probe import wait  # the same poll, beside this script

from gridcomm._backends.nccl import engines


def spread(samples: list[float]) -> str:
    if not samples:
        return "-"
    return f"{statistics.median(samples) * 1e3:.1f} [{min(samples) * 1e3:.1f}..{max(samples) * 1e3:.1f}] ms"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    engine = engines._engine_for("nccl4py")
    core, b = engine.core, engine.bindings

    def nb_parent() -> Any:
        comm = core.Communicator()
        comm.initialize(1, 0, core.UniqueId.from_bytes(engines.new_unique_id("nccl4py")),
                        core.NCCLConfig(blocking=False))
        wait(comm, "non-blocking init")
        return comm

    def child_by(kind: str) -> Callable[[Any], Any]:
        def make(parent: Any) -> Any:
            if kind == "split":
                child = parent.split(0, 0, core.NCCLConfig(blocking=True))
            elif kind == "split-share":
                child = parent.split(0, 0, core.NCCLConfig(blocking=True, split_share=True))
            elif kind == "shrink-share":
                child = parent.shrink([], core.NCCLConfig(blocking=True, shrink_share=True))
            else:
                child = parent.shrink([], core.NCCLConfig(blocking=True))
            wait(parent, kind + " (parent)")
            wait(child, kind + " (child)")
            return child
        return make

    x = cupy.ones(1, dtype=cupy.float32)
    y = cupy.zeros(1, dtype=cupy.float32)
    f32, total = engine.types["float32"], engine.ops["sum"]

    def check(child: Any) -> str:
        stream = cupy.cuda.get_current_stream().ptr
        x.fill(1)
        b.all_reduce(x.data.ptr, x.data.ptr, 1, f32, total, child._comm, stream)
        after_ar = int(child.get_async_error())
        y.fill(0)
        b.group_start()
        try:
            b.send(x.data.ptr, 1, f32, 0, child._comm, stream)
            b.recv(y.data.ptr, 1, f32, 0, child._comm, stream)
        finally:
            b.group_end()
        after_group = int(child.get_async_error())
        cupy.cuda.get_current_stream().synchronize()
        return f"all_reduce -> {float(x[0])} state {after_ar}; send/recv -> {float(y[0])} state {after_group}"

    def per_call(child: Any) -> float:
        stream = cupy.cuda.get_current_stream().ptr
        rounds = []
        for _ in range(5):
            cupy.cuda.Device().synchronize()
            started = time.perf_counter()
            for _ in range(2000):
                b.all_reduce(x.data.ptr, x.data.ptr, 1, f32, total, child._comm, stream)
            cupy.cuda.Device().synchronize()
            rounds.append((time.perf_counter() - started) / 2000)
        return statistics.median(rounds)

    # Warm-up: CUDA context, NCCL's library and its first topology.
    cupy_nccl.NcclCommunicator(1, cupy_nccl.get_unique_id(), 0).destroy()
    nb_parent().destroy()

    raw: list[float] = []
    raw4py: list[float] = []
    for _ in range(args.reps):
        started = time.perf_counter()
        comm = cupy_nccl.NcclCommunicator(1, cupy_nccl.get_unique_id(), 0)
        raw.append(time.perf_counter() - started)
        comm.destroy()
        started = time.perf_counter()
        blocking = core.Communicator()
        blocking.initialize(1, 0, core.UniqueId.from_bytes(engines.new_unique_id("nccl4py")),
                            core.NCCLConfig(blocking=True))
        raw4py.append(time.perf_counter() - started)
        blocking.destroy()
    print(f"cupy (raw) {spread(raw)}", flush=True)
    print(f"nccl4py-blocking {spread(raw4py)}", flush=True)

    for kind in ("split", "split-share", "shrink-share", "shrink"):
        total_t: list[float] = []
        parent_t: list[float] = []
        destroy_child: list[float] = []
        destroy_parent: list[float] = []
        abort_child: list[float] = []
        note = ""
        call_us = float("nan")
        try:
            for rep in range(args.reps):
                started = time.perf_counter()
                parent = nb_parent()
                parent_t.append(time.perf_counter() - started)
                child = child_by(kind)(parent)
                total_t.append(time.perf_counter() - started)
                if rep == 0:
                    note = check(child)
                    call_us = per_call(child) * 1e6
                if rep % 2 == 0:
                    started = time.perf_counter()
                    child.destroy()
                    destroy_child.append(time.perf_counter() - started)
                else:
                    started = time.perf_counter()
                    child.abort()
                    abort_child.append(time.perf_counter() - started)
                started = time.perf_counter()
                parent.destroy()
                destroy_parent.append(time.perf_counter() - started)
        except Exception as exc:  # noqa: BLE001 - a probe reports and goes on
            note += f" FAILED: {type(exc).__name__}: {exc}"
        print(f"nb+{kind}: total {spread(total_t)} (parent {spread(parent_t)}); child {note}; "
              f"4 B all_reduce {call_us:.2f} us a call; child destroy {spread(destroy_child)}, child abort "
              f"{spread(abort_child)}, then parent destroy {spread(destroy_parent)}", flush=True)


if __name__ == "__main__":
    main()
