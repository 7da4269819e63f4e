"""The host backend: the communicator API over NumPy arrays, data moved through the coordinator.

It exists so every multi-rank behaviour runs where there is no GPU (CI, laptops). Messages go
through the coordinator's bounded mailbox, chunked, so arrays larger than one gRPC message work.
Reductions run on the root in rank order, so every rank gets bit-identical results. Calls are
synchronous: ``stream`` is accepted for API compatibility and ignored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from gridcomm import _validate
from gridcomm._client import CoordinatorClient
from gridcomm._errors import GridcommError, coordinator_lost

_REDUCE: dict[str, Callable[..., Any]] = {
    "sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum, "avg": np.add,
}


def _bytes(array: Any) -> memoryview:
    """The array's memory, in memory order, as a byte view (no copy for contiguous arrays)."""
    flat = np.asarray(array).reshape(-1, order="A")
    return memoryview(flat).cast("B")  # type: ignore[arg-type]


class HostBackend:
    """Collectives for one communicator (``name``) over the coordinator mailbox."""

    kind = "host"
    #: Called with an ArgumentError before it propagates (set by the communicator).
    on_invalid: Callable[[Exception], None] | None = None
    #: The rank whose process hosts the coordinator (embedded mode), so losing the coordinator
    #: is reported as that rank's failure.
    coordinator_rank: int | None = None

    def __init__(self, client: CoordinatorClient, name: str, rank: int, world_size: int) -> None:
        self._client = client
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self._seq = 0
        self._p2p: dict[tuple[int, int], int] = {}
        #: Set by abort(): calls that fail afterwards raise it (the cause), not the symptom.
        self._failure: Exception | None = None
        client.open_data_channel()

    # ------------------------------------------------------------------ message plumbing
    def _next(self) -> str:
        self._seq += 1
        return f"{self.name}/c{self._seq}"

    def _put(self, key: str, array: Any, readers: int = 1) -> None:
        if readers > 0:
            try:
                self._client.put(key, _bytes(array), readers)
            except GridcommError as exc:
                raise self._cause(exc) from exc

    def _take(self, key: str, out: Any) -> None:
        self._take_bytes(key, _bytes(out))

    def _take_bytes(self, key: str, out: memoryview) -> None:
        try:
            self._client.take(key, out=out)
        except GridcommError as exc:
            raise self._cause(exc) from exc

    def _cause(self, exc: GridcommError) -> Exception:
        """What a failed transfer raises: the failure the watcher reported, if any, else the
        transfer's own error (a lost coordinator named as its host rank's failure)."""
        return self._failure or coordinator_lost(exc, self.coordinator_rank)

    def _reduce_to(self, tag: str, root: int, in_array: Any, op: str) -> np.ndarray | None:
        """Every rank's in_array reduced on ``root`` in rank order; None on other ranks."""
        if self.rank != root:
            self._put(f"{tag}/{self.rank}>{root}", in_array)
            return None
        acc = np.array(in_array, copy=True)
        scratch = np.empty_like(acc)
        fn = _REDUCE[op]
        for src in range(self.world_size):
            if src == root:
                continue
            self._take(f"{tag}/{src}>{root}", scratch)
            fn(acc, scratch, out=acc)
        if op == "avg":
            np.divide(acc, self.world_size, out=acc, casting="unsafe")
        return acc

    def _bcast(self, tag: str, root: int, array: Any) -> None:
        if self.rank == root:
            self._put(f"{tag}/bcast", array, readers=self.world_size - 1)
        else:
            self._take(f"{tag}/bcast", array)

    # ------------------------------------------------------------------ collectives
    @_validate.reports_invalid
    def all_reduce(self, in_array: Any, out_array: Any, op: str = "sum", stream: Any = None) -> None:
        _validate.all_reduce(in_array, out_array, op)
        tag = self._next()
        acc = self._reduce_to(tag, 0, in_array, op)
        if acc is not None:
            _bytes(out_array)[:] = _bytes(acc)
        self._bcast(tag, 0, out_array)

    @_validate.reports_invalid
    def reduce(self, in_array: Any, out_array: Any, root: int = 0, op: str = "sum", stream: Any = None) -> None:
        root = _validate.reduce(in_array, out_array, root, op, self.rank, self.world_size)
        acc = self._reduce_to(self._next(), root, in_array, op)
        if acc is not None:
            _bytes(out_array)[:] = _bytes(acc)

    @_validate.reports_invalid
    def broadcast(self, in_out_array: Any, root: int = 0, stream: Any = None) -> None:
        root = _validate.broadcast(in_out_array, root, self.world_size)
        self._bcast(self._next(), root, in_out_array)

    @_validate.reports_invalid
    def reduce_scatter(self, in_array: Any, out_array: Any, count: int, op: str = "sum", stream: Any = None) -> None:
        count = _validate.reduce_scatter(in_array, out_array, count, op, self.world_size)
        tag = self._next()
        acc = self._reduce_to(tag, 0, in_array, op)
        if acc is not None:
            flat = acc.reshape(-1, order="A")
            for dst in range(1, self.world_size):
                self._put(f"{tag}/part/0>{dst}", flat[dst * count : (dst + 1) * count])
            _bytes(out_array)[:] = _bytes(flat[:count])
        else:
            self._take(f"{tag}/part/0>{self.rank}", out_array)

    @_validate.reports_invalid
    def all_gather(self, in_array: Any, out_array: Any, count: int, stream: Any = None) -> None:
        count = _validate.all_gather(in_array, out_array, count, self.world_size)
        tag = self._next()
        out_flat = _bytes(out_array)
        width = in_array.itemsize * count
        if self.rank == 0:
            out_flat[:width] = _bytes(in_array)
            for src in range(1, self.world_size):
                self._take_bytes(f"{tag}/{src}>0", out_flat[src * width : (src + 1) * width])
        else:
            self._put(f"{tag}/{self.rank}>0", in_array)
        self._bcast(tag, 0, out_array)

    @_validate.reports_invalid
    def send(self, array: Any, peer: int, stream: Any = None) -> None:
        _validate.check_array("send", "array", array)
        peer = _validate.peer("send", peer, self.rank, self.world_size)
        self._put(self._p2p_key(self.rank, peer), array)

    @_validate.reports_invalid
    def recv(self, out_array: Any, peer: int, stream: Any = None) -> None:
        _validate.check_array("recv", "out_array", out_array)
        peer = _validate.peer("recv", peer, self.rank, self.world_size)
        self._take(self._p2p_key(peer, self.rank), out_array)

    @_validate.reports_invalid
    def send_recv(self, in_array: Any, out_array: Any, peer: int, stream: Any = None) -> None:
        peer = _validate.send_recv(in_array, out_array, peer, self.rank, self.world_size)
        if peer == self.rank:
            _bytes(out_array)[:] = _bytes(in_array)
            return
        # The mailbox holds the outgoing message, so sending first cannot deadlock.
        self._put(self._p2p_key(self.rank, peer), in_array)
        self._take(self._p2p_key(peer, self.rank), out_array)

    def _p2p_key(self, src: int, dst: int) -> str:
        n = self._p2p.get((src, dst), 0) + 1
        self._p2p[(src, dst)] = n
        return f"{self.name}/p2p/{src}>{dst}/{n}"

    @_validate.reports_invalid
    def scatter(self, in_array: Any, out_array: Any, root: int = 0, stream: Any = None) -> None:
        root = _validate.scatter(in_array, out_array, root, self.rank, self.world_size)
        tag = self._next()
        if self.rank == root:
            for dst in range(self.world_size):
                if dst != root:
                    self._put(f"{tag}/{root}>{dst}", in_array[dst])
            _bytes(out_array)[:] = _bytes(in_array[root])
        else:
            self._take(f"{tag}/{root}>{self.rank}", out_array)

    @_validate.reports_invalid
    def gather(self, in_array: Any, out_array: Any, root: int = 0, stream: Any = None) -> None:
        root = _validate.gather(in_array, out_array, root, self.rank, self.world_size)
        tag = self._next()
        if self.rank == root:
            for src in range(self.world_size):
                if src != root:
                    self._take(f"{tag}/{src}>{root}", out_array[src])
            _bytes(out_array[root])[:] = _bytes(in_array)
        else:
            self._put(f"{tag}/{self.rank}>{root}", in_array)

    @_validate.reports_invalid
    def all_to_all(self, in_array: Any, out_array: Any, stream: Any = None) -> None:
        _validate.all_to_all(in_array, out_array, self.world_size)
        tag = self._next()
        for dst in range(self.world_size):
            if dst != self.rank:
                self._put(f"{tag}/{self.rank}>{dst}", in_array[dst])
        _bytes(out_array[self.rank])[:] = _bytes(in_array[self.rank])
        for src in range(self.world_size):
            if src != self.rank:
                self._take(f"{tag}/{src}>{self.rank}", out_array[src])

    # ------------------------------------------------------------------ support
    def exchange_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` (same length everywhere), in rank order (used by split)."""
        mine = np.asarray(values, dtype=np.int64)
        out = np.empty(len(values) * self.world_size, dtype=np.int64)
        self.all_gather(mine, out, len(values))
        return out.reshape(self.world_size, len(values)).tolist()

    def abort(self, error: Exception | None = None) -> None:
        """Nothing runs on a device; pending calls end when the coordinator reports the failure,
        and then raise ``error`` (the cause) rather than what they saw."""
        self._failure = error

    def destroy(self) -> None:
        """Nothing to free."""
