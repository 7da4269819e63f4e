"""Calls in flight end, with the watcher's error, when the watcher declares the coordinator lost.

The coordinator runs in a process of its own (``gridcomm serve``) and is frozen with SIGSTOP: its
connections stay open, nothing answers. A rank (its own process) waits in a 60 s ``get`` on its
main thread and a 60 s ``barrier`` on another; both must end within the liveness bound plus a
second of the freeze (asserted with a generous margin for a loaded machine), raising the error the
watcher reported, on the Session stream and on unary calls alike.
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
#: call's own 60 s deadline (nor its 10 s slices).
MARGIN = 4.0

RANK = r"""
import json, os, threading, time
import gridcomm

rank = int(os.environ["GRIDCOMM_RANK"])
client = gridcomm.CoordinatorClient("127.0.0.1", int(os.environ["PORT"]), rank, 2, timeout_s=60)
client.join()
if rank == 1:
    until = time.monotonic() + 60
    while client.failure is None and time.monotonic() < until:  # alive, in no call, until its watcher gives up
        time.sleep(0.1)
    raise SystemExit(0)
ended = {}

def wait_in(what, call):
    try:
        call()
        ended[what] = {"kind": "returned"}
    except gridcomm.GridcommError as exc:
        ended[what] = {"kind": type(exc).__name__, "message": str(exc), "at": time.monotonic()}

barrier = threading.Thread(target=wait_in, args=("barrier", lambda: client.barrier("never", timeout_s=60)))
barrier.start()
print("WAITING", flush=True)
wait_in("get", lambda: client.get("never", timeout_s=60))
barrier.join(70)
watcher = client.failure
print("ENDED", json.dumps({"calls": ended, "watcher": str(watcher), "watcher_kind": type(watcher).__name__}),
      flush=True)
client.close()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("session", ["client", "off"])
def test_calls_in_flight_end_with_the_watcher_when_the_coordinator_freezes(session: str) -> None:
    env = dict(os.environ, PYTHONPATH=ROOT, GRIDCOMM_HEARTBEAT_TIMEOUT_S=f"{BOUND:g}")
    with serving(["--world-size", "2", "--bind", "127.0.0.1", "--port", "0"], env) as (coordinator, line):
        assert "listening on 127.0.0.1:" in line, line
        port = line.strip().rsplit(":", 1)[1]
        ranks = [Rank(r, RANK, {"PORT": port, "GRIDCOMM_SESSION": session, "GRIDCOMM_RANK": str(r)})
                 for r in range(2)]
        try:
            # A call still on its way when the coordinator freezes is in flight all the same.
            ranks[0].expect("WAITING", 60)
            stopped_at = time.monotonic()
            os.kill(coordinator.pid, signal.SIGSTOP)
            line = ranks[0].expect("ENDED", 60)
        finally:
            for rank in ranks:
                rank.kill()
            os.kill(coordinator.pid, signal.SIGCONT)
            coordinator.kill()
    ended = json.loads(line.split(" ", 1)[1])
    assert ended["watcher_kind"] == "CoordinatorUnavailable", ended
    for what in ("get", "barrier"):
        call = ended["calls"][what]
        assert call["kind"] == "CoordinatorUnavailable" and call["message"] == ended["watcher"], (what, ended)
        took = call["at"] - stopped_at
        print(f"session={session}: {what} ended {took:.2f} s after the freeze (liveness bound {BOUND:g} s)")
        assert took < BOUND + 1.0 + MARGIN, f"{what} ended {took:.2f} s after the freeze: {ended}"
