"""The vocabulary of a job's state: refusal codes, members, failures, limits, and the base every
part of the state shares. Pure: no gRPC, no asyncio, no clock reads."""

from __future__ import annotations

import dataclasses
import enum

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


@dataclasses.dataclass


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
