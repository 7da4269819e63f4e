"""The directed join (gridcomm/_coordinator/tree.py, gridcomm/_client/directed.py): ranks of the
relay tree that know no relay address (no GRIDCOMM_RELAY_ADDRESSES: Slurm, bare metal) ask the
coordinator where to join, are answered at once, and the members join through their group's relay.

Real coordinator (in this process), one OS process per rank.
"""

from __future__ import annotations

import json

import grpc
import pytest

from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._proto import coordinator_pb2_grpc as pb_grpc
from gridcomm._wire import WIRE
from tests.support.procs import RankProcesses, assert_all_ok
from tests.support.relayed import relayed

TOKEN = "directed-join-token"

RANK = """
import json, os, time, numpy as np, gridcomm
time.sleep(float(os.environ.get("START_DELAY_S", "0")))
comm = gridcomm.init_process_group(backend="host", timeout_s=60)
client = comm._client
x = np.ones(4)
comm.all_reduce(x, x)
comm.barrier("directed")
print(json.dumps({"through": client.joined_through, "hosts": client.relay is not None, "sum": float(x[0])}), flush=True)
comm.stop()
"""


def run_job(server, world: int, **per_rank: dict[str, str]) -> dict[int, dict]:
    env = {"GRIDCOMM_HOST": "127.0.0.1", "GRIDCOMM_PORT": str(server.port), "GRIDCOMM_TOKEN": TOKEN,
           "GRIDCOMM_COORDINATOR": "external", "GRIDCOMM_BACKEND": "host", "GRIDCOMM_RELAY": "on",
           "GRIDCOMM_RELAY_FANIN": "4"}
    results = RankProcesses(RANK, world, env=env, per_rank_env={int(k): v for k, v in per_rank.items()}).wait(100)
    assert_all_ok(results)
    return {rank: json.loads([line for line in r.stdout.splitlines() if line.startswith("{")][-1])
            for rank, r in results.items()}


@pytest.mark.timeout(150)
def test_without_addresses_members_join_through_the_relay_the_coordinator_names(coordinator_factory):
    """9 ranks, groups of 4: ranks 0 and 4 are told to host their group's relay, the others of
    their groups to join through it (none is held at the coordinator), rank 8 (a group of one)
    to join directly. The coordinator's fan-in is auto: it takes the ranks' GRIDCOMM_RELAY_FANIN."""
    world = 9
    server = coordinator_factory(world, token=TOKEN)
    out = run_job(server, world)
    assert all(v["sum"] == world for v in out.values()), out
    assert {r for r, v in out.items() if v["hosts"]} == {0, 4}, out
    assert {r for r, v in out.items() if v["through"] == "relay"} == {1, 2, 3, 5, 6, 7}, out
    contacts = server._servicer.metrics.first_contacts
    assert contacts["lead"] == 2 and contacts["relay"] == 6 and contacts["direct"] == 1, dict(contacts)
    # The members' joins reached the coordinator through their relays: 3 joins of their own
    # (ranks 0, 4, 8) and at most one message per member from the relays.
    metrics = server._servicer.metrics
    assert metrics.ops["join"] >= world and metrics.messages["join"] <= 3 + 6, dict(metrics.messages)
    assert not server.state.failures


@pytest.mark.timeout(150)
def test_members_of_a_late_leader_come_back_and_join_through_its_relay(coordinator_factory):
    """Rank 4 (group 1's leader) starts 4 s after the others: its members are told to come back
    (and hold nothing at the coordinator meanwhile), then join through its relay once it listens."""
    world = 8
    server = coordinator_factory(world, token=TOKEN)
    out = run_job(server, world, **{"4": {"START_DELAY_S": "4"}})
    assert all(v["sum"] == world for v in out.values()), out
    assert {r for r, v in out.items() if v["hosts"]} == {0, 4}, out
    assert {r for r, v in out.items() if v["through"] == "relay"} == {1, 2, 3, 5, 6, 7}, out
    contacts = server._servicer.metrics.first_contacts
    assert contacts["held"] >= 3 and contacts["relay"] == 6, dict(contacts)
    assert not server.state.failures


def first_contact(stub, rank: int, world: int = 8, **fields) -> pb.JoinResponse:
    return stub.Join(pb.JoinRequest(wire=WIRE, job_id="default", rank=rank, world_size=world, incarnation=100 + rank,
                                    hostname="h", first_contact=True, **fields), timeout=10)


