"""A relay's aggregates: the same operation of several ranks, gathered until it goes up as one.

The same barrier arrival (name, sequence number, generation) or get (key) of several ranks, and the
first joins of the relay's group, go up as one operation naming them all; which operations make one
aggregate, and what an aggregate is while it waits for the rest of its ranks (see
gridcomm._relay.upstream, which sends them).
"""

from __future__ import annotations

from typing import Any

from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._relay.children import Child

#: The longest a barrier arrival (or a first join) waits at the relay for the rest of the relay's
#: ranks before it goes up. Why bounded: what the coordinator knows of a barrier or a rendezvous
#: (`gridcomm status`, the list of missing ranks a wait names) lags by this much for ranks whose
#: sibling does not come.
HOLD_S = 1.0

#: Barriers a relay remembers having sent up (so that a repeated long poll is not held).
WENT_UP_KEPT = 256


def group_key(kind: str, request: Any) -> tuple[Any, ...] | None:
    """What makes the same operation of several ranks one aggregate (None: it goes up alone)."""
    if kind == "join":
        if request.generation or request.recovery or request.relay_address:
            return None  # a recovery, a replacement's or a relay host's join: its own answer
        return ("join", request.job_id, request.world_size, request.wants_relay, request.relay_rank)
    if kind == "barrier":
        caller = request.caller
        return ("barrier", caller.job_id, caller.generation, request.name, request.seq, tuple(request.participants))
    if kind == "get" and not request.offset:
        caller = request.caller
        return ("get", caller.job_id, caller.generation, request.key)
    return None


def rank_of(kind: str, request: Any) -> int:
    """The rank an operation that can be aggregated is made by."""
    return int(request.rank) if kind == "join" else int(request.caller.rank)


#: (child, the child's op id, the child's op): who an upstream operation answers.
Route = list[tuple[Child, int, pb.SessionOp]]


class Group:
    """The same operation of several ranks, gathered until it goes up as one aggregate."""

    __slots__ = ("route", "waiting", "opened")

    def __init__(self, route: Route, waiting: set[int] | None, opened: float) -> None:
        self.route = route
        #: Loop time of its first operation's arrival.
        self.opened = opened
        #: Whom it waits for that has not arrived (None or empty: it goes up at the next write);
        #: it goes up at ``opened + HOLD_S`` whoever is missing.
        self.waiting = waiting
