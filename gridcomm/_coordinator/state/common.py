"""The vocabulary of a job's state: refusal codes, members, failures, limits, and the base every
part of the state shares. Pure: no gRPC, no asyncio, no clock reads."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import secrets

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
                 predecessor_alive: bool = False, restarted: bool = False, failed_cause: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.failed_rank = failed_rank
        #: The failure's cause ("stall", "mismatch"; "" for a death, silence or report).
        self.failed_cause = failed_cause
        #: A new process asked for a rank whose process still looks alive (see JobState._admit).
        self.predecessor_alive = predecessor_alive
        #: The caller says it joined a generation this coordinator never formed: the coordinator
        #: restarted and lost the job's state (the client raises CoordinatorRestarted).
        self.restarted = restarted


class MemberState(enum.IntEnum):
    JOINED = 1
    LEFT = 2
    FAILED = 3


@dataclasses.dataclass(slots=True)
class Member:
    """One process's record of a rank (one per rank of the job: slotted, as the coordinator keeps
    one for each of up to 100,000 ranks)."""

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
    #: When the coordinator answered this member's join (it could heartbeat from then on).
    reachable_at: float | None = None
    #: The coordinator's cumulative lag (see gridcomm._runtime.lag) at last_heartbeat, or at
    #: reachable_at before the first heartbeat: lag after it is not counted as the member's silence.
    lag_mark: float = 0.0


@dataclasses.dataclass(frozen=True)
class Failure:
    rank: int
    reason: str
    at: float
    reported_by: int
    #: "" (a death, a silence or a report), "stall" or "mismatch" (see state.progress).
    cause: str = ""


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one job's state may hold. Why bounded in bytes: any rank that holds the token can set
    keys and open barriers, and a buggy or hostile one must meet a clear RESOURCE_EXHAUSTED long
    before the coordinator's process meets its memory limit (the shipped coordinator pod has 1 GiB).

    Every byte the state keeps for a key, a value (whole or arriving in pieces) or a barrier counts
    against one budget, :meth:`state_budget`, with the bookkeeping Python keeps beside it (see
    ``KeyValue`` and ``Barriers``)."""

    max_key_bytes: int = 1024
    max_value_bytes: int = 64 * 1024 * 1024
    max_keys: int = 1_000_000
    #: Keys, values and values arriving in pieces, in bytes (None: only the state budget binds).
    max_total_value_bytes: int | None = None
    #: The state budget: this much, plus ``state_bytes_per_rank`` for every rank of the job (a
    #: larger job keeps more per-rank keys, and a barrier of every rank costs 8 bytes per rank).
    max_state_bytes: int = 256 * 1024 * 1024
    state_bytes_per_rank: int = 1024
    #: Barrier names with an instance some rank waits at (a barrier every member passed is not
    #: pending: it costs its name and a few words, and is dropped when room is needed), in all and
    #: opened by one rank (its arrival was the first at an instance not yet complete).
    max_pending_barriers: int = 10_000
    max_pending_barriers_per_rank: int = 1_000
    #: A barrier every member passed is kept at least this long (a rank may repeat its arrival
    #: after a broken stream or a wait's slice), and then only while room allows.
    barrier_retain_s: float = 300.0
    #: Calls of one rank that wait at once (gets of keys not yet set, barriers, its join); the
    #: relay of a group carries its group's waits as one each.
    max_waits_per_rank: int = 1024
    max_name_bytes: int = 1024
    max_hostname_bytes: int = 256
    #: A pre-rendezvous member with no call in flight for this long may be replaced by a new
    #: incarnation (its process died while joining); a live one re-polls well within it.
    stale_join_s: float = 2.0

    def state_budget(self, world_size: int) -> int:
        """The bytes a job of ``world_size`` ranks may keep in keys, values and barriers."""
        return self.max_state_bytes + self.state_bytes_per_rank * world_size


class StateBase:
    """What every part of a job's state reads: its size, members, generation and failures (set up
    by :class:`~gridcomm._coordinator.state.membership.JobState`)."""

    world_size: int
    job_id: str
    limits: Limits
    #: Formed generations on the wire's count (0: the first rendezvous has not completed).
    generation: int
    members: dict[int, Member]
    failures: list[Failure]
    _failed: dict[int, Failure]
    left_count: int
    completed_at: float | None
    #: Every rank of the generation, as one shared tuple (see JobState.__init__).
    _everyone: tuple[int, ...]

    @property
    def complete(self) -> bool:
        return self.generation > 0

    @property
    def failed(self) -> bool:
        return bool(self._failed)

    def _failure_error(self, what: str) -> StateError:
        first = self.failures[0]
        return StateError(ABORTED, f"{what}: rank {first.rank} failed: {first.reason}", failed_rank=first.rank,
                          failed_cause=first.cause)

    def check_not_failed(self, what: str) -> None:
        if self._failed:
            raise self._failure_error(what)

    def _drop_pieces(self, rank: int) -> None:
        """A rank that left or failed will not finish its values in pieces (see KeyValue)."""

    # What the state holds, in bytes, against Limits.state_budget (see KeyValue and Barriers).
    _kv_bytes: int
    _pieces_cost: int
    _barrier_bytes: int

    def _state_bytes(self) -> int:
        return self._kv_bytes + self._pieces_cost + self._barrier_bytes

    def _budget(self) -> int:
        return self.limits.state_budget(self.world_size)

    def _full_error(self, what: str, grow: int) -> StateError:
        return StateError(
            RESOURCE_EXHAUSTED,
            f"{what} was refused: it needs {grow} bytes, and the coordinator's state holds {self._state_bytes()} of its "
            f"{self._budget()} bytes (keys {self._kv_bytes}, values in pieces {self._pieces_cost}, barriers "
            f"{self._barrier_bytes}); does a rank set keys or open barrier names without end?",
        )


#: The key of process_tag: random per coordinator process, so a tag cannot be matched against
#: guessed incarnations.
_TAG_KEY = secrets.token_bytes(16)


def process_tag(incarnation: int) -> str:
    """What answers and messages show for a process instead of its incarnation (8 hex digits).

    Why: the incarnation, 64 random bits only its process and the coordinator know, is what
    proves a call comes from that rank's process; shown to one token holder, it would let that
    holder heartbeat as a dead rank or report it failed. The tag tells processes apart (a
    replacement has another) and cannot be turned back into the incarnation."""
    return hashlib.blake2s(incarnation.to_bytes(8, "little"), key=_TAG_KEY, digest_size=4).hexdigest()
