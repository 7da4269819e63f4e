"""The coordinator: a ``grpc.aio`` server on a thread of its own.

One event loop serves every rank; a waiting rank costs a future, never a thread. The decisions
live in :mod:`gridcomm._rendezvous`; this module only waits, wakes and translates to gRPC.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import hmac
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2

from gridcomm import _config, _metrics
from gridcomm._errors import ConfigError, CoordinatorUnavailable
from gridcomm._eventloop import drop_late_grpc_events
from gridcomm._guard import MAX_METADATA_BYTES, BoundedHealth, GuardedServer, health_server_options
from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._proto import coordinator_pb2_grpc as pb_grpc
from gridcomm._rendezvous import JobState, Limits, Member, MemberState, StateError, quote

log = logging.getLogger(__name__)

SERVICE_NAME = "gridcomm.v1.Coordinator"
MISSING_KEY = "gridcomm-missing-ranks"
FAILED_KEY = "gridcomm-failed-rank"
#: What a coordinator tells a Session stream it accepts, in the initial metadata.
SESSION_FEATURES_KEY = "gridcomm-session-features"
SESSION_FEATURES = "group"
#: Margin kept between the server's answer and the caller's gRPC deadline, so a timed-out wait
#: reaches the caller as our structured answer rather than as the transport's DEADLINE_EXCEEDED.
_ANSWER_MARGIN_S = 0.25
#: Host-backend messages, and a key's value larger than this, travel in pieces of this size.
CHUNK_BYTES = 1024 * 1024
#: Largest request message the coordinator reads: a chunk plus framing. Why not more: health
#: requests need no token and are read whole, so this bounds what each of them can make it hold.
MAX_REQUEST_BYTES = CHUNK_BYTES + 64 * 1024
#: Largest message sent (the coordinator's answers; a Session reply batches several).
MAX_MESSAGE_BYTES = 80 * 1024 * 1024
#: Longest status message sent (characters); see _details.
MAX_DETAILS = 400
#: Concurrent calls one connection may have open. A rank needs a few (its Session stream, a
#: long poll, a transfer); ranks sharing a process carry their calls on one Session stream.
MAX_STREAMS_PER_CONNECTION = 256

_T = TypeVar("_T")


def max_connections(world_size: int) -> int:
    """Connections the coordinator accepts at once: a few per rank (its calls, its watcher, a
    probe) and room for operators' tools; past it new connections are closed at once."""
    return 4 * world_size + 1024


def server_options(world_size: int) -> list[tuple[str, Any]]:
    """gRPC server options, set explicitly: a long-poll server CANCELs calls past ~1,000 parked
    waiters with the defaults, a second server on the same port must fail, not share it, and
    what a caller without the token can make the server hold is bounded."""
    return [
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.server.max_pending_requests", 1 << 20),
        ("grpc.server.max_pending_requests_hard_limit", 1 << 20),
        ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
        ("grpc.max_metadata_size", MAX_METADATA_BYTES),
        ("grpc.absolute_max_metadata_size", MAX_METADATA_BYTES),
        ("grpc.max_allowed_incoming_connections", max_connections(world_size)),
        # A connection that has not finished its HTTP/2 (or TLS) handshake is closed after 10 s,
        # and one with no call open for 5 minutes is asked to go (a client reconnects on its next call).
        ("grpc.server_handshake_timeout_ms", 10_000),
        ("grpc.max_connection_idle_ms", 300_000),
        # Why no BDP probing, and a fixed 1 MiB window per stream (one chunk in flight): BDP
        # probing widens every stream's flow-control window, which is what a call refused before
        # its body was read can still make the server buffer (12 unauthenticated 79 MiB Sets:
        # +24-35 MB with it on 2 cores, +103 MB on 16; +1-5 MB without).
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.lookahead_bytes", CHUNK_BYTES),
        # Why generous: liveness comes from heartbeats and connection loss, not keepalive; an
        # overloaded peer (thousands of ranks on few cores) must not be cut off for a slow ping ack.
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 1_000),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.http2.max_pings_without_data", 0),
    ]


class _Undecodable:
    """Stands for a request body that is not a valid message of its type."""


_UNDECODABLE = _Undecodable()


