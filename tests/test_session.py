"""The Session stream (join/set/get/barrier/leave over one long-lived bidi stream) against real
coordinators on loopback, with real clients (threads, one per rank) and hand-made wire traffic.

1. Equivalence: the same flows and the same failures in every GRIDCOMM_SESSION mode (client,
   off): join, set/get, 20 back-to-back barriers of 8 ranks, barrier/get/join timeouts
   naming the missing ranks, wrong token, nothing listening, a rank that reports a failure. Error
   types, missing ranks, failed rank and message text are compared across the modes.
2. Connections: from the server side (this process's accepted TCP connections to the
   coordinator's port, read from /proc/net/tcp), every client has a stream and a connection of
   its own (a rank stands for a pod); the last client to close closes its connection.
3. The raw protocol, with the generated stub and with byte-level channels: one request answered by
   id, an operation with no oneof, each operation answering exactly as its unary RPC (code,
   details, gridcomm-* trailers), undecodable bytes, the per-stream bound on waiting operations,
   missing and wrong tokens.
4. Fallback: a stream cut mid-wait by a TCP proxy between client and coordinator.
5. Idempotence: the same barrier arrival (same seq) sent twice on a stream is counted once.
6. Identity and close: a changed generation is what every path sends; closing the clients ends
   an operation in flight at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import os
import queue
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

import gridcomm
from gridcomm._client.client import fetch_status
from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._proto import coordinator_pb2_grpc as pb_grpc
from gridcomm._wire import WIRE
from tests.support.calls import (
    OK,
    SERVICE,
    UNDECODABLE,
    Outcome,
    _outcome_of,
    assert_serving,
    call_unary,
    client_flow,
    coordinator,
)
from tests.support.procs import wait_for

MODES = ("client", "off")
#: Bound on any single wait in these tests (a hang fails the test instead of stalling it).
WAIT_S = 20.0
#: Unary calls of an old coordinator that the forwarding server passes through.
UNARY = ("Join", "Set", "Get", "Barrier", "Heartbeat", "ReportFailure", "Leave", "Status")


# ------------------------------------------------------------------------------------ helpers


_GRPC_BEFORE_1_84 = tuple(int(p) for p in grpc.__version__.split(".")[:2]) < (1, 84)


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
    session.send(*(op(100 + r, join=pb.JoinRequest(wire=WIRE, job_id=server.job_id, rank=r, world_size=world,
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
        # The flow travelled as the mode says: each client's own stream, which its watcher's
        # heartbeats share (one connection per rank), or its own unary channel beside the
        # watcher's (two). Counted before the Status call below, whose own connection can still
        # be open on the server's side for a moment after the call (seen once in about 50 runs
        # of make test: one connection more in mode "off").
        want = world if mode == "client" else 2 * world
        wait_for(lambda: server_connections(server.port) == want, f"{want} connections", timeout_s=5.0)
        assert pending_barrier(server.port, "loop") is None
        on_threads(lambda c: c.leave(), ranks)
    assert server.wait_all_left(5.0)
    assert not server.state.failed


def per_call(via: str, timeout_s: float) -> dict[str, float]:
    """A get's or barrier's keyword arguments: its own timeout (``via`` "call"), or none, so that
    it takes the client's (``via`` "client")."""
    return {"timeout_s": timeout_s} if via == "call" else {}


def error_outcomes(mode: str, factory: Callable[..., gridcomm.Coordinator], via: str = "call") -> dict[str, Any]:
    """Every failure a client can see, in one mode; each on a coordinator of its own. ``via``:
    whether get and barrier are given their timeout per call, or take the client's."""
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
@pytest.mark.parametrize("mode", MODES)
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
def test_every_client_has_a_stream_and_a_connection_of_its_own(coordinator_factory):
    """A rank stands for a pod: the clients of one process share nothing, and a client's calls
    (a barrier of its own after the others left) still travel on its own stream. (The last
    client to close closes its connection: see the next test.)"""
    world = 6
    server = coordinator_factory(world)
    with clients(server.port, world, "client") as made:
        on_threads(lambda c: c.join(), made)
        on_threads(lambda c: c.barrier("together", timeout_s=10.0), made)
        made[0].set("k", b"v")
        assert on_threads(lambda c: c.get("k", timeout_s=5.0), made) == [b"v"] * world
        assert server_connections(server.port) == world
        streams = {id(c._session) for c in made}
        assert len(streams) == world and None not in {c._session for c in made}
        for c in made[:-1]:
            c.leave()
        made[-1].barrier("last", timeout_s=0.2, participants=[world - 1])
        made[-1].leave()
    assert server.wait_all_left(5.0)


def test_the_shared_process_stream_is_refused_with_a_clear_error():
    with pytest.raises(gridcomm.ConfigError, match="process was removed"):
        gridcomm.CoordinatorClient("127.0.0.1", 1, 0, 1, session="process")


