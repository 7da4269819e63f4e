"""Session streams: the coordinator calls that wait (join, get, barrier) and the small ones (set,
leave), carried over one long-lived gRPC stream instead of one unary call each.

Why: on the coordinator a unary call costs a few hundred microseconds of Python in gRPC's asyncio
layer before our handler runs; one message on an open stream costs a small fraction of that, and
operations that arrive together travel as one message. By default every client of a process that
dials the same coordinator with the same credentials shares one stream (GRIDCOMM_SESSION=process);
``client`` gives each client its own stream and ``off`` uses the unary RPCs only.

Groups: when several clients of a stream make the same barrier arrival or the same get, they
travel as one operation (``SessionOp.also`` lists the other callers) and one result answers them
all, so the coordinator waits once and writes once per process instead of once per rank. A
whole-job barrier is held up to HOLD_BARRIER_S, a get up to HOLD_GET_S, for the stream's other
users to join it (sent at once when they all have, or when every one of them is waiting for
some operation).
Groups go only to a coordinator that advertises them in the stream's initial metadata.

The stream lives on the process-wide background loop (:mod:`gridcomm._eventloop`): no thread per
client. A calling thread queues its operation and waits, bounded, for its result. Every operation
is idempotent (barrier arrivals carry a sequence number, joins an incarnation), so when the stream
breaks the client repeats the operation as a unary call; when no answer comes in time the caller
sees what a unary call's deadline would have given it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import operator
import os
import threading
from collections.abc import Iterable
from typing import Any

import grpc

from gridcomm import _config, _eventloop
from gridcomm._channel import make_aio_channel
from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._proto import coordinator_pb2_grpc as pb_grpc
from gridcomm._server import SESSION_FEATURES_KEY

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


class Deferred(tuple):  # type: ignore[type-arg]
    """A get's or barrier's fields, made into its protobuf request only where one is sent: by
    an operation alone or the lead of a group, or by a unary repeat. The other members of a
    group need only their caller and wait. Why: building a request message on every rank's
    thread, only for the loop thread to copy and free it, cost the ranks of a process a tenth of
    their time per barrier (16 ranks a process). Why a tuple: made on every rank's thread,
    where under load each Python frame costs several times its time alone; a tuple is made in
    C (its fields are read on the loop thread, through C getters too). Made as
    ``Deferred((message class, caller, wait_s, fields))``."""

    __slots__ = ()

    #: What the loop reads of a group member (build() unpacks the rest).
    caller = property(operator.itemgetter(1))
    wait_s = property(operator.itemgetter(2))

    def build(self) -> Any:
        message, caller, wait_s, fields = self
        return message(caller=caller, wait_s=wait_s, **fields)


def built(request: Any) -> Any:
    """The protobuf request (``request`` itself unless it is Deferred)."""
    return request.build() if type(request) is Deferred else request


class StreamBroken(Exception):
    """The stream ended (or cannot be used) before the operation was answered; its outcome is
    unknown and the caller repeats it as a unary call."""


class _Waiter:
    """One caller waiting for one result: a lock taken at creation (by Session.call) and
    released by the loop (cheaper than an Event, whose Condition costs more per wake-up). Why
    no __init__: one is made per operation on the caller's thread, and a class whose __init__
    is Python code costs a frame to make; the fields the loop may never set read the class's
    defaults instead."""

    lock: threading.Lock
    result: pb.SessionResult | None = None
    broken: str | None = None
    #: The waiters this one wakes once it runs (see _wake_tree).
    next: list[_Waiter] | None = None

    def wake(self) -> None:
        try:
            self.lock.release()
        except RuntimeError:
            pass  # woken twice: a waiter interrupted while passing its wake-up on (see Session.call)

    def pass_on(self) -> None:
        """Wakes the waiters this one was to wake (see _wake_tree); harmless if repeated."""
        for following in self.next or ():
            following.wake()


#: How many waiters each woken waiter wakes in turn (see _wake_tree).
_FANOUT = 2

#: How long a group of a stream with several users waits for the rest of them (see _drain). A
#: whole-job barrier cannot complete before the last of its ranks arrives anyway, so holding the
#: early arrivals of a process costs it nothing; a get may be made by one rank only, so it waits
#: less.
HOLD_BARRIER_S = 0.02
HOLD_GET_S = 0.002


def _wake_tree(waiters: list[_Waiter]) -> None:
    """Wakes the waiters of one reply as a tree: the loop wakes the first, each waiter wakes the
    next _FANOUT once it runs. Why: hundreds of threads woken at once fight over the GIL (at
    8,192 ranks as 32 processes x 256 threads, a barrier cost 2.0 s woken all at once, 0.74 s
    with a fan-out of 4, 1.1 s with a plain chain; at 2,048 ranks 110 ms, 95 ms and 180 ms).
    Once groups came, a fan-out of 2 beat 4 at 256 and 512 threads per process (8,192 ranks
    351 vs 414-455 ms per barrier, 16,384 ranks 2.08-2.15 s vs 2.54-2.59 s) and tied at 16-64."""
    n = len(waiters)
    for i, waiter in enumerate(waiters):
        first = _FANOUT * i + 1
        if first < n:
            waiter.next = waiters[first : first + _FANOUT]
    if waiters:
        waiters[0].wake()


class Session:
    """One Session stream to one coordinator. ``call`` runs on any thread but the loop's; the
    rest runs on the loop."""

    def __init__(self, key: tuple[Any, ...], target: str, tls: _config.TlsFiles | None,
                 metadata: tuple[tuple[str, str], ...]) -> None:
        self._key = key
        self._target = target
        self._tls = tls
        self._metadata = metadata
        self._loop = _eventloop.loop()
        self._ids = itertools.count(1)
        self._waiters: dict[int, _Waiter] = {}
        #: Operations queued by calling threads (id, kind, request, group key, hold seconds),
        #: moved to the outbox on the loop.
        self._inbox: collections.deque[tuple[int, str, Any, Any, float]] = collections.deque()
        self._drain_pending = False
        self.users = 0
        #: Set when the coordinator does not serve Session (an older one): unary calls only.
        self.unsupported: str | None = None
        # Loop-thread state.
        #: The next message to write. Why a message, not a list of ops: the ops (a group's 16
        #: callers, say) are made in place, not copied once more into the request at the write.
        self._outbox = pb.SessionRequest()
        #: The outbox's groups by key (see _drain): (lead op, its request); whether this
        #: stream's coordinator takes them.
        self._groups: dict[Any, tuple[pb.SessionOp, Any]] = {}
        self._grouping = False
        #: The pending hold: its timer, when it ends, and how long it was (read by calling
        #: threads to decide whether to wake the loop).
        self._hold: asyncio.TimerHandle | None = None
        self._hold_due = 0.0
        self._hold_s = 0.0
        #: Whether a calling thread keeps a hold's time instead of the loop (see call), and how
        #: many drains have taken the inbox (tells that thread whether its hold was taken over).
        self._kept = False
        self._drains = 0
        self._channel: grpc.aio.Channel | None = None
        self._call: Any = None
        self._has_work: asyncio.Event | None = None
        self._sent: set[int] = set()
        self._tasks: tuple[asyncio.Task[None], ...] = ()
        #: Whether the current stream got any reply; streams refused in a row without one.
        self._replied = False
        self._refusals = 0
        #: Set by close(): nothing reopens the stream (what is still queued falls back to unary).
        self._closed = False

    # ------------------------------------------------------------------ calling threads
    def call(self, kind: str, request: Any, timeout_s: float, group: Any = None, hold: float = 0.0) -> Any:
        """Runs one operation; returns the unary RPC's response message. Raises :class:`OpError`
        (the operation's status, or DEADLINE_EXCEEDED when no answer came within ``timeout_s``)
        or :class:`StreamBroken`. Operations with the same ``group`` key (a get or barrier
        whose fields, but the caller's and wait_s, are the key) may travel as one; ``hold``: how
        long it may wait for the other clients of this stream to make it too (an operation that
        every client usually makes: a whole-job barrier, a rendezvous get; see _drain)."""
        if self.unsupported is not None:
            raise StreamBroken(self.unsupported)
        if threading.get_ident() == _eventloop._thread_id and _eventloop.on_loop_thread():
            raise StreamBroken("called on the background loop's own thread, which cannot wait for itself")
        op_id = next(self._ids)
        waiter = _Waiter()
        waiter.lock = lock = threading.Lock()
        lock.acquire()
        self._waiters[op_id] = waiter
        self._inbox.append((op_id, kind, request, group, hold))
        # Why the flag: one wake-up of the loop (a write to its self-pipe) for every batch of
        # operations that arrive together, not one per operation. While a hold is pending, an
        # operation that may wait as long does not wake the loop unless it can complete the
        # held groups: the hold's end takes it (the loop re-checks the inbox whenever a hold
        # ends, so an operation queued as it ends is not left behind). It can once every user of
        # the stream is waiting for something (see _drain).
        keep = 0.0
        kept_at = 0
        if not self._drain_pending and not (hold and (self._hold is not None or self._kept) and hold >= self._hold_s
                                            and len(self._waiters) < self.users):
            if (hold and group is not None and self._grouping and self.users >= 2 and self._hold is None
                    and not self._kept and timeout_s > hold):
                # Why: the first operation of a hold would wake the loop only to start a timer
                # (a third of the loop's work per barrier at 16 ranks a process); this thread
                # keeps the hold's time instead, and wakes the loop only if it runs out before
                # the last operation of the group wakes it.
                self._kept, self._hold_s, keep, kept_at = True, hold, hold, self._drains
            else:
                self._wake_loop(op_id)
        try:
            acquired = False
            if keep:
                try:
                    acquired = lock.acquire(timeout=keep)
                finally:
                    # The hold ran out, or this wait was interrupted, before any drain took the
                    # held operations: the loop sends them now.
                    if not acquired and kept_at == self._drains and not self._drain_pending:
                        self._wake_loop(op_id, force=True)
                timeout_s -= keep
            if not acquired and not lock.acquire(True, timeout_s if timeout_s > 0.0 else 0.0):
                if self._waiters.pop(op_id, None) is not None:
                    raise OpError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
                # The loop took this waiter at the same moment: its wake-up (and the chain
                # behind it) is on the way.
                lock.acquire()
        except (OpError, StreamBroken):
            raise  # this waiter was taken back before the loop took it: nothing to pass on
        except BaseException:
            # Interrupted (a signal handler raised on the main thread: KeyboardInterrupt). A
            # waiter the loop already took is part of a wake-up tree, and the waiters below it
            # would wait for this thread forever: the loop passes the wake-up on instead (after
            # the step that built the tree, which already ran).
            if self._waiters.pop(op_id, None) is None:
                with contextlib.suppress(RuntimeError):  # the loop is closed (interpreter exit)
                    self._loop.call_soon_threadsafe(waiter.pass_on)
            raise
        following = waiter.next
        if following:  # waiter.pass_on(), written out: this runs on every rank's thread
            for other in following:
                try:
                    other.lock.release()
                except RuntimeError:
                    pass  # woken twice (see _Waiter.wake)
        if waiter.broken is not None:
            raise StreamBroken(waiter.broken)
        result = waiter.result
        assert result is not None
        if result.code:
            raise OpError(_CODES.get(result.code, grpc.StatusCode.UNKNOWN), result.details,
                          tuple((m.key, m.value) for m in result.metadata))
        return getattr(result, kind)

    def _wake_loop(self, op_id: int, force: bool = False) -> None:
        """Schedules a drain of the inbox (``force``: send what is held too)."""
        self._drain_pending = True
        try:
            self._loop.call_soon_threadsafe(self._drain, force)
        except RuntimeError as exc:  # the loop is closed (interpreter exit)
            self._waiters.pop(op_id, None)
            raise StreamBroken(f"the background loop is closed: {exc}") from exc

    # ------------------------------------------------------------------ loop thread
    def _drain(self, force: bool = False) -> None:
        self._drain_pending = False  # before taking: an op queued from now on schedules a drain
        self._kept = False  # a thread keeping a hold leaves it to this drain
        self._drains += 1
        inbox, outbox = self._inbox, self._outbox
        if not inbox:
            if force:
                self._send()
            return
        if self._closed:
            # A client closed while another thread of it was queuing: no new stream for a
            # session nobody holds any more; the callers repeat as unary calls (and see the close).
            self._fall_back([item[0] for item in inbox], "was closed")
            inbox.clear()
            return
        if self._call is None:
            self._open()
        # Why groups: the ranks of one process arriving at the same barrier (or getting the same
        # key) cost the coordinator one wait and one result instead of one each, and this
        # process one result to read. Only ops not yet written join a group.
        groups = self._groups if self._grouping else None
        users = self.users
        urgent = force or groups is None or users < 2
        shortest = HOLD_BARRIER_S
        while inbox:
            op_id, kind, request, group, hold = inbox.popleft()
            if not hold or group is None:
                urgent = True
            elif hold < shortest:
                shortest = hold
            if group is not None and groups is not None:
                lead = groups.get(group)
                if lead is not None:
                    lead_op, lead_request = lead
                    lead_op.also.add(id=op_id, caller=request.caller)
                    # The group is answered at its earliest deadline; a member with time left
                    # asks again, as after any slice of a long poll.
                    if request.wait_s < lead_request.wait_s:
                        lead_request.wait_s = request.wait_s
                    continue
            try:
                message = built(request)
            except Exception as exc:  # noqa: BLE001 - its caller's unary repeat builds it again and sees why
                self._fall_back([op_id], f"could not carry the operation ({exc!r})")
                continue
            op = outbox.ops.add(id=op_id, **{kind: message})
            if group is not None and groups is not None:
                groups[group] = (op, getattr(op, kind))
        # Why hold: the ranks of a process reach a barrier one after another (each needs the
        # GIL), so sending at once splits them over several messages, each costing both sides a
        # gRPC read and write. A group that every user usually joins waits (see HOLD_BARRIER_S)
        # until every user of this stream has joined it; any other operation (or a group that
        # every user has joined) sends the whole outbox at once. So does a hold once every user
        # is waiting for an operation: nobody is left to join it. Why: when a hold ran out with
        # part of a process's ranks (they reached a get or barrier over more than the hold, as
        # after a start signal), the rest form a group that can never be complete, and the last
        # rank of the process, the one a barrier waits for, waited out a second hold.
        if not urgent:
            assert groups is not None
            sizes = [len(lead_op.also) + 1 for lead_op, _ in groups.values()]  # empty: every held operation fell back
            urgent = not sizes or min(sizes) >= users or len(self._waiters) >= users
        if urgent:
            self._send()
            return
        due = self._loop.time() + shortest
        if self._hold is None or due < self._hold_due:
            if self._hold is not None:
                self._hold.cancel()
            self._hold = self._loop.call_at(due, self._hold_ended)
            self._hold_due, self._hold_s = due, shortest

    def _hold_ended(self) -> None:
        self._hold = None
        self._drain(force=True)

    def _send(self) -> None:
        if self._hold is not None:
            self._hold.cancel()
            self._hold = None
        if self._has_work is not None:
            self._has_work.set()
        if self._inbox and not self._drain_pending:
            # An operation queued while this hold ended may have relied on it (see call).
            self._drain_pending = True
            self._loop.call_soon(self._drain)

    def _open(self) -> None:
        if self._channel is None:
            self._channel = make_aio_channel(self._target, self._tls)
        # Why wait_for_ready: a coordinator that is not up yet (or a name that does not resolve
        # yet) is waited for; each operation's own timeout bounds the wait.
        call = pb_grpc.CoordinatorStub(self._channel).Session(metadata=self._metadata, wait_for_ready=True)
        self._call = call
        self._has_work = has_work = asyncio.Event()
        self._sent = set()
        self._replied = False
        self._grouping = False  # until this stream's coordinator says it takes groups
        self._groups = {}
        # Why kept: the loop holds tasks weakly; an unreferenced pending task can be collected.
        self._tasks = (asyncio.ensure_future(self._write(call, has_work)), asyncio.ensure_future(self._read(call)))

    async def _write(self, call: Any, has_work: asyncio.Event) -> None:
        try:
            while self._call is call:
                await has_work.wait()
                has_work.clear()
                batch, self._outbox = self._outbox, pb.SessionRequest()
                self._groups = {}
                if batch.ops:
                    self._sent.update(_ids(batch))
                    await call.write(batch)
        except asyncio.CancelledError:
            self._broken(call, "cancelled")
            raise
        except Exception as exc:  # noqa: BLE001 - every error ends this stream; ops fall back
            self._broken(call, await self._status(call, _why(exc)))

    async def _status(self, call: Any, fallback: str) -> str:
        """The call's final status, waited for briefly. Why: a write that fails because the
        coordinator refused the stream (UNIMPLEMENTED on an older one) reports only a generic
        error; the status tells an older coordinator from a broken connection."""
        try:
            code = await asyncio.wait_for(call.code(), 1.0)
            details = await asyncio.wait_for(call.details(), 1.0)
        except Exception:  # noqa: BLE001 - no status in time: keep what the failure said
            return fallback
        if code is grpc.StatusCode.UNIMPLEMENTED:
            self.unsupported = f"the coordinator at {self._target} does not serve Session streams"
        elif code is grpc.StatusCode.INTERNAL and not self._replied:
            # Why: a write racing an UNIMPLEMENTED answer can turn it into INTERNAL on this side;
            # a coordinator that refuses two streams in a row without a single reply is taken
            # not to serve them (a stream that got replies resets the count).
            self._refusals += 1
            if self._refusals >= 2:
                self.unsupported = (f"the coordinator at {self._target} ended two Session streams without a reply "
                                    f"({code.name}: {details})")
        return f"{code.name}: {details}"

    async def _read(self, call: Any) -> None:
        why = "the coordinator ended the stream"
        try:
            metadata = await call.initial_metadata()
            if self._call is call:
                self._grouping = any(key == SESSION_FEATURES_KEY and "group" in str(value).split(",")
                                     for key, value in metadata or ())
            sent, waiters = self._sent, self._waiters
            async for reply in call:
                if not self._replied:
                    self._replied = True
                    self._refusals = 0
                ready = []
                for result in reply.results:
                    ids = (result.id, *result.also) if result.also else (result.id,)
                    sent.difference_update(ids)  # one call for a group's ids, not one each
                    for op_id in ids:
                        waiter = waiters.pop(op_id, None)
                        if waiter is not None:
                            waiter.result = result
                            ready.append(waiter)
                _wake_tree(ready)
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
        if self._has_work is not None:
            self._has_work.set()  # ends this stream's writer
        lost = set(self._sent)
        lost.update(_ids(self._outbox))
        self._sent, self._outbox, self._groups = set(), pb.SessionRequest(), {}
        self._fall_back(lost, f"ended: {why}")
        if lost:
            # Why not a warning when cancelled: that is this process closing the stream (exit).
            (log.debug if why == "cancelled" else log.warning)("gridcomm: the Session stream to %s ended with %d operations in flight (%s); they are "
                        "repeated as unary calls", self._target, len(lost), why)

    def _fall_back(self, op_ids: Iterable[int], why: str) -> None:
        """The operations ``op_ids`` will not be answered here: their callers repeat them as
        unary calls (StreamBroken), told that the stream ``why``."""
        ready = []
        for op_id in op_ids:
            waiter = self._waiters.pop(op_id, None)
            if waiter is not None:
                waiter.broken = f"the Session stream to {self._target} {why}"
                ready.append(waiter)
        _wake_tree(ready)

    async def close(self) -> None:
        """Ends the stream and closes the channel (its connection goes at once)."""
        self._closed = True
        if self._hold is not None:
            self._hold.cancel()
            self._hold = None
        # Why: an operation still queued or in flight (a thread of a client that another thread
        # closed) is told now, not at its deadline; it repeats as a unary call, which a closed
        # client refuses.
        self._fall_back(list(self._waiters), "was closed")
        self._inbox.clear()
        self._outbox, self._groups, self._sent = pb.SessionRequest(), {}, set()
        call, self._call = self._call, None
        if self._has_work is not None:
            self._has_work.set()  # ends the writer
        tasks, self._tasks = self._tasks, ()
        channel, self._channel = self._channel, None
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
            if channel is not None:
                await channel.close()
            # Why: a cancelled task's traceback refers back to this session and its call; drop
            # the references so nothing keeps the call (and its channel) alive until a GC pass.
            self._has_work = None


def _ids(request: pb.SessionRequest) -> list[int]:
    """Every operation id a request carries, group members included."""
    return [op_id for op in request.ops for op_id in (op.id, *(member.id for member in op.also))]


def _why(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return repr(exc)


_lock = threading.Lock()
_sessions: dict[tuple[Any, ...], Session] = {}


def acquire(target: str, tls: _config.TlsFiles | None, metadata: tuple[tuple[str, str], ...],
            owner: object | None = None) -> Session:
    """The Session for this coordinator and credentials (shared by the process's clients, or
    ``owner``'s own); pair with :func:`release`."""
    key: tuple[Any, ...] = (os.getpid(), target, tls, metadata,
                            id(owner) if owner is not None else None)
    with _lock:
        session = _sessions.get(key)
        if session is None:
            session = _sessions[key] = Session(key, target, tls, metadata)
        session.users += 1
        return session


def release(session: Session) -> None:
    """Drops one user; the last one closes the stream and its channel."""
    with _lock:
        session.users -= 1
        if session.users > 0:
            return
        if _sessions.get(session._key) is session:
            del _sessions[session._key]
    running = _eventloop.current()
    if running is not None:
        try:
            asyncio.run_coroutine_threadsafe(session.close(), running)
        except RuntimeError:
            pass  # the loop closed meanwhile (interpreter exit)