def join(stub, rank: int, also: list[pb.RelayedRank] | None = None, **fields) -> grpc.StatusCode:
    """A join (with ``also``: a relay's aggregate of first joins, on a Session stream); its status."""
    request = pb.JoinRequest(job_id="default", rank=rank, world_size=8, incarnation=100 + rank, hostname="h",
                             wait_s=0, wire=WIRE, **fields)
    try:
        if also is None:
            stub.Join(request, timeout=10)
        else:
            relayed(stub, "join", request, pb.Aggregate(ranks=also), timeout_s=10)
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()


@pytest.mark.timeout(60)
def test_first_contacts_are_answered_at_once_and_a_relay_speaks_for_its_own_group(coordinator_factory, monkeypatch):
    monkeypatch.setenv("GRIDCOMM_RELAY_FANIN", "4")
    monkeypatch.delenv("GRIDCOMM_JOB_ID", raising=False)
    server = coordinator_factory(8)
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        early = first_contact(stub, 5, fanin=2)  # the coordinator's own fan-in (4) wins over a rank's
        assert early.retry_after_s > 0 and not early.host_relay and not early.relay_address, early
        assert (early.leader, early.fanin) == (4, 4)
        lead = first_contact(stub, 4)
        assert lead.host_relay and lead.leader == 4 and lead.retry_after_s == 0, lead
        # The leader's own join registers its relay (and waits for the rendezvous: wait_s=0 ends it).
        assert join(stub, 4, relay_address="127.0.0.1:1") == grpc.StatusCode.DEADLINE_EXCEEDED
        sent = first_contact(stub, 5)
        assert sent.relay_address == "127.0.0.1:1" and sent.retry_after_s == 0, sent
        # Nothing was registered by the first contacts: only rank 4 joined.
        assert set(server.state.members) == {4}
        # An aggregate naming a rank of another group beside one sent to rank 4's relay is refused.
        assert join(stub, 5, also=[pb.RelayedRank(rank=1, incarnation=101, hostname="h")]) == \
            grpc.StatusCode.INVALID_ARGUMENT
        assert set(server.state.members) == {4}
        assert join(stub, 5, also=[pb.RelayedRank(rank=6, incarnation=106, hostname="h")]) == \
            grpc.StatusCode.DEADLINE_EXCEEDED
        assert set(server.state.members) == {4, 5, 6}
        for bad in ({"rank": 8}, {"rank": 1, "world": 9}):
            with pytest.raises(grpc.RpcError) as refused:
                first_contact(stub, **bad)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad


@pytest.mark.timeout(60)
def test_a_leader_names_its_relay_in_its_first_contact_and_its_members_are_sent_there_at_once(
        coordinator_factory, monkeypatch):
    """A leader that hosts its relay before it asks names it in its first contact: its members are
    sent there from then on, before the leader's own join (no "come back"). Once the leader has
    joined, only the relay its join registered stands."""
    monkeypatch.setenv("GRIDCOMM_RELAY_FANIN", "4")
    monkeypatch.delenv("GRIDCOMM_JOB_ID", raising=False)
    server = coordinator_factory(8)
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            first_contact(stub, 0, relay_address="no port")
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "HOST:PORT" in refused.value.details()
        lead = first_contact(stub, 0, relay_address="127.0.0.1:7")
        assert lead.host_relay and lead.leader == 0, lead
        sent = first_contact(stub, 1)
        assert sent.relay_address == "127.0.0.1:7" and sent.retry_after_s == 0, sent
        # A non-leader's address is not taken as its group's relay.
        assert first_contact(stub, 5, relay_address="127.0.0.1:8").retry_after_s > 0
        assert not first_contact(stub, 6).relay_address
        assert set(server.state.members) == set()  # first contacts register nothing
        # The leader joins without a relay (it could not start one): its members join directly.
        assert join(stub, 0) == grpc.StatusCode.DEADLINE_EXCEEDED
        direct = first_contact(stub, 2)
        assert not direct.relay_address and direct.retry_after_s == 0 and not direct.host_relay, direct
    contacts = server._servicer.metrics.first_contacts
    assert contacts["relay"] == 1 and contacts["lead"] == 1, dict(contacts)


