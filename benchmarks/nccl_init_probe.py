"""Where NCCL init time goes at world size 1 (on the GPU machine), raw against gridcomm:

- ``raw``: CuPy's blocking ncclCommInitRank (what cupyx does), and the same plus a first 4 B
  all_reduce, synchronised;
- ``create``: the nccl4py engine's bounded create alone (non-blocking init; its split to the
  blocking child is then finished in the background), and create + the first all_reduce;
- ``init_process_group`` (rendezvous on a coordinator in this process, unique ID through it, the
  create), alone and + the first all_reduce; then the same with ``--work-ms`` of host work before
  the first all_reduce (a program builds its model between init and its first collective),
  against raw with the same work;
- ``split()`` of that communicator, alone and + a first all_reduce on the child.

Medians of --reps with min..max, after a warm-up.

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/nccl_init_probe.py [--reps 7] [--work-ms 100]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

os.environ.setdefault("GRIDCOMM_BIND", "127.0.0.1")

import cupy  # noqa: E402
from cupy.cuda import nccl  # noqa: E402

import gridcomm  # noqa: E402 - after the bind address is set
from gridcomm._backends import nccl as _nccl  # noqa: E402
from gridcomm._backends.nccl import engines  # noqa: E402


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def spread(samples: list[float]) -> str:
    return f"{statistics.median(samples) * 1e3:.1f} [{min(samples) * 1e3:.1f}..{max(samples) * 1e3:.1f}] ms"


def busy(seconds: float) -> None:
    """Host work (the GIL held, as model building holds it)."""
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--work-ms", type=float, default=100.0)
    args = parser.parse_args()
    work = args.work_ms / 1e3
    x = cupy.ones(1, dtype=cupy.float32)
    sync = cupy.cuda.get_current_stream().synchronize

    def first_call(comm) -> None:  # type: ignore[no-untyped-def]
        comm.allReduce(x.data.ptr, x.data.ptr, 1, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                        cupy.cuda.get_current_stream().ptr)
        sync()

    gridcomm.init_process_group(1, 0, backend="nccl", host="127.0.0.1", port=free_port()).stop()  # warm up
    rows: dict[str, list[float]] = {}

    def note(name: str, started: float) -> None:
        rows.setdefault(name, []).append(time.perf_counter() - started)

    for _ in range(args.reps):
        t = time.perf_counter()
        raw = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
        note("raw", t)
        first_call(raw)
        note("raw + first all_reduce", t)
        raw.destroy()
        t = time.perf_counter()
        raw = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
        busy(work)
        first_call(raw)
        note(f"raw + {args.work_ms:g} ms work + first all_reduce", t)
        raw.destroy()

        def made_then_first(name: str, make):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            made = make()
            note(name, t)
            made.all_reduce(x, x)
            sync()
            note(name + " + first all_reduce", t)
            return made

        uid = engines.new_unique_id("nccl4py")
        made_then_first("engine create", lambda uid=uid: _nccl.NcclBackend(1, 0, uid, engine_name="nccl4py")).destroy()
        comm = made_then_first("init_process_group", lambda: gridcomm.init_process_group(
            1, 0, backend="nccl", host="127.0.0.1", port=free_port()))
        made_then_first("split()", lambda comm=comm: comm.split(0))
        comm.stop()

        t = time.perf_counter()
        comm = gridcomm.init_process_group(1, 0, backend="nccl", host="127.0.0.1", port=free_port())
        busy(work)
        comm.all_reduce(x, x)
        sync()
        note(f"init_process_group + {args.work_ms:g} ms work + first all_reduce", t)
        comm.stop()
    for name, samples in rows.items():
        print(f"{name}: {spread(samples)}", flush=True)


if __name__ == "__main__":
    main()
