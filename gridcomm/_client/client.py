"""The coordinator client: a synchronous gRPC client with a deadline on every call.

No thread is started per client: calls run on the caller's thread and gRPC's own core, or, for
join, set, get, barrier and leave, travel on the client's Session stream (see
:mod:`gridcomm._client.session`; unary RPCs when GRIDCOMM_SESSION=off or when the stream breaks). Long
waits are made of bounded slices so progress is logged ("waiting for 3 of 64 ranks: [5, 17, 40]")
and no single call outlives its deadline. Transient UNAVAILABLE is retried by the channel's
retry policy (jittered exponential backoff); the first contact waits for the channel to be
ready, so a coordinator DNS name that does not resolve yet is retried until the deadline.

Its parts: how calls travel (``calls``), its streams and channels (``streams``), its joins
(``joining``), its place in the relay tree (``tree``), values larger than a message (``store``).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import grpc

from gridcomm import _config
from gridcomm._client import calls as _calls
from gridcomm._client import joining as _joining
from gridcomm._client import session as _session
from gridcomm._client import store as _store
from gridcomm._client import streams as _streams
from gridcomm._client import tree as _relay_tree
from gridcomm._client.calls import SHORT_CALL_S as SHORT_CALL_S
from gridcomm._client.calls import fetch_status as fetch_status
from gridcomm._client.calls import fetch_status_call as fetch_status_call
from gridcomm._client.inflight import Abandoned, InFlight
from gridcomm._client.tracker import Tracker
from gridcomm._client.watcher import Watcher
from gridcomm._config.settings import ClientSettings
from gridcomm._errors import CommAborted, ConfigError, GridcommError
from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._proto import coordinator_pb2_grpc as pb_grpc
from gridcomm._runtime.channel import make_aio_channel, make_channel
from gridcomm._wire import translate

log = logging.getLogger(__name__)

_T = TypeVar("_T")

#: Progress is logged, and a fresh long-poll is issued, at least this often during long waits.
PROGRESS_INTERVAL_S = 10.0
#: Transport slack added to a long-poll's gRPC deadline beyond the wait the server was asked for.
_CALL_SLACK_S = 1.0
#: A value up to this size travels on the Session stream; a larger one as unary calls (see set).
_SESSION_VALUE_BYTES = 64 * 1024


def check_text(what: str, value: Any) -> None:
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
        relay: str | None = None,
        settings: ClientSettings | None = None,
        coordinator_rank: int | None = None,
    ) -> None:
        if settings is None:
            settings = ClientSettings.resolve(host, port, rank, world_size, token, timeout_s, job_id=job_id, tls=tls,
                                              session=session, relay=relay)
        elif any(v is not None for v in (host, port, rank, world_size, token, timeout_s, job_id, tls, session, relay)):
            raise ConfigError("CoordinatorClient takes either settings= or the separate arguments, not both.")
        if settings.port == 0:
            raise ConfigError("port=0 cannot be dialled; pass the coordinator's bound port.")
        self.settings = settings
        self.world_size = settings.world_size
        self.rank = settings.rank
        self.host, self.port = settings.host, settings.port
        #: The bound on a whole call (join, barrier, get ...), unless the call passes its own.
        self.timeout_s = settings.timeout_s
        self.job_id = settings.job_id
        self.hostname = hostname if hostname is not None else socket.gethostname()
        self.incarnation = secrets.randbits(64) or 1
        self.generation = 0
        #: The coordinator's liveness bound, as its join answer says (until then the default).
        self.heartbeat_timeout_s = _config.DEFAULT_HEARTBEAT_TIMEOUT_S
        self.target = settings.target
        secret = settings.token
        self._metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {secret}"),) if secret else ()
        self.tls = settings.tls
        self.session_mode = settings.session
        #: The unary channel, opened on first use (a client whose calls all travel on the
        #: Session stream never opens a connection of its own).
        self._channel: grpc.Channel | None = None
        self._stub_: pb_grpc.CoordinatorStub | None = None
        self._session: _session.Session | None = None
        self._aio: grpc.aio.Channel | None = None
        #: The relay the Session stream dials (GRIDCOMM_RELAY_ADDRESS, or the tree's after the
        #: join), until it is found gone.
        self.relay_target = settings.relay
        self._relay_aio: grpc.aio.Channel | None = None
        #: The relay this rank hosts for its group of the tree (see _tree), once joined.
        self.relay: Any = None
        #: A stream to that relay for this rank's own barriers and gets (see streams.own_relay_session).
        self._own_relay: _session.Session | None = None
        self._own_relay_aio: grpc.aio.Channel | None = None
        self._relay_rank: int | None = None
        #: The group relay this rank's join tries first (GRIDCOMM_RELAY_ADDRESSES), until joined.
        self._relay_join: str | None = None
        #: Where this rank's join was answered: "relay" (its group's) or "coordinator".
        self.joined_through = ""
        self._closed = False
        self._barrier_seq: dict[str, int] = {}
        self._joined = False
        #: A join was sent (the coordinator may hold this rank as a member of the forming rendezvous).
        self._join_sent = False
        self._left = False
        #: The job ranks of this generation, ascending (all ranks until a shrink()).
        self.members: tuple[int, ...] = tuple(range(self.world_size))
        #: The rank whose process hosts the coordinator (0 when embedded in rank 0), or None; a
        #: coordinator that goes silent is then that rank's failure.
        self.coordinator_rank = coordinator_rank
        #: The first failure this generation's watcher reported (a peer's, or the coordinator lost).
        self.failure: GridcommError | None = None
        #: A failure the watcher reported for a later generation than this rank's (see watched).
        self._ahead: tuple[int, GridcommError] | None = None
        self._on_failure: Callable[[GridcommError], None] | None = None
        self._failure_lock = threading.Lock()
        self._watcher: Watcher | None = None
        #: The communicators' progress counters this client's heartbeats carry (see tracker).
        self._trackers: list[Tracker] = []
        #: Unary calls in flight, and the watcher's verdict that the coordinator is lost (until a
        #: join or recovery enters a generation again): see gridcomm._client.inflight.
        self._inflight = InFlight()
        self._lost: GridcommError | None = None

    # ------------------------------------------------------------------ plumbing
    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The call metadata (the token) this client sends."""
        return self._metadata

    @property
    def caller(self) -> pb.Caller:
        """This rank's identity on every request after join."""
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

    def _call(self, method: Callable[..., _T], request: Any, what: str, timeout_s: float, *, wait_for_ready: bool = False) -> _T:
        if self._closed:
            raise CommAborted(f"{what}: this client was closed.")
        try:
            return self._inflight.unary(method, request, timeout=timeout_s, metadata=self._metadata,
                                        wait_for_ready=wait_for_ready)
        except Abandoned as exc:
            raise exc.raised() from None
        except grpc.RpcError as exc:
            raise translate(exc, what, self.target) from exc

    def _op(self, kind: str, request: Any, what: str, timeout_s: float, *, wait_for_ready: bool = False) -> Any:
        """One coordinator operation: on the Session stream where there is one, else (or when
        the stream breaks; every operation is idempotent) as its unary RPC."""
        return _calls.op(self, kind, request, what, timeout_s, wait_for_ready=wait_for_ready)

    def _long_poll(self, what: str, timeout_s: float | None, attempt: Callable[[float, float], _T],
                   progress: Callable[[list[int]], str], *, first_contact: bool = False,
                   ends_when_lost: bool = True) -> _T:
        """Repeats ``attempt(wait_s, call_timeout_s)`` in bounded slices until it succeeds or the
        overall deadline passes (see gridcomm._client.calls.long_poll)."""
        return _calls.long_poll(self, what, timeout_s, attempt, progress, first_contact=first_contact,
                                ends_when_lost=ends_when_lost, interval_s=PROGRESS_INTERVAL_S,
                                slack_s=_CALL_SLACK_S)

    # ------------------------------------------------------------------ API
    def _tree(self, until: float | None = None) -> None:
        """Where this rank stands in the relay tree: hosts its group's relay, joins through one, or
        joins directly (see gridcomm._client.tree.decide; the coordinator is asked until ``until``)."""
        _relay_tree.decide(self, until)

    def join(self, timeout_s: float | None = None) -> int:
        """Registers this rank and waits until every rank has joined; returns the generation."""
        return _joining.join(self, timeout_s)

    def recover(self, mode: str, timeout_s: float | None = None) -> int:
        """After a failure of this generation, joins the next one as a survivor: ``"rebuild"``
        (every failed rank replaced by a new process; waits, bounded, for them) or ``"shrink"``
        (survivors only). Every survivor must make the same call. Returns the new generation;
        :attr:`members` names its job ranks. A rank that fails meanwhile ends the wait with
        :class:`RankFailedError` naming it; the call can be repeated."""
        return _joining.recover(self, mode, timeout_s)

    def watched(self, error: GridcommError, generation: int) -> None:
        """From the watcher: a failure of ``generation``. The first of the current generation is
        kept (:attr:`failure`) and handed to the handler set by :meth:`on_failure`."""
        with self._failure_lock:
            if generation > self.generation:
                # Why kept: a failure of the generation this rank's recovery is joining, whose
                # answer has not reached it yet; the coordinator tells each process once (its
                # heartbeats are held after that), so it is taken when that generation is entered.
                self._ahead = (generation, error)
            if generation < self.generation or self.failure is not None:
                return
            self.failure = error
            handler = self._on_failure
        if handler is not None:
            handler(error)
        else:
            log.warning("rank %d: %s", self.rank, error)

    def abandon(self, error: GridcommError) -> None:
        """From the watcher (on the loop): the coordinator is lost. Every call this client has in
        flight ends now with ``error`` (unary, on its Session stream, through a relay), and so does
        every later barrier or get, instead of waiting for its own deadline."""
        self._lost = error
        ended = self._inflight.abandon(error)
        for session in (self._session, self._own_relay):
            if session is not None:
                ended += session.abandon(error)
        if ended:
            log.debug("rank %d: %d call(s) in flight ended: %s", self.rank, ended, error)

    def track(self, tracker: Tracker) -> None:
        """Carries ``tracker``'s progress on every heartbeat from now on (a communicator's)."""
        self._trackers = [*self._trackers, tracker]

    def trackers(self) -> list[Tracker]:
        """The communicators' progress counters (and flight records) this client carries."""
        return list(self._trackers)

    def untrack(self, tracker: Tracker) -> None:
        self._trackers = [t for t in self._trackers if t is not tracker]

    def progress(self) -> list[pb.Progress]:
        """What the next heartbeat says of this rank's progress (this generation's communicators)."""
        generation = self._generation
        return [t.progress() for t in self._trackers if t.generation == generation][:64]

    def probed(self, probes: Iterable[pb.DigestProbe]) -> None:
        """The coordinator asks for digests (GRIDCOMM_DEBUG=collectives): the next heartbeat answers."""
        generation = self._generation
        by_name = {t.name: t for t in self._trackers if t.generation == generation}
        for probe in probes:
            tracker = by_name.get(probe.communicator)
            if tracker is not None:
                tracker.probe(probe.counts, probe.prints)

    def on_failure(self, handler: Callable[[GridcommError], None] | None) -> None:
        """Sets who hears of this generation's first failure (from the watcher's thread); called
        at once when it has already happened."""
        with self._failure_lock:
            self._on_failure = handler
            error = self.failure
        if error is not None and handler is not None:
            handler(error)

    def set(self, key: str, value: bytes) -> None:
        """Stores ``value`` (bytes) under ``key`` for this generation."""
        check_text("key", key)
        if not isinstance(value, (bytes, bytearray, memoryview)):
            raise ConfigError(f"value for key {key!r} must be bytes, not {type(value).__name__}.")
        what = f"rank {self.rank}: set {key!r}"
        if len(value) <= _SESSION_VALUE_BYTES:
            self._op("set", pb.SetRequest(caller=self.caller, key=key, value=bytes(value)), what, SHORT_CALL_S)
            return
        _store.set_in_pieces(self, key, value, what)

    def get(self, key: str, timeout_s: float | None = None) -> bytes:
        """Returns the value under ``key``, waiting until some rank sets it or the deadline passes."""
        check_text("key", key)
        what = f"rank {self.rank}: get {key!r}"

        def attempt(wait_s: float, call_s: float) -> pb.GetResponse:
            return self._op("get", pb.GetRequest(caller=self._caller, key=key, wait_s=wait_s), what, call_s)

        response = self._long_poll(what, timeout_s, attempt, lambda missing: "another rank has not set it yet")
        return _store.whole(self, key, response)

    def barrier(self, name: str = "barrier", timeout_s: float | None = None, *,
                participants: Sequence[int] = ()) -> None:
        """Waits until every rank (or every one of ``participants``) reaches the barrier ``name``;
        on timeout raises :class:`RendezvousTimeout` naming the missing ranks. Reusing a name is fine."""
        if not isinstance(name, str) or not name:
            raise ConfigError(f"barrier name must be a non-empty str, not {name!r}.")
        check_text("barrier name", name)
        seq = self._barrier_seq.get(name, 0) + 1
        # Why: the seq advances even if this wait fails, since the coordinator recorded the arrival.
        self._barrier_seq[name] = seq
        what = f"rank {self.rank}: barrier {name!r}"

        def attempt(wait_s: float, call_s: float) -> pb.BarrierResponse:
            request = pb.BarrierRequest(caller=self._caller, name=name, seq=seq, wait_s=wait_s, participants=participants)
            return self._op("barrier", request, what, call_s)

        self._long_poll(what, timeout_s, attempt,
                        lambda missing: f"waiting for {len(missing)} of {self.world_size} ranks: {missing[:16]}")

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
        self.stop_watching()  # a heartbeat after the leave would be refused
        try:
            if self._joined:
                self._op("leave", pb.LeaveRequest(caller=self.caller), f"rank {self.rank}: leave", timeout_s)
            elif self._join_sent:
                # Why also after a join that did not complete: the coordinator holds this rank as a
                # member of the forming rendezvous until it hears the rank left. Best effort: the
                # join's own error already said what went wrong.
                try:
                    self._op("leave", pb.LeaveRequest(caller=self.caller), f"rank {self.rank}: leave",
                             min(timeout_s, 2.0))
                except GridcommError as exc:
                    log.debug("rank %d: leave after an incomplete join: %s", self.rank, exc)
            self._left = True
        finally:
            self.close()

    def aio_channel(self) -> grpc.aio.Channel:
        """This client's channel on the background loop, made on first use (call it on the loop):
        its Session stream and its watcher's heartbeats share it, so a rank holds one connection."""
        if self._aio is None:
            self._aio = make_aio_channel(self.target, self.tls)
        return self._aio

    def session_stream(self) -> _session.Session | None:
        """The Session stream this client's operations and the watcher's heartbeats ride: to the
        relay while there is one, else to the coordinator (None with GRIDCOMM_SESSION=off, or once
        closed)."""
        return _streams.session_stream(self)

    def relay_unreachable(self, session: _session.Session) -> None:
        """From the watcher (on the loop): the relay did not answer a heartbeat in time; stop
        using it (what ``session`` still carries falls back to unary calls to the coordinator)."""
        if session.relay and self._session is session:
            asyncio.ensure_future(session.close())

    def relay_channel(self) -> grpc.aio.Channel:
        """The channel to the relay, on the background loop (made on first use)."""
        assert self.relay_target is not None
        if self._relay_aio is None:
            self._relay_aio = make_aio_channel(self.relay_target, self.tls, relay=True)
        return self._relay_aio

    def stop_watching(self) -> None:
        """Stops the heartbeats (before a leave, or when this rank is done). Idempotent."""
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.stop()

    def close(self) -> None:
        """Closes the channel without leaving (idempotent)."""
        self._closed = True
        self.stop_watching()
        _streams.release(self)

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
