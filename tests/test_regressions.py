"""Server bugs the fuzzing found, each pinned by a test with a minimal reproducer (all fixed; the
grpcio 1.84-1.85 aio non-UTF-8 :path crash by the watchdog of gridcomm._runtime.guard)."""



from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._proto import coordinator_pb2_grpc as pb_grpc
from gridcomm._wire import WIRE
from tests.support.calls import (
    ABORTED,
    DEADLINE,
    EXISTS,
    FAILED_KEY,
    INVALID,
    METHODS,
    MISSING_KEY,
    OK,
    UNDECODABLE,
    Outcome,
    assert_proper,
    assert_serving,
    call_unary,
    coordinator,
    decodes,
    raw_call,
)
from tests.support.fuzz_model import (
    Driver,
    Job,
    _copy,
)
from tests.support.http2 import (
    DATA,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    PREFACE,
    SETTINGS,
    exchange,
    grpc_message,
    h2_frame,
    hpack_literal,
    status_when_back,
)

# ------------------------------------------------------------------------------------ pinned bugs
# Each test below states the correct behaviour and a minimal reproducer; xfail(strict=True) keeps
# the suite green until the server is fixed, and turns red (XPASS) the moment it is, so the
# marker gets removed.


@contextlib.contextmanager
def joined(world_size: int) -> Iterator[tuple[grpc.Channel, Job]]:
    with coordinator(world_size) as (server, channel):
        job = Job(server.job_id, world_size)
        Driver(channel, job).join_all(list(range(world_size)), [100 + r for r in range(world_size)])
        yield channel, job


@pytest.mark.timeout(60)
def test_huge_job_id_gets_a_readable_refusal():
    # Reproducer: Join(job_id="x" * 100_000, rank=0, world_size=2, incarnation=1) ->
    #   RESOURCE_EXHAUSTED "Stream removed (received metadata size exceeds hard limit ...)".
    with joined(2) as (channel, job):
        stub = pb_grpc.CoordinatorStub(channel)
        huge = "x" * 100_000
        caller = _copy(job.valid_callers()[0], job_id=huge)
        requests = {
            "Join": pb.JoinRequest(wire=WIRE, job_id=huge, rank=0, world_size=2, incarnation=100, wait_s=0.0),
            "Set": pb.SetRequest(caller=caller, key="k", value=b"v"),
            "Get": pb.GetRequest(caller=caller, key="k"),
            "Barrier": pb.BarrierRequest(caller=caller, name="b", seq=1),
            "Heartbeat": pb.HeartbeatRequest(caller=caller),
            "ReportFailure": pb.ReportFailureRequest(caller=caller, reason="r"),
            "Leave": pb.LeaveRequest(caller=caller),
        }
        for rpc, request in requests.items():
            outcome = call_unary(getattr(stub, rpc), request)
            assert_proper(outcome, rpc)
            assert outcome.code is INVALID, (rpc, outcome.code, outcome.details[:200])


@pytest.mark.timeout(60)
def test_refused_barrier_arrival_leaves_no_trace():
    # Reproducer (world size 3, all joined):
    #   rank 0: Barrier(name="b", seq=1, participants=[1])   -> INVALID_ARGUMENT (not a participant)
    #   rank 1: Barrier(name="b", seq=1, participants=[])    -> OK (!), though ranks 0 and 2 never arrived
    #   rank 0: Barrier(name="c", seq=1, participants=[1,2]) -> INVALID_ARGUMENT
    #   rank 0: Barrier(name="c", seq=1, participants=[0,1]) -> INVALID_ARGUMENT "opened for [1, 2]" (!)
    with joined(3) as (channel, job):
        stub = pb_grpc.CoordinatorStub(channel)
        c0, c1, _ = job.valid_callers()

        def arrive(caller: pb.Caller, name: str, participants: list[int]) -> Outcome:
            return call_unary(stub.Barrier, pb.BarrierRequest(caller=caller, name=name, seq=1, wait_s=0.05,
                                                              participants=participants))

        assert arrive(c0, "b", [1]).code is INVALID
        out = arrive(c1, "b", [])
        assert (out.code, out.trailing.get(MISSING_KEY)) == (DEADLINE, "0,2"), (out.code, out.details)
        assert arrive(c0, "c", [1, 2]).code is INVALID
        out = arrive(c0, "c", [0, 1])
        assert (out.code, out.trailing.get(MISSING_KEY)) == (DEADLINE, "1"), (out.code, out.details)
        assert arrive(c1, "c", [0, 1]).code is OK


