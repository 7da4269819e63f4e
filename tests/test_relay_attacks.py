"""A relay as strict as the coordinator (gridcomm/_relay/children.py): a token holder's
stream to a relay can hurt nobody but itself.

Ranks 0 and 1 are real OS processes whose Session streams go through a real relay (in this
process) to a real coordinator, running barriers among themselves; rank 2, the attacker, joins in
this process and then speaks to the relay on a raw Session stream of its own.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

import gridcomm
from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._proto import coordinator_pb2_grpc as pb_grpc
from gridcomm._relay.server import Relay
from tests.support.procs import RankProcesses, assert_all_ok, wait_for
from tests.support.relayed import relayed

TOKEN = "relay-attack-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)

VICTIM = """
import json, os, time, gridcomm
c = gridcomm.CoordinatorClient(timeout_s=60)
c.join()
# A count, not a clock: both ranks must stop after the same barrier (about DURATION_S unloaded).
n = int(float(os.environ["DURATION_S"]) / 0.06)
try:
    for _ in range(n):
        c.barrier("victims", participants=[0, 1])
        time.sleep(0.05)
    c.barrier("done", participants=[0, 1])
    print(json.dumps({"ok": True, "barriers": n, "relay": c.relay_target}), flush=True)
    c.leave()
except gridcomm.GridcommError as exc:
    print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
"""


class Job:
    """The coordinator, the relay, victims 0 and 1 and the attacker's own client (rank 2)."""

    def __init__(self, factory: Any, *, bound: float, duration_s: float) -> None:
        self.server = factory(3, token=TOKEN, heartbeat_timeout_s=bound)
        self.relay = Relay(self.server.address, token=TOKEN, heartbeat_timeout_s=bound, world_size=3).start()
        self.victims = RankProcesses(VICTIM, 3, ranks=[0, 1], env={
            "GRIDCOMM_HOST": "127.0.0.1", "GRIDCOMM_PORT": str(self.server.port), "GRIDCOMM_TOKEN": TOKEN,
            "GRIDCOMM_RELAY_ADDRESS": self.relay.target, "DURATION_S": str(duration_s)})
        self.attacker = gridcomm.CoordinatorClient("127.0.0.1", self.server.port, 2, 3, token=TOKEN, timeout_s=60)
        self.attacker.join()
        wait_for(lambda: self.server.state.barriers.get("victims"), "the victims' first barrier", 30)

    def caller(self, rank: int = 2, incarnation: int | None = None) -> pb.Caller:
        state = self.server.state
        return pb.Caller(job_id=state.job_id, rank=rank, generation=state.generation,
                         incarnation=self.attacker.incarnation if incarnation is None else incarnation)

    def victims_ok(self) -> None:
        results = self.victims.wait(90)
        assert_all_ok(results)
        for r in results.values():
            out = json.loads(r.stdout.strip().splitlines()[-1])
            assert out["ok"] and out["relay"] == self.relay.target, out
        assert not self.server.state.failures, [f.reason for f in self.server.state.failures]

    def close(self) -> None:
        self.victims.close()
        try:
            self.attacker.leave(timeout_s=10)
        except gridcomm.GridcommError:
            pass
        self.attacker.close()
        self.relay.stop()


@pytest.fixture
def job(coordinator_factory) -> Iterator[Any]:
    made: list[Job] = []

    def make(**kw: float) -> Job:
        made.append(Job(coordinator_factory, **kw))
        return made[-1]

    yield make
    for j in made:
        j.close()


class Stream:
    """The attacker's raw Session stream to the relay: ops written from a queue, answers collected."""

    def __init__(self, target: str) -> None:
        self._ops: queue.Queue[pb.SessionRequest | None] = queue.Queue()
        self.results: list[pb.SessionResult] = []
        self.status: grpc.StatusCode | None = None
        self._channel = grpc.insecure_channel(target)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _requests(self) -> Iterator[pb.SessionRequest]:
        while (request := self._ops.get()) is not None:
            yield request

    def _read(self) -> None:
        try:
            for reply in pb_grpc.CoordinatorStub(self._channel).Session(self._requests(), metadata=AUTH, timeout=120):
                self.results.extend(reply.results)
            self.status = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            self.status = exc.code()

    def send(self, ops: list[pb.SessionOp]) -> None:
        self._ops.put(pb.SessionRequest(ops=ops))

    def close(self) -> None:
        self._ops.put(None)
        self._reader.join(30)
        self._channel.close()


