"""A relay's verdict on the coordinator's silence, for the ranks behind it.

A rank behind a relay heartbeats the relay, which answers at the wait from what the coordinator
last told it; a coordinator that stops answering (frozen, partitioned: its connections stay open)
would go unnoticed by those ranks, and their long gets and barriers would wait for their own
deadlines. So the relay counts how long the coordinator has not answered it (any reply on its
upstream stream; the time its own loop ran behind left out, as a watcher does), and once that
passes the liveness bound it answers its ranks' heartbeats, held or new, at once with UNAVAILABLE
naming the silence, with the silence in seconds in the answer's metadata (:data:`SILENT_KEY`).
A rank's watcher takes that silence as its own (gridcomm._client.watcher): it declares the
coordinator lost at once, with the error a rank dialling the coordinator directly gets, and its
calls in flight through the relay end with it (gridcomm._client.inflight). The first answer from
the coordinator lifts the verdict.
"""

from __future__ import annotations

import grpc

from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._runtime.loop import lag_s

#: The metadata key of a relay's answer that says the coordinator is silent: seconds, as text.
SILENT_KEY = "gridcomm-coordinator-silent-s"

_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]


class Silence:
    """How long the coordinator has not answered a relay (times are the relay's loop's)."""

    def __init__(self, now: float) -> None:
        self._heard, self._lag = now, lag_s()
        #: Set once the silence passed the bound (and until the coordinator answers again).
        self.lost = False

    def heard(self, now: float) -> None:
        """A reply came from the coordinator."""
        self._heard, self._lag, self.lost = now, lag_s(), False

    def seconds(self, now: float) -> float:
        """Seconds without a reply, less the time this process's loop ran behind meanwhile."""
        return (now - self._heard) - max(0.0, lag_s() - self._lag)

    def left(self, now: float, bound: float) -> float:
        """Seconds until the silence passes ``bound`` (at least a little, so a wait can end there)."""
        return max(0.05, bound - self.seconds(now) + 0.01)


def silent_answer(op_id: int, relay: str, upstream: str, silent_s: float) -> pb.SessionResult:
    """A relay's answer to a rank's heartbeat while the coordinator has been silent ``silent_s``."""
    result = pb.SessionResult(id=op_id, code=_UNAVAILABLE,
                              details=f"relay {relay} has had no answer from the coordinator at {upstream} "
                                      f"for {silent_s:.1f} s")
    result.metadata.add(key=SILENT_KEY, value=f"{silent_s:.3f}")
    return result


def reported(exc: grpc.RpcError) -> float:
    """The coordinator's silence a relay's answer reports (0.0: it reports none)."""
    trailing = getattr(exc, "trailing_metadata", None)
    try:
        entries = trailing() if callable(trailing) else ()
        for key, value in entries or ():
            if key == SILENT_KEY:
                seconds = float(value)
                return seconds if seconds == seconds else 0.0
    except (TypeError, ValueError):
        pass
    return 0.0
