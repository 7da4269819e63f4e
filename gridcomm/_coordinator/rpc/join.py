"""Join: the rendezvous, a relay's aggregate of first joins, the directed join's first contacts
(:mod:`gridcomm._coordinator.tree`), a replacement for a rank whose process still looks alive, and
a recovery's wait. The decisions are the state's (:mod:`gridcomm._coordinator.state.membership`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import grpc

from gridcomm._coordinator.answers import Abort, bounded
from gridcomm._coordinator.rpc.base import Operations, log
from gridcomm._coordinator.state import REBUILD, SHRINK, StateError, process_tag
from gridcomm._coordinator.tree import Tree, address_problem
from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._wire import MISSING_KEY, WIRE, ranks_text, shown_generation, wire_refusal

#: JoinRequest.recovery -> the state's recovery mode.
_MODES: dict[int, str | None] = {pb.RECOVERY_NONE: None, pb.RECOVERY_REBUILD: REBUILD, pb.RECOVERY_SHRINK: SHRINK}


class JoinOps(Operations):
    """Join and what it waits for."""

    #: The answer of a join slice that ended before the rendezvous completed (see _join_wait_answer).
    _missing_answer: tuple[Any, str, tuple[tuple[str, str], ...]] | None
    #: The relay tree: rank -> (incarnation, HOST:PORT) of the relay its process hosts.
    _relays: dict[int, tuple[int, str]]
    #: The tree's groups and leaders, for the directed join (first contacts).
    _tree: Tree

    async def join_aggregate(self, request: pb.JoinRequest, aggregate: pb.Aggregate) -> tuple[pb.JoinResponse, None]:
        """A relay's aggregate: the same first join by the other ranks ``aggregate`` names."""
        return await self.join(request, None, aggregate), None

    async def join(self, request: pb.JoinRequest, deadline: float | None,
                   aggregate: pb.Aggregate | None = None) -> pb.JoinResponse:
        problem = wire_refusal(request.wire)
        if problem is not None:
            # Why first: another wire form may mean other things by the same fields.
            self.metrics.join_refused(request.rank, request.hostname, "FAILED_PRECONDITION", problem)
            raise Abort(grpc.StatusCode.FAILED_PRECONDITION, f"join of rank {request.rank} refused: {problem}")
        response = await self._join(request, deadline, aggregate)
        response.wire = WIRE
        return response

    async def _join(self, request: pb.JoinRequest, deadline: float | None,
                    aggregate: pb.Aggregate | None) -> pb.JoinResponse:
        state = self._state
        if request.first_contact:
            return await self._first_contact(request, deadline)
        self.metrics.messages["join"] += 1
        if aggregate is not None and (aggregate.ranks or aggregate.lost):
            return await self._join_aggregate(request, aggregate, deadline)
        self.metrics.ops["join"] += 1
        if request.recovery not in _MODES:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"join of rank {request.rank}: unknown recovery "
                        f"{request.recovery}.")
        mode = _MODES[request.recovery]
        base = request.generation
        address = request.relay_address
        if address and (problem := address_problem(address)) is not None:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"join of rank {request.rank}: {problem}")
        completed = await self._enter(request, base, mode, deadline)
        if address:
            self._relays[request.rank] = (request.incarnation, address)
        self._tree.leader_news(request.rank)
        if not completed and state.refuses_waiting_replacements():
            self._wake(("join",))  # replacements that wait learn that they are not admitted
        if completed:
            self._formed()
        answer = state.join_answer(request.rank, request.incarnation, base)
        if answer == "joined":
            self._lost.heard(request.rank)  # joined: the stream that carried its join carries the process
            return self._joined(request)
        if answer == "recovery":
            return await self._await_recovery(request, base, deadline)
        member = state.members[request.rank]
        with self._abandoned_if_cancelled(request):
            ok = await self._wait(("join",), lambda: state.complete, request.wait_s, deadline,
                                  f"join of rank {request.rank}", member=member)
        if not state.is_current(member):
            raise Abort(grpc.StatusCode.ABORTED, f"rank {request.rank} was replaced by a newer process while joining.")
        if not ok:
            raise Abort(grpc.StatusCode.DEADLINE_EXCEEDED, *self._join_wait_answer())
        self._lost.heard(request.rank)
        return self._joined(request)

    async def _join_aggregate(self, request: pb.JoinRequest, aggregate: pb.Aggregate,
                              deadline: float | None) -> pb.JoinResponse:
        """A relay's aggregate of first joins (``SessionOp.aggregate``): each rank is registered as
        its own join would register it, and one wait and one answer serve them all. What only a
        join of its own handles (a rank whose previous process still looks alive, a process admitted into a
        running job, a rank replaced while it waits, a refusal) is answered with a status that
        makes the relay repeat each join alone: every rank then gets its own join's answer.
        Registering is idempotent (a process's join repeated is the same join), so what this one
        registered before it stopped stands."""
        state = self._state
        joiners = [(request.rank, request.incarnation, request.hostname)]
        joiners.extend((j.rank, j.incarnation, j.hostname) for j in aggregate.ranks)
        what = f"an aggregated join of {len(joiners)} ranks (rank {request.rank} first)"
        if aggregate.lost:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"{what} names lost ranks (only a relay's heartbeat does).")
        problem = self._tree.aggregate_problem([rank for rank, _, _ in joiners])
        if problem is not None:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"{what} is refused: {problem}.")
        if len(joiners) > max(1, state.world_size):
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"{what} names more ranks than the job's {state.world_size}.")
        if request.generation or request.recovery != pb.RECOVERY_NONE or request.relay_address:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: only a first join (generation 0, no recovery, no "
                        "relay address) is aggregated; send the others alone.")
        self.metrics.ops["join"] += len(joiners)
        now = self._now()
        completed = False
        for rank, incarnation, hostname in joiners:
            try:
                completed = state.join(request.job_id, rank, request.world_size, incarnation, hostname, now) or completed
            except StateError as exc:
                # Why not its own status: a DEADLINE_EXCEEDED would reach every rank of the
                # aggregate as theirs; FAILED_PRECONDITION makes the relay repeat each alone.
                raise Abort(grpc.StatusCode.FAILED_PRECONDITION,
                            f"{what}: rank {rank}'s join is refused ({exc.message}); join each alone.") from None
        if completed:
            self._formed()
        answers = {state.join_answer(rank, incarnation, 0) for rank, incarnation, _ in joiners}
        if answers - {"joined", "rendezvous"} or len(answers) > 1:
            raise Abort(grpc.StatusCode.FAILED_PRECONDITION, f"{what}: a rank of it is admitted into a running job; "
                        "join each alone.")
        members = [state.members[rank] for rank, _, _ in joiners]
        if answers == {"rendezvous"}:
            for member in members:
                state.call_started(member)  # each waits, as its own join would (not taken for a dead joiner)
            try:
                ok = await self._wait(("join",), lambda: state.complete, request.wait_s, deadline, what)
            except asyncio.CancelledError:
                for rank, incarnation, _ in joiners:
                    state.join_abandoned(rank, incarnation, self._now())  # its relay's stream dropped
                raise
            finally:
                ended = self._now()
                for member in members:
                    state.call_ended(member, ended)
            if not all(state.is_current(member) for member in members):
                raise Abort(grpc.StatusCode.FAILED_PRECONDITION, f"{what}: a rank of it was replaced by a newer "
                            "process while joining; join each alone.")
            if not ok:
                raise Abort(grpc.StatusCode.DEADLINE_EXCEEDED, *self._join_wait_answer())
        answered, lag = self._now(), self.lag.total_s
        for member in members:
            state.answered(member, answered, lag)
        self._lost.heard_relayed([member.rank for member in members])  # joined, through this stream
        return self._response(request)

    def _formed(self) -> None:
        """A join completed the rendezvous or a recovery: says so and wakes every waiting join."""
        state = self._state
        if state.generation == 1:
            log.info("coordinator: all %d ranks joined; generation %d", state.world_size,
                     shown_generation(state.generation))
        else:
            log.warning("coordinator: generation %d formed by %s(): ranks %s", shown_generation(state.generation),
                        state.recovered_from[1], bounded(list(state.active)))
            self.metrics.recovered(state.generation)
            self._owner.set_serving(True)
        self._wake(("join",))

    def _join_wait_answer(self) -> tuple[str, tuple[tuple[str, str], ...]]:
        """What a join slice that ends before the rendezvous completes answers: who is missing.
        Why cached until the next arrival: every waiting rank's slice ends with it, so built afresh
        it was O(world size) per answer, O(world size^2) per round of slices (8,192 ranks waiting
        out a 40 s connect storm spent the coordinator's loop on it)."""
        state = self._state
        key = (state.member_changes, state.generation, len(state.failures), sum(self.metrics.join_refusals.values()))
        cached = self._missing_answer
        if cached is None or cached[0] != key:
            missing = state.missing_join()
            text = (f"{len(missing)} of {state.world_size} ranks have not joined: {bounded(missing)}"
                    + self.metrics.refusal_note(missing))  # a missing rank that was refused says why
            cached = self._missing_answer = (key, text, ((MISSING_KEY, ranks_text(missing)),))
        return cached[1], cached[2]

    async def _first_contact(self, request: pb.JoinRequest, deadline: float | None) -> pb.JoinResponse:
        """A rank of the tree asks where to join: answered at once, or once its leader asks or
        joins, at most its hold later (see gridcomm._coordinator.tree)."""
        state = self._state

        def answer() -> tuple[str, pb.JoinResponse]:
            return self._tree.first_contact(
                request, job_id=state.job_id, formed=state.generation > 0 or state.complete,
                relay_at=self._relay_at, leader_joined=state.members.__contains__, now=self._now())

        kind, response = answer()
        if kind == "retry":
            hold = self._tree.hold_s
            left = hold if deadline is None else min(hold, deadline - self._loop.time() - 0.5)
            if left > 0:
                self.metrics.first_contacts["held"] += 1
                await self._tree.hold(response.leader, left)
                kind, response = answer()
        self.metrics.first_contacts[kind] += 1
        return response

    def _relay_of(self, request: pb.JoinRequest) -> str:
        """Where the relay of a joining rank's group is ('' when it has none: dial the coordinator)."""
        host = request.relay_rank
        if not request.wants_relay or host == request.rank or not 0 <= host < self._state.world_size:
            return ""
        return self._relay_at(host)

    def _relay_at(self, host: int) -> str:
        """Where the relay rank ``host``'s process registered listens ('' if none, or gone)."""
        entry = self._relays.get(host)
        member = self._state.members.get(host)
        if entry is None or member is None or member.incarnation != entry[0] or self._state.gone(member):
            return ""
        return entry[1]

    def _joined(self, request: pb.JoinRequest) -> pb.JoinResponse:
        state = self._state
        member = state.members.get(request.rank)
        if member is not None:
            state.answered(member, self._now(), self.lag.total_s)
        return self._response(request)

    def _response(self, request: pb.JoinRequest) -> pb.JoinResponse:
        state = self._state
        # Members are not sent: O(world size) per join is O(world size^2) per rendezvous; Status
        # lists them for who needs them. A shrunk generation names its job ranks.
        active = state.active
        return pb.JoinResponse(generation=state.generation, world_size=state.world_size,
                               heartbeat_timeout_s=self._owner.heartbeat_timeout_s,
                               member_ranks=active if len(active) < state.world_size else (),
                               relay_address=self._relay_of(request))

    async def _enter(self, request: pb.JoinRequest, base: int, mode: str | None, deadline: float | None) -> bool:
        """Registers the join with the state. A new process for a rank whose predecessor still
        looks alive waits (bounded by the call) for the coordinator to mark it failed, which it
        does within the liveness bound if that process is in fact gone (a pod restarted fast)."""
        while True:
            try:
                return self._state.join(request.job_id, request.rank, request.world_size, request.incarnation,
                                        request.hostname, self._now(), base=base, mode=mode)
            except StateError as exc:
                if exc.predecessor_alive and await self._predecessor_gone(request, deadline):
                    continue
                # Kept for status and the waiting ranks' messages, and logged (an operator reads who was refused and why).
                self.metrics.join_refused(request.rank, request.hostname, exc.code, exc.message)
                raise

    async def _predecessor_gone(self, request: pb.JoinRequest, deadline: float | None) -> bool:
        """A new process asks for a rank whose process the coordinator still counts alive: True
        once that one is marked failed (then the join is tried again); raises the refusal when it
        heartbeats after this join came (it is alive: a second process for a rank), or, when
        neither happened within the call, a wait answer the client's long poll repeats."""
        state = self._state
        old = state.members[request.rank]
        since = self._now()

        if await self._wait(("beat", old.rank), lambda: state.predecessor_settled(old, since), request.wait_s,
                            deadline, f"join of rank {request.rank}", fail_fast=False):
            return state.gone(old)  # else it heartbeat: alive, and the caller raises the refusal
        raise Abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"rank {request.rank}'s previous process (process {process_tag(old.incarnation)} on {old.hostname or '?'}) "
                    f"has not been heard from since this one came; waiting for the coordinator to mark it failed "
                    f"(liveness bound {self._owner.heartbeat_timeout_s:g} s)", ((MISSING_KEY, ranks_text([request.rank])),))

    @contextlib.contextmanager
    def _abandoned_if_cancelled(self, request: pb.JoinRequest) -> Iterator[None]:
        """A join whose call is cancelled while it waits (its process died: the connection
        dropped) stops counting a process that is not yet in a generation (see
        JobState.join_abandoned): a replacement killed while it waits is not admitted."""
        try:
            yield
        except asyncio.CancelledError:
            if self._state.join_abandoned(request.rank, request.incarnation, self._now()):
                (log.warning if self._state.complete else log.info)(
                    "coordinator: rank %d's join (process %s) ended before its generation formed; it is not counted",
                    request.rank, process_tag(request.incarnation))
            raise

    async def _await_recovery(self, request: pb.JoinRequest, base: int, deadline: float | None) -> pb.JoinResponse:
        """Waits until the generation this join entered has formed (a recovery completes), or a
        failure during it, or the bounded wait ends (then the ranks still awaited are named)."""
        state = self._state
        rank, incarnation = request.rank, request.incarnation
        base = base or state.generation
        with self._abandoned_if_cancelled(request):
            ok = await self._wait(("join",), lambda: state.recovery_check(rank, incarnation, base), request.wait_s,
                                  deadline, f"recovery of generation {shown_generation(base)}", fail_fast=False,
                                  member=state.recovery_waiter(rank, incarnation))
        if not ok:
            missing = state.missing_join()
            raise Abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"the recovery of generation {shown_generation(base)} waits for {len(missing)} rank(s): {bounded(missing)} "
                        "(survivors that have not called it, or failed ranks without a replacement)",
                        ((MISSING_KEY, ranks_text(missing)),))
        return self._joined(request)
