"""The relay (gridcomm/_relay/): ranks that dial a relay instead of the coordinator.

Real OS processes per rank, a real coordinator, a real relay (in this process, or in a process of
its own where the test kills it). The ranks are bare clients configured by the environment only
(GRIDCOMM_RELAY_ADDRESS, as `gridcomm launch` sets it).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import grpc
import pytest

from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._relay.server import Relay
from tests.support.procs import ROOT, RankProcesses, assert_all_ok, wait_for

TOKEN = "relay-test-token"

RANK = """
import json, os, sys, time, gridcomm
c = gridcomm.CoordinatorClient(timeout_s=60)
c.join()
if c.rank == 0:
    c.set("blob", b"x" * 300)
assert c.get("blob") == b"x" * 300
n = int(os.environ.get("BARRIERS", "10"))
pause = float(os.environ.get("PAUSE_S", "0"))
late, first_late = float(os.environ.get("LATE_S", "0")), float(os.environ.get("FIRST_LATE_S", "0"))
try:
    for i in range(n):
        if late or (first_late and i == 0):
            time.sleep(late or first_late)
        c.barrier("step")
        if pause:
            time.sleep(pause)
        if i == 0:
            print("STEP", flush=True)
    print(json.dumps({"ok": True, "relay": c.relay_target}), flush=True)
    c.leave()
except gridcomm.RankFailedError as exc:
    print(json.dumps({"ok": False, "failed": exc.rank, "error": str(exc)}), flush=True)
