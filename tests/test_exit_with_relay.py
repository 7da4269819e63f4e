"""A process whose ranks host relays for one another exits cleanly (code 0) right after they leave,
every time. At that moment its relays' servers are stopping (their groups just left) or still
serving; cancelling a server's stop half-way, or its handlers with the server still up, crashed
the process in grpcio's core after the program's last line (SIGSEGV), in a few exits of a hundred.
Real processes: several rounds of a job of PROCS processes, each of THREADS ranks that lead groups of FANIN."""

from __future__ import annotations

import pytest

from tests.support.procs import RankProcesses, report

PROCS = 4
THREADS = 32
FANIN = 4
ROUNDS = 12

CODE = r"""
import os, threading, gridcomm
proc, threads = int(os.environ["GRIDCOMM_RANK"]), int(os.environ["THREADS"])
port, world = int(os.environ["PORT"]), int(os.environ["WORLD"])
clients = [gridcomm.CoordinatorClient("127.0.0.1", port, proc * threads + t, world, timeout_s=60) for t in range(threads)]
errors = []
def run(c):
    try:
        c.join()
        for _ in range(3):
            c.barrier("b")
        c.leave()
    except Exception as exc:
        errors.append(repr(exc))
ts = [threading.Thread(target=run, args=(c,)) for c in clients]
[t.start() for t in ts]; [t.join(60) for t in ts]
print("END", "errors" if errors else "ok", errors[:2], flush=True)
"""


@pytest.mark.timeout(400)
def test_a_process_hosting_relays_exits_cleanly_right_after_its_ranks_leave(coordinator_factory):
    world = PROCS * THREADS
    for round_ in range(ROUNDS):
        server = coordinator_factory(world)
        results = RankProcesses(CODE, PROCS, env={"PORT": str(server.port), "WORLD": str(world), "THREADS": str(THREADS),
                                                  "GRIDCOMM_RELAY": "on", "GRIDCOMM_RELAY_FANIN": str(FANIN),
                                                  "PYTHONFAULTHANDLER": "1"}).wait(90)
        assert all("END ok" in r.stdout for r in results.values()), report(results)
        assert all(r.returncode == 0 for r in results.values()), f"round {round_}:\n" + report(results)
        server.stop()
