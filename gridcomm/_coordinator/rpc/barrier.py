"""Barrier: an arrival (a rank's own, or a relay's aggregate of its ranks'), the wakes of a
completed instance, and the wait. The decisions are the state's
(:mod:`gridcomm._coordinator.state.barriers`).
"""

from __future__ import annotations

import grpc

from gridcomm._coordinator.answers import Abort, bounded
from gridcomm._coordinator.rpc.base import Operations
from gridcomm._coordinator.state import quote
from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._wire import FAILED_KEY, MISSING_KEY, ranks_text


class BarrierOps(Operations):
    """Barrier."""

    async def barrier_aggregate(self, request: pb.BarrierRequest,
                                aggregate: pb.Aggregate) -> tuple[pb.BarrierResponse, None]:
        """A relay's aggregate: the same arrival by the other ranks ``aggregate`` names."""
        return await self.barrier(request, None, aggregate), None

    async def barrier(self, request: pb.BarrierRequest, deadline: float | None,
                      aggregate: pb.Aggregate | None = None) -> pb.BarrierResponse:
        state = self._state
        now = self._now()
        name, seq = request.name, request.seq
        member = self._caller(request.caller, "barrier", now)
        also = self._also(request.caller, aggregate, "barrier", now) if aggregate is not None else ()
        self.metrics.messages["barrier"] += 1
        barrier = state.barriers.get(name)
        # A name the state does not know (new, or dropped after every member passed it) starts
        # at the caller's seq: the instances before it completed long ago, nobody waits there.
        before = barrier.completed if barrier is not None else max(0, seq - 1)
        completed = state.arrive(name, member.rank, seq, now, request.participants)
        if also:  # a relay's aggregate: the same arrival by its other ranks
            completed = state.arrive_many(name, also, seq, now, request.participants)
        barrier = state.barriers[name]
        if completed > before:
            for done_seq in range(before + 1, completed + 1):
                self._wake(("barrier", name, done_seq))
            # Once per completed instance, never per arrival.
            self.metrics.barrier_completed(barrier.last_wait_s, completed - before, len(barrier.members))
        if barrier.completed >= seq:
            return pb.BarrierResponse(seq=seq)
        blocker = state.barrier_blocker(name, seq)
        if blocker is not None:
            raise Abort(grpc.StatusCode.ABORTED,
                        f"barrier {quote(name)} #{seq} cannot complete: rank {blocker.rank} left the job before arriving",
                        ((FAILED_KEY, str(blocker.rank)),))
        if not await self._wait(("barrier", name, seq), lambda: barrier.completed >= seq, request.wait_s, deadline,
                                f"barrier {quote(name)}", member=member):
            missing = state.barrier_missing(name, seq)
            raise Abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"barrier {quote(name)} #{seq}: {len(missing)} of {state.world_size} ranks have not arrived: "
                        f"{bounded(missing)}", ((MISSING_KEY, ranks_text(missing)),))
        return pb.BarrierResponse(seq=seq)
