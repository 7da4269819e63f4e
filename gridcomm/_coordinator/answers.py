"""How the coordinator answers in gRPC's terms: refusals as statuses (code, readable details,
trailers), the state's members and failures as messages, and the bounded log of refused tokens.

A refusal (:class:`Abort`, a :class:`~gridcomm._coordinator.state.StateError`, or an unexpected
error) becomes its status in one place, :func:`status_of`; a unary call ends with it
(:func:`refuse`), an operation of a Session stream answers with it (:func:`refused_result`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

import grpc

from gridcomm._coordinator.state import Member, StateError, process_tag
from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._wire import FAILED_CAUSE_KEY, FAILED_KEY, RESTARTED_KEY

log = logging.getLogger(__name__)

#: Longest status message sent (characters); see details().
MAX_DETAILS = 400


class Abort(Exception):
    """Raised inside an operation to answer with a status (and trailing metadata)."""

    def __init__(self, code: grpc.StatusCode, message: str, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.metadata = metadata


def details(message: str) -> str:
    """Status details short enough that, percent-encoded (up to 9 bytes a character), they stay
    well inside gRPC's 8 KiB metadata budget beside our trailers."""
    return message if len(message) <= MAX_DETAILS else message[: MAX_DETAILS - 15] + "... (truncated)"


def status_of(name: str, exc: Exception) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str], ...]]:
    """The status a refused or failed operation answers with: code, details, trailing metadata."""
    if isinstance(exc, Abort):
        return exc.code, details(exc.message), exc.metadata
    if isinstance(exc, StateError):
        metadata: tuple[tuple[str, str], ...] = ()
        if exc.failed_rank is not None:
            metadata = ((FAILED_KEY, str(exc.failed_rank)),)
            if exc.failed_cause:
                metadata += ((FAILED_CAUSE_KEY, exc.failed_cause),)
        elif exc.restarted:
            metadata = ((RESTARTED_KEY, "1"),)
        return getattr(grpc.StatusCode, exc.code), details(exc.message), metadata
    log.exception("coordinator: %s failed on an unexpected error", name, exc_info=exc)
    return grpc.StatusCode.INTERNAL, details(f"{name} failed inside the coordinator: {exc!r}"), ()


async def refuse(context: grpc.aio.ServicerContext, name: str, exc: Exception) -> None:
    """Answers a refused or failed call with a status and a readable message; always raises."""
    if isinstance(exc, grpc.aio.AbortError):
        raise exc
    code, text, metadata = status_of(name, exc)
    await context.abort(code, text, trailing_metadata=metadata)


#: A Session result that carries a status and nothing else: (operation id, code, details).
CompactResult = tuple[int, int, str]


def refused_result(op_id: int, name: str, exc: Exception) -> tuple[grpc.StatusCode, pb.SessionResult | CompactResult]:
    """What a Session stream answers for an operation refused or failed (before or while it
    runs): the status :func:`refuse` would end its unary call with, as a result of the stream,
    and its code. Why a tuple when there are no trailers: a message of its own costs ~1 KB, and a
    burst of refusals would hold one each until written; the reply's result built from it (see
    gridcomm._coordinator.session) is the same bytes."""
    code, text, metadata = status_of(name, exc)
    if not metadata:
        return code, (op_id, code.value[0], text)
    return code, pb.SessionResult(id=op_id, code=code.value[0], details=text,
                                  metadata=[pb.MetadataEntry(key=k, value=v) for k, v in metadata])


def bounded(ranks: list[int], shown: int = 16) -> str:
    if len(ranks) <= shown:
        return str(ranks)
    return f"{ranks[:shown]}... ({len(ranks)} in all)"


class RefusalLog:
    """Logs refused calls at a bounded rate: the first of each interval as it comes, the rest as
    one count when the interval ends. Why: one client without the token made ~3,000 log lines a
    second, a disk and a log pipeline an unauthenticated caller could fill."""

    INTERVAL_S = 10.0

    def __init__(self) -> None:
        self._until = 0.0
        self._count = 0
        self._peers: set[str] = set()
        #: Refused calls since start (what an operator's metrics would read).
        self.total = 0

    def note(self, method: str, peer: str, how: str) -> None:
        self.total += 1
        now = time.monotonic()
        if now >= self._until:
            self._flush()
            self._until = now + self.INTERVAL_S
            log.warning("coordinator: refused %s from %s: %s token (further refusals in the next %g s are counted, "
                        "not logged one by one)", method, peer, how, self.INTERVAL_S)
            try:
                asyncio.get_running_loop().call_later(self.INTERVAL_S, self._flush)
            except RuntimeError:
                pass  # no loop (a unit test): the next refusal flushes
            return
        self._count += 1
        if len(self._peers) < 8:
            self._peers.add(peer)

    def _flush(self) -> None:
        if self._count:
            log.warning("coordinator: refused %d more calls without a valid token in the last %g s (from %s%s)",
                        self._count, self.INTERVAL_S, ", ".join(sorted(self._peers)),
                        ", ..." if len(self._peers) >= 8 else "")
        self._count = 0
        self._peers = set()


def add_members(into: Any, members: Iterable[Member]) -> None:
    """Appends each of ``members`` to ``into`` (a repeated gridcomm.v1.Member field), each built in
    place. Why not a pb.Member each, copied in: every rank's standalone message was held at once,
    several times the size of the answer itself (a Status names every rank of the job)."""
    add = into.add
    offset = time.time() - time.monotonic()  # the members' monotonic times, as wall-clock times
    for member in members:
        add(rank=member.rank, hostname=member.hostname, process_tag=process_tag(member.incarnation),
            state=int(member.state), joined_at_unix_s=offset + member.joined_at)  # type: ignore[arg-type]


def failure_pb(failure: Any) -> pb.Failure:
    return pb.Failure(
        rank=failure.rank,
        reason=failure.reason,
        at_unix_s=time.time() - (time.monotonic() - failure.at),
        reported_by=failure.reported_by,
        cause=_CAUSES.get(getattr(failure, "cause", ""), pb.FAILURE_CAUSE_UNSPECIFIED),
    )


_CAUSES = {"stall": pb.FAILURE_CAUSE_STALL, "mismatch": pb.FAILURE_CAUSE_MISMATCH}