@pytest.mark.timeout(60)
def test_a_barrier_for_some_ranks_before_the_rendezvous_completes_waits_for_those_not_joined_yet():
    # Found by the fuzzer: world size 3, ranks 0 and 2 joined (rank 1 not yet); rank 0
    # Barrier("b", seq=1, participants=[0, 1]) -> INVALID_ARGUMENT "participants must be distinct
    # ranks of generation -1 (job ranks [0, 1, 2]), sorted; got [0, 1]" (!), where a barrier for
    # every rank waits for the rank that has not joined.
    with coordinator(3) as (server, channel):
        job = Job(server.job_id, 3)
        Driver(channel, job).join_all([0, 2], [100, 102])
        stub = pb_grpc.CoordinatorStub(channel)
        c0 = next(c for c in job.valid_callers() if c.rank == 0)
        for participants in ([0, 1], []):
            out = call_unary(stub.Barrier, pb.BarrierRequest(caller=c0, name=f"b{len(participants)}", seq=1, wait_s=0.05,
                                                             participants=participants))
            assert (out.code, out.trailing.get(MISSING_KEY)) == (DEADLINE, "1" if participants else "1,2"), \
                (participants, out.code, out.details)
        out = call_unary(stub.Barrier, pb.BarrierRequest(caller=c0, name="c", seq=1, wait_s=0.05, participants=[0, 3]))
        assert out.code is INVALID, (out.code, out.details)


@pytest.mark.timeout(60)
def test_a_name_opened_for_some_ranks_refuses_an_arrival_for_every_rank():
    # Found by the fuzzer (the model had let it pass): rank 1 Barrier("p", seq=1, participants=[1])
    # completes alone; rank 1 Barrier("p", seq=2, participants=[]) names every rank, another group.
    with joined(3) as (channel, job):
        stub = pb_grpc.CoordinatorStub(channel)
        _, c1, _ = job.valid_callers()

        def arrive(seq: int, participants: list[int]) -> Outcome:
            return call_unary(stub.Barrier, pb.BarrierRequest(caller=c1, name="p", seq=seq, wait_s=0.05,
                                                              participants=participants))

        assert arrive(1, [1]).code is OK
        out = arrive(2, [])
        assert out.code is INVALID and "opened for [1]" in out.details, (out.code, out.details)
        assert arrive(2, [1]).code is OK


@pytest.mark.timeout(60)
def test_undecodable_body_is_invalid_argument(fresh_server):
    # Reproducer: channel.unary_unary("/gridcomm.v1.Coordinator/Join")(b"\xff") -> UNKNOWN.
    _, channel = fresh_server
    for method in sorted(METHODS):
        undecodable = [body for body in UNDECODABLE if not decodes(method, body)]
        assert len(undecodable) >= 3, method
        for body in undecodable:
            outcome = raw_call(channel, method, [body])
            assert_proper(outcome, f"{method} {body!r}")
            assert outcome.code is INVALID, (method, body, outcome.code.name, outcome.details)
    assert_serving(channel)


@pytest.mark.timeout(60)
def test_huge_barrier_name_after_a_failure_gets_a_readable_refusal():
    # Reproducer (world size 2, both joined): rank 1: ReportFailure(reason="x") -> OK;
    #   rank 0: Barrier(name="k" * 20_000, seq=1) -> RESOURCE_EXHAUSTED "Stream removed (... hard limit ...)".
    with joined(2) as (channel, job):
        stub = pb_grpc.CoordinatorStub(channel)
        c0, c1 = job.valid_callers()
        assert call_unary(stub.ReportFailure, pb.ReportFailureRequest(caller=c1, reason="x")).code is OK
        out = call_unary(stub.Barrier, pb.BarrierRequest(caller=c0, name="k" * 20_000, seq=1))
        assert_proper(out, "Barrier with a 20 KB name after a failure")
        assert out.code in (ABORTED, INVALID), (out.code, out.details[:200])


