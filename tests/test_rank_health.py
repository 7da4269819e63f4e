"""Per-rank health in every phase, with grpc's standard health client against real processes.

``""`` is liveness: SERVING on every live rank in every phase, whatever happened to its peers.
``gridcomm.v1.Coordinator`` is readiness: SERVING only while the rank's communicator is up, rank 0
included (not before the rendezvous completes, although it hosts the coordinator), NOT_SERVING
after a peer's failure, SERVING again once a new communicator is up (a recovery).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from gridcomm import GridcommError
from gridcomm._client.client import fetch_status
from tests.support.procs import ROOT
from tests.support.ranks import LIVENESS, READINESS, Rank, check, free_port, kill_all, observe, wait_status

HEARTBEAT_S = 2.0

# One rank: its health server first (as a script that loads data would), then the phases the
# test drives. GRIDCOMM_HEALTH_PORT (rank 2) or a free port reported on stdout (ranks 0 and 1).
RANK = r"""
import os, sys
import numpy, gridcomm

rank = int(os.environ["GRIDCOMM_RANK"])
port = gridcomm.start_health_server(None if os.environ.get("GRIDCOMM_HEALTH_PORT") else 0)
print("HEALTH", port, flush=True)
for line in sys.stdin:
    command = line.split()
    if command[0] == "init":
        comm = gridcomm.init_process_group(3, rank, backend="host")
        print("UP", flush=True)
    elif command[0] == "die":
        os._exit(9)
    elif command[0] == "collective":
        try:
            comm.all_reduce(numpy.ones(4), numpy.empty(4))
            print("NOFAIL", flush=True)
        except gridcomm.RankFailedError as exc:
            print("FAILED", exc.rank, flush=True)
    elif command[0] == "recover":
        comm.stop()
        comm = gridcomm.init_process_group(2, rank, backend="host", port=int(command[1]))
        print("UP2", comm.world_size, flush=True)
    elif command[0] == "stop":
        comm.stop()
        print("STOPPED", flush=True)
    elif command[0] == "exit":
        break
