"""The directed join, a rank's side: where a rank of the relay tree that knows no relay address
(no GRIDCOMM_RELAY_ADDRESSES) joins. It asks the coordinator (``JoinRequest.first_contact``),
which answers at once: host the group's relay, join through the relay at HOST:PORT, come back
later, or join directly (see gridcomm._coordinator.tree). Between asks the rank waits with
jitter, so the ranks of a group whose relay is late do not come back together.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

from gridcomm._errors import CoordinatorUnavailable, RendezvousTimeout
from gridcomm._proto import coordinator_pb2 as pb

log = logging.getLogger("gridcomm")

#: The longest one ask may take (the coordinator answers at once; more is a coordinator that is
#: not up yet or overloaded, and the ask is made again after a pause).
ASK_TIMEOUT_S = 10.0
#: The pause after an ask that got no answer, doubled each time up to the maximum, with jitter.
ASK_BACKOFF_S = 0.2
ASK_BACKOFF_MAX_S = 2.0


def jittered(seconds: float) -> float:
    """``seconds`` spread over 0.5x to 1.5x, so that ranks told alike do not come back alike."""
    return seconds * (0.5 + random.random())


def ask(client: Any, until: float) -> pb.JoinResponse | None:
    """Asks the coordinator where ``client``'s rank joins, again as told, until it is told where
    or ``until`` (monotonic) passes. Returns the answer that directs it (``host_relay``,
    ``relay_address``, or neither: join directly), or None: no direction in time (or a
    coordinator that does not direct joins); the rank then joins the coordinator directly."""
    what = f"rank {client.rank}: first contact"
    backoff = ASK_BACKOFF_S
    asks = 0
    while (left := until - time.monotonic()) > 0:
        request = pb.JoinRequest(job_id=client.job_id, rank=client.rank, world_size=client.world_size,
                                 incarnation=client.incarnation, hostname=client.hostname, first_contact=True,
                                 fanin=client.settings.relay_fanin or 0)
        asks += 1
        try:
            answer: pb.JoinResponse = client._call(client._stub.Join, request, what, min(left, ASK_TIMEOUT_S),
                                                   wait_for_ready=True)
        except (RendezvousTimeout, CoordinatorUnavailable) as exc:
            pause = min(max(0.0, until - time.monotonic()), jittered(backoff))
            log.debug("%s: no answer (%s); asking again in %.1f s", what, exc, pause)
            time.sleep(pause)
            backoff = min(ASK_BACKOFF_MAX_S, backoff * 2)
            continue
        if answer.fanin == 0:
            return None  # a coordinator that does not direct joins answered as to a join
        if answer.retry_after_s > 0:
            time.sleep(min(max(0.0, until - time.monotonic()), jittered(answer.retry_after_s)))
            continue
        log.debug("%s: directed after %d ask(s): %s", what, asks,
                  "host the relay" if answer.host_relay else answer.relay_address or "join directly")
        return answer
    log.info("%s: not directed within the grace; joining the coordinator directly", what)
    return None