def _parser(message_type: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return message_type.FromString(data)
        except Exception:  # noqa: BLE001 - DecodeError and friends: answered INVALID_ARGUMENT
            return _UNDECODABLE

    return parse


def _reading_after_auth(servicer: _Servicer, name: str, method: Callable[..., Any], client_streaming: bool,
                        server_streaming: bool) -> Callable[..., Any]:
    """Wraps one RPC so that the token is checked on the call's headers, before any request
    message is read. Why: gRPC reads and parses a unary request whole before its handler runs,
    so without a token 12 concurrent 79 MiB Sets took a coordinator to +2.3 GB before each was
    refused. Every method is registered with a streaming request (the same bytes on the wire as
    a unary call), so a refused caller's body stays in the transport's flow-control window."""

    if client_streaming:
        if server_streaming:
            async def stream_stream(request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
                await servicer._admit(context, name)
                await method(request_iterator, context)
            return stream_stream

        async def stream_unary(request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
            await servicer._admit(context, name)
            return await method(request_iterator, context)
        return stream_unary

    if server_streaming:
        async def unary_stream(request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
            request = await servicer._admit_and_read(context, name)
            async for reply in method(request, context):
                yield reply
        return unary_stream

    async def unary_unary(request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        return await method(await servicer._admit_and_read(context, name), context)
    return unary_unary


def _register(servicer: _Servicer, server: grpc.aio.Server) -> None:
    """Registers the Coordinator service like the generated helper, but (1) every method takes a
    streaming request and checks the token before reading it (see _reading_after_auth), and (2)
    the deserializers turn an undecodable body into a sentinel the handlers refuse with
    INVALID_ARGUMENT (gRPC's own answer would be UNKNOWN)."""
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["Coordinator"].methods:
        request_type = getattr(pb, method.input_type.name)
        response_type = getattr(pb, method.output_type.name)
        make = grpc.stream_stream_rpc_method_handler if method.server_streaming else grpc.stream_unary_rpc_method_handler
        handle = _reading_after_auth(servicer, method.name, getattr(servicer, method.name), method.client_streaming,
                                     method.server_streaming)
        handlers[method.name] = make(handle, request_deserializer=_parser(request_type),
                                     response_serializer=response_type.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


def _status_code(name: str) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, name)


def _ranks_text(ranks: Iterable[int], limit: int = 2048) -> str:
    text = ",".join(str(r) for r in ranks)
    return text[:limit]


def _bounded(ranks: list[int], shown: int = 16) -> str:
    if len(ranks) <= shown:
        return str(ranks)
    return f"{ranks[:shown]}... ({len(ranks)} in all)"


class _Abort(Exception):
    """Raised inside a handler to answer with a status (and trailing metadata)."""

    def __init__(self, code: grpc.StatusCode, message: str, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.metadata = metadata


def _details(message: str) -> str:
    """Status details short enough that, percent-encoded (up to 9 bytes a character), they stay
    well inside gRPC's 8 KiB metadata budget beside our trailers."""
    return message if len(message) <= MAX_DETAILS else message[: MAX_DETAILS - 15] + "... (truncated)"


def _status_of(name: str, exc: Exception) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """The status a refused or failed operation answers with: code, details, trailing metadata."""
    if isinstance(exc, _Abort):
        return exc.code, _details(exc.message), exc.metadata
    if isinstance(exc, StateError):
        metadata = ((FAILED_KEY, str(exc.failed_rank)),) if exc.failed_rank is not None else ()
        return _status_code(exc.code), _details(exc.message), metadata
    log.exception("coordinator: %s failed on an unexpected error", name, exc_info=exc)
    return grpc.StatusCode.INTERNAL, _details(f"{name} failed inside the coordinator: {exc!r}"), ()


async def _refuse(context: grpc.aio.ServicerContext, name: str, exc: Exception) -> None:
    """Answers a refused or failed call with a status and a readable message; always raises."""
    if isinstance(exc, grpc.aio.AbortError):
        raise exc
    code, details, metadata = _status_of(name, exc)
    await context.abort(code, details, trailing_metadata=metadata)


def _handler(method: Callable[..., Awaitable[_T]]) -> Callable[..., Awaitable[_T]]:
    """Wraps a servicer method: maps refusals to statuses, never lets an exception escape to
    crash or confuse the server (the token was checked before the request was read)."""

    name = method.__name__

    async def wrapped(self: _Servicer, request: Any, context: grpc.aio.ServicerContext) -> _T:
        try:
            if request is _UNDECODABLE:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                             f"the {name} request body is not a valid gridcomm.v1 message of its type.")
            return await method(self, request, context)
        except Exception as exc:  # noqa: BLE001 - the coordinator must survive any request
            await _refuse(context, name, exc)
        raise AssertionError("unreachable")  # _refuse always raises

    wrapped.__name__ = name
    wrapped.__doc__ = method.__doc__
    wrapped.__wrapped__ = method  # type: ignore[attr-defined]  # what a Session operation runs
    return wrapped


class _RefusalLog:
    """Logs refused calls at a bounded rate: the first of each interval as it comes, the rest as
    one count when the interval ends. Why: one client without the token made ~3,000 log lines a
    second, a disk and a log pipeline an unauthenticated caller could fill."""

    INTERVAL_S = 10.0

    def __init__(self) -> None:
        self._until = 0.0
        self._count = 0
        self._peers: set[str] = set()
        #: Refused calls since start (what an operator's metrics would read).
        self.total = 0

    def note(self, method: str, peer: str, how: str) -> None:
        self.total += 1
        now = time.monotonic()
        if now >= self._until:
            self._flush()
            self._until = now + self.INTERVAL_S
            log.warning("coordinator: refused %s from %s: %s token (further refusals in the next %g s are counted, "
                        "not logged one by one)", method, peer, how, self.INTERVAL_S)
            try:
                asyncio.get_running_loop().call_later(self.INTERVAL_S, self._flush)
            except RuntimeError:
                pass  # no loop (a unit test): the next refusal flushes
            return
        self._count += 1
        if len(self._peers) < 8:
            self._peers.add(peer)

    def _flush(self) -> None:
        if self._count:
            log.warning("coordinator: refused %d more calls without a valid token in the last %g s (from %s%s)",
                        self._count, self.INTERVAL_S, ", ".join(sorted(self._peers)),
                        ", ..." if len(self._peers) >= 8 else "")
        self._count = 0
        self._peers = set()


@dataclasses.dataclass
class _Parked:
    """An operation that has to wait: for what (key, done), and how it is answered."""

    #: The ranks waiting (one, or a Session group's members).
    members: Sequence[Member]
    key: tuple[Any, ...]
    done: Callable[[], bool]
    what: str
    response: Callable[[], Any]
    timed_out: Callable[[], Exception]


class _Servicer(pb_grpc.CoordinatorServicer):
    def __init__(self, owner: Coordinator) -> None:
        self._owner = owner
        self._state = owner.state
        self._loop = asyncio.get_running_loop()
        self._waiters: dict[tuple[Any, ...], list[asyncio.Future[None]]] = {}
        self._token = owner._token.encode() if owner._token is not None else None
        self._refusals = _RefusalLog()
        #: Session operations that came as members of a group (SessionOp.also), since start.
        self.grouped = 0

    # ------------------------------------------------------------------ plumbing
    def _now(self) -> float:
        return time.monotonic()

    def _authenticate(self, context: grpc.aio.ServicerContext, method: str) -> None:
        if self._token is None:
            return
        supplied = b""
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                supplied = value.encode() if isinstance(value, str) else bytes(value)
                break
        expected = b"Bearer " + self._token
        if not hmac.compare_digest(supplied, expected):
            self._refusals.note(method, context.peer(), "missing" if not supplied else "wrong")
            raise _Abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"{method} refused: the {'token is missing' if not supplied else 'token is wrong'}; "
                "set the same GRIDCOMM_TOKEN (or GRIDCOMM_TOKEN_FILE) on every rank and the coordinator.",
            )

    async def _admit(self, context: grpc.aio.ServicerContext, name: str) -> None:
        """Checks the call's token on its headers; a refused call is answered (and this raises)."""
        self._owner.metrics.watch_call(context, name)  # metrics hook (issue 18): counted when the call ends
        try:
            self._authenticate(context, name)
        except Exception as exc:  # noqa: BLE001 - refused with a status, never a crash
            await _refuse(context, name, exc)

    async def _admit_and_read(self, context: grpc.aio.ServicerContext, name: str) -> Any:
        """The token check, then the call's one request message."""
        await self._admit(context, name)
        request = await context.read()
        if request is grpc.aio.EOF:
            await _refuse(context, name, _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"the {name} call carried no request."))
        return request

    def _wake(self, key: tuple[Any, ...]) -> None:
        for fut in self._waiters.pop(key, ()):
            if not fut.done():
                fut.set_result(None)

    def wake_all(self) -> None:
        """Every waiter re-checks its condition (after a failure, abort or stop)."""
        waiters, self._waiters = self._waiters, {}
        for futs in waiters.values():
            for fut in futs:
                if not fut.done():
                    fut.set_result(None)

    def _budget(self, wait_s: float, remaining_call: float | None) -> float:
        """How long a wait may last: what the caller asked, bounded."""
        # Why: wait_s comes off the wire; NaN, negative or absurd values must not hang or crash.
        budget = wait_s if wait_s == wait_s and wait_s > 0 else 0.0
        budget = min(budget, self._owner.max_wait_s)
        if remaining_call is not None:
            budget = min(budget, remaining_call - _ANSWER_MARGIN_S)
        return max(0.0, budget)

    def _check_waiting(self, what: str, fail_fast: bool = True) -> None:
        """Raises what ends a wait that is not done: a failed job (when ``fail_fast``) or a
        coordinator that is shutting down."""
        if fail_fast:
            self._state.check_not_failed(what)
        if self._owner._closing:
            raise _Abort(grpc.StatusCode.UNAVAILABLE, f"{what}: the coordinator is shutting down.")

    async def _finish(self, parked: _Parked, wait_s: float, context: Any) -> Any:
        """Waits (bounded) for a parked operation and answers it as its RPC does."""
        (member,) = parked.members
        member.active_calls += 1
        try:
            ok = await self._wait(parked.key, parked.done, wait_s, context, parked.what)
        finally:
            member.active_calls -= 1
            member.last_seen = self._now()
        if not ok:
            raise parked.timed_out()
        return parked.response()

    async def _wait(
        self,
        key: tuple[Any, ...],
        done: Callable[[], bool],
        wait_s: float,
        context: grpc.aio.ServicerContext,
        what: str,
        *,
        fail_fast: bool = True,
    ) -> bool:
        """Waits until ``done()``, a failure (raised when ``fail_fast``), or the bounded wait
        ends; returns ``done()``."""
        deadline = self._loop.time() + self._budget(wait_s, context.time_remaining())
        while True:
            # Why done() first: what already completed (a message delivered, a barrier passed)
            # is still handed out after a failure; only waiting is refused.
            if done():
                return True
            self._check_waiting(what, fail_fast)
            remaining = deadline - self._loop.time()
            if remaining <= 0:
                return False
            fut: asyncio.Future[None] = self._loop.create_future()
            futs = self._waiters.setdefault(key, [])
            futs.append(fut)
            timer = self._loop.call_later(remaining, _settle, fut)
            try:
                await fut
            finally:
                timer.cancel()
                if self._waiters.get(key) is futs:
                    # Why: a wake pops the whole list; a list still here means this wait timed
                    # out or was cancelled, so drop the future and keep abandoned waits (a Get
                    # for a key that never comes) from piling up.
                    try:
                        futs.remove(fut)
                    except ValueError:
                        pass
                    if not futs:
                        del self._waiters[key]

    def _caller(self, caller: pb.Caller, what: str, now: float | None = None) -> Any:
        state = self._state
        member = state.check_caller(caller.job_id, caller.rank, caller.incarnation, caller.generation, what)
        member.last_seen = self._now() if now is None else now
        return member

    def _on_failure(self) -> None:
        self._owner.metrics.rank_failed()  # metrics hook (issue 18): one call per new failure
        self._owner._set_serving(False)
        self.wake_all()
        self._note_departures()

    def _note_departures(self) -> None:
        """Lets a stop() that waits for every rank to leave (or fail) go on."""
        if self._state.all_left():
            self._owner._all_left.set()

    # ------------------------------------------------------------------ RPCs
    @_handler
    async def Join(self, request: pb.JoinRequest, context: grpc.aio.ServicerContext) -> pb.JoinResponse:
        state = self._state
        now = self._now()
        was_failed = state.failed
        self._owner.metrics.ops["join"] += 1  # metrics hook (issue 18)
        try:
            completed = state.join(
                request.job_id, request.rank, request.world_size, request.incarnation, request.hostname, now
            )
        except StateError as exc:
            # Hook (issue 18): kept for status and the waiting ranks' messages, and logged.
            self._owner.metrics.join_refused(request.rank, request.hostname, exc.code, exc.message)
            if state.failed and not was_failed:
                # Why: the join marked a rank failed (a restarted process): tell everyone now.
                log.error("coordinator: %s", state.failures[0].reason)
                self._on_failure()
            raise
        member = state.members[request.rank]
        if completed:
            log.info("coordinator: all %d ranks joined; generation %d", state.world_size, state.generation)
            self._wake(("join",))
        member.active_calls += 1
        try:
            ok = await self._wait(("join",), lambda: state.complete, request.wait_s, context, f"join of rank {request.rank}")
        finally:
            member.active_calls -= 1
            member.last_seen = self._now()
        if state.members.get(request.rank) is not member:
            raise _Abort(grpc.StatusCode.ABORTED, f"rank {request.rank} was replaced by a newer process while joining.")
        if not ok:
            missing = state.missing_join()
            raise _Abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"{len(missing)} of {state.world_size} ranks have not joined: {_bounded(missing)}"
                + self._owner.metrics.refusal_note(missing),  # hook (issue 18): a missing rank that was refused
                ((MISSING_KEY, _ranks_text(missing)),),
            )
        return pb.JoinResponse(
            generation=state.generation,
            world_size=state.world_size,
            # Members are not sent: O(world size) per join is O(world size^2) per rendezvous;
            # Status lists them for who needs them.
            heartbeat_timeout_s=self._owner.heartbeat_timeout_s,
        )

    @_handler
    async def Set(self, request: pb.SetRequest, context: grpc.aio.ServicerContext) -> pb.SetResponse:
        member = self._caller(request.caller, "set")
        self._owner.metrics.ops["set"] += 1  # metrics hook (issue 18)
        state = self._state
        state.check_not_failed("set")
        if request.total_bytes:
            if not state.set_piece(member.rank, request.key, request.offset, request.total_bytes, request.value):
                return pb.SetResponse()
        else:
            state.set(request.key, request.value)
        self._wake(("kv", request.key))
        return pb.SetResponse()

    def _admit_get(self, request: pb.GetRequest, caller: pb.Caller, shared: tuple[Any, ...] | None = None) -> Member:
        """A get's checks of one caller (each member of a Session group passes its own;
        ``shared``: what _shared_fields read once for the group)."""
        return self._caller(caller, "get", None if shared is None else shared[0])  # type: ignore[no-any-return]

    def _begin_get(self, request: pb.GetRequest, members: Sequence[Member]) -> pb.GetResponse | _Parked:
        """The value, or what to wait for; ``members`` (the caller, or a Session group) were admitted."""
        state = self._state
        self._owner.metrics.ops["get"] += len(members)  # metrics hook (issue 18)
        key = request.key
        value = state.get(key)  # validates the key
        if value is not None:
            return self._value_response(key, value, request)
        if request.offset:
            raise _Abort(grpc.StatusCode.ABORTED, f"key {quote(key)} is no longer set; read it again from offset 0.")
        return _Parked(
            members, ("kv", key), lambda: key in state.kv, f"get of {quote(key)}",
            lambda: self._value_response(key, state.kv[key], request),
            lambda: _Abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"key {quote(key)} was not set within {request.wait_s:.1f} s"),
        )

    def _value_response(self, key: str, value: bytes, request: pb.GetRequest) -> pb.GetResponse:
        """A value, or its piece from request.offset when it is larger than one message."""
        offset = request.offset
        if not offset and len(value) <= CHUNK_BYTES:
            return pb.GetResponse(value=value)
        version = self._state.version(key)
        if offset:
            if request.version != version:
                raise _Abort(grpc.StatusCode.ABORTED,
                             f"key {quote(key)} was set again while it was read in pieces; read it again from offset 0.")
            if offset >= len(value):
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                             f"offset {offset} is past the end of key {quote(key)} ({len(value)} bytes).")
        return pb.GetResponse(value=value[offset : offset + CHUNK_BYTES], total_bytes=len(value), version=version)

    @_handler
    async def Get(self, request: pb.GetRequest, context: grpc.aio.ServicerContext) -> pb.GetResponse:
        begun = self._begin_get(request, (self._admit_get(request, request.caller),))
        if isinstance(begun, _Parked):
            return await self._finish(begun, request.wait_s, context)  # type: ignore[no-any-return]
        return begun

    def _shared_fields(self, request: Any) -> tuple[Any, ...]:
        """What every member of a Session group of gets or barriers shares, read once for the
        group: the time, and a barrier's name, seq and participants. Why: each read of a
        protobuf field makes a new Python object, and this ran once per rank per barrier."""
        now = self._now()
        if type(request) is pb.BarrierRequest:
            return now, request.name, request.seq, request.participants
        return (now,)

    def _admit_barrier(self, request: pb.BarrierRequest, caller: pb.Caller,
                       shared: tuple[Any, ...] | None = None) -> Member:
        """One caller's checks and arrival (each member of a Session group passes its own;
        ``shared``: what _shared_fields read once for the group)."""
        if shared is None:
            shared = self._shared_fields(request)
        now, name, seq, participants = shared
        state = self._state
        member = self._caller(caller, "barrier", now)
        barrier = state.barriers.get(name)
        # Why the guards: this runs once per rank per barrier, and a name already in use passed
        # the name check when its barrier opened.
        if barrier is None:
            state.check_barrier_name(name)
        if state._failed:  # the failed property, without its frame
            state.check_not_failed(f"barrier {quote(name)}")
        before = barrier.completed if barrier is not None else 0
        completed = state.arrive(name, member.rank, seq, now, participants)
        if completed > before:
            for done_seq in range(before + 1, completed + 1):
                self._wake(("barrier", name, done_seq))
            done = state.barriers[name]
            # metrics hook (issue 18): once per completed instance, never per arrival
            self._owner.metrics.barrier_completed(done.last_wait_s, completed - before, len(done.members))
        return member  # type: ignore[no-any-return]

    def _begin_barrier(self, request: pb.BarrierRequest, members: Sequence[Member]) -> pb.BarrierResponse | _Parked:
        """Done, or what to wait for; ``members`` (the caller, or a Session group) arrived already."""
        state = self._state
        name, seq = request.name, request.seq
        # Why there is a barrier: an admitted arrival opened it.
        completed = state.barriers[name].completed
        if completed >= seq:
            return pb.BarrierResponse(seq=seq)
        blocker = state.barrier_blocker(name, seq)
        if blocker is not None:
            raise _Abort(
                grpc.StatusCode.ABORTED,
                f"barrier {quote(name)} #{seq} cannot complete: rank {blocker.rank} left the job before arriving",
                ((FAILED_KEY, str(blocker.rank)),),
            )
        barrier = state.barriers[name]

        def timed_out() -> _Abort:
            missing = state.barrier_missing(name, seq)
            return _Abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"barrier {quote(name)} #{seq}: {len(missing)} of {state.world_size} ranks have not arrived: "
                f"{_bounded(missing)}",
                ((MISSING_KEY, _ranks_text(missing)),),
            )

        return _Parked(members, ("barrier", name, seq), lambda: barrier.completed >= seq, f"barrier {quote(name)}",
                       lambda: pb.BarrierResponse(seq=seq), timed_out)

    @_handler
    async def Barrier(self, request: pb.BarrierRequest, context: grpc.aio.ServicerContext) -> pb.BarrierResponse:
        begun = self._begin_barrier(request, (self._admit_barrier(request, request.caller),))
        if isinstance(begun, _Parked):
            return await self._finish(begun, request.wait_s, context)  # type: ignore[no-any-return]
        return begun

    @_handler
    async def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext) -> pb.HeartbeatResponse:
        """Long-poll: answered after wait_s or as soon as any rank fails, with every failure."""
        state = self._state
        member = self._caller(request.caller, "heartbeat")
        state.heartbeat(member.rank, self._now())
        beat = member.last_heartbeat
        try:
            await self._wait(("failure",), lambda: state.failed, min(request.wait_s, self._owner.heartbeat_timeout_s),
                             context, "heartbeat", fail_fast=False)
        except asyncio.CancelledError:
            # Why: the call ended without an answer: the caller's process died or its network
            # went away (or it merely re-dials). Give it a moment to heartbeat again, then fail it.
            self._loop.call_later(self._owner.connection_grace_s, self._check_lost, member, beat)
            raise
        return pb.HeartbeatResponse(failures=[_failure_pb(f) for f in state.failures])

    def _check_lost(self, member: Member, beat: float | None) -> None:
        if member.state is MemberState.JOINED and member.last_heartbeat == beat \
                and self._state.members.get(member.rank) is member:
            self._fail(member.rank, f"rank {member.rank} on {member.hostname or '?'} lost its connection to the "
                       "coordinator without leaving (process killed, crashed, or network cut)")

    def _fail(self, rank: int, reason: str) -> None:
        failure = self._state.fail(rank, reason, -1, self._now())
        if failure is not None:
            log.error("coordinator: %s", reason)
            self._on_failure()

    async def watch_liveness(self) -> None:
        """Marks failed every heartbeating rank silent for longer than the heartbeat timeout."""
        timeout = self._owner.heartbeat_timeout_s
        period = max(0.05, min(1.0, timeout / 4))
        while not self._owner._closing:
            await asyncio.sleep(period)
            for rank in self._state.expired(self._now(), timeout):
                member = self._state.members[rank]
                why = ("sent no heartbeat within {t:g} s of the rendezvous (died while joining?)"
                       if member.last_heartbeat is None else
                       "sent no heartbeat for {t:g} s (hung, partitioned, or overloaded)").format(t=timeout)
                self._fail(rank, f"rank {rank} on {member.hostname or '?'} {why}")

    @_handler
    async def ReportFailure(
        self, request: pb.ReportFailureRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReportFailureResponse:
        rank = request.caller.rank
        self._caller(request.caller, "report_failure")
        failure = self._state.fail(rank, request.reason or "reported an error", rank, self._now())
        if failure is not None:
            log.error("coordinator: rank %d reported a failure: %s", rank, failure.reason)
            self._on_failure()
        return pb.ReportFailureResponse()

    @_handler
    async def Leave(self, request: pb.LeaveRequest, context: grpc.aio.ServicerContext) -> pb.LeaveResponse:
        state = self._state
        caller = request.caller
        self._owner.metrics.ops["leave"] += 1  # metrics hook (issue 18)
        member = state.members.get(caller.rank)
        if member is None or member.state is not MemberState.LEFT or member.incarnation != caller.incarnation:
            state.check_caller(caller.job_id, caller.rank, caller.incarnation, caller.generation, "leave")
        state.leave(caller.rank, self._now())
        # Why: barriers waiting on this rank can never complete; let them fail now.
        self.wake_all()
        self._note_departures()
        return pb.LeaveResponse()

    async def Put(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> pb.PutResponse:
        """Receives one message in chunks; waits (bounded) for room in the mailbox first."""
        reserved = 0
        mailbox = self._state.mailbox
        try:
            first = await context.read()
            if first is grpc.aio.EOF:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "Put carried no chunk.")
            if first is _UNDECODABLE:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "the first chunk of a Put is not a valid gridcomm.v1.Chunk.")
            self._caller(first.caller, "put")
            key, total, readers = first.key, first.total_bytes, first.readers
            mailbox.check(key, total, readers)
            ok = await self._wait(("mailbox-room",), lambda: mailbox.has_room(total), self._owner.timeout_s, context,
                                  f"put of {quote(key)}")
            if not ok:
                raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"no room for message {quote(key)} ({total} bytes): the mailbox holds {mailbox.used} of "
                             f"{mailbox.max_bytes} bytes and nobody took them.")
            mailbox.reserve(total)
            reserved = total
            parts = [first.data]
            received = len(first.data)
            # Read to the end of the stream: a surplus after the announced size is refused, not dropped.
            while received <= total:
                chunk = await context.read()
                if chunk is grpc.aio.EOF:
                    break
                if chunk is _UNDECODABLE:
                    raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"a chunk of message {quote(key)} is not a valid "
                                 "gridcomm.v1.Chunk.")
                received += len(chunk.data)
                parts.append(chunk.data)
            if received != total:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                             f"message {quote(key)} announced {total} bytes but carried {received}.")
            mailbox.publish(key, b"".join(parts), readers)
            reserved = 0
            self._wake(("mailbox", key))
            return pb.PutResponse()
        except Exception as exc:  # noqa: BLE001 - the coordinator must survive any request
            await _refuse(context, "Put", exc)
        finally:
            if reserved:
                mailbox.release(reserved)
                self._wake(("mailbox-room",))
        raise AssertionError("unreachable")

    async def Take(self, request: pb.TakeRequest, context: grpc.aio.ServicerContext) -> Any:
        """Waits for a message and streams it back in chunks."""
        mailbox = self._state.mailbox
        try:
            if request is _UNDECODABLE:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "the Take request body is not a valid gridcomm.v1.TakeRequest.")
            member = self._caller(request.caller, "take")
            key = request.key
            mailbox.check_key(key)
            member.active_calls += 1
            try:
                ok = await self._wait(("mailbox", key), lambda: key in mailbox.messages, request.wait_s, context,
                                      f"take of {quote(key)}")
            finally:
                member.active_calls -= 1
                member.last_seen = self._now()
            if not ok:
                raise _Abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                             f"message {quote(key)} did not arrive within {request.wait_s:.1f} s")
            data = mailbox.take(key)
            assert data is not None
            if key not in mailbox.messages:
                self._wake(("mailbox-room",))
        except Exception as exc:  # noqa: BLE001 - the coordinator must survive any request
            await _refuse(context, "Take", exc)
            return
        view = memoryview(data)
        if not data:
            yield pb.Chunk(total_bytes=0)
        for offset in range(0, len(data), CHUNK_BYTES):
            yield pb.Chunk(total_bytes=len(data), data=bytes(view[offset : offset + CHUNK_BYTES]))

    async def Session(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        """Batched operations on one stream; each answers as its unary RPC would (see the proto)."""
        await context.send_initial_metadata(((SESSION_FEATURES_KEY, SESSION_FEATURES),))
        await _ServerSession(self, context).serve()

    @_handler
    async def Status(self, request: pb.StatusRequest, context: grpc.aio.ServicerContext) -> pb.StatusResponse:
        state = self._state
        now = self._now()
        # Hook (issue 18): the latest refused joins ride in the trailers (no proto change).
        context.set_trailing_metadata(self._owner.metrics.refusals_trailer())
        return pb.StatusResponse(
            job_id=state.job_id,
            world_size=state.world_size,
            generation=state.generation,
            members=[_member_pb(m) for m in sorted(state.members.values(), key=lambda m: m.rank)],
            missing_ranks=state.missing_join(),
            barriers=[
                pb.BarrierStatus(name=n, seq=s, arrived_ranks=a, missing_ranks=m, waiting_s=w)
                for n, s, a, m, w in state.pending_barriers(now)
            ],
            failures=[_failure_pb(f) for f in state.failures],
            uptime_s=now - state.started_at,
            serving=self._owner.serving,
        )


class _SessionWait:
    """A parked Session operation, standing in its wait list where a unary call's future would
    (``_Servicer._wake`` calls done() and set_result()); re-checked at each wake-up, answered
    at its deadline like the unary wait."""

    __slots__ = ("_session", "_id", "_also", "_kind", "_parked", "_finished", "_timer")

    def __init__(self, session: _ServerSession, ids: Sequence[int], kind: str, parked: _Parked, wait_s: float) -> None:
        self._session = session
        self._id = ids[0]
        #: The other members of a group (their op ids), answered by the same result.
        self._also = ids[1:]
        self._kind = kind
        self._parked = parked
        self._finished = False
        self._timer: asyncio.TimerHandle | None = None
        for member in parked.members:
            member.active_calls += 1
        session._parked.add(self)
        # The unary wait's first round: a failed job or a closing coordinator answers at once.
        self.set_result(None)
        if not self._finished:
            servicer = session._servicer
            self._timer = servicer._loop.call_later(servicer._budget(wait_s, None), self._expire)

    def done(self) -> bool:
        return self._finished

    def set_result(self, _: object) -> None:
        """Woken: answer if the wait is over (done, failed, closing), else wait again."""
        if self._finished:
            return
        parked = self._parked
        servicer = self._session._servicer
        try:
            if not parked.done():
                servicer._check_waiting(parked.what)
                servicer._waiters.setdefault(parked.key, []).append(self)  # type: ignore[arg-type]
                return
        except Exception as exc:  # noqa: BLE001 - answered with the unary RPC's status
            self._end(exc)
            return
        self._end()

    def _expire(self) -> None:
        if self._finished:
            return
        self._unlist()
        self._end(None if self._parked.done() else self._parked.timed_out())

    def _unlist(self) -> None:
        waiters = self._session._servicer._waiters
        futs = waiters.get(self._parked.key)
        if futs is not None:
            try:
                futs.remove(self)  # type: ignore[arg-type]
            except ValueError:
                pass
            if not futs:
                del waiters[self._parked.key]

    def _release(self) -> None:
        self._finished = True
        if self._timer is not None:
            self._timer.cancel()
        now = self._session._servicer._now()
        for member in self._parked.members:
            member.active_calls -= 1
            member.last_seen = now
        self._session._parked.discard(self)

    def _end(self, refusal: Exception | None = None) -> None:
        """Answers the operation (and the rest of its group): its response, or ``refusal``'s status."""
        self._release()
        session = self._session
        if refusal is None:
            try:
                result = pb.SessionResult(id=self._id, also=self._also, **{self._kind: self._parked.response()})
            except Exception as exc:  # noqa: BLE001 - answered with the unary RPC's status
                refusal = exc
        if refusal is not None:
            result = session._refused(self._id, f"Session {self._kind}", refusal, self._also)
        session._answer(result)

    def drop(self) -> None:
        """The stream ended: nobody to answer."""
        if not self._finished:
            self._release()
            self._unlist()


class _OpContext:
    """What a Session operation passes where a unary handler gets its call context: no call
    deadline of its own (the operation's wait_s bounds every wait)."""

    @staticmethod
    def time_remaining() -> None:
        return None


#: The checks and logic the other Session operations run, as a task each: the unary handler
#: without its call wrapper.
_SESSION_METHODS: dict[str, Callable[..., Awaitable[Any]]] = {
    "join": _Servicer.Join.__wrapped__,  # type: ignore[attr-defined]
    "set": _Servicer.Set.__wrapped__,  # type: ignore[attr-defined]
    "leave": _Servicer.Leave.__wrapped__,  # type: ignore[attr-defined]
}
#: The operations that come by the thousand (barriers, a rendezvous's gets), in two steps: the
#: checks (and arrival) of one caller, then, once for all the callers of a group, what answers
#: at once or what to wait for. They wait without a task each, and may be grouped (SessionOp.also).
_SESSION_PARKING: dict[str, tuple[Callable[[_Servicer, Any, pb.Caller, tuple[Any, ...]], Member],
                                   Callable[[_Servicer, Any, Sequence[Member]], Any]]] = {
    "barrier": (_Servicer._admit_barrier, _Servicer._begin_barrier),
    "get": (_Servicer._admit_get, _Servicer._begin_get),
}


class _ServerSession:
    """One Session stream: reads batches of operations, runs each (barriers and gets parked in
    the wait lists, the rest as a task), and writes the results that completed since the last
    write as one reply (so N waiters released together
    cost one message per stream, not N calls)."""

    def __init__(self, servicer: _Servicer, context: grpc.aio.ServicerContext) -> None:
        self._servicer = servicer
        self._context = context
        self._results: list[pb.SessionResult] = []
        self._ready = asyncio.Event()
        self._closing = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._parked: set[_SessionWait] = set()
        # Why a bound: a client that sends operations that never complete (gets of keys nobody
        # sets) must not grow the coordinator without limit.
        self._max_ops = max(1024, 2 * servicer._state.world_size + 64)

    async def serve(self) -> None:
        writer = asyncio.ensure_future(self._write())
        try:
            while True:
                request = await self._context.read()
                if request is grpc.aio.EOF:
                    break
                if request is _UNDECODABLE:
                    raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                                 "a Session request is not a valid gridcomm.v1.SessionRequest.")
                for op in request.ops:
                    self._start(op)
            # The client is done sending: answer what is in flight (each op's wait is bounded).
            while self._tasks or self._parked:
                if self._tasks:
                    await asyncio.wait(set(self._tasks))
                else:
                    await asyncio.sleep(0.05)
            self._closing = True
            self._ready.set()
            await writer
        except Exception as exc:  # noqa: BLE001 - refused with a status, never a crash
            if self._servicer._owner._closing:
                return  # hook (issue 18): the server stopped under an open stream; nobody to tell
            # Why first: a reply still being written makes the abort fail (too many operations
            # on the call) and leaves the stream hanging; let that write end, drop the rest.
            self._results = []
            self._closing = True
            self._ready.set()
            try:
                await asyncio.wait_for(writer, 5.0)
            except BaseException:  # noqa: BLE001 - a writer that fails or hangs: abort anyway
                pass
            await _refuse(self._context, "Session", exc)
        finally:
            for task in list(self._tasks):
                task.cancel()
            for parked in list(self._parked):
                parked.drop()
            writer.cancel()

    def _answer(self, result: pb.SessionResult) -> None:
        self._results.append(result)
        self._ready.set()

    def _refused(self, op_id: int, name: str, exc: Exception, also: Sequence[int] = ()) -> pb.SessionResult:
        code, details, metadata = _status_of(name, exc)
        self._servicer._owner.metrics.session_op_error(name, code, 1 + len(also))  # metrics hook (issue 18)
        return pb.SessionResult(id=op_id, also=also, code=code.value[0], details=details,
                                metadata=[pb.MetadataEntry(key=k, value=v) for k, v in metadata])

    def _start(self, op: pb.SessionOp) -> None:
        kind = op.WhichOneof("op")
        if kind is None:
            self._answer(self._refused(op.id, "Session", _Abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"Session operation {op.id} names no operation.")))
            return
        waiting = len(self._tasks) + len(self._parked)
        if waiting >= self._max_ops:
            self._answer(self._refused(op.id, f"Session {kind}", _Abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{kind} refused: this Session stream already has {waiting} operations waiting.")))
            return
        steps = _SESSION_PARKING.get(kind)
        if steps is not None:
            self._start_parking(op, kind, steps)
            return
        if op.also:
            self._answer(self._refused(op.id, f"Session {kind}", _Abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"a Session {kind} cannot be grouped; only get and barrier can."),
                [member.id for member in op.also]))
            return
        task = asyncio.ensure_future(self._run(op.id, kind, getattr(op, kind)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _start_parking(self, op: pb.SessionOp, kind: str, steps: tuple[Callable[..., Any], Callable[..., Any]]) -> None:
        """A get or barrier, alone or grouped. Why no task: the waits that come by the thousand
        (barriers, the gets of a rendezvous) are answered from the wake-up itself, without a
        coroutine each. A group (op.also: the same operation by other ranks of this stream)
        costs one wait and one result; each member passes its own checks, and a member that
        fails them is answered on its own, with what its unary call would have got."""
        admit, begin = steps
        servicer = self._servicer
        request = getattr(op, kind)
        name = f"Session {kind}"
        if len(op.also) >= servicer._state.world_size:
            self._answer(self._refused(op.id, name, _Abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"a Session {kind} group of {len(op.also) + 1} callers is larger than the job "
                f"({servicer._state.world_size} ranks)."), [member.id for member in op.also]))
            return
        ids: list[int] = []
        members: list[Member] = []
        servicer.grouped += len(op.also)
        callers = [(op.id, request.caller)]
        callers.extend((member.id, member.caller) for member in op.also)
        shared = servicer._shared_fields(request)
        for op_id, caller in callers:
            try:
                members.append(admit(servicer, request, caller, shared))
            except Exception as exc:  # noqa: BLE001 - answered with the unary RPC's status
                self._answer(self._refused(op_id, name, exc))
                continue
            ids.append(op_id)
        if not ids:
            return
        try:
            begun = begin(servicer, request, members)
        except Exception as exc:  # noqa: BLE001 - answered with the unary RPC's status
            self._answer(self._refused(ids[0], name, exc, ids[1:]))
            return
        if isinstance(begun, _Parked):
            _SessionWait(self, ids, kind, begun, request.wait_s)
        else:
            self._answer(pb.SessionResult(id=ids[0], also=ids[1:], **{kind: begun}))

    async def _run(self, op_id: int, kind: str, request: Any) -> None:
        try:
            reply = await _SESSION_METHODS[kind](self._servicer, request, _OpContext)
        except Exception as exc:  # noqa: BLE001 - answered with the unary RPC's status
            self._answer(self._refused(op_id, f"Session {kind}", exc))
            return
        self._answer(pb.SessionResult(id=op_id, **{kind: reply}))

    async def _write(self) -> None:
        while True:
            if not self._results:
                if self._closing:
                    return
                await self._ready.wait()
                self._ready.clear()
                continue
            batch, self._results = self._results, []
            await self._context.write(pb.SessionReply(results=batch))


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _member_pb(member: Any) -> pb.Member:
    return pb.Member(
        rank=member.rank,
        hostname=member.hostname,
        incarnation=member.incarnation,
        state=int(member.state),  # type: ignore[arg-type]
        joined_at_unix_s=time.time() - (time.monotonic() - member.joined_at),
    )


def _failure_pb(failure: Any) -> pb.Failure:
    return pb.Failure(
        rank=failure.rank,
        reason=failure.reason,
        at_unix_s=time.time() - (time.monotonic() - failure.at),
        reported_by=failure.reported_by,
    )


class Coordinator:
    """The gridcomm control-plane server (rendezvous, key-value, barriers, liveness, health).

    Runs a ``grpc.aio`` server on a thread of its own, so it can live inside the rank-0 process
    (the default) or standalone (``gridcomm serve``)::

        server = gridcomm.Coordinator(world_size=2, port=0).start()
        print(server.port)          # the bound port
        ...
        server.stop()

    ``bind`` is the listen address; ``port=0`` picks a free port. With ``token`` set, every
    coordinator RPC must carry it (health checks need none, as kubelet sends none).
    """

    def __init__(
        self,
        world_size: int,
        bind: str = "0.0.0.0",
        port: int = 0,
        token: str | None = None,
        *,
        job_id: str | None = None,
        heartbeat_timeout_s: float | None = None,
        limits: Limits | None = None,
        tls: _config.TlsFiles | None = None,
        health_port: int | None = None,
        metrics_port: int | None = None,
    ) -> None:
        self.world_size = _config.world_size(world_size)
        self.bind = _config.validate_host("bind", bind)
        _, self._requested_port = _config.coordinator_address("localhost", port)
        self._token = _config.validate_token("token", token) if token is not None else None
        self.job_id = _config.job_id(job_id)
        self.heartbeat_timeout_s = _config.heartbeat_timeout_s(heartbeat_timeout_s)
        #: Bound on waits the server makes on its own behalf (room in the mailbox).
        self.timeout_s = _config.timeout_s()
        #: At interpreter exit without stop(), how long to keep serving for ranks still joined.
        self.exit_grace_s = min(30.0, 2 * self.heartbeat_timeout_s)
        #: No single long-poll is held longer than this, whatever wait_s a request asks for.
        self.max_wait_s = 3600.0
        #: After a heartbeat call drops without an answer, how long the rank has to heartbeat again.
        self.connection_grace_s = min(2.0, self.heartbeat_timeout_s / 2)
        self.state = JobState(self.world_size, self.job_id, now=time.monotonic(), limits=limits)
        self._port: int | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._stop_requested: asyncio.Event | None = None
        self._all_left = threading.Event()
        self._closing = False
        self._servicer: _Servicer | None = None
        self._health: Any = None
        self._main: GuardedServer | None = None
        self._health_server: GuardedServer | None = None
        #: False once a rank failed (or the coordinator stops): health says NOT_SERVING.
        self._job_ok = False
        self._stopped = threading.Event()
        self.tls = tls
        if tls is not None and (tls.cert is None or tls.key is None):
            raise ConfigError("a TLS coordinator needs GRIDCOMM_TLS_CERT and GRIDCOMM_TLS_KEY (its certificate and key).")
        self._health_port_requested = health_port
        #: The plaintext grpc.health.v1 port (health only; kubelet's probes cannot speak TLS).
        self.health_port: int | None = None
        # Hook (issue 18): counters for operators, and /metrics when a port is given.
        self.metrics = _metrics.CoordinatorMetrics()
        self._metrics_port_requested = metrics_port
        self._metrics_server: _metrics.MetricsServer | None = None
        #: The Prometheus /metrics port (after start(), when one was asked for).
        self.metrics_port: int | None = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def port(self) -> int:
        """The port the server listens on (after start())."""
        if self._port is None:
            raise ConfigError("the coordinator has not been started; call start() first.")
        return self._port

    @property
    def address(self) -> str:
        host = "127.0.0.1" if self.bind in ("0.0.0.0", "::", "") else self.bind
        return _config.format_target(host, self.port)

    def start(self, timeout_s: float = 30.0) -> Coordinator:
        """Binds and starts serving; returns self once the port is bound (raises if it cannot be)."""
        if self._thread is not None:
            raise ConfigError("this Coordinator was already started; create a new one.")
        if self._token is None and self.bind in ("0.0.0.0", "::"):
            log.warning(
                "coordinator: listening on all interfaces (%s) without a token; set GRIDCOMM_TOKEN to "
                "refuse callers that do not know it", self.bind,
            )
        self._thread = threading.Thread(target=self._run, name="gridcomm-coordinator", daemon=True)
        self._thread.start()
        # Why: a process that exits without stop() would otherwise freeze this daemon thread
        # mid-serve at interpreter shutdown, leaving ranks connected to a server that never
        # answers; at exit we stop properly, after a bounded wait for the ranks to leave or fail.
        atexit.register(self._stop_at_exit)
        if not self._ready.wait(timeout_s):
            raise CoordinatorUnavailable(f"the coordinator did not start within {timeout_s:.1f} s.")
        if self._start_error is not None:
            raise self._start_error
        if self._metrics_port_requested is not None:  # hook (issue 18)
            try:
                self._metrics_server = _metrics.serve_metrics(self, self._metrics_port_requested, self.bind)
            except BaseException:
                self.stop()
                raise
            self.metrics_port = self._metrics_server.port
        return self

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        drop_late_grpc_events(loop)  # hook (issue 18): no traceback for another loop's late events
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:  # noqa: BLE001 - reported to start() or logged
            if not self._ready.is_set():
                self._start_error = exc
                self._ready.set()
            else:
                log.exception("coordinator: the server loop ended on an error")
        finally:
            try:
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()
                self._stopped.set()

    async def _serve(self) -> None:
        self._stop_requested = asyncio.Event()
        self._servicer = _Servicer(self)
        self._health = BoundedHealth()
        servicer, health_servicer = self._servicer, self._health

        def register(server: grpc.aio.Server) -> None:
            _register(servicer, server)
            health_servicer.register(server)

        target = _config.format_target(self.bind, self._requested_port)
        credentials = None
        if self.tls is not None:
            assert self.tls.cert is not None and self.tls.key is not None
            credentials = grpc.ssl_server_credentials(
                [(self.tls.key, self.tls.cert)], root_certificates=self.tls.ca,
                require_client_auth=self.tls.require_client_cert)
        self._main = GuardedServer("coordinator", target, server_options(self.world_size), register,
                                   credentials=credentials, on_accepting=self._accepting_changed)
        port = await self._main.start()
        if port == 0:
            raise CoordinatorUnavailable(
                f"the coordinator cannot listen on {target}: {self._main.bind_error or 'is the port in use?'}; "
                "choose another with GRIDCOMM_PORT or port=0."
            )
        self._port = port
        health_server = None
        if self._health_port_requested is not None:
            health_target = _config.format_target(self.bind, self._health_port_requested)
            health_server = GuardedServer("coordinator health", health_target, health_server_options(),
                                          health_servicer.register)
            self.health_port = await health_server.start()
            if not self.health_port:
                await self._main.stop(0)
                raise CoordinatorUnavailable(f"the health port {health_target} cannot be bound: "
                                             f"{health_server.bind_error or 'is it in use?'}")
        self._health_server = health_server
        self._job_ok = True
        await self._publish_health()
        liveness = asyncio.ensure_future(self._servicer.watch_liveness())
        log.info("coordinator: serving job %r for %d ranks on %s", self.job_id, self.world_size, target)
        self._ready.set()
        try:
            await self._stop_requested.wait()
        finally:
            self._closing = True
            liveness.cancel()
            self._job_ok = False
            await self._publish_health()
            self._servicer.wake_all()
            await self._main.stop(0.5)
            if health_server is not None:
                await health_server.stop(0.2)

    @property
    def serving(self) -> bool:
        """True while the coordinator accepts calls and no rank has failed: what health says."""
        main = self._main
        return self._job_ok and main is not None and main.accepting

    async def _publish_health(self) -> None:
        # Issue 18: "" is liveness (the port accepts calls), whatever happened to the ranks;
        # SERVICE_NAME is readiness (serving, and no rank has failed).
        main = self._main
        serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
        live = not self._closing and main is not None and main.accepting
        await self._health.set("", serving if live else not_serving)
        await self._health.set(SERVICE_NAME, serving if self.serving else not_serving)

    def _accepting_changed(self, accepting: bool) -> None:
        """The watchdog found the main server dead (or bound it again): the plaintext health port
        must not say SERVING for a port that refuses connections."""
        asyncio.ensure_future(self._publish_health())

    def _set_serving(self, serving: bool) -> None:
        """Called on the loop thread (after a failure)."""
        self._job_ok = serving
        asyncio.ensure_future(self._publish_health())

    def wait_all_left(self, timeout_s: float) -> bool:
        """Waits until every rank has left (or failed); returns False at the timeout."""
        return self._all_left.wait(timeout_s)

    def _wait_idle(self, timeout_s: float) -> None:
        """Waits (bounded) until nobody needs this server any more: every rank left or failed, or,
        before the rendezvous completed, no rank has a call in flight (the joiners got their answer)."""
        deadline = time.monotonic() + timeout_s
        state = self.state
        while not self._all_left.wait(min(0.05, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                return
            if not state.complete and not any(m.active_calls for m in list(state.members.values())):
                return

    def _stop_at_exit(self) -> None:
        self.stop(grace_s=self.exit_grace_s)

    def stop(self, grace_s: float = 0.0) -> None:
        """Stops serving, first waiting up to ``grace_s`` for every rank to leave. Idempotent."""
        atexit.unregister(self._stop_at_exit)
        metrics, self._metrics_server = self._metrics_server, None
        if metrics is not None:  # hook (issue 18)
            metrics.stop()
        if self._thread is None or self._loop is None or self._stopped.is_set():
            return
        if grace_s > 0:
            self._wait_idle(grace_s)
        loop, stop = self._loop, self._stop_requested
        if stop is not None:
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:
                pass  # loop already closed
        self._thread.join(10.0)

    def __enter__(self) -> Coordinator:
        return self if self._thread is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