@pytest.mark.timeout(30)
# The stream's tasks once kept the call (and its connection) alive until a GC pass (found here, fixed).
@pytest.mark.parametrize("mode", MODES)
def test_the_last_client_to_close_closes_the_connection(coordinator_factory, mode):
    server = coordinator_factory(4)
    # Why without the cyclic collector: closing must not depend on when it happens to run.
    gc.disable()
    try:
        with clients(server.port, 4, mode) as ranks:
            on_threads(lambda c: c.join(), ranks)
            # Mode "off": the unary channel and the watcher's; "client": the one both share. (The
            # watcher dials from the background loop as join returns: waited for, not assumed.)
            want = 4 if mode == "client" else 8
            wait_for(lambda: server_connections(server.port) == want, f"{want} connections", timeout_s=5.0)
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
    with clients(server.port, 2, "client", token="the-token") as ranks, \
            clients(server.port, 2, "client", ranks=[0], token="not-the-token") as (stranger,):
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
            ("join", pb.JoinRequest(wire=WIRE, job_id=job, rank=0, world_size=4, incarnation=1, wait_s=0.1)),
            ("join", pb.JoinRequest(wire=WIRE, job_id=job, rank=3, world_size=3, incarnation=1, wait_s=0.1)),
            ("join", pb.JoinRequest(wire=WIRE, job_id="another-job", rank=0, world_size=3, incarnation=1, wait_s=0.1)),
            ("join", pb.JoinRequest(wire=WIRE, job_id=job, rank=2, world_size=3, incarnation=callers[2].incarnation,
                                    wait_s=0.1)),
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
    """The bound counts each rank's operations on the stream (a relay's stream carries many
    ranks): one rank past it is refused, another rank on the same stream is still served."""
    bound = 1024  # _ServerSession's bound for a small world: max(1024, 2 * world_size + 64)
    extra = 16
    with coordinator(2) as (server, channel), raw_session(channel) as session:
        callers = join_on_stream(session, server, 2)
        ids = list(range(1, bound + extra + 1))
        for start in range(0, len(ids), 260):
            session.send(*(op(i, get=pb.GetRequest(caller=callers[0], key=f"never-{i}", wait_s=2.0))
                           for i in ids[start:start + 260]))
        refused = session.wait(ids[bound:], timeout_s=5.0)
        for result in refused.values():
            code, details, _ = as_outcome(result)
            assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and f"{bound} operations" in details, result
        # While rank 0 fills it, rank 1 is served on the same stream, and another stream too.
        session.send(op(3001, set=pb.SetRequest(caller=callers[1], key="k", value=b"v")),
                     op(3002, get=pb.GetRequest(caller=callers[1], key="k", wait_s=1.0)))
        assert session.wait([3001, 3002])[3002].get.value == b"v"
        with raw_session(channel) as other:
            other.send(op(1, get=pb.GetRequest(caller=callers[1], key="k", wait_s=1.0)))
            assert other.wait([1])[1].get.value == b"v"
        assert_serving(channel, what="with a full Session stream")
        timed_out = session.wait(ids[:bound], timeout_s=15.0)
        assert {as_outcome(r)[0] for r in timed_out.values()} == {grpc.StatusCode.DEADLINE_EXCEEDED}
        assert len(session.results) == len(ids) + 4  # + the joins and rank 1's two; each answered once
        # The waits ended, so the stream takes rank 0's operations again.
        session.send(op(5000, get=pb.GetRequest(caller=callers[0], key="k", wait_s=1.0)))
        assert session.wait([5000])[5000].get.value == b"v"
        assert not server.state.failed


@pytest.mark.timeout(30)
@pytest.mark.parametrize("metadata, words", [((), "token is missing"),
                                             ((("authorization", "Bearer wrong"),), "token is wrong")])
def test_session_without_the_token_is_unauthenticated(metadata, words):
    with coordinator(2, token="the-token") as (server, channel), raw_session(channel, metadata) as session:
        session.send(op(1, join=pb.JoinRequest(wire=WIRE, job_id=server.job_id, rank=0, world_size=2, incarnation=1,
                                               wait_s=0.1)))
        error = session.wait_end()
        assert error is not None and error.code() is grpc.StatusCode.UNAUTHENTICATED, error
        assert words in error.details()
        assert session.results == [] and 0 not in server.state.members
    with coordinator(2, token="the-token") as (server, channel), \
            raw_session(channel, (("authorization", "Bearer the-token"),)) as session:
        assert len(join_on_stream(session, server, 2)) == 2


