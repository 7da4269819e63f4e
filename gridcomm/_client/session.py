"""A client's Session stream: the coordinator calls that wait (join, get, barrier) and the small
ones (set, leave), carried as messages on one long-lived gRPC stream instead of a unary call each.

Why: on the coordinator a unary call costs a few hundred microseconds of Python in gRPC's asyncio
layer before a handler runs; a message on an open stream costs a fraction of that. Each client
has a stream of its own: a rank is a process (one pod, or one of the few processes of a pod
under ``gridcomm launch``), so there is nothing to share, and machinery that served only clients sharing a
process would serve no deployment.
``GRIDCOMM_SESSION=off`` uses the unary RPCs only.

The stream lives on the process-wide background loop (:mod:`gridcomm._runtime.loop`): no thread per
client. A calling thread queues its operation and waits, bounded, for its result. Every operation
is idempotent (barrier arrivals carry a sequence number, joins an incarnation), so when the stream
breaks the client repeats the operation as a unary call; when no answer comes in time the caller
sees what a unary call's deadline would have given it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

import grpc

from gridcomm._client.inflight import Abandoned
from gridcomm._errors import GridcommError
from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._proto import coordinator_pb2_grpc as pb_grpc
from gridcomm._runtime import loop as _eventloop

log = logging.getLogger(__name__)

_CODES = {code.value[0]: code for code in grpc.StatusCode}


class OpError(grpc.RpcError):
    """An operation answered with a status other than OK, shaped like a failed unary call so the
    client's one translation table reads it."""

    def __init__(self, code: grpc.StatusCode, details: str, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(details)
        self._code = code
        self._details = details
        self._metadata = metadata

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata


class StreamBroken(Exception):
    """The stream ended (or cannot be used) before the operation was answered; its outcome is
    unknown and the caller repeats it as a unary call."""


class _Waiter:
    """One caller thread waiting for one result: a lock taken at creation and released by the
    loop (cheaper than an Event, whose Condition costs more per wake-up)."""

    __slots__ = ("lock", "result", "broken", "error")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lock.acquire()
        self.result: pb.SessionResult | None = None
        self.broken: str | None = None
        #: The watcher's verdict that ended this operation (see abandon).
        self.error: GridcommError | None = None

    def wake(self) -> None:
        self.lock.release()


class _LoopWaiter:
    """A coroutine on the loop itself (the watcher's heartbeat) waiting for one result."""

    __slots__ = ("future", "result", "broken", "error")

    def __init__(self, future: asyncio.Future[None]) -> None:
        self.future = future
        self.result: pb.SessionResult | None = None
        self.broken: str | None = None
        self.error: GridcommError | None = None

    def wake(self) -> None:
        if not self.future.done():
            self.future.set_result(None)


class Session:
    """One client's Session stream to one coordinator. ``call`` runs on any thread but the
    loop's; the rest runs on the loop."""

    def __init__(self, target: str, metadata: tuple[tuple[str, str], ...],
                 channel: Callable[[], grpc.aio.Channel], *, relay: bool = False, wait_for_ready: bool = True) -> None:
        self._target = target
        #: False: a stream whose server is not listening breaks at once (a tree relay tried
        #: before the join), instead of waiting for it.
        self._wait_for_ready = wait_for_ready
        #: A stream to a relay is not opened again once it breaks: the client goes on without
        #: the relay (its operations repeat as unary calls to the coordinator meanwhile).
        self.relay = relay
        #: Gives the channel the stream runs on: the client's, shared with its watcher (a rank
        #: holds one connection), which the client closes.
        self._channel = channel
        self._metadata = metadata
        self._loop = _eventloop.loop()
        self._ids = itertools.count(1)
        self._waiters: dict[int, _Waiter | _LoopWaiter] = {}
        # Loop-thread state.
        #: The next message to write: what callers queued since the last write.
        self._outbox = pb.SessionRequest()
        self._call: Any = None
        self._has_work: asyncio.Event | None = None
        #: Operations written on the current stream and not answered yet.
        self._sent: dict[int, str] = {}
        self._tasks: tuple[asyncio.Task[None], ...] = ()
        #: Set by close(): nothing reopens the stream (what is still queued falls back to unary).
        self._closed = False

    @property
    def closed(self) -> bool:
        """True once closed, or, for a relay's stream, once it broke."""
        return self._closed

    # ------------------------------------------------------------------ calling threads
    def call(self, kind: str, request: Any, timeout_s: float) -> Any:
        """Runs one operation; returns the unary RPC's response message. Raises :class:`OpError`
        (the operation's status, or DEADLINE_EXCEEDED when no answer came within ``timeout_s``)
        or :class:`StreamBroken`."""
        if _eventloop.on_loop_thread():
            raise StreamBroken("called on the background loop's own thread, which cannot wait for itself")
        op_id = next(self._ids)
        waiter = self._waiters[op_id] = _Waiter()
        try:
            self._loop.call_soon_threadsafe(self._queue, op_id, kind, request)
        except RuntimeError as exc:  # the loop is closed (interpreter exit)
            self._waiters.pop(op_id, None)
            raise StreamBroken(f"the background loop is closed: {exc}") from exc
        try:
            if not waiter.lock.acquire(True, timeout_s if timeout_s > 0.0 else 0.0):
                if self._waiters.pop(op_id, None) is not None:
                    raise OpError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
                waiter.lock.acquire()  # the loop took this waiter at the same moment: its answer is on the way
        except BaseException:
            # Interrupted (a signal handler raised on the main thread: KeyboardInterrupt), or
            # timed out: nobody waits for this answer any more.
            self._waiters.pop(op_id, None)
            raise
        return _outcome(waiter, kind)

    async def run(self, kind: str, request: Any, timeout_s: float) -> Any:
        """:meth:`call` for a coroutine on the background loop (the watcher's heartbeats ride
        the stream the rank already holds: no call per heartbeat for the coordinator to set up)."""
        op_id = next(self._ids)
        waiter = self._waiters[op_id] = _LoopWaiter(self._loop.create_future())
        self._queue(op_id, kind, request)
        try:
            await asyncio.wait_for(asyncio.shield(waiter.future), timeout_s)
        except asyncio.TimeoutError:
            if self._waiters.pop(op_id, None) is not None:
                raise OpError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        finally:
            self._waiters.pop(op_id, None)
        return _outcome(waiter, kind)

    # ------------------------------------------------------------------ loop thread
    def _queue(self, op_id: int, kind: str, request: Any) -> None:
        if op_id not in self._waiters:
            return  # its caller gave up before the loop got to it
        if self._closed:
            # A client closed while another thread of it was queuing: the caller repeats as a
            # unary call (and sees the close).
            self._fall_back([op_id], "was closed")
            return
        if self._call is None:
            self._open()
        self._outbox.ops.add(id=op_id, **{kind: request})
        assert self._has_work is not None
        self._has_work.set()

    def _open(self) -> None:
        # Why wait_for_ready: a coordinator that is not up yet (or a name that does not resolve
        # yet) is waited for; each operation's own timeout bounds the wait.
        call = pb_grpc.CoordinatorStub(self._channel()).Session(metadata=self._metadata,
                                                                 wait_for_ready=self._wait_for_ready)
        self._call = call
        self._has_work = has_work = asyncio.Event()
        self._sent = {}
        # Why kept: the loop holds tasks weakly; an unreferenced pending task can be collected.
        self._tasks = (asyncio.ensure_future(self._write(call, has_work)), asyncio.ensure_future(self._read(call)))

    async def _write(self, call: Any, has_work: asyncio.Event) -> None:
        try:
            while self._call is call:
                await has_work.wait()
                has_work.clear()
                batch, self._outbox = self._outbox, pb.SessionRequest()
                if batch.ops:
                    self._sent.update((op.id, op.WhichOneof("op")) for op in batch.ops)
                    await call.write(batch)
        except asyncio.CancelledError:
            self._broken(call, "cancelled")
            raise
        except Exception as exc:  # noqa: BLE001 - every error ends this stream; ops fall back
            self._broken(call, await self._status(call, _why(exc)))

    async def _status(self, call: Any, fallback: str) -> str:
        """The call's final status, waited for briefly. Why: a failed write reports only a generic
        error; the status says what ended the stream (for the fall-back's log line)."""
        try:
            code = await asyncio.wait_for(call.code(), 1.0)
            details = await asyncio.wait_for(call.details(), 1.0)
        except Exception:  # noqa: BLE001 - no status in time: keep what the failure said
            return fallback
        return f"{code.name}: {details}"

    async def _read(self, call: Any) -> None:
        why = "the coordinator ended the stream"
        try:
            sent, waiters = self._sent, self._waiters
            async for reply in call:
                for result in reply.results:
                    sent.pop(result.id, None)
                    waiter = waiters.pop(result.id, None)
                    if waiter is not None:
                        waiter.result = result
                        waiter.wake()
        except asyncio.CancelledError:
            self._broken(call, "cancelled")
            raise
        except Exception as exc:  # noqa: BLE001 - every error ends this stream; ops fall back
            why = _why(exc)
        self._broken(call, await self._status(call, why))

    def _broken(self, call: Any, why: str) -> None:
        """Ends this stream: the operations it carried, or still queued for it, fall back."""
        if self._call is not call:
            return
        self._call = None
        call.cancel()
        if self.relay:
            self._closed = True
        if self._has_work is not None:
            self._has_work.set()  # ends this stream's writer
        kinds = dict(self._sent)
        kinds.update((op.id, op.WhichOneof("op")) for op in self._outbox.ops)
        lost = set(kinds)
        # Why counted apart: an operation whose caller gave up (a long poll's attempt that timed
        # out, repeated since) is in flight but not repeated; only those still awaited are.
        awaited = sum(1 for op_id in lost if op_id in self._waiters)
        self._sent, self._outbox = {}, pb.SessionRequest()
        if awaited:
            # Why not a warning when cancelled: that is this process closing the stream (exit).
            # Why not for a relay that took only heartbeats and leaves with it: its rank's process
            # ended (a job's ranks finish seconds apart); were it a death, the coordinator names
            # that rank to everyone, and nothing waited on the stream is lost.
            # Nor for a relay tried before the join (not waited for): the join says when it gives up.
            quiet = why == "cancelled" or not self._wait_for_ready or \
                (self.relay and set(kinds.values()) <= {"heartbeat", "leave"})
            (log.debug if quiet else log.warning)(
                "gridcomm: the Session stream to %s ended (%s) with %d operation(s) still awaited; they are repeated "
                "as unary calls", self._target, why, awaited)
        # Why after the line: it then comes before what the repeated calls log.
        self._fall_back(lost, f"ended: {why}")

    def _fall_back(self, op_ids: Iterable[int], why: str) -> None:
        """The operations ``op_ids`` will not be answered here: their callers repeat them as
        unary calls (StreamBroken), told that the stream ``why``."""
        for op_id in op_ids:
            waiter = self._waiters.pop(op_id, None)
            if waiter is not None:
                waiter.broken = f"the Session stream to {self._target} {why}"
                waiter.wake()

    def abandon(self, error: GridcommError) -> int:
        """Ends every operation awaited on this stream with ``error`` (the watcher declared the
        coordinator lost; see gridcomm._client.inflight): its caller raises that error, and the
        operation is not repeated. Runs on the loop; returns how many it ended."""
        ended = 0
        for op_id in list(self._waiters):
            waiter = self._waiters.pop(op_id, None)
            if waiter is not None:
                waiter.error = error
                waiter.wake()
                ended += 1
        return ended

    async def close(self) -> None:
        """Ends the stream (the client closes the channel it runs on)."""
        self._closed = True
        # Why: an operation still queued or in flight (a thread of a client that another thread
        # closed) is told now, not at its deadline; it repeats as a unary call, which a closed
        # client refuses.
        self._fall_back(list(self._waiters), "was closed")
        self._outbox, self._sent = pb.SessionRequest(), {}
        call, self._call = self._call, None
        if self._has_work is not None:
            self._has_work.set()  # ends the writer
        tasks, self._tasks = self._tasks, ()
        try:
            if call is not None:
                try:
                    await asyncio.wait_for(call.done_writing(), 1.0)
                except (Exception, asyncio.CancelledError):  # noqa: BLE001 - closing anyway
                    pass
                call.cancel()
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=1.0)
        finally:
            # Why: a cancelled task's traceback refers back to this session and its call; drop
            # the references so nothing keeps the call (and its channel) alive until a GC pass.
            self._has_work = None


def _outcome(waiter: _Waiter | _LoopWaiter, kind: str) -> Any:
    if waiter.error is not None:
        raise Abandoned(waiter.error)
    if waiter.broken is not None:
        raise StreamBroken(waiter.broken)
    result = waiter.result
    assert result is not None
    if result.code:
        raise OpError(_CODES.get(result.code, grpc.StatusCode.UNKNOWN), result.details,
                      tuple((m.key, m.value) for m in result.metadata))
    return getattr(result, kind)


def _why(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return repr(exc)
