"""Calls a relay carries for other ranks end, with the watcher's error, when the coordinator freezes.

As tests/test_inflight_calls.py, through the relay tree: the coordinator runs in a process of its
own (``gridcomm serve``), three ranks (each a process) with GRIDCOMM_RELAY=on and a fan-in of 4,
so rank 0 hosts its group's relay and ranks 1 and 2 reach the coordinator through it. Rank 2 waits
in a 60 s ``get`` on its main thread and a 60 s ``barrier`` on another, both carried by the relay;
the coordinator is frozen with SIGSTOP (its connections stay open, nothing answers). The relay
answers rank 2's heartbeats itself, so before the relay counted the coordinator's silence rank 2
never learnt of it and both calls waited for their deadlines; now both end within the liveness
bound plus a second (asserted with a margin for a loaded machine), raising the error rank 2's
watcher reported: CoordinatorUnavailable, naming the coordinator's silence, as a rank dialling it
directly gets. Killed instead (SIGKILL: the relay's stream to it breaks), both calls end as a direct
rank's do: CoordinatorUnavailable naming the coordinator's address, within the same bound.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.support.procs import ROOT
from tests.support.ranks import Rank, serving

BOUND = 2.0
#: What the test allows past the bound plus a second: a loaded machine's scheduling, never the
#: calls' own 60 s deadline (nor their 10 s slices).
MARGIN = 4.0

RANK = r"""
import json, os, threading, time
import gridcomm

rank = int(os.environ["GRIDCOMM_RANK"])
client = gridcomm.CoordinatorClient("127.0.0.1", int(os.environ["PORT"]), rank, 3, timeout_s=60)
client.join()
client.barrier("joined")  # every rank's stream has moved to its relay
if rank != 2:
    print("READY", json.dumps({"hosts": client.relay.target if client.relay is not None else None}), flush=True)
    until = time.monotonic() + 90
    while time.monotonic() < until:  # alive (rank 0's relay with it) until the test ends it
        time.sleep(0.1)
    raise SystemExit(0)
ended = {}

def wait_in(what, call):
    try:
        call()
        ended[what] = {"kind": "returned"}
    except gridcomm.GridcommError as exc:
        ended[what] = {"kind": type(exc).__name__, "message": str(exc), "at": time.monotonic()}

relay = client.relay_target
barrier = threading.Thread(target=wait_in, args=("barrier", lambda: client.barrier("never", timeout_s=60)))
barrier.start()
print("WAITING", json.dumps({"relay": relay}), flush=True)
wait_in("get", lambda: client.get("never", timeout_s=60))
barrier.join(70)
watcher = client.failure
print("ENDED", json.dumps({"calls": ended, "watcher": str(watcher), "watcher_kind": type(watcher).__name__}),
      flush=True)
client.close()
"""


@pytest.mark.timeout(150)
@pytest.mark.parametrize("signum", [signal.SIGSTOP, signal.SIGKILL], ids=["frozen", "killed"])
def test_calls_a_relay_carries_end_when_the_coordinator_is_lost(signum: int) -> None:
    env = dict(os.environ, PYTHONPATH=ROOT, GRIDCOMM_HEARTBEAT_TIMEOUT_S=f"{BOUND:g}")
    with serving(["--world-size", "3", "--bind", "127.0.0.1", "--port", "0"], env) as (coordinator, line):
        assert "listening on 127.0.0.1:" in line, line
        port = line.strip().rsplit(":", 1)[1]
        ranks = [Rank(r, RANK, {"PORT": port, "GRIDCOMM_RANK": str(r), "GRIDCOMM_RELAY": "on",
                                "GRIDCOMM_RELAY_FANIN": "4", "GRIDCOMM_HEARTBEAT_TIMEOUT_S": f"{BOUND:g}"})
                 for r in range(3)]
        try:
            hosted = json.loads(ranks[0].expect("READY", 60).split(" ", 1)[1])["hosts"]
            ranks[1].expect("READY", 60)
            waiting = json.loads(ranks[2].expect("WAITING", 60).split(" ", 1)[1])
            assert hosted is not None and waiting["relay"] == hosted, (hosted, waiting)
            # A call still on its way when the coordinator freezes is in flight all the same.
            stopped_at = time.monotonic()
            os.kill(coordinator.pid, signum)
            line = ranks[2].expect("ENDED", 90)
        finally:
            for rank in ranks:
                rank.kill()
            os.kill(coordinator.pid, signal.SIGCONT)
            coordinator.kill()
    ended = json.loads(line.split(" ", 1)[1])
    if signum == signal.SIGKILL:
        for what in ("get", "barrier"):
            call = ended["calls"][what]
            took = call["at"] - stopped_at
            print(f"through the relay, coordinator killed: {what} ended {took:.2f} s after: {call['message']}")
            assert call["kind"] == "CoordinatorUnavailable", (what, ended)
            assert f"the coordinator at 127.0.0.1:{port}" in call["message"], (what, ended)
            assert took < BOUND + 1.0 + MARGIN, f"{what} ended {took:.2f} s after the kill: {ended}"
        return
    assert ended["watcher_kind"] == "CoordinatorUnavailable", ended
    assert "the coordinator at 127.0.0.1:" in ended["watcher"] and "has not answered" in ended["watcher"], ended
    for what in ("get", "barrier"):
        call = ended["calls"][what]
        assert call["kind"] == "CoordinatorUnavailable" and call["message"] == ended["watcher"], (what, ended)
        took = call["at"] - stopped_at
        print(f"through the relay: {what} ended {took:.2f} s after the freeze (liveness bound {BOUND:g} s): "
              f"{call['message']}")
        assert took < BOUND + 1.0 + MARGIN, f"{what} ended {took:.2f} s after the freeze: {ended}"