"""


def env_for(server, relay_target: str, **extra: str) -> dict[str, str]:
    return {"GRIDCOMM_HOST": "127.0.0.1", "GRIDCOMM_PORT": str(server.port), "GRIDCOMM_TOKEN": TOKEN,
            "GRIDCOMM_RELAY_ADDRESS": relay_target, **extra}


def last_json(result) -> dict:
    return json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])


@pytest.mark.timeout(120)
def test_ranks_reach_the_coordinator_through_a_relay_as_aggregates(coordinator_factory):
    world = 4
    server = coordinator_factory(world, token=TOKEN)
    relay = Relay(server.address, token=TOKEN).start()
    try:
        results = RankProcesses(RANK, world, env=env_for(server, relay.target, BARRIERS="40")).wait(90)
        assert_all_ok(results)
        for r in results.values():
            assert last_json(r) == {"ok": True, "relay": relay.target}
        # Arrivals that reach the relay together go up as one operation (opportunistic: whatever
        # arrived since the last upstream write). The 4 ranks are released at one instant by each
        # barrier's one answer, so over 40 barriers some of their next arrivals coincide.
        assert relay.aggregated > 0 and relay.carried < world * 42, (relay.aggregated, relay.carried)
        assert not server.state.failures
    finally:
        relay.stop()


@pytest.mark.timeout(120)
def test_a_relay_sends_a_barrier_up_once_its_ranks_have_arrived(coordinator_factory):
    """A barrier's arrivals wait at the relay for the relay's other ranks in it (the barrier
    cannot pass without them): with one rank 0.2 s behind the others at every barrier, the
    coordinator still gets one message per barrier, where sending what had arrived gave two."""
    world, n = 4, 10
    server = coordinator_factory(world, token=TOKEN)
    relay = Relay(server.address, token=TOKEN).start()
    try:
        results = RankProcesses(RANK, world, env=env_for(server, relay.target, BARRIERS=str(n)),
                                per_rank_env={3: {"LATE_S": "0.2"}}).wait(90)
        assert_all_ok(results)
        assert relay.ranks_carried["barrier"] == world * n
        # Why not exactly n: a barrier whose late rank comes more than HOLD_S after the
        # first (a stalled machine) goes up in two.
        assert n <= relay.sent["barrier"] <= n + 2, dict(relay.sent)
        assert not server.state.failures
    finally:
        relay.stop()


@pytest.mark.timeout(120)
def test_a_rank_that_does_not_come_holds_its_siblings_arrivals_only_briefly(coordinator_factory):
    """Rank 3 reaches the first barrier 8 s after the others: the coordinator learns of ranks
    0-2's arrival after the relay's hold (HOLD_S, 1 s), long before rank 3 comes, so
    status names rank 3 alone as missing; then the barrier passes for all."""
    from gridcomm._proto import coordinator_pb2_grpc as pb_grpc
    from gridcomm._relay.server import HOLD_S

    assert HOLD_S < 8.0 / 2
    world = 4
    server = coordinator_factory(world, token=TOKEN)
    relay = Relay(server.address, token=TOKEN).start()
    ranks = RankProcesses(RANK, world, env=env_for(server, relay.target, BARRIERS="2"),
                          per_rank_env={3: {"FIRST_LATE_S": "8"}})
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.CoordinatorStub(channel)

            def three_arrived() -> list:
                status = stub.Status(pb.StatusRequest(), metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=10)
                rows = [(list(b.arrived_ranks), list(b.missing_ranks)) for b in status.barriers if b.name == "step"]
                return rows if rows and len(rows[0][0]) == 3 else []

            seen = wait_for(three_arrived, "ranks 0-2's arrival at the coordinator", 60.0)
            assert seen == [([0, 1, 2], [3])], seen
            assert relay.ranks_carried["barrier"] == 3  # rank 3 has not come yet: its siblings went up without it
        results = ranks.wait(90)
        assert_all_ok(results)
        assert not server.state.failures
    finally:
        ranks.close()
        relay.stop()


@pytest.mark.timeout(60)
def test_a_relay_refuses_a_wrong_token_and_undecodable_bytes(coordinator_factory):
    server = coordinator_factory(2, token=TOKEN)
    relay = Relay(server.address, token=TOKEN).start()
    try:
        channel = grpc.insecure_channel(relay.target)
        session = channel.stream_stream("/gridcomm.v1.Coordinator/Session")
        with pytest.raises(grpc.RpcError) as wrong:
            list(session(iter([pb.SessionRequest().SerializeToString()]), metadata=(("authorization", "Bearer nope"),),
                         timeout=10))
        assert wrong.value.code() == grpc.StatusCode.UNAUTHENTICATED and "token is wrong" in wrong.value.details()
        with pytest.raises(grpc.RpcError) as garbage:
            list(session(iter([b"\xff\xff\xff"]), metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=10))
        assert garbage.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # An operation that names nothing is answered as the coordinator would, on a stream that stays up.
        replies = list(session(iter([pb.SessionRequest(ops=[pb.SessionOp(id=7)]).SerializeToString()]),
                               metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=10))
        result = pb.SessionReply.FromString(replies[0]).results[0]
        assert result.id == 7 and result.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        channel.close()
    finally:
        relay.stop()


@pytest.mark.timeout(120)
def test_a_rank_killed_behind_a_relay_is_named_within_the_bound(coordinator_factory):
    world, bound = 3, 3.0
    server = coordinator_factory(world, token=TOKEN, heartbeat_timeout_s=bound)
    relay = Relay(server.address, token=TOKEN, heartbeat_timeout_s=bound).start()
    ranks = RankProcesses(RANK, world, env=env_for(server, relay.target, BARRIERS="1000", PAUSE_S="0.05"))
    try:
        wait_for(lambda: len(server.state.members) == world and server.state.complete, "the rendezvous", 60)
        time.sleep(1.0)
        killed_at = time.monotonic()
        os.kill(ranks.procs[2].pid, signal.SIGKILL)
        wait_for(lambda: server.state.failures, "rank 2's failure", 4 * bound)
        named_after = time.monotonic() - killed_at
        failure = server.state.failures[0]
        assert failure.rank == 2, failure.reason
        results = ranks.wait(60)
        for rank in (0, 1):
            out = last_json(results[rank])
            assert out["ok"] is False and out["failed"] == 2, out
        print(f"\nrank 2 killed behind the relay: named after {named_after:.1f} s (bound {bound:g} s): {failure.reason}")
        assert named_after < 2 * bound + 3
    finally:
        ranks.close()
        relay.stop()


COMMUNICATOR_RANK = """
import json, os, time, numpy as np, gridcomm
comm = gridcomm.init_process_group(backend="host", timeout_s=60)
x = np.ones(4)
for _ in range(3):
    comm.all_reduce(x, x)
