"""Where a gridcomm all_reduce spends its Python time (device machine): each step timed alone."""

from __future__ import annotations

import timeit

import cupy

x = cupy.ones(1, dtype=cupy.float32)
y = cupy.empty_like(x)
table = {(x.dtype, "sum"): (7, 1, 0)}
steps = {
    "x.dtype": "x.dtype",
    "table[x.dtype, 'sum']": "table[x.dtype, 'sum']",
    "x.flags.c_contiguous": "x.flags.c_contiguous",
    "x._c_contiguous": "x._c_contiguous",
    "x.size": "x.size",
    "x.data.ptr": "x.data.ptr",
    "get_current_stream().ptr": "cupy.cuda.get_current_stream().ptr",
    "y.dtype is x.dtype": "y.dtype is x.dtype",
}
for name, stmt in steps.items():
    try:
        n = 200_000
        t = min(timeit.repeat(stmt, globals=globals(), number=n, repeat=5)) / n
        print(f"{name:<28}{t * 1e9:8.0f} ns")
    except Exception as exc:  # noqa: BLE001
        print(f"{name:<28} failed: {exc!r}")
print([n for n in dir(cupy.cuda.stream) if "current" in n.lower()])
