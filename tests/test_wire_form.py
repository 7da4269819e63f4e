"""Mixed gridcomm versions fail at the join with a message, never as a silent misread: the
coordinator (and a relay, for its ranks' joins) refuses a join or first contact of another wire
form, and a rank refuses a join's answer of another (an older coordinator answers 0). A relay's
aggregate comes from the relay alone: one a rank sends it is dropped."""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

import gridcomm
from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._proto import coordinator_pb2_grpc as pb_grpc
from gridcomm._relay.server import Relay
from gridcomm._wire import SERVICE_NAME, WIRE
from tests.support.relayed import relayed, session_op

OLD = 0  # what a gridcomm older than the wire form's number sends and answers


def join_request(rank: int, wire: int, **fields: Any) -> pb.JoinRequest:
    values: dict[str, Any] = {"job_id": "default", "rank": rank, "world_size": 2, "incarnation": 100 + rank,
                              "hostname": "h", "wait_s": 0.2, "wire": wire}
    return pb.JoinRequest(**{**values, **fields})


def assert_wire_refusal(code: grpc.StatusCode, details: str, theirs: int = OLD) -> None:
    assert code == grpc.StatusCode.FAILED_PRECONDITION, (code, details)
    assert f"wire form is {theirs}" in details and f"'s is {WIRE}" in details, details
    assert "run the same gridcomm version on every rank and the coordinator" in details, details


@pytest.mark.timeout(60)
def test_the_coordinator_refuses_a_join_or_first_contact_of_another_wire_form(coordinator_factory):
    """A join, a Session join and a first contact whose wire form is not the coordinator's are
    refused with FAILED_PRECONDITION and a message that says what to do; nothing is registered,
    the refusal is kept for `gridcomm status`, and a join of the same form goes on as usual."""
    server = coordinator_factory(2)
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        for wire in (OLD, WIRE + 1):
            with pytest.raises(grpc.RpcError) as caught:
                stub.Join(join_request(0, wire), timeout=10)
            assert_wire_refusal(caught.value.code(), caught.value.details(), wire)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Join(join_request(1, OLD, first_contact=True), timeout=10)
        assert_wire_refusal(caught.value.code(), caught.value.details())
        result = session_op(stub, "join", join_request(1, OLD), timeout_s=10)
        assert_wire_refusal(next(c for c in grpc.StatusCode if c.value[0] == result.code), result.details)
        assert not server.state.members
        assert any("wire form is 0" in r.reason for r in server._servicer.metrics.refused_joins)
        # The same wire form: joined, and the answer names it.
        with pytest.raises(grpc.RpcError) as caught:
            stub.Join(join_request(0, WIRE), timeout=10)  # rank 1 has not joined: the wait ends
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, caught.value.details()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(stub.Join, join_request(0, WIRE, wait_s=10.0), timeout=20)
            second = stub.Join(join_request(1, WIRE, wait_s=10.0), timeout=20)
            assert first.result(20).wire == second.wire == WIRE
    assert sorted(server.state.members) == [0, 1] and not server.state.failures


class OldCoordinator:
    """A real gRPC server answering Join as a coordinator older than the wire form's number does
    (JoinResponse.wire unset: 0), whatever the request."""

    def __init__(self) -> None:
        self.joins: queue.Queue[pb.JoinRequest] = queue.Queue()

        def join(request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinResponse:
            self.joins.put(request)
            return pb.JoinResponse(generation=1, world_size=1, heartbeat_timeout_s=15.0)

        handler = grpc.unary_unary_rpc_method_handler(join, request_deserializer=pb.JoinRequest.FromString,
                                                      response_serializer=pb.JoinResponse.SerializeToString)
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(2))
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, {"Join": handler}),))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def stop(self) -> None:
        self.server.stop(0)


@pytest.fixture
def old_coordinator() -> Iterator[OldCoordinator]:
    server = OldCoordinator()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.timeout(60)
