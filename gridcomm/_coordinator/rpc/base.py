"""What every operation of the coordinator shares: the caller's checks, the bounded waits and
their wakes, the charge of a Session operation, and how a failure is recorded.

:class:`Operations` is the base of each RPC family's mixin (:mod:`gridcomm._coordinator.rpc`);
:class:`~gridcomm._coordinator.servicer.Servicer` combines them. A waiting operation costs a
future, never a thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import grpc

from gridcomm._coordinator.answers import Abort, RefusalLog
from gridcomm._coordinator.metrics import CoordinatorMetrics
from gridcomm._coordinator.relay_lost import RelayLosses
from gridcomm._coordinator.state import RESOURCE_EXHAUSTED, JobState, Member, StateError
from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._runtime.guard import token_problem
from gridcomm._runtime.lag import LagMeter

#: The logger of every operation (each RPC family's module logs here): the name operators and
#: their log configurations know the coordinator's operations by.
log = logging.getLogger("gridcomm._coordinator.servicer")

#: Margin kept between the server's answer and the caller's gRPC deadline, so a timed-out wait
#: reaches the caller as our structured answer rather than as the transport's DEADLINE_EXCEEDED.
ANSWER_MARGIN_S = 0.25


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Owner(Protocol):
    """What the operations read of the server that runs them (gridcomm._coordinator.server.Coordinator)."""

    state: JobState
    heartbeat_timeout_s: float
    stall_timeout_s: float
    max_wait_s: float
    connection_grace_s: float
    metrics: CoordinatorMetrics
    #: Ranks per group of the relay tree (the directed join's groups), and whether it was set
    #: (GRIDCOMM_RELAY_FANIN) rather than derived from the world size.
    relay_fanin: int
    relay_fanin_configured: bool

    @property
    def token(self) -> str | None: ...

    @property
    def closing(self) -> bool: ...

    @property
    def serving(self) -> bool: ...

    def set_serving(self, serving: bool) -> None: ...

    def note_all_left(self) -> None: ...


class Operations:
    """The state, waiters and plumbing of the coordinator's operations (see the module)."""

    def __init__(self, owner: Owner) -> None:
        self._owner = owner
        self._state = owner.state
        self._loop = asyncio.get_running_loop()
        self._waiters: dict[tuple[Any, ...], list[asyncio.Future[None]]] = {}
        self._token = owner.token.encode() if owner.token is not None else None
        self.refusals = RefusalLog()
        self.metrics = owner.metrics
        #: This loop's own lag, which liveness does not count as the ranks' silence.
        self.lag = LagMeter()
        #: (rank, incarnation) -> its Session operations in flight (see admit_op).
        self._in_flight: dict[tuple[int, int], int] = {}
        #: Ranks behind relays whose connection to them dropped (see gridcomm._coordinator.relay_lost).
        self._lost = RelayLosses(self._state, self._loop, self.lag, lambda: owner.connection_grace_s,
                                 lambda: owner.closing, self._fail)

    @property
    def world_size(self) -> int:
        return self._state.world_size

    @property
    def closing(self) -> bool:
        """Whether the coordinator is stopping (a Session stream it cuts has nobody to answer)."""
        return self._owner.closing

    # ------------------------------------------------------------------ plumbing
    def _now(self) -> float:
        return time.monotonic()

    def has_token(self, context: grpc.aio.ServicerContext) -> bool:
        """Whether the call carries the job's token (nothing is noted either way)."""
        return token_problem(context, self._token) is None

    def authenticate(self, context: grpc.aio.ServicerContext, method: str) -> None:
        """Raises Abort(UNAUTHENTICATED) unless the call carries the job's token (on its headers,
        so before any request message is read)."""
        problem = token_problem(context, self._token)
        if problem is not None:
            self.refusals.note(method, context.peer(), problem)
            raise Abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"{method} refused: the token is {problem}; "
                "set the same GRIDCOMM_TOKEN (or GRIDCOMM_TOKEN_FILE) on every rank and the coordinator.",
            )

    def deadline_of(self, context: grpc.aio.ServicerContext) -> float | None:
        """A unary call's deadline on this loop's clock, less the answer margin."""
        remaining = context.time_remaining()
        return None if remaining is None else self._loop.time() + remaining - ANSWER_MARGIN_S

    def _wake(self, key: tuple[Any, ...]) -> None:
        for fut in self._waiters.pop(key, ()):
            if not fut.done():
                fut.set_result(None)

    def wake_all(self) -> None:
        """Every waiter re-checks its condition (after a failure, abort or stop)."""
        waiters, self._waiters = self._waiters, {}
        for futs in waiters.values():
            for fut in futs:
                if not fut.done():
                    fut.set_result(None)

    def admit_op(self, kind: str, request: Any, aggregated: bool = False) -> tuple[int, int] | None:
        """Charges a Session operation to its caller's share of operations in flight, before a
        task is made for it (Limits.max_waits_per_rank): the key to release it by, or None when
        it is not charged (a join, a relay's heartbeat, or a caller the state refuses: the
        operation runs and says why); ``aggregated``: it carries a relay's aggregate. Why here:
        a rank that parks gets of keys nobody sets on many streams made a task for each (131,072
        of them on one connection: +192 MB) before any wait could refuse it."""
        caller = getattr(request, "caller", None)
        if caller is None or (kind == "heartbeat" and aggregated):
            # A relay's heartbeat speaks for all its ranks: charged to one of them, that rank's
            # parked operations would refuse it for the others (the stream's own bound holds it).
            return None
        try:
            member = self._state.check_caller(caller.job_id, caller.rank, caller.incarnation, caller.generation, kind,
                                              any_generation=True)
        except StateError:
            return None
        key = (member.rank, member.incarnation)
        count = self._in_flight.get(key, 0)
        if count >= self._state.limits.max_waits_per_rank:
            raise Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{kind} refused: rank {member.rank} already has {count} "
                        "operations in flight at the coordinator, the limit.")
        self._in_flight[key] = count + 1
        return key

    def release_op(self, key: tuple[int, int]) -> None:
        """An operation admit_op charged has ended."""
        count = self._in_flight.pop(key, 1) - 1
        if count > 0:
            self._in_flight[key] = count

    def _check_waiting(self, what: str, fail_fast: bool = True) -> None:
        """Raises what ends a wait that is not done: a failed job (when ``fail_fast``) or a
        coordinator that is shutting down."""
        if fail_fast:
            self._state.check_not_failed(what)
        if self._owner.closing:
            raise Abort(grpc.StatusCode.UNAVAILABLE, f"{what}: the coordinator is shutting down.")

    async def _wait(self, key: tuple[Any, ...], done: Callable[[], bool], wait_s: float, deadline: float | None,
                    what: str, *, member: Member | None = None, fail_fast: bool = True) -> bool:
        """Waits until ``done()``, a failure (raised when ``fail_fast``), or the bounded wait
        ends; returns ``done()``. ``member``: the rank waiting (counted as having a call in
        flight meanwhile, and seen when the wait ends)."""
        # Why bounded: wait_s comes off the wire; NaN, negative or absurd values must not hang or crash.
        budget = min(wait_s if wait_s == wait_s and wait_s > 0 else 0.0, self._owner.max_wait_s)
        end = self._loop.time() + budget
        if deadline is not None and deadline < end:
            end = deadline
        if member is not None:
            if member.active_calls >= self._state.limits.max_waits_per_rank and not done():
                # Why: each wait holds a future, a task and a call's buffers (~1.5 KB); one rank's
                # gets of keys nobody sets, on many streams, must not grow the coordinator.
                raise StateError(RESOURCE_EXHAUSTED, f"{what} refused: rank {member.rank} already has "
                                 f"{member.active_calls} calls waiting at the coordinator, the limit.")
            self._state.call_started(member)
        try:
            while True:
                # Why done() first: what already completed (a message delivered, a barrier passed)
                # is still handed out after a failure; only waiting is refused.
                if done():
                    return True
                self._check_waiting(what, fail_fast)
                remaining = end - self._loop.time()
                if remaining <= 0:
                    return False
                fut: asyncio.Future[None] = self._loop.create_future()
                futs = self._waiters.setdefault(key, [])
                futs.append(fut)
                timer = self._loop.call_later(remaining, _settle, fut)
                try:
                    await fut
                finally:
                    timer.cancel()
                    if self._waiters.get(key) is futs:
                        # Why: a wake pops the whole list; a list still here means this wait timed
                        # out or was cancelled, so drop the future and keep abandoned waits (a Get
                        # for a key that never comes) from piling up.
                        try:
                            futs.remove(fut)
                        except ValueError:
                            pass
                        if not futs:
                            del self._waiters[key]
        finally:
            if member is not None:
                self._state.call_ended(member, self._now())

    def _caller(self, caller: pb.Caller, what: str, now: float | None = None) -> Member:
        member = self._state.check_caller(caller.job_id, caller.rank, caller.incarnation, caller.generation, what)
        self._state.seen(member, self._now() if now is None else now)
        return member

    def _on_failure(self) -> None:
        self.metrics.rank_failed()  # one call per new failure
        self._owner.set_serving(False)
        self.wake_all()
        self._note_departures()

    def _note_departures(self) -> None:
        """Lets a stop() that waits for every rank to leave (or fail) go on."""
        if self._state.all_left():
            self._owner.note_all_left()

    def _fail(self, rank: int, reason: str, cause: str = "") -> None:
        first = self._state.first_failure()
        failure = self._state.fail(rank, reason, -1, self._now(), cause)
        if failure is not None:
            if first is not None and first.rank != rank and not cause:
                # Why not an error: after a failure the survivors exit or recover, and one that
                # exits without leaving goes silent; the failure was reported once, by its rank.
                log.info("coordinator: %s, after rank %d's failure (it exited or is recovering)", reason, first.rank)
            else:
                log.error("coordinator: %s", reason)
            if cause:
                self.metrics.hangs[cause] += 1
            self._on_failure()

    def _also(self, caller: pb.Caller, aggregate: pb.Aggregate, what: str, now: float | None = None) -> list[int]:
        """Checks the other ranks of a relay's aggregate (each is seen, as its own call would be);
        returns them. They share the caller's job and generation, which its own check covered."""
        others = aggregate.ranks
        if len(others) > self._state.world_size:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"a {what} names {len(others)} other ranks, more than the job's {self._state.world_size}.")
        if aggregate.lost:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"a {what} names lost ranks (only a relay's heartbeat does).")
        return self._state.check_also(caller.job_id, caller.generation, [r.rank for r in others],
                                      [r.incarnation for r in others], what, self._now() if now is None else now)

