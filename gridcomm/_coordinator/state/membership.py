"""Membership and recovery: the rendezvous, replacements, rebuild()/shrink() into the next
generation, and every caller's identity check. Pure: the caller passes ``now``."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable

from gridcomm._coordinator.state.barriers import Barriers
from gridcomm._coordinator.state.common import (
    ABORTED,
    ALREADY_EXISTS,
    FAILED_PRECONDITION,
    INVALID_ARGUMENT,
    Failure,
    Limits,
    Member,
    MemberState,
    StateError,
    process_tag,
    quote,
)
from gridcomm._coordinator.state.keyvalue import KeyValue
from gridcomm._coordinator.state.liveness import Liveness
from gridcomm._coordinator.state.progress import Progress
from gridcomm._wire import shown_generation as _shown

REBUILD = "rebuild"
SHRINK = "shrink"


@dataclasses.dataclass
class Recovery:
    """The next generation while it forms, after a failure of the current one.

    ``mode`` is what the survivors chose (None until the first of them arrives; a replacement
    may come first). A survivor's arrival counts only while no failure came after it: each is
    stored with the number of failures known when it arrived, so a failure during the recovery
    sends every survivor that waits back with RankFailedError, and their retry arrives again.
    """

    base: int
    mode: str | None = None
    #: Survivor rank -> number of failures of the base generation known when it arrived.
    survivors: dict[int, int] = dataclasses.field(default_factory=dict)
    #: Rank -> the new process admitted as the replacement of a failed rank.
    replacements: dict[int, Member] = dataclasses.field(default_factory=dict)
    #: How many survivors arrived while ``failures`` failures were known (counted, so that an
    #: arrival costs O(1) and not a pass over the world).
    counted: int = 0
    failures: int = 0

    def arrive(self, rank: int, failures: int) -> None:
        """A survivor's arrival while ``failures`` failures are known (a repeat counts once)."""
        if self.failures != failures:
            self.failures, self.counted = failures, 0  # earlier arrivals were sent back to retry
        if self.survivors.get(rank) != failures:
            self.survivors[rank] = failures
            self.counted += 1


