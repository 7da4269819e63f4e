"""A relay: the coordinator's service for the ranks of one node, carried upstream as aggregates.

Ranks dial the relay exactly as they would dial the coordinator (the same Session stream, the same
token); the relay holds one Session stream to the coordinator and carries their operations on it:

- the same barrier arrival (name, sequence number, generation) or get (key) of several ranks goes
  up as one operation naming them all (``SessionOp.aggregate``), and its one answer goes back to each. A barrier's
  arrivals are held until every rank connected here that takes part in it has arrived (the barrier
  cannot pass before they do, so holding delays nothing), or for at most ``HOLD_S``: the
  coordinator gets one message per relay and barrier, and a rank that does not come (hung, or
  slower than the hold) delays its siblings' arrivals at the coordinator by that much at most;
- first joins go up the same way, as one join naming every rank, held for
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
import concurrent.futures
import logging
from collections.abc import Iterable
from typing import Any

import grpc

from gridcomm import _config
from gridcomm._errors import ConfigError, GridcommError
from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._relay import tls as relay_tls
from gridcomm._relay.aggregate import HOLD_S, Group, group_key, rank_of
from gridcomm._relay.beats import Beats
from gridcomm._relay.children import Child, answered, lost_report, probe
from gridcomm._relay.silence import Silence
from gridcomm._runtime import loop as _eventloop
from gridcomm._runtime.admission import CONTROL_HEADROOM, RELAY_UNAUTHENTICATED, Admission
from gridcomm._runtime.channel import make_aio_channel
from gridcomm._runtime.guard import GuardedServer, control_server_options, token_problem
from gridcomm._wire import SERVICE_NAME, UNDECODABLE, decoder, wire_refusal

log = logging.getLogger(__name__)

_INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]
_FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION.value[0]

#: Connections a relay accepts at once (gRPC closes new ones past it): its node's ranks (a few
#: each) and, as on the coordinator's port, room for what a flood opens between two sweeps of the
#: admission, which keeps at most RELAY_UNAUTHENTICATED unauthenticated ones (see
#: gridcomm._runtime.admission). An idle connection costs the relay's host ~17 KB (~48 KB with TLS).
MAX_RELAY_CONNECTIONS = RELAY_UNAUTHENTICATED + CONTROL_HEADROOM

#: Ranks one stream may speak for in the relay's count of whom barriers wait for (a shared
#: session carries its process's ranks; more is not a deployment, and must not grow the relay).
_RANKS_PER_STREAM = 64


class Relay(Beats):
    """Serves the Coordinator service to a node's ranks at :attr:`target` and carries their
    operations to the coordinator at ``upstream`` on one Session stream. Runs on the process's
    background loop; :meth:`start` returns once it is bound, :meth:`stop` ends it (bounded).
    Its fields are gridcomm._relay.state's; what goes upstream, gridcomm._relay.upstream's; its
    heartbeats, gridcomm._relay.beats'."""

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
        credentials = relay_tls.server_credentials(self._tls)  # see gridcomm._relay.tls
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
        self._idle = asyncio.Event()
        self._idle.set()
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
            idle = self._idle
            if self._children and idle is not None:
                try:
                    await asyncio.wait_for(idle.wait(), grace_s)
                except asyncio.TimeoutError:
                    pass
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
            child.end()
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
        if self._idle is not None:
            self._idle.clear()
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
            while refusal is None and not child.closed and (child.inflight > 0 or child.results):
                child.changed.clear()
                await child.changed.wait()
        except asyncio.CancelledError:
            # The stream was cancelled (while reading, or answering what it had in flight after
            # its end of it closed): its process died or its connection went.
            cut = True
            raise
        finally:
            ended_here = child.closed  # this relay ended it (its upstream broke, or it stopped)
            child.close()
            self._children.discard(child)
            if not self._children and self._idle is not None:
                self._idle.set()
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
        if op.HasField("aggregate"):
            # Why: only the relay speaks for several ranks at once (it sends its ranks' requests
            # up in operations of its own, so a rank's aggregate would otherwise be dropped unseen).
            child.refuse(op.id, _INVALID, f"Session operation {op.id} carries an aggregate: only a relay speaks for "
                         "several ranks.")
            return
        if kind == "join" and (problem := wire_refusal(request.wire, "the relay")) is not None:
            child.refuse(op.id, _FAILED_PRECONDITION,
                         f"join of rank {request.rank} refused by the relay at {self.target}: {problem}")
            return
        caller = getattr(request, "caller", None)
        if caller is not None and not child.owns(caller):
            # A process this stream has not proven to be: the coordinator judges it, for this
            # child alone (see gridcomm._relay.children).
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
        key = group_key(kind, request)
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
            group = self._groups[key] = Group([(child, op.id, op)], waiting, loop.time())
            if waiting is not None:
                waiting.discard(rank_of(kind, request))
                if waiting:
                    loop.call_at(group.opened + HOLD_S, self._hold_ended)
                    return
            self._wake_writer()
            return
        group.route.append((child, op.id, op))
        waiting = group.waiting
        if waiting:
            waiting.discard(rank_of(kind, request))
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
        which processes it proved to be (see gridcomm._relay.children.lost_report)."""
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
            request, aggregate = lost_report(child, lost, self.target)
            self._send("heartbeat", request, [], lambda result: None, aggregate)

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
