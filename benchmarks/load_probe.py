"""Where the CPU goes per barrier under load: P processes x T ranks (threads, one CoordinatorClient
each) against a coordinator in a process of its own, back-to-back whole-job barriers, every
process busy at once (the rendezvous benchmark's layout above 128 ranks).

Prints, per barrier, summed over the P processes: wall time; the processes' CPU; of it the rank
threads' (their own thread clocks) with their context switches, the background loop thread's and
gRPC's event-engine threads'; and the coordinator process's CPU. ``session_probe.py`` measures one
process alone, which is quieter; this one shows what only load shows (on 2 cores, every Python
step on a rank's thread cost several times its time alone: BENCHMARKS.md, attempt 14). Compare
with ``grpc_floor.py --processes P --threads T``, the same pattern on bare gRPC.

    python benchmarks/load_probe.py --processes 32 --threads 16 --barriers 300
    python benchmarks/load_probe.py --gridcomm /tmp/other/checkout     # A/B, interleave runs
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import threading
import time
from typing import Any

from session_probe import (  # this directory is sys.path[0]
    TICK,
    gate_and_collect,
    serve,
    stop_server,
    switches,
    thread_stats,
)


def ranks_process(path: str, port: int, ranks: range, world: int, barriers: int, fresh: bool, joined: Any, go: Any,
                  out: Any) -> None:
    sys.path.insert(0, path)
    import gridcomm

    clients = [gridcomm.CoordinatorClient("127.0.0.1", port, r, world, timeout_s=120) for r in ranks]
    joins = [threading.Thread(target=c.join) for c in clients]
    for t in joins:
        t.start()
    for t in joins:
        t.join(300)
    joined.put(os.getpid())
    go.wait(600)
    rank_stats: list[tuple[float, int, int]] = []  # appended once per thread (append is atomic)

    def run(client: Any) -> None:
        cpu, (voluntary, involuntary) = time.thread_time(), switches()
        for i in range(barriers):
            client.barrier(f"probe-{i}" if fresh else "probe")
        voluntary_end, involuntary_end = switches()
        rank_stats.append((time.thread_time() - cpu, voluntary_end - voluntary, involuntary_end - involuntary))

    # Python names its threads only for itself: find the loop's OS thread id by its name.
    loop_tids = {str(t.native_id) for t in threading.enumerate() if t.name == "gridcomm-loop"}
    before = thread_stats(os.getpid())
    wall, cpu = time.perf_counter(), time.process_time()
    threads = [threading.Thread(target=run, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(1200)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    after = thread_stats(os.getpid())

    def ticks(pick: Any) -> float:
        return sum(n - before.get(tid, (name, 0))[1] for tid, (name, n) in after.items() if pick(tid, name)) / TICK

    loop = ticks(lambda tid, name: tid in loop_tids)
    engine = ticks(lambda tid, name: name == "event_engine")
    out.put((wall, cpu, *(sum(column) for column in zip(*rank_stats, strict=True)), loop, engine))
    for client in clients:
        client.leave()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=32)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--barriers", type=int, default=300)
    ap.add_argument("--names", choices=("same", "fresh"), default="same",
                    help="one barrier name throughout, or a new one per barrier (as benchmarks/rendezvous.py does)")
    ap.add_argument("--gridcomm", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    help="the checkout whose gridcomm package to measure (default: this one)")
    args = ap.parse_args()
    world = args.processes * args.threads
    ctx = mp.get_context("spawn")
    out, stop, joined, go = ctx.Queue(), ctx.Event(), ctx.Queue(), ctx.Event()
    server = ctx.Process(target=serve, args=(args.gridcomm, world, out, stop))
    server.start()
    workers: list[Any] = []
    try:
        port, server_pid = out.get(timeout=60)
        workers = [ctx.Process(target=ranks_process, args=(args.gridcomm, port, range(p * args.threads, (p + 1) * args.threads),
                                                           world, args.barriers, args.names == "fresh", joined, go, out))
                   for p in range(args.processes)]
        results, server_cpu = gate_and_collect(workers, joined, go, out, server_pid, 1200)
        n = args.barriers
        total = [sum(r[i] for r in results) for i in range(1, 7)]
        print(f"gridcomm, {args.processes} processes x {args.threads} threads: {max(r[0] for r in results) / n * 1e3:.2f} ms per "
              f"barrier; per barrier, clients {total[0] / n * 1e3:.3f} ms of CPU (rank threads {total[1] / n * 1e3:.3f} ms, "
              f"their voluntary and involuntary switches {total[2] / n:.1f} and {total[3] / n:.1f}; loop threads "
              f"{total[4] / n * 1e3:.3f} ms; gRPC event engine {total[5] / n * 1e3:.3f} ms), coordinator {server_cpu / n * 1e3:.3f} ms")
        return 0
    finally:
        for w in workers:
            w.join(60)
            if w.is_alive():
                w.kill()
        stop_server(stop, server)


if __name__ == "__main__":
    sys.exit(main())
