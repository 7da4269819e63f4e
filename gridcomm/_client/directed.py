"""The directed join, a rank's side: where a rank of the relay tree that knows no relay address
(no GRIDCOMM_RELAY_ADDRESSES) joins. It asks the coordinator (``JoinRequest.first_contact``),
which answers at once: host the group's relay, join through the relay at HOST:PORT, come back
later, or join directly (see gridcomm._coordinator.tree). Between asks the rank waits with
jitter, so the ranks of a group whose relay is late do not come back together.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import time
from typing import Any

import grpc

from gridcomm._errors import ConfigError, CoordinatorUnavailable, RendezvousTimeout
from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._proto import coordinator_pb2_grpc as pb_grpc
from gridcomm._runtime import loop as _eventloop
from gridcomm._runtime.channel import make_aio_channel
from gridcomm._wire import WIRE, translate, wire_mismatch

log = logging.getLogger("gridcomm")

#: The longest one ask may take (the coordinator answers at once; more is a coordinator that is
#: not up yet or overloaded, and the ask is made again after a pause).
ASK_TIMEOUT_S = 10.0
#: The pause after an ask that got no answer, doubled each time up to the maximum, with jitter.
ASK_BACKOFF_S = 0.2
ASK_BACKOFF_MAX_S = 2.0
#: How many ranks of a job may ask at once unpaced (about what a listen queue and the coordinator
#: take in one burst), and the rate the first asks of a larger job's members are spread at (the
#: coordinator answers about 5,000 asks a second on one core). Why pace: asks sent faster than the
#: coordinator answers wait in its queue, each holding a call and a connection there (~10-13 KB),
#: time out and come again; spread, they are answered as they come.
PACE_FREE = 4096
PACE_RATE = 4000.0


def start_delay_s(world_size: int) -> float:
    """How long a member of a job of ``world_size`` ranks waits before its first ask: uniform over
    the spread its job's size needs (none up to :data:`PACE_FREE` ranks; 15 s at 65,536). A
    leader asks at once, so that its members find its relay registered when they ask."""
    return random.random() * max(0, world_size - PACE_FREE) / PACE_RATE


def jittered(seconds: float) -> float:
    """``seconds`` spread over 0.5x to 1.5x, so that ranks told alike do not come back alike."""
    return seconds * (0.5 + random.random())


class Asker:
    """The channel the asks go on: on the background loop, without the unary retry policy (the
    asks are repeated here; parsing the policy costs as much as the rest of making a channel),
    closed once the rank is directed. Why not the synchronous stub: a unary call there is a future,
    and each synchronous channel with one in flight runs a thread of its own, which for thousands
    of ranks in a process cost more CPU than the join."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.channel: grpc.aio.Channel | None = None

    def stub(self) -> pb_grpc.CoordinatorStub:
        if self.channel is None:
            self.channel = make_aio_channel(self.client.target, self.client.tls, retries=False)
        return pb_grpc.CoordinatorStub(self.channel)

    def close(self) -> None:
        channel, self.channel = self.channel, None
        if channel is not None:
            asyncio.run_coroutine_threadsafe(channel.close(), _eventloop.loop())


def _ask_once(asker: Asker, request: pb.JoinRequest, what: str, timeout_s: float) -> pb.JoinResponse:
    """One ask, on the background loop."""
    client = asker.client

    async def call() -> pb.JoinResponse:
        stub = asker.stub()
        answer: pb.JoinResponse = await stub.Join(request, timeout=timeout_s, metadata=client.metadata,
                                                  wait_for_ready=True)
        return answer

    future = asyncio.run_coroutine_threadsafe(call(), _eventloop.loop())
    try:
        return future.result(timeout_s + 5.0)  # the slack: this process's loop may run behind
    except concurrent.futures.TimeoutError:
        future.cancel()
        raise RendezvousTimeout(f"{what}: no answer from the coordinator at {client.target} within "
                                f"{timeout_s:.1f} s.") from None
    except grpc.RpcError as exc:
        raise translate(exc, what, client.target) from None


def ask(client: Any, until: float, relay_address: str = "") -> pb.JoinResponse | None:
    """Asks the coordinator where ``client``'s rank joins, again as told, until it is told where
    or ``until`` (monotonic) passes. ``relay_address``: the relay this rank already hosts, in case
    it leads its group (then its members are sent there from this ask on). Returns the answer that directs it (``host_relay``,
    ``relay_address``, or neither: join directly), or None: no direction in time (or a
    coordinator that does not direct joins); the rank then joins the coordinator directly."""
    asker = Asker(client)
    try:
        return _ask(client, asker, until, relay_address)
    finally:
        asker.close()


def _ask(client: Any, asker: Asker, until: float, relay_address: str) -> pb.JoinResponse | None:
    what = f"rank {client.rank}: first contact"
    backoff = ASK_BACKOFF_S
    asks = 0
    if not relay_address:  # a member (a leader names its relay, and asks at once)
        time.sleep(min(max(0.0, until - time.monotonic()), start_delay_s(client.world_size)))
    while (left := until - time.monotonic()) > 0:
        request = pb.JoinRequest(job_id=client.job_id, rank=client.rank, world_size=client.world_size, wire=WIRE,
                                 incarnation=client.incarnation, hostname=client.hostname, first_contact=True,
                                 fanin=client.settings.relay_fanin or 0, relay_address=relay_address)
        asks += 1
        try:
            answer = _ask_once(asker, request, what, min(left, ASK_TIMEOUT_S))
        except (RendezvousTimeout, CoordinatorUnavailable) as exc:
            pause = min(max(0.0, until - time.monotonic()), jittered(backoff))
            log.debug("%s: no answer (%s); asking again in %.1f s", what, exc, pause)
            time.sleep(pause)
            backoff = min(ASK_BACKOFF_MAX_S, backoff * 2)
            continue
        problem = wire_mismatch(answer.wire, client.target)
        if problem is not None:
            raise ConfigError(f"{what}: {problem}")
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
