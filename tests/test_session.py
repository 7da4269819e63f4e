"""The Session stream (join/set/get/barrier/leave over one long-lived bidi stream) against real
coordinators on loopback, with real clients (threads, one per rank) and hand-made wire traffic.

1. Equivalence: the same flows and the same failures in every GRIDCOMM_SESSION mode (process,
   client, off): join, set/get, 20 back-to-back barriers of 8 ranks, barrier/get/join timeouts
   naming the missing ranks, wrong token, nothing listening, a rank that reports a failure. Error
   types, missing ranks, failed rank and message text are compared across the modes.
2. Sharing: from the server side (this process's accepted TCP connections to the coordinator's
   port, read from /proc/net/tcp), "process" mode carries every client on one connection,
   "client" mode on one each; the last client to close closes the connection.
3. The raw protocol, with the generated stub and with byte-level channels: one request answered by
   id, an operation with no oneof, each operation answering exactly as its unary RPC (code,
   details, gridcomm-* trailers), undecodable bytes, the per-stream bound on waiting operations,
   missing and wrong tokens.
4. Fallback: a coordinator that does not serve Session (a real gRPC server that forwards only the
   unary RPCs to a real coordinator, as an older coordinator would answer), and a stream cut
   mid-wait by a TCP proxy between client and coordinator.
5. Idempotence: the same barrier arrival (same seq) sent twice on a stream is counted once.
6. Groups (SessionOp.also): the coordinator advertises them; a grouped barrier arrives for every
   member and is answered by one result; a refused member is answered alone, as its unary call;
   a grouped get; groups of what cannot be grouped, or larger than the job, are refused for every
   member; the threads of one process are grouped end to end and still see their own errors; no
   groups go to a coordinator that does not advertise them; an operation held for the other
   clients of a stream still goes out when they never make it; closing the clients ends an
   operation in flight at once.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import os
import queue
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

import gridcomm
from gridcomm import _session
from gridcomm._client import fetch_status
from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._proto import coordinator_pb2_grpc as pb_grpc
from tests.test_fuzz import (
    OK,
    SERVICE,
    UNDECODABLE,
    Outcome,
    _outcome_of,
    assert_serving,
    call_unary,
    client_flow,
    coordinator,
    start_coordinator,
)

MODES = ("process", "client", "off")
#: Bound on any single wait in these tests (a hang fails the test instead of stalling it).
WAIT_S = 20.0
#: Unary calls of an old coordinator that the forwarding server passes through.
UNARY = ("Join", "Set", "Get", "Barrier", "Heartbeat", "ReportFailure", "Leave", "Status")


# ------------------------------------------------------------------------------------ helpers


_GRPC_BEFORE_1_84 = tuple(int(p) for p in grpc.__version__.split(".")[:2]) < (1, 84)


def wait_for(predicate: Callable[[], Any], what: str, timeout_s: float = 10.0) -> Any:
    """Polls ``predicate`` until it is truthy (its value is returned) or fails after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.02)


def client(port: int, rank: int, world: int, mode: str, **kwargs: Any) -> gridcomm.CoordinatorClient:
    kwargs.setdefault("timeout_s", WAIT_S)
    return gridcomm.CoordinatorClient("127.0.0.1", port, rank, world, session=mode, **kwargs)


@contextlib.contextmanager
def clients(port: int, world: int, mode: str, ranks: Sequence[int] | None = None,
            **kwargs: Any) -> Iterator[list[gridcomm.CoordinatorClient]]:
    made = [client(port, r, world, mode, **kwargs) for r in (range(world) if ranks is None else ranks)]
    try:
        yield made
    finally:
        for c in made:
            c.close()


def on_threads(fn: Callable[[Any], Any], items: Sequence[Any], timeout_s: float = WAIT_S) -> list[Any]:
    """``fn`` on every item at once, one thread each (ranks of one job); results in order."""
    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(fn, items, timeout=timeout_s))


def pending_barrier(port: int, name: str) -> pb.BarrierStatus | None:
    for barrier in fetch_status("127.0.0.1", port).barriers:
        if barrier.name == name:
            return barrier
    return None


def arrived(port: int, name: str) -> list[int]:
    """The ranks waiting at the pending instance of barrier ``name`` (Status RPC)."""
    barrier = pending_barrier(port, name)
    return list(barrier.arrived_ranks) if barrier is not None else []


def server_connections(port: int) -> int:
    """Established TCP connections accepted on ``port`` by sockets of this process (the server
    side of each connection to an in-process coordinator)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                local_port = int(fields[1].rsplit(":", 1)[1], 16)
                if local_port == port and fields[3] == "01" and fields[9] in inodes:  # 01: ESTABLISHED
                    count += 1
    return count


def outcome(fn: Callable[[], Any]) -> tuple[str, list[int] | None, int | None, str]:
    """What a call raised, comparable across modes: type, missing ranks, failed rank, message
    (numbers with a decimal point masked: they are measured durations)."""
    try:
        fn()
    except gridcomm.GridcommError as exc:
        return (type(exc).__name__, getattr(exc, "missing_ranks", None), getattr(exc, "rank", None),
                re.sub(r"\d+\.\d+", "N", str(exc)))
    return ("no error", None, None, "")


class RawSession:
    """A hand-driven Session stream over the generated stub: requests from a queue, every result
    gathered (in arrival order) by a reader thread."""

    def __init__(self, channel: grpc.Channel, metadata: Sequence[tuple[str, str]] = ()) -> None:
        self._requests: queue.Queue[pb.SessionRequest | None] = queue.Queue()
        self.call = pb_grpc.CoordinatorStub(channel).Session(iter(self._requests.get, None), metadata=tuple(metadata),
                                                              timeout=60.0)
        self.results: list[pb.SessionResult] = []
        self.replies = 0
        self.error: grpc.RpcError | None = None
        self.ended = False
        self._cv = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for reply in self.call:
                with self._cv:
                    self.replies += 1
                    self.results.extend(reply.results)
                    self._cv.notify_all()
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            with self._cv:
                self.ended = True
                self._cv.notify_all()

    def send(self, *ops: pb.SessionOp) -> None:
        self._requests.put(pb.SessionRequest(ops=list(ops)))

    def wait(self, ids: Sequence[int], timeout_s: float = 10.0) -> dict[int, pb.SessionResult]:
        """The results for ``ids``; fails if one is missing after ``timeout_s`` or the stream ended first."""
        want = set(ids)
        with self._cv:
            done = self._cv.wait_for(lambda: want <= {r.id for r in self.results} or self.ended, timeout_s)
            got = {r.id: r for r in self.results if r.id in want}
        assert done and set(got) == want, (f"results for {sorted(want - set(got))[:20]} missing after {timeout_s} s; "
                                           f"stream ended: {self.ended}, error: {self.error}")
        return got

    def wait_end(self, timeout_s: float = 10.0) -> grpc.RpcError | None:
        with self._cv:
            assert self._cv.wait_for(lambda: self.ended, timeout_s), f"the stream did not end within {timeout_s} s"
        return self.error

    def close(self) -> None:
        self._requests.put(None)
        self.call.cancel()


@contextlib.contextmanager
def raw_session(channel: grpc.Channel, metadata: Sequence[tuple[str, str]] = ()) -> Iterator[RawSession]:
    session = RawSession(channel, metadata)
    try:
        yield session
    finally:
        session.close()


def op(op_id: int, **kind: Any) -> pb.SessionOp:
    return pb.SessionOp(id=op_id, **kind)


def join_on_stream(session: RawSession, server: gridcomm.Coordinator, world: int) -> list[pb.Caller]:
    """Joins every rank with one request on ``session``; returns each rank's caller."""
    session.send(*(op(100 + r, join=pb.JoinRequest(job_id=server.job_id, rank=r, world_size=world,
                                                   incarnation=0x5E55_0000 + r, hostname="raw", wait_s=5.0))
                   for r in range(world)))
    results = session.wait([100 + r for r in range(world)])
    for result in results.values():
        assert (result.code, result.WhichOneof("response")) == (0, "join"), result
    generation = results[100].join.generation
    return [pb.Caller(job_id=server.job_id, rank=r, incarnation=0x5E55_0000 + r, generation=generation)
            for r in range(world)]


