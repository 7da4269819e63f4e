"""The coordinator client: a synchronous gRPC client with a deadline on every call.

No thread is started per client: calls run on the caller's thread and gRPC's own core. Long
waits are made of bounded slices so progress is logged ("waiting for 3 of 64 ranks: [5, 17, 40]")
and no single call outlives its deadline. Transient UNAVAILABLE is retried by the channel's
retry policy (jittered exponential backoff); the first contact waits for the channel to be
ready, so a coordinator DNS name that does not resolve yet is retried until the deadline.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc

from gridcomm import _config
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
from gridcomm._server import CHUNK_BYTES, FAILED_KEY, MAX_MESSAGE_BYTES, MISSING_KEY, SERVICE_NAME

log = logging.getLogger(__name__)

_T = TypeVar("_T")

#: Progress is logged, and a fresh long-poll is issued, at least this often during long waits.
PROGRESS_INTERVAL_S = 10.0
#: Transport slack added to a long-poll's gRPC deadline beyond the wait the server was asked for.
_CALL_SLACK_S = 1.0
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

_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                # Unary calls only: a streaming transfer (Put, Take) that fails midway is not
                # re-sent by the channel; the host backend sees the error and the failure path.
                "name": [{"service": SERVICE_NAME, "method": m} for m in
                         ("Join", "Set", "Get", "Barrier", "Heartbeat", "ReportFailure", "Leave", "Status")],
                "retryPolicy": {
                    "maxAttempts": 5,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)


def channel_options() -> list[tuple[str, Any]]:
    return [
        # Why: simulated ranks in one process must not share one connection (~2,000 parked calls
        # over one channel failed here).
        ("grpc.use_local_subchannel_pool", 1),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        # Why generous: liveness comes from heartbeats and connection loss, not keepalive; an
        # overloaded peer (thousands of ranks on few cores) must not be cut off for a slow ping ack.
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1_000),
        # Why: pod DNS can lag; the default waits 30 s between resolutions.
        ("grpc.dns_min_time_between_resolutions_ms", 500),
        ("grpc.enable_retries", 1),
        ("grpc.service_config", _SERVICE_CONFIG),
    ]


def channel_credentials(tls: _config.TlsFiles) -> grpc.ChannelCredentials:
    cert, key = tls.client_pair()
    return grpc.ssl_channel_credentials(root_certificates=tls.ca, private_key=key, certificate_chain=cert)


def secure_options(tls: _config.TlsFiles | None) -> list[tuple[str, Any]]:
    options = channel_options()
    if tls is not None and tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return options


def make_channel(target: str, tls: _config.TlsFiles | None) -> grpc.Channel:
    """A synchronous channel to the coordinator: TLS when configured, else plaintext."""
    if tls is None:
        return grpc.insecure_channel(target, options=channel_options())
    return grpc.secure_channel(target, channel_credentials(tls), options=secure_options(tls))


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
        self._channel: grpc.Channel | None = make_channel(self.target, self.tls)
        self._stub = pb_grpc.CoordinatorStub(self._channel)
        self._barrier_seq: dict[str, int] = {}
        self._caller_key: tuple[str, int, int, int] | None = None
        #: Streaming calls in flight (cancelled by cancel_inflight on a failure).
        self._inflight: set[Any] = set()
        self._caller = pb.Caller()
        self._joined = False
        self._left = False

    # ------------------------------------------------------------------ plumbing
    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The call metadata (the token) this client sends."""
        return self._metadata

    @property
    def caller(self) -> pb.Caller:
        """This rank's identity on every request after join (rebuilt only when it changes)."""
        key = (self.job_id, self.rank, self.incarnation, self.generation)
        if self._caller_key != key:
            self._caller_key = key
            self._caller = pb.Caller(job_id=self.job_id, rank=self.rank, incarnation=self.incarnation,
                                     generation=self.generation)
        return self._caller

    def _call(self, method: Callable[..., _T], request: Any, what: str, timeout_s: float, *, wait_for_ready: bool = False) -> _T:
        if self._channel is None:
            raise CommAborted(f"{what}: this client was closed.")
        try:
            return method(request, timeout=timeout_s, metadata=self._metadata, wait_for_ready=wait_for_ready)
        except grpc.RpcError as exc:
            raise translate(exc, what, self.target) from exc

    def _long_poll(self, what: str, timeout_s: float | None, attempt: Callable[[float, float], _T],
                   progress: Callable[[list[int]], str], *, first_contact: bool = False) -> _T:
        """Repeats ``attempt(wait_s, call_timeout_s)`` in bounded slices until it succeeds or the
        overall deadline passes, logging who is still missing after each slice."""
        total = self.timeout_s if timeout_s is None else _config.parse_duration("timeout_s", timeout_s)
        started = time.monotonic()
        deadline = started + total
        answered = False
        while True:
            wait_s = max(0.0, min(deadline - time.monotonic(), PROGRESS_INTERVAL_S))
            try:
                return attempt(wait_s, wait_s + _CALL_SLACK_S)
            except RendezvousTimeout as exc:
                answered = answered or bool(getattr(exc, "from_server", False))
                if deadline - time.monotonic() > 0.05:
                    if exc.missing_ranks:
                        log.info("rank %d: %s after %.0f s", self.rank, progress(exc.missing_ranks), time.monotonic() - started)
                    continue
                if first_contact and not answered:
                    raise CoordinatorUnavailable(
                        f"{what}: no answer from the coordinator at {self.target} within {total:.1f} s; is rank 0 "
                        "(or `gridcomm serve`) running there, and does the name resolve?"
                    ) from exc
                details = getattr(exc, "details", str(exc))
                hint = f"; is the process for rank {exc.missing_ranks[0]} running?" if exc.missing_ranks else ""
                raise RendezvousTimeout(f"{what} did not complete within {total:.1f} s: {details}{hint}",
                                        exc.missing_ranks) from exc

    # ------------------------------------------------------------------ API
    def join(self, timeout_s: float | None = None) -> int:
        """Registers this rank and waits until every rank has joined; returns the generation."""
        def attempt(wait_s: float, call_s: float) -> pb.JoinResponse:
            request = pb.JoinRequest(
                job_id=self.job_id, rank=self.rank, world_size=self.world_size,
                incarnation=self.incarnation, hostname=self.hostname, wait_s=wait_s,
            )
            return self._call(self._stub.Join, request, f"rank {self.rank}: join", call_s, wait_for_ready=True)

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
        if not isinstance(key, str):
            raise ConfigError(f"key must be a str, not {type(key).__name__}.")
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise ConfigError(f"value for key {key!r} must be bytes, not {type(value).__name__}.")
        request = pb.SetRequest(caller=self.caller, key=key, value=bytes(value))
        self._call(self._stub.Set, request, f"rank {self.rank}: set {key!r}", SHORT_CALL_S + len(value) / 50e6)

    def get(self, key: str, timeout_s: float | None = None) -> bytes:
        """Returns the value under ``key``, waiting until some rank sets it or the deadline passes."""
        if not isinstance(key, str):
            raise ConfigError(f"key must be a str, not {type(key).__name__}.")

        def attempt(wait_s: float, call_s: float) -> pb.GetResponse:
            request = pb.GetRequest(caller=self.caller, key=key, wait_s=wait_s)
            return self._call(self._stub.Get, request, f"rank {self.rank}: get {key!r}", call_s)

        return self._long_poll(f"rank {self.rank}: get {key!r}", timeout_s, attempt,
                               lambda missing: f"still waiting for key {key!r}").value

    def barrier(self, name: str = "barrier", timeout_s: float | None = None, *,
                participants: Sequence[int] = ()) -> None:
        """Waits until every rank (or every one of ``participants``) reaches the barrier ``name``;
        on timeout raises :class:`RendezvousTimeout` naming the missing ranks. Reusing a name is fine."""
        if not isinstance(name, str) or not name:
            raise ConfigError(f"barrier name must be a non-empty str, not {name!r}.")
        seq = self._barrier_seq.get(name, 0) + 1
        what = f"rank {self.rank}: barrier {name!r}"

        def attempt(wait_s: float, call_s: float) -> pb.BarrierResponse:
            request = pb.BarrierRequest(caller=self.caller, name=name, seq=seq, wait_s=wait_s, participants=participants)
            return self._call(self._stub.Barrier, request, what, call_s)

        # Why: the seq advances even if this wait fails, since the coordinator recorded the arrival.
        self._barrier_seq[name] = seq
        self._long_poll(what, timeout_s, attempt,
                        lambda missing: f"barrier {name!r}: waiting for {len(missing)} of {self.world_size} ranks: {missing[:16]}")

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
        if self._channel is None:
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
        if self._channel is None:
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

    def leave(self) -> None:
        """Leaves the job cleanly (distinct from failing). Idempotent; closes the channel."""
        if self._left or self._channel is None:
            return
        try:
            if self._joined:
                self._call(self._stub.Leave, pb.LeaveRequest(caller=self.caller), f"rank {self.rank}: leave", SHORT_CALL_S)
            self._left = True
        finally:
            self.close()

    def close(self) -> None:
        """Closes the channel without leaving (idempotent)."""
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def fetch_status(host: str, port: int, token: str | None = None, timeout_s: float = SHORT_CALL_S) -> pb.StatusResponse:
    """One Status call (for ``gridcomm status``)."""
    target = _config.format_target(host, port)
    secret = _config.token(token)
    metadata = (("authorization", f"Bearer {secret}"),) if secret else ()
    with make_channel(target, _config.tls()) as channel:
        try:
            return pb_grpc.CoordinatorStub(channel).Status(pb.StatusRequest(), timeout=timeout_s, metadata=metadata)
        except grpc.RpcError as exc:
            raise translate(exc, "status", target) from exc