@pytest.mark.timeout(60)
def test_a_new_process_for_a_live_rank_fails_nobody_and_becomes_the_replacement_after_its_death():
    # Was (before recovery in place): a new process for a joined rank failed that rank at once (and health
    # had to go NOT_SERVING with it). Now (world size 2, both joined, rank 1 waiting in a barrier):
    #   Join(rank 0, new incarnation, wait_s=0) -> DEADLINE_EXCEEDED, missing [0] (its predecessor
    #     has not been heard from since); nobody failed, the barrier still waits, health SERVING;
    #   the same join, wait_s=5, while the old rank 0 heartbeats -> ALREADY_EXISTS ("live process");
    #   old rank 0 reports a failure -> the barrier ends ABORTED naming 0 at once, and the new
    #     process is the replacement: it waits for the survivors' recovery (missing [1]).
    with joined(2) as (channel, job):
        stub = pb_grpc.CoordinatorStub(channel)
        c0, c1 = job.valid_callers()
        new = pb.JoinRequest(wire=WIRE, job_id=job.job_id, rank=0, world_size=2, incarnation=999, hostname="restarted")
        with ThreadPoolExecutor(2) as pool:
            waiting = pool.submit(call_unary, stub.Barrier, pb.BarrierRequest(caller=c1, name="b", seq=1, wait_s=10.0))
            parked_by = time.monotonic() + 5.0
            while not any(b.name == "b" for b in call_unary(stub.Status, pb.StatusRequest()).response.barriers):
                assert time.monotonic() < parked_by, "rank 1 never arrived at the barrier"
                time.sleep(0.01)
            out = call_unary(stub.Join, new)
            assert (out.code, out.trailing.get(MISSING_KEY)) == (DEADLINE, "0"), out
            assert "not been heard from" in out.details, out.details
            assert not call_unary(stub.Status, pb.StatusRequest()).response.failures
            assert_serving(channel, serving=True)
            refused = pool.submit(call_unary, stub.Join, _copy(new, wait_s=5.0))
            beat_by = time.monotonic() + 5.0
            while not refused.done():  # the old process's heartbeats (what its watcher sends)
                assert call_unary(stub.Heartbeat, pb.HeartbeatRequest(caller=c0, wait_s=0.0)).code is OK
                assert time.monotonic() < beat_by, "the join was not answered after the old process heartbeat"
                time.sleep(0.05)
            assert refused.result().code is EXISTS and "live process" in refused.result().details, refused.result()
            assert not waiting.done()
            assert call_unary(stub.ReportFailure, pb.ReportFailureRequest(caller=c0, reason="crashed")).code is OK
            barrier = waiting.result(timeout=5)
        assert barrier.code is ABORTED and barrier.trailing.get(FAILED_KEY) == "0", barrier
        assert_serving(channel, serving=False)
        out = call_unary(stub.Join, _copy(new, wait_s=0.5))
        assert (out.code, out.trailing.get(MISSING_KEY)) == (DEADLINE, "1"), out


@pytest.mark.timeout(60)
def test_long_non_ascii_failure_reason_reaches_the_other_ranks():
    # Reproducer (world size 2, both joined): rank 1: ReportFailure(reason="\u00e9" * 2048) -> OK;
    #   rank 0: Set(key="k", value=b"v") -> RESOURCE_EXHAUSTED "Stream removed (received metadata size
    #   exceeds soft limit (12264 vs. 8192) ... grpc-message:12064B ...)".
    with joined(2) as (channel, job):
        stub = pb_grpc.CoordinatorStub(channel)
        c0, c1 = job.valid_callers()
        reason = "Fehler in \u00fcbergr\u00f6\u00dfe: " + "\u00e9" * 2048
        assert call_unary(stub.ReportFailure, pb.ReportFailureRequest(caller=c1, reason=reason)).code is OK
        for rpc, request in [("Set", pb.SetRequest(caller=c0, key="k", value=b"v")),
                             ("Get", pb.GetRequest(caller=c0, key="k")),
                             ("Barrier", pb.BarrierRequest(caller=c0, name="b", seq=1))]:
            out = call_unary(getattr(stub, rpc), request)
            assert_proper(out, rpc)
            assert (out.code, out.trailing.get(FAILED_KEY)) == (ABORTED, "1"), (rpc, out.code, out.details[:200])


@pytest.mark.timeout(60)
def test_non_utf8_path_does_not_stop_the_server(fresh_server):
    # Reproducer: send PREFACE + SETTINGS + HEADERS(:method POST, :scheme http, :path b"/\xe5",
    #   :authority x, content-type application/grpc, te trailers) + DATA(empty gRPC message, END_STREAM)
    #   to the port; afterwards socket.create_connection(("127.0.0.1", port)) -> ConnectionRefusedError.
    server, channel = fresh_server
    block = b"".join(hpack_literal(n, v) for n, v in [
        (b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/\xe5"), (b":authority", b"127.0.0.1"),
        (b"content-type", b"application/grpc"), (b"te", b"trailers")])
    exchange(server.port, PREFACE + h2_frame(SETTINGS, 0, 0, b"") + h2_frame(HEADERS, END_HEADERS, 1, block)
             + h2_frame(DATA, END_STREAM, 1, grpc_message(b"")))
    try:
        status = status_when_back(server.port)
    except OSError as exc:
        raise AssertionError(f"the coordinator stopped listening after a non-UTF-8 :path: {exc!r}") from exc
    assert status.serving
    assert_serving(channel)