print("IDLE", flush=True)
time.sleep(float(os.environ["IDLE_S"]))  # between collectives: every heartbeat repeats its progress
comm.all_reduce(x, x)
comm.barrier("end")
print(json.dumps({"ok": True}), flush=True)
comm.stop()
"""


@pytest.mark.timeout(120)
def test_a_relay_sends_progress_that_did_not_change_as_a_flag_and_the_coordinator_keeps_it_fresh(
        coordinator_factory):
    """Ranks with a communicator idle between collectives: each heartbeat repeats its progress.
    The relay sends those entries up once, then only says they are the same; the coordinator
    keeps the report it has and dates it afresh (what a stall's naming reads), and nobody fails."""
    world, bound = 3, 3.0
    server = coordinator_factory(world, token=TOKEN, heartbeat_timeout_s=bound)
    relay = Relay(server.address, token=TOKEN, heartbeat_timeout_s=bound).start()
    ranks = RankProcesses(COMMUNICATOR_RANK, world, env=env_for(
        server, relay.target, IDLE_S="6", GRIDCOMM_COORDINATOR="external", GRIDCOMM_HEARTBEAT_TIMEOUT_S=f"{bound:g}",
        GRIDCOMM_BACKEND="host"))
    try:
        progress = server.state.progress

        def reports() -> dict[int, tuple[int, float]] | None:
            comm = progress.communicators.get("world")
            if comm is None or len(comm.ranks) < world or relay.progress_same < 2 * world:
                return None
            return {r: (e.entered, e.reported_at) for r, e in comm.ranks.items()}

        before = wait_for(reports, "repeated progress sent up as a flag", 60)
        sent, same = relay.progress_sent, relay.progress_same
        after = wait_for(lambda: (lambda now: now if now and all(now[r][1] > before[r][1] for r in now) else None)(
            reports()), "the coordinator dating the repeated reports afresh", 4 * bound)
        # The counts are the ones the ranks last reported in full, not lost.
        assert all(after[r][0] == before[r][0] >= 3 for r in after), (before, after)
        wait_for(lambda: relay.progress_same >= same + 3 * world, "three more heartbeats of flags", 4 * bound)
        # At most one report per rank in full meanwhile (a rank whose last heartbeat before the
        # window still said it was inside its third all_reduce).
        assert relay.progress_sent - sent <= world, (sent, relay.progress_sent)
        results = ranks.wait(60)
        assert_all_ok(results)
        assert not server.state.failures
    finally:
        ranks.close()
        relay.stop()


RELAY_PROCESS = """
import sys, time, gridcomm
from gridcomm._relay.server import Relay
relay = Relay(sys.argv[1], token=sys.argv[2]).start()
print(relay.target, flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(120)
def test_when_the_relay_dies_its_ranks_go_on_with_the_coordinator(coordinator_factory):
    world = 3
    server = coordinator_factory(world, token=TOKEN)
    with relay_process(server) as (relay, target), \
            RankProcesses(RANK, world, env=env_for(server, target, BARRIERS="60", PAUSE_S="0.1")) as ranks:
        wait_for(lambda: server.state.complete, "the rendezvous", 60)
        time.sleep(1.0)
        relay.kill()
        results = ranks.wait(90)
    assert_all_ok(results)
    for r in results.values():
        out = last_json(r)
        # Every rank finished all its barriers, now without the relay; nobody was failed.
        assert out == {"ok": True, "relay": None}, out
    assert not server.state.failures, [f.reason for f in server.state.failures]


@contextlib.contextmanager
def relay_process(server) -> Iterator[tuple[subprocess.Popen, str]]:
    """A relay in a process of its own (the test kills or stops it); yields it and its address."""
    relay = subprocess.Popen([sys.executable, "-c", RELAY_PROCESS, server.address, TOKEN], stdout=subprocess.PIPE,
                             text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        target = relay.stdout.readline().strip()
        assert target, "the relay process did not start"
        yield relay, target
    finally:
        if relay.poll() is None:
            relay.kill()
        relay.wait(10)


RANK_WATCHED = RANK.replace('"relay": c.relay_target}', '"relay": c.relay_target, "watcher": str(c.failure or "")}')


@pytest.mark.timeout(120)
def test_when_the_relay_hangs_its_ranks_go_on_with_the_coordinator(coordinator_factory):
    """A relay that stops answering (SIGSTOP: hung, or starved) is left within the wait plus
    max(2 s, bound / 4), and its ranks heartbeat the coordinator directly from then on: nobody
    is failed, and no rank's watcher takes the coordinator for gone (the relay's death, which
    drops its connections, is the test above)."""
    world, bound = 3, 6.0
    server = coordinator_factory(world, token=TOKEN, heartbeat_timeout_s=bound)
    # Each rank runs barriers for over twice the liveness bound after the hang (150 x 0.1 s).
    with relay_process(server) as (relay, target), \
            RankProcesses(RANK_WATCHED, world, env=env_for(server, target, BARRIERS="150", PAUSE_S="0.1")) as ranks:
        wait_for(lambda: server.state.complete, "the rendezvous", 60)
        time.sleep(2.0)
        relay.send_signal(signal.SIGSTOP)
        results = ranks.wait(90)
    assert_all_ok(results)
    for r in results.values():
        out = last_json(r)
        assert out == {"ok": True, "relay": None, "watcher": ""}, out
    assert not server.state.failures, [f.reason for f in server.state.failures]


TREE_WORKER = """
import json, os, threading, time, gridcomm
proc = int(os.environ["GRIDCOMM_RANK"]); threads = int(os.environ["THREADS"]); world = int(os.environ["WORLD"])
port = int(os.environ["PORT"])
time.sleep(float(os.environ.get("START_DELAY_S", "0")))
clients = [gridcomm.CoordinatorClient("127.0.0.1", port, proc * threads + t, world, token=os.environ["TOKEN"],
                                      timeout_s=float(os.environ.get("TIMEOUT_S", "60"))) for t in range(threads)]