def codes(results: list[pb.SessionResult]) -> set[str]:
    return {grpc.StatusCode.OK.name if not r.code else next(c.name for c in grpc.StatusCode if c.value[0] == r.code)
            for r in results}


@pytest.mark.timeout(150)
def test_a_heartbeat_naming_another_rank_through_a_relay_is_refused_for_its_sender(job):
    """(a) Before: the relay kept the forged heartbeat as rank 1's, the coordinator refused it in
    the relay's aggregate, and live rank 1 was named failed a bound later."""
    bound = 3.0
    j = job(bound=bound, duration_s=3 * bound + 2)
    stream = Stream(j.relay.target)
    try:
        forged = j.caller(rank=1, incarnation=12345)
        sent, end = 0, time.monotonic() + 2.5 * bound
        while time.monotonic() < end:
            sent += 1
            stream.send([pb.SessionOp(id=sent, heartbeat=pb.HeartbeatRequest(caller=forged, wait_s=0.0))])
            time.sleep(0.02)
        wait_for(lambda: len(stream.results) >= sent, "the forged heartbeats' answers", 30)
    finally:
        stream.close()
    j.victims_ok()
    assert codes(stream.results) == {"FAILED_PRECONDITION"}, codes(stream.results)
    assert "rank 1 called heartbeat as process" in stream.results[0].details, stream.results[0].details


@pytest.mark.timeout(150)
def test_a_child_naming_more_ranks_than_the_job_has_is_refused_alone(job):
    """(b) Before: 23 ranks named in a job of 3 made the relay's whole heartbeat aggregate too big
    for the coordinator, which refused it; every rank behind the relay was named failed."""
    bound = 3.0
    j = job(bound=bound, duration_s=3 * bound + 2)
    stream = Stream(j.relay.target)
    try:
        named = list(range(3, 26))
        sent, end = 0, time.monotonic() + 2.5 * bound
        while time.monotonic() < end:
            stream.send([pb.SessionOp(id=sent + i, heartbeat=pb.HeartbeatRequest(caller=j.caller(rank=r), wait_s=0.0))
                         for i, r in enumerate(named, 1)])
            sent += len(named)
            time.sleep(0.1)
        wait_for(lambda: len(stream.results) >= sent, "the heartbeats' answers", 30)
    finally:
        stream.close()
    j.victims_ok()
    assert codes(stream.results) == {"INVALID_ARGUMENT"}, codes(stream.results)
    assert "is out of range for world size 3" in stream.results[0].details, stream.results[0].details


@pytest.mark.timeout(150)
def test_one_child_parking_gets_through_a_relay_is_refused_alone(job):
    """(c) Before: 1,100 gets of unset keys by one child filled the relay's one stream to the
    coordinator (its bound, 1,024 operations waiting, counted the stream), and the other ranks'
    barriers on it were refused. Now the relay holds each child to that bound, and the coordinator
    counts a relay's stream per rank. (A long heartbeat bound: the attacker's own heartbeats are
    refused too while it has 1,024 operations waiting, which would end the job a bound later.)"""
    j = job(bound=60.0, duration_s=8.0)
    stream = Stream(j.relay.target)
    try:
        stream.send([pb.SessionOp(id=i, get=pb.GetRequest(caller=j.caller(), key=f"never-{i}", wait_s=60.0))
                     for i in range(1, 1101)])
        wait_for(lambda: len(stream.results) >= 76, "the refusals of the gets past the bound", 30)
        j.victims_ok()
        # 76 past the relay's bound for the child; one more at the coordinator where the attacker's
        # own heartbeat was in flight there (1,024 operations per rank).
        assert 76 <= len(stream.results) <= 77 and codes(stream.results) == {"RESOURCE_EXHAUSTED"}, stream.results
        assert all("refused" in r.details and "1024 operations" in r.details for r in stream.results), stream.results
    finally:
        stream._channel.close()
        stream.close()