def as_outcome(result: pb.SessionResult) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    code = next(c for c in grpc.StatusCode if c.value[0] == result.code)
    return code, result.details, {m.key: m.value for m in result.metadata}


def ours(outcome: Outcome) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    return outcome.code, outcome.details, {k: v for k, v in outcome.trailing.items() if k.startswith("gridcomm-")}


# ------------------------------------------------------------------------------------ 1. equivalence


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES)
def test_join_set_get_and_20_barriers_of_8_ranks(coordinator_factory, mode):
    world = 8
    server = coordinator_factory(world)
    with clients(server.port, world, mode) as ranks:
        assert on_threads(lambda c: c.join(), ranks) == [1] * world
        ranks[3].set("addr", b"\x00nccl-id\xff")
        assert on_threads(lambda c: c.get("addr", timeout_s=5.0), ranks) == [b"\x00nccl-id\xff"] * world

        def twenty(c: gridcomm.CoordinatorClient) -> int:
            for _ in range(20):
                c.barrier("loop", timeout_s=10.0)
            return c._barrier_seq["loop"]

        # Why back to back: a rank released from #k arrives at #k+1 while others are still being
        # released from #k (the pattern that deadlocks cupyx's store-based barrier).
        assert on_threads(twenty, ranks) == [20] * world
        # The flow travelled as the mode says: one stream for the process, one per client, or
        # each client's own unary channel. Counted before the Status call below, whose own
        # connection can still be open on the server's side for a moment after the call (seen
        # once in about 50 runs of make test: 9 connections for 8 clients in mode "off").
        assert server_connections(server.port) == (1 if mode == "process" else world)
        assert pending_barrier(server.port, "loop") is None
        on_threads(lambda c: c.leave(), ranks)
    assert server.wait_all_left(5.0)
    assert not server.state.failed


def per_call(via: str, timeout_s: float) -> dict[str, float]:
    """A get's or barrier's keyword arguments: its own timeout (``via`` "call"), or none, so that
    it takes the client's (``via`` "client": the path that sends its first slice straight to the
    stream)."""
    return {"timeout_s": timeout_s} if via == "call" else {}


def error_outcomes(mode: str, factory: Callable[..., gridcomm.Coordinator], via: str = "call") -> dict[str, Any]:
    """Every failure a client can see, in one mode; each on a coordinator of its own. ``via``:
    whether get and barrier are given their timeout per call, or take the client's (the path
    that sends a get's or barrier's first slice straight to the stream)."""
    out: dict[str, Any] = {}

    def made(port: int, world: int, timeout_s: float, **kwargs: Any) -> Any:
        if via == "client":
            kwargs["timeout_s"] = timeout_s
        return clients(port, world, mode, **kwargs)

    server = factory(4)
    with made(server.port, 4, 1.0) as ranks:
        on_threads(lambda c: c.join(timeout_s=WAIT_S), ranks)
        # Rank 3 joined but never comes to the barrier.
        out["barrier timeout"] = on_threads(lambda c: outcome(lambda: c.barrier("stuck", **per_call(via, 1.0))), ranks[:3])
        out["get timeout"] = outcome(lambda: ranks[0].get("never-set", **per_call(via, 1.0)))
        out["bad key"] = outcome(lambda: ranks[0].set("", b"x"))

    server = factory(3)
    with clients(server.port, 3, mode, ranks=[1], timeout_s=1.0) as (lonely,):
        out["join timeout"] = outcome(lonely.join)

    server = factory(3, token="right-token")
    with clients(server.port, 3, mode, ranks=[0], token="wrong-token") as (stranger,):
        out["wrong token"] = outcome(stranger.join)

    with socket.socket() as reserved:  # bound, never listening: connections are refused
        reserved.bind(("127.0.0.1", 0))
        with clients(reserved.getsockname()[1], 2, mode, ranks=[0], timeout_s=1.0) as (nobody,):
            out["nothing listening"] = outcome(nobody.join)[:3]  # the message names the port

    server = factory(3)
    with made(server.port, 3, 10.0) as ranks:
        on_threads(lambda c: c.join(timeout_s=WAIT_S), ranks)
        with ThreadPoolExecutor(2) as pool:
            waiting = [pool.submit(outcome, functools.partial(c.barrier, "b", **per_call(via, 10.0))) for c in ranks[::2]]
            wait_for(lambda: arrived(server.port, "b") == [0, 2], "ranks 0 and 2 waiting at barrier 'b'")
            ranks[1].report_failure("CUDA error: an illegal memory access")
            out["rank failed while waiting"] = [f.result(timeout=5.0) for f in waiting]
        out["barrier after failure"] = outcome(lambda: ranks[0].barrier("next", **per_call(via, 5.0)))
        out["get after failure"] = outcome(lambda: ranks[2].get("never-set", **per_call(via, 5.0)))
    return out


@pytest.mark.timeout(90)
def test_every_mode_fails_the_same_way(coordinator_factory):
    runs = [(mode, via) for mode in MODES for via in ("call", "client")]
    with ThreadPoolExecutor(len(runs)) as pool:
        found = dict(zip(runs, pool.map(lambda run: error_outcomes(run[0], coordinator_factory, run[1]), runs, timeout=80),
                         strict=True))
    for run in runs:
        got = found[run]
        assert [o[:3] for o in got["barrier timeout"]] == [("RendezvousTimeout", [3], None)] * 3, (run, got)
        assert "[3]" in got["barrier timeout"][0][3], (run, got)
        assert got["get timeout"][:3] == ("RendezvousTimeout", [], None), (run, got)
        assert "'never-set'" in got["get timeout"][3], (run, got)
        assert got["bad key"][0] == "ConfigError", (run, got)
        assert got["join timeout"][:3] == ("RendezvousTimeout", [0, 2], None), (run, got)
        assert got["wrong token"][0] == "AuthenticationError" and "token is wrong" in got["wrong token"][3], (run, got)
        assert got["nothing listening"] == ("CoordinatorUnavailable", None, None), (run, got)
        for failed in (*got["rank failed while waiting"], got["barrier after failure"], got["get after failure"]):
            assert failed[:3] == ("RankFailedError", None, 1) and "illegal memory access" in failed[3], (run, got)
    # And the modes agree with each other to the word (a Session operation answers as its unary
    # RPC), whether the timeout is the call's or the client's.
    for run in runs:
        assert found[run] == found[("off", "call")], run


