"""A coordinator kept busy past its liveness bound fails no live rank.

1,024 ranks (8 processes x 128 threads, each rank a client with its own connection, as a pod has)
join with the default liveness bound and then run barriers back to back for longer than that
bound, which keeps the coordinator's loop saturated on the CI machine's two cores. Every rank is
alive throughout; the coordinator must not read its own backlog as their silence. (At 2,048 ranks
it did: heartbeats were unary calls that waited behind the Session streams' traffic, and every
rank was failed ~15 s after the rendezvous.)
"""

from __future__ import annotations

import asyncio
import json

import pytest

from gridcomm import _config
from gridcomm._coordinator import session as server_session
from tests.support.procs import RankProcesses, assert_all_ok

PROCS = 8
THREADS = 128
#: Barriers run for this long after the rendezvous: past the default liveness bound.
HOLD_S = _config.DEFAULT_HEARTBEAT_TIMEOUT_S + 10

WORKER = """
import json, os, threading, time, gridcomm
proc = int(os.environ["GRIDCOMM_RANK"]); threads = int(os.environ["THREADS"]); world = int(os.environ["WORLD"])
port = int(os.environ["PORT"]); hold_s = float(os.environ["HOLD_S"])
threading.stack_size(512 * 1024)
clients = [gridcomm.CoordinatorClient("127.0.0.1", port, proc * threads + t, world, timeout_s=240)
           for t in range(threads)]
errors, passed = [], {}
def run(c):
    try:
        c.join()
        # Every rank runs the same number of barriers: rank 0 decides when to stop, by a key.
        n = 0
        while True:
            c.barrier("storm")
            n += 1
            if c.rank == 0 and n % 4 == 0:
                c.set(f"go/{n}", b"1" if time.monotonic() - started < hold_s else b"0")
            if n % 4 == 0 and c.get(f"go/{n}") == b"0":
                break
        passed[c.rank] = (n, c.relay_target is not None)
        c.leave()
    except Exception as exc:
        errors.append(f"rank {c.rank}: {type(exc).__name__}: {exc}"[:600])
started = time.monotonic()
ts = [threading.Thread(target=run, args=(c,)) for c in clients]
[t.start() for t in ts]; [t.join(300) for t in ts]
print(json.dumps({"errors": errors[:5], "n_errors": len(errors), "passed": passed}))
"""


@pytest.mark.timeout(400)
@pytest.mark.parametrize("relay", ["off", "auto"])
def test_a_saturated_coordinator_fails_no_live_rank(coordinator_factory, relay):
    """``off``: every rank's stream to the coordinator (the shape that failed every rank at 2,048);
    ``auto``: the relay tree that 1,024 ranks get by default (32 relays of 32)."""
    world = PROCS * THREADS
    server = coordinator_factory(world)  # the default liveness bound
    assert server.heartbeat_timeout_s == _config.DEFAULT_HEARTBEAT_TIMEOUT_S
    results = RankProcesses(WORKER, PROCS, env={"PORT": str(server.port), "THREADS": str(THREADS),
                                                "WORLD": str(world), "HOLD_S": str(HOLD_S),
                                                "GRIDCOMM_RELAY": relay}).wait(380)
    assert_all_ok(results)
    passed: dict[int, int] = {}
    errors = []
    for r in results.values():
        data = json.loads(r.stdout.strip().splitlines()[-1])
        errors += data["errors"]
        passed.update({int(k): v for k, v in data["passed"].items()})
    assert not errors, errors
    assert not server.state.failures, [f.reason for f in server.state.failures[:3]]
    assert len(passed) == world and len({n for n, _ in passed.values()}) == 1, sorted(set(passed.values()))
    through_relay = sum(relayed for _, relayed in passed.values())
    # auto: every rank but those that host a relay (ranks 0, 32, ... at 1,024) went through one, but for
    # any whose relay, starved on this machine, missed a heartbeat and was left for the coordinator.
    expected = 0 if relay == "off" else world - world // _config.auto_relay_fanin(world)
    assert expected * 0.9 <= through_relay <= expected, through_relay
    # The liveness machinery was live the whole time: every rank heartbeat, so a silent one
    # would have been failed.
    assert all(m.last_heartbeat is not None for m in server.state.members.values())
    lag = server._servicer.lag if server._servicer is not None else None
    print(f"\n{world} ranks (relay {relay}), {next(iter(passed.values()))[0]} barriers in ~{HOLD_S:.0f} s; coordinator lag "
          f"{lag.total_s:.1f} s in all, worst {lag.worst_s:.2f} s" if lag else "")
    assert server.wait_all_left(30)


LATE_READ = """
import json, os, time, gridcomm
c = gridcomm.CoordinatorClient("127.0.0.1", int(os.environ["PORT"]), int(os.environ["GRIDCOMM_RANK"]), 2, timeout_s=60)
c.join()
# A fixed count, the same for both ranks (each deciding by its own clock, one ran a barrier the
# other had left before): the sleeps alone make it last RUN_S.
n = 0
for _ in range(int(float(os.environ["RUN_S"]) / 0.05)):
    c.barrier("b")
    n += 1
    time.sleep(0.05)
print(json.dumps({"barriers": n, "watcher": None if c.failure is None else str(c.failure)}), flush=True)
c.leave()
"""


@pytest.mark.timeout(90)
def test_a_heartbeat_retried_late_in_the_bound_is_one_the_coordinator_can_answer(coordinator_factory, monkeypatch):
    """A watcher whose heartbeat went unanswered (the coordinator read it late; or its relay hung
    and it turned to the coordinator) tries again with what is left of the bound. That attempt
    asked the coordinator to hold it for the whole interval with less time than that left to its
    own deadline, so a coordinator back in time could still not answer it: the watcher took the
    coordinator for gone, stopped heartbeating, and the coordinator then failed the live rank
    (8,192 ranks with a relay per process: ranks whose relay missed a heartbeat went that way).
    Here rank 1's first heartbeat is read 0.9 x the bound late."""
    bound = 6.0
    server = coordinator_factory(2, heartbeat_timeout_s=bound)
    original = server_session.OPERATIONS["heartbeat"]
    late: set[int] = set()

    async def read_late(servicer, request, deadline):
        if request.caller.rank == 1 and not late:
            late.add(1)
            await asyncio.sleep(0.9 * bound)
        return await original(servicer, request, deadline)

    monkeypatch.setitem(server_session.OPERATIONS, "heartbeat", read_late)
    results = RankProcesses(LATE_READ, 2, env={"PORT": str(server.port), "RUN_S": str(3 * bound)}).wait(70)
    assert_all_ok(results)
    assert late, "rank 1's heartbeat did not ride its Session stream"
    for r in results.values():
        data = json.loads(r.stdout.strip().splitlines()[-1])
        assert data["watcher"] is None and data["barriers"] > 0, data
    assert not server.state.failures, [f.reason for f in server.state.failures]