@pytest.mark.timeout(60)
def test_a_member_that_asks_before_its_leader_is_held_and_answered_when_the_leader_asks(coordinator_factory,
                                                                                        monkeypatch):
    """A member's first contact made before its leader's is held (not answered "come back") and
    answered with the relay's address the moment the leader names it."""
    import concurrent.futures
    import time

    monkeypatch.setenv("GRIDCOMM_RELAY_FANIN", "4")
    monkeypatch.delenv("GRIDCOMM_JOB_ID", raising=False)
    server = coordinator_factory(8)
    server._servicer._tree.hold_s = 30.0  # longer than this machine may stall between the two asks
    with grpc.insecure_channel(server.address) as channel, concurrent.futures.ThreadPoolExecutor(1) as pool:
        stub = pb_grpc.CoordinatorStub(channel)
        held = pool.submit(lambda: stub.Join(pb.JoinRequest(job_id="default", rank=5, world_size=8, incarnation=105,
                                                            hostname="h", first_contact=True, wire=WIRE), timeout=60))
        deadline = time.monotonic() + 10
        while server._servicer.metrics.first_contacts["held"] < 1:
            assert time.monotonic() < deadline, "the member's first contact was never held"
            time.sleep(0.01)
        assert not held.done()
        first_contact(stub, 4, relay_address="127.0.0.1:9")
        asked = time.monotonic()
        answer = held.result(timeout=50)
        assert time.monotonic() - asked < 25, "answered at the hold's end, not when its leader asked"
        assert answer.relay_address == "127.0.0.1:9" and answer.retry_after_s == 0, answer
    contacts = server._servicer.metrics.first_contacts
    assert contacts["relay"] == 1 and not contacts["retry"], dict(contacts)


@pytest.mark.timeout(150)
def test_a_rank_that_guessed_it_leads_stops_its_relay_when_the_coordinator_groups_otherwise(
        coordinator_factory, monkeypatch):
    """The ranks' fan-in (2) makes ranks 2 and 6 guess they lead and start a relay before they ask;
    the coordinator's own fan-in (4) wins: they stop it and join through ranks 0's and 4's."""
    monkeypatch.setenv("GRIDCOMM_RELAY_FANIN", "4")
    world = 8
    server = coordinator_factory(world, token=TOKEN)
    out = run_job(server, world, **{str(r): {"GRIDCOMM_RELAY_FANIN": "2"} for r in range(world)})
    assert all(v["sum"] == world for v in out.values()), out
    assert {r for r, v in out.items() if v["hosts"]} == {0, 4}, out
    assert {r for r, v in out.items() if v["through"] == "relay"} == {1, 2, 3, 5, 6, 7}, out
    assert not server.state.failures


def test_a_large_jobs_members_spread_their_first_asks_and_a_small_jobs_do_not():
    """Up to 4,096 ranks every member asks at once; above, the members' first asks are spread
    uniformly so that a job started at once asks at about 4,000 a second (65,536 ranks: over
    (65,536 - 4,096) / 4,000 = 15.36 s). Leaders are not delayed (they name their relay)."""
    from gridcomm._client.directed import start_delay_s

    assert {start_delay_s(n) for n in (2, 256, 2048, 4096) for _ in range(50)} == {0.0}
    draws = [start_delay_s(65_536) for _ in range(400)]
    assert all(0.0 <= d <= 15.36 for d in draws), max(draws)
    assert max(draws) > 12.0 and min(draws) < 3.0, (min(draws), max(draws))
    assert max(start_delay_s(8192) for _ in range(400)) <= 1.024


@pytest.mark.timeout(60)
def test_in_a_large_job_a_leader_asks_at_once_and_a_member_waits_its_turn(coordinator_factory, monkeypatch):
    """65,536 ranks: a member draws its first ask's delay from 0 to 15.36 s (here pinned to the
    top of the range), a leader (it names the relay it hosts) asks at once, so that its members
    find its relay when they ask. Real coordinator; the asks are the client's own."""
    import time

    import gridcomm
    from gridcomm._client import directed

    world = 65_536
    server = coordinator_factory(world, token=TOKEN)
    monkeypatch.setattr(directed.random, "random", lambda: 0.99)
    monkeypatch.setenv("GRIDCOMM_TOKEN", TOKEN)
    monkeypatch.setenv("GRIDCOMM_RELAY_FANIN", "4")
    leader = gridcomm.CoordinatorClient("127.0.0.1", server.port, 4, world, timeout_s=30)
    member = gridcomm.CoordinatorClient("127.0.0.1", server.port, 5, world, timeout_s=30)
    try:
        # Within a grace far shorter than the member's drawn delay (15.2 s): the leader is directed
        # (it hosts its group's relay), the member has not asked by then.
        answer = directed.ask(leader, time.monotonic() + 8.0, relay_address="127.0.0.1:1")
        assert answer is not None and answer.host_relay and answer.leader == 4, answer
        assert directed.ask(member, time.monotonic() + 2.0) is None
        assert server._servicer.metrics.first_contacts["lead"] == 1, dict(server._servicer.metrics.first_contacts)
        assert sum(server._servicer.metrics.first_contacts.values()) == 1, dict(server._servicer.metrics.first_contacts)
    finally:
        leader.close()
        member.close()
