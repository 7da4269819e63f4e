"""Where NCCL init time goes at world size 1 (on the GPU machine): raw ncclCommInitRank (CuPy), the
nccl4py engine's bounded create (a non-blocking init, then its split to a blocking child),
``init_process_group`` and ``split()``, at three poll intervals of the bounded create.

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/nccl_init_probe.py
"""

from __future__ import annotations

import os
import socket
import statistics
import time

os.environ.setdefault("GRIDCOMM_BIND", "127.0.0.1")

from cupy.cuda import nccl  # noqa: E402

import gridcomm  # noqa: E402 - after the bind address is set
from gridcomm._backends.nccl import engines  # noqa: E402


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def spread(samples: list[float]) -> str:
    return f"{statistics.median(samples) * 1e3:.1f} [{min(samples) * 1e3:.1f}..{max(samples) * 1e3:.1f}] ms"


def timed(samples: list[float], make):  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    made = make()
    samples.append(time.perf_counter() - started)
    return made


def main() -> None:
    gridcomm.init_process_group(1, 0, backend="nccl", host="127.0.0.1", port=free_port()).stop()  # warm up
    engine = engines._engine_for("nccl4py")
    for poll_max in (0.01, 0.002, 0.0005):
        engines._POLL_MAX_S = poll_max
        raw: list[float] = []
        create: list[float] = []
        init: list[float] = []
        split: list[float] = []
        for _ in range(5):
            timed(raw, lambda: nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)).destroy()
            uid = engines.new_unique_id("nccl4py")
            timed(create, lambda uid=uid: engine.create(1, 0, [uid], time.monotonic() + 30, lambda: None, "probe")).destroy()
            comm = timed(init, lambda: gridcomm.init_process_group(1, 0, backend="nccl", host="127.0.0.1",
                                                                   port=free_port()))
            timed(split, lambda comm=comm: comm.split(0))
            comm.stop()
        print(f"poll max {poll_max * 1e3:g} ms: raw {spread(raw)}, engine create {spread(create)}, "
              f"init_process_group {spread(init)}, split {spread(split)}", flush=True)


if __name__ == "__main__":
    main()