@pytest.mark.timeout(30)
# A parked Session get answers a failed job at once, like the unary wait (a bug found here, fixed).
@pytest.mark.parametrize("mode", ["process", "client", "off"])
def test_get_after_a_rank_failed_raises_rank_failed_at_once(coordinator_factory, mode):
    server = coordinator_factory(3)
    with clients(server.port, 3, mode) as ranks:
        on_threads(lambda c: c.join(), ranks)
        ranks[0].set("there", b"v")
        with ThreadPoolExecutor(1) as pool:
            # A get already waiting when the failure comes is woken and told (every mode does this).
            waiting = pool.submit(outcome, lambda: ranks[0].get("never-set", timeout_s=10.0))
            wait_for(lambda: server.state.members[0].active_calls, "rank 0 waiting for its key")
            ranks[1].report_failure("NCCL error: unhandled system error")
            assert waiting.result(timeout=5.0)[:3] == ("RankFailedError", None, 1)
        # What completed is still handed out after a failure; only waiting is refused.
        assert ranks[2].get("there", timeout_s=2.0) == b"v"
        started = time.monotonic()
        got = outcome(lambda: ranks[2].get("never-set", timeout_s=2.0))
        assert (got[:3], time.monotonic() - started < 1.0) == (("RankFailedError", None, 1), True), got


# ------------------------------------------------------------------------------------ 2. sharing


@pytest.mark.timeout(60)
def test_process_mode_shares_one_stream_and_client_mode_opens_one_each(coordinator_factory):
    world = 16
    server = coordinator_factory(world)
    shared_ranks, own_ranks = range(0, 10), range(10, 16)
    with clients(server.port, world, "process", ranks=shared_ranks) as shared, \
            clients(server.port, world, "client", ranks=own_ranks) as own:
        everyone = shared + own
        on_threads(lambda c: c.join(), everyone)
        on_threads(lambda c: c.barrier("together", timeout_s=10.0), everyone)
        shared[0].set("k", b"v")
        assert on_threads(lambda c: c.get("k", timeout_s=5.0), everyone) == [b"v"] * world
        # Ten clients of one process on one connection, six clients on six.
        assert server_connections(server.port) == 1 + len(own_ranks)
        for c in shared[:-1]:
            c.leave()
        # The stream stays while any of its clients does; the last one's calls still travel on it.
        shared[-1].barrier("last", timeout_s=0.2, participants=[shared_ranks[-1]])
        assert server_connections(server.port) == 1 + len(own_ranks)
        on_threads(lambda c: c.leave(), [shared[-1], *own])
    assert server.wait_all_left(5.0)




@pytest.mark.timeout(30)
# The stream's tasks once kept the call (and its connection) alive until a GC pass (found here, fixed).
@pytest.mark.parametrize("mode", ["process", "client", "off"])
def test_the_last_client_to_close_closes_the_connection(coordinator_factory, mode):
    server = coordinator_factory(4)
    # Why without the cyclic collector: closing must not depend on when it happens to run.
    gc.disable()
    try:
        with clients(server.port, 4, mode) as ranks:
            on_threads(lambda c: c.join(), ranks)
            assert server_connections(server.port) == (1 if mode == "process" else 4)
            for c in ranks:
                c.leave()

            def closed() -> bool:
                if _GRPC_BEFORE_1_84:
                    # Why: grpcio before 1.84 keeps a closed stream's call in a cycle of its own
                    # (its StreamStreamCall, _AioCall and a Task: seen with gc.DEBUG_SAVEALL, none
                    # of them gridcomm's), freed by a GC pass; 1.84+ closes without one.
                    gc.collect()
                return server_connections(server.port) == 0

            wait_for(closed, "every connection closed", timeout_s=3.0)
    finally:
        gc.enable()


@pytest.mark.timeout(30)
def test_clients_with_other_credentials_do_not_share_a_stream(coordinator_factory):
    server = coordinator_factory(2, token="the-token")
    with clients(server.port, 2, "process", token="the-token") as ranks, \
            clients(server.port, 2, "process", ranks=[0], token="not-the-token") as (stranger,):
        on_threads(lambda c: c.join(), ranks)
        with pytest.raises(gridcomm.AuthenticationError, match="token is wrong"):
            stranger.join()
        # The refused client did not break the stream its neighbours share.
        on_threads(lambda c: c.barrier("after the stranger", timeout_s=5.0), ranks)
        ranks[1].set("k", b"v")
        assert ranks[0].get("k", timeout_s=1.0) == b"v"


# ------------------------------------------------------------------------------------ 3. raw protocol


@pytest.mark.timeout(30)
def test_one_request_of_mixed_operations_is_answered_by_id():
    with coordinator(2) as (server, channel), raw_session(channel) as session:
        callers = join_on_stream(session, server, 2)
        # The get comes first but can only be answered after the set that follows it.
        session.send(
            op(9000, get=pb.GetRequest(caller=callers[1], key="k", wait_s=5.0)),
            op(3, set=pb.SetRequest(caller=callers[0], key="k", value=b"value")),
            op(77),  # names no operation
            op(5, barrier=pb.BarrierRequest(caller=callers[0], name="", seq=1, wait_s=1.0)),
            op(6, get=pb.GetRequest(caller=pb.Caller(job_id="other", rank=0), key="k", wait_s=1.0)),
        )
        got = session.wait([9000, 3, 77, 5, 6])
        assert (got[9000].code, got[9000].get.value) == (0, b"value")
        assert (got[3].code, got[3].WhichOneof("response")) == (0, "set")
        assert as_outcome(got[77])[0] is grpc.StatusCode.INVALID_ARGUMENT and "names no operation" in got[77].details
        assert got[77].WhichOneof("response") is None
        assert as_outcome(got[5])[0] is grpc.StatusCode.INVALID_ARGUMENT
        assert got[6].code != 0 and got[6].WhichOneof("response") is None
        assert len(session.results) == len(set(r.id for r in session.results)), "an operation was answered twice"
        # Refused operations do not end the stream: it still serves.
        session.send(op(8, barrier=pb.BarrierRequest(caller=callers[0], name="b", seq=1, wait_s=5.0)),
                     op(9, barrier=pb.BarrierRequest(caller=callers[1], name="b", seq=1, wait_s=5.0)))
        assert [r.barrier.seq for r in session.wait([8, 9]).values()] == [1, 1]
        assert not session.ended


@pytest.mark.timeout(30)
def test_each_operation_answers_exactly_as_its_unary_rpc():
    with coordinator(3) as (server, channel), raw_session(channel) as session:
        callers = join_on_stream(session, server, 3)
        stub = pb_grpc.CoordinatorStub(channel)
        job = server.job_id
        stale = pb.Caller(job_id=job, rank=1, incarnation=callers[1].incarnation, generation=callers[1].generation + 7)
        cases = [
            ("join", pb.JoinRequest(job_id=job, rank=0, world_size=4, incarnation=1, wait_s=0.1)),
            ("join", pb.JoinRequest(job_id=job, rank=3, world_size=3, incarnation=1, wait_s=0.1)),
            ("join", pb.JoinRequest(job_id="another-job", rank=0, world_size=3, incarnation=1, wait_s=0.1)),
            ("join", pb.JoinRequest(job_id=job, rank=2, world_size=3, incarnation=callers[2].incarnation, wait_s=0.1)),
            ("set", pb.SetRequest(caller=stale, key="k", value=b"v")),
            ("set", pb.SetRequest(caller=callers[0], key="k" * 5000, value=b"v")),
            ("set", pb.SetRequest(caller=callers[0], key="k", value=b"v")),
            ("get", pb.GetRequest(caller=callers[1], key="k", wait_s=0.1)),
            ("get", pb.GetRequest(caller=callers[1], key="unset", wait_s=0.3)),
            ("get", pb.GetRequest(caller=pb.Caller(job_id=job, rank=1, incarnation=99), key="k", wait_s=0.1)),
            ("barrier", pb.BarrierRequest(caller=callers[0], name="", seq=1, wait_s=0.1)),
            ("barrier", pb.BarrierRequest(caller=callers[0], name="b", seq=2, wait_s=0.1)),
            ("barrier", pb.BarrierRequest(caller=callers[0], name="b", seq=1, wait_s=0.3)),
            ("barrier", pb.BarrierRequest(caller=callers[0], name="g", seq=1, wait_s=0.3, participants=[0, 2])),
            ("barrier", pb.BarrierRequest(caller=callers[1], name="g", seq=1, wait_s=0.1, participants=[0, 2])),
            ("leave", pb.LeaveRequest(caller=stale)),
        ]
        for i, (kind, request) in enumerate(cases):
            unary = call_unary(getattr(stub, kind.capitalize()), request)
            session.send(op(i, **{kind: request}))
            result = session.wait([i])[i]
            on_stream = as_outcome(result)
            assert on_stream == ours(unary), f"{kind} {request}: stream {on_stream} != unary {ours(unary)}"
            if unary.code is OK:
                assert getattr(result, kind) == unary.response, kind
        # The barrier timeouts above named their missing ranks, as the unary ones do.
        assert as_outcome(session.wait([12])[12])[2] == {"gridcomm-missing-ranks": "1,2"}


