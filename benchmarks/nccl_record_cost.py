"""What the NCCL flight record and GRIDCOMM_DEBUG=collectives cost per call (device machine).

One process, world size 1, three NCCL communicators (three jobs, each resolved with its own
settings): the flight record off (``GRIDCOMM_FLIGHT_RECORD=0``), on (the default), and
``GRIDCOMM_DEBUG=collectives`` (fingerprints and digests; its record is the tracker's). The same
all_reduce of 1 float32 through each, interleaved in rounds; each block of calls is timed on the
host from its first call to its last call's return (the enqueue: the GPU is drained before each
block, untimed), so the figure is the host's cost per call. Every 64th call of each is a timed
one (GPU timing events, see gridcomm._backends.nccl.timing) in all three: it is in each figure.
Medians of the rounds with min..max, and each variant's median over the record-off one.

    python benchmarks/nccl_record_cost.py [--calls 500] [--rounds 21] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import cupy  # noqa: E402

import gridcomm  # noqa: E402


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _job(**env: str) -> Any:
    """A one-rank NCCL job resolved with ``env`` set (settings are read once, at init)."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return gridcomm.init_process_group(1, 0, backend="nccl", host="127.0.0.1", port=_port(), timeout_s=60)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def block(call: Callable[..., None], x: Any, y: Any, calls: int) -> float:
    cupy.cuda.runtime.deviceSynchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        call(x, y, "sum")
    elapsed = time.perf_counter() - t0
    cupy.cuda.runtime.deviceSynchronize()
    return elapsed / calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    os.environ.setdefault("GRIDCOMM_BIND", "127.0.0.1")
    comms = {
        "record off (GRIDCOMM_FLIGHT_RECORD=0)": _job(GRIDCOMM_FLIGHT_RECORD="0"),
        "record on (default)": _job(),
        "GRIDCOMM_DEBUG=collectives": _job(GRIDCOMM_DEBUG="collectives"),
    }
    names = list(comms)
    off, on, debug = (comms[n] for n in names)
    assert off._tracker.record is None and on._tracker.record is not None and debug._tracker.fingerprints
    x = cupy.ones(1, dtype=cupy.float32)
    y = cupy.zeros(1, dtype=cupy.float32)
    try:
        for name in names:
            block(comms[name].all_reduce, x, y, args.calls)  # warm-up (and nccl4py's split)
        times: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                times[name].append(block(comms[name].all_reduce, x, y, args.calls))
        entries = [len(c._tracker.record or ()) for c in comms.values()]
        timed = [c._backend._timer.samples if c._backend._timer is not None else None for c in comms.values()]
    finally:
        for comm in comms.values():
            comm.stop()
    base = statistics.median(times[names[0]])
    rows = []
    print(f"world size 1, NCCL ({off._backend.engine} engine), all_reduce of 1 x float32, host time per call "
          f"(enqueue), {args.calls} calls x {args.rounds} rounds, interleaved")
    print("| variant | us per call, median [min..max] | over record off |")
    print("| --- | ---: | ---: |")
    for name in names:
        values = times[name]
        med = statistics.median(values)
        rows.append({"variant": name, "median_us": med * 1e6, "min_us": min(values) * 1e6,
                     "max_us": max(values) * 1e6, "over_off_us": (med - base) * 1e6})
        print(f"| {name} | {med * 1e6:.2f} [{min(values) * 1e6:.2f}..{max(values) * 1e6:.2f}] | "
              f"{(med - base) * 1e6:+.3f} us |")
    print(f"flight record entries kept: {entries}; timed collectives read by the samplers: {timed}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"calls": args.calls, "rounds": args.rounds, "rows": rows, "entries": entries,
                       "timed_read": timed}, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
