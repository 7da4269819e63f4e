"""The coordinator client: a synchronous gRPC client with a deadline on every call.

No thread is started per client: calls run on the caller's thread and gRPC's own core, or, for
join, set, get, barrier and leave, travel on the process's Session stream (see
:mod:`gridcomm._session`; unary RPCs when GRIDCOMM_SESSION=off or when the stream breaks). Long
waits are made of bounded slices so progress is logged ("waiting for 3 of 64 ranks: [5, 17, 40]")
and no single call outlives its deadline. Transient UNAVAILABLE is retried by the channel's
retry policy (jittered exponential backoff); the first contact waits for the channel to be
ready, so a coordinator DNS name that does not resolve yet is retried until the deadline.
"""

from __future__ import annotations

import logging
import secrets
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gridcomm import _config, _progress, _session
from gridcomm._channel import make_channel
from gridcomm._errors import (
    AuthenticationError,
    CommAborted,
    ConfigError,
    CoordinatorUnavailable,
    GridcommError,
    RankFailedError,
    RendezvousTimeout,
)
from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._proto import coordinator_pb2_grpc as pb_grpc
from gridcomm._server import CHUNK_BYTES, FAILED_KEY, MISSING_KEY

log = logging.getLogger(__name__)

_T = TypeVar("_T")

#: Progress is logged, and a fresh long-poll is issued, at least this often during long waits.
PROGRESS_INTERVAL_S = 10.0
#: Transport slack added to a long-poll's gRPC deadline beyond the wait the server was asked for.
_CALL_SLACK_S = 1.0
#: A value up to this size travels on the Session stream; a larger one as unary calls (see set).
_SESSION_VALUE_BYTES = 64 * 1024
#: How often a value read in pieces may be found set again before get gives up.
_REREADS = 8
#: Bound on a short (non-waiting) call.
SHORT_CALL_S = 10.0

# One table from gRPC status to the library's errors (metadata can refine it, see _translate).
_STATUS_ERRORS: dict[grpc.StatusCode, type[GridcommError]] = {
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: AuthenticationError,
    grpc.StatusCode.INVALID_ARGUMENT: ConfigError,
    grpc.StatusCode.OUT_OF_RANGE: ConfigError,
    grpc.StatusCode.ALREADY_EXISTS: ConfigError,
    grpc.StatusCode.FAILED_PRECONDITION: ConfigError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ConfigError,
    grpc.StatusCode.NOT_FOUND: ConfigError,
    grpc.StatusCode.ABORTED: RankFailedError,
    grpc.StatusCode.DEADLINE_EXCEEDED: RendezvousTimeout,
    grpc.StatusCode.UNAVAILABLE: CoordinatorUnavailable,
    grpc.StatusCode.UNIMPLEMENTED: CoordinatorUnavailable,
    grpc.StatusCode.CANCELLED: CommAborted,
}

#: The unary RPC that does what each Session operation does.
_UNARY = {"join": "Join", "set": "Set", "get": "Get", "barrier": "Barrier", "leave": "Leave"}


def _metadata_value(error: grpc.RpcError, key: str) -> str | None:
    try:
        trailing = error.trailing_metadata() or ()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - not a call object
        return None
    for k, v in trailing:
        if k == key:
            return v if isinstance(v, str) else v.decode()
    return None


def _parse_ranks(text: str | None) -> list[int]:
    if not text:
        return []
    out = []
    for part in text.split(","):
        try:
            out.append(int(part))
        except ValueError:
            pass
    return out


