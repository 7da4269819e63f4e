"""A rank behind a relay whose connection to it drops is named within the connection grace, as a
rank that dials the coordinator directly is (gridcomm/_coordinator/relay_lost.py): its relay
reports the stream's end, and the coordinator fails the process unless it heartbeats again within
the grace. A relay is believed only for the processes whose heartbeats it carries.

Real processes and a real coordinator; the coordinator's rule also on raw gRPC, with the test as
the relay (a token holder), so that a re-dial and forged reports are exact.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._proto import coordinator_pb2_grpc as pb_grpc
from gridcomm._wire import WIRE
from tests.support.procs import RankProcesses, wait_for

TOKEN = "relay-lost-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
#: A liveness bound long enough that a verdict at the silence bound is told apart from one within
#: the connection grace (2 s).
BOUND = 20.0

RANK = """
import json, os, time, gridcomm
c = gridcomm.CoordinatorClient(timeout_s=60)
c.join()
print("JOINED", c.relay_target, flush=True)
try:
    while True:
        c.barrier("step")
        time.sleep(0.05)
except gridcomm.RankFailedError as exc:
    print(json.dumps({"told_at": time.time(), "failed": exc.rank, "error": str(exc)[:400]}), flush=True)
"""


@pytest.mark.timeout(120)
def test_a_rank_killed_behind_its_groups_relay_is_named_within_the_connection_grace(coordinator_factory):
    world = 4  # GRIDCOMM_RELAY_FANIN=2: rank 2 hosts the relay of ranks 2 and 3
    server = coordinator_factory(world, token=TOKEN, heartbeat_timeout_s=BOUND)
    ranks = RankProcesses(RANK, world, env={
        "GRIDCOMM_HOST": "127.0.0.1", "GRIDCOMM_PORT": str(server.port), "GRIDCOMM_TOKEN": TOKEN,
        "GRIDCOMM_RELAY": "on", "GRIDCOMM_RELAY_FANIN": "2"})
    try:
        wait_for(lambda: server.state.complete and server.state.barriers.get("step"), "the first barrier", 60)
        time.sleep(1.0)  # heartbeats through the relays
        killed_at = time.time()
        os.kill(ranks.procs[3].pid, signal.SIGKILL)
        results = ranks.wait(60)
        failure = server.state.failures[0]
        assert failure.rank == 3 and "lost its connection to its relay at " in failure.reason, failure.reason
        for rank in (0, 1, 2):
            out = json.loads(results[rank].stdout.strip().splitlines()[-1])
            assert out["failed"] == 3, out
            told = out["told_at"] - killed_at
            print(f"\nrank {rank} told of rank 3 after {told:.1f} s (bound {BOUND:g} s): {failure.reason}")
            # Generous (a loaded machine): the grace is 2 s, the silence bound 20 s.
            assert told < BOUND / 2, (told, out)
        joined = results[3].stdout.split()
        assert joined[:2] == ["JOINED", joined[1]] and joined[1] != "None", results[3].stdout  # it was relayed
    finally:
        ranks.close()


class Raw:
    """A coordinator for two ranks joined on raw gRPC, and Session streams spoken as a relay."""

    def __init__(self, factory) -> None:
        self.server = factory(2, token=TOKEN, heartbeat_timeout_s=BOUND)
        self.channel = grpc.insecure_channel(self.server.address)
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        self.incarnations = {0: 0x1111, 1: 0x2222}
        joins = [threading.Thread(target=self.stub.Join, args=(pb.JoinRequest(
            job_id="default", rank=r, world_size=2, incarnation=self.incarnations[r], hostname="raw", wait_s=20,
            wire=WIRE),),
            kwargs={"metadata": AUTH, "timeout": 30}) for r in (0, 1)]
        [t.start() for t in joins]
        [t.join(40) for t in joins]
        assert self.server.state.complete
        self.generation = self.server.state.generation
        self._streams: list[tuple[queue.Queue, threading.Thread]] = []

    def caller(self, rank: int, incarnation: int | None = None) -> pb.Caller:
        return pb.Caller(job_id="default", rank=rank, generation=self.generation,
                         incarnation=self.incarnations[rank] if incarnation is None else incarnation)

    def beat(self, rank: int) -> None:
        """A heartbeat of ``rank``'s own, answered at once (a unary call: the rank re-dialled)."""
        self.stub.Heartbeat(pb.HeartbeatRequest(caller=self.caller(rank), wait_s=0), metadata=AUTH, timeout=10)

    def stream(self) -> queue.Queue:
        """A Session stream (a relay's upstream): put HeartbeatRequests on the queue, None ends it."""
        ops: queue.Queue = queue.Queue()
        answers: queue.Queue = queue.Queue()
        ids = iter(range(1, 1 << 30))

        def requests() -> Iterator[pb.SessionRequest]:
            while (sent := ops.get()) is not None:
                request, aggregate = sent
                yield pb.SessionRequest(ops=[pb.SessionOp(id=next(ids), heartbeat=request, aggregate=aggregate)])

        def read() -> None:
            try:
                for reply in self.stub.Session(requests(), metadata=AUTH):
                    for result in reply.results:
                        answers.put(result)
            except grpc.RpcError:
                pass

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        self._streams.append((ops, reader))
        ops.answers = answers  # type: ignore[attr-defined]
        return ops

    def send(self, stream: queue.Queue, request: pb.HeartbeatRequest, aggregate: pb.Aggregate) -> None:
        """Sends ``request`` with the relay's ``aggregate`` on ``stream`` and waits for its answer
        (so it has been read)."""
        stream.put((request, aggregate))
        result = stream.answers.get(timeout=15)  # type: ignore[attr-defined]
        assert not result.code, result.details

    def carry(self, stream: queue.Queue, rank: int) -> None:
        """A relay's heartbeat for ``rank`` (its last heartbeat at the relay just now)."""
        self.send(stream, pb.HeartbeatRequest(caller=self.caller(rank), wait_s=0), pb.Aggregate(ranks=[pb.RelayedRank(
            rank=rank, incarnation=self.incarnations[rank], generation=self.generation, age_s=0.0)]))

    def report(self, stream: queue.Queue, rank: int, incarnation: int | None = None) -> None:
        """The relay reports ``rank``'s stream to it ended without its leaving."""
        caller = self.caller(rank, incarnation)
        self.send(stream, pb.HeartbeatRequest(caller=caller), pb.Aggregate(
            relay="10.0.0.9:7000", lost=[pb.RelayedRank(rank=rank, incarnation=caller.incarnation)]))

    def close(self) -> None:
        for ops, reader in self._streams:
            ops.put(None)
            reader.join(10)
        self.channel.close()


