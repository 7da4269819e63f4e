"""A client's joins: of the job (first through its group's relay where it knows one: see
gridcomm._client.tree), of the next generation by a survivor (a recovery), and what it takes from
the answer (its generation, its members, where its stream goes from then on)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from gridcomm import _config
from gridcomm._client import streams as _streams
from gridcomm._client import tree as _relay_tree
from gridcomm._client.watcher import Watcher
from gridcomm._errors import CommAborted, ConfigError
from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._wire import WIRE, shown_generation, wire_mismatch

if TYPE_CHECKING:
    from gridcomm._client.client import CoordinatorClient

#: How long a join waits for its group's relay (GRIDCOMM_RELAY_ADDRESSES) to answer before it goes
#: to the coordinator directly: pods of one job start seconds apart (image pulls, scheduling).
RELAY_JOIN_GRACE_S = 20.0


def join(client: CoordinatorClient, timeout_s: float | None = None) -> int:
    """Registers this rank and waits until every rank has joined; returns the generation."""
    client._join_sent = True
    total = client.timeout_s if timeout_s is None else _config.parse_duration("timeout_s", timeout_s)
    # Why half the timeout: while the coordinator says "come back" (its group's relay is not up
    # yet) the rank asks again; the coordinator itself sends it on after LEAD_GRACE_S.
    client._tree(time.monotonic() + total / 2)
    relay_until = time.monotonic() + min(RELAY_JOIN_GRACE_S, total / 4)
    what = f"rank {client.rank}: join"

    def attempt(wait_s: float, call_s: float) -> pb.JoinResponse:
        request = join_request(client, wait_s)
        if client._relay_join is not None:
            response = _relay_tree.join_through_relay(client, request, what, call_s, relay_until)
            if response is not None:
                client.joined_through = "relay"
                return response
        client.joined_through = "coordinator"
        return client._op("join", request, what, call_s, wait_for_ready=True)

    response = client._long_poll(
        f"rank {client.rank} of {client.world_size}: join", timeout_s, attempt,
        lambda missing: f"waiting for {len(missing)} of {client.world_size} ranks: {missing[:16]}",
        first_contact=True,
    )
    client.heartbeat_timeout_s = response.heartbeat_timeout_s or client.heartbeat_timeout_s
    enter(client, response)
    client._joined = True
    # Watched from here on, as a communicator's rank is: heartbeats on the background loop
    # (no thread of its own), so its death reaches the others and theirs reaches its waits.
    client._watcher = Watcher(client)
    client._watcher.start()
    return client.generation


def recover(client: CoordinatorClient, mode: str, timeout_s: float | None = None) -> int:
    """After a failure of this generation, joins the next one as a survivor: ``"rebuild"``
    (every failed rank replaced by a new process; waits, bounded, for them) or ``"shrink"``
    (survivors only). Every survivor must make the same call. Returns the new generation;
    :attr:`members` names its job ranks. A rank that fails meanwhile ends the wait with
    :class:`RankFailedError` naming it; the call can be repeated."""
    recovery = {"rebuild": pb.RECOVERY_REBUILD, "shrink": pb.RECOVERY_SHRINK}.get(mode)
    if recovery is None:
        raise ConfigError(f"recovery mode {mode!r} must be 'rebuild' or 'shrink'.")
    if not client._joined or client._closed:
        raise CommAborted(f"rank {client.rank}: {mode} needs a joined, open client.")
    base = client.generation
    what = f"rank {client.rank}: {mode} of generation {shown_generation(base)}"

    def attempt(wait_s: float, call_s: float) -> pb.JoinResponse:
        return client._op("join", join_request(client, wait_s, base, recovery), what, call_s)

    response = client._long_poll(what, timeout_s, attempt,
                                 lambda missing: f"waiting for {len(missing)} rank(s): {missing[:16]}",
                                 ends_when_lost=False)
    enter(client, response)
    return client.generation


def join_request(client: CoordinatorClient, wait_s: float, generation: int = 0,
                 recovery: int = pb.RECOVERY_NONE) -> pb.JoinRequest:
    """This process's join: of the job (a new process), or, by a survivor of ``generation``,
    of the next one (``recovery``)."""
    return pb.JoinRequest(job_id=client.job_id, rank=client.rank, world_size=client.world_size, wire=WIRE,
                          incarnation=client.incarnation, hostname=client.hostname, wait_s=wait_s,
                          generation=generation, recovery=recovery,  # type: ignore[arg-type]
                          relay_address=client.relay.target if client.relay is not None else "",
                          wants_relay=client._relay_rank is not None, relay_rank=client._relay_rank or 0)


def enter(client: CoordinatorClient, response: pb.JoinResponse) -> None:
    """Takes the generation a join or a recovery answered: its number and members; barrier
    counts and the failure latch start afresh (the coordinator's keys and barriers do too)."""
    problem = wire_mismatch(response.wire, client.target)
    if problem is not None:
        raise ConfigError(f"rank {client.rank}: join: {problem}")
    with client._failure_lock:
        client._lost = None
        client.generation = response.generation
        client.members = tuple(response.member_ranks) or tuple(range(client.world_size))
        ahead, client._ahead = client._ahead, None
        # The new communicator's handler hears of it when it is set (on_failure).
        client.failure = ahead[1] if ahead is not None and ahead[0] == client.generation else None
    client._barrier_seq = {}
    if client.relay is not None:
        client.relay.heartbeat_timeout_s = response.heartbeat_timeout_s or client.relay.heartbeat_timeout_s
    client._relay_join = None
    session = client._session
    on_relay = session is not None and session.relay and not session.closed
    if response.relay_address and response.relay_address != client.relay_target and not on_relay:
        _streams.move_to_relay(client, response.relay_address)
