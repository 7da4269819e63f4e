"""Channels to the coordinator: options, credentials, the unary retry policy (one place for the
synchronous client and the background loop's streams)."""

from __future__ import annotations

import json
from typing import Any

import grpc

from gridcomm import _config
from gridcomm._runtime import loop as _eventloop
from gridcomm._wire import CHUNK_BYTES, MAX_MESSAGE_BYTES, MAX_REQUEST_BYTES, SERVICE_NAME

_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                # Unary calls only: the channel does not re-send a Session stream that breaks;
                # the client repeats the operations it carried as unary calls instead (each one
                # is idempotent), so a retry here would only duplicate that.
                "name": [{"service": SERVICE_NAME, "method": m} for m in
                         ("Join", "Set", "Get", "Barrier", "Heartbeat", "ReportFailure", "Leave", "Status")],
                "retryPolicy": {
                    "maxAttempts": 5,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)


#: The longest gap between a rank's attempts to reach its group's relay (gRPC's reconnect backoff
#: on a channel to a relay; 1 s to the coordinator). Why short: a member whose relay's pod starts
#: after it waits for the relay (see gridcomm._client.tree.join_through_relay), and finds it this long
#: after it listens at most; at 1 s the ranks of a 2,048-rank job found theirs 1.0-1.9 s after
#: the last one listened. An attempt at a port nobody listens on costs a refused connect.
RELAY_RECONNECT_MAX_MS = 250


def channel_options(retries: bool = True, *, relay: bool = False) -> list[tuple[str, Any]]:
    """The channel's options; ``retries=False`` leaves out the unary retry policy (a call then
    says at once whether the coordinator's port refused it); ``relay``: a channel to a relay, which
    carries Session streams only (never retried by the channel: see _SERVICE_CONFIG), so it has no
    retry policy either (parsing it cost as much as the rest of making a channel)."""
    if relay:
        return [(k, RELAY_RECONNECT_MAX_MS if k == "grpc.max_reconnect_backoff_ms" else v)
                for k, v in channel_options(False)]
    if not retries:
        return [o for o in channel_options() if o[0] not in ("grpc.enable_retries", "grpc.service_config")] + [
            ("grpc.enable_retries", 0)]
    return [
        # Why: simulated ranks in one process must not share one connection (~2,000 parked calls
        # over one channel failed here).
        ("grpc.use_local_subchannel_pool", 1),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_REQUEST_BYTES),
        # Why generous: liveness comes from heartbeats and connection loss, not keepalive; an
        # overloaded peer (thousands of ranks on few cores) must not be cut off for a slow ping ack.
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Why no BDP probing: with it on, every message a channel reads makes it send a PING (and
        # the peer an ACK): two more writes and wake-ups per message, on both ends, for a control
        # plane whose messages are small; with thousands of ranks through relays that is a large
        # share of a barrier's time. Why a fixed 1 MiB window per stream: one value chunk
        # (CHUNK_BYTES) in flight, as the servers allow.
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.lookahead_bytes", CHUNK_BYTES),
        ("grpc.initial_reconnect_backoff_ms", 100),
        # Why 5 s: despite its name this is gRPC's minimum connect timeout (how long one attempt
        # may take before it is abandoned and dialled again). At 100 ms, thousands of ranks
        # dialling a busy coordinator abandon and re-dial over and over, filling its listen queue:
        # the storm feeds itself.
        ("grpc.min_reconnect_backoff_ms", 5_000),
        ("grpc.max_reconnect_backoff_ms", 1_000),
        # Why: pod DNS can lag; the default waits 30 s between resolutions.
        ("grpc.dns_min_time_between_resolutions_ms", 500),
        ("grpc.enable_retries", 1),
        ("grpc.service_config", _SERVICE_CONFIG),
    ]


def channel_credentials(tls: _config.TlsFiles) -> grpc.ChannelCredentials:
    cert, key = tls.client_pair()
    return grpc.ssl_channel_credentials(root_certificates=tls.ca, private_key=key, certificate_chain=cert)


def secure_options(tls: _config.TlsFiles | None, retries: bool = True, relay: bool = False) -> list[tuple[str, Any]]:
    options = channel_options(retries, relay=relay)
    if tls is not None and tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return options


def make_channel(target: str, tls: _config.TlsFiles | None) -> grpc.Channel:
    """A synchronous channel to the coordinator: TLS when configured, else plaintext."""
    if tls is None:
        return grpc.insecure_channel(target, options=channel_options())
    return grpc.secure_channel(target, channel_credentials(tls), options=secure_options(tls))


def make_aio_channel(target: str, tls: _config.TlsFiles | None, retries: bool = True, *,
                     relay: bool = False) -> grpc.aio.Channel:
    """An asyncio channel (on the background loop) with the same options and credentials;
    ``relay``: to a relay (see RELAY_RECONNECT_MAX_MS)."""
    if tls is None:
        channel = grpc.aio.insecure_channel(target, options=channel_options(retries, relay=relay))
    else:
        channel = grpc.aio.secure_channel(target, channel_credentials(tls), options=secure_options(tls, retries, relay))
    _eventloop.closes_at_exit(channel)
    return channel
