"""What both sides of the control plane agree on: the service and trailer names, the message
limits, and the one table between gRPC status codes and the library's errors. The client modules
import this, never the server's."""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Iterable
from typing import Any

import grpc

from gridcomm._errors import (
    AuthenticationError,
    CollectiveMismatch,
    CommAborted,
    ConfigError,
    CoordinatorRestarted,
    CoordinatorUnavailable,
    GridcommError,
    RankFailedError,
    RankStalled,
    RendezvousTimeout,
)

SERVICE_NAME = "gridcomm.v1.Coordinator"
#: Trailers: the ranks a timed-out wait still waits for, and the rank whose failure ended a call.
MISSING_KEY = "gridcomm-missing-ranks"
FAILED_KEY = "gridcomm-failed-rank"
#: Beside it, where the failure was a hang: "stall" or "mismatch" (RankStalled, CollectiveMismatch).
FAILED_CAUSE_KEY = "gridcomm-failed-cause"
#: Trailer on a FAILED_PRECONDITION refusal from a coordinator that has no record of a rank that
#: says it joined: the coordinator restarted and lost the job (CoordinatorRestarted, not ConfigError).
RESTARTED_KEY = "gridcomm-coordinator-restarted"

#: The wire form this gridcomm speaks (JoinRequest.wire, JoinResponse.wire): what its messages
#: mean beyond their field numbers (a relay's aggregate rides on SessionOp.aggregate). A join or
#: first contact of another form is refused, and a client refuses an answer of another, so mixed
#: versions fail at the join with a message instead of misreading each other. 0: a gridcomm that
#: predates the number.
WIRE = 2


def _older(wire: int) -> str:
    return " (a gridcomm older than the wire form's number)" if wire == 0 else ""


def wire_refusal(theirs: int, server: str = "the coordinator") -> str | None:
    """Why a server (the coordinator, or a relay) refuses a join or first contact whose wire form
    is ``theirs`` (None: it is this one's)."""
    if theirs == WIRE:
        return None
    return (f"this rank runs a gridcomm whose wire form is {theirs}{_older(theirs)}; {server}'s is {WIRE}: run the "
            "same gridcomm version on every rank and the coordinator.")


def wire_mismatch(theirs: int, target: str) -> str | None:
    """Why a rank refuses a join's answer in wire form ``theirs`` from ``target`` (None: it is this one's)."""
    if theirs == WIRE:
        return None
    return (f"the coordinator at {target} runs a gridcomm whose wire form is {theirs}{_older(theirs)}; this rank's is "
            f"{WIRE}: run the same gridcomm version on every rank and the coordinator.")


#: A key's value larger than this travels in pieces of this size.
CHUNK_BYTES = 1024 * 1024
#: Largest request message the coordinator reads: a chunk plus framing. Why not more: health
#: requests need no token and are read whole, so this bounds what each of them can make it hold.
MAX_REQUEST_BYTES = CHUNK_BYTES + 64 * 1024
#: Largest message sent (the coordinator's answers; a Session reply batches several).
MAX_MESSAGE_BYTES = 80 * 1024 * 1024


# Why two numberings and one conversion: the wire's generation fields count formed generations
# (0: none yet, 1: the first rendezvous), so that 0 can mean "names no generation" (a new
# process's JoinRequest, a Caller before its join, a Status before the rendezvous). Users see the
# generation counted from 0 (``comm.generation``: 0 at the first init, +1 per recovery). Renumbering
# the wire would give 0 two meanings; so everything shown to a person (the API, log lines,
# ``gridcomm status``, the ``gridcomm_generation`` gauge, error texts) goes through this function.
def shown_generation(wire_generation: int) -> int:
    """The generation a user sees for a wire generation: 0 at the first init, +1 per recovery;
    -1 for the wire's 0 (no generation has formed yet)."""
    return wire_generation - 1


_RANK_PREFIX = re.compile(r"^rank \d+( of \d+)?: ")


def _label(what: str) -> str:
    """``'rank 3 of 8: join'`` -> ``'join'``: the part of a call's name a server message repeats."""
    return _RANK_PREFIX.sub("", what, count=1)


def without_repeat(what: str, details: str) -> str:
    """``details`` without the label ``what`` already says (``"barrier 'x': barrier 'x' #2: ..."``
    reads ``"barrier 'x': #2: ..."``; the sequence number is kept)."""
    label = _label(what)
    if label and details.startswith(label):
        rest = details[len(label):]
        if rest.startswith(": "):
            return rest[2:]
        if rest.startswith(" #"):
            return rest[1:]
    return details


class Undecodable:
    """Stands for a request body that is not a valid message of its type."""


UNDECODABLE = Undecodable()