@pytest.mark.timeout(150)
def test_a_child_that_never_reads_its_answers_is_cut_off_not_buffered(job):
    """(d) Before: the relay kept every answer a child did not read (its heartbeats, answered at
    once), and grew without bound. Now past 4 x its bound of waiting operations (or 64 MiB) the
    child's stream ends with RESOURCE_EXHAUSTED, as at the coordinator."""
    j = job(bound=10.0, duration_s=6.0)
    total, sent = 200_000, [0, time.monotonic()]
    beat = pb.HeartbeatRequest(caller=j.caller(), wait_s=0.0)

    def requests() -> Iterator[pb.SessionRequest]:
        for start in range(0, total, 500):
            yield pb.SessionRequest(ops=[pb.SessionOp(id=i, heartbeat=beat) for i in range(start, start + 500)])
            sent[:] = [sent[0] + 500, time.monotonic()]

    # A small receive window and no growing it: the relay's writes stall as soon as answers are unread.
    with grpc.insecure_channel(j.relay.target, options=[("grpc.http2.bdp_probe", 0),
                                                        ("grpc.http2.lookahead_bytes", 16384)]) as channel:
        answers = pb_grpc.CoordinatorStub(channel).Session(requests(), metadata=AUTH, timeout=60.0)
        # Unread until the writes stall (the relay stopped reading) or all are out.
        while sent[0] < total and time.monotonic() - sent[1] < 0.5:
            time.sleep(0.05)
        code, text = grpc.StatusCode.OK, ""
        try:
            for _ in answers:
                pass  # now read: what was written before the end, then the status
        except grpc.RpcError as exc:
            code, text = exc.code(), exc.details() or ""
    print(f"\n{sent[0]} heartbeats sent unread to the relay: {code.name} ({text[:90]})")
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and "answers its client has not read" in text, (code, text)
    j.victims_ok()


@pytest.mark.timeout(60)
def test_the_coordinator_skips_a_bad_entry_of_a_relayed_heartbeat_alone(coordinator_factory):
    """Behind (b): the coordinator refused a relay's whole heartbeat when it named more ranks than
    the job has. Now an entry out of range is skipped and the others are still heartbeats."""
    server = coordinator_factory(2, token=TOKEN, heartbeat_timeout_s=30.0)
    clients = [gridcomm.CoordinatorClient("127.0.0.1", server.port, r, 2, token=TOKEN, timeout_s=30) for r in (0, 1)]
    try:
        joins = [threading.Thread(target=c.join) for c in clients]
        [t.start() for t in joins]
        [t.join(30) for t in joins]
        state = server.state
        before = {r: state.members[r].last_heartbeat for r in (0, 1)}
        time.sleep(0.05)
        caller = pb.Caller(job_id=state.job_id, rank=0, incarnation=clients[0].incarnation, generation=state.generation)
        ranks = [0, 7, 1, -3]
        incarnations = [clients[0].incarnation, 1, clients[1].incarnation, 2]
        request = pb.HeartbeatRequest(caller=caller, wait_s=0.0)
        aggregate = pb.Aggregate(ranks=[pb.RelayedRank(rank=r, incarnation=i, generation=state.generation, age_s=0.0)
                                        for r, i in zip(ranks, incarnations, strict=True)])
        with grpc.insecure_channel(server.address) as channel:
            answer = relayed(pb_grpc.CoordinatorStub(channel), "heartbeat", request, aggregate, timeout_s=10,
                             metadata=AUTH)
        assert not answer.failures
        assert all(state.members[r].last_heartbeat > (before[r] or 0.0) for r in (0, 1)), before
    finally:
        for c in clients:
            c.close()
