"""How a client's calls travel: an operation on the Session stream or as its unary RPC, a long wait
in bounded slices that say who they wait for, and the one Status call of ``gridcomm status``."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from gridcomm import _config
from gridcomm._client import progress as _progress
from gridcomm._client import session as _session
from gridcomm._client import streams as _streams
from gridcomm._client.inflight import Abandoned
from gridcomm._errors import CommAborted, CoordinatorUnavailable, RendezvousTimeout
from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._proto import coordinator_pb2_grpc as pb_grpc
from gridcomm._runtime.channel import make_channel
from gridcomm._wire import translate

if TYPE_CHECKING:
    from gridcomm._client.client import CoordinatorClient

log = logging.getLogger(__name__)

_T = TypeVar("_T")

#: Bound on a short (non-waiting) call.
SHORT_CALL_S = 10.0

#: The unary RPC that does what each Session operation does.
UNARY = {"join": "Join", "set": "Set", "get": "Get", "barrier": "Barrier", "leave": "Leave",
         "add": "Add", "compare_set": "CompareSet", "delete_key": "DeleteKey", "keys": "Keys"}

#: What a rank that hosts its group's relay sends through it (see streams.own_relay_session): the
#: operations a relay aggregates.
THROUGH_OWN_RELAY = frozenset(("barrier", "get"))


def op(client: CoordinatorClient, kind: str, request: Any, what: str, timeout_s: float, *,
       wait_for_ready: bool = False) -> Any:
    """One coordinator operation: on the Session stream where there is one, else (or when
    the stream breaks; every operation is idempotent) as its unary RPC."""
    if client._closed:
        raise CommAborted(f"{what}: this client was closed.")
    session = _streams.own_relay_session(client) if kind in THROUGH_OWN_RELAY else None
    if session is None:
        session = client.session_stream()
    if session is not None:
        started = time.monotonic()
        try:
            return session.call(kind, request, timeout_s)
        except Abandoned as exc:
            raise exc.raised() from None
        except _session.OpError as exc:
            raise translate(exc, what, client.target) from None
        except _session.StreamBroken as exc:
            log.debug("rank %d: %s; repeating %s as a unary call", client.rank, exc, kind)
        # Why: the repeat gets what is left of this call's time, not all of it again.
        timeout_s -= time.monotonic() - started
        if timeout_s <= 0:
            raise translate(_session.OpError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"),
                            what, client.target)
    return client._call(getattr(client._stub, UNARY[kind]), request, what, timeout_s, wait_for_ready=wait_for_ready)


def long_poll(client: CoordinatorClient, what: str, timeout_s: float | None, attempt: Callable[[float, float], _T],
              progress: Callable[[list[int]], str], *, first_contact: bool, ends_when_lost: bool, interval_s: float,
              slack_s: float) -> _T:
    """Repeats ``attempt(wait_s, call_timeout_s)`` in bounded slices until it succeeds or the
    overall deadline passes, logging who is still missing after each slice. ``ends_when_lost``:
    once the watcher declared the coordinator lost, raises its error instead of another slice
    (a join or a recovery is tried regardless). A slice waits ``interval_s`` at most, and its call
    ``slack_s`` longer."""
    total = client.timeout_s if timeout_s is None else _config.parse_duration("timeout_s", timeout_s)
    started = time.monotonic()
    deadline = started + total
    answered = False
    speaker = _progress.Wait(what, client.target, total, started, progress)  # a long wait says who it waits for
    while True:
        lost = client._lost
        if lost is not None and ends_when_lost and not first_contact:
            raise Abandoned(lost).raised()
        wait_s = max(0.0, min(deadline - time.monotonic(), interval_s))
        try:
            return attempt(wait_s, wait_s + slack_s)
        except RendezvousTimeout as exc:
            timeout = exc
        answered = answered or timeout.from_server
        if deadline - time.monotonic() > 0.05:
            speaker.slice_ended(timeout, answered)
            continue
        if first_contact and not answered:
            raise CoordinatorUnavailable(
                f"{what}: no answer from the coordinator at {client.target} within {total:.1f} s; is rank 0 "
                "(or `gridcomm serve`) running there, and does the name resolve?"
            ) from timeout
        raise _progress.timed_out(what, total, timeout) from timeout


def fetch_status(host: str, port: int, token: str | None = None, timeout_s: float = SHORT_CALL_S) -> pb.StatusResponse:
    """One Status call (for ``gridcomm status``)."""
    return fetch_status_call(host, port, token, timeout_s)[0]


def fetch_status_call(host: str, port: int, token: str | None = None,
                      timeout_s: float = SHORT_CALL_S) -> tuple[pb.StatusResponse, tuple[tuple[str, Any], ...]]:
    """One Status call: the answer and its trailing metadata (the refused joins ride there)."""
    target = _config.format_target(host, port)
    secret = _config.token(token)
    metadata = (("authorization", f"Bearer {secret}"),) if secret else ()
    started = time.monotonic()
    with make_channel(target, _config.tls()) as channel:
        # Why connect first, within the whole deadline: as a probe does (a slow handshake, a
        # port-forward, is not an unreachable coordinator).
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise CoordinatorUnavailable(f"status: the coordinator at {target} is unavailable: cannot connect within "
                                         f"{timeout_s:g} s") from None
        try:
            reply, call = pb_grpc.CoordinatorStub(channel).Status.with_call(
                pb.StatusRequest(), timeout=max(0.05, timeout_s - (time.monotonic() - started)), metadata=metadata,
                wait_for_ready=True)
        except grpc.RpcError as exc:
            raise translate(exc, "status", target) from exc
        return reply, tuple(call.trailing_metadata() or ())
