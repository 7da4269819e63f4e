"""What progress counting and collective fingerprints (GRIDCOMM_DEBUG=collectives) cost per call.

One process, world size 1, host backend (no GPU needed): the same small all_reduce through the
backend's own method (nothing counted), through a communicator (counted), and through a
communicator with fingerprints, interleaved in rounds; medians of the rounds with min..max.

    python benchmarks/progress_cost.py [--calls 20000] [--rounds 9]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import numpy as np


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    os.environ.setdefault("GRIDCOMM_BIND", "127.0.0.1")
    import gridcomm

    plain = gridcomm.init_process_group(1, 0, backend="host", host="127.0.0.1", port=_port())
    os.environ["GRIDCOMM_DEBUG"] = "collectives"
    debug = gridcomm.init_process_group(1, 0, backend="host", host="127.0.0.1", port=_port())  # a second job, resolved with fingerprints on
    del os.environ["GRIDCOMM_DEBUG"]
    assert debug is not None and debug._tracker.fingerprints and not plain._tracker.fingerprints
    x = np.ones(4, dtype=np.float32)
    y = np.empty_like(x)
    variants = {"backend (not counted)": plain._backend.all_reduce, "communicator (counted)": plain.all_reduce,
                "communicator, GRIDCOMM_DEBUG=collectives": debug.all_reduce}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(args.rounds):
        order = list(variants.items())
        order = order[r % len(order):] + order[:r % len(order)]
        for name, call in order:
            t0 = time.perf_counter()
            for _ in range(args.calls):
                call(x, y, "sum")
            times[name].append((time.perf_counter() - t0) / args.calls)
    base = statistics.median(times["backend (not counted)"])
    print(f"world size 1, host backend, all_reduce of 4 x float32, {args.calls} calls x {args.rounds} rounds")
    print("| path | us per call, median [min..max] | over the backend's own |")
    print("| --- | ---: | ---: |")
    for name, samples in times.items():
        med = statistics.median(samples)
        print(f"| {name} | {med * 1e6:.2f} [{min(samples) * 1e6:.2f}..{max(samples) * 1e6:.2f}] | "
              f"{(med - base) * 1e6:+.2f} us |")
    debug.stop()
    plain.stop()


if __name__ == "__main__":
    main()
