"""Where a process's CPU goes per barrier: T ranks (threads, one CoordinatorClient each) of one
process against a coordinator in a process of its own, back-to-back whole-job barriers.

Prints, per barrier: wall time; the rank threads' CPU (their own thread clocks) and their
context switches; the background loop thread's CPU; gRPC's event-engine threads' CPU; the
coordinator process's CPU. One process alone is far quieter than the 32-process benchmark on a
shared 2-core machine, so a change of a few percent in the client shows here first.

    python benchmarks/session_probe.py --ranks 16 --barriers 3000
    python benchmarks/session_probe.py --ranks 16 --gridcomm /tmp/other/checkout   # A/B
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import os
import sys
import threading
import time
from typing import Any

from rendezvous import proc_stats  # this directory is the script's: sys.path[0]

TICK = os.sysconf("SC_CLK_TCK")


def thread_stats(pid: int) -> dict[str, tuple[str, int]]:
    """thread id -> (name, user + system clock ticks) of every thread of ``pid``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended meanwhile
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        out[tid] = (name, int(fields[11]) + int(fields[12]))
    return out


def switches() -> tuple[int, int]:
    """(voluntary, involuntary) context switches of the calling thread so far."""
    with open(f"/proc/self/task/{threading.get_native_id()}/status") as f:
        values = dict(line.split(":", 1) for line in f if "ctxt" in line)
    return int(values["voluntary_ctxt_switches"]), int(values["nonvoluntary_ctxt_switches"])


def gate_and_collect(workers: list[Any], ready: Any, go: Any, out: Any, server_pid: int,
                     result_timeout_s: float) -> tuple[list[Any], float]:
    """Starts the worker processes, waits until each has said it is ready, opens ``go`` and
    collects one result from each; returns them with the server's CPU seconds in between."""
    for worker in workers:
        worker.start()
    for _ in workers:
        ready.get(timeout=300)
    server_cpu = proc_stats(server_pid)["cpu_s"]
    go.set()
    results = [out.get(timeout=result_timeout_s) for _ in workers]
    return results, proc_stats(server_pid)["cpu_s"] - server_cpu


def stop_server(stop: Any, server: Any) -> None:
    """Tells the coordinator process to stop and waits for it (bounded; killed if it hangs)."""
    stop.set()
    server.join(30)
    if server.is_alive():
        server.kill()


def serve(path: str, ranks: int, out: Any, stop: Any) -> None:
    sys.path.insert(0, path)
    import gridcomm

    coordinator = gridcomm.Coordinator(ranks, bind="127.0.0.1", port=0).start()
    out.put((coordinator.port, os.getpid()))
    stop.wait(1800)
    coordinator.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--barriers", type=int, default=3000)
    ap.add_argument("--gridcomm", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    help="the checkout whose gridcomm package to measure (default: this one)")
    args = ap.parse_args()
    sys.path.insert(0, args.gridcomm)
    import gridcomm

    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=serve, args=(args.gridcomm, args.ranks, out, stop))
    server.start()
    try:
        port, server_pid = out.get(timeout=60)
        clients = [gridcomm.CoordinatorClient("127.0.0.1", port, r, args.ranks, timeout_s=60) for r in range(args.ranks)]
        joins = [threading.Thread(target=c.join) for c in clients]
        for t in joins:
            t.start()
        for t in joins:
            t.join(120)
        totals: collections.Counter[str] = collections.Counter()
        lock = threading.Lock()

        def run(client: gridcomm.CoordinatorClient) -> None:
            cpu, (vol, invol) = time.thread_time(), switches()
            for _ in range(args.barriers):
                client.barrier("probe", timeout_s=60)
            vol_end, invol_end = switches()
            with lock:
                totals["cpu"] += time.thread_time() - cpu
                totals["vol"] += vol_end - vol
                totals["invol"] += invol_end - invol

        before, server_before = thread_stats(os.getpid()), proc_stats(server_pid)["cpu_s"]
        started = time.perf_counter()
        threads = [threading.Thread(target=run, args=(c,)) for c in clients]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        wall = time.perf_counter() - started
        after, server_cpu = thread_stats(os.getpid()), proc_stats(server_pid)["cpu_s"] - server_before
        n = args.barriers
        # Python names its threads only for itself: find the loop's OS thread id by its name.
        loop_tids = {str(t.native_id) for t in threading.enumerate() if t.name == "gridcomm-loop"}
        by_name: collections.Counter[str] = collections.Counter()
        for tid, (name, ticks) in after.items():
            by_name["gridcomm-loop" if tid in loop_tids else name] += ticks - before.get(tid, (name, 0))[1]
        print(f"{args.ranks} ranks, {n} barriers: {wall / n * 1e6:.0f} us per barrier; per barrier: "
              f"rank threads {totals['cpu'] / n * 1e6:.0f} us of CPU, {totals['vol'] / n:.1f} voluntary and "
              f"{totals['invol'] / n:.1f} involuntary switches; loop {by_name['gridcomm-loop'] / TICK / n * 1e6:.0f} us; "
              f"gRPC event engine {by_name['event_engine'] / TICK / n * 1e6:.0f} us; "
              f"coordinator process {server_cpu / n * 1e6:.0f} us")
        for client in clients:
            client.leave()
        return 0
    finally:
        stop_server(stop, server)


if __name__ == "__main__":
    sys.exit(main())
