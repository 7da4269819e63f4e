"""A client's values larger than one message: set in pieces by unary calls, and read whole (a value
set again while it is read is read again, a bounded number of times)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc

from gridcomm._client.calls import SHORT_CALL_S
from gridcomm._errors import GridcommError
from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._wire import CHUNK_BYTES, translate

if TYPE_CHECKING:
    from gridcomm._client.client import CoordinatorClient

#: How often a value read in pieces may be found set again before get gives up.
REREADS = 8


def set_in_pieces(client: CoordinatorClient, key: str, value: bytes | bytearray | memoryview, what: str) -> None:
    """A value too large for the Session stream, set by unary calls."""
    # Why unary: a Session message carries several operations, and the coordinator reads no
    # message larger than a chunk. A value larger than a chunk travels in pieces (total_bytes
    # says so; 0 means the one message is the whole value).
    view = memoryview(value).cast("B")
    total = len(view)
    pieces = total if total > CHUNK_BYTES else 0
    for offset in range(0, total, CHUNK_BYTES):
        piece = bytes(view[offset : offset + CHUNK_BYTES])
        request = pb.SetRequest(caller=client.caller, key=key, value=piece, total_bytes=pieces, offset=offset)
        client._call(client._stub.Set, request, what, SHORT_CALL_S + len(piece) / 50e6)


def whole(client: CoordinatorClient, key: str, response: pb.GetResponse) -> bytes:
    """The value a get answered: ``response.value``, or, for a value larger than one message
    (``total_bytes`` set), that first piece and the rest read after it. A value set again
    meanwhile is read again from its start (a bounded number of times)."""
    what = f"rank {client.rank}: get {key!r}"
    for _ in range(REREADS):
        parts, got = [response.value], len(response.value)
        while got < response.total_bytes:
            request = pb.GetRequest(caller=client.caller, key=key, offset=got, version=response.version)
            try:
                piece = client._stub.Get(request, timeout=SHORT_CALL_S + CHUNK_BYTES / 50e6, metadata=client._metadata)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.ABORTED:
                    raise translate(exc, what, client.target) from exc
                break
            parts.append(piece.value)
            got += len(piece.value)
            if not piece.value:
                break
        else:
            return b"".join(parts)
        # Set again while it was read (or a piece came back empty): start over, without waiting.
        response = client._call(client._stub.Get, pb.GetRequest(caller=client.caller, key=key), what, SHORT_CALL_S)
        if not response.total_bytes:
            return response.value  # type: ignore[no-any-return]
    raise GridcommError(f"{what}: the value changed {REREADS} times while it was being read; it is set too often "
                        "to be read whole.")
