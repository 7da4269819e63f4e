"""TLS on the hop from a rank to its relay: a relay serves exactly what its members dial.

A member dials its relay as it dials the coordinator (gridcomm._runtime.channel: the job's CA, its
client certificate where it has one, GRIDCOMM_TLS_SERVER_NAME). So wherever the job uses TLS, the
relay serves with the job's serving certificate (GRIDCOMM_TLS_CERT/_KEY in the relay's process),
requires client certificates where the coordinator does, and, once it listens, dials itself the
way its members will: a certificate its members would refuse is a ConfigError at start, never a
member's handshake failing until its timeout.
"""

from __future__ import annotations

import dataclasses

import grpc

from gridcomm import _config
from gridcomm._errors import ConfigError
from gridcomm._runtime import guard
from gridcomm._runtime.channel import make_aio_channel
from gridcomm._wire import SERVICE_NAME


class RelayTlsError(ConfigError):
    """Raised when a relay could not serve its members over TLS the way they dial it."""


#: How long the self-dial may take (a loopback handshake; generous for a loaded machine).
CHECK_S = 10.0


def serving_identity_problem(tls: _config.TlsFiles | None) -> str | None:
    """Why a relay in this process could not serve its members over TLS (None: it can, or the job
    is plaintext)."""
    if tls is None or (tls.cert is not None and tls.key is not None):
        return None
    return ("the job uses TLS (GRIDCOMM_TLS_CA or a client certificate is set) but this process has no serving "
            "certificate for a relay (GRIDCOMM_TLS_CERT and GRIDCOMM_TLS_KEY, the coordinator's or one that "
            "the job's CA signed for the name its members verify)")


def server_credentials(tls: _config.TlsFiles | None) -> grpc.ServerCredentials | None:
    """The relay's server credentials: None for a plaintext job; a ConfigError where the job uses
    TLS and this process has no serving certificate (a plaintext relay would refuse every member)."""
    problem = serving_identity_problem(tls)
    if problem is not None:
        raise RelayTlsError(f"cannot host a relay: {problem}; set them, or GRIDCOMM_RELAY=off.")
    return guard.server_credentials(tls)


async def dial_problem(target: str, tls: _config.TlsFiles | None, name: str | None = None) -> RelayTlsError | None:
    """Dials the relay at ``target`` with a member's credentials: the RelayTlsError to raise when
    the TLS handshake fails, else None. ``name``: the host name members verify when they dial it by another
    address than ``target`` (a GRIDCOMM_RELAY_ADDRESSES template), unless GRIDCOMM_TLS_SERVER_NAME
    names it for everyone."""
    if tls is None:
        return None
    if name is not None and not tls.server_name:
        tls = dataclasses.replace(tls, server_name=name)
    channel = make_aio_channel(target, tls, retries=False, relay=True)
    try:
        # Why a method the relay does not serve: UNIMPLEMENTED proves the handshake (and, with
        # mTLS, the client certificate) passed; a failed handshake is UNAVAILABLE at once.
        probe = channel.unary_unary(f"/{SERVICE_NAME}/Status", request_serializer=bytes,
                                    response_deserializer=bytes)
        try:
            await probe(b"", timeout=CHECK_S, wait_for_ready=False)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAUTHENTICATED):
                return None
            verified = tls.server_name or target.rsplit(":", 1)[0]
            return RelayTlsError(
                f"this process's relay at {target} cannot be dialled the way its members dial it: "
                f"{exc.code().name}: {exc.details()}; its certificate (GRIDCOMM_TLS_CERT) must be signed by the "
                f"job's CA (GRIDCOMM_TLS_CA) and name {verified!r} (or set GRIDCOMM_TLS_SERVER_NAME to a name it "
                "has, on every rank), or set GRIDCOMM_RELAY=off.")
        return None  # answered: a Status the relay serves would be fine too
    finally:
        await channel.close()
