"""The coordinator client: a synchronous gRPC client with a deadline on every call.

No thread is started per client: calls run on the caller's thread and gRPC's own core, or, for
join, set, get, barrier and leave, travel on the client's Session stream (see
:mod:`gridcomm._client.session`; unary RPCs when GRIDCOMM_SESSION=off or when the stream breaks). Long
waits are made of bounded slices so progress is logged ("waiting for 3 of 64 ranks: [5, 17, 40]")
and no single call outlives its deadline. Transient UNAVAILABLE is retried by the channel's
retry policy (jittered exponential backoff); the first contact waits for the channel to be
ready, so a coordinator DNS name that does not resolve yet is retried until the deadline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import grpc

from gridcomm import _config
from gridcomm._client import directed as _directed
from gridcomm._client import progress as _progress
from gridcomm._client import session as _session
from gridcomm._client.inflight import Abandoned, InFlight
from gridcomm._client.tracker import Tracker
from gridcomm._client.watcher import Watcher
from gridcomm._config.settings import ClientSettings
from gridcomm._errors import (
    CommAborted,
    ConfigError,
    CoordinatorUnavailable,
    GridcommError,
    RendezvousTimeout,
)
from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._proto import coordinator_pb2_grpc as pb_grpc
from gridcomm._relay.tls import RelayTlsError, serving_identity_problem
from gridcomm._runtime import loop as _eventloop
from gridcomm._runtime.channel import make_aio_channel, make_channel
from gridcomm._wire import CHUNK_BYTES, shown_generation, translate

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
#: How long a join waits for its group's relay (GRIDCOMM_RELAY_ADDRESSES) to answer before it goes
#: to the coordinator directly: pods of one job start seconds apart (image pulls, scheduling).
RELAY_JOIN_GRACE_S = 20.0

#: The unary RPC that does what each Session operation does.
_UNARY = {"join": "Join", "set": "Set", "get": "Get", "barrier": "Barrier", "leave": "Leave",
          "add": "Add", "compare_set": "CompareSet", "delete_key": "DeleteKey", "keys": "Keys"}

#: What a rank that hosts its group's relay sends through it (see _own_relay_session): the
#: operations a relay aggregates.
_THROUGH_OWN_RELAY = frozenset(("barrier", "get"))


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
        #: A stream to that relay for this rank's own barriers and gets (see _own_relay_session).
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
        if self._closed:
            raise CommAborted(f"{what}: this client was closed.")
        session = self._own_relay_session() if kind in _THROUGH_OWN_RELAY else None
        if session is None:
            session = self.session_stream()
        if session is not None:
            started = time.monotonic()
            try:
                return session.call(kind, request, timeout_s)
            except Abandoned as exc:
                raise exc.raised() from None
            except _session.OpError as exc:
                raise translate(exc, what, self.target) from None
            except _session.StreamBroken as exc:
                log.debug("rank %d: %s; repeating %s as a unary call", self.rank, exc, kind)
            # Why: the repeat gets what is left of this call's time, not all of it again.
            timeout_s -= time.monotonic() - started
            if timeout_s <= 0:
                raise translate(_session.OpError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"),
                                what, self.target)
        return self._call(getattr(self._stub, _UNARY[kind]), request, what, timeout_s, wait_for_ready=wait_for_ready)

    def _long_poll(self, what: str, timeout_s: float | None, attempt: Callable[[float, float], _T],
                   progress: Callable[[list[int]], str], *, first_contact: bool = False,
                   ends_when_lost: bool = True) -> _T:
        """Repeats ``attempt(wait_s, call_timeout_s)`` in bounded slices until it succeeds or the
        overall deadline passes, logging who is still missing after each slice. ``ends_when_lost``:
        once the watcher declared the coordinator lost, raises its error instead of another slice
        (a join or a recovery is tried regardless)."""
        total = self.timeout_s if timeout_s is None else _config.parse_duration("timeout_s", timeout_s)
        started = time.monotonic()
        deadline = started + total
        answered = False
        speaker = _progress.Wait(what, self.target, total, started, progress)  # a long wait says who it waits for
        while True:
            lost = self._lost
            if lost is not None and ends_when_lost and not first_contact:
                raise Abandoned(lost).raised()
            wait_s = max(0.0, min(deadline - time.monotonic(), PROGRESS_INTERVAL_S))
            try:
                return attempt(wait_s, wait_s + _CALL_SLACK_S)
            except RendezvousTimeout as exc:
                timeout = exc
            answered = answered or timeout.from_server
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
    def _tree(self, until: float | None = None) -> None:
        """The relay tree (GRIDCOMM_RELAY, GRIDCOMM_RELAY_FANIN): rank ``k x fanin`` hosts a relay
        for its group and joins directly; the others join through it. Where the relays' addresses
        are known (GRIDCOMM_RELAY_ADDRESSES) every rank decides alone; otherwise the coordinator
        directs each rank's join (see gridcomm._client.directed), asked until ``until``."""
        settings = self.settings
        if self.relay_target is not None or self.session_mode == "off" or settings.relay_mode == "off":
            return  # a node agent's relay (gridcomm launch), or none
        if settings.relay_mode == "auto" and self.world_size < _config.RELAY_AUTO_WORLD:
            return
        problem = serving_identity_problem(self.tls)
        if problem is not None:
            # Every rank decides alike from the job's TLS files: no relay would serve its members.
            if settings.relay_mode == "on":
                raise ConfigError(f"rank {self.rank}: GRIDCOMM_RELAY=on, but {problem}; set them on every rank "
                                  "or GRIDCOMM_RELAY=auto (no relays then) or off.")
            return
        template = settings.relay_addresses
        if template is None and not self._joined:
            self._directed(time.monotonic() + self.timeout_s / 2 if until is None else until)
            return
        fanin = settings.fanin(self.world_size)
        leader = self.rank - self.rank % fanin
        if leader != self.rank:
            self._relay_rank = leader
            if template is not None and not self._joined:
                # Its relay's address is known before the join: the join goes there too.
                self._relay_join = _config.format_relay_address(template, leader, leader // fanin)
            return
        self._host_relay(leader, fanin, template)

    def _directed(self, until: float) -> None:
        """The directed join: the coordinator says whether this rank hosts its group's relay, joins
        through it (then this rank's connection to the coordinator is closed: it needs none), or
        joins the coordinator directly."""
        fanin = self.settings.fanin(self.world_size)
        if self.rank % fanin == 0:
            self._host_relay(self.rank, fanin, None)  # before it asks: its first contact names it
        answer = _directed.ask(self, until, self.relay.target if self.relay is not None else "")
        if answer is None:
            return
        if self.relay is not None and not answer.host_relay:
            relay, self.relay = self.relay, None  # the coordinator's groups are not this rank's guess
            relay.stop()
        if answer.host_relay:
            if self.relay is not None:  # named in the first contact: it stays, for the coordinator's group
                self.relay.regroup(range(self.rank + 1, min(self.rank + answer.fanin, self.world_size)))
            self._host_relay(answer.leader, answer.fanin, None)
            return
        if answer.leader != self.rank:
            self._relay_rank = answer.leader  # a direct join's answer names the relay if one comes
        if answer.relay_address:
            self._relay_join = answer.relay_address

    def _host_relay(self, leader: int, fanin: int, template: str | None) -> None:
        """Hosts the relay of the group of ``fanin`` ranks that this rank (``leader``) leads."""
        if leader + 1 >= self.world_size or self.relay is not None:
            return  # a group of one: nobody to relay for
        from gridcomm._relay.server import Relay
        from gridcomm._runtime.address import local_address

        port, name = 0, None
        if template is not None:
            name, port = _config.parse_target(_config.format_relay_address(template, leader, leader // fanin))
        try:
            self.relay = Relay(self.target, token=self.settings.token, tls=self.tls, bind=local_address(self.host),
                               port=port, ranks=range(leader + 1, min(leader + fanin, self.world_size)),
                               tls_name=name, world_size=self.world_size).start()
        except RelayTlsError:
            raise  # its members could not dial it: a clear error now, not their timeouts
        except GridcommError as exc:
            # Its group then dials the coordinator directly: slower at scale, never wrong.
            log.warning("rank %d: hosts no relay for its group: %s", self.rank, exc)

    def join(self, timeout_s: float | None = None) -> int:
        """Registers this rank and waits until every rank has joined; returns the generation."""
        self._join_sent = True
        total = self.timeout_s if timeout_s is None else _config.parse_duration("timeout_s", timeout_s)
        # Why half the timeout: while the coordinator says "come back" (its group's relay is not up
        # yet) the rank asks again; the coordinator itself sends it on after LEAD_GRACE_S.
        self._tree(time.monotonic() + total / 2)
        relay_until = time.monotonic() + min(RELAY_JOIN_GRACE_S, total / 4)
        what = f"rank {self.rank}: join"

        def attempt(wait_s: float, call_s: float) -> pb.JoinResponse:
            request = self._join_request(wait_s)
            if self._relay_join is not None:
                response = self._join_through_relay(request, what, call_s, relay_until)
                if response is not None:
                    self.joined_through = "relay"
                    return response
            self.joined_through = "coordinator"
            return self._op("join", request, what, call_s, wait_for_ready=True)

        response = self._long_poll(
            f"rank {self.rank} of {self.world_size}: join", timeout_s, attempt,
            lambda missing: f"waiting for {len(missing)} of {self.world_size} ranks: {missing[:16]}",
            first_contact=True,
        )
        self.heartbeat_timeout_s = response.heartbeat_timeout_s or self.heartbeat_timeout_s
        self._enter(response)
        self._joined = True
        # Watched from here on, as a communicator's rank is: heartbeats on the background loop
        # (no thread of its own), so its death reaches the others and theirs reaches its waits.
        self._watcher = Watcher(self)
        self._watcher.start()
        return self.generation

    def _join_through_relay(self, request: pb.JoinRequest, what: str, call_s: float,
                            until: float) -> pb.JoinResponse | None:
        """The join through this rank's group relay (GRIDCOMM_RELAY_ADDRESSES), so the coordinator
        is not dialled by every rank. A relay that does not answer yet (its rank's pod is still
        starting) is waited for until ``until``; then None: the join goes to the coordinator
        directly, and the join's answer moves the stream to the relay if it came up."""
        target = self._relay_join
        assert target is not None
        began = time.monotonic()
        why = "it was not listening"
        backoff = 0.1
        while (left := until - time.monotonic()) > 0:
            if self._closed:
                raise CommAborted(f"{what}: this client was closed.")
            self.relay_target = target
            # Why wait for the connection rather than try and sleep: gRPC dials a relay that is not
            # listening yet again on its own, every RELAY_RECONNECT_MAX_MS at most, and the join
            # goes the moment it connects. Tried and slept in Python, each attempt (a stream, at
            # once refused) cost this process's loop, which at 64 ranks a process also had to start
            # the relay, and ranks found their relay seconds after it listened.
            if not self._relay_connected(left):
                continue
            session = self._session
            if session is None or session.closed or not session.relay:
                session = _session.Session(target, self._metadata, self.relay_channel, relay=True,
                                           wait_for_ready=False)
                self._session = session
            try:
                return session.call("join", request, call_s)
            except _session.OpError as exc:
                raise translate(exc, what, target) from None
            except _session.StreamBroken as exc:
                why = str(exc)  # connected, but the stream ended (the relay lost the coordinator?)
                time.sleep(min(max(0.0, until - time.monotonic()), backoff * (0.5 + random.random())))
                backoff = min(2.0, backoff * 2)
        log.info("rank %d: the relay at %s did not answer within %.0f s (%s); joining the coordinator at %s "
                 "directly", self.rank, target, time.monotonic() - began, why, self.target)
        self._relay_join = None
        session, self._session = self._session, None
        channel, self._relay_aio = self._relay_aio, None
        self.relay_target = None
        _close_later(session, [channel] if channel is not None else [])
        return None

    def _relay_connected(self, timeout_s: float) -> bool:
        """Waits, at most ``timeout_s``, until the channel to the relay (relay_target) is connected."""
        async def connected() -> None:
            await asyncio.wait_for(self.relay_channel().channel_ready(), timeout_s)

        future = asyncio.run_coroutine_threadsafe(connected(), _eventloop.loop())
        try:
            future.result(timeout_s + 5.0)  # the slack: this process's loop may run behind
            return True
        except (asyncio.TimeoutError, concurrent.futures.TimeoutError):
            future.cancel()
            return False
        except Exception as exc:  # noqa: BLE001 - the channel was closed meanwhile (the client was)
            log.debug("rank %d: waiting for the relay at %s: %r", self.rank, self.relay_target, exc)
            time.sleep(0.1)
            return False

    def recover(self, mode: str, timeout_s: float | None = None) -> int:
        """After a failure of this generation, joins the next one as a survivor: ``"rebuild"``
        (every failed rank replaced by a new process; waits, bounded, for them) or ``"shrink"``
        (survivors only). Every survivor must make the same call. Returns the new generation;
        :attr:`members` names its job ranks. A rank that fails meanwhile ends the wait with
        :class:`RankFailedError` naming it; the call can be repeated."""
        recovery = {"rebuild": pb.RECOVERY_REBUILD, "shrink": pb.RECOVERY_SHRINK}.get(mode)
        if recovery is None:
            raise ConfigError(f"recovery mode {mode!r} must be 'rebuild' or 'shrink'.")
        if not self._joined or self._closed:
            raise CommAborted(f"rank {self.rank}: {mode} needs a joined, open client.")
        base = self.generation
        what = f"rank {self.rank}: {mode} of generation {shown_generation(base)}"

        def attempt(wait_s: float, call_s: float) -> pb.JoinResponse:
            return self._op("join", self._join_request(wait_s, base, recovery), what, call_s)

        response = self._long_poll(what, timeout_s, attempt,
                                   lambda missing: f"waiting for {len(missing)} rank(s): {missing[:16]}",
                                   ends_when_lost=False)
        self._enter(response)
        return self.generation

    def _join_request(self, wait_s: float, generation: int = 0, recovery: int = pb.RECOVERY_NONE) -> pb.JoinRequest:
        """This process's join: of the job (a new process), or, by a survivor of ``generation``,
        of the next one (``recovery``)."""
        return pb.JoinRequest(job_id=self.job_id, rank=self.rank, world_size=self.world_size,
                              incarnation=self.incarnation, hostname=self.hostname, wait_s=wait_s,
                              generation=generation, recovery=recovery,  # type: ignore[arg-type]
                              relay_address=self.relay.target if self.relay is not None else "",
                              wants_relay=self._relay_rank is not None, relay_rank=self._relay_rank or 0)

    def _enter(self, response: pb.JoinResponse) -> None:
        """Takes the generation a join or a recovery answered: its number and members; barrier
        counts and the failure latch start afresh (the coordinator's keys and barriers do too)."""
        with self._failure_lock:
            self._lost = None
            self.generation = response.generation
            self.members = tuple(response.member_ranks) or tuple(range(self.world_size))
            ahead, self._ahead = self._ahead, None
            # The new communicator's handler hears of it when it is set (on_failure).
            self.failure = ahead[1] if ahead is not None and ahead[0] == self.generation else None
        self._barrier_seq = {}
        if self.relay is not None:
            self.relay.heartbeat_timeout_s = response.heartbeat_timeout_s or self.relay.heartbeat_timeout_s
        self._relay_join = None
        session = self._session
        on_relay = session is not None and session.relay and not session.closed
        if response.relay_address and response.relay_address != self.relay_target and not on_relay:
            self._move_to_relay(response.relay_address)

    def _move_to_relay(self, target: str) -> None:
        """After the join: this rank's stream goes to its group's relay from now on, and its
        connection to the coordinator is closed (its unary calls open one again if needed)."""
        self.relay_target = target
        session, self._session = self._session, None
        channel, self._aio = self._aio, None
        _close_later(session, [channel] if channel is not None else [])

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
        # Why unary: a Session message carries several operations, and the coordinator reads no
        # message larger than a chunk. A value larger than a chunk travels in pieces (total_bytes
        # says so; 0 means the one message is the whole value).
        view = memoryview(value).cast("B")
        total = len(view)
        pieces = total if total > CHUNK_BYTES else 0
        for offset in range(0, total, CHUNK_BYTES):
            piece = bytes(view[offset : offset + CHUNK_BYTES])
            self._call(self._stub.Set, pb.SetRequest(caller=self.caller, key=key, value=piece, total_bytes=pieces,
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
        check_text("key", key)
        what = f"rank {self.rank}: get {key!r}"

        def attempt(wait_s: float, call_s: float) -> pb.GetResponse:
            return self._op("get", pb.GetRequest(caller=self._caller, key=key, wait_s=wait_s), what, call_s)

        return self._whole(key, self._long_poll(what, timeout_s, attempt, lambda missing: "another rank has not set it yet"))

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
        if self.session_mode == "off" or self._closed:
            return None
        session = self._session
        if session is not None and session.relay and session.closed:
            log.warning("rank %d: the relay at %s is gone; going to the coordinator at %s directly", self.rank,
                        self.relay_target, self.target)
            self.relay_target, session = None, None
        if session is None:
            if self.relay_target is not None:
                session = _session.Session(self.relay_target, self._metadata, self.relay_channel, relay=True)
            else:
                session = _session.Session(self.target, self._metadata, self.aio_channel)
            self._session = session
        return session

    def _own_relay_session(self) -> _session.Session | None:
        """A rank that hosts its group's relay sends its barriers and gets through that relay, as
        its group does, so each reaches the coordinator inside the group's one aggregate: the
        coordinator then handles one message per group and barrier, not two. Its heartbeats stay
        on its own stream to the coordinator, so its process's death is seen there as soon as
        that stream drops. None (its own stream, then) before the join, without a relay, or
        once that stream broke (the relay lost the coordinator)."""
        if self.relay is None or not self._joined or self.session_mode == "off":
            return None
        session = self._own_relay
        if session is None:
            target = self.relay.target
            session = self._own_relay = _session.Session(
                target, self._metadata, lambda: self._own_relay_channel(target), relay=True)
        return None if session.closed else session

    def _own_relay_channel(self, target: str) -> grpc.aio.Channel:
        if self._own_relay_aio is None:
            self._own_relay_aio = make_aio_channel(target, self.tls, relay=True)
        return self._own_relay_aio

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
        own, self._own_relay = self._own_relay, None
        if own is not None:
            own_channel, self._own_relay_aio = self._own_relay_aio, None
            _close_later(own, [own_channel] if own_channel is not None else [])
        relay, self.relay = self.relay, None
        if relay is not None:
            relay.stop_when_idle()
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()
        session, self._session = self._session, None
        channels = [c for c in (self._aio, self._relay_aio) if c is not None]
        self._aio = self._relay_aio = None
        _close_later(session, channels)

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _close_later(session: _session.Session | None, channels: list[grpc.aio.Channel]) -> None:
    """Closes a Session stream, then channels, on the background loop (without waiting)."""
    running = _eventloop.current()
    if running is None or (session is None and not channels):
        return  # nothing to close, or the loop is gone (interpreter exit): so are its channels

    async def close_all() -> None:
        if session is not None:
            await session.close()
        for channel in channels:
            await channel.close()

    try:
        asyncio.run_coroutine_threadsafe(close_all(), running)
    except RuntimeError:
        pass  # the loop closed meanwhile (interpreter exit)


def fetch_status(host: str, port: int, token: str | None = None, timeout_s: float = SHORT_CALL_S) -> pb.StatusResponse:
    """One Status call (for ``gridcomm status``)."""
    return fetch_status_call(host, port, token, timeout_s)[0]


def fetch_status_call(host: str, port: int, token: str | None = None,
                      timeout_s: float = SHORT_CALL_S) -> tuple[pb.StatusResponse, tuple[tuple[str, Any], ...]]:
    """One Status call: the answer and its trailing metadata (the refused joins ride there)."""
    target = _config.format_target(host, port)
    secret = _config.token(token)
    metadata = (("authorization", f"Bearer {secret}"),) if secret else ()
    started = time.monotonic()
    with make_channel(target, _config.tls()) as channel:
        # Why connect first, within the whole deadline: as a probe does (a slow handshake, a
        # port-forward, is not an unreachable coordinator).
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise CoordinatorUnavailable(f"status: the coordinator at {target} is unavailable: cannot connect within "
                                         f"{timeout_s:g} s") from None
        try:
            reply, call = pb_grpc.CoordinatorStub(channel).Status.with_call(
                pb.StatusRequest(), timeout=max(0.05, timeout_s - (time.monotonic() - started)), metadata=metadata,
                wait_for_ready=True)
        except grpc.RpcError as exc:
            raise translate(exc, "status", target) from exc
        return reply, tuple(call.trailing_metadata() or ())