@pytest.fixture
def raw(coordinator_factory) -> Iterator[Raw]:
    job = Raw(coordinator_factory)
    try:
        yield job
    finally:
        job.close()


def no_failure_for(raw: Raw, seconds: float) -> None:
    """No failure for ``seconds`` (past the grace), rank 0 heartbeating directly meanwhile."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        raw.beat(0)
        assert not raw.server.state.failures, [f.reason for f in raw.server.state.failures]
        time.sleep(0.2)


@pytest.mark.timeout(90)
def test_a_reported_rank_that_heartbeats_again_within_the_grace_is_not_failed(raw):
    relay = raw.stream()
    raw.carry(relay, 1)
    raw.report(relay, 1)
    raw.beat(1)  # it re-dialled the coordinator within the grace
    no_failure_for(raw, 2 * raw.server.connection_grace_s + 1.0)
    # Its re-dial is heard before its relay's report comes: the report is not believed.
    raw.carry(relay, 1)
    raw.beat(1)
    raw.report(relay, 1)
    no_failure_for(raw, 2 * raw.server.connection_grace_s + 1.0)
    # It reaches the relay again, is carried, and this time does not come back: failed.
    raw.carry(relay, 1)
    reported_at = time.monotonic()
    raw.report(relay, 1)
    while not raw.server.state.failures:
        raw.beat(0)
        time.sleep(0.1)
        assert time.monotonic() - reported_at < BOUND / 2, "not failed within the grace"
    failure = raw.server.state.failures[0]
    assert failure.rank == 1 and "rank 1 on raw lost its connection to its relay at 10.0.0.9:7000 without leaving" \
        in failure.reason, failure.reason


@pytest.mark.timeout(90)
def test_a_relay_reporting_a_process_it_does_not_carry_fails_nobody(raw):
    relay, other = raw.stream(), raw.stream()
    raw.carry(relay, 1)
    raw.beat(0)  # rank 0 heartbeats directly: no relay carries it
    raw.report(relay, 0)  # not carried by this stream
    raw.report(other, 0)  # a token holder that carries nobody
    raw.report(other, 1)  # carried by another stream
    raw.report(relay, 1, incarnation=0x9999)  # not the process the coordinator holds for rank 1
    # Neither heartbeats meanwhile (a rank behind a relay is heard of every bound / 6, longer than
    # the grace): only the reports' being ignored keeps them.
    end = time.monotonic() + 2 * raw.server.connection_grace_s + 1.0
    while time.monotonic() < end:
        assert not raw.server.state.failures, [f.reason for f in raw.server.state.failures]
        time.sleep(0.2)
    assert not raw.server.state.failures, [f.reason for f in raw.server.state.failures]
    # The stream that carries rank 1 and names its process is believed (and only for rank 1).
    raw.report(relay, 1)
    wait_for(lambda: raw.server.state.failures, "rank 1's failure", BOUND / 2)
    assert [f.rank for f in raw.server.state.failures] == [1], [f.reason for f in raw.server.state.failures]