def parses_as(message_type: Any, body: bytes) -> bool:
    try:
        message_type.FromString(body)
    except Exception:  # noqa: BLE001 - any parse error means "not this message"
        return False
    return True


#: A SessionRequest whose one operation is a join with a job id that is not UTF-8: only the
#: innermost message is wrong.
NESTED_UNDECODABLE = b"\x0a\x08" + b"\x08\x01" + b"\x12\x04" + b"\x0a\x02\xc3\x28"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("body", [b for b in UNDECODABLE if not parses_as(pb.SessionRequest, b)] + [NESTED_UNDECODABLE])
def test_undecodable_stream_message_ends_the_stream_and_the_coordinator_serves_on(body):
    assert not parses_as(pb.SessionRequest, body)
    with coordinator(2) as (server, channel):
        empty = pb.SessionRequest().SerializeToString()  # a valid message with no operation
        outcome = raw_stream(channel, [empty, body])
        assert (outcome.code, "SessionRequest" in outcome.details) == (grpc.StatusCode.INVALID_ARGUMENT, True), outcome
        assert_serving(channel, what="after an undecodable Session message")
        client_flow(server.port, 2, "after-garbage")


def raw_stream(channel: grpc.Channel, bodies: Sequence[bytes], timeout_s: float = 3.0) -> Outcome:
    """A Session call of raw bytes (no serialisation on this side); replies are raw bytes too."""
    call = channel.stream_stream(f"/{SERVICE}/Session")(iter(list(bodies)), timeout=timeout_s)
    started = time.monotonic()
    try:
        replies = list(call)
    except grpc.RpcError as exc:
        return _outcome_of(exc, started)
    return Outcome(OK, "", {}, replies, time.monotonic() - started)


@pytest.mark.timeout(60)
# The abort once raced the reply's write and left the stream hanging (found here, fixed).
def test_undecodable_message_while_a_reply_is_being_written_ends_the_stream():
    with coordinator(1) as (server, channel), raw_session(channel) as session:
        (caller,) = join_on_stream(session, server, 1)
        call_unary(pb_grpc.CoordinatorStub(channel).Set, pb.SetRequest(caller=caller, key="big", value=b"x" * (1 << 20)))
        get = pb.SessionRequest(ops=[op(1, get=pb.GetRequest(caller=caller, key="big"))]).SerializeToString()
        for attempt in range(12):  # the abort races the reply's write: several streams, so no pass by luck
            outcome = raw_stream(channel, [get, b"\xff"], timeout_s=2.0)
            assert (outcome.code, "SessionRequest" in outcome.details) == (grpc.StatusCode.INVALID_ARGUMENT, True), \
                (attempt, outcome)
        assert_serving(channel, what="after undecodable Session messages")


@pytest.mark.timeout(60)
def test_operations_beyond_the_per_stream_bound_are_refused_and_the_stream_recovers():
    bound = 1024  # _ServerSession's bound for a small world: max(1024, 2 * world_size + 64)
    extra = 16
    with coordinator(2) as (server, channel), raw_session(channel) as session:
        callers = join_on_stream(session, server, 2)
        ids = list(range(1, bound + extra + 1))
        for start in range(0, len(ids), 260):
            session.send(*(op(i, get=pb.GetRequest(caller=callers[i % 2], key=f"never-{i}", wait_s=2.0))
                           for i in ids[start:start + 260]))
        refused = session.wait(ids[bound:], timeout_s=5.0)
        for result in refused.values():
            code, details, _ = as_outcome(result)
            assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and f"{bound} operations waiting" in details, result
        # While this stream is full, another one is served.
        with raw_session(channel) as other:
            other.send(op(1, set=pb.SetRequest(caller=callers[0], key="k", value=b"v")),
                       op(2, get=pb.GetRequest(caller=callers[1], key="k", wait_s=1.0)))
            assert other.wait([1, 2])[2].get.value == b"v"
        assert_serving(channel, what="with a full Session stream")
        timed_out = session.wait(ids[:bound], timeout_s=15.0)
        assert {as_outcome(r)[0] for r in timed_out.values()} == {grpc.StatusCode.DEADLINE_EXCEEDED}
        assert len(session.results) == len(ids) + 2  # + the joins; each operation answered once
        # The waits ended, so the stream takes operations again.
        session.send(op(5000, get=pb.GetRequest(caller=callers[0], key="k", wait_s=1.0)))
        assert session.wait([5000])[5000].get.value == b"v"
        assert not server.state.failed


@pytest.mark.timeout(30)
@pytest.mark.parametrize("metadata, words", [((), "token is missing"),
                                             ((("authorization", "Bearer wrong"),), "token is wrong")])
def test_session_without_the_token_is_unauthenticated(metadata, words):
    with coordinator(2, token="the-token") as (server, channel), raw_session(channel, metadata) as session:
        session.send(op(1, join=pb.JoinRequest(job_id=server.job_id, rank=0, world_size=2, incarnation=1, wait_s=0.1)))
        error = session.wait_end()
        assert error is not None and error.code() is grpc.StatusCode.UNAUTHENTICATED, error
        assert words in error.details()
        assert session.results == [] and 0 not in server.state.members
    with coordinator(2, token="the-token") as (server, channel), \
            raw_session(channel, (("authorization", "Bearer the-token"),)) as session:
        assert len(join_on_stream(session, server, 2)) == 2


# ------------------------------------------------------------------------------------ 4. fallback


class _CountCalls(grpc.ServerInterceptor):
    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        self.calls[details.method.rsplit("/", 1)[-1]] += 1
        return continuation(details)


@contextlib.contextmanager
def coordinator_without_session(world: int) -> Iterator[tuple[gridcomm.Coordinator, int, _CountCalls]]:
    """A real coordinator behind a gRPC server that serves only the unary RPCs (passed through as
    bytes, with their status and gridcomm-* trailers): Session is UNIMPLEMENTED, as on an older
    coordinator. Yields the coordinator, the front's port and its call counts."""
    server = start_coordinator(world)
    upstream = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    counter = _CountCalls()
    front = grpc.server(ThreadPoolExecutor(4 * world + 8), interceptors=[counter])

    def forward(method: str) -> grpc.RpcMethodHandler:
        rpc = upstream.unary_unary(f"/{SERVICE}/{method}")

        def handle(body: bytes, context: grpc.ServicerContext) -> bytes:
            metadata = [(k, v) for k, v in context.invocation_metadata() if k == "authorization"]
            try:
                return rpc(body, timeout=context.time_remaining(), metadata=metadata)
            except grpc.RpcError as exc:
                context.set_trailing_metadata([(k, v) for k, v in exc.trailing_metadata() or ()
                                               if k.startswith("gridcomm-")])
                context.abort(exc.code(), exc.details())
                raise  # unreachable: abort raises

        return grpc.unary_unary_rpc_method_handler(handle)

    front.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {m: forward(m) for m in UNARY}),))
    port = front.add_insecure_port("127.0.0.1:0")
    front.start()
    try:
        yield server, port, counter
    finally:
        front.stop(0)
        upstream.close()
        server.stop()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES)
