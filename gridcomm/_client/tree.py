"""A client's place in the relay tree: whether it hosts its group's relay, joins through one, or
joins the coordinator directly (GRIDCOMM_RELAY, GRIDCOMM_RELAY_FANIN, GRIDCOMM_RELAY_ADDRESSES, or
the coordinator's direction: gridcomm._client.directed), and the join through a group's relay.

The one place a client starts a relay (:func:`host_relay`, which imports gridcomm._relay only then:
a rank that hosts none loads no relay code).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import time
from typing import TYPE_CHECKING

from gridcomm import _config
from gridcomm._client import directed as _directed
from gridcomm._client import session as _session
from gridcomm._client.streams import close_later
from gridcomm._errors import CommAborted, ConfigError, GridcommError
from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._relay.tls import RelayTlsError, serving_identity_problem
from gridcomm._runtime import loop as _eventloop
from gridcomm._wire import translate

if TYPE_CHECKING:
    from gridcomm._client.client import CoordinatorClient

log = logging.getLogger(__name__)


def decide(client: CoordinatorClient, until: float | None = None) -> None:
    """The relay tree (GRIDCOMM_RELAY, GRIDCOMM_RELAY_FANIN): rank ``k x fanin`` hosts a relay
    for its group and joins directly; the others join through it. Where the relays' addresses
    are known (GRIDCOMM_RELAY_ADDRESSES) every rank decides alone; otherwise the coordinator
    directs each rank's join (see gridcomm._client.directed), asked until ``until``."""
    settings = client.settings
    if client.relay_target is not None or client.session_mode == "off" or settings.relay_mode == "off":
        return  # a node agent's relay (gridcomm launch), or none
    if settings.relay_mode == "auto" and client.world_size < _config.RELAY_AUTO_WORLD:
        return
    problem = serving_identity_problem(client.tls)
    if problem is not None:
        # Every rank decides alike from the job's TLS files: no relay would serve its members.
        if settings.relay_mode == "on":
            raise ConfigError(f"rank {client.rank}: GRIDCOMM_RELAY=on, but {problem}; set them on every rank "
                              "or GRIDCOMM_RELAY=auto (no relays then) or off.")
        return
    template = settings.relay_addresses
    if template is None and not client._joined:
        directed(client, time.monotonic() + client.timeout_s / 2 if until is None else until)
        return
    fanin = settings.fanin(client.world_size)
    leader = client.rank - client.rank % fanin
    if leader != client.rank:
        client._relay_rank = leader
        if template is not None and not client._joined:
            # Its relay's address is known before the join: the join goes there too.
            client._relay_join = _config.format_relay_address(template, leader, leader // fanin)
        return
    host_relay(client, leader, fanin, template)


def directed(client: CoordinatorClient, until: float) -> None:
    """The directed join: the coordinator says whether this rank hosts its group's relay, joins
    through it (then this rank's connection to the coordinator is closed: it needs none), or
    joins the coordinator directly."""
    fanin = client.settings.fanin(client.world_size)
    if client.rank % fanin == 0:
        host_relay(client, client.rank, fanin, None)  # before it asks: its first contact names it
    answer = _directed.ask(client, until, client.relay.target if client.relay is not None else "")
    if answer is None:
        return
    if client.relay is not None and not answer.host_relay:
        relay, client.relay = client.relay, None  # the coordinator's groups are not this rank's guess
        relay.stop()
    if answer.host_relay:
        if client.relay is not None:  # named in the first contact: it stays, for the coordinator's group
            client.relay.regroup(range(client.rank + 1, min(client.rank + answer.fanin, client.world_size)))
        host_relay(client, answer.leader, answer.fanin, None)
        return
    if answer.leader != client.rank:
        client._relay_rank = answer.leader  # a direct join's answer names the relay if one comes
    if answer.relay_address:
        client._relay_join = answer.relay_address


def host_relay(client: CoordinatorClient, leader: int, fanin: int, template: str | None) -> None:
    """Hosts the relay of the group of ``fanin`` ranks that this rank (``leader``) leads."""
    if leader + 1 >= client.world_size or client.relay is not None:
        return  # a group of one: nobody to relay for
    from gridcomm._relay.server import Relay
    from gridcomm._runtime.address import local_address

    port, name = 0, None
    if template is not None:
        name, port = _config.parse_target(_config.format_relay_address(template, leader, leader // fanin))
    try:
        client.relay = Relay(client.target, token=client.settings.token, tls=client.tls,
                             bind=local_address(client.host), port=port,
                             ranks=range(leader + 1, min(leader + fanin, client.world_size)),
                             tls_name=name, world_size=client.world_size).start()
    except RelayTlsError:
        raise  # its members could not dial it: a clear error now, not their timeouts
    except GridcommError as exc:
        # Its group then dials the coordinator directly: slower at scale, never wrong.
        log.warning("rank %d: hosts no relay for its group: %s", client.rank, exc)


def join_through_relay(client: CoordinatorClient, request: pb.JoinRequest, what: str, call_s: float,
                       until: float) -> pb.JoinResponse | None:
    """The join through this rank's group relay (GRIDCOMM_RELAY_ADDRESSES), so the coordinator
    is not dialled by every rank. A relay that does not answer yet (its rank's pod is still
    starting) is waited for until ``until``; then None: the join goes to the coordinator
    directly, and the join's answer moves the stream to the relay if it came up."""
    target = client._relay_join
    assert target is not None
    began = time.monotonic()
    why = "it was not listening"
    backoff = 0.1
    while (left := until - time.monotonic()) > 0:
        if client._closed:
            raise CommAborted(f"{what}: this client was closed.")
        client.relay_target = target
        # Why wait for the connection rather than try and sleep: gRPC dials a relay that is not
        # listening yet again on its own, every RELAY_RECONNECT_MAX_MS at most, and the join
        # goes the moment it connects. Tried and slept in Python, each attempt (a stream, at
        # once refused) cost this process's loop, which at 64 ranks a process also had to start
        # the relay, and ranks found their relay seconds after it listened.
        if not relay_connected(client, left):
            continue
        session = client._session
        if session is None or session.closed or not session.relay:
            session = _session.Session(target, client._metadata, client.relay_channel, relay=True,
                                       wait_for_ready=False)
            client._session = session
        try:
            return session.call("join", request, call_s)
        except _session.OpError as exc:
            raise translate(exc, what, target) from None
        except _session.StreamBroken as exc:
            why = str(exc)  # connected, but the stream ended (the relay lost the coordinator?)
            time.sleep(min(max(0.0, until - time.monotonic()), backoff * (0.5 + random.random())))
            backoff = min(2.0, backoff * 2)
    log.info("rank %d: the relay at %s did not answer within %.0f s (%s); joining the coordinator at %s "
             "directly", client.rank, target, time.monotonic() - began, why, client.target)
    client._relay_join = None
    session, client._session = client._session, None
    channel, client._relay_aio = client._relay_aio, None
    client.relay_target = None
    close_later(session, [channel] if channel is not None else [])
    return None


def relay_connected(client: CoordinatorClient, timeout_s: float) -> bool:
    """Waits, at most ``timeout_s``, until the channel to the relay (relay_target) is connected."""
    async def connected() -> None:
        await asyncio.wait_for(client.relay_channel().channel_ready(), timeout_s)

    future = asyncio.run_coroutine_threadsafe(connected(), _eventloop.loop())
    try:
        future.result(timeout_s + 5.0)  # the slack: this process's loop may run behind
        return True
    except (asyncio.TimeoutError, concurrent.futures.TimeoutError):
        future.cancel()
        return False
    except Exception as exc:  # noqa: BLE001 - the channel was closed meanwhile (the client was)
        log.debug("rank %d: waiting for the relay at %s: %r", client.rank, client.relay_target, exc)
        time.sleep(0.1)
        return False
