"""Speaking as a relay to a real coordinator: one operation with a relay's aggregate
(``SessionOp.aggregate``) on a Session stream of its own, answered as a unary call would be (a
refusal raises an error with the status code and details, as gRPC's own does)."""

from __future__ import annotations

from typing import Any

import grpc

from gridcomm._client.session import OpError
from gridcomm._proto import coordinator_pb2 as pb

_CODES = {code.value[0]: code for code in grpc.StatusCode}


def refused(result: pb.SessionResult) -> OpError:
    """A Session operation's refusal as the error its unary RPC would have raised."""
    return OpError(_CODES.get(result.code, grpc.StatusCode.UNKNOWN), result.details,
                   tuple((m.key, m.value) for m in result.metadata))


def aggregate_of(*callers: Any, **fields: Any) -> pb.Aggregate:
    """An aggregate naming ``callers`` (Callers or RelayedRanks), each rank with its process."""
    ranks = [c if isinstance(c, pb.RelayedRank) else pb.RelayedRank(rank=c.rank, incarnation=c.incarnation)
             for c in callers]
    return pb.Aggregate(ranks=ranks, **fields)


def session_op(stub: Any, kind: str, request: Any, aggregate: pb.Aggregate | None = None, timeout_s: float = 20.0,
               metadata: Any = ()) -> pb.SessionResult:
    """``request`` (a ``kind`` operation) with ``aggregate`` on a Session stream of its own: the
    SessionResult whatever its code."""
    op = pb.SessionOp(id=1, aggregate=aggregate, **{kind: request})
    found = None
    for reply in stub.Session(iter([pb.SessionRequest(ops=[op])]), timeout=timeout_s, metadata=metadata):
        for result in reply.results:
            if result.id == 1:
                found = result
    assert found is not None, "the Session stream ended without answering"
    return found


def relayed(stub: Any, kind: str, request: Any, aggregate: pb.Aggregate | None = None, timeout_s: float = 20.0,
            metadata: Any = ()) -> Any:
    """As session_op, but the operation's response, or its refusal raised (an OpError, as the client reads one)."""
    result = session_op(stub, kind, request, aggregate, timeout_s, metadata)
    if result.code:
        raise refused(result)
    return getattr(result, kind)
