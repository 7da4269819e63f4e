"""Named barriers: arrivals counted per instance (O(1) an arrival), for every rank or a group."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from gridcomm._coordinator.state.common import (
    INVALID_ARGUMENT,
    RESOURCE_EXHAUSTED,
    Member,
    MemberState,
    StateBase,
    StateError,
    quote,
)
from gridcomm._wire import shown_generation as _shown


@dataclasses.dataclass
class _Barrier:
    #: Highest seq each rank has arrived at (index = rank).
    arrived: list[int]
    #: The ranks that take part (every rank, or a sub-communicator's members).
    members: tuple[int, ...]
    #: Highest seq every rank has reached (the barrier instances that are complete).
    completed: int = 0
    #: How many ranks have arrived at instance completed + 1.
    count_next: int = 0
    #: When the first rank arrived at the oldest incomplete instance (for status and progress).
    waiting_since: float | None = None
    #: How long the instance that completed last waited, first arrival to completion (metrics).
    last_wait_s: float = 0.0


class Barriers(StateBase):
    """The barriers of the current generation (a recovery starts with none)."""

    barriers: dict[str, _Barrier]

    def check_barrier_name(self, name: str) -> None:
        size = len(name.encode())
        if size == 0 or size > self.limits.max_name_bytes:
            raise StateError(INVALID_ARGUMENT, f"barrier name length {size} must be between 1 and {self.limits.max_name_bytes} bytes.")

    def arrive(self, name: str, rank: int, seq: int, now: float, participants: Sequence[int] = ()) -> int:
        """Records rank's arrival at instance ``seq`` of barrier ``name``.

        ``participants`` are the ranks that take part (empty: every rank). Returns the highest
        instance that is complete after this arrival (>= seq means done).
        """
        barrier = self.barriers.get(name)
        if barrier is None:  # a name in use passed this check when its barrier opened
            self.check_barrier_name(name)
        if self._failed:
            # Why after the name check: a refusal names what is wrong with the request first.
            self.check_not_failed(f"barrier {quote(name)}")
        if seq < 1:
            raise StateError(INVALID_ARGUMENT, f"barrier {quote(name)} seq {seq} must be >= 1.")
        members = self._participants(name, rank, participants) if participants else self._everyone
        # Why membership is checked before the barrier is opened: a refused arrival must leave
        # no trace (it would otherwise fix the group for the ranks that come after it).
        if rank not in (members if members is not self._everyone else range(self.world_size)):
            raise StateError(INVALID_ARGUMENT, f"rank {rank} is not a participant of barrier {quote(name)}.")
        if barrier is None:
            if len(self.barriers) >= self.limits.max_barrier_names:
                raise StateError(RESOURCE_EXHAUSTED, f"{len(self.barriers)} barrier names are in use, the limit.")
            barrier = self.barriers[name] = _Barrier(arrived=[0] * self.world_size, members=members)
        elif members is not barrier.members and members != barrier.members:
            raise StateError(
                INVALID_ARGUMENT,
                f"rank {rank} arrived at barrier {quote(name)} for ranks {list(members)[:16]}, but it was "
                f"opened for {list(barrier.members)[:16]}; every member must name the same group.",
            )
        mine = barrier.arrived[rank]
        if seq > mine + 1:
            # Why: a rank cannot skip an instance; seq counts its own arrivals at this name.
            raise StateError(
                INVALID_ARGUMENT,
                f"rank {rank} arrived at barrier {quote(name)} #{seq}, but its previous arrival was #{mine}; "
                "seq must count up by one.",
            )
        if seq > mine:
            barrier.arrived[rank] = seq
            if barrier.waiting_since is None:
                barrier.waiting_since = now
            if seq == barrier.completed + 1:
                barrier.count_next += 1
                # Why: counting arrivals keeps an arrival O(1); the recount runs once per instance.
                while barrier.count_next == len(barrier.members):
                    barrier.last_wait_s = now - barrier.waiting_since if barrier.waiting_since is not None else 0.0
                    barrier.completed += 1
                    barrier.count_next = sum(1 for r in barrier.members if barrier.arrived[r] > barrier.completed)
                    barrier.waiting_since = now if barrier.count_next else None
        return barrier.completed

    def _participants(self, name: str, rank: int, participants: Sequence[int]) -> tuple[int, ...]:
        if not participants:
            return self._everyone
        members = tuple(participants)
        if members == self._everyone:
            return self._everyone
        if list(members) != sorted(set(members)) or members[0] < 0 or members[-1] >= self.world_size or \
                any(r not in self.members for r in members):
            raise StateError(
                INVALID_ARGUMENT,
                f"barrier {quote(name)}: participants must be distinct ranks of generation {_shown(self.generation)} "
                f"(job ranks {list(self._everyone)[:16]}), sorted; got {list(members)[:16]}.",
            )
        return members

    def barrier_missing(self, name: str, seq: int) -> list[int]:
        barrier = self.barriers.get(name)
        if barrier is None:
            return list(self._everyone)
        return [r for r in barrier.members if barrier.arrived[r] < seq]

    def barrier_blocker(self, name: str, seq: int) -> Member | None:
        """A member that left cleanly before arriving at ``name``#``seq``: the barrier can never complete."""
        if not self.left_count:
            return None  # Why: the common case stays O(1) per arrival, not O(world size).
        for rank in self.barrier_missing(name, seq):
            member = self.members.get(rank)
            if member is not None and member.state is MemberState.LEFT:
                return member
        return None

    def pending_barriers(self, now: float) -> Iterable[tuple[str, int, list[int], list[int], float]]:
        for name, barrier in self.barriers.items():
            top = max(barrier.arrived)
            if top > barrier.completed:
                seq = barrier.completed + 1
                arrived = [r for r in barrier.members if barrier.arrived[r] >= seq]
                missing = [r for r in barrier.members if barrier.arrived[r] < seq]
                since = barrier.waiting_since if barrier.waiting_since is not None else now
                yield name, seq, arrived, missing, max(0.0, now - since)