# via: get and barrier given their timeout per call, or taking the client's (the path that sends
# the first slice straight to the stream, and repeats it as a unary call itself).
@pytest.mark.parametrize("via", ["call", "client"])
def test_a_coordinator_without_session_is_served_by_unary_calls(mode, via):
    world = 3
    with coordinator_without_session(world) as (server, port, counter), clients(port, world, mode) as ranks:
        assert on_threads(lambda c: c.join(), ranks) == [1] * world
        # The stream was tried (by every client that has a stream of its own), refused, and the
        # joins were made as unary calls.
        assert {"process": counter.calls["Session"] >= 1, "client": counter.calls["Session"] >= world,
                "off": counter.calls["Session"] == 0}[mode], counter.calls
        ranks[0].set("k", b"v")
        if via == "client":
            for c in ranks:
                c.timeout_s = 5.0
        assert on_threads(lambda c: c.get("k", **per_call(via, 5.0)), ranks) == [b"v"] * world
        for _ in range(5):
            on_threads(lambda c: c.barrier("b", **per_call(via, 5.0)), ranks)
        if via == "client":
            for c in ranks:
                c.timeout_s = 0.5
        assert [o[:3] for o in on_threads(lambda c: outcome(lambda: c.barrier("late", **per_call(via, 0.5))), ranks[:2])] \
            == [("RendezvousTimeout", [2], None)] * 2
        on_threads(lambda c: c.leave(), ranks)
        assert server.wait_all_left(5.0)
        # Every operation was a unary call.
        assert counter.calls["Join"] >= world and counter.calls["Leave"] == world and counter.calls["Set"] == 1
        assert counter.calls["Barrier"] >= 5 * world + 2, counter.calls


@pytest.mark.timeout(60)
# A refusal racing a write once hid UNIMPLEMENTED, so every operation retried the stream (found here, fixed).
def test_a_coordinator_without_session_is_tried_once_per_stream():
    world = 16
    for trial in range(8):  # the refusal races a write: several rounds, so the test does not pass by luck
        with coordinator_without_session(world) as (server, port, counter), clients(port, world, "client") as ranks:
            on_threads(lambda c: c.join(), ranks)
            for _ in range(3):
                on_threads(lambda c: c.barrier("b", timeout_s=5.0), ranks)
            on_threads(lambda c: c.leave(), ranks)
            assert counter.calls["Session"] == world, f"trial {trial}: {counter.calls['Session']} Session calls"


class TcpProxy:
    """Forwards 127.0.0.1:port to the coordinator; ``cut()`` drops every connection made so far
    (what a restarted load balancer or a flapping link does to a long-lived stream)."""

    def __init__(self, upstream_port: int) -> None:
        self._upstream_port = upstream_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.accepted = 0
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self._listener.accept()
                up = socket.create_connection(("127.0.0.1", self._upstream_port), timeout=5.0)
            except OSError:
                return
            up.settimeout(None)
            with self._lock:
                self.accepted += 1
                self._open += [down, up]
            for src, dst in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        with self._lock:
            socks, self._open = self._open, []
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        self._listener.close()
        self.cut()


@contextlib.contextmanager
def proxied_pair(factory: Callable[..., gridcomm.Coordinator], mode: str
                 ) -> Iterator[tuple[gridcomm.Coordinator, TcpProxy, gridcomm.CoordinatorClient, gridcomm.CoordinatorClient]]:
    """A joined job of two: rank 0 dials through a proxy, rank 1 directly."""
    server = factory(2)
    proxy = TcpProxy(server.port)
    try:
        with clients(proxy.port, 2, mode, ranks=[0]) as (near,), clients(server.port, 2, mode, ranks=[1]) as (far,):
            on_threads(lambda c: c.join(), [near, far])
            yield server, proxy, near, far
    finally:
        proxy.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("via", ["call", "client"])  # as in test_a_coordinator_without_session_is_served_by_unary_calls
def test_a_stream_cut_mid_wait_is_repeated_as_a_unary_call(coordinator_factory, mode, via):
    with proxied_pair(coordinator_factory, mode) as (server, proxy, near, far), ThreadPoolExecutor(1) as pool:
        assert proxy.accepted == 1  # near's stream (or unary channel) carried its join
        near.timeout_s = 15.0
        waiting = pool.submit(outcome, lambda: near.barrier("x", **per_call(via, 15.0)))
        wait_for(lambda: arrived(server.port, "x") == [0], "rank 0 waiting at barrier 'x'")
        proxy.cut()
        # near dials again (its repeated call, or the unary channel's retry) and is still waiting.
        wait_for(lambda: proxy.accepted >= 2, "rank 0 dialled again")
        assert not waiting.done()
        far.barrier("x", timeout_s=5.0)
        assert waiting.result(timeout=10.0) == ("no error", None, None, "")
        # Counted once: the next instance needs both ranks again and completes.
        assert pending_barrier(server.port, "x") is None
        on_threads(lambda c: c.barrier("x", timeout_s=5.0), [near, far])
        assert near._barrier_seq["x"] == far._barrier_seq["x"] == 2 and pending_barrier(server.port, "x") is None
        assert not server.state.failed


@pytest.mark.timeout(60)
# The unary repeat once got the whole slice again (found here, fixed).
@pytest.mark.parametrize("mode", ["off", "process"])
@pytest.mark.parametrize("via", ["call", "client"])  # as in test_a_coordinator_without_session_is_served_by_unary_calls
def test_a_stream_cut_late_in_a_wait_keeps_the_callers_deadline(coordinator_factory, mode, via):
    timeout_s, cut_at_s = 2.5, 2.0
    bound_s = timeout_s + 1.0 + 0.3  # the unary call's deadline (wait + the client's 1 s slack) + scheduling
    with proxied_pair(coordinator_factory, mode) as (server, proxy, near, far):
        near.timeout_s = timeout_s
        cutter = threading.Timer(cut_at_s, proxy.cut)
        started = time.monotonic()
        cutter.start()
        try:
            got = outcome(lambda: near.barrier("late", **per_call(via, timeout_s)))
        finally:
            cutter.cancel()
        elapsed = time.monotonic() - started
        assert got[:3] == ("RendezvousTimeout", [1], None), got
        assert elapsed <= bound_s, f"barrier(timeout_s={timeout_s}) answered after {elapsed:.2f} s"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES)