def decoder(message_type: Any) -> Callable[[bytes], Any]:
    """A server's request deserializer that turns an undecodable body into UNDECODABLE (refused
    with INVALID_ARGUMENT by the handler; gRPC's own answer would be UNKNOWN)."""
    def parse(data: bytes) -> Any:
        try:
            return message_type.FromString(data)
        except Exception:  # noqa: BLE001 - DecodeError and friends
            return UNDECODABLE

    return parse


def progress_said(progress: Iterable[Any]) -> tuple[tuple[str, int, str, bool, int, int, float], ...] | None:
    """What a heartbeat's progress entries say, in a form compared with the rank's last report:
    every count, kind and flag, not the ages (which only grow). None when an entry carries what
    only a full report handles: fingerprints or answers to a digest probe, a pending GPU sample, or an age that is not a
    finite number >= 0. The coordinator compares it to refresh a repeated report; a relay, to
    leave out the entries it already reported."""
    said = []
    for p in progress:
        age = p.age_s
        if p.recent or p.probe_counts or p.probe_lost or p.gpu_wait_s != 0.0 or not 0.0 <= age < math.inf:
            return None
        said.append((p.communicator, p.entered, p.kind, p.inside, p.completed, p.digest, p.inside_s))
    return tuple(said)


def ranks_text(ranks: Iterable[int], limit: int = 2048) -> str:
    """The ranks of a MISSING_KEY trailer (read back by parse_ranks), cut at ``limit`` characters
    (built only that far: the list may hold every rank of a large job)."""
    return ",".join(str(r) for r in itertools.islice(ranks, limit // 2 + 1))[:limit]


# One table from gRPC status to the library's errors (metadata refines it: see translate).
#: (status, trailer) -> the error a status carrying that trailer means instead of its plain one.
TRAILER_ERRORS: dict[tuple[grpc.StatusCode, str], type[GridcommError]] = {
    (grpc.StatusCode.FAILED_PRECONDITION, RESTARTED_KEY): CoordinatorRestarted,
}

STATUS_ERRORS: dict[grpc.StatusCode, type[GridcommError]] = {
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: AuthenticationError,
    grpc.StatusCode.INVALID_ARGUMENT: ConfigError,
    grpc.StatusCode.OUT_OF_RANGE: ConfigError,
    grpc.StatusCode.ALREADY_EXISTS: ConfigError,
    grpc.StatusCode.FAILED_PRECONDITION: ConfigError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ConfigError,
    grpc.StatusCode.NOT_FOUND: ConfigError,
    grpc.StatusCode.ABORTED: RankFailedError,
    grpc.StatusCode.DEADLINE_EXCEEDED: RendezvousTimeout,
    grpc.StatusCode.UNAVAILABLE: CoordinatorUnavailable,
    grpc.StatusCode.UNIMPLEMENTED: CoordinatorUnavailable,
    grpc.StatusCode.CANCELLED: CommAborted,
}


def _metadata_value(error: grpc.RpcError, key: str) -> str | None:
    try:
        trailing = error.trailing_metadata() or ()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - not a call object
        return None
    for k, v in trailing:
        if k == key:
            return v if isinstance(v, str) else v.decode()
    return None


def parse_ranks(text: str | None) -> list[int]:
    if not text:
        return []
    out = []
    for part in text.split(","):
        try:
            out.append(int(part))
        except ValueError:
            pass
    return out


def translate(error: grpc.RpcError, what: str, target: str) -> GridcommError:
    """Turns a gRPC error into the library's error, with a message that names the call and address."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN  # type: ignore[attr-defined]
    details = (error.details() if hasattr(error, "details") else None) or str(code)  # type: ignore[attr-defined]
    details = without_repeat(what, details)  # no "barrier 'x': barrier 'x': ..."
    failed = _metadata_value(error, FAILED_KEY)
    if failed is not None:
        rank = int(failed) if failed.lstrip("-").isdigit() else -1
        kind = {"stall": RankStalled, "mismatch": CollectiveMismatch}.get(_metadata_value(error, FAILED_CAUSE_KEY) or "",
                                                                        RankFailedError)
        return kind(f"{what}: {details}", rank=rank, reason=details)
    cls = STATUS_ERRORS.get(code, GridcommError)
    for (status, key), refined in TRAILER_ERRORS.items():
        if code == status and _metadata_value(error, key) is not None:
            cls = refined
    if cls is CoordinatorRestarted:
        return CoordinatorRestarted(f"{what}: the coordinator at {target} restarted and lost the job: {details}")
    if cls is RendezvousTimeout:
        missing_text = _metadata_value(error, MISSING_KEY)
        # Why from_server: a wait the server ended (it answered) differs from no answer at all.
        return RendezvousTimeout(f"{what}: {details}", parse_ranks(missing_text), details=details,
                                 from_server=missing_text is not None or details != "Deadline Exceeded")
    if cls is CoordinatorUnavailable:
        return CoordinatorUnavailable(f"{what}: the coordinator at {target} is unavailable: {details}")
    return cls(f"{what}: {details}")
