"""Forged progress cannot frame a live rank: a rank's own heartbeat claiming to be far ahead, or to
have waited in a collective for a million seconds, gets nobody else named stalled.

A real coordinator (in the test process) with a short stall bound; one OS process per rank. The
honest ranks enter and leave one collective of 'world' (their trackers say so through their own
watchers' heartbeats), then compute. The forger joins as the last rank and sends its own
heartbeats by hand with a forged progress report.
"""

from __future__ import annotations

import time

import pytest

from tests.support.procs import RankProcesses, report, wait_for

HB = 3.0
STALL = 2.0

HONEST = r"""
import os, time
import gridcomm
from gridcomm._client.tracker import Tracker

rank = int(os.environ["GRIDCOMM_RANK"]); world = int(os.environ["GRIDCOMM_WORLD_SIZE"])
client = gridcomm.CoordinatorClient("127.0.0.1", int(os.environ["PORT"]), rank, world, timeout_s=60)
client.join()
tracker = Tracker("world", client.generation)
client.track(tracker)
tracker.enter("all_reduce")
tracker.leave()
print("READY", flush=True)
time.sleep(120)  # computing: its watcher heartbeats with its progress meanwhile
"""

FORGER = r"""
import os, sys, time
import grpc
import gridcomm
from gridcomm._proto import coordinator_pb2 as pb

rank = int(os.environ["GRIDCOMM_RANK"]); world = int(os.environ["GRIDCOMM_WORLD_SIZE"])
client = gridcomm.CoordinatorClient("127.0.0.1", int(os.environ["PORT"]), rank, world, timeout_s=60)
client.join()
while not os.path.exists(os.environ["GO"]):  # forges once the honest ranks' reports are in
    time.sleep(0.05)
entered, age = int(os.environ["ENTERED"]), float(os.environ["AGE"])
forged = [pb.Progress(communicator="world", entered=entered, kind="all_reduce", age_s=age, inside=True)]
while True:
    try:
        client._stub.Heartbeat(pb.HeartbeatRequest(caller=client.caller, progress=forged, wait_s=0),
                               metadata=client.metadata, timeout=10)
        print("SENT", flush=True)
    except grpc.RpcError as exc:
        print("REFUSED", exc.code().name, exc.details(), flush=True)
    time.sleep(0.3)
"""


def _run(coordinator_factory, tmp_path, world: int, entered: int, age: float, settle_s: float) -> tuple[list, str]:
    """The job's failures once the forger has been heard for ``settle_s`` (or someone was named),
    and the forger's output."""
    server = coordinator_factory(world, heartbeat_timeout_s=HB, stall_timeout_s=STALL)
    go = tmp_path / "go"
    env = {"PORT": str(server.port), "ENTERED": str(entered), "AGE": repr(age), "GO": str(go)}
    honest = RankProcesses(HONEST, world, env=env, ranks=range(world - 1))
    forger = RankProcesses(FORGER, world, env=env, ranks=[world - 1])
    try:
        wait_for(lambda: server.state.generation == 1, "the job forms", 60)
        # The honest ranks' reports of collective #1 have reached the coordinator.
        wait_for(lambda: server.state.failures or all(
            r in getattr(server.state.progress.communicators.get("world"), "ranks", {}) for r in range(world - 1)),
            "the honest ranks report their progress", 30)
        go.touch()
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline and not server.state.failures:
            time.sleep(0.05)
        failures = list(server.state.failures)
    finally:
        honest.close()
        results = forger.wait(0.1)
    return failures, report(results)


@pytest.mark.timeout(120)
def test_one_rank_claiming_to_be_ahead_gets_only_itself_named(coordinator_factory, tmp_path):
    # Three ranks: the forger claims to have waited in all_reduce #2 for 1,000,000 s while ranks
    # 0 and 1 compute after #1. Before the checks rank 0 was named stalled at once; now the ranks
    # behind are the majority, so the forger is the odd one out, named after the stall bound.
    failures, forger = _run(coordinator_factory, tmp_path, 3, entered=2, age=1e6, settle_s=STALL + 6 * HB)
    assert failures, "the forger, the odd one out, is named after the stall bound\n" + forger
    assert [f.rank for f in failures] == [2], failures
    assert failures[0].cause == "stall" and "odd one out" in failures[0].reason, failures[0].reason


@pytest.mark.timeout(120)
def test_with_two_ranks_a_forged_claim_names_nobody(coordinator_factory, tmp_path):
    # An even split: the forger's word against rank 0's. A claim to wait in collective #5 while
    # rank 0 computes after #1 is not the shape of an honest wait (that is the very next
    # collective, which two ranks must still be named for), so nobody is named within three stall
    # bounds (before the checks rank 0 was named stalled within a second).
    failures, forger = _run(coordinator_factory, tmp_path, 2, entered=5, age=1e6, settle_s=3 * STALL + HB)
    assert not failures, failures
    assert "SENT" in forger, forger


@pytest.mark.timeout(120)
def test_an_implausible_count_is_refused_to_its_sender_alone(coordinator_factory, tmp_path):
    # entered=1e9 a second after the job formed: the forger's heartbeat is refused with
    # INVALID_ARGUMENT (its progress is not kept); rank 0 and 1 are never named.
    failures, forger = _run(coordinator_factory, tmp_path, 3, entered=10**9, age=1e6, settle_s=3 * STALL + HB)
    assert not failures, failures
    assert "REFUSED INVALID_ARGUMENT" in forger and "1000000000 collectives entered" in forger, forger
