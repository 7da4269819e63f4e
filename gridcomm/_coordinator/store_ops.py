"""The coordinator's Add, CompareSet, DeleteKey and Keys: the rest of a key-value store as
``torch.distributed.Store`` has it (``gridcomm.TorchStore``), beside Set and Get on the same keys.

A mixin of :class:`~gridcomm._coordinator.servicer.Servicer`: each operation runs as a unary RPC
and as a Session operation alike. The decisions are the state's
(:mod:`gridcomm._coordinator.state.keyvalue`); here are the checks of the caller, the wakes of
those waiting for a key, and Keys' wait.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc

from gridcomm._coordinator.answers import Abort
from gridcomm._coordinator.state import JobState, Member, quote
from gridcomm._proto import coordinator_pb2 as pb

#: The most keys one Keys request may name (torch's wait and check name a few).
MAX_KEYS_PER_REQUEST = 1024


class StoreOps:
    """Add, CompareSet, DeleteKey and Keys over the servicer's state."""

    if TYPE_CHECKING:
        _state: JobState
        _loop: asyncio.AbstractEventLoop
        metrics: Any

        def _caller(self, caller: pb.Caller, what: str, now: float | None = None) -> Member: ...

        def _wake(self, key: tuple[Any, ...]) -> None: ...

        async def _wait(self, key: tuple[Any, ...], done: Callable[[], bool], wait_s: float, deadline: float | None,
                        what: str, *, member: Member | None = None, fail_fast: bool = True) -> bool: ...

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
