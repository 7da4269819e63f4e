"""The coordinator's key-value store: Set and Get (values larger than one message go in pieces),
and Add, CompareSet, DeleteKey and Keys, the rest of a store as ``torch.distributed.Store`` has it
(``gridcomm.TorchStore``), on the same keys.

Each operation runs as a unary RPC and as a Session operation alike. The decisions are the
state's (:mod:`gridcomm._coordinator.state.keyvalue`); here are the checks of the caller, the
wakes of those waiting for a key, and the waits of Get and Keys.
"""

from __future__ import annotations

from typing import Any

import grpc

from gridcomm._coordinator.answers import Abort
from gridcomm._coordinator.rpc.base import Operations
from gridcomm._coordinator.state import quote
from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._wire import CHUNK_BYTES

#: The most keys one Keys request may name (torch's wait and check name a few).
MAX_KEYS_PER_REQUEST = 1024


class StoreOps(Operations):
    """Set, Get, Add, CompareSet, DeleteKey and Keys over the state's keys."""

    async def set(self, request: pb.SetRequest, deadline: float | None) -> pb.SetResponse:
        member = self._caller(request.caller, "set")
        self.metrics.ops["set"] += 1
        state = self._state
        state.check_not_failed("set")
        if request.total_bytes:
            if not state.set_piece(member.rank, request.key, request.offset, request.total_bytes, request.value):
                return pb.SetResponse()
        else:
            state.set(request.key, request.value)
        self._wake(("kv", request.key))
        return pb.SetResponse()

    async def get_aggregate(self, request: pb.GetRequest, aggregate: pb.Aggregate) -> tuple[pb.GetResponse, None]:
        """A relay's aggregate: the same get by the other ranks ``aggregate`` names."""
        return await self.get(request, None, aggregate), None

    async def get(self, request: pb.GetRequest, deadline: float | None,
                  aggregate: pb.Aggregate | None = None) -> pb.GetResponse:
        member = self._caller(request.caller, "get")
        if aggregate is not None:
            self._also(request.caller, aggregate, "get")
        self.metrics.ops["get"] += 1 + (len(aggregate.ranks) if aggregate is not None else 0)
        self.metrics.messages["get"] += 1
        state = self._state
        key = request.key
        value = state.get(key)  # validates the key
        if value is None:
            if request.offset:
                raise Abort(grpc.StatusCode.ABORTED, f"key {quote(key)} is no longer set; read it again from offset 0.")
            if not await self._wait(("kv", key), lambda: key in state.kv, request.wait_s, deadline,
                                    f"get of {quote(key)}", member=member):
                raise Abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"key {quote(key)} was not set within {request.wait_s:.1f} s")
            value = state.kv[key]
        return self._value_response(key, value, request)

    def _value_response(self, key: str, value: bytes, request: pb.GetRequest) -> pb.GetResponse:
        """A value, or its piece from request.offset when it is larger than one message."""
        offset = request.offset
        if not offset and len(value) <= CHUNK_BYTES:
            return pb.GetResponse(value=value)
        version = self._state.version(key)
        if offset:
            if request.version != version:
                raise Abort(grpc.StatusCode.ABORTED,
                            f"key {quote(key)} was set again while it was read in pieces; read it again from offset 0.")
            if offset >= len(value):
                raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"offset {offset} is past the end of key {quote(key)} ({len(value)} bytes).")
        return pb.GetResponse(value=value[offset : offset + CHUNK_BYTES], total_bytes=len(value), version=version)

    def _changing(self, request: Any, kind: str) -> tuple[int, int]:
        """Checks the caller of an operation that changes a key; its (rank, incarnation)."""
        member = self._caller(request.caller, kind)
        self.metrics.ops[kind] += 1
        self._state.check_not_failed(kind)
        return member.rank, member.incarnation

    async def add(self, request: pb.AddRequest, deadline: float | None) -> pb.AddResponse:
        caller = self._changing(request, "add")
        value = self._state.add(request.key, request.amount, caller, request.request_id)
        self._wake(("kv", request.key))
        return pb.AddResponse(value=value)

    async def compare_set(self, request: pb.CompareSetRequest, deadline: float | None) -> pb.CompareSetResponse:
        caller = self._changing(request, "compare_set")
        value = self._state.compare_set(request.key, request.expected, request.desired, caller, request.request_id)
        self._wake(("kv", request.key))
        return pb.CompareSetResponse(value=value)

    async def delete_key(self, request: pb.DeleteKeyRequest, deadline: float | None) -> pb.DeleteKeyResponse:
        caller = self._changing(request, "delete_key")
        return pb.DeleteKeyResponse(deleted=self._state.delete(request.key, caller, request.request_id))

    async def keys(self, request: pb.KeysRequest, deadline: float | None) -> pb.KeysResponse:
        member = self._caller(request.caller, "keys")
        self.metrics.ops["keys"] += 1
        state = self._state
        names = list(request.keys)
        if len(names) > MAX_KEYS_PER_REQUEST:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"keys names {len(names)} keys; at most {MAX_KEYS_PER_REQUEST} a request.")
        for name in names:
            state.get(name)  # checks the key
        wait_s = request.wait_s if request.wait_s == request.wait_s else 0.0  # NaN waits not at all
        if wait_s > 0:
            end = self._loop.time() + wait_s
            for name in names:
                if name in state.kv:
                    continue
                left = end - self._loop.time()
                if left > 0:
                    await self._wait(("kv", name), lambda name=name: name in state.kv, left, deadline,  # type: ignore[misc]
                                     f"wait for {quote(name)}", member=member)
            missing = [name for name in names if name not in state.kv]
            if missing:
                shown = ", ".join(quote(name) for name in missing[:8])
                raise Abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"{len(missing)} of {len(names)} keys were not set within {wait_s:.1f} s: {shown}"
                            f"{' ...' if len(missing) > 8 else ''}")
        return pb.KeysResponse(present=[name in state.kv for name in names], count=state.count())
