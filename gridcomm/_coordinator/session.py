"""The coordinator's side of a Session stream: operations read in batches, each run as its unary
RPC runs it (:class:`gridcomm._coordinator.servicer.Servicer`), results written in batches.

Each operation of a stream is a task of its own; the results that complete between two writes go
out as one reply, so a barrier that releases a rank costs its stream one message.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from gridcomm._coordinator.answers import Abort, CompactResult, refuse, refused_result
from gridcomm._coordinator.relay_lost import enter_stream
from gridcomm._coordinator.servicer import Servicer
from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._wire import UNDECODABLE

#: What a Session operation runs: the operation of its unary RPC.
OPERATIONS: dict[str, Callable[[Servicer, Any, float | None], Awaitable[Any]]] = {
    "join": Servicer.join,
    "set": Servicer.set,
    "get": Servicer.get,
    "barrier": Servicer.barrier,
    "leave": Servicer.leave,
    "heartbeat": Servicer.heartbeat,
    "add": Servicer.add,
    "compare_set": Servicer.compare_set,
    "delete_key": Servicer.delete_key,
    "keys": Servicer.keys,
}

#: What a Session operation that carries a relay's aggregate (SessionOp.aggregate) runs: its
#: answer, and what the SessionResult tells the relay beside it. Other kinds take none.
AGGREGATED: dict[str, Callable[[Servicer, Any, pb.Aggregate], Awaitable[tuple[Any, pb.AggregateAnswer | None]]]] = {
    "join": Servicer.join_aggregate,
    "get": Servicer.get_aggregate,
    "barrier": Servicer.barrier_aggregate,
    "heartbeat": Servicer.relayed_heartbeat,
}


class ServerSession:
    """One Session stream: reads batches of operations, runs each as a task, and writes the
    results that completed since the last write as one reply."""

    def __init__(self, servicer: Servicer, context: grpc.aio.ServicerContext) -> None:
        self._servicer = servicer
        self._context = context
        self._results: list[pb.SessionResult | CompactResult] = []
        self._ready = asyncio.Event()
        self._closing = False
        self._tasks: set[asyncio.Task[None]] = set()
        # Why a bound: a client that sends operations that never complete (gets of keys nobody
        # sets) must not grow the coordinator without limit. Why per rank (the process the
        # operation is charged to, see Servicer.admit_op): a relay's stream carries many ranks,
        # and one of them parking gets must not refuse the others' barriers.
        self._max_ops = max(1024, 2 * servicer.world_size + 64)
        #: (rank, incarnation), or None for what is charged to nobody -> its operations waiting.
        self._waiting: dict[tuple[int, int] | None, int] = {}
        # Why a bound on answers too: refusals come at once, so a client that sends and never
        # reads would pile them up here behind a write that flow control holds.
        self._max_results = 4 * self._max_ops

    async def serve(self) -> None:
        enter_stream()  # its operations' tasks know which stream they came on (gridcomm._coordinator.relay_lost)
        writer = asyncio.ensure_future(self._write())
        try:
            while True:
                request = await self._context.read()
                if request is grpc.aio.EOF:
                    break
                if request is UNDECODABLE:
                    raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "a Session request is not a valid gridcomm.v1.SessionRequest.")
                for op in request.ops:
                    self._start(op)
                if len(self._results) > self._max_results:
                    raise Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"this Session stream has {len(self._results)} answers its client has not read; it is "
                                "closed (a client must read the answers to what it sends).")
            # The client is done sending: answer what is in flight (each op's wait is bounded).
            if self._tasks:
                await asyncio.wait(set(self._tasks))
            self._closing = True
            self._ready.set()
            await writer
        except Exception as exc:  # noqa: BLE001 - refused with a status, never a crash
            if self._servicer.closing:
                return  # the server stopped under an open stream: nobody to tell
            # Why first: a reply still being written makes the abort fail (too many operations
            # on the call) and leaves the stream hanging; let that write end, drop the rest.
            self._results = []
            self._closing = True
            self._ready.set()
            try:
                await asyncio.wait_for(writer, 5.0)
            except BaseException:  # noqa: BLE001 - a writer that fails or hangs: abort anyway
                pass
            await refuse(self._context, "Session", exc)
        finally:
            for task in list(self._tasks):
                task.cancel()
            writer.cancel()

    def _answer(self, result: pb.SessionResult) -> None:
        self._results.append(result)
        self._ready.set()

    def _refuse(self, op_id: int, name: str, exc: Exception) -> None:
        """Answers an operation refused before it runs, or refused or failed while it ran, with
        its unary RPC's status (gridcomm._coordinator.answers.refused_result)."""
        code, result = refused_result(op_id, name, exc)
        self._servicer.metrics.session_op_error(name, code, 1)
        self._results.append(result)
        self._ready.set()

    def _start(self, op: pb.SessionOp) -> None:
        kind = op.WhichOneof("op")
        operation = OPERATIONS.get(kind) if kind is not None else None
        if operation is None:
            self._refuse(op.id, "Session", Abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"Session operation {op.id} names no operation."))
            return
        request = getattr(op, kind)
        aggregate = op.aggregate if op.HasField("aggregate") else None
        if aggregate is not None and kind not in AGGREGATED:
            self._refuse(op.id, f"Session {kind}", Abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"a {kind} carries no aggregate (only a relay's join, get, barrier "
                "or heartbeat does)."))
            return
        try:
            charged = self._servicer.admit_op(kind, request, aggregate is not None)
        except Abort as exc:
            self._refuse(op.id, f"Session {kind}", exc)
            return
        waiting = self._waiting.get(charged, 0)
        if waiting >= self._max_ops:
            if charged is not None:
                self._servicer.release_op(charged)
            self._refuse(op.id, f"Session {kind}", Abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{kind} refused: this Session stream already has {waiting} operations waiting."))
            return
        self._waiting[charged] = waiting + 1
        task = asyncio.ensure_future(self._run(op.id, kind, operation, request) if aggregate is None else
                                     self._run_aggregate(op.id, kind, request, aggregate))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda _: self._ended(charged))

    def _ended(self, charged: tuple[int, int] | None) -> None:
        count = self._waiting.pop(charged, 1) - 1
        if count > 0:
            self._waiting[charged] = count
        if charged is not None:
            self._servicer.release_op(charged)

    async def _run(self, op_id: int, kind: str, operation: Callable[[Servicer, Any, float | None], Awaitable[Any]],
                   request: Any) -> None:
        try:
            # No deadline of its own: the operation's wait_s bounds every wait.
            reply = await operation(self._servicer, request, None)
        except Exception as exc:  # noqa: BLE001 - answered with the unary RPC's status
            self._refuse(op_id, f"Session {kind}", exc)
            return
        self._answer(pb.SessionResult(id=op_id, **{kind: reply}))

    async def _run_aggregate(self, op_id: int, kind: str, request: Any, aggregate: pb.Aggregate) -> None:
        try:
            reply, answer = await AGGREGATED[kind](self._servicer, request, aggregate)
        except Exception as exc:  # noqa: BLE001 - answered with the unary RPC's status
            self._refuse(op_id, f"Session {kind}", exc)
            return
        self._answer(pb.SessionResult(id=op_id, aggregate=answer, **{kind: reply}))

    async def _write(self) -> None:
        while True:
            if not self._results:
                if self._closing:
                    return
                await self._ready.wait()
                self._ready.clear()
                continue
            batch, self._results = self._results, []
            reply = pb.SessionReply()
            for result in batch:
                if isinstance(result, tuple):  # a refusal kept as (id, code, details): see refused_result
                    reply.results.add(id=result[0], code=result[1], details=result[2])
                else:
                    reply.results.append(result)
            await self._context.write(reply)