# With the client's timeout, a get's or barrier's first slice goes straight to the stream; a slice
# that ends unanswered goes on as the long poll, whose deadline counts from the first slice's start.
def test_a_long_poll_goes_on_after_its_first_slice_and_keeps_the_clients_deadline(coordinator_factory, monkeypatch, mode):
    slice_s, timeout_s = 0.8, 1.2
    bound_s = timeout_s + 0.45  # counted again from the second slice it would be slice_s + timeout_s = 2.0 s
    monkeypatch.setattr(gridcomm._client, "PROGRESS_INTERVAL_S", slice_s)
    server = coordinator_factory(2)
    with clients(server.port, 2, mode) as ranks, ThreadPoolExecutor(2) as pool:
        on_threads(lambda c: c.join(), ranks)
        for c in ranks:
            c.timeout_s = 5.0
        # Answered in the third slice: rank 1 comes after 2 s.
        later = pool.submit(lambda: (time.sleep(2.0), ranks[1].set("late", b"v"), ranks[1].barrier("slow")))
        started = time.monotonic()
        got = pool.submit(lambda: (ranks[0].get("late"), ranks[0].barrier("slow")))
        assert got.result(timeout=10.0) == (b"v", None) and later.result(timeout=10.0)[1:] == (None, None)
        assert time.monotonic() - started >= 2.0
        assert ranks[0]._barrier_seq["slow"] == ranks[1]._barrier_seq["slow"] == 1
        assert pending_barrier(server.port, "slow") is None
        # Never answered: the error comes at the client's deadline, not one slice later.
        ranks[0].timeout_s = timeout_s
        for call, expected in ((lambda: ranks[0].barrier("stuck"), ("RendezvousTimeout", [1], None)),
                               (lambda: ranks[0].get("never-set"), ("RendezvousTimeout", [], None))):
            started = time.monotonic()
            found = outcome(call)
            elapsed = time.monotonic() - started
            assert found[:3] == expected, found
            assert timeout_s - 0.05 <= elapsed <= bound_s, f"{found[3]}: after {elapsed:.2f} s"


# ------------------------------------------------------------------------------------ 5. idempotence


@pytest.mark.timeout(30)
def test_the_same_barrier_arrival_twice_on_a_stream_counts_once():
    with coordinator(3) as (server, channel), raw_session(channel) as session:
        callers = join_on_stream(session, server, 3)
        arrival = pb.BarrierRequest(caller=callers[0], name="once", seq=1, wait_s=0.3)
        session.send(op(1, barrier=arrival), op(2, barrier=arrival))  # twice in one request
        session.send(op(3, barrier=arrival))  # and again in the next
        # Were rank 0 counted more than once, rank 1's arrival would complete the barrier of three.
        session.send(op(4, barrier=pb.BarrierRequest(caller=callers[1], name="once", seq=1, wait_s=0.3)))
        for result in session.wait([1, 2, 3, 4]).values():
            code, details, metadata = as_outcome(result)
            assert code is grpc.StatusCode.DEADLINE_EXCEEDED and metadata == {"gridcomm-missing-ranks": "2"}, result
        pending = pending_barrier(server.port, "once")
        assert pending is not None and (list(pending.arrived_ranks), list(pending.missing_ranks)) == ([0, 1], [2])
        session.send(op(5, barrier=pb.BarrierRequest(caller=callers[2], name="once", seq=1, wait_s=1.0)),
                     op(6, barrier=arrival))
        assert [(r.code, r.barrier.seq) for r in session.wait([5, 6]).values()] == [(0, 1), (0, 1)]
        assert pending_barrier(server.port, "once") is None
        assert server.state.barriers["once"].completed == 1


# ------------------------------------------------------------------------------------ 6. groups


def by_id(results: Sequence[pb.SessionResult]) -> dict[int, pb.SessionResult]:
    """Each operation id answered so far, a group's result under every id it answers."""
    answered: dict[int, pb.SessionResult] = {}
    for result in results:
        for op_id in (result.id, *result.also):
            assert op_id not in answered, f"operation {op_id} was answered twice"
            answered[op_id] = result
    return answered


def wait_ids(session: RawSession, ids: Sequence[int], timeout_s: float = 10.0) -> dict[int, pb.SessionResult]:
    """The results for ``ids``, counting the ids a group's result answers."""
    want = set(ids)
    with session._cv:
        session._cv.wait_for(lambda: want <= set(by_id(session.results)) or session.ended, timeout_s)
        got = {i: r for i, r in by_id(session.results).items() if i in want}
    assert set(got) == want, f"results for {sorted(want - set(got))} missing after {timeout_s} s; error {session.error}"
    return got


def grouped(lead_id: int, kind: str, request: Any, members: Sequence[tuple[int, pb.Caller]]) -> pb.SessionOp:
    return pb.SessionOp(id=lead_id, also=[pb.GroupMember(id=i, caller=c) for i, c in members], **{kind: request})


@pytest.mark.timeout(30)
def test_the_coordinator_says_it_takes_groups():
    with coordinator(1) as (server, channel), raw_session(channel) as session:
        metadata = dict(session.call.initial_metadata())
        assert "group" in metadata.get("gridcomm-session-features", "").split(","), metadata


@pytest.mark.timeout(30)
def test_a_grouped_barrier_arrives_for_every_member_and_is_answered_once():
    with coordinator(4) as (server, channel), raw_session(channel) as session:
        callers = join_on_stream(session, server, 4)
        before = len(session.results)
        session.send(grouped(1, "barrier", pb.BarrierRequest(caller=callers[0], name="g", seq=1, wait_s=5.0),
                             [(2, callers[1]), (3, callers[2])]))
        # Every member arrived (the Status RPC lists them), and only rank 3 is awaited.
        wait_for(lambda: arrived(server.port, "g") == [0, 1, 2], "the group's three arrivals")
        assert list(pending_barrier(server.port, "g").missing_ranks) == [3]
        session.send(op(4, barrier=pb.BarrierRequest(caller=callers[3], name="g", seq=1, wait_s=5.0)))
        got = wait_ids(session, [1, 2, 3, 4])
        assert {i: (r.code, r.barrier.seq) for i, r in got.items()} == {1: (0, 1), 2: (0, 1), 3: (0, 1), 4: (0, 1)}
        assert got[1] is got[2] is got[3], "the group was not answered by one result"
        assert len(session.results) - before == 2
        assert server._servicer.grouped == 2
        # A second instance by the same group completes as well (each member's seq counted).
        session.send(grouped(5, "barrier", pb.BarrierRequest(caller=callers[3], name="g", seq=2, wait_s=5.0),
                             [(6, callers[0]), (7, callers[1]), (8, callers[2])]))
        assert {r.barrier.seq for r in wait_ids(session, [5, 6, 7, 8]).values()} == {2}
        assert server.state.barriers["g"].completed == 2


@pytest.mark.timeout(30)
def test_a_refused_member_is_answered_alone_as_its_unary_call_and_the_rest_go_on():
    with coordinator(4) as (server, channel), raw_session(channel) as session:
        callers = join_on_stream(session, server, 4)
        stub = pb_grpc.CoordinatorStub(channel)
        stale = pb.Caller(job_id=server.job_id, rank=2, incarnation=callers[2].incarnation,
                          generation=callers[2].generation + 3)
        other_job = pb.Caller(job_id="someone-else", rank=1)
        # What the unary calls of the two bad members answer (neither arrives, so both can be asked first).
        unary_stale = ours(call_unary(stub.Barrier, pb.BarrierRequest(caller=stale, name="m", seq=1, wait_s=0.1)))
        unary_other = ours(call_unary(stub.Barrier, pb.BarrierRequest(caller=other_job, name="m", seq=1, wait_s=0.1)))
        assert unary_stale[0] is grpc.StatusCode.FAILED_PRECONDITION and unary_other[0] is grpc.StatusCode.INVALID_ARGUMENT
        session.send(grouped(1, "barrier", pb.BarrierRequest(caller=stale, name="m", seq=1, wait_s=0.5),
                             [(2, callers[0]), (3, other_job), (4, callers[1])]))
        got = wait_ids(session, [1, 2, 3, 4])
        assert as_outcome(got[1]) == unary_stale
        assert as_outcome(got[3]) == unary_other
        assert got[1].also == [] and got[3].also == [], "a refused member's result answered others too"
        # The two good members arrived and wait together for rank 2, at the group's deadline.
        assert got[2] is got[4] and sorted((got[2].id, *got[2].also)) == [2, 4]
        assert as_outcome(got[2])[0] is grpc.StatusCode.DEADLINE_EXCEEDED
        assert as_outcome(got[2])[2] == {"gridcomm-missing-ranks": "2,3"}
        # Every member refused: each answered alone, nothing arrives.
        session.send(grouped(5, "barrier", pb.BarrierRequest(caller=stale, name="n", seq=1, wait_s=0.5),
                             [(6, other_job)]))
        got = wait_ids(session, [5, 6])
        assert as_outcome(got[5]) == unary_stale and got[5] is not got[6]
        assert pending_barrier(server.port, "n") is None


