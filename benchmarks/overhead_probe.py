"""Where gridcomm's per-call Python time goes (device machine).

1. Each step of a fast path timed alone (attribute reads, lookups).
2. Each collective's whole gridcomm call against the same call written by hand with raw NCCL
   arguments (the backend engine's per-call shape), NCCL itself replaced by a no-op on both sides: the
   difference is what gridcomm adds per call (a real one-rank communicator is built first, so the
   tables are the real ones).
"""

from __future__ import annotations

import os
import threading
import timeit

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import cupy  # noqa: E402
from cupy.cuda import nccl  # noqa: E402

from gridcomm._backends import nccl as gridcomm_nccl  # noqa: E402

N = 200_000


def best(fn, n: int = N) -> float:
    """Seconds per call: the best of 5 repeats."""
    return min(timeit.repeat(fn, number=n, repeat=5)) / n


x = cupy.ones(1, dtype=cupy.float32)
y = cupy.empty_like(x)
table = {(x.dtype, "sum"): (7, 1, 0)}
by_id = {id(x.dtype): (7, 1)}
steps = {
    "x.dtype": "x.dtype",
    "table[x.dtype, 'sum'] (hash of a dtype)": "table[x.dtype, 'sum']",
    "by_id[id(x.dtype)]": "by_id[id(x.dtype)]",
    "x.flags.c_contiguous": "x.flags.c_contiguous",
    "x._c_contiguous": "x._c_contiguous",
    "x.size": "x.size",
    "x.data.ptr": "x.data.ptr",
    "get_current_stream().ptr": "cupy.cuda.get_current_stream().ptr",
    "y.dtype is x.dtype": "y.dtype is x.dtype",
}
print("## one step at a time")
for name, stmt in steps.items():
    try:
        t = min(timeit.repeat(stmt, globals=globals(), number=N, repeat=5)) / N
        print(f"{name:<42}{t * 1e9:8.0f} ns")
    except Exception as exc:  # noqa: BLE001
        print(f"{name:<42} failed: {exc!r}")


def nop(*args):
    """NCCL's per-call functions (the backend's engine shape: comm before the stream), doing nothing."""


backend = gridcomm_nccl.NcclBackend(1, 0, gridcomm_nccl.new_unique_id())
backend.ready()  # nccl4py: its split done, so the functions read below are NCCL's own
print(f"engine: {backend.engine}")
STUBBED = ("_nccl_all_reduce", "_nccl_broadcast", "_nccl_all_gather", "_nccl_send", "_nccl_recv")
real = {name: getattr(backend, name) for name in STUBBED}
for name in STUBBED:
    setattr(backend, name, nop)
c = backend._c
backend.world_size = 2  # the stub never talks to a peer: lets send/recv name rank 1
y2 = cupy.empty(2, dtype=cupy.float32)
F32, SUM, stream = nccl.NCCL_FLOAT32, nccl.NCCL_SUM, cupy.cuda.get_current_stream


def raw_send_recv() -> None:
    s = stream().ptr
    nccl.groupStart()
    try:
        nop(x.data.ptr, x.size, F32, 1, c, s)
        nop(y.data.ptr, y.size, F32, 1, c, s)
    finally:
        nccl.groupEnd()


cases = {
    "all_reduce": (lambda: backend.all_reduce(x, y, "sum"),
                   lambda: nop(x.data.ptr, y.data.ptr, x.size, F32, SUM, c, stream().ptr)),
    "broadcast": (lambda: backend.broadcast(x, 0),
                  lambda: nop(x.data.ptr, x.data.ptr, x.size, F32, 0, c, stream().ptr)),
    "all_gather": (lambda: backend.all_gather(x, y2, 1),
                   lambda: nop(x.data.ptr, y2.data.ptr, x.size, F32, c, stream().ptr)),
    "send": (lambda: backend.send(x, 1), lambda: nop(x.data.ptr, x.size, F32, 1, c, stream().ptr)),
    "recv": (lambda: backend.recv(y, 1), lambda: nop(y.data.ptr, y.size, F32, 1, c, stream().ptr)),
    "send_recv": (lambda: backend.send_recv(x, y, 1), raw_send_recv),
}
print("\n## whole calls, NCCL stubbed out (ns per call; best of 5 x 200k)")
print(f"{'collective':<12}{'gridcomm':>10}{'raw':>10}{'added':>10}")
for name, (grid, raw) in cases.items():
    g, r = best(grid), best(raw)
    print(f"{name:<12}{g * 1e9:10.0f}{r * 1e9:10.0f}{(g - r) * 1e9:10.0f}")

# send_recv's added time, apart: NCCL's group calls alone, and both sides with them stubbed too.
group_pair = best(lambda: (nccl.groupStart(), nccl.groupEnd()))
print(f"\ngroupStart()+groupEnd() alone: {group_pair * 1e9:.0f} ns; Python threads: {threading.active_count()}")
real_group = backend._group_start, backend._group_end
backend._group_start = backend._group_end = nop


def raw_send_recv_nogroup() -> None:
    s = stream().ptr
    nop(x.data.ptr, x.size, F32, 1, c, s)
    nop(y.data.ptr, y.size, F32, 1, c, s)


for label, fn in (("raw, groups stubbed", raw_send_recv_nogroup),
                  ("gridcomm, groups stubbed", lambda: backend.send_recv(x, y, 1)),
                  ("raw (again, after gridcomm)", raw_send_recv)):
    print(f"send_recv {label:<30}{best(fn) * 1e9:8.0f} ns")
backend._group_start, backend._group_end = real_group
print(f"send_recv {'gridcomm (again, real groups)':<30}{best(lambda: backend.send_recv(x, y, 1)) * 1e9:8.0f} ns")
for name, fn in real.items():
    setattr(backend, name, fn)
backend.world_size = 1
backend.destroy()
