"""A client's Session streams and channels: to the coordinator, to its group's relay, and, on a
rank that hosts a relay, to that relay for its own barriers and gets; all on the background loop.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import grpc

from gridcomm._client import session as _session
from gridcomm._runtime import loop as _eventloop
from gridcomm._runtime.channel import make_aio_channel

if TYPE_CHECKING:
    from gridcomm._client.client import CoordinatorClient

log = logging.getLogger(__name__)


def session_stream(client: CoordinatorClient) -> _session.Session | None:
    """The Session stream this client's operations and the watcher's heartbeats ride: to the
    relay while there is one, else to the coordinator (None with GRIDCOMM_SESSION=off, or once
    closed)."""
    if client.session_mode == "off" or client._closed:
        return None
    session = client._session
    if session is not None and session.relay and session.closed:
        log.warning("rank %d: the relay at %s is gone; going to the coordinator at %s directly", client.rank,
                    client.relay_target, client.target)
        client.relay_target, session = None, None
    if session is None:
        if client.relay_target is not None:
            session = _session.Session(client.relay_target, client._metadata, client.relay_channel, relay=True)
        else:
            session = _session.Session(client.target, client._metadata, client.aio_channel)
        client._session = session
    return session


def own_relay_session(client: CoordinatorClient) -> _session.Session | None:
    """A rank that hosts its group's relay sends its barriers and gets through that relay, as
    its group does, so each reaches the coordinator inside the group's one aggregate: the
    coordinator then handles one message per group and barrier, not two. Its heartbeats stay
    on its own stream to the coordinator, so its process's death is seen there as soon as
    that stream drops. None (its own stream, then) before the join, without a relay, or
    once that stream broke (the relay lost the coordinator)."""
    if client.relay is None or not client._joined or client.session_mode == "off":
        return None
    session = client._own_relay
    if session is None:
        target = client.relay.target
        session = client._own_relay = _session.Session(
            target, client._metadata, lambda: _own_relay_channel(client, target), relay=True)
    return None if session.closed else session


def _own_relay_channel(client: CoordinatorClient, target: str) -> grpc.aio.Channel:
    if client._own_relay_aio is None:
        client._own_relay_aio = make_aio_channel(target, client.tls, relay=True)
    return client._own_relay_aio


def move_to_relay(client: CoordinatorClient, target: str) -> None:
    """After the join: this rank's stream goes to its group's relay from now on, and its
    connection to the coordinator is closed (its unary calls open one again if needed)."""
    client.relay_target = target
    session, client._session = client._session, None
    channel, client._aio = client._aio, None
    close_later(session, [channel] if channel is not None else [])


def release(client: CoordinatorClient) -> None:
    """What :meth:`CoordinatorClient.close` lets go of: its streams, its channels and the relay it
    hosts (which stops once its group is gone)."""
    own, client._own_relay = client._own_relay, None
    if own is not None:
        own_channel, client._own_relay_aio = client._own_relay_aio, None
        close_later(own, [own_channel] if own_channel is not None else [])
    relay, client.relay = client.relay, None
    if relay is not None:
        relay.stop_when_idle()
    channel, client._channel = client._channel, None
    if channel is not None:
        channel.close()
    session, client._session = client._session, None
    channels = [c for c in (client._aio, client._relay_aio) if c is not None]
    client._aio = client._relay_aio = None
    close_later(session, channels)


def close_later(session: _session.Session | None, channels: list[grpc.aio.Channel]) -> None:
    """Closes a Session stream, then channels, on the background loop (without waiting)."""
    running = _eventloop.current()
    if running is None or (session is None and not channels):
        return  # nothing to close, or the loop is gone (interpreter exit): so are its channels

    async def close_all() -> None:
        if session is not None:
            await session.close()
        for channel in channels:
            await channel.close()

    try:
        asyncio.run_coroutine_threadsafe(close_all(), running)
    except RuntimeError:
        pass  # the loop closed meanwhile (interpreter exit)