@pytest.mark.timeout(30)
def test_a_grouped_get_waits_once_and_answers_every_member_with_the_value():
    with coordinator(3) as (server, channel), raw_session(channel) as session:
        callers = join_on_stream(session, server, 3)
        session.send(grouped(1, "get", pb.GetRequest(caller=callers[1], key="blob", wait_s=5.0), [(2, callers[2])]))
        time.sleep(0.2)
        assert not set(by_id(session.results)) & {1, 2}, "answered before the key was set"
        session.send(op(3, set=pb.SetRequest(caller=callers[0], key="blob", value=b"x" * 128)))
        got = wait_ids(session, [1, 2, 3])
        assert got[1] is got[2] and (got[1].code, got[1].get.value) == (0, b"x" * 128)
        # Already set: answered at once, still one result.
        session.send(grouped(4, "get", pb.GetRequest(caller=callers[0], key="blob", wait_s=5.0),
                             [(5, callers[1]), (6, callers[2])]))
        got = wait_ids(session, [4, 5, 6])
        assert got[4] is got[5] is got[6] and got[4].get.value == b"x" * 128
        # A group that times out names the key, once for all.
        session.send(grouped(7, "get", pb.GetRequest(caller=callers[0], key="never", wait_s=0.3), [(8, callers[1])]))
        got = wait_ids(session, [7, 8])
        assert got[7] is got[8] and as_outcome(got[7])[0] is grpc.StatusCode.DEADLINE_EXCEEDED
        assert "never" in got[7].details


@pytest.mark.timeout(30)
def test_groups_of_what_cannot_be_grouped_or_too_large_are_refused_for_every_member():
    with coordinator(2) as (server, channel), raw_session(channel) as session:
        callers = join_on_stream(session, server, 2)
        session.send(grouped(1, "set", pb.SetRequest(caller=callers[0], key="k", value=b"v"), [(2, callers[1])]))
        got = wait_ids(session, [1, 2])
        assert got[1] is got[2] and as_outcome(got[1])[0] is grpc.StatusCode.INVALID_ARGUMENT
        assert "cannot be grouped" in got[1].details
        assert server.state.get("k") is None, "a refused group was carried out"
        session.send(grouped(3, "barrier", pb.BarrierRequest(caller=callers[0], name="big", seq=1, wait_s=1.0),
                             [(10 + i, callers[i % 2]) for i in range(2)]))
        got = wait_ids(session, [3, 10, 11])
        assert got[3] is got[10] is got[11] and as_outcome(got[3])[0] is grpc.StatusCode.INVALID_ARGUMENT
        assert "larger than the job" in got[3].details
        assert pending_barrier(server.port, "big") is None
        # The stream serves on.
        session.send(op(20, barrier=pb.BarrierRequest(caller=callers[0], name="b", seq=1, wait_s=5.0)),
                     op(21, barrier=pb.BarrierRequest(caller=callers[1], name="b", seq=1, wait_s=5.0)))
        assert {r.code for r in wait_ids(session, [20, 21]).values()} == {0}


@pytest.mark.timeout(60)
def test_the_ranks_of_one_process_are_grouped_and_each_sees_its_own_errors(coordinator_factory):
    """16 ranks as threads of this process, 20 back-to-back barriers and a get of one key: the
    coordinator received some of them as groups, and every rank passed every barrier; then a rank
    whose caller is stale (a rejoined generation it missed) gets its own error, not the group's."""
    world = 16
    server = coordinator_factory(world)
    with clients(server.port, world, "process") as made:
        on_threads(lambda c: c.join(), made)

        def rank_main(c: gridcomm.CoordinatorClient) -> bytes:
            for _ in range(20):
                c.barrier("loop")
            if c.rank == 0:
                c.set("blob", b"b" * 128)
            return c.get("blob")

        assert on_threads(rank_main, made) == [b"b" * 128] * world
        assert server.state.barriers["loop"].completed == 20
        assert server._servicer.grouped > 0, "no operation of 16 threads came grouped"
        # Rank 5's client believes in a generation the job is not at: only it is refused.
        made[5].generation += 1

        def last(c: gridcomm.CoordinatorClient) -> str:
            try:
                c.barrier("last", timeout_s=2.0)
            except gridcomm.GridcommError as exc:
                return type(exc).__name__ + ": " + str(exc)
            return "ok"

        outcomes = on_threads(last, [c for c in made])
        assert "generation" in outcomes[5] and outcomes[5] != "ok", outcomes[5]
        # The others wait for rank 5, which never arrived: they time out naming it.
        assert all(o.startswith("RendezvousTimeout") and "[5]" in o for i, o in enumerate(outcomes) if i != 5), outcomes


@pytest.mark.timeout(60)
def test_a_coordinator_that_does_not_say_it_takes_groups_gets_none(coordinator_factory, monkeypatch):
    from gridcomm import _server
    monkeypatch.setattr(_server, "SESSION_FEATURES", "something-else")
    world = 8
    server = coordinator_factory(world)
    with clients(server.port, world, "process") as made:
        on_threads(lambda c: c.join(), made)
        on_threads(lambda c: [c.barrier("x") for _ in range(10)], made)
    assert server.state.barriers["x"].completed == 10
    assert server._servicer.grouped == 0


@pytest.mark.timeout(60)
def test_an_operation_held_for_the_other_clients_is_sent_when_they_do_not_come(coordinator_factory):
    """A whole-job barrier or a get waits briefly for the other clients of its stream to make it
    too; one that the others never make still goes out, and an operation that is not held (a
    set, a barrier of some ranks) sends what is held with it."""
    world = 4
    server = coordinator_factory(world)
    with clients(server.port, world, "process") as made:
        on_threads(lambda c: c.join(), made)
        made[0].set("k", b"v")
        for _ in range(5):
            assert made[0].get("k", timeout_s=5.0) == b"v"  # only client 0 asks
        # A get held for a key that a set of another client of the stream then provides.
        got: queue.Queue[bytes] = queue.Queue()
        waiter = threading.Thread(target=lambda: got.put(made[1].get("later", timeout_s=10.0)), daemon=True)
        waiter.start()
        made[2].set("later", b"w")
        assert got.get(timeout=10.0) == b"w"
        on_threads(lambda c: c.barrier("some", participants=[0, 1], timeout_s=5.0), made[:2])

        # A whole-job barrier whose last local rank comes late (beyond any hold) still completes.
        def late(c: gridcomm.CoordinatorClient) -> None:
            if c.rank == 3:
                time.sleep(0.2)
            c.barrier("late", timeout_s=5.0)

        on_threads(late, made)
        assert server.state.barriers["late"].completed == 1
        on_threads(lambda c: [c.barrier("all", timeout_s=5.0) for _ in range(5)], made)
        assert server.state.barriers["all"].completed == 5
        assert server.state.barriers["some"].completed == 1


