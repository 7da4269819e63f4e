"""Ranks behind a relay whose connection to it dropped: failed within the connection grace.

A rank that dials the coordinator directly and dies is seen at once: its held heartbeat call is
cancelled, and it is failed unless it heartbeats again within the connection grace (see
Servicer._check_lost). A rank behind a relay has its held heartbeat at the relay; when its Session
stream to the relay ends without its leaving, the relay names the process (rank, incarnation) in
its next heartbeat upstream (``Aggregate.lost``), and the coordinator applies the same rule: a
grace in which its own loop kept up and no heartbeat of that process arrived, then the failure.

A relay is believed only for what it carried: a process is reported lost only by the Session
stream its latest heartbeat came on (a relay's aggregate, or the process's own heartbeat through
that relay), and only as the process the coordinator holds for the rank. So a token holder can
report nobody but ranks whose heartbeats it carries; any other report is ignored, for it alone.
And a rank that re-dialled the coordinator directly before its relay's report came is not failed
by it: its latest heartbeat came on another stream.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
from collections.abc import Callable
from typing import Any

from gridcomm._coordinator.state import JobState
from gridcomm._runtime.lag import LagMeter

log = logging.getLogger(__name__)

#: The Session stream an operation came on (None: a unary call). Set by ServerSession.serve; the
#: tasks it makes for its operations inherit it.
STREAM: contextvars.ContextVar[int | None] = contextvars.ContextVar("gridcomm_session_stream", default=None)
_streams = itertools.count(1)

#: The longest relay address a report is named with (it comes off the wire).
_MAX_ADDRESS = 120


def enter_stream() -> None:
    """Marks the current task (a Session stream's) and the tasks it makes as that stream's."""
    STREAM.set(next(_streams))


class RelayLosses:
    """Which stream carries each rank's heartbeats, and the checks of the processes relays
    report lost."""

    def __init__(self, state: JobState, loop: asyncio.AbstractEventLoop, lag: LagMeter, grace: Callable[[], float],
                 closing: Callable[[], bool], fail: Callable[[int, str], None]) -> None:
        self._state, self._loop, self._lag = state, loop, lag
        self._grace, self._closing, self._fail = grace, closing, fail
        #: rank -> the Session stream its latest heartbeat, or its join once answered as joined, came
        #: on (None: a unary call). Why not a join still waiting in the rendezvous: a rank whose
        #: stream drops there joins again, as a direct one does; a client short of CPU may re-dial
        #: mid-join, and counting its waiting join would fail a live rank after the grace.
        self._via: dict[int, int | None] = {}

    # ------------------------------------------------------------------ what carries whom
    def heard(self, rank: int) -> None:
        """A heartbeat of ``rank`` came (directly, or in a relay's aggregate) on the current stream."""
        self._via[rank] = STREAM.get()

    def heard_relayed(self, ranks: list[int]) -> None:
        stream = STREAM.get()
        via = self._via
        for rank in ranks:
            via[rank] = stream

    # ------------------------------------------------------------------ reports
    def report(self, aggregate: Any) -> None:
        """A relay's heartbeat names processes whose stream to it ended without their leaving
        (``aggregate.lost``, a gridcomm.v1.Aggregate)."""
        lost = aggregate.lost
        if not lost:
            return
        stream = STREAM.get()
        relay = aggregate.relay[:_MAX_ADDRESS].strip() or "?"
        if not relay.isprintable():
            relay = "?"
        if len(lost) > max(1, self._state.world_size):
            log.warning("coordinator: a relay at %s reports %d lost ranks, more than the job's %d; ignored", relay,
                        len(lost), self._state.world_size)
            return
        for rank, incarnation in ((r.rank, r.incarnation) for r in lost):
            member = self._state.members.get(rank)
            if (stream is None or member is None or member.incarnation != incarnation
                    or self._via.get(rank) != stream or not self._state.lost_connection(member, member.last_heartbeat)):
                # Not a process this stream carries (or no longer, or not joined): ignored, for this relay alone.
                log.info("coordinator: a relay at %s reports rank %d lost, a process whose heartbeats it does not "
                         "carry; ignored", relay, rank)
                continue
            self._loop.call_later(self._grace(), self._check, member, member.last_heartbeat, self._lag.total_s,
                                  relay)

    def _check(self, member: Any, beat: float | None, lag_then: float, relay: str) -> None:
        state = self._state
        if self._lag.total_s - lag_then > self._grace() / 4:
            # As Servicer._check_lost: this loop fell behind during the grace, so the rank's next
            # heartbeat may be unread yet; looked at again after a grace in which it kept up.
            if state.lost_connection(member, beat) and not self._closing():
                self._loop.call_later(self._grace(), self._check, member, beat, self._lag.total_s, relay)
            return
        if state.lost_connection(member, beat):
            self._fail(member.rank, f"rank {member.rank} on {member.hostname or '?'} lost its connection to its "
                       f"relay at {relay} without leaving (process killed, crashed, or network cut)")
