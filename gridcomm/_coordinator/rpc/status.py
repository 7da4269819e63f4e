"""Status: the job as an operator sees it (members, pending barriers, failures, progress,
stragglers), bounded so the answer stays far below a message's limit at any world size.
"""

from __future__ import annotations

from typing import Any

from gridcomm._coordinator.answers import add_members, failure_pb
from gridcomm._coordinator.rpc.base import Operations
from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._wire import shown_generation

#: Pending barriers a Status answer lists at most (the longest-waiting), and about how many ranks
#: their lists may name in all (or twice the world size, if more).
MAX_STATUS_BARRIERS = 64
MAX_STATUS_BARRIER_RANKS = 65_536


class StatusOps(Operations):
    """Status."""

    async def status(self, request: pb.StatusRequest, deadline: float | None) -> pb.StatusResponse:
        state = self._state
        now = self._now()
        barriers, unlisted = self._barrier_rows(now)
        response = pb.StatusResponse(
            job_id=state.job_id,
            world_size=state.world_size,
            generation=shown_generation(state.generation) if state.generation else None,
            missing_ranks=state.missing_join(),
            barriers=barriers,
            failures=[failure_pb(f) for f in state.failures],
            uptime_s=now - state.started_at,
            serving=self._owner.serving,
            late=state.progress.late_lines(now, self._owner.heartbeat_timeout_s) + unlisted,
            stragglers=[pb.StragglerStatus(rank=s.rank, lag_s=s.lag_s, communicator=s.communicator)
                        for s in state.progress.lag.stragglers()],
        )
        add_members(response.members, sorted(state.members.values(), key=lambda m: m.rank))
        self._add_progress_rows(response.progress, now)
        return response

    def _barrier_rows(self, now: float) -> tuple[list[pb.BarrierStatus], list[str]]:
        """The pending barriers that have waited longest, at most MAX_STATUS_BARRIERS of them and
        about MAX_STATUS_BARRIER_RANKS ranks in all (at least one barrier), and a line saying how
        many more there are. Why capped: each costs O(its members) to list, and a rank may hold
        thousands pending; the whole answer must stay far below the 80 MiB a message may be."""
        state = self._state
        rows: list[pb.BarrierStatus] = []
        ranks = 0
        cap = max(MAX_STATUS_BARRIER_RANKS, 2 * state.world_size)
        for name, seq, arrived, missing, waited in state.pending_barriers(now):
            rows.append(pb.BarrierStatus(name=name, seq=seq, arrived_ranks=arrived, missing_ranks=missing,
                                         waiting_s=waited))
            ranks += len(arrived) + len(missing)
            if len(rows) >= MAX_STATUS_BARRIERS or ranks >= cap:
                break
        more = state.pending_barrier_count - len(rows)
        unlisted = [f"{more} more pending barriers are not listed (the {len(rows)} that have waited longest are)"] \
            if more > 0 else []
        return rows, unlisted

    def _add_progress_rows(self, into: Any, now: float) -> None:
        """Each rank's last collective per communicator, at most 4 x world size rows (the world's
        first), appended to ``into`` (a StatusResponse's progress), each built in place (see
        answers.add_members)."""
        state = self._state
        if state.progress.generation != state.generation:
            return
        add = into.add
        cap = 4 * state.world_size
        comms = sorted(state.progress.communicators.values(), key=lambda c: (c.name != "world", c.name))
        for comm in comms:
            for rank, entered, kind, age, inside in comm.rows(now):
                if len(into) >= cap:
                    return
                add(communicator=comm.name, rank=rank, entered=entered, kind=kind, age_s=age, inside=inside)