@pytest.mark.timeout(60)
def test_the_first_operation_of_a_hold_keeps_its_time_on_its_own_thread(coordinator_factory):
    """The first operation of a held group does not wake the loop just to start a timer: its
    thread keeps the hold's time. So the whole-job barriers of a process's ranks cost one drain
    each (two before), and an operation the other clients never make still goes out when its
    hold ends, not at its deadline."""
    world, barriers = 4, 20
    server = coordinator_factory(world)
    with clients(server.port, world, "process") as made:
        on_threads(lambda c: c.join(), made)
        session = made[0]._session
        assert all(c._session is session for c in made)
        before = session._drains
        on_threads(lambda c: [c.barrier("all", timeout_s=10.0) for _ in range(barriers)], made)
        assert server.state.barriers["all"].completed == barriers
        # One drain per barrier; a hold that runs out on a slow machine adds one (the margin).
        drains = session._drains - before
        assert drains <= barriers * 3 // 2, f"{drains} drains for {barriers} barriers"
        made[1].set("k", b"v")
        for _ in range(3):
            started = time.monotonic()
            assert made[0].get("k", timeout_s=5.0) == b"v"  # only client 0 asks: its hold runs out
            elapsed = time.monotonic() - started
            assert elapsed < 1.0, f"a lone get took {elapsed:.2f} s (its hold is {_session.HOLD_GET_S} s)"


@pytest.mark.timeout(60)
def test_a_hold_ends_once_every_client_of_the_stream_is_waiting(coordinator_factory, monkeypatch):
    """A held group waits for the stream's other clients only while one of them could still
    join it. Here two of the four clients of a stream already wait elsewhere (a barrier of some
    ranks), so the other two's get has nobody left to wait for and goes out at once, not when
    its hold runs out. Why it matters: a process whose ranks reach a get or barrier over more
    than the hold sends them in parts, and its last part could never be complete."""
    world = 5
    server = coordinator_factory(world)
    extra = client(server.port, 4, world, "off")
    side = ThreadPoolExecutor(2)
    try:
        with clients(server.port, world, "process", ranks=[0, 1, 2, 3]) as made:
            on_threads(lambda c: c.join(), [*made, extra])
            extra.set("k", b"v")
            waiting = [side.submit(c.barrier, "side", 30.0, participants=[0, 1, 4]) for c in made[:2]]
            wait_for(lambda: sorted(arrived(server.port, "side")) == [0, 1], "clients 0 and 1 at the side barrier")
            # A hold far longer than the wait allowed below: the outcome is not a matter of timing.
            monkeypatch.setattr(_session, "HOLD_GET_S", 5.0)
            started = time.monotonic()
            assert on_threads(lambda c: c.get("k", timeout_s=20.0), made[2:]) == [b"v", b"v"]
            elapsed = time.monotonic() - started
            assert elapsed < 2.5, f"the gets of the last two clients took {elapsed:.2f} s (held for clients that wait)"
            extra.barrier("side", timeout_s=10.0, participants=[0, 1, 4])
            for done in waiting:
                done.result(timeout=10.0)
    finally:
        side.shutdown(wait=False)
        extra.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("via", ["call", "client"])
def test_a_changed_generation_is_what_every_path_sends(coordinator_factory, via):
    """A client whose generation changed (a rejoin it missed, here set by hand) sends the new
    one on every path: the fast path of get and barrier (the client's timeout) reads the same
    identity as the rest, so the coordinator refuses it by its generation either way."""
    server = coordinator_factory(2)
    with clients(server.port, 2, "process", timeout_s=2.0) as made:
        on_threads(lambda c: c.join(), made)
        made[1].generation += 1
        for call in (lambda: made[1].barrier("b", **per_call(via, 2.0)), lambda: made[1].get("k", **per_call(via, 2.0))):
            found = outcome(call)
            assert found[0] != "no error" and "generation" in found[3], found
        assert made[1].caller.generation == made[1].generation


class _Interrupted(Exception):
    pass


@pytest.mark.timeout(60)
def test_an_interrupted_hold_keeper_hands_the_hold_to_the_loop(coordinator_factory):
    """The thread that keeps a hold's time (the first of a group) may be interrupted, as the main
    thread is by a signal whose handler raises (KeyboardInterrupt). What it held goes out at once
    all the same: its arrival reaches the coordinator, and the barrier completes for the others
    instead of waiting for the next operation of this stream."""
    server = coordinator_factory(3)
    extra = client(server.port, 2, 3, "off")
    previous = signal.getsignal(signal.SIGUSR1)

    def interrupt(signum: int, frame: Any) -> None:
        raise _Interrupted()

    signal.signal(signal.SIGUSR1, interrupt)
    try:
        with clients(server.port, 3, "process", ranks=[0, 1]) as made:
            on_threads(lambda c: c.join(), [*made, extra])
            assert threading.current_thread() is threading.main_thread()
            timer = threading.Timer(0.005, os.kill, args=(os.getpid(), signal.SIGUSR1))
            timer.start()
            with pytest.raises(_Interrupted):
                made[0].barrier("x", timeout_s=10.0)  # whole-job: held up to 20 ms, this thread keeps it
            timer.join()
            deadline = time.monotonic() + 2.0
            while server.state.barriers.get("x") is None or server.state.barriers["x"].arrived[0] < 1:
                assert time.monotonic() < deadline, "rank 0's interrupted arrival never left the process"
                time.sleep(0.01)
            on_threads(lambda c: c.barrier("x", timeout_s=5.0), [made[1], extra])
            assert server.state.barriers["x"].completed == 1
    finally:
        signal.signal(signal.SIGUSR1, previous)
        extra.close()


@pytest.mark.timeout(60)
def test_an_operation_the_loop_cannot_build_falls_back_alone(coordinator_factory):
    """Get and barrier requests are built on the loop (only the lead of a group is sent). One
    that cannot become a message there (the client's own checks would have refused it) ends
    only its own operation: its caller repeats it as a unary call, which builds it again and
    raises there; the stream and what else it carries go on."""
    server = coordinator_factory(2)
    with clients(server.port, 2, "process") as made:
        on_threads(lambda c: c.join(), made)
        session = made[0]._session
        stream = session._call
        bad = _session.Deferred((pb.GetRequest, made[0].caller, 1.0, {"key": "half\ud800"}))
        with pytest.raises(_session.StreamBroken, match="could not carry the operation"):
            session.call("get", bad, 5.0, ("get", "half"), _session.HOLD_GET_S)
        made[1].set("k", b"v")
        assert on_threads(lambda c: c.get("k", timeout_s=5.0), made) == [b"v", b"v"]
        on_threads(lambda c: c.barrier("after", timeout_s=5.0), made)
        assert session._call is stream, "the stream was replaced"


@pytest.mark.timeout(60)
def test_closing_the_clients_ends_a_waiting_operation_at_once(coordinator_factory):
    """A barrier that another thread's close() interrupts ends with CommAborted at once, not at
    its 30 s deadline (the stream is gone; the unary repeat is refused by the closed client)."""
    server = coordinator_factory(3)
    extra = client(server.port, 2, 3, "off")
    try:
        with clients(server.port, 3, "process", ranks=[0, 1]) as made:
            on_threads(lambda c: c.join(), [*made, extra])
            outcome_q: queue.Queue[str] = queue.Queue()

            def wait() -> None:
                try:
                    made[0].barrier("waiting", timeout_s=30.0)
                    outcome_q.put("passed")
                except gridcomm.GridcommError as exc:
                    outcome_q.put(type(exc).__name__)

            threading.Thread(target=wait, daemon=True).start()
            wait_for(lambda: arrived(server.port, "waiting") == [0], "rank 0 waiting at the coordinator")
            for c in made:
                c.close()
            assert outcome_q.get(timeout=10.0) == "CommAborted"
    finally:
        extra.close()