# ------------------------------------------------------------------------------------ 4. fallback


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
@pytest.mark.parametrize("via", ["call", "client"])  # given their timeout per call, or taking the client's
def test_a_stream_cut_mid_wait_is_repeated_as_a_unary_call(coordinator_factory, mode, via):
    with proxied_pair(coordinator_factory, mode) as (server, proxy, near, far), ThreadPoolExecutor(1) as pool:
        # near's stream carried its join and carries its heartbeats (mode "off": its unary channel
        # and its watcher's, dialled as join returns).
        dialled = 1 if mode == "client" else 2
        wait_for(lambda: proxy.accepted == dialled, f"{dialled} connections of rank 0")
        near.timeout_s = 15.0
        waiting = pool.submit(outcome, lambda: near.barrier("x", **per_call(via, 15.0)))
        wait_for(lambda: arrived(server.port, "x") == [0], "rank 0 waiting at barrier 'x'")
        proxy.cut()
        # near dials again (its repeated call, or the unary channel's retry) and is still waiting.
        wait_for(lambda: proxy.accepted >= dialled + 1, "rank 0 dialled again")
        assert not waiting.done()
        far.barrier("x", timeout_s=5.0)
        assert waiting.result(timeout=10.0) == ("no error", None, None, "")
        # Counted once: the next instance needs both ranks again and completes.
        assert pending_barrier(server.port, "x") is None
        on_threads(lambda c: c.barrier("x", timeout_s=5.0), [near, far])
        assert near._barrier_seq["x"] == far._barrier_seq["x"] == 2 and pending_barrier(server.port, "x") is None
        assert not server.state.failed


@pytest.mark.timeout(60)
def test_a_cut_stream_reports_only_the_operations_still_awaited(coordinator_factory, caplog):
    """An attempt whose caller gave up (a long poll's slice that timed out) is still in flight on
    the stream, but nobody repeats it: the warning counts only what is repeated."""
    from gridcomm._client import session as _session
    from gridcomm._runtime.channel import make_aio_channel

    server = coordinator_factory(2)
    proxy = TcpProxy(server.port)
    target = f"127.0.0.1:{proxy.port}"
    try:
        with clients(server.port, 2, "client") as (near, far), ThreadPoolExecutor(1) as pool:
            on_threads(lambda c: c.join(), [near, far])
            channels: list[grpc.aio.Channel] = []

            def channel() -> grpc.aio.Channel:
                channels.append(make_aio_channel(target, None))
                return channels[-1]

            stream = _session.Session(target, near._metadata, channel)
            abandoned = pb.BarrierRequest(caller=near.caller, name="given-up", seq=1, wait_s=20.0)
            with pytest.raises(_session.OpError) as timed_out:
                stream.call("barrier", abandoned, 0.5)
            assert timed_out.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            awaited = pool.submit(lambda: stream.call(
                "barrier", pb.BarrierRequest(caller=near.caller, name="awaited", seq=1, wait_s=20.0), 20.0))
            wait_for(lambda: arrived(server.port, "awaited") == [0], "rank 0 waiting at barrier 'awaited'")
            with caplog.at_level("WARNING", logger="gridcomm._client.session"):
                proxy.cut()
                with pytest.raises(_session.StreamBroken):
                    awaited.result(timeout=15.0)
                # The line is written on the loop before the caller is woken; waited for all the
                # same, so that a line written late fails as a missing line, not as a race.
                wait_for(lambda: any("Session stream" in r.getMessage() for r in caplog.records),
                         "the broken stream's warning", timeout_s=10.0)
            said = [r.getMessage() for r in caplog.records if "Session stream" in r.getMessage()]
            assert len(said) == 1 and "with 1 operation(s) still awaited" in said[0], said

            async def close() -> None:
                await stream.close()
                for ch in channels:
                    await ch.close()

            asyncio.run_coroutine_threadsafe(close(), stream._loop).result(timeout=10.0)
    finally:
        proxy.close()


@pytest.mark.timeout(60)
# The unary repeat once got the whole slice again (found here, fixed).
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("via", ["call", "client"])  # given their timeout per call, or taking the client's
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
    monkeypatch.setattr(gridcomm._client.client, "PROGRESS_INTERVAL_S", slice_s)
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


# ------------------------------------------------------------------------------------ 6. identity and close


@pytest.mark.timeout(60)
@pytest.mark.parametrize("via", ["call", "client"])
def test_a_changed_generation_is_what_every_path_sends(coordinator_factory, via):
    """A client whose generation changed (a rejoin it missed, here set by hand) sends the new
    one on every path, so the coordinator refuses it by its generation either way."""
    server = coordinator_factory(2)
    with clients(server.port, 2, "client", timeout_s=2.0) as made:
        on_threads(lambda c: c.join(), made)
        made[1].generation += 1
        for call in (lambda: made[1].barrier("b", **per_call(via, 2.0)), lambda: made[1].get("k", **per_call(via, 2.0))):
            found = outcome(call)
            assert found[0] != "no error" and "generation" in found[3], found
        assert made[1].caller.generation == made[1].generation


@pytest.mark.timeout(60)
def test_closing_the_clients_ends_a_waiting_operation_at_once(coordinator_factory):
    """A barrier that another thread's close() interrupts ends with CommAborted at once, not at
    its 30 s deadline (the stream is gone; the unary repeat is refused by the closed client)."""
    server = coordinator_factory(3)
    extra = client(server.port, 2, 3, "off")
    try:
        with clients(server.port, 3, "client", ranks=[0, 1]) as made:
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