out = {}
def run(c):
    try:
        c.join()
        if c.rank == 0:
            c.set("blob", b"b" * 100)
        assert c.get("blob") == b"b" * 100
        for i in range(int(os.environ["BARRIERS"])):
            c.barrier("tree")
            time.sleep(float(os.environ["PAUSE_S"]))
        out[c.rank] = {"ok": True, "relayed": c.relay_target is not None, "hosts": c.relay is not None,
                       "carried": dict(c.relay.ranks_carried) if c.relay is not None else {}}
        c.leave()
    except gridcomm.RankFailedError as exc:
        out[c.rank] = {"ok": False, "failed": exc.rank}
    except Exception as exc:
        out[c.rank] = {"ok": False, "error": repr(exc)[:300]}
ts = [threading.Thread(target=run, args=(c,)) for c in clients]
[t.start() for t in ts]
print("JOINING", flush=True)
[t.join(120) for t in ts]
print(json.dumps(out), flush=True)
"""


def tree(server, procs: int, threads: int, barriers: int, pause_s: float, **extra: str) -> RankProcesses:
    return RankProcesses(TREE_WORKER, procs, env={
        "PORT": str(server.port), "THREADS": str(threads), "WORLD": str(procs * threads), "TOKEN": TOKEN,
        "BARRIERS": str(barriers), "PAUSE_S": str(pause_s), "GRIDCOMM_RELAY": "on", "GRIDCOMM_RELAY_FANIN": "8",
        **extra})


def free_port_block(count: int) -> int:
    """A multiple of 10 whose next ``count`` ports are free on loopback now (for a relay template)."""
    for _ in range(200):
        base = random.randrange(20000, 30000, 10)
        socks = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise AssertionError("no block of free ports")


def session_streams(server) -> dict[str, int]:
    """The coordinator's Session streams and unary Joins, counted as each ended (its metrics' source)."""
    counts = server._servicer.metrics.rpcs
    return {"Session": sum(n for (m, _), n in counts.items() if m == "Session"),
            "Join": sum(n for (m, _), n in counts.items() if m == "Join")}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("leaders_late", [False, True], ids=["together", "leaders-start-late"])
def test_ranks_join_through_their_groups_relay_when_its_address_is_known(coordinator_factory, leaders_late):
    """GRIDCOMM_RELAY_ADDRESSES (what the Kubernetes detectors derive from pod names): the joins go
    to the relays, so the coordinator holds a stream per group, not per rank. A member whose relay
    is not up yet (its leader's pod starts later) waits for it instead of dialling the coordinator."""
    procs, threads = 4, 8
    base = free_port_block(procs)
    server = coordinator_factory(procs * threads, token=TOKEN)
    template = f"127.0.0.1:{base // 10}{{group}}"
    if leaders_late:
        # 8 processes of 4 ranks: the leaders (ranks 0, 8, 16, 24) are in processes 0, 2, 4, 6,
        # which start 3 s late; the members in processes 1, 3, 5, 7 find no relay at first.
        ranks = RankProcesses(TREE_WORKER, 8, env={
            "PORT": str(server.port), "THREADS": "4", "WORLD": str(procs * threads), "TOKEN": TOKEN,
            "BARRIERS": "10", "PAUSE_S": "0", "GRIDCOMM_RELAY": "on", "GRIDCOMM_RELAY_FANIN": "8",
            "GRIDCOMM_RELAY_ADDRESSES": template},
            per_rank_env={p: {"START_DELAY_S": "3"} for p in range(0, 8, 2)})
    else:
        ranks = tree(server, procs, threads, 10, 0.0, GRIDCOMM_RELAY_ADDRESSES=template)
    results = ranks.wait(100)
    assert_all_ok(results)
    out = {int(k): v for r in results.values() for k, v in last_json(r).items()}
    assert len(out) == 32 and all(v["ok"] for v in out.values()), out
    assert all(v["relayed"] == (r % 8 != 0) for r, v in out.items()), out
    # 4 leaders' own streams and 4 relays' streams upstream; no member dialled the coordinator.
    counts = wait_for(lambda: (c := session_streams(server))["Session"] >= 8 and c, "the streams to end", 20)
    assert counts == {"Session": 8, "Join": 0}, counts
    # The members' joins reached the coordinator as aggregates: a relay holds its group's first
    # joins for the rest of the group (at most HOLD_S), where each went up alone before (4
    # leaders' joins + 28 members' = 32 messages).
    metrics = server._servicer.metrics
    assert metrics.ops["join"] >= 32 and metrics.messages["join"] <= (8 if not leaders_late else 20), \
        (metrics.ops["join"], metrics.messages["join"])
    assert not server.state.failures


@pytest.mark.timeout(120)
def test_a_member_whose_relay_never_answers_joins_the_coordinator_directly(coordinator_factory):
    """Group 1's relay port is taken, so its leader hosts no relay: its members try it for a
    quarter of their join's timeout, then join the coordinator directly; the job goes on."""
    procs, threads = 4, 8
    base = free_port_block(procs)
    server = coordinator_factory(procs * threads, token=TOKEN)
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", base + 1))  # bound, not listening: connections are refused
    try:
        results = tree(server, procs, threads, 10, 0.0, GRIDCOMM_RELAY_ADDRESSES=f"127.0.0.1:{base // 10}{{group}}",
                       TIMEOUT_S="20").wait(100)
    finally:
        blocker.close()
    assert_all_ok(results)
    out = {int(k): v for r in results.values() for k, v in last_json(r).items()}
    assert len(out) == 32 and all(v["ok"] for v in out.values()), out
    assert not out[8]["hosts"] and all(not out[r]["relayed"] for r in range(8, 16)), out
    assert all(v["relayed"] == (r % 8 != 0) for r, v in out.items() if not 8 <= r < 16), out
    counts = wait_for(lambda: (c := session_streams(server))["Session"] >= 13 and c, "the streams to end", 20)
    # 3 relays upstream, 4 leaders, and group 1's 7 members at the coordinator (stream or unary join).
    assert counts["Session"] + counts["Join"] >= 14 and counts["Session"] <= 14, counts
    assert not server.state.failures


@pytest.mark.timeout(120)
def test_the_relay_tree_carries_every_group_through_its_first_rank(coordinator_factory):
    procs, threads = 4, 8
    server = coordinator_factory(procs * threads, token=TOKEN)
    results = tree(server, procs, threads, 10, 0.0).wait(100)
    assert_all_ok(results)
    out = {int(k): v for r in results.values() for k, v in last_json(r).items()}
    assert len(out) == 32 and all(v["ok"] for v in out.values()), out
    # Ranks 0, 8, 16, 24 host their group's relay and dial the coordinator; the rest go through it.
    assert {r for r, v in out.items() if v["hosts"]} == {0, 8, 16, 24}
    assert all(v["relayed"] == (r % 8 != 0) for r, v in out.items())
    # Each relay carried all 8 ranks' 10 barriers and the get: its own rank's too, so that the
    # coordinator gets one message per group and barrier, not a second from the relay's rank.
    assert all(out[r]["carried"].get("barrier") == 80 and out[r]["carried"].get("get") == 8 for r in (0, 8, 16, 24)), \
        {r: out[r]["carried"] for r in (0, 8, 16, 24)}
    messages = server._servicer.metrics.messages["barrier"]
    assert 40 <= messages <= 320 - 40, messages  # at least one per group and barrier; never one per rank
    assert not server.state.failures


@pytest.mark.timeout(120)
def test_a_relay_of_the_tree_dies_with_its_rank_and_that_rank_is_named(coordinator_factory):
    procs, threads, bound = 4, 8, 3.0
    server = coordinator_factory(procs * threads, token=TOKEN, heartbeat_timeout_s=bound)
    ranks = tree(server, procs, threads, 1000, 0.05)
    try:
        wait_for(lambda: server.state.complete, "the rendezvous", 60)
        time.sleep(1.5)
        os.kill(ranks.procs[1].pid, signal.SIGKILL)  # ranks 8..15: rank 8 hosts their relay
        results = ranks.wait(60)
        failures = list(server.state.failures)
        # The first failure is of the killed group; survivors that exit after it without leaving
        # may be recorded after it (their connections drop), never as silent.
        assert failures and 8 <= failures[0].rank < 16, [f.reason for f in failures]
        assert all(8 <= f.rank < 16 or "lost its connection" in f.reason for f in failures), [f.reason for f in failures]
        for proc in (0, 2, 3):
            out = last_json(results[proc])
            # Every other rank, whether it went through a relay or not, learns of the failure.
            assert all(not v["ok"] and 8 <= v.get("failed", -1) < 16 for v in out.values()), out
    finally:
        ranks.close()


SHRINK_WORKER = """
import json, os, threading, time, gridcomm
proc = int(os.environ["GRIDCOMM_RANK"]); threads = int(os.environ["THREADS"]); world = int(os.environ["WORLD"])
port = int(os.environ["PORT"])
clients = [gridcomm.CoordinatorClient("127.0.0.1", port, proc * threads + t, world, token=os.environ["TOKEN"],
                                      timeout_s=60) for t in range(threads)]
out = {}
def run(c):
    try:
        c.join()
        try:
            while True:
                c.barrier("before")
                time.sleep(0.05)
        except gridcomm.RankFailedError as exc:
            failed = exc.rank
        for attempt in range(10):
            try:
                generation = c.recover("shrink")
                break
            except gridcomm.RankFailedError:
                continue  # another rank of the dead group was named meanwhile: call again
        for i in range(10):
            c.barrier("after")
        out[c.rank] = {"ok": True, "failed": failed, "members": len(c.members), "relayed": c.relay_target is not None,
                       "generation": generation}
        c.leave()
    except Exception as exc:
        out[c.rank] = {"ok": False, "error": repr(exc)[:300]}
ts = [threading.Thread(target=run, args=(c,)) for c in clients]
[t.start() for t in ts]
[t.join(120) for t in ts]
print(json.dumps(out), flush=True)
"""


@pytest.mark.timeout(150)
def test_a_shrink_after_a_group_died_goes_on_through_the_surviving_relays(coordinator_factory):
    procs, threads, bound = 3, 8, 3.0
    server = coordinator_factory(procs * threads, token=TOKEN, heartbeat_timeout_s=bound)
    ranks = RankProcesses(SHRINK_WORKER, procs, env={
        "PORT": str(server.port), "THREADS": str(threads), "WORLD": str(procs * threads), "TOKEN": TOKEN,
        "GRIDCOMM_RELAY": "on", "GRIDCOMM_RELAY_FANIN": "8"})
    try:
        wait_for(lambda: server.state.complete, "the rendezvous", 60)
        time.sleep(1.0)
        os.kill(ranks.procs[1].pid, signal.SIGKILL)  # ranks 8..15, and the relay of their group
        results = ranks.wait(120)
        out = {int(k): v for proc in (0, 2) for k, v in last_json(results[proc]).items()}
        assert len(out) == 16 and all(v["ok"] for v in out.values()), out
        # The survivors formed the next generation without ranks 8..15, and its barriers went on
        # through the relays of their own groups (ranks 0 and 16 host them).
        assert all(v["members"] == 16 and 8 <= v["failed"] < 16 for v in out.values()), out
        assert all(v["relayed"] == (r % 8 != 0) for r, v in out.items()), out
        assert len({v["generation"] for v in out.values()}) == 1
    finally:
        ranks.close()
