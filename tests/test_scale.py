"""2048 ranks as 32 processes x 64 threads: join + 20 barriers (`make test-scale`).

Each simulated rank has its own client (its own channel), as a real rank would.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.support.procs import RankProcesses, assert_all_ok

PROCS = int(os.environ.get("GRIDCOMM_SCALE_PROCS", "32"))
THREADS = int(os.environ.get("GRIDCOMM_SCALE_THREADS", "64"))

WORKER = """
import json, os, threading, time, gridcomm
proc = int(os.environ["GRIDCOMM_RANK"]); threads = int(os.environ["THREADS"]); world = int(os.environ["WORLD"])
port = int(os.environ["PORT"])
clients = [gridcomm.CoordinatorClient("127.0.0.1", port, proc * threads + t, world, timeout_s=120)
           for t in range(threads)]
times = {}
errors = []
def run(c):
    try:
        t0 = time.monotonic(); c.join(); t1 = time.monotonic()
        if c.rank == 0:
            c.set("blob", b"b" * 128)
        assert c.get("blob") == b"b" * 128
        t2 = time.monotonic()
        for i in range(20):
            c.barrier("scale")
        t3 = time.monotonic()
        times[c.rank] = (t0, t1, t2, t3)
        c.leave()
    except Exception as exc:
        errors.append(repr(exc))
ts = [threading.Thread(target=run, args=(c,)) for c in clients]
[t.start() for t in ts]; [t.join(200) for t in ts]
print(json.dumps({"errors": errors[:5], "n_errors": len(errors), "times": times}))
"""


@pytest.mark.scale
@pytest.mark.timeout(400)
def test_2048_ranks_join_and_20_barriers(coordinator_factory):
    world = PROCS * THREADS
    server = coordinator_factory(world)
    results = RankProcesses(WORKER, PROCS, env={"PORT": str(server.port), "THREADS": str(THREADS),
                                                "WORLD": str(world)}).wait(380)
    assert_all_ok(results)
    times = {}
    for r in results.values():
        data = json.loads(r.stdout.strip().splitlines()[-1])
        assert data["n_errors"] == 0, data["errors"]
        times.update({int(k): v for k, v in data["times"].items()})
    assert len(times) == world
    start = min(t[0] for t in times.values())
    joined = max(t[1] for t in times.values())
    blob = max(t[2] for t in times.values())
    done = max(t[3] for t in times.values())
    print(f"\n{world} ranks: join {joined - start:.2f} s (first call to last completion), "
          f"blob {blob - joined:.3f} s, 20 barriers {done - blob:.2f} s ({(done - blob) / 20 * 1e3:.0f} ms each)")
    assert server.wait_all_left(30)
    assert not server.state.failed
