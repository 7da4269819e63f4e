"""The gridcomm error hierarchy.

Every error a caller can see from gridcomm is a :class:`GridcommError` subclass; gRPC and CuPy
exceptions are wrapped (``raise ... from exc``) so callers never handle ``grpc.RpcError``.
"""

from __future__ import annotations

from collections.abc import Sequence


class GridcommError(Exception):
    """Raised for every gridcomm failure; the base of all gridcomm errors."""


class ConfigError(GridcommError, ValueError):
    """Raised when an argument, environment variable or request is invalid; the message names the
    setting, the value and the fix."""


class RendezvousTimeout(GridcommError, TimeoutError):
    """Raised when a join, barrier or key lookup did not complete within its deadline."""

    #: The ranks that were still awaited, sorted (empty when unknown).
    missing_ranks: list[int]
    #: The coordinator's own words for the wait (its status details), without the caller's
    #: prefix; empty when the error was not made from a coordinator's answer.
    details: str
    #: Whether the coordinator answered this wait (it ended a long-poll slice with the ranks it
    #: still waits for), as opposed to no answer within the call's deadline: the client's
    #: progress reports tell "still waiting for ranks" from "the coordinator does not answer".
    from_server: bool

    def __init__(self, message: str, missing_ranks: Sequence[int] = (), *, details: str = "",
                 from_server: bool = False) -> None:
        super().__init__(message)
        self.missing_ranks = sorted(missing_ranks)
        self.details = details
        self.from_server = from_server


class RankFailedError(GridcommError):
    """Raised on every surviving rank when another rank died, hung, lost its network or reported an
    error. ``rank`` is the failed rank (-1 when unknown) and ``reason`` says why."""

    def __init__(self, message: str, rank: int = -1, reason: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.reason = reason


class RankStalled(RankFailedError):
    """Raised on every rank when a live rank (``rank``) stopped making progress: its peers waited
    in a collective or barrier it did not enter for ``GRIDCOMM_STALL_TIMEOUT_S``, or a collective
    every rank entered did not return. The stalled rank writes its threads' stacks to stderr and
    its liveness turns NOT_SERVING (kubelet restarts it). Catchable as :class:`RankFailedError`
    (``rebuild()`` gets a replacement)."""


class CollectiveMismatch(RankFailedError):
    """Raised on every rank when ranks called different collectives at the same position of a
    communicator (``GRIDCOMM_DEBUG=collectives``): the message names the position, both calls and
    their ranks; ``rank`` is the odd one out. Catchable as :class:`RankFailedError`."""


class AuthenticationError(GridcommError):
    """Raised when the coordinator refused the caller's token or TLS credentials."""


class CommAborted(GridcommError):
    """Raised when a communicator was aborted (by ``abort()``) or used after ``stop()``."""


class CoordinatorUnavailable(GridcommError, ConnectionError):
    """Raised when the coordinator cannot be reached (not listening, unresolvable, or gone) within
    the deadline."""


class CoordinatorRestarted(CoordinatorUnavailable):
    """Raised when the coordinator no longer knows this job: it restarted and lost the job's state
    (members, generation, keys), so a rank that had joined is a stranger to it. Not a mistake in
    this rank's configuration: restart every rank of the job so that they meet at the new
    coordinator. Catchable as :class:`CoordinatorUnavailable`."""


class CoordinatorLost(RankFailedError, CoordinatorUnavailable):
    """Raised on every other rank when the coordinator hosted inside rank 0 stopped answering:
    rank 0 is taken as failed (``rank == 0``). Catchable as either parent."""


class DataPlaneError(GridcommError):
    """Raised when a host-backend peer connection breaks the data-plane protocol: bytes that are not
    a valid frame, a message of another size or for another call than this rank expected, or a
    handshake that does not follow the protocol. The message names both ranks and the address."""


class ArgumentError(ConfigError):
    """Raised when a collective is called with an invalid array, shape, dtype, op, root or peer."""


def coordinator_lost(error: GridcommError, coordinator_rank: int | None) -> GridcommError:
    """``error`` as seen by a rank whose coordinator lives in ``coordinator_rank``'s process: an
    unreachable coordinator is that rank's failure. Other errors pass through."""
    if coordinator_rank is None or not isinstance(error, CoordinatorUnavailable) or isinstance(error, CoordinatorLost):
        return error
    return CoordinatorLost(f"rank {coordinator_rank} failed (it hosts the coordinator): {error}",
                           rank=coordinator_rank, reason=str(error))
