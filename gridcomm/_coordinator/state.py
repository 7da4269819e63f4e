"""Rendezvous, key-value, barrier and liveness decisions as plain state.

No gRPC, no asyncio, no clock reads: the caller passes ``now`` (seconds, monotonic) into every
method that needs time, so every branch is unit-tested with an injected clock and no network.
The server (``_server.py``) owns the waiting; this module only decides.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Sequence

from gridcomm._wire import shown_generation as _shown

#: Error codes, spelled as gRPC status names so the server maps them one to one.
INVALID_ARGUMENT = "INVALID_ARGUMENT"
ALREADY_EXISTS = "ALREADY_EXISTS"
FAILED_PRECONDITION = "FAILED_PRECONDITION"
ABORTED = "ABORTED"
RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
NOT_FOUND = "NOT_FOUND"


def quote(value: str, limit: int = 64) -> str:
    """repr() of a wire-supplied string, cut to ``limit`` characters so a refusal stays readable
    and far below gRPC's metadata limits whatever the caller sent."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} characters)"


class StateError(Exception):
    """A request the state refuses; ``code`` is a gRPC status name."""

    def __init__(self, code: str, message: str, *, failed_rank: int | None = None,
                 predecessor_alive: bool = False, restarted: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.failed_rank = failed_rank
        #: A new process asked for a rank whose process still looks alive (see JobState._admit).
        self.predecessor_alive = predecessor_alive
        #: The caller says it joined a generation this coordinator never formed: the coordinator
        #: restarted and lost the job's state (the client raises CoordinatorRestarted).
        self.restarted = restarted


class MemberState(enum.IntEnum):
    JOINED = 1
    LEFT = 2
    FAILED = 3


@dataclasses.dataclass
class Member:
    rank: int
    incarnation: int
    hostname: str
    joined_at: float
    last_seen: float
    state: MemberState = MemberState.JOINED
    #: Calls of this member in flight; a member with none and a stale last_seen may be replaced
    #: before the rendezvous completes (its process died while waiting to join).
    active_calls: int = 0
    #: When the member's watcher last sent a heartbeat (None: it never did, so liveness is not
    #: tracked for it, e.g. a bare CoordinatorClient).
    last_heartbeat: float | None = None


@dataclasses.dataclass(frozen=True)
class Failure:
    rank: int
    reason: str
    at: float
    reported_by: int


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


@dataclasses.dataclass
class _Pieces:
    """A value arriving in pieces: its announced size, the bytes so far, the last piece's offset."""

    total: int
    data: bytearray = dataclasses.field(default_factory=bytearray)
    last: int = -1


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


@dataclasses.dataclass(frozen=True)
class Limits:
    max_key_bytes: int = 1024
    max_value_bytes: int = 64 * 1024 * 1024
    max_keys: int = 1_000_000
    max_total_value_bytes: int = 1024 * 1024 * 1024
    max_barrier_names: int = 1_000_000
    max_name_bytes: int = 1024
    max_hostname_bytes: int = 256
    #: A pre-rendezvous member with no call in flight for this long may be replaced by a new
    #: incarnation (its process died while joining); a live one re-polls well within it.
    stale_join_s: float = 2.0


class JobState:
    """The coordinator's view of one job: members, generation, keys, barriers, failures."""

    def __init__(self, world_size: int, job_id: str, *, now: float, limits: Limits | None = None) -> None:
        if world_size < 1:
            raise ValueError("world_size must be >= 1")
        self.world_size = world_size
        self.job_id = job_id
        self.limits = limits or Limits()
        self.started_at = now
        self.generation = 0
        self.members: dict[int, Member] = {}
        self.failures: list[Failure] = []
        self._failed: dict[int, Failure] = {}
        self.kv: dict[str, bytes] = {}
        self._kv_bytes = 0
        #: Each key's version: the count of sets when it was last set (a reader of a value in
        #: pieces names it, so a value set again midway is not read torn).
        self._versions: dict[str, int] = {}
        self._sets = 0
        #: Values arriving in pieces, by (rank, key): the announced size and what came so far.
        #: Their announced sizes count towards max_total_value_bytes from the first piece on.
        self._pieces: dict[tuple[int, str], _Pieces] = {}
        self._pieces_bytes = 0
        self.barriers: dict[str, _Barrier] = {}
        self.left_count = 0
        self.completed_at: float | None = None
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

    @property
    def active(self) -> tuple[int, ...]:
        """The job ranks of the current generation, ascending."""
        return self._everyone

    # ----------------------------------------------------------------- join and identity
    @property
    def complete(self) -> bool:
        return self.generation > 0

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
        if len(self.members) == self.world_size:
            self.generation = 1
            self.completed_at = now
            return True
        return False

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
                f"rank {waiting.rank} {taken} on {waiting.hostname or '?'} (incarnation {waiting.incarnation:#x}); "
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
                f"rank {rank} is held by a live process on {old.hostname or '?'} (incarnation {old.incarnation:#x}, "
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
                f"rank {rank} (incarnation {incarnation:#x}) asked to recover generation {_shown(base)}, but it is not a "
                f"member of generation {_shown(self.generation)}; a new process joins without naming a generation.",
            )
        if base == self.generation - 1 and self.recovered_from == (base, mode):
            member.last_seen = now
            return False  # this survivor's recovery completed; a re-poll gets the new generation
        if base != self.generation:
            raise StateError(
                FAILED_PRECONDITION,
                f"rank {rank} asked to recover generation {_shown(base)}, but the job is at generation {_shown(self.generation)}.",
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
        self.kv = {}
        self._kv_bytes = 0
        self._versions = {}
        self._pieces = {}
        self._pieces_bytes = 0
        self.barriers = {}
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
                f"rank {rank} called {what} as incarnation {incarnation:#x}, but the rank belongs to incarnation "
                f"{member.incarnation:#x}; a restarted process cannot use the old process's session.",
            )
        if generation != self.generation and not (any_generation and 0 < generation < self.generation):
            raise StateError(
                FAILED_PRECONDITION,
                f"rank {rank} called {what} for generation {_shown(generation)}, but the job is at generation "
                f"{_shown(self.generation)}; rejoin first.",
            )
        if member.state is MemberState.LEFT:
            raise StateError(FAILED_PRECONDITION, f"rank {rank} called {what} after it left the job.")
        return member

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

    # ----------------------------------------------------------------- key-value
    def _check_key(self, key: str) -> None:
        size = len(key.encode())
        if size == 0 or size > self.limits.max_key_bytes:
            raise StateError(INVALID_ARGUMENT, f"key length {size} bytes must be between 1 and {self.limits.max_key_bytes}.")

    def set(self, key: str, value: bytes) -> None:
        self._check_key(key)
        self._check_value_size(key, len(value))
        old = self.kv.get(key)
        grow = len(value) - (len(old) if old is not None else 0)
        if old is None and len(self.kv) >= self.limits.max_keys:
            raise StateError(RESOURCE_EXHAUSTED, f"the store holds {len(self.kv)} keys, its limit; key {quote(key)} was not set.")
        self._check_room(key, grow)
        self.kv[key] = value
        self._kv_bytes += grow
        self._sets += 1
        self._versions[key] = self._sets

    def _check_value_size(self, key: str, size: int) -> None:
        if size > self.limits.max_value_bytes:
            raise StateError(
                RESOURCE_EXHAUSTED,
                f"value for key {quote(key)} is {size} bytes; the limit is {self.limits.max_value_bytes}.",
            )

    def _check_room(self, key: str, grow: int) -> None:
        if self._kv_bytes + self._pieces_bytes + grow > self.limits.max_total_value_bytes:
            raise StateError(
                RESOURCE_EXHAUSTED,
                f"the store would hold more than {self.limits.max_total_value_bytes} bytes; key {quote(key)} was not set.",
            )

    def set_piece(self, rank: int, key: str, offset: int, total: int, data: bytes) -> bool:
        """One piece of a value that travels in several (see SetRequest); returns True when it
        was the last and the key now holds the whole value."""
        self._check_key(key)
        self._check_value_size(key, total)
        pending = self._pieces.get((rank, key))
        if offset == 0:
            # Why a first piece restarts: the sender began again (its earlier attempt broke off).
            self._drop_piece(rank, key)
            self._check_room(key, total)
            pending = self._pieces[(rank, key)] = _Pieces(total)
            self._pieces_bytes += total
        elif pending is None or pending.total != total or offset != len(pending.data):
            if pending is not None and offset == pending.last and offset + len(data) == len(pending.data):
                return False  # the same piece again (a call repeated after a broken stream)
            got = "no earlier piece" if pending is None else f"{len(pending.data)} of {pending.total} bytes"
            self._drop_piece(rank, key)
            raise StateError(
                INVALID_ARGUMENT,
                f"a piece of key {quote(key)} at offset {offset} (of {total} bytes) does not follow what rank {rank} "
                f"sent before ({got}); send the value again from offset 0.",
            )
        if offset + len(data) > total:
            self._drop_piece(rank, key)
            raise StateError(INVALID_ARGUMENT, f"a piece of key {quote(key)} ends at {offset + len(data)}, past the "
                             f"announced {total} bytes.")
        pending.last = offset
        pending.data += data
        if len(pending.data) < total:
            return False
        self._drop_piece(rank, key)
        self.set(key, bytes(pending.data))
        return True

    def _drop_piece(self, rank: int, key: str) -> None:
        pending = self._pieces.pop((rank, key), None)
        if pending is not None:
            self._pieces_bytes -= pending.total

    def _drop_pieces(self, rank: int) -> None:
        """A rank that left or failed will not finish its values in pieces."""
        for rank_key in [k for k in self._pieces if k[0] == rank]:
            self._drop_piece(*rank_key)

    def version(self, key: str) -> int:
        return self._versions.get(key, 0)

    def get(self, key: str) -> bytes | None:
        self._check_key(key)
        return self.kv.get(key)

    # ----------------------------------------------------------------- barriers
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

    # ----------------------------------------------------------------- leave, failure, liveness
    def depart(self, job_id: str, rank: int, incarnation: int, generation: int, now: float) -> None:
        """A leave request: the caller's identity is checked, except that the same process
        leaving again is answered as the first time (its first answer may have been lost)."""
        member = self.members.get(rank)
        if member is None or member.state is not MemberState.LEFT or member.incarnation != incarnation:
            self.check_caller(job_id, rank, incarnation, generation, "leave")
        self.leave(rank, now)

    def is_current(self, member: Member) -> bool:
        """Whether ``member`` still holds its rank (a newer process may have replaced it while it
        waited to join)."""
        return self.members.get(member.rank) is member

    def lost_connection(self, member: Member, beat: float | None) -> bool:
        """Whether a rank whose heartbeat call dropped at ``beat`` (its last heartbeat then) and
        sent none since is lost: still joined, still the same process, no heartbeat after."""
        return member.state is MemberState.JOINED and member.last_heartbeat == beat and self.is_current(member)

    def leave(self, rank: int, now: float) -> None:
        member = self.members[rank]
        if member.state is MemberState.JOINED:
            member.state = MemberState.LEFT
            member.last_seen = now
            self.left_count += 1
        if self._pieces:
            self._drop_pieces(rank)

    def all_left(self) -> bool:
        """True when every rank has left or failed (rank 0 may stop serving)."""
        return self.complete and all(m.state is not MemberState.JOINED for m in self.members.values())

    def fail(self, rank: int, reason: str, reported_by: int, now: float) -> Failure | None:
        """Marks ``rank`` failed; returns the failure if it is new (the first report wins)."""
        if rank in self._failed:
            return None
        member = self.members.get(rank)
        if member is not None and member.state is MemberState.LEFT:
            # Why: a clean leave followed by a lost connection is not a failure.
            return None
        failure = Failure(rank, reason[:2048], now, reported_by)
        self._failed[rank] = failure
        if self._pieces:
            self._drop_pieces(rank)
        self.failures.append(failure)
        if member is not None:
            member.state = MemberState.FAILED
        return failure

    @property
    def failed(self) -> bool:
        return bool(self._failed)

    def first_failure(self) -> Failure | None:
        return self.failures[0] if self.failures else None

    def _failure_error(self, what: str) -> StateError:
        first = self.failures[0]
        return StateError(ABORTED, f"{what}: rank {first.rank} failed: {first.reason}", failed_rank=first.rank)

    def check_not_failed(self, what: str) -> None:
        if self._failed:
            raise self._failure_error(what)

    def heartbeat(self, rank: int, now: float) -> None:
        member = self.members[rank]
        member.last_heartbeat = now
        member.last_seen = now

    def expired(self, now: float, timeout_s: float) -> list[int]:
        """Ranks that have not left or failed and show no sign of life within timeout_s:

        - a rank that heartbeats, silent for timeout_s (calls in flight do not count: a silently
          partitioned rank's barrier call stays open on this side until TCP gives up);
        - once the job uses heartbeats, a rank that never sent one within timeout_s after the
          rendezvous completed (it died while joining, so nothing else would ever notice).
        Jobs of bare clients (no heartbeats at all) are never expired.
        """
        joined = [m for m in self.members.values() if m.state is MemberState.JOINED]
        out = [m.rank for m in joined if m.last_heartbeat is not None and now - m.last_heartbeat > timeout_s]
        if self.completed_at is not None and now - self.completed_at > timeout_s and \
                any(m.last_heartbeat is not None for m in self.members.values()):
            out.extend(m.rank for m in joined if m.last_heartbeat is None and m.active_calls == 0)
        return sorted(out)