def translate(error: grpc.RpcError, what: str, target: str) -> GridcommError:
    """Turns a gRPC error into the library's error, with a message that names the call and address."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN  # type: ignore[attr-defined]
    details = (error.details() if hasattr(error, "details") else None) or str(code)  # type: ignore[attr-defined]
    details = _progress.without_repeat(what, details)  # issue 18: no "barrier 'x': barrier 'x': ..."
    failed = _metadata_value(error, FAILED_KEY)
    if failed is not None:
        rank = int(failed) if failed.lstrip("-").isdigit() else -1
        return RankFailedError(f"{what}: {details}", rank=rank, reason=details)
    cls = _STATUS_ERRORS.get(code, GridcommError)
    if cls is RendezvousTimeout:
        missing_text = _metadata_value(error, MISSING_KEY)
        timeout = RendezvousTimeout(f"{what}: {details}", _parse_ranks(missing_text))
        # Why: a wait the server ended (it answered) differs from no answer at all.
        timeout.from_server = missing_text is not None or details != "Deadline Exceeded"  # type: ignore[attr-defined]
        timeout.details = details  # type: ignore[attr-defined]
        return timeout
    if cls is CoordinatorUnavailable:
        return CoordinatorUnavailable(f"{what}: the coordinator at {target} is unavailable: {details}")
    return cls(f"{what}: {details}")


def _check_text(what: str, value: Any) -> None:
    """A key or name must be a str that UTF-8 can encode (a protobuf string): checked on the
    calling thread, since get and barrier requests are built later, on the background loop."""
    if not isinstance(value, str):
        raise ConfigError(f"{what} must be a str, not {type(value).__name__}.")
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        raise ConfigError(f"{what} {value!r} is not valid UTF-8 text ({exc.reason} at position {exc.start}).") from None


class CoordinatorClient:
    """A client of the gridcomm coordinator, for one rank.

    Usable on its own to bootstrap any framework without NCCL::

        client = gridcomm.CoordinatorClient("job-0.svc", 13333, rank, world_size=2)
        client.join()
        if rank == 0:
            client.set("addr", b"10.0.0.1:1234")
        peer = client.get("addr")
        client.barrier("ready")
        client.leave()

    Every call has a deadline (``timeout_s``, GRIDCOMM_TIMEOUT_S, 300 s by default) and raises a
    :class:`GridcommError` subclass, never ``grpc.RpcError``.
    """

    def __init__(
        self,
        host: str | None = None,
        port: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        token: str | None = None,
        timeout_s: float | None = None,
        *,
        job_id: str | None = None,
        hostname: str | None = None,
        tls: _config.TlsFiles | None = None,
        session: str | None = None,
    ) -> None:
        self.world_size = _config.world_size(world_size)
        self.rank = _config.rank(rank, self.world_size)
        self.host, self.port = _config.coordinator_address(host, port)
        if self.port == 0:
            raise ConfigError("port=0 cannot be dialled; pass the coordinator's bound port.")
        self.timeout_s = _config.timeout_s(timeout_s)
        self.job_id = _config.job_id(job_id)
        self.hostname = hostname if hostname is not None else socket.gethostname()
        self.incarnation = secrets.randbits(64) or 1
        self.generation = 0
        self.heartbeat_timeout_s = _config.DEFAULT_HEARTBEAT_TIMEOUT_S
        self.target = _config.format_target(self.host, self.port)
        secret = _config.token(token)
        self._metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {secret}"),) if secret else ()
        self.tls = tls if tls is not None else _config.tls()
        self.session_mode = _config.session_mode(session)
        #: The unary channel, opened on first use (a client whose calls all travel on the
        #: Session stream never opens a connection of its own).
        self._channel: grpc.Channel | None = None
        self._stub_: pb_grpc.CoordinatorStub | None = None
        self._session: _session.Session | None = None
        self._closed = False
        self._barrier_seq: dict[str, int] = {}
        #: Streaming calls in flight (cancelled by cancel_inflight on a failure).
        self._inflight: set[Any] = set()
        self._joined = False
        self._left = False
        self._data_ready = False

    # ------------------------------------------------------------------ plumbing
    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The call metadata (the token) this client sends."""
        return self._metadata

    @property
    def caller(self) -> pb.Caller:
        """This rank's identity on every request after join (the fast paths of get and barrier
        read ``_caller`` itself)."""
        return self._caller

    @property
    def generation(self) -> int:
        """The job generation this rank joined (0 before join)."""
        return self._generation

    @generation.setter
    def generation(self, value: int) -> None:
        # Why here: the identity message is made once per change of the one field of it that
        # changes (job id, rank and incarnation are fixed at construction), not per request.
        self._generation = value
        self._caller = pb.Caller(job_id=self.job_id, rank=self.rank, incarnation=self.incarnation, generation=value)

    @property
    def _stub(self) -> pb_grpc.CoordinatorStub:
        if self._closed:
            raise CommAborted(f"rank {self.rank}: this client was closed.")
        if self._stub_ is None:
            self._channel = make_channel(self.target, self.tls)
            self._stub_ = pb_grpc.CoordinatorStub(self._channel)
        return self._stub_

    def open_data_channel(self, timeout_s: float | None = None) -> None:
        """Opens the channel that carries this client's unary calls and host-backend transfers
        (Put, Take) and waits, bounded, until it is connected, as a first contact does. Why: join
        travels on the Session stream, so without this the first transfer would dial; on a slow
        or lossy network its connection attempt can fail where a wait succeeds."""
        bound = self.timeout_s if timeout_s is None else timeout_s
        self._stub  # noqa: B018 - opens the channel
        assert self._channel is not None
        if self._data_ready:
            return
        # Why a health Check and not grpc.channel_ready_future: the future's connectivity-polling
        # thread raises "Cannot invoke RPC: Channel closed!" (a traceback on stderr) when the
        # channel is closed within its 0.2 s poll, as a short script's stop() does (issue 18).
        # Any answer, whatever its status, means the connection is up.
        try:
            health_pb2_grpc.HealthStub(self._channel).Check(health_pb2.HealthCheckRequest(), timeout=bound,
                                                            wait_for_ready=True)
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):  # type: ignore[attr-defined]
                raise CoordinatorUnavailable(f"rank {self.rank}: no connection to the coordinator at {self.target} "
                                             f"within {bound:.1f} s") from exc
        self._data_ready = True

    def _call(self, method: Callable[..., _T], request: Any, what: str, timeout_s: float, *, wait_for_ready: bool = False) -> _T:
        if self._closed:
            raise CommAborted(f"{what}: this client was closed.")
        try:
            return method(request, timeout=timeout_s, metadata=self._metadata, wait_for_ready=wait_for_ready)
        except grpc.RpcError as exc:
            raise translate(exc, what, self.target) from exc

    def _op(self, kind: str, request: Any, what: str, timeout_s: float, *, wait_for_ready: bool = False,
            group: Any = None, hold: float = 0.0) -> Any:
        """One coordinator operation: on the Session stream where there is one, else (or when
        the stream breaks; every operation is idempotent) as its unary RPC. ``group``: the key
        under which the same operation by other clients of this process's stream may travel
        with this one, ``hold`` how long it may wait for them (see
        :meth:`_session.Session.call`)."""
        if self._closed:
            raise CommAborted(f"{what}: this client was closed.")
        if self.session_mode != "off":
            if self._session is None:
                self._session = _session.acquire(self.target, self.tls, self._metadata,
                                                 self if self.session_mode == "client" else None)
            started = time.monotonic()
            try:
                return self._session.call(kind, request, timeout_s, group, hold)
            except (_session.OpError, _session.StreamBroken) as exc:
                error: Exception = exc
            return self._not_answered_on_stream(kind, request, error, what, timeout_s, started, wait_for_ready)
        method = getattr(self._stub, _UNARY[kind])
        return self._call(method, _session.built(request), what, timeout_s, wait_for_ready=wait_for_ready)

    def _not_answered_on_stream(self, kind: str, request: Any, error: Exception, what: str, timeout_s: float,
                                started: float, wait_for_ready: bool = False) -> Any:
        """An operation the Session stream raised ``error`` for: a status (OpError) is
        translated and raised; a broken stream, or one not served, repeats the operation as its
        unary RPC with what is left of ``timeout_s`` since ``started`` (every operation is
        idempotent)."""
        if isinstance(error, _session.OpError):
            raise translate(error, what, self.target) from None
        log.debug("rank %d: %s; repeating %s as a unary call", self.rank, error, kind)
        # Why: the repeat gets what is left of this call's time, not all of it again.
        timeout_s -= time.monotonic() - started
        if timeout_s <= 0:
            raise translate(_session.OpError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"),
                            what, self.target)
        method = getattr(self._stub, _UNARY[kind])
        return self._call(method, _session.built(request), what, timeout_s, wait_for_ready=wait_for_ready)

    def _first_slice_failed(self, kind: str, request: Any, error: Exception, started: float,
                            what: Callable[[], str]) -> Any:
        """What :meth:`_op` does (:meth:`_not_answered_on_stream`) when the first slice of a
        get's or barrier's long poll, sent straight to the Session stream by the method itself
        (its fast path), raised ``error``. Returns the response, or the RendezvousTimeout of a
        slice that ended without one (the long poll goes on from there); raises anything else.
        Why the fast path: under load every Python step on a rank's thread costs several times
        its time alone (cold caches, 2 cores for 33 processes). At 512 ranks (32 processes x 16
        threads) the rank threads' CPU per barrier fell from 15.9-17.9 ms to 11.1-12.8 ms when a
        barrier went straight to the stream, skipping the long poll's and _op's frames
        (measured with a bare call in their place)."""
        try:
            return self._not_answered_on_stream(kind, request, error, what(), request.wait_s + _CALL_SLACK_S, started)
        except RendezvousTimeout as exc:
            exc.started = started  # type: ignore[attr-defined]
            return exc

    def _long_poll(self, what: str, timeout_s: float | None, attempt: Callable[[float, float], _T],
                   progress: Callable[[list[int]], str], *, first_contact: bool = False,
                   failed: RendezvousTimeout | None = None) -> _T:
        """Repeats ``attempt(wait_s, call_timeout_s)`` in bounded slices until it succeeds or the
        overall deadline passes, logging who is still missing after each slice. ``failed``: the
        timeout of a first slice that get or barrier already ran (see :meth:`_first_slice_failed`);
        the deadline counts from that slice's start."""
        total = self.timeout_s if timeout_s is None else _config.parse_duration("timeout_s", timeout_s)
        started = time.monotonic() if failed is None else failed.started  # type: ignore[attr-defined]
        deadline = started + total
        answered = False
        speaker = _progress.Wait(what, self.target, total, started, progress)  # hook (issue 18): waits that speak
        while True:
            if failed is None:
                wait_s = max(0.0, min(deadline - time.monotonic(), PROGRESS_INTERVAL_S))
                try:
                    return attempt(wait_s, wait_s + _CALL_SLACK_S)
                except RendezvousTimeout as exc:
                    failed = exc
            timeout, failed = failed, None
            answered = answered or bool(getattr(timeout, "from_server", False))
            if deadline - time.monotonic() > 0.05:
                speaker.slice_ended(timeout, answered)
                continue
            if first_contact and not answered:
                raise CoordinatorUnavailable(
                    f"{what}: no answer from the coordinator at {self.target} within {total:.1f} s; is rank 0 "
                    "(or `gridcomm serve`) running there, and does the name resolve?"
                ) from timeout
            raise _progress.timed_out(what, total, timeout) from timeout

    # ------------------------------------------------------------------ API
    def join(self, timeout_s: float | None = None) -> int:
        """Registers this rank and waits until every rank has joined; returns the generation."""
        def attempt(wait_s: float, call_s: float) -> pb.JoinResponse:
            request = pb.JoinRequest(
                job_id=self.job_id, rank=self.rank, world_size=self.world_size,
                incarnation=self.incarnation, hostname=self.hostname, wait_s=wait_s,
            )
            return self._op("join", request, f"rank {self.rank}: join", call_s, wait_for_ready=True)

        response = self._long_poll(
            f"rank {self.rank} of {self.world_size}: join", timeout_s, attempt,
            lambda missing: f"waiting for {len(missing)} of {self.world_size} ranks: {missing[:16]}",
            first_contact=True,
        )
        self.generation = response.generation
        self.heartbeat_timeout_s = response.heartbeat_timeout_s or self.heartbeat_timeout_s
        self._joined = True
        return self.generation

    def set(self, key: str, value: bytes) -> None:
        """Stores ``value`` (bytes) under ``key`` for this generation."""
        _check_text("key", key)
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise ConfigError(f"value for key {key!r} must be bytes, not {type(value).__name__}.")
        what = f"rank {self.rank}: set {key!r}"
        if len(value) <= _SESSION_VALUE_BYTES:
            self._op("set", pb.SetRequest(caller=self.caller, key=key, value=bytes(value)), what, SHORT_CALL_S)
            return
        # Why unary: a Session message carries several operations, and the coordinator reads no
        # message larger than a chunk. A value larger than a chunk travels in pieces.
        view = memoryview(value).cast("B")
        total = len(view)
        if total <= CHUNK_BYTES:
            self._call(self._stub.Set, pb.SetRequest(caller=self.caller, key=key, value=bytes(view)), what,
                       SHORT_CALL_S + total / 50e6)
            return
        for offset in range(0, total, CHUNK_BYTES):
            piece = bytes(view[offset : offset + CHUNK_BYTES])
            self._call(self._stub.Set, pb.SetRequest(caller=self.caller, key=key, value=piece, total_bytes=total,
                                                     offset=offset), what, SHORT_CALL_S + len(piece) / 50e6)

    def _whole(self, key: str, response: pb.GetResponse) -> bytes:
        """The value a get answered: ``response.value``, or, for a value larger than one message
        (``total_bytes`` set), that first piece and the rest read after it. A value set again
        meanwhile is read again from its start (a bounded number of times)."""
        what = f"rank {self.rank}: get {key!r}"
        for _ in range(_REREADS):
            parts, got = [response.value], len(response.value)
            while got < response.total_bytes:
                request = pb.GetRequest(caller=self.caller, key=key, offset=got, version=response.version)
                try:
                    piece = self._stub.Get(request, timeout=SHORT_CALL_S + CHUNK_BYTES / 50e6, metadata=self._metadata)
                except grpc.RpcError as exc:
                    if exc.code() != grpc.StatusCode.ABORTED:
                        raise translate(exc, what, self.target) from exc
                    break
                parts.append(piece.value)
                got += len(piece.value)
                if not piece.value:
                    break
            else:
                return b"".join(parts)
            # Set again while it was read (or a piece came back empty): start over, without waiting.
            response = self._call(self._stub.Get, pb.GetRequest(caller=self.caller, key=key), what, SHORT_CALL_S)
            if not response.total_bytes:
                return response.value  # type: ignore[no-any-return]
        raise GridcommError(f"{what}: the value changed {_REREADS} times while it was being read; it is set too often "
                            "to be read whole.")

    def get(self, key: str, timeout_s: float | None = None) -> bytes:
        """Returns the value under ``key``, waiting until some rank sets it or the deadline passes."""
        if not (type(key) is str and key.isascii()):  # ASCII always encodes: the check's frame only for the rest
            _check_text("key", key)
        failed = None
        session = self._session
        if session is not None and timeout_s is None and not self._closed:
            # The fast path: the long poll's first slice straight to the stream (see _first_slice_failed).
            wait_s = min(self.timeout_s, PROGRESS_INTERVAL_S)
            request = _session.Deferred((pb.GetRequest, self._caller, wait_s, {"key": key}))
            started = time.monotonic()
            try:
                response = session.call("get", request, wait_s + _CALL_SLACK_S, ("get", key), _session.HOLD_GET_S)
                return response.value if not response.total_bytes else self._whole(key, response)  # type: ignore[no-any-return]
            except (_session.OpError, _session.StreamBroken) as exc:
                failed = self._first_slice_failed("get", request, exc, started, lambda: f"rank {self.rank}: get {key!r}")
            if not isinstance(failed, RendezvousTimeout):
                return self._whole(key, failed)

        def attempt(wait_s: float, call_s: float) -> pb.GetResponse:
            request = _session.Deferred((pb.GetRequest, self.caller, wait_s, {"key": key}))
            return self._op("get", request, f"rank {self.rank}: get {key!r}", call_s, group=("get", key),
                            hold=_session.HOLD_GET_S)

        return self._whole(key, self._long_poll(f"rank {self.rank}: get {key!r}", timeout_s, attempt,
                                                lambda missing: "another rank has not set it yet", failed=failed))

    def barrier(self, name: str = "barrier", timeout_s: float | None = None, *,
                participants: Sequence[int] = ()) -> None:
        """Waits until every rank (or every one of ``participants``) reaches the barrier ``name``;
        on timeout raises :class:`RendezvousTimeout` naming the missing ranks. Reusing a name is fine."""
        seq = self._barrier_seq.get(name) if type(name) is str else None  # a name used before passed these checks
        if seq is None:
            # Why the ASCII test first: a fresh name per barrier is common (the benchmark's are), and
            # ASCII always encodes; the full check, a frame of its own, runs only for the rest.
            if not (type(name) is str and name and name.isascii()):
                if not isinstance(name, str) or not name:
                    raise ConfigError(f"barrier name must be a non-empty str, not {name!r}.")
                _check_text("barrier name", name)
            seq = self._barrier_seq.get(name, 0)
        seq += 1
        # Why: the seq advances even if this wait fails, since the coordinator recorded the arrival.
        self._barrier_seq[name] = seq
        failed = None
        session = self._session
        if session is not None and timeout_s is None and not participants and not self._closed:
            # The fast path: the long poll's first slice straight to the stream (see _first_slice_failed).
            wait_s = min(self.timeout_s, PROGRESS_INTERVAL_S)
            request = _session.Deferred((pb.BarrierRequest, self._caller, wait_s, {"name": name, "seq": seq}))
            started = time.monotonic()
            try:
                session.call("barrier", request, wait_s + _CALL_SLACK_S, ("barrier", name, seq, ()),
                             _session.HOLD_BARRIER_S)
                return
            except (_session.OpError, _session.StreamBroken) as exc:
                failed = self._first_slice_failed("barrier", request, exc, started,
                                                  lambda: f"rank {self.rank}: barrier {name!r}")
            if not isinstance(failed, RendezvousTimeout):
                return
        what = f"rank {self.rank}: barrier {name!r}"
        group = ("barrier", name, seq, tuple(participants))

        fields: dict[str, Any] = {"name": name, "seq": seq}
        if participants:  # Why only when given: the empty keyword alone costs a third more per message.
            fields["participants"] = participants

        def attempt(wait_s: float, call_s: float) -> pb.BarrierResponse:
            request = _session.Deferred((pb.BarrierRequest, self.caller, wait_s, fields))
            return self._op("barrier", request, what, call_s, group=group,
                            hold=0.0 if participants else _session.HOLD_BARRIER_S)

        self._long_poll(what, timeout_s, attempt,
                        lambda missing: f"waiting for {len(missing)} of {self.world_size} ranks: {missing[:16]}",
                        failed=failed)

    def put(self, key: str, data: bytes | memoryview, readers: int = 1, timeout_s: float | None = None) -> None:
        """Sends one message (any size; streamed in chunks) for ``readers`` takers (host backend)."""
        view = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
        total = len(view)

        def chunks() -> Iterator[pb.Chunk]:
            yield pb.Chunk(caller=self.caller, key=key, total_bytes=total, readers=readers,
                           data=bytes(view[:CHUNK_BYTES]))
            for offset in range(CHUNK_BYTES, total, CHUNK_BYTES):
                yield pb.Chunk(data=bytes(view[offset : offset + CHUNK_BYTES]))

        call_s = self.timeout_s if timeout_s is None else timeout_s
        what = f"rank {self.rank}: send {key!r}"
        if self._closed:
            raise CommAborted(f"{what}: this client was closed.")
        call = self._stub.Put.future(chunks(), timeout=call_s, metadata=self._metadata)
        self._inflight.add(call)
        try:
            call.result()
        except grpc.RpcError as exc:
            raise translate(exc, what, self.target) from exc
        except grpc.FutureCancelledError as exc:
            raise CommAborted(f"{what}: cancelled, since the job failed.") from exc
        finally:
            self._inflight.discard(call)

    def take(self, key: str, out: memoryview | None = None, timeout_s: float | None = None) -> bytes | int:
        """Receives one message. With ``out`` (a writable byte view of the right size) the data is
        written there and the byte count returned; otherwise the bytes are returned."""
        total = self.timeout_s if timeout_s is None else timeout_s
        what = f"rank {self.rank}: receive {key!r}"
        request = pb.TakeRequest(caller=self.caller, key=key, wait_s=total)
        if self._closed:
            raise CommAborted(f"{what}: this client was closed.")
        parts: list[bytes] = []
        received = 0
        call = self._stub.Take(request, timeout=total + _CALL_SLACK_S, metadata=self._metadata)
        self._inflight.add(call)
        try:
            for chunk in call:
                size = len(chunk.data)
                if out is not None:
                    if received + size > len(out):
                        raise ConfigError(f"{what}: the message is larger than the {len(out)}-byte receive buffer.")
                    out[received : received + size] = chunk.data
                else:
                    parts.append(chunk.data)
                received += size
        except grpc.RpcError as exc:
            raise translate(exc, what, self.target) from exc
        finally:
            self._inflight.discard(call)
        if out is not None:
            if received != len(out):
                raise ConfigError(f"{what}: received {received} bytes into a {len(out)}-byte buffer; the sender's "
                                  "array has a different size.")
            return received
        return b"".join(parts)

    def cancel_inflight(self) -> None:
        """Cancels this client's data transfers in flight (from another thread), so a rank that
        learns of a failure is not left waiting on a transfer to a peer or coordinator that is
        gone. The waiting thread then gets CANCELLED (CommAborted), which callers translate."""
        for call in list(self._inflight):
            call.cancel()

    def heartbeat(self) -> list[pb.Failure]:
        """Tells the coordinator this rank is alive; returns the failures it knows of."""
        response = self._call(self._stub.Heartbeat, pb.HeartbeatRequest(caller=self.caller),
                              f"rank {self.rank}: heartbeat", SHORT_CALL_S)
        return list(response.failures)

    def report_failure(self, reason: str) -> None:
        """Marks this rank failed, so every other rank is told (best effort, bounded)."""
        request = pb.ReportFailureRequest(caller=self.caller, reason=str(reason)[:2048])
        self._call(self._stub.ReportFailure, request, f"rank {self.rank}: report failure", SHORT_CALL_S)

    def leave(self, timeout_s: float = SHORT_CALL_S) -> None:
        """Leaves the job cleanly (distinct from failing). Idempotent; closes the channel."""
        if self._left or self._closed:
            return
        try:
            if self._joined:
                self._op("leave", pb.LeaveRequest(caller=self.caller), f"rank {self.rank}: leave", timeout_s)
            self._left = True
        finally:
            self.close()

    def close(self) -> None:
        """Closes the channel without leaving (idempotent)."""
        self._closed = True
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()
        session, self._session = self._session, None
        if session is not None:
            _session.release(session)

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def fetch_status(host: str, port: int, token: str | None = None, timeout_s: float = SHORT_CALL_S) -> pb.StatusResponse:
    """One Status call (for ``gridcomm status``)."""
    return fetch_status_call(host, port, token, timeout_s)[0]


def fetch_status_call(host: str, port: int, token: str | None = None,
                      timeout_s: float = SHORT_CALL_S) -> tuple[pb.StatusResponse, tuple[tuple[str, Any], ...]]:
    """One Status call: the answer and its trailing metadata (the refused joins ride there)."""
    target = _config.format_target(host, port)
    secret = _config.token(token)
    metadata = (("authorization", f"Bearer {secret}"),) if secret else ()
    with make_channel(target, _config.tls()) as channel:
        try:
            reply, call = pb_grpc.CoordinatorStub(channel).Status.with_call(pb.StatusRequest(), timeout=timeout_s,
                                                                            metadata=metadata)
        except grpc.RpcError as exc:
            raise translate(exc, "status", target) from exc
        return reply, tuple(call.trailing_metadata() or ())