class JobState(Liveness, Barriers, KeyValue):
    """The coordinator's view of one job: members, generation, keys, barriers, failures."""

    def __init__(self, world_size: int, job_id: str, *, now: float, limits: Limits | None = None) -> None:
        if world_size < 1:
            raise ValueError("world_size must be >= 1")
        self.world_size = world_size
        self.job_id = job_id
        self.limits = limits or Limits()
        self.started_at = now
        self.generation = 0
        self.members = {}
        self.failures = []
        self._failed = {}
        self._sets = 0
        self._clear_keys()
        self._clear_barriers()
        self.left_count = 0
        self.completed_at = None
        #: Every rank of the generation, as one shared tuple: an arrival at a whole-job barrier
        #: compares it by identity, keeping the arrival O(1) rather than O(world size). All job
        #: ranks, until a shrink() leaves fewer.
        self._everyone = tuple(range(world_size))
        #: The next generation while it forms (after a failure), else None.
        self.recovery: Recovery | None = None
        #: Failures of earlier generations, oldest first (a record; Status shows the current one's).
        self.past_failures: list[Failure] = []
        #: (base generation, mode) of the recovery that made the current generation.
        self.recovered_from: tuple[int, str | None] = (0, None)
        #: How far each rank got in each communicator of the current generation.
        self.progress = Progress()
        self.member_changes = 0

    @property
    def active(self) -> tuple[int, ...]:
        """The job ranks of the current generation, ascending."""
        return self._everyone

    # ----------------------------------------------------------------- join and identity
    def missing_join(self) -> list[int]:
        """Ranks the forming generation waits for: the first rendezvous's, or a recovery's."""
        if self.complete:
            return self.recovery_missing()
        return [r for r in range(self.world_size) if r not in self.members]

    def join(self, job_id: str, rank: int, world_size: int, incarnation: int, hostname: str, now: float, *,
             base: int = 0, mode: str | None = None) -> bool:
        """Registers a rank; returns True when this join completed the rendezvous (or a recovery).

        ``base``/``mode``: a survivor of generation ``base`` joining the next one by ``mode``
        (REBUILD or SHRINK). A new process (base 0) for a rank of a running job is a replacement:
        see :meth:`_admit`.
        """
        self._check_job(job_id)
        if world_size != self.world_size:
            # Why: a mismatch means the pods were launched from different specs; refuse loudly.
            raise StateError(
                INVALID_ARGUMENT,
                f"rank {rank} says the world size is {world_size}, but this coordinator was started for "
                f"{self.world_size} ranks; launch every rank with the same world size.",
            )
        self._check_rank(rank, "join")
        if incarnation == 0:
            raise StateError(INVALID_ARGUMENT, f"rank {rank} joined with incarnation 0; it must be a random non-zero number.")
        if len(hostname.encode()) > self.limits.max_hostname_bytes:
            raise StateError(INVALID_ARGUMENT, f"rank {rank}'s hostname is longer than {self.limits.max_hostname_bytes} bytes.")
        # Why interned: a member keeps its hostname, and a host's ranks all name the same one.
        hostname = sys.intern(hostname)
        if base:
            return self._recover(rank, incarnation, base, mode, now)
        if mode is not None:
            raise StateError(INVALID_ARGUMENT, f"rank {rank} asked for a {mode} without naming the generation it "
                             "recovers from.")
        if self.complete:
            return self._admit(rank, incarnation, hostname, now)
        if self._failed:
            raise self._failure_error(f"rank {rank} cannot join")
        old = self.members.get(rank)
        if old is not None and self._repoll(old, incarnation, now, "is already taken by a live process"):
            return False
        self.members[rank] = Member(rank, incarnation, hostname, joined_at=now, last_seen=now)
        self.member_changes += 1
        if len(self.members) == self.world_size:
            self.generation = 1
            self.completed_at = now
            return True
        return False

    def join_answer(self, rank: int, incarnation: int, base: int) -> str:
        """What a join that :meth:`join` accepted waits for: ``"joined"`` (answered at once: a
        member's join of the formed generation, the one that completed it or a re-poll),
        ``"recovery"`` (a process admitted into a running job, or a survivor: the next generation),
        or ``"rendezvous"`` (the first generation is still forming)."""
        if not self.complete:
            return "rendezvous"
        member = self.members.get(rank)
        if not base and member is not None and member.incarnation == incarnation:
            return "joined"
        return "recovery"

    def recovery_waiter(self, rank: int, incarnation: int) -> Member | None:
        """The process of ``rank`` that waits in a recovery (a survivor, or the replacement admitted
        for a failed rank), if it is the one with ``incarnation``: its call in flight counts."""
        recovery = self.recovery
        waiting = self.members.get(rank)
        if recovery is not None and rank in recovery.replacements:
            waiting = recovery.replacements[rank]
        return waiting if waiting is not None and waiting.incarnation == incarnation else None

    def join_abandoned(self, rank: int, incarnation: int, now: float) -> bool:
        """The join of a process not yet in a generation ended without an answer (its call was
        cancelled: the process died, or its connection did). It is no longer counted, so the
        generation does not form with a member that is gone; a process that comes back joins
        again. True when it was dropped (a process with another call still waiting is kept)."""
        if not self.complete:
            member = self.members.get(rank)
            if member is None or member.incarnation != incarnation or member.active_calls:
                return False
            self.leave(rank, now)  # before the rendezvous a leave removes the member
            return True
        recovery = self.recovery
        waiting = recovery.replacements.get(rank) if recovery is not None else None
        if waiting is None or waiting.incarnation != incarnation or waiting.active_calls:
            return False
        del recovery.replacements[rank]  # type: ignore[union-attr]
        return True

    def refuses_waiting_replacements(self) -> bool:
        """Whether the forming generation leaves out replacements that wait (survivors chose
        shrink()): they must be woken to hear that they are not admitted."""
        recovery = self.recovery
        return recovery is not None and recovery.mode == SHRINK and bool(recovery.replacements)

    def _repoll(self, waiting: Member, incarnation: int, now: float, taken: str) -> bool:
        """A join for a rank that ``waiting`` (a process not yet in a generation) holds: True when
        it is that process re-polling (idempotent); raises when another live one holds it; False
        when the holder went stale (it died while waiting; the new process takes its place)."""
        if waiting.incarnation == incarnation:
            waiting.last_seen = now
            return True
        if waiting.active_calls > 0 or now - waiting.last_seen < self.limits.stale_join_s:
            raise StateError(
                ALREADY_EXISTS,
                f"rank {waiting.rank} {taken} on {waiting.hostname or '?'} (process {process_tag(waiting.incarnation)}); "
                "each rank must be started exactly once.",
            )
        return False

    # ----------------------------------------------------------------- recovery in place
    def _admit(self, rank: int, incarnation: int, hostname: str, now: float) -> bool:
        """A join by a new process (or a re-poll of one) once the job is running."""
        old = self.members.get(rank)
        if old is not None and old.incarnation == incarnation:
            # The same process re-polling after it was admitted (or before a failure it must hear of).
            old.last_seen = now
            if self._failed:
                raise self._failure_error(f"rank {rank} cannot join")
            return False
        recovery = self.recovery
        waiting = recovery.replacements.get(rank) if recovery is not None else None
        if waiting is not None and self._repoll(waiting, incarnation, now, "already has a replacement waiting"):
            return False
        if rank not in self._everyone:
            raise StateError(
                FAILED_PRECONDITION,
                f"rank {rank} is not part of generation {_shown(self.generation)}: the job shrank to ranks "
                f"{list(self._everyone)[:16]}; a new process is admitted only as the replacement of a failed rank.",
            )
        if old is not None and old.state is MemberState.JOINED:
            # Why not admitted: a rank is one process. If the old one is in fact dead, the
            # coordinator marks it failed within the liveness bound, and then this one is admitted
            # (the server waits for that, bounded, before it answers with this refusal).
            heard = f"heard from {now - old.last_seen:.1f} s ago"
            raise StateError(
                ALREADY_EXISTS,
                f"rank {rank} is held by a live process on {old.hostname or '?'} (process {process_tag(old.incarnation)}, "
                f"{heard}) in generation {_shown(self.generation)}; a second process for it is refused. A replacement "
                "is admitted only once its predecessor has failed.",
                predecessor_alive=True,
            )
        if not self._failed:
            raise StateError(
                FAILED_PRECONDITION,
                f"rank {rank} left generation {_shown(self.generation)} cleanly and no rank has failed; a new process "
                "is admitted only as the replacement of a failed rank (restart the whole job otherwise).",
            )
        if recovery is not None and recovery.mode == SHRINK:
            raise self._shrunk_error(rank)
        if recovery is None:
            recovery = self.recovery = Recovery(base=self.generation)
        recovery.replacements[rank] = Member(rank, incarnation, hostname, joined_at=now, last_seen=now)
        return self._maybe_complete(now)

    def _shrunk_error(self, rank: int) -> StateError:
        return StateError(
            FAILED_PRECONDITION,
            f"the survivors of generation {_shown(self.generation)} chose shrink(): the next generation goes on without "
            f"rank {rank}, so its replacement is not admitted.",
        )

    def _recover(self, rank: int, incarnation: int, base: int, mode: str | None, now: float) -> bool:
        """A survivor of generation ``base`` asks to join the next one by ``mode``."""
        if mode not in (REBUILD, SHRINK):
            raise StateError(INVALID_ARGUMENT, f"rank {rank}: recovery mode {mode!r} must be rebuild or shrink.")
        member = self.members.get(rank)
        if member is None and base > self.generation:
            # Why: a survivor of a generation this coordinator never formed; it restarted since.
            raise StateError(
                FAILED_PRECONDITION,
                f"rank {rank} asked to recover generation {_shown(base)}, but this coordinator has no record of it: it was "
                "restarted (or replaced) and lost the job's state; restart every rank of the job.",
                restarted=True,
            )
        if member is None or member.incarnation != incarnation:
            raise StateError(
                FAILED_PRECONDITION,
                f"rank {rank} (process {process_tag(incarnation)}) asked to recover generation {_shown(base)}, but it is not a "
                f"member of generation {_shown(self.generation)}; a new process joins without naming a generation.",
            )
        if base == self.generation - 1 and self.recovered_from == (base, mode):
            member.last_seen = now
            return False  # this survivor's recovery completed; a re-poll gets the new generation
        if base != self.generation:
            raise StateError(
                FAILED_PRECONDITION,
                f"rank {rank} asked to recover generation {_shown(base)}, but {self._where()}.",
            )
        if member.state is MemberState.FAILED:
            raise StateError(
                ABORTED,
                f"rank {rank} was marked failed in generation {_shown(base)} ({self._failed[rank].reason}); it cannot "
                "take part in the recovery: start a new process for it (it will be admitted as a replacement).",
                failed_rank=rank,
            )
        if member.state is MemberState.LEFT:
            raise StateError(FAILED_PRECONDITION, f"rank {rank} left generation {_shown(base)}; it cannot recover it.")
        if not self._failed:
            raise StateError(
                FAILED_PRECONDITION,
                f"rank {rank} called {mode}(), but no rank of generation {_shown(base)} has failed; rebuild() and "
                "shrink() follow a RankFailedError.",
            )
        recovery = self.recovery
        if recovery is None:
            recovery = self.recovery = Recovery(base=base)
        if recovery.mode is None:
            recovery.mode = mode
        elif recovery.mode != mode:
            raise StateError(
                FAILED_PRECONDITION,
                f"rank {rank} called {mode}(), but the other survivors of generation {_shown(base)} called "
                f"{recovery.mode}(); every survivor must make the same call.",
            )
        member.last_seen = now
        recovery.arrive(rank, len(self.failures))
        return self._maybe_complete(now)

    def recovery_check(self, rank: int, incarnation: int, base: int) -> bool:
        """Whether the recovery a rank waits in has completed (True), is still forming (False),
        or raises what ends its wait: a failure after it arrived, or a shrink that leaves a
        replacement out."""
        if self.generation > base:
            member = self.members.get(rank)
            if member is not None and member.incarnation == incarnation:
                return True
            raise self._shrunk_error(rank) if self.recovered_from[1] == SHRINK else StateError(
                ABORTED, f"rank {rank} was replaced in generation {_shown(self.generation)} by another process.")
        recovery = self.recovery
        if recovery is None:
            raise StateError(ABORTED, f"the recovery of generation {_shown(base)} was abandoned; call it again.")
        if rank in recovery.survivors and self.members.get(rank) is not None and \
                self.members[rank].incarnation == incarnation:
            if recovery.survivors[rank] != len(self.failures):
                latest = self.failures[-1]
                raise StateError(ABORTED, f"rank {latest.rank} failed during the recovery: {latest.reason}",
                                 failed_rank=latest.rank)
            return False
        waiting = recovery.replacements.get(rank)
        if waiting is not None and waiting.incarnation == incarnation:
            if recovery.mode == SHRINK:
                raise self._shrunk_error(rank)
            return False
        raise StateError(ABORTED, f"rank {rank} is no longer waiting in the recovery of generation {_shown(base)}; join again.")

    def recovery_missing(self) -> list[int]:
        """Ranks the forming generation still waits for (survivors and replacements)."""
        recovery = self.recovery
        if recovery is None:
            return []
        count = len(self.failures)
        missing = []
        for rank in self._everyone:
            member = self.members[rank]
            if member.state is MemberState.JOINED:
                if recovery.survivors.get(rank) != count:
                    missing.append(rank)
            elif recovery.mode != SHRINK and rank not in recovery.replacements:
                missing.append(rank)
        return missing

    def _maybe_complete(self, now: float) -> bool:
        """Forms the next generation once everyone it waits for is there (O(1) until then)."""
        recovery = self.recovery
        assert recovery is not None
        # Failed and left ranks are disjoint (fail() skips a rank that left, leave() one that failed).
        gone = len(self._failed) + self.left_count
        expected = len(self._everyone) - gone
        # With no survivor, every rank is new: nobody to ask, the job restarts in place.
        mode = recovery.mode if expected else REBUILD
        counted = recovery.counted if recovery.failures == len(self.failures) else 0
        if mode is None or counted < expected or (mode == REBUILD and len(recovery.replacements) < gone):
            return False
        members = {r: m for r, m in self.members.items() if m.state is MemberState.JOINED}
        if mode == REBUILD:
            members.update(recovery.replacements)
        active = tuple(sorted(members))
        self.past_failures.extend(self.failures)
        self.failures = []
        self._failed = {}
        self._clear_keys()
        self._clear_barriers()
        self.left_count = 0
        self.members = members
        self._everyone = active if len(active) < self.world_size else tuple(range(self.world_size))
        self.recovered_from = (recovery.base, mode)
        self.recovery = None
        self.generation += 1
        self.completed_at = now
        for member in members.values():
            member.last_seen = now
        return True

    def check_caller(self, job_id: str, rank: int, incarnation: int, generation: int, what: str, *,
                     any_generation: bool = False) -> Member:
        """Validates the identity on a post-join request and returns the member. ``any_generation``:
        a heartbeat, which speaks for the process whatever generation its sender last took."""
        # Why the guards: this runs for every rank on every request; the checks raise the errors.
        if job_id != self.job_id:
            self._check_job(job_id)
        if not 0 <= rank < self.world_size:
            self._check_rank(rank, what)
        member = self.members.get(rank)
        if member is None:
            if generation:
                # Why: only a coordinator that never saw the rendezvous this rank completed gets
                # here, i.e. one restarted since (its state is gone) or another job's.
                raise StateError(
                    FAILED_PRECONDITION,
                    f"rank {rank} called {what} for generation {_shown(generation)}, but this coordinator has no record of "
                    f"rank {rank}: it was restarted (or replaced) after the rendezvous and lost the job's state; "
                    "restart every rank of the job.",
                    restarted=True,
                )
            raise StateError(FAILED_PRECONDITION, f"rank {rank} called {what} before joining; call join() first.")
        if member.incarnation != incarnation:
            raise StateError(
                FAILED_PRECONDITION,
                f"rank {rank} called {what} as process {process_tag(incarnation)}, but the rank belongs to process "
                f"{process_tag(member.incarnation)}; a restarted process cannot use the old process's session.",
            )
        if generation != self.generation and not (any_generation and 0 < generation < self.generation):
            raise StateError(
                FAILED_PRECONDITION,
                f"rank {rank} called {what} for generation {_shown(generation)}, but {self._where()}; rejoin first.",
            )
        if member.state is MemberState.LEFT:
            raise StateError(FAILED_PRECONDITION, f"rank {rank} called {what} after it left the job.")
        return member

    def check_also(self, job_id: str, generation: int, ranks: Iterable[int], incarnations: Iterable[int], what: str,
                   now: float) -> list[int]:
        """check_caller for each other rank of a relay's aggregate (of the caller's job and
        generation, which the caller's own check covered), each seen at ``now``; returns the
        ranks. Why a loop of its own: it runs for every rank of every aggregate; a rank that is
        joined as this process takes the short path, and any other gets check_caller's answer."""
        members, left, seen = self.members, MemberState.LEFT, self.seen
        out = []
        for rank, incarnation in zip(ranks, incarnations, strict=True):
            member = members.get(rank)
            if member is None or member.incarnation != incarnation or member.state is left:
                member = self.check_caller(job_id, rank, incarnation, generation, what)
            seen(member, now)
            out.append(rank)
        return out

    def relayed_members(self, job_id: str, ranks: Iterable[int], incarnations: Iterable[int],
                        generations: Iterable[int]) -> list[Member | None]:
        """check_caller (as for a heartbeat: any generation the process last took) for each rank
        of a relay's heartbeat, in order; None for a rank it refuses (skipped, not an error). Why
        a loop of its own: as check_also, it runs for every rank of every relay every bound / 6."""
        members, left, current = self.members, MemberState.LEFT, self.generation
        out: list[Member | None] = []
        for rank, incarnation, generation in zip(ranks, incarnations, generations, strict=True):
            member = members.get(rank)
            if member is None or member.incarnation != incarnation or member.state is left \
                    or not (generation == current or 0 < generation < current):
                try:
                    member = self.check_caller(job_id, rank, incarnation, generation, "heartbeat", any_generation=True)
                except StateError:
                    member = None
            out.append(member)
        return out

    def _check_job(self, job_id: str) -> None:
        if job_id != self.job_id:
            raise StateError(
                INVALID_ARGUMENT,
                f"job id {quote(job_id)} does not match this coordinator's job {quote(self.job_id)}; "
                "set the same GRIDCOMM_JOB_ID on every rank.",
            )

    def _check_rank(self, rank: int, what: str) -> None:
        if not 0 <= rank < self.world_size:
            raise StateError(
                INVALID_ARGUMENT,
                f"{what} from rank {rank} is out of range for world size {self.world_size}; ranks are "
                f"0..{self.world_size - 1}.",
            )

    def depart(self, job_id: str, rank: int, incarnation: int, generation: int, now: float) -> None:
        """A leave request: the caller's identity is checked, except that the same process
        leaving again is answered as the first time (its first answer may have been lost)."""
        member = self.members.get(rank)
        if member is None or member.state is not MemberState.LEFT or member.incarnation != incarnation:
            self.check_caller(job_id, rank, incarnation, generation, "leave")
        self.leave(rank, now)

    def _where(self) -> str:
        """Where the job is, for refusals that name a generation (the wire's 0 is none yet)."""
        if self.generation == 0:
            return "the job has not formed its first generation yet (the rendezvous is still waiting)"
        return f"the job is at generation {_shown(self.generation)}"