"""


def _health(ports: dict[int, int], ranks, service: str) -> dict[int, str]:
    return {r: check(ports[r], service) for r in ranks}


@pytest.mark.timeout(150)
def test_liveness_and_readiness_per_rank_in_every_phase():
    coordinator_port, second_port, rank2_health = free_port(), free_port(), free_port()
    env = {"GRIDCOMM_PORT": str(coordinator_port), "GRIDCOMM_HOST": "127.0.0.1", "GRIDCOMM_BIND": "127.0.0.1",
           "GRIDCOMM_WORLD_SIZE": "3", "GRIDCOMM_HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_S), "GRIDCOMM_TIMEOUT_S": "60"}
    ranks = [Rank(r, RANK, {**env, "GRIDCOMM_RANK": str(r),
                            **({"GRIDCOMM_HEALTH_PORT": str(rank2_health)} if r == 2 else {})}) for r in range(3)]
    try:
        ports = {r.rank: int(r.expect("HEALTH", 30).split()[1]) for r in ranks}
        assert ports[2] == rank2_health

        # Phase 0: health up, nothing else (a script loading its data): live, not ready.
        assert _health(ports, range(3), LIVENESS) == {0: "SERVING", 1: "SERVING", 2: "SERVING"}
        assert _health(ports, range(3), READINESS) == {0: "NOT_SERVING", 1: "NOT_SERVING", 2: "NOT_SERVING"}

        # Phase 1: ranks 0 and 1 wait in the rendezvous for rank 2. Rank 0 hosts the coordinator,
        # and is still not ready: its communicator does not exist yet.
        ranks[0].send("init")
        ranks[1].send("init")
        _wait_joined(coordinator_port, 2, 30.0)
        assert _health(ports, (0, 1), LIVENESS) == {0: "SERVING", 1: "SERVING"}
        assert _health(ports, (0, 1), READINESS) == {0: "NOT_SERVING", 1: "NOT_SERVING"}

        # Phase 2: every rank up: live and ready.
        ranks[2].send("init")
        for r in ranks:
            r.expect("UP", 30)
        assert _health(ports, range(3), LIVENESS) == {0: "SERVING", 1: "SERVING", 2: "SERVING"}
        assert _health(ports, range(3), READINESS) == {0: "SERVING", 1: "SERVING", 2: "SERVING"}

        # Phase 3: rank 2 dies. The survivors turn not ready within the liveness bound, and stay
        # live (kubelet must not restart them), also past the heartbeat timeout, while they
        # hold their failed communicator (writing a checkpoint, say).
        ranks[2].send("die")
        assert ranks[2].wait(10) == 9
        for r in (0, 1):
            wait_status(ports[r], READINESS, "NOT_SERVING", HEARTBEAT_S + 5)
        for r in (0, 1):
            assert observe(ports[r], LIVENESS, 2 * HEARTBEAT_S + 1) == {"SERVING"}, ranks[r].report()
        for r in (0, 1):
            ranks[r].send("collective")
            assert ranks[r].expect("FAILED", 20) == "FAILED 2"
        # One crash reads as one failure: the survivors, still heartbeating, were not expired.
        status = fetch_status("127.0.0.1", coordinator_port)
        assert [f.rank for f in status.failures] == [2], [(f.rank, f.reason) for f in status.failures]
        assert not status.serving  # the coordinator's own readiness follows the job
        assert check(coordinator_port, LIVENESS) == "SERVING" and check(coordinator_port, READINESS) == "NOT_SERVING"
        assert _health(ports, (0, 1), LIVENESS) == {0: "SERVING", 1: "SERVING"}

        # Phase 4: a recovery (here: the survivors build a new communicator of two): ready again.
        ranks[0].send(f"recover {second_port}")
        ranks[1].send(f"recover {second_port}")
        for r in (0, 1):
            assert ranks[r].expect("UP2", 60) == "UP2 2"
        assert _health(ports, (0, 1), READINESS) == {0: "SERVING", 1: "SERVING"}
        assert _health(ports, (0, 1), LIVENESS) == {0: "SERVING", 1: "SERVING"}

        # Phase 5: stopped: not ready, and live for as long as the process runs.
        for r in (0, 1):
            ranks[r].send("stop")
        for r in (0, 1):
            ranks[r].expect("STOPPED", 30)
        assert _health(ports, (0, 1), READINESS) == {0: "NOT_SERVING", 1: "NOT_SERVING"}
        assert _health(ports, (0, 1), LIVENESS) == {0: "SERVING", 1: "SERVING"}
        for r in (0, 1):
            ranks[r].send("exit")
        for r in (0, 1):
            assert ranks[r].wait(30) == 0, ranks[r].report()
            assert "Traceback" not in ranks[r].stderr(), ranks[r].report()
    finally:
        kill_all(ranks)


def _wait_joined(port: int, count: int, timeout_s: float) -> None:
    """Until the coordinator lists ``count`` members (the ranks are inside their join)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if len(fetch_status("127.0.0.1", port, timeout_s=2).members) >= count:
                return
        except GridcommError:
            pass  # not listening yet
        assert time.monotonic() < deadline, f"{count} ranks did not join within {timeout_s} s"
        time.sleep(0.05)  # polling the coordinator's answer, not a synchronisation by time


@pytest.mark.timeout(60)
def test_a_health_port_in_use_is_refused_clearly():
    """A clash names the port and the setting, without grpc's own add_port.cc line."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        code = f"import gridcomm; gridcomm.start_health_server({port}, bind='127.0.0.1')"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                              env={"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"})
    assert done.returncode != 0
    assert f"port {port} is already in use" in done.stderr and "GRIDCOMM_HEALTH_PORT" in done.stderr, done.stderr
    assert "add_port" not in done.stderr
