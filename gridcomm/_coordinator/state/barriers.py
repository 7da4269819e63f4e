"""Named barriers: arrivals counted per instance (O(1) an arrival), for every rank or a group, in
bounded memory.

A barrier is *pending* while some member has arrived at an instance that is not complete: it holds
each member's count of arrivals (an ``array`` of 8 bytes a member) and counts against the state's
budget (``Limits.state_budget``, shared with the keys), ``Limits.max_pending_barriers`` and, for
the rank whose arrival opened it, ``Limits.max_pending_barriers_per_rank``. Once every member has
passed its latest instance the barrier is *passed*: its array is freed and only its name, its group
and how many instances completed are kept, so a rank's next arrival at the name counts on from
there and an arrival repeated after its instance completed (a wait's next slice, a call repeated
after a broken stream) is answered as done. Passed barriers are dropped, oldest first, once passed
for ``Limits.barrier_retain_s`` and room is needed: when they hold more than a quarter of the
budget, or when a pending one needs their room. A name that was dropped starts afresh, and an
arrival there whose seq is above 1 (the job reused a name it passed long ago: every member had
passed it) continues from that seq.

Pending barriers are kept in the order of their waits (an ordered dict), so the count and the
oldest wait that metrics read cost O(1), and Status lists the longest-waiting first.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import sys
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence

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

#: What a pending barrier costs beyond its name, its group and 8 bytes a member: its record, its
#: array's header, its entries in ``barriers`` and in the pending order, its clock readings.
PENDING_OVERHEAD = 512
#: What a passed barrier costs beyond its name and its group: its record, its entry in
#: ``barriers``, its place in the queue of passed barriers.
PASSED_OVERHEAD = 256
#: A group's rank as the group's tuple holds it: a pointer and (above 256) an int of its own.
_GROUP_RANK_BYTES = 40
#: The highest seq taken (a count of one rank's arrivals at one name; the arrays hold int64).
MAX_SEQ = 1 << 62


@dataclasses.dataclass(slots=True)
class _Barrier:
    #: The name, as ``barriers`` holds it (the queues refer to this one string).
    name: str
    #: The ranks that take part (every rank, or a sub-communicator's members), ascending.
    members: tuple[int, ...]
    #: Each member's count of arrivals at this name, by its position in ``members``; None while
    #: the barrier is passed (every member is at ``completed``).
    arrived: array.array[int] | None = None
    #: Highest seq every member has reached (the barrier instances that are complete).
    completed: int = 0
    #: How many members have arrived at instance completed + 1.
    count_next: int = 0
    #: When the first rank arrived at the oldest incomplete instance (for status and progress);
    #: None exactly while the barrier is not pending.
    waiting_since: float | None = None
    #: How long the instance that completed last waited, first arrival to completion (metrics).
    last_wait_s: float = 0.0
    #: What its name and group cost (bytes), and what it is counted as now.
    base_cost: int = 0
    cost: int = 0
    #: When it last became passed, and how many entries of the passed queue name it (the last
    #: one is the latest passing; the earlier ones are skipped).
    passed_at: float = 0.0
    queued: int = 0
    #: The rank whose arrival made it pending (it is counted against that rank's share).
    opener: int = -1


#: Marks a passed barrier that is becoming pending while room is made for it (never dropped).
_OPENING: array.array[int] = array.array("q")


class Barriers(StateBase):
    """The barriers of the current generation (a recovery starts with none)."""

    #: Every barrier known by name: pending and passed.
    barriers: dict[str, _Barrier]
    #: The pending ones, the longest-waiting first.
    _pending: collections.OrderedDict[str, _Barrier]
    #: Names of passed barriers in the order they passed (see _Barrier.queued).
    _passed: collections.deque[str]
    _passed_bytes: int
    #: Passed barriers dropped in this generation (a dropped name may come back at seq > 1).
    _forgotten: int
    #: Rank -> pending barriers its arrival opened (see Limits.max_pending_barriers_per_rank).
    _opened: dict[int, int]

    def _clear_barriers(self) -> None:
        """No barriers (a new generation's)."""
        self.barriers = {}
        self._pending = collections.OrderedDict()
        self._passed = collections.deque()
        self._barrier_bytes = 0
        self._passed_bytes = 0
        self._forgotten = 0
        self._opened = {}

    def check_barrier_name(self, name: str) -> None:
        size = len(name) if name.isascii() else len(name.encode())
        if size == 0 or size > self.limits.max_name_bytes:
            raise StateError(INVALID_ARGUMENT, f"barrier name length {size} must be between 1 and {self.limits.max_name_bytes} bytes.")

    def _position(self, members: tuple[int, ...], rank: int) -> int:
        """``rank``'s place in ``members`` (-1: not one of them); O(1) for every rank of the job."""
        if len(members) == self.world_size:
            return rank if 0 <= rank < self.world_size else -1
        i = bisect_left(members, rank)
        return i if i < len(members) and members[i] == rank else -1

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
        if seq < 1 or seq > MAX_SEQ:
            raise StateError(INVALID_ARGUMENT, f"barrier {quote(name)} seq {seq} must be between 1 and {MAX_SEQ}.")
        if not participants:
            members = self._everyone
        elif barrier is not None and self.complete and len(participants) == len(barrier.members) \
                and tuple(participants) == barrier.members:
            # The group this barrier was opened for, checked then. Why it need not be checked
            # again: after the rendezvous a generation's members change only with the next
            # generation, which starts with no barriers. Checked per arrival it would cost
            # O(group) per arrival, O(group^2) per barrier.
            members = barrier.members
        else:
            members = self._participants(name, rank, participants)
        # Why membership is checked before the barrier is opened: a refused arrival must leave
        # no trace (it would otherwise fix the group for the ranks that come after it).
        pos = self._position(members, rank)
        if pos < 0:
            raise StateError(INVALID_ARGUMENT, f"rank {rank} is not a participant of barrier {quote(name)}.")
        if barrier is None:
            # A name this generation dropped was passed by every member: their count goes on.
            barrier = _Barrier(name, members, completed=seq - 1 if seq > 1 and self._forgotten else 0)
        elif members is not barrier.members and members != barrier.members:
            raise StateError(
                INVALID_ARGUMENT,
                f"rank {rank} arrived at barrier {quote(name)} for ranks {list(members)[:16]}, but it was "
                f"opened for {list(barrier.members)[:16]}; every member must name the same group.",
            )
        arrived = barrier.arrived
        mine = barrier.completed if arrived is None else arrived[pos]
        if seq > mine + 1:
            # Why: a rank cannot skip an instance; seq counts its own arrivals at this name.
            raise StateError(
                INVALID_ARGUMENT,
                f"rank {rank} arrived at barrier {quote(name)} #{seq}, but its previous arrival was #{mine}; "
                "seq must count up by one.",
            )
        if seq <= mine:
            return barrier.completed  # a repeat: already counted
        if arrived is None:
            arrived = self._open(barrier, rank, now)
        arrived[pos] = seq
        if barrier.waiting_since is None:
            barrier.waiting_since = now
        if seq == barrier.completed + 1:
            barrier.count_next += 1
            if barrier.count_next == len(barrier.members):
                # Why counting arrivals keeps an arrival O(1): the recount runs once per instance.
                while barrier.count_next == len(barrier.members):
                    barrier.last_wait_s = now - barrier.waiting_since if barrier.waiting_since is not None else 0.0
                    barrier.completed += 1
                    # Every member is at completed or beyond: the rest are ahead of it.
                    barrier.count_next = len(arrived) - arrived.count(barrier.completed)
                    barrier.waiting_since = now if barrier.count_next else None
                if barrier.count_next:
                    self._pending.move_to_end(barrier.name)  # its wait starts again: the newest
                else:
                    self._pass(barrier, now)
        return barrier.completed

    def arrive_many(self, name: str, ranks: Iterable[int], seq: int, now: float,
                    participants: Sequence[int] = ()) -> int:
        """arrive() for each of ``ranks`` in order (the other ranks of a relay's aggregate): the
        same records, the same answer, the same refusals. Why a loop of its own: it runs for every
        rank of every aggregate. Once one arrive() here has checked what is the same for all of
        them (the name, the job's failure, the seq's range, the group), a next rank's first
        arrival at an instance that it does not complete is counted in a few steps; any other
        arrival (a repeat, a skip, a rank outside the group, the completing one) takes arrive()."""
        completed = 0
        checked = False
        for rank in ranks:
            if checked:
                barrier = self.barriers.get(name)
                if barrier is not None and (arrived := barrier.arrived) is not None \
                        and seq == barrier.completed + 1 and barrier.count_next + 1 < len(arrived):
                    pos = self._position(barrier.members, rank)
                    if pos >= 0 and arrived[pos] == seq - 1:
                        arrived[pos] = seq
                        barrier.count_next += 1
                        completed = barrier.completed
                        continue
            completed = self.arrive(name, rank, seq, now, participants)
            checked = True
        return completed

    def _open(self, barrier: _Barrier, rank: int, now: float) -> array.array[int]:
        """Makes a new or passed barrier pending (``rank``'s arrival is the first at its next
        instance), within the pending limits and the budget (passed barriers are dropped for room
        where they may be)."""
        name = barrier.name
        opened = self._opened.get(rank, 0)
        if opened >= self.limits.max_pending_barriers_per_rank:
            # Why a share per rank: one rank that arrives at names the others never reach (a bug,
            # or a hostile token holder) is refused, and the others' barriers go on.
            raise StateError(
                RESOURCE_EXHAUSTED,
                f"barrier {quote(name)} was refused: rank {rank} has opened {opened} barriers that wait for ranks that "
                "have not arrived, the limit for one rank; does it arrive at barrier names the others never reach?",
            )
        if len(self._pending) >= self.limits.max_pending_barriers:
            raise StateError(
                RESOURCE_EXHAUSTED,
                f"barrier {quote(name)} was refused: {len(self._pending)} barriers wait for ranks that have not arrived, "
                f"the limit; do ranks arrive at barrier names the others never reach?",
            )
        new = name not in self.barriers
        if not barrier.base_cost:
            barrier.base_cost = sys.getsizeof(name) + (
                0 if barrier.members is self._everyone else
                sys.getsizeof(barrier.members) + _GROUP_RANK_BYTES * len(barrier.members))
        cost = barrier.base_cost + PENDING_OVERHEAD + 8 * len(barrier.members)
        grow = cost - barrier.cost
        if self._state_bytes() + grow > self._budget():
            if not new:
                barrier.arrived = _OPENING  # not dropped to make its own room
            self._drop_passed(now, grow)
            barrier.arrived = None
            if self._state_bytes() + grow > self._budget():
                if not new and not barrier.queued:  # its entries were skipped: queue it again
                    self._passed.append(name)
                    barrier.queued = 1
                raise self._full_error(f"barrier {quote(name)}", grow)
        if new:
            self.barriers[name] = barrier
        else:
            self._passed_bytes -= barrier.cost
        self._barrier_bytes += grow
        barrier.cost = cost
        barrier.arrived = array.array("q", [barrier.completed]) * len(barrier.members)
        self._pending[name] = barrier
        barrier.opener = rank
        self._opened[rank] = opened + 1
        return barrier.arrived

    def _pass(self, barrier: _Barrier, now: float) -> None:
        """Every member passed the latest instance: only the name, group and count stay."""
        barrier.arrived = None
        del self._pending[barrier.name]
        left = self._opened[barrier.opener] - 1
        if left:
            self._opened[barrier.opener] = left
        else:
            del self._opened[barrier.opener]
        cost = barrier.base_cost + PASSED_OVERHEAD
        self._barrier_bytes += cost - barrier.cost
        self._passed_bytes += cost
        barrier.cost = cost
        barrier.passed_at = now
        # Why the head is trimmed here: a name used again and again (a training step's barrier)
        # passes once per instance, and its earlier entries, stale, would otherwise stay queued
        # until the budget is pressed. Amortised O(1), as in _drop_passed.
        self._trim_stale_head()
        self._passed.append(barrier.name)
        barrier.queued += 1
        if self._passed_bytes > self._budget() // 4:
            self._drop_passed(now, 0)

    def _trim_stale_head(self) -> _Barrier | None:
        """Removes stale entries from the head of the passed queue (their barrier passed again
        later, is pending, or is gone); returns the barrier the head now names, if any."""
        queue = self._passed
        while queue:
            barrier = self.barriers.get(queue[0])
            if barrier is not None and barrier.queued <= 1 and barrier.arrived is None:
                return barrier
            queue.popleft()
            if barrier is not None:
                barrier.queued -= 1
        return None

    def _drop_passed(self, now: float, need: int) -> None:
        """Drops the oldest passed barriers passed at least barrier_retain_s ago, while passed
        ones hold more than a quarter of the budget or ``need`` more bytes do not fit. Amortised
        O(1): every entry of the queue is removed once."""
        queue, budget, retain = self._passed, self._budget(), self.limits.barrier_retain_s
        while self._passed_bytes > budget // 4 or (need and self._state_bytes() + need > budget):
            barrier = self._trim_stale_head()
            if barrier is None:
                break
            if now - barrier.passed_at < retain or barrier.passed_at >= now:
                break  # the rest passed later still
            queue.popleft()
            barrier.queued = 0
            del self.barriers[barrier.name]
            self._passed_bytes -= barrier.cost
            self._barrier_bytes -= barrier.cost
            self._forgotten += 1

    def _participants(self, name: str, rank: int, participants: Sequence[int]) -> tuple[int, ...]:
        if not participants:
            return self._everyone
        members = tuple(participants)
        if members == self._everyone:
            return self._everyone
        # Ranks of the generation, joined or not yet (a barrier opened before the rendezvous
        # completes waits for them, as a whole-job barrier does).
        everyone = self._everyone
        if list(members) != sorted(set(members)) or members[0] < 0 or members[-1] >= self.world_size or \
                (len(everyone) < self.world_size and not set(members) <= set(everyone)):
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
        if barrier.arrived is None:
            return [] if seq <= barrier.completed else list(barrier.members)
        return [r for r, count in zip(barrier.members, barrier.arrived, strict=True) if count < seq]

    def barrier_blocker(self, name: str, seq: int) -> Member | None:
        """A member that left cleanly before arriving at ``name``#``seq``: the barrier can never complete."""
        if not self.left_count:
            return None  # Why: the common case stays O(1) per arrival, not O(world size).
        for rank in self.barrier_missing(name, seq):
            member = self.members.get(rank)
            if member is not None and member.state is MemberState.LEFT:
                return member
        return None

    @property
    def pending_barrier_count(self) -> int:
        """Barriers some rank waits at (O(1))."""
        return len(self._pending)

    def oldest_barrier_wait(self, now: float) -> float:
        """How long the longest-waiting pending barrier has waited (0 when none; O(1))."""
        for barrier in self._pending.values():
            return max(0.0, now - barrier.waiting_since) if barrier.waiting_since is not None else 0.0
        return 0.0

    def pending_barriers(self, now: float) -> Iterator[tuple[str, int, list[int], list[int], float]]:
        """(name, seq, arrived, missing, waited) of each pending barrier, the longest-waiting
        first; each costs O(its members), so callers take as many as they can show."""
        for barrier in self._pending.values():
            seq, counts = barrier.completed + 1, barrier.arrived
            if counts is None:
                continue
            arrived = [r for r, count in zip(barrier.members, counts, strict=True) if count >= seq]
            missing = [r for r, count in zip(barrier.members, counts, strict=True) if count < seq]
            since = barrier.waiting_since if barrier.waiting_since is not None else now
            yield barrier.name, seq, arrived, missing, max(0.0, now - since)
