"""Could the nccl4py engine drop its split (issue 25, item 6)? On the GPU machine, world size 1:
the time of a non-blocking ncclCommInitRank alone, of that init plus the split to a blocking child
(what the engine does now), and of CuPy's blocking init; then small all_reduce calls made straight
on the non-blocking communicator, counting how many return ncclInProgress (each then polled with
ncclCommGetAsyncError until success), against the same calls on the blocking child; then a
send/recv group to itself on each, with the communicator's state after ncclGroupEnd.

Found on an H200 (NCCL 2.28.9, nccl4py 0.6.0): non-blocking init 22 ms, with the split 62 ms; 4 B
all_reduce costs the same on both and never came back ncclInProgress; but the first send/recv
group on the non-blocking communicator returns without an error while the communicator stays
ncclInProgress (nccl4py raises nothing), and the next call is ncclInvalidArgument ("Attempt to
use communicator before the previous operation returned ncclSuccess"), which leaves it in error.
So collectives straight on the non-blocking communicator would need a state check after every
group (and, at world size >= 2 with lazy connections, after every call): not done.

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/nccl_nonblocking_probe.py
"""

from __future__ import annotations

import statistics
import time

import cupy
from cupy.cuda import nccl as cupy_nccl

from gridcomm._backends.nccl import engines

IN_PROGRESS = 7


def ms(samples: list[float]) -> str:
    return f"{statistics.median(samples) * 1e3:.1f} [{min(samples) * 1e3:.1f}..{max(samples) * 1e3:.1f}] ms"


def wait(comm, what: str) -> None:  # type: ignore[no-untyped-def]
    until = time.monotonic() + 30
    while time.monotonic() < until:
        if comm.is_valid:
            state = int(comm.get_async_error())
            if state == 0:
                return
            if state != IN_PROGRESS:
                raise RuntimeError(f"{what}: ncclResult {state}")
        time.sleep(0.0002)
    raise TimeoutError(what)


def main() -> None:
    engine = engines._engine_for("nccl4py")
    core, b = engine.core, engine.bindings
    raw, nonblocking, with_split = [], [], []
    for _ in range(6):
        started = time.perf_counter()
        cupy_nccl.NcclCommunicator(1, cupy_nccl.get_unique_id(), 0).destroy()
        raw.append(time.perf_counter() - started)

        uid = core.UniqueId.from_bytes(engines.new_unique_id("nccl4py"))
        started = time.perf_counter()
        comm = core.Communicator()
        comm.initialize(1, 0, uid, core.NCCLConfig(blocking=False))
        wait(comm, "non-blocking init")
        nonblocking.append(time.perf_counter() - started)
        child = comm.split(0, 0, core.NCCLConfig(blocking=True))
        wait(comm, "split")
        wait(child, "child")
        with_split.append(time.perf_counter() - started)
        child.destroy()
        comm.destroy()
    print(f"init at world size 1: CuPy blocking {ms(raw)}; nccl4py non-blocking {ms(nonblocking)}; "
          f"non-blocking + split to a blocking child {ms(with_split)}", flush=True)

    uid = core.UniqueId.from_bytes(engines.new_unique_id("nccl4py"))
    comm = core.Communicator()
    comm.initialize(1, 0, uid, core.NCCLConfig(blocking=False))
    wait(comm, "non-blocking init")
    child = comm.split(0, 0, core.NCCLConfig(blocking=True))
    wait(comm, "split")
    wait(child, "child")
    x = cupy.ones(1, dtype=cupy.float32)
    stream = cupy.cuda.get_current_stream().ptr
    f32, total = engine.types["float32"], engine.ops["sum"]
    for name, c in (("blocking child", child), ("non-blocking", comm)):
        handle = c._comm
        in_progress = 0
        rounds = []
        for _ in range(7):
            cupy.cuda.Device().synchronize()
            started = time.perf_counter()
            for _ in range(1000):
                try:
                    b.all_reduce(x.data.ptr, x.data.ptr, 1, f32, total, handle, stream)
                except b.NCCLError as exc:
                    if getattr(exc, "status", None) != IN_PROGRESS and "progress" not in str(exc).lower():
                        raise
                    in_progress += 1
                    wait(c, "all_reduce")
            cupy.cuda.Device().synchronize()
            rounds.append((time.perf_counter() - started) / 1000)
        print(f"4 B all_reduce on the {name} communicator: {statistics.median(rounds) * 1e6:.2f} us a call "
              f"[{min(rounds) * 1e6:.2f}..{max(rounds) * 1e6:.2f}], {in_progress} of 7000 returned ncclInProgress",
              flush=True)
    y = cupy.zeros(1, dtype=cupy.float32)
    for name, c in (("blocking child", child), ("non-blocking", comm)):
        states = []
        for _ in range(2):
            try:
                b.group_start()
                try:
                    b.send(x.data.ptr, 1, f32, 0, c._comm, stream)
                    b.recv(y.data.ptr, 1, f32, 0, c._comm, stream)
                finally:
                    b.group_end()
                states.append(f"ok, state {int(c.get_async_error())}")
            except b.NCCLError as exc:
                states.append(f"{exc}")
        print(f"send/recv group to itself on the {name} communicator: {states}", flush=True)
    child.destroy()
    comm.destroy()


if __name__ == "__main__":
    main()
