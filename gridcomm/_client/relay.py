"""A relay: the coordinator's service for the ranks of one node, carried upstream as aggregates.

Ranks dial the relay exactly as they would dial the coordinator (the same Session stream, the same
token); the relay holds one Session stream to the coordinator and carries their operations on it:

- the same barrier arrival (name, sequence number, generation) or get (key) of several ranks goes
  up as one operation naming them all (``also``), and its one answer goes back to each. A barrier's
  arrivals are held until every rank connected here that takes part in it has arrived (the barrier
  cannot pass before they do, so holding delays nothing), or for at most ``HOLD_S``: the
  coordinator gets one message per relay and barrier, and a rank that does not come (hung, or
  slower than the hold) delays its siblings' arrivals at the coordinator by that much at most;
- first joins go up the same way, as one join naming every rank (``JoinRequest.also``), held for
  the relay's group (the ranks it was started for, when it knows them) as barriers are;
- other joins, sets and leaves go up one by one, batched into the stream's messages;
- a rank's heartbeat is answered by the relay itself (at its wait, or at once when the relay
  learns of a failure); the relay sends the coordinator one heartbeat for all its ranks every
  ``bound / 6``, with the age of each one's last heartbeat, so the coordinator judges every rank by
  its own silence with the same bound. A rank whose stream to the relay ends without its leaving
  (its process killed, its connection cut) is reported to the coordinator at once, which fails it
  after the same connection grace as a rank whose own heartbeat call to it dropped
  (gridcomm._coordinator.relay_lost).

If an aggregate is refused, each of its operations is repeated alone, so every rank gets the answer
its own call would have got. If the stream to the coordinator breaks, the relay ends its ranks'
streams; each rank repeats what it had in flight as unary calls to the coordinator and goes on
without the relay (see gridcomm._client.client), as it does when the relay dies.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import grpc

from gridcomm import _config
from gridcomm._client import relay_tls
from gridcomm._client.channel import make_aio_channel
from gridcomm._client.relay_children import Child, answered, lost_report, probe
from gridcomm._client.relay_silence import Silence, silent_answer
from gridcomm._errors import ConfigError, GridcommError
from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._proto import coordinator_pb2_grpc as pb_grpc
from gridcomm._runtime import loop as _eventloop
from gridcomm._runtime.admission import CONTROL_HEADROOM, RELAY_UNAUTHENTICATED, Admission
from gridcomm._runtime.guard import GuardedServer, control_server_options, token_problem
from gridcomm._wire import SERVICE_NAME, UNDECODABLE, decoder, progress_said

log = logging.getLogger(__name__)

_INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
_DEADLINE = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]


#: Connections a relay accepts at once (gRPC closes new ones past it): its node's ranks (a few
#: each) and, as on the coordinator's port, room for what a flood opens between two sweeps of the
#: admission, which keeps at most RELAY_UNAUTHENTICATED unauthenticated ones (see
#: gridcomm._runtime.admission). An idle connection costs the relay's host ~17 KB (~48 KB with TLS).
MAX_RELAY_CONNECTIONS = RELAY_UNAUTHENTICATED + CONTROL_HEADROOM

#: The longest a barrier arrival (or a first join) waits at the relay for the rest of the relay's
#: ranks before it goes up. Why bounded: what the coordinator knows of a barrier or a rendezvous
#: (`gridcomm status`, the list of missing ranks a wait names) lags by this much for ranks whose
#: sibling does not come.
HOLD_S = 1.0

#: Barriers a relay remembers having sent up (so that a repeated long poll is not held).
_WENT_UP_KEPT = 256

#: Ranks one stream may speak for in the relay's count of whom barriers wait for (a shared
#: session carries its process's ranks; more is not a deployment, and must not grow the relay).
_RANKS_PER_STREAM = 64


def _group_key(kind: str, request: Any) -> tuple[Any, ...] | None:
    """What makes the same operation of several ranks one aggregate (None: it goes up alone)."""
    if kind == "join":
        if request.generation or request.recovery or request.relay_address:
            return None  # a recovery, a replacement's or a relay host's join: its own answer
        return ("join", request.job_id, request.world_size, request.wants_relay, request.relay_rank)
    if kind == "barrier":
        caller = request.caller
        return ("barrier", caller.job_id, caller.generation, request.name, request.seq, tuple(request.participants))
    if kind == "get" and not request.offset:
        caller = request.caller
        return ("get", caller.job_id, caller.generation, request.key)
    return None


def _rank_of(kind: str, request: Any) -> int:
    """The rank an operation that can be aggregated is made by."""
    return int(request.rank) if kind == "join" else int(request.caller.rank)


#: (child, the child's op id, the child's op): who an upstream operation answers.
_Route = list[tuple[Child, int, pb.SessionOp]]


class _Group:
    """The same operation of several ranks, gathered until it goes up as one aggregate."""

    __slots__ = ("route", "waiting", "opened")

    def __init__(self, route: _Route, waiting: set[int] | None, opened: float) -> None:
        self.route = route
        #: Loop time of its first operation's arrival.
        self.opened = opened
        #: Whom it waits for that has not arrived (None or empty: it goes up at the next write);
        #: it goes up at ``opened + HOLD_S`` whoever is missing.
        self.waiting = waiting


class Relay:
    """Serves the Coordinator service to a node's ranks at :attr:`target` and carries their
    operations to the coordinator at ``upstream`` on one Session stream. Runs on the process's
    background loop; :meth:`start` returns once it is bound, :meth:`stop` ends it (bounded)."""

    def __init__(self, upstream: str, *, token: str | None = None, tls: _config.TlsFiles | None = None,
                 bind: str = "127.0.0.1", port: int = 0,
                 heartbeat_timeout_s: float = _config.DEFAULT_HEARTBEAT_TIMEOUT_S, ranks: Iterable[int] = (),
                 tls_name: str | None = None, world_size: int = 0) -> None:
        self.upstream = upstream
        #: The job's size (0: unknown; a child's bound grows with it), and the host name members
        #: verify where they dial it by another address than target (see relay_tls).
        self.world_size, self.tls_name = world_size, tls_name
        #: The ranks this relay serves, where its host knows them (a tree group): whom its first
        #: joins wait for.
        self._group = frozenset(ranks)
        #: Those of them whose first join it has sent up (a join of one of them again is a long
        #: poll repeated, which is not held).
        self._joins_sent: set[int] = set()
        self._token = token.encode() if token is not None else None
        self._metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self._tls = tls
        self.bind = bind
        self._requested_port = port
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.port = 0
        self._server: GuardedServer | None = None
        self._admission: Admission | None = None
        self._channel: grpc.aio.Channel | None = None
        self._up: Any = None  # the upstream Session call
        self._up_tasks: tuple[asyncio.Task[None], ...] = ()
        self._outbox: list[pb.SessionOp] = []
        self._has_work: asyncio.Event | None = None
        self._routes: dict[int, tuple[str, _Route, Callable[[pb.SessionResult], None] | None]] = {}
        self._next_id = 0
        self._groups: dict[tuple[Any, ...], _Group] = {}
        self._children: set[Child] = set()
        #: rank -> (the stream it reaches this relay on, the generation its latest operation named):
        #: whom a barrier's arrivals wait for.
        self._ranks: dict[int, tuple[Child, int]] = {}
        #: The latest barriers sent up (their group keys), oldest first.
        self._went_up: collections.OrderedDict[tuple[Any, ...], None] = collections.OrderedDict()
        #: rank -> (its latest caller, when its last heartbeat arrived (loop time), and the
        #: background loop's lag then: lag after it is left out of the age the relay reports)
        self._beats: dict[int, tuple[pb.Caller, float, float]] = {}
        #: rank -> its last heartbeat's progress entries (their ages as of that heartbeat's arrival),
        #: and what they say (gridcomm._wire.progress_said; None: they go up in full every time).
        self._progress: dict[int, tuple[list[pb.Progress], Hashable | None]] = {}
        #: rank -> (generation, what its entries said) as this relay last reported them in a
        #: heartbeat the coordinator answered: while they say the same, they go up as a flag.
        self._progress_up: dict[int, tuple[int, Hashable]] = {}
        #: Progress entries sent up in full, and ranks whose progress went up as the same.
        self.progress_sent = 0
        #: rank -> the coordinator's digest probes for it, given with its next heartbeat's answer.
        self._probes_down: dict[int, list[pb.DigestProbe]] = {}
        self.progress_same = 0
        self._beat_waiters: set[asyncio.Future[None]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._latest = pb.HeartbeatResponse()
        self._beat_task: asyncio.Task[None] | None = None
        #: How long the coordinator has not answered (see gridcomm._client.relay_silence).
        self._silence: Silence | None = None
        self._stopped = False
        #: How many operations carried upstream were aggregates of several ranks.
        self.aggregated = 0
        #: Rank operations carried upstream, by kind (an aggregate counts each rank it names).
        self.ranks_carried: collections.Counter[str] = collections.Counter()
        #: Operations sent upstream, by kind (an aggregate counts once).
        self.sent: collections.Counter[str] = collections.Counter()

    @property
    def carried(self) -> int:
        """Operations carried upstream (an aggregate counts once)."""
        return sum(self.sent.values())

    @property
    def dropped(self) -> int:
        """Unauthenticated connections its port's admission dropped (gridcomm._runtime.admission)."""
        return self._admission.dropped if self._admission is not None else 0

    def regroup(self, ranks: Iterable[int]) -> None:
        """The ranks it carries are ``ranks`` (the coordinator's groups, not its host's guess)."""
        self._group = frozenset(ranks)

    @property
    def target(self) -> str:
        host = "127.0.0.1" if self.bind in ("0.0.0.0", "::", "") else self.bind
        return _config.format_target(host, self.port)

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout_s: float = 30.0) -> Relay:
        loop = _eventloop.loop()
        try:
            port = asyncio.run_coroutine_threadsafe(self._start(), loop).result(timeout_s)
        except concurrent.futures.TimeoutError:
            raise GridcommError(f"the relay did not start within {timeout_s:g} s (this process's "
                                "background loop is starved?)") from None
        if not port:
            raise ConfigError(f"the relay cannot listen on {self.bind}:{self._requested_port}.")
        return self

    async def _start(self) -> int:
        credentials = relay_tls.server_credentials(self._tls)  # see gridcomm._client.relay_tls
        self._channel = make_aio_channel(self.upstream, self._tls)
        #: The port's unauthenticated connections are capped apart (a relay is a listener any pod
        #: can reach); a Session that passes the token check authenticates its connection.
        self._admission = Admission("relay", RELAY_UNAUTHENTICATED, authenticates=True)
        self._server = GuardedServer("relay", _config.format_target(self.bind, self._requested_port),
                                     control_server_options(MAX_RELAY_CONNECTIONS), self._register, credentials=credentials,
                                     admission=self._admission)
        self.port = await self._server.start()
        if self.port and (problem := await relay_tls.dial_problem(self.target, self._tls, self.tls_name)):
            self._stopped = True
            await self._stop()
            raise problem
        self._silence = Silence(asyncio.get_running_loop().time())
        self._beat_task = asyncio.ensure_future(self._heartbeats())
        return self.port

    def stop(self, timeout_s: float = 5.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        loop = _eventloop.current()
        if loop is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._stop(), loop).result(timeout_s)
        except Exception:  # noqa: BLE001 - stopping anyway
            log.debug("relay: stop did not finish", exc_info=True)

    def stop_when_idle(self, grace_s: float = 10.0) -> None:
        """Stops once none of its ranks is connected, or after ``grace_s`` (its rank is done, but
        the others of its group may still be leaving through it). Returns at once."""
        loop = _eventloop.current()
        if loop is None or self._stopped:
            return

        async def later() -> None:
            deadline = loop.time() + grace_s
            while self._children and loop.time() < deadline:
                await asyncio.sleep(0.1)
            if not self._stopped:
                self._stopped = True
                await self._stop()

        try:
            asyncio.run_coroutine_threadsafe(later(), loop)
        except RuntimeError:
            pass  # the loop closed meanwhile (interpreter exit)

    async def _stop(self) -> None:
        if self._beat_task is not None:
            self._beat_task.cancel()
        for child in list(self._children):
            child.closed = True
            child.ready.set()
        if self._server is not None:
            await self._server.stop(0.2)
        self._end_upstream("the relay stopped")
        if self._channel is not None:
            await self._channel.close()

    # ------------------------------------------------------------------ serving the ranks
    def _register(self, server: grpc.aio.Server) -> None:
        methods = {"Session": grpc.stream_stream_rpc_method_handler(
            self._session, request_deserializer=decoder(pb.SessionRequest),
            response_serializer=pb.SessionReply.SerializeToString)}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, methods),))

    async def _session(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        problem = token_problem(context, self._token)
        if problem is not None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                f"Session refused by the relay: the token is {problem}; set the same GRIDCOMM_TOKEN "
                                "(or GRIDCOMM_TOKEN_FILE) on every rank and the coordinator.")
        if self._admission is not None:
            self._admission.admitted(context.peer())
        child = Child(context, self.world_size)
        self._children.add(child)
        writer = child.writer = asyncio.ensure_future(child.write())
        refusal: tuple[grpc.StatusCode, str] | None = None
        cut = False
        try:
            while True:
                request = await context.read()
                if request is grpc.aio.EOF:
                    break
                if request is UNDECODABLE:
                    refusal = (grpc.StatusCode.INVALID_ARGUMENT, "a Session request is not a valid gridcomm.v1.SessionRequest.")
                    break
                for op in request.ops:
                    self._take(child, op)
                if (why := child.overflow()) is not None:
                    refusal = (grpc.StatusCode.RESOURCE_EXHAUSTED, why)
                    break
            # The rank is done sending: answer what it has in flight (each wait is bounded).
            while refusal is None and child.inflight > 0 and not child.closed:
                await asyncio.sleep(0.05)
            while refusal is None and child.results and not child.closed:
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            # The stream was cancelled (while reading, or answering what it had in flight after
            # its end of it closed): its process died or its connection went.
            cut = True
            raise
        finally:
            ended_here = child.closed  # this relay ended it (its upstream broke, or it stopped)
            child.close()
            self._children.discard(child)
            self._forget(child)
            if cut and not ended_here and not self._stopped:
                self._report_lost(child)
            # Why the writer ends first: an abort while a reply is being written fails (too many
            # operations on the call) and leaves the stream hanging.
            try:
                await asyncio.wait_for(writer, 5.0)
            except BaseException:  # noqa: BLE001 - a writer that fails or hangs: go on
                writer.cancel()
        if refusal is not None:
            await context.abort(*refusal)

    def _take(self, child: Child, op: pb.SessionOp) -> None:
        kind = op.WhichOneof("op")
        if not child.admit(op, kind):
            return
        if kind is None:
            child.answer(pb.SessionResult(id=op.id, code=_INVALID, details=f"Session operation {op.id} names no operation."))
            return
        request = getattr(op, kind)
        if kind == "join":
            # Why: only the relay speaks for several ranks at once (a rank's heartbeat: the relay
            # reads only its caller and progress).
            request.ClearField("also")
        elif kind in ("barrier", "get"):
            request.ClearField("also_ranks")
            request.ClearField("also_incarnations")
        caller = getattr(request, "caller", None)
        if caller is not None and not child.owns(caller):
            # A process this stream has not proven to be: the coordinator judges it, for this
            # child alone (see gridcomm._client.relay_children).
            if kind != "heartbeat":
                self._send(kind, request, [(child, op.id, op)])
                return

            def proven(result: pb.SessionResult) -> None:
                if result.code:
                    child.answer(answered(result, op.id))
                    return
                child.learn(kind, op, 0)
                self._note(child, caller)
                self._child_heartbeat(child, op)

            self._send(kind, probe(request), [], proven)
            return
        if caller is not None:
            self._note(child, caller)
        if kind == "heartbeat":
            self._child_heartbeat(child, op)
            return
        key = _group_key(kind, request)
        if key is None:
            self._send(kind, request, [(child, op.id, op)])
            return
        group = self._groups.get(key)
        if group is None:
            # Why not what this relay has sent up before (see _expected): that is a long poll
            # repeated (or a late rank's arrival), and the barrier may pass (the rendezvous
            # complete) meanwhile; held, its answer would come late.
            waiting = self._expected(key, request)
            loop = asyncio.get_running_loop()
            group = self._groups[key] = _Group([(child, op.id, op)], waiting, loop.time())
            if waiting is not None:
                waiting.discard(_rank_of(kind, request))
                if waiting:
                    loop.call_at(group.opened + HOLD_S, self._hold_ended)
                    return
            self._wake_writer()
            return
        group.route.append((child, op.id, op))
        waiting = group.waiting
        if waiting:
            waiting.discard(_rank_of(kind, request))
            if not waiting:
                self._wake_writer()

    def _note(self, child: Child, caller: pb.Caller) -> None:
        """Which stream ``caller``'s rank reaches this relay on, and in which generation."""
        rank = caller.rank
        entry = self._ranks.get(rank)
        if entry is None or entry[0] is not child or entry[1] != caller.generation:
            if entry is None and len(child.ranks) >= _RANKS_PER_STREAM:
                return
            if entry is not None and entry[0] is not child:
                entry[0].ranks.discard(rank)
            self._ranks[rank] = (child, caller.generation)
            child.ranks.add(rank)

    def _forget(self, child: Child) -> None:
        for rank in child.ranks:
            entry = self._ranks.get(rank)
            if entry is not None and entry[0] is child:
                del self._ranks[rank]
        child.ranks.clear()

    def _report_lost(self, child: Child) -> None:
        """``child``'s stream ended without its processes leaving: the coordinator is told at once
        which processes it proved to be (see gridcomm._client.relay_children.lost_report)."""
        # Not a rank that is on another stream of this relay now (it re-dialled).
        lost = sorted((rank, incarnation) for rank, incarnation in child.owned if rank not in self._ranks)
        for rank, incarnation in lost:
            beat = self._beats.get(rank)
            if beat is not None and beat[0].incarnation == incarnation:
                # Why: its age in the next heartbeats would count as a heartbeat the coordinator
                # has not had yet (a rank killed before its first went up), and it is not alive here.
                del self._beats[rank]
                self._progress.pop(rank, None)
                self._progress_up.pop(rank, None)
                self._probes_down.pop(rank, None)
        if lost:
            log.info("relay %s: the stream of rank(s) %s ended without their leaving; the coordinator is told",
                     self.target, [rank for rank, _ in lost])
            self._send("heartbeat", lost_report(child, lost, self.target), [], lambda result: None)

    def _expected(self, key: tuple[Any, ...], request: Any) -> set[int] | None:
        """Whom a group that ``request`` opens waits for (None: nobody; it goes up at the next
        write). A barrier: the ranks connected here of its generation, among its participants when
        it names them. A first join: the relay's ranks whose first join has not gone up yet."""
        if key[0] == "join":
            if not self._group or request.rank in self._joins_sent:
                return None
            return set(self._group - self._joins_sent)
        if key[0] != "barrier" or key in self._went_up:
            return None
        generation, participants = key[2], key[5]
        ranks = {rank for rank, (child, gen) in self._ranks.items() if gen == generation and not child.closed}
        if participants:
            ranks.intersection_update(participants)
        return ranks

    def _child_heartbeat(self, child: Child, op: pb.SessionOp) -> None:
        request = op.heartbeat
        loop = asyncio.get_running_loop()
        self._beats[request.caller.rank] = (request.caller, loop.time(), _eventloop.lag_s())
        if request.progress:
            entries = list(request.progress[:64])
            self._progress[request.caller.rank] = (entries, progress_said(entries))
        else:
            self._progress.pop(request.caller.rank, None)

        async def answer() -> None:
            if not self._latest.failures and not self._coordinator_silent():
                fut: asyncio.Future[None] = loop.create_future()
                self._beat_waiters.add(fut)
                wait_s = request.wait_s if request.wait_s == request.wait_s and request.wait_s > 0 else 0.0
                try:
                    await asyncio.wait_for(fut, min(wait_s, self.heartbeat_timeout_s))
                except asyncio.TimeoutError:
                    pass
                finally:
                    self._beat_waiters.discard(fut)
            silence = self._silence
            if silence is not None and silence.lost:
                child.answer(silent_answer(op.id, self.target, self.upstream, silence.seconds(loop.time())))
                return
            probes = self._probes_down.pop(request.caller.rank, None)
            if probes:  # digest probes for this rank (GRIDCOMM_DEBUG=collectives)
                beat = pb.HeartbeatResponse()
                beat.CopyFrom(self._latest)
                beat.digest_probes.extend(probes)
                child.answer(pb.SessionResult(id=op.id, heartbeat=beat))
                return
            child.answer(pb.SessionResult(id=op.id, heartbeat=self._latest))

        # Why kept: the loop holds tasks weakly.
        task = asyncio.ensure_future(answer())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _coordinator_silent(self) -> bool:
        """Whether the coordinator has not answered this relay for the liveness bound; the first
        time it is found so, the ranks' held heartbeats are answered with that now."""
        silence = self._silence
        if silence is None:
            return False
        if not silence.lost:
            silent_s = silence.seconds(asyncio.get_running_loop().time())
            if silent_s <= self.heartbeat_timeout_s:
                return False
            silence.lost = True
            log.warning("relay %s: no answer from the coordinator at %s for %.1f s (heartbeat timeout %g s); its "
                        "%d ranks are told it is lost", self.target, self.upstream, silent_s,
                        self.heartbeat_timeout_s, len(self._ranks))
            self._wake_beats()
        return True

    def _wake_beats(self) -> None:
        """Answers the ranks' held heartbeats now."""
        waiters, self._beat_waiters = self._beat_waiters, set()
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    # ------------------------------------------------------------------ upstream
    def _hold_ended(self) -> None:
        if self._groups and not self._stopped:
            self._wake_writer()

    def _wake_writer(self) -> None:
        if self._up is None:
            self._open_upstream()
        assert self._has_work is not None
        self._has_work.set()

    def _send(self, kind: str, request: Any, route: _Route,
              done: Callable[[pb.SessionResult], None] | None = None) -> None:
        self._next_id += 1
        op_id = self._next_id
        self._routes[op_id] = (kind, route, done)
        self._outbox.append(pb.SessionOp(id=op_id, **{kind: request}))
        self.sent[kind] += 1
        self.ranks_carried[kind] += len(route)
        self._wake_writer()

    def _open_upstream(self) -> None:
        assert self._channel is not None
        call = pb_grpc.CoordinatorStub(self._channel).Session(metadata=self._metadata, wait_for_ready=True)
        self._up = call
        self._has_work = asyncio.Event()
        self._up_tasks = (asyncio.ensure_future(self._write_up(call, self._has_work)),
                          asyncio.ensure_future(self._read_up(call)))

    def _flush_groups(self) -> None:
        """Sends the groups that are complete or due; a barrier still waiting for ranks stays."""
        if not self._groups:
            return
        now = asyncio.get_running_loop().time()
        for key, group in list(self._groups.items()):
            if group.waiting and group.opened + HOLD_S > now:
                continue
            del self._groups[key]
            route = group.route
            kind = key[0]
            if kind == "join":
                self._joins_sent.update(r[2].join.rank for r in route)
            elif kind == "barrier":
                self._went_up[key] = None
                if len(self._went_up) > _WENT_UP_KEPT:
                    self._went_up.popitem(last=False)
            first = getattr(route[0][2], kind)
            held = now - group.opened
            if len(route) == 1 and held < 0.01:
                self._send(kind, first, route)
                continue
            request = type(first)()
            request.CopyFrom(first)
            # Why less the time held: a rank's wait counts from when it asked (its call's deadline
            # is its wait plus a second of slack), not from when the relay sent it up.
            request.wait_s = max(0.0, min(getattr(r[2], kind).wait_s for r in route) - held)
            if len(route) == 1:
                self._send(kind, request, route)
                continue
            if kind == "join":
                request.also.extend(pb.Joiner(rank=r[2].join.rank, incarnation=r[2].join.incarnation,
                                              hostname=r[2].join.hostname) for r in route[1:])
            else:
                callers = [getattr(r[2], kind).caller for r in route[1:]]
                request.also_ranks.extend(c.rank for c in callers)
                request.also_incarnations.extend(c.incarnation for c in callers)
            self.aggregated += 1
            self._send(kind, request, route)

    async def _write_up(self, call: Any, has_work: asyncio.Event) -> None:
        try:
            while self._up is call:
                await has_work.wait()
                has_work.clear()
                self._flush_groups()
                batch, self._outbox = self._outbox, []
                if batch:
                    await call.write(pb.SessionRequest(ops=batch))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the stream ended; the relay ends its ranks' streams
            self._end_upstream(f"writing to the coordinator failed: {exc!r}")

    async def _read_up(self, call: Any) -> None:
        why = "the coordinator ended the relay's stream"
        try:
            async for reply in call:
                if self._silence is not None:
                    self._silence.heard(asyncio.get_running_loop().time())
                for result in reply.results:
                    self._route(result)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the stream ended
            why = f"the relay's stream to the coordinator broke: {exc!r}"
        self._end_upstream(why)

    def _route(self, result: pb.SessionResult) -> None:
        entry = self._routes.pop(result.id, None)
        if entry is None:
            return
        kind, route, done = entry
        if done is not None:
            done(result)
            return
        if result.code and len(route) > 1 and result.code != _DEADLINE:
            # An aggregate refused: each rank's operation alone gets the answer it would have.
            # Why not a wait that ended (DEADLINE_EXCEEDED: the barrier has not passed, the key is
            # not set yet): that answer is every rank's, and each repeats its long poll.
            for child, op_id, op in route:
                self._send(kind, getattr(op, kind), [(child, op_id, op)])
            return
        for child, _op_id, op in route:
            child.learn(kind, op, result.code)
        if kind == "leave" and not result.code:
            for child, _op_id, op in route:
                rank = op.leave.caller.rank
                self._beats.pop(rank, None)
                self._progress.pop(rank, None)
                self._progress_up.pop(rank, None)
                self._probes_down.pop(rank, None)
                noted = self._ranks.get(rank)
                if noted is not None and noted[0] is child:
                    del self._ranks[rank]
                    child.ranks.discard(rank)
        for child, op_id, _op in route:
            answer = pb.SessionResult()
            answer.CopyFrom(result)
            answer.id = op_id
            child.answer(answer)

    def _end_upstream(self, why: str) -> None:
        """The stream to the coordinator is gone: every rank's stream is ended, so each repeats what
        it had in flight as unary calls to the coordinator (and goes on without this relay)."""
        call, self._up = self._up, None
        if call is None:
            return
        (log.warning if self._children else log.debug)(
            "relay %s: %s; its %d ranks go to the coordinator directly", self.target, why, len(self._children))
        call.cancel()
        if self._has_work is not None:
            self._has_work.set()
        self._routes.clear()
        self._groups.clear()
        self._outbox = []
        for child in list(self._children):
            child.closed = True
            child.ready.set()
            asyncio.ensure_future(self._abort(child, why))

    async def _abort(self, child: Child, why: str) -> None:
        try:
            if child.writer is not None:
                await asyncio.wait_for(asyncio.shield(child.writer), 5.0)  # it ends: the child is closed
        except BaseException:  # noqa: BLE001 - abort anyway
            pass
        try:
            await child.context.abort(grpc.StatusCode.UNAVAILABLE, f"relay {self.target}: {why}")
        except BaseException:  # noqa: BLE001 - abort raises by design; a finished call is fine too
            pass

    async def _heartbeats(self) -> None:
        """One heartbeat upstream for every rank of this relay, every bound / 6 (a long-poll: a
        failure comes back at once)."""
        loop = asyncio.get_running_loop()
        while not self._stopped:
            # Read afresh: a rank hosting a relay learns the job's bound from its join's answer.
            period = max(0.05, self.heartbeat_timeout_s / 6)
            if not self._beats:
                if self._silence is not None:
                    self._silence.heard(loop.time())  # nothing asked of the coordinator: no silence
                await asyncio.sleep(period)
                continue
            now, lag = loop.time(), _eventloop.lag_s()
            beats = list(self._beats.values())
            # Why the lag is left out: this process's loop (the relay's, and in a node agent or a
            # simulation its ranks' too) ran behind, which is not the ranks' silence.
            ages = [max(0.0, (now - t) - (lag - at)) for _, t, at in beats]
            same: list[bool] = []
            full: dict[int, tuple[int, Hashable]] = {}
            request = pb.HeartbeatRequest(caller=beats[0][0], wait_s=period, relayed=True, also_age_s=ages,
                                          also_ranks=[c.rank for c, _, _ in beats],
                                          also_incarnations=[c.incarnation for c, _, _ in beats],
                                          also_generations=[c.generation for c, _, _ in beats])
            for (caller, _, _), age in zip(beats, ages, strict=True):
                rank = caller.rank
                entries, said = self._progress.get(rank, ((), None))
                key = (caller.generation, said)
                if said is not None and self._progress_up.get(rank) == key:
                    same.append(True)
                    continue
                same.append(False)
                if said is not None:
                    full[rank] = key
                for entry in entries:
                    # Why the age added: the coordinator dates the entry from this message's arrival.
                    relayed = request.progress.add()
                    relayed.CopyFrom(entry)
                    relayed.rank = rank
                    relayed.age_s = entry.age_s + age if entry.age_s == entry.age_s else 0.0
                    if entry.gpu_wait_s > 0:
                        relayed.gpu_wait_s = entry.gpu_wait_s + age
            if any(same):
                request.also_progress_same.extend(same)
            self.progress_sent += len(request.progress)
            self.progress_same += sum(same)
            answered: asyncio.Future[pb.SessionResult] = loop.create_future()

            def done(result: pb.SessionResult, answered: asyncio.Future[pb.SessionResult] = answered) -> None:
                if not answered.done():
                    answered.set_result(result)

            self._send("heartbeat", request, [], done)
            wait_s = period + max(1.0, self.heartbeat_timeout_s / 2)
            if self._silence is not None and not self._silence.lost:
                # Why: the ranks are told the moment the silence passes the bound, not at a timeout.
                wait_s = min(wait_s, self._silence.left(loop.time(), self.heartbeat_timeout_s))
            try:
                result = await asyncio.wait_for(answered, wait_s)
            except asyncio.TimeoutError:
                self._progress_up.clear()  # whether the coordinator read it is unknown: all in full
                self._coordinator_silent()
                continue
            if result.code:
                self._progress_up.clear()
                (log.debug if result.code == _UNAVAILABLE else log.warning)(
                    "relay %s: the coordinator refused its heartbeat: %s", self.target, result.details)
                await asyncio.sleep(period)
                continue
            self._progress_up.update(full)
            if result.heartbeat.progress_resend:
                for rank in result.heartbeat.progress_resend:
                    self._progress_up.pop(rank, None)
                    self._probes_down.pop(rank, None)
                result.heartbeat.ClearField("progress_resend")  # the ranks' answers carry the rest
            if result.heartbeat.digest_probes:
                for probe in result.heartbeat.digest_probes:
                    self._probes_down.setdefault(probe.rank, []).append(probe)
                result.heartbeat.ClearField("digest_probes")
                self._wake_beats()
            self._latest = result.heartbeat
            if result.heartbeat.failures:
                waiters, self._beat_waiters = self._beat_waiters, set()
                for fut in waiters:
                    if not fut.done():
                        fut.set_result(None)
                await asyncio.sleep(period)  # answered at once while failed: keep the pace
