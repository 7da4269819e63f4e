"""A relay's children: each rank's Session stream to the relay, held to the coordinator's bounds.

The identity of a relayed operation is the stream it came on. A stream owns the processes (rank,
incarnation) it has proven to be: an operation of a process the stream does not own yet goes up
to the coordinator alone (a heartbeat as a check answered at once), and the coordinator's answer
is that stream's alone: a success makes the stream own the process, a refusal reaches the child
with the coordinator's own status and message. So a child cannot heartbeat, arrive, get or report
progress as another rank through the relay, and its bad input never reaches an aggregate the
relay sends for its other ranks.

Per child, as the coordinator per stream (gridcomm._coordinator.session): at most
:func:`max_ops` operations waiting, and answers it does not read bounded (4 x that many, or
:data:`MAX_UNREAD_BYTES`): past that its stream is closed with RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import asyncio

import grpc

from gridcomm._proto import coordinator_pb2 as pb

_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
_DEADLINE = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]

#: Bytes of answers a child may leave unread before its stream is closed.
MAX_UNREAD_BYTES = 64 * 1024 * 1024

#: Processes one stream may own: a rank's client has one stream (a rank across its recoveries
#: owns a few); more is not a deployment, and must not grow the relay.
MAX_OWNED = 64


def max_ops(world_size: int) -> int:
    """Operations one child may have waiting at the relay: the coordinator's bound per stream."""
    return max(1024, 2 * world_size + 64)


class Child:
    """One Session stream to the relay: what it owns, what it has waiting, and its answers,
    written back in batches."""

    def __init__(self, context: grpc.aio.ServicerContext, world_size: int = 0) -> None:
        self.context = context
        self.results: list[pb.SessionResult] = []
        self.unread_bytes = 0
        self.ready = asyncio.Event()
        #: Set whenever what it has waiting changes (an answer, its answers taken by the writer,
        #: closed): its stream's end waits on it until everything it sent is answered.
        self.changed = asyncio.Event()
        self.closed = False
        self.inflight = 0
        self.max_ops = max_ops(world_size)
        self.writer: asyncio.Task[None] | None = None
        #: The ranks whose operations this stream carried (see Relay._note).
        self.ranks: set[int] = set()
        #: The processes (rank, incarnation) this stream has proven to be (less those that left).
        self.owned: set[tuple[int, int]] = set()
        #: The job its processes are of (as their latest operation the coordinator accepted named it).
        self.job_id = ""

    # ------------------------------------------------------------------ identity
    def owns(self, caller: pb.Caller) -> bool:
        return (caller.rank, caller.incarnation) in self.owned

    def can_own(self) -> bool:
        return len(self.owned) < MAX_OWNED

    def learn(self, kind: str, op: pb.SessionOp, code: int) -> None:
        """The coordinator answered ``op`` (sent for this stream): a join it accepted, or an
        operation whose caller it accepted (answered, or its wait ended), proves the process."""
        if kind == "join":
            if not code and self.can_own():
                self.owned.add((op.join.rank, op.join.incarnation))
                self.job_id = op.join.job_id
            return
        caller = getattr(getattr(op, kind), "caller", None)
        if caller is None or code not in (0, _DEADLINE):
            return
        if kind == "leave" and not code:
            self.owned.discard((caller.rank, caller.incarnation))  # gone by leaving: never lost
        elif self.can_own():
            self.owned.add((caller.rank, caller.incarnation))
            self.job_id = caller.job_id

    # ------------------------------------------------------------------ bounds
    def admit(self, op: pb.SessionOp, kind: str | None) -> bool:
        """Counts ``op`` as waiting, or refuses it as the coordinator refuses an operation past
        its stream's bound (answered at once; False)."""
        self.inflight += 1
        if self.inflight > self.max_ops:
            self.refuse(op.id, _EXHAUSTED,
                        f"{kind} refused: this Session stream already has {self.inflight - 1} operations waiting.")
            return False
        if kind not in (None, "join") and not self.owns(getattr(op, kind).caller) and not self.can_own():
            self.refuse(op.id, _EXHAUSTED, f"{kind} refused: this Session stream already speaks for {MAX_OWNED} "
                        "processes, the limit (a rank's client has a stream of its own).")
            return False
        return True

    def overflow(self) -> str | None:
        """Why this stream is closed (answers it does not read past the bound), or None."""
        if len(self.results) > 4 * self.max_ops:
            return (f"this Session stream has {len(self.results)} answers its client has not read; it is closed "
                    "(a client must read the answers to what it sends).")
        if self.unread_bytes > MAX_UNREAD_BYTES:
            return (f"this Session stream has {self.unread_bytes} bytes of answers its client has not read; it is "
                    "closed (a client must read the answers to what it sends).")
        return None

    # ------------------------------------------------------------------ answers
    def refuse(self, op_id: int, code: int, details: str) -> None:
        self.answer(pb.SessionResult(id=op_id, code=code, details=details))

    def answer(self, result: pb.SessionResult) -> None:
        if self.closed:
            return
        self.inflight -= 1
        self.results.append(result)
        self.unread_bytes += result.ByteSize()
        self.ready.set()
        self.changed.set()

    def end(self) -> None:
        """The relay ends this stream (it stopped, or lost the coordinator): its writer stops."""
        self.closed = True
        self.ready.set()
        self.changed.set()

    def close(self) -> None:
        self.closed = True
        self.results, self.unread_bytes = [], 0
        self.ready.set()
        self.changed.set()

    async def write(self) -> None:
        while not self.closed:
            if not self.results:
                await self.ready.wait()
                self.ready.clear()
                continue
            batch, self.results, self.unread_bytes = self.results, [], 0
            self.changed.set()
            await self.context.write(pb.SessionReply(results=batch))


def probe(heartbeat: pb.HeartbeatRequest) -> pb.HeartbeatRequest:
    """The coordinator's check of a child's heartbeat for a process its stream does not own yet:
    the same heartbeat as the rank's own, answered at once."""
    out = pb.HeartbeatRequest(caller=heartbeat.caller, progress=heartbeat.progress[:64])
    return out


def lost_report(child: Child, lost: list[tuple[int, int]], relay: str) -> tuple[pb.HeartbeatRequest, pb.Aggregate]:
    """A relayed heartbeat (and its aggregate) that names processes (rank, incarnation) of
    ``child`` whose stream to the relay ``relay`` ended without their leaving; answered at once."""
    return (pb.HeartbeatRequest(caller=pb.Caller(job_id=child.job_id, rank=lost[0][0], incarnation=lost[0][1])),
            pb.Aggregate(relay=relay, lost=[pb.RelayedRank(rank=rank, incarnation=incarnation)
                                            for rank, incarnation in lost]))


def answered(result: pb.SessionResult, op_id: int) -> pb.SessionResult:
    """The coordinator's answer to an operation, as the answer to a child's ``op_id``."""
    out = pb.SessionResult()
    out.CopyFrom(result)
    out.id = op_id
    return out