def test_a_rank_refuses_the_join_answer_of_a_coordinator_of_another_wire_form(old_coordinator, monkeypatch):
    """An older coordinator reads a join without the wire form and answers one without it: the
    rank raises a GridcommError that says what to do instead of taking the answer."""
    monkeypatch.setenv("GRIDCOMM_SESSION", "off")  # the old server here answers the unary Join only
    client = gridcomm.CoordinatorClient("127.0.0.1", old_coordinator.port, 0, 1, timeout_s=20)
    try:
        with pytest.raises(gridcomm.GridcommError) as caught:
            client.join()
    finally:
        client.close()
    text = str(caught.value)
    assert "runs a gridcomm whose wire form is 0" in text and f"this rank's is {WIRE}" in text, text
    assert "run the same gridcomm version on every rank and the coordinator" in text, text
    assert old_coordinator.joins.get(timeout=5).wire == WIRE


class RelayStream:
    """A raw Session stream to a relay, as a rank's client would open it."""

    def __init__(self, target: str) -> None:
        self.ops: queue.Queue[pb.SessionRequest | None] = queue.Queue()
        self.results: queue.Queue[pb.SessionResult] = queue.Queue()
        self.channel = grpc.insecure_channel(target)

        def requests() -> Iterator[pb.SessionRequest]:
            while (request := self.ops.get()) is not None:
                yield request

        def read() -> None:
            try:
                for reply in pb_grpc.CoordinatorStub(self.channel).Session(requests(), timeout=60):
                    for result in reply.results:
                        self.results.put(result)
            except grpc.RpcError:
                pass

        self.reader = threading.Thread(target=read, daemon=True)
        self.reader.start()

    def call(self, op: pb.SessionOp) -> pb.SessionResult:
        self.ops.put(pb.SessionRequest(ops=[op]))
        return self.results.get(timeout=30)

    def close(self) -> None:
        self.ops.put(None)
        self.reader.join(10)
        self.channel.close()


@pytest.mark.timeout(60)
def test_a_relay_refuses_its_ranks_joins_of_another_wire_form_and_their_aggregates(coordinator_factory):
    """A rank's join through a relay in another wire form is refused by the relay, as the
    coordinator would refuse it. An aggregate a rank sends the relay is refused for it (only the
    relay speaks for several ranks): a barrier naming two more ranks is not an arrival of any of
    them, and the barrier waits for them all."""
    server = coordinator_factory(3)
    relay = Relay(server.address, world_size=3).start()
    stream = RelayStream(relay.target)
    clients = [gridcomm.CoordinatorClient("127.0.0.1", server.port, r, 3, timeout_s=30) for r in range(3)]
    try:
        refused = stream.call(pb.SessionOp(id=1, join=join_request(0, OLD, world_size=3)))
        assert refused.code == grpc.StatusCode.FAILED_PRECONDITION.value[0], refused.details
        assert_wire_refusal(grpc.StatusCode.FAILED_PRECONDITION, refused.details)
        assert f"refused by the relay at {relay.target}" in refused.details, refused.details
        assert not server.state.members
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda c: c.join(), clients))
        # Rank 2 names ranks 0 and 1 (their real processes) in an aggregate: refused by the relay.
        forged = pb.Aggregate(ranks=[pb.RelayedRank(rank=c.rank, incarnation=c.incarnation) for c in clients[:2]])
        barrier = pb.BarrierRequest(caller=clients[2].caller, name="b", seq=1, wait_s=0.5)
        answer = stream.call(pb.SessionOp(id=2, barrier=barrier, aggregate=forged))
        assert answer.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], answer.details
        assert "only a relay speaks for several ranks" in answer.details, answer.details
        answer = stream.call(pb.SessionOp(id=3, barrier=barrier))  # the same arrival alone waits for 0 and 1
        assert answer.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0], answer.details
        assert "[0, 1]" in answer.details, answer.details
        # The same aggregate sent to the coordinator by a relay completes the barrier.
        with grpc.insecure_channel(server.address) as channel:
            assert relayed(pb_grpc.CoordinatorStub(channel), "barrier", barrier, forged).seq == 1
        assert not server.state.failures
    finally:
        stream.close()
        for c in clients:
            c.close()
        relay.stop()
