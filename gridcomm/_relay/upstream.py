"""A relay's one Session stream to the coordinator: what its ranks send goes up on it, batched,
the same operation of several ranks as one aggregate (gridcomm._relay.aggregate), and each answer
goes back to the ranks it answers.

If an aggregate is refused, each of its operations is repeated alone, so every rank gets the answer
its own call would have got. If the stream breaks, the relay ends its ranks' streams; each rank
repeats what it had in flight as unary calls to the coordinator and goes on without the relay.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import grpc

from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._proto import coordinator_pb2_grpc as pb_grpc
from gridcomm._relay.aggregate import HOLD_S, WENT_UP_KEPT, Route
from gridcomm._relay.children import Child
from gridcomm._relay.state import RelayState

log = logging.getLogger(__name__)

_DEADLINE = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]


class Upstream(RelayState):
    """Sends a relay's operations to the coordinator and routes the answers back (on the loop)."""

    def _hold_ended(self) -> None:
        if self._groups and not self._stopped:
            self._wake_writer()

    def _wake_writer(self) -> None:
        if self._up is None:
            self._open_upstream()
        assert self._has_work is not None
        self._has_work.set()

    def _send(self, kind: str, request: Any, route: Route,
              done: Callable[[pb.SessionResult], None] | None = None, aggregate: pb.Aggregate | None = None) -> None:
        self._next_id += 1
        op_id = self._next_id
        self._routes[op_id] = (kind, route, done)
        self._outbox.append(pb.SessionOp(id=op_id, aggregate=aggregate, **{kind: request}))
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
                if len(self._went_up) > WENT_UP_KEPT:
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
            aggregate = pb.Aggregate()
            if kind == "join":
                aggregate.ranks.extend(pb.RelayedRank(rank=r[2].join.rank, incarnation=r[2].join.incarnation,
                                                      hostname=r[2].join.hostname) for r in route[1:])
            else:
                callers = [getattr(r[2], kind).caller for r in route[1:]]
                aggregate.ranks.extend(pb.RelayedRank(rank=c.rank, incarnation=c.incarnation) for c in callers)
            self.aggregated += 1
            self._send(kind, request, route, aggregate=aggregate)

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
            answer.ClearField("aggregate")  # the relay's, not the rank's
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
            child.end()
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
