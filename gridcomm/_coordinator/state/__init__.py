"""Rendezvous, recovery, key-value, barrier and liveness decisions as plain state.

No gRPC calls, no asyncio, no clock reads: the caller passes ``now`` (seconds, monotonic) into
every method that needs time, so every branch is unit-tested with an injected clock and no
network. The servicer owns the waiting; this package only decides. :class:`JobState` is the one
object the servicer talks to; its parts, one module each: ``membership`` (the rendezvous,
replacements, rebuild/shrink, identity checks), ``keyvalue``, ``barriers``, ``liveness`` (leaves,
failures, heartbeat expiry), on the vocabulary of ``common``.
"""

from __future__ import annotations

from gridcomm._coordinator.state.common import (
    ABORTED,
    ALREADY_EXISTS,
    FAILED_PRECONDITION,
    INVALID_ARGUMENT,
    NOT_FOUND,
    RESOURCE_EXHAUSTED,
    Failure,
    Limits,
    Member,
    MemberState,
    StateError,
    process_tag,
    quote,
)
from gridcomm._coordinator.state.membership import REBUILD, SHRINK, JobState, Recovery

__all__ = [
    "ABORTED",
    "ALREADY_EXISTS",
    "FAILED_PRECONDITION",
    "INVALID_ARGUMENT",
    "NOT_FOUND",
    "REBUILD",
    "RESOURCE_EXHAUSTED",
    "SHRINK",
    "Failure",
    "JobState",
    "Limits",
    "Member",
    "MemberState",
    "Recovery",
    "StateError",
    "process_tag",
    "quote",
]
