"""``gridcomm demo``: a coordinator plus a few local rank processes, every step checked, timed."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

from gridcomm._client import CoordinatorClient
from gridcomm._server import Coordinator

BLOB_BYTES = 128


def _rank_main(rank: int, world: int, port: int, barriers: int) -> int:
    client = CoordinatorClient("127.0.0.1", port, rank, world, timeout_s=60.0)
    t0 = time.perf_counter()
    client.join()
    t_join = time.perf_counter() - t0
    expected = bytes((i * 7 + 3) % 256 for i in range(BLOB_BYTES))
    t0 = time.perf_counter()
    if rank == 0:
        client.set("demo/blob", expected)
    blob = client.get("demo/blob")
    t_blob = time.perf_counter() - t0
    if blob != expected:
        print(json.dumps({"rank": rank, "error": "blob mismatch"}), flush=True)
        return 1
    times = []
    for _ in range(barriers):
        t0 = time.perf_counter()
        client.barrier("demo")
        times.append(time.perf_counter() - t0)
    client.leave()
    print(json.dumps({"rank": rank, "join_s": t_join, "blob_s": t_blob, "barrier_s": times}), flush=True)
    return 0


def run_demo(nproc: int = 4, backend: str | None = None, barriers: int = 100) -> int:
    """Starts a coordinator and ``nproc`` rank processes; prints a table; returns an exit code."""
    server = Coordinator(nproc, bind="127.0.0.1", port=0).start()
    procs = []
    try:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        for rank in range(nproc):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "gridcomm._demo", str(rank), str(nproc), str(server.port), str(barriers)],
                stdout=subprocess.PIPE, text=True, env=env,
            ))
        results = []
        failed = 0
        for proc in procs:
            out, _ = proc.communicate(timeout=120)
            if proc.returncode != 0:
                failed += 1
            for line in out.splitlines():
                if line.startswith("{"):
                    results.append(json.loads(line))
        server.wait_all_left(5.0)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        server.stop()
    print(f"gridcomm demo: {nproc} ranks, coordinator on 127.0.0.1:{server.port}, {barriers} barriers each")
    print(f"{'rank':>4}  {'join ms':>8}  {'blob ms':>8}  {'barrier median us':>17}  {'barrier p90 us':>14}  check")
    for r in sorted(results, key=lambda r: r["rank"]):
        if "error" in r:
            print(f"{r['rank']:>4}  {r['error']}")
            continue
        b = sorted(r["barrier_s"])
        p90 = b[int(0.9 * (len(b) - 1))] if b else 0.0
        print(f"{r['rank']:>4}  {r['join_s'] * 1e3:8.1f}  {r['blob_s'] * 1e3:8.2f}  "
              f"{(statistics.median(b) if b else 0) * 1e6:17.0f}  {p90 * 1e6:14.0f}  ok")
    ok = failed == 0 and len([r for r in results if "error" not in r]) == nproc
    print("all checks passed" if ok else f"FAILED: {failed} rank(s) exited non-zero")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(_rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])))
