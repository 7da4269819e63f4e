"""The host backend: the communicator API over NumPy arrays, data moved directly between ranks.

It exists so every multi-rank behaviour runs where there is no GPU (CI, laptops, CPU jobs). The
coordinator only introduces the ranks (:mod:`gridcomm._backends.host.plane` publishes each rank's data-plane
address through its key-value store); bytes then go rank to rank, through shared memory between
ranks of one host. Calls are synchronous: ``stream`` is accepted for API compatibility and ignored.

Algorithms, by size (``S`` bytes, ``N`` ranks):

- ``all_reduce`` up to :data:`SMALL_BYTES`: recursive doubling, ``log2 N`` rounds of whole-buffer
  exchanges (ranks beyond the largest power of two fold into a partner first). Latency wins at
  small sizes: NCCL's tuning model switches from tree to ring as sizes grow (NVIDIA/nccl#754),
  gloo ships halving-doubling next to its ring (``gloo/allreduce_halving_doubling.h``), while
  torch's gloo process group runs ``gloo::allreduce``, a ring, at every size
  (``gloo/allreduce.cc``), which costs it ``2(N-1)`` latency steps even at 4 bytes.
- ``all_reduce`` above it, and large ``reduce`` and ``reduce_scatter``: a ring (reduce-scatter,
  then all-gather, ``2(N-1)/N x S`` bytes sent per rank, the bandwidth optimum that gloo's and
  NCCL's rings also reach), every link moving its chunk at once.
- ``broadcast``: a binomial tree up to :data:`SMALL_BYTES`; above it a chain in ring order whose
  ranks forward each frame as it arrives (pipelined, so ``S`` crosses each link once).
- ``all_gather``: the ring's all-gather half. ``reduce`` up to :data:`SMALL_BYTES`: every rank
  sends to the root, which reduces in rank order. ``scatter``, ``gather``, ``all_to_all``,
  ``send``, ``recv``, ``send_recv``: direct, all transfers of a call in flight together.

Every result is bit-identical on every rank: a reduced element is computed once, by one rank, and
copied to the others (the ring), or every rank evaluates the same expression tree with the same
operand order (recursive doubling combines ``op(lower ranks' part, higher ranks' part)`` on both
sides of each exchange, so even ``min``/``max`` of signed zeros agree).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from gridcomm._backends import validate as _validate
from gridcomm._backends.base import NO_HOOKS, ControlPlane, Hooks
from gridcomm._backends.host import plane as _p2p
from gridcomm._backends.host.frames import OPS
from gridcomm._errors import GridcommError, coordinator_lost

_REDUCE: dict[str, Callable[..., Any]] = {
    "sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum, "avg": np.add,
}
#: all_reduce, reduce and broadcast switch from their latency algorithm to their bandwidth one
#: above this many bytes.
SMALL_BYTES = 64 * 1024
_OP = OPS


def _flat(array: Any) -> np.ndarray:
    """The array as a 1-D view in memory order (no copy: arguments are checked contiguous)."""
    return np.asarray(array).reshape(-1, order="A")


def _raw(flat: np.ndarray) -> memoryview:
    """A 1-D array's memory as a writable byte view."""
    return memoryview(flat.view(np.uint8))  # type: ignore[arg-type]


def _copy_unless_same(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[:] = src, skipped when both are the same memory (an in-place call, as NCCL allows)."""
    if dst.ctypes.data != src.ctypes.data:
        np.copyto(dst, src)


def _bounds(count: int, parts: int) -> list[tuple[int, int]]:
    """``count`` elements cut into ``parts`` near-equal runs, as (start, end)."""
    base, extra = divmod(count, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


def _reducer(fn: Callable[..., Any], acc: np.ndarray, start: int) -> Callable[[int, memoryview], None]:
    """A receive sink that folds each arriving frame into ``acc[start:]``: acc = op(frame, acc)."""
    dtype = acc.dtype
    itemsize = dtype.itemsize

    def sink(offset: int, view: memoryview) -> None:
        got = np.frombuffer(view, dtype=dtype)
        first = start + offset // itemsize
        dst = acc[first : first + got.size]
        fn(got, dst, out=dst)

    return sink


class HostBackend:
    """Collectives of one rank of communicator ``name`` over the peer-to-peer data plane."""

    kind = "host"

    def __init__(self, client: ControlPlane, name: str, rank: int, world_size: int, *,
                 config: _p2p.PlaneConfig, participants: Sequence[int] = (), hooks: Hooks = NO_HOOKS,
                 timeout_s: float | None = None) -> None:
        """``timeout_s`` bounds the creation (publishing this rank's card and the barrier that
        waits for every member's; default: the client's), so a recovery's bound covers it."""
        self._client = client
        self.name = name
        self.rank = rank
        self.world_size = world_size
        self.config = config
        #: Called with an ArgumentError before it propagates (the communicator's hook).
        self.on_invalid = hooks.on_invalid
        #: The rank whose process hosts the coordinator (embedded mode), so losing the coordinator
        #: is reported as that rank's failure.
        self.coordinator_rank = hooks.coordinator_rank
        self._plane = _p2p.Plane(config, name, rank, world_size, self._card_of, on_broken=hooks.on_broken)
        try:
            client.set(self._key(rank), self._plane.card.encode())
            # Why a barrier: afterwards every card is in the store, so a later lookup never waits
            # on a rank that died before publishing (a barrier fails fast on a failed rank).
            client.barrier(f"{name}/data-plane", timeout_s, participants=participants)
        except BaseException:
            self._plane.close()
            raise

    def _key(self, rank: int) -> str:
        return f"{self.name}/data-plane/{rank}"

    def _card_of(self, rank: int) -> bytes:
        try:
            return self._client.get(self._key(rank))
        except GridcommError as exc:
            raise coordinator_lost(exc, self.coordinator_rank) from exc

    @property
    def on_broken(self) -> Callable[[BaseException], None] | None:
        """Called when the data plane breaks on its own (bad bytes, a deadline); the
        communicator's hook, which then reports this rank failed."""
        return self._plane.on_broken

    def transports(self) -> dict[int, str]:
        """Each peer this rank has a link to, and how it moves payloads: shm or tcp, +tls where
        its socket is TLS."""
        return self._plane.transports()

    # ------------------------------------------------------------------ building blocks
    def _exchange(self, peer: int, send: memoryview, recv: memoryview, op: int) -> None:
        plane = self._plane
        plane.send(peer, send, op)
        plane.recv(peer, len(recv), op, dest=recv)
        plane.wait()

    def _recursive_doubling(self, w: np.ndarray, fn: Callable[..., Any], op: int) -> None:
        """All-reduce of ``w`` in place, combining op(lower ranks' part, higher ranks' part)."""
        plane, me, n = self._plane, self.rank, self.world_size
        raw = _raw(w)
        core = 1 << (n.bit_length() - 1)
        extra = n - core
        if me >= core:
            # Folded: my part to my partner below, the result back from it.
            plane.send(me - core, raw, op)
            plane.wait()
            plane.recv(me - core, len(raw), op, dest=raw)
            plane.wait()
            return
        scratch = np.empty_like(w)
        sraw = _raw(scratch)
        if me < extra:
            plane.recv(me + core, len(raw), op, dest=sraw)
            plane.wait()
            fn(w, scratch, out=w)
        mask = 1
        while mask < core:
            partner = me ^ mask
            self._exchange(partner, raw, sraw, op)
            if me < partner:
                fn(w, scratch, out=w)
            else:
                fn(scratch, w, out=w)
            mask <<= 1
        if me < extra:
            plane.send(me + core, raw, op)
            plane.wait()

    def _ring_reduce_scatter(self, w: np.ndarray, parts: Sequence[tuple[int, int]], fn: Callable[..., Any],
                             op: int) -> None:
        """Ring reduce-scatter of ``w`` in place over positions ``parts`` (element ranges): after
        it, this rank holds the whole reduction of position ``rank + 1``."""
        plane, me, n = self._plane, self.rank, self.world_size
        raw, its = _raw(w), w.itemsize
        right, left = (me + 1) % n, (me - 1) % n
        for step in range(n - 1):
            s0, s1 = parts[(me - step) % n]
            r0, r1 = parts[(me - step - 1) % n]
            plane.send(right, raw[s0 * its : s1 * its], op)
            plane.recv(left, (r1 - r0) * its, op, reduce=_reducer(fn, w, r0), itemsize=its)
            plane.wait()

    def _ring_all_gather(self, w: np.ndarray, parts: Sequence[tuple[int, int]], op: int) -> None:
        """Ring all-gather in place: this rank starts with position ``rank + 1`` and ends with all."""
        plane, me, n = self._plane, self.rank, self.world_size
        raw, its = _raw(w), w.itemsize
        right, left = (me + 1) % n, (me - 1) % n
        for step in range(n - 1):
            s0, s1 = parts[(me + 1 - step) % n]
            r0, r1 = parts[(me - step) % n]
            plane.send(right, raw[s0 * its : s1 * its], op)
            plane.recv(left, (r1 - r0) * its, op, dest=raw[r0 * its : r1 * its])
            plane.wait()

    def _by_rank(self, count: int) -> list[tuple[int, int]]:
        """Ring positions for per-rank blocks of ``count``: position j holds rank j - 1's block, so
        the ring leaves (or starts) each rank with its own block."""
        n = self.world_size
        return [(((j - 1) % n) * count, ((j - 1) % n + 1) * count) for j in range(n)]

    def _average(self, w: np.ndarray, op: str) -> None:
        if op == "avg":
            np.divide(w, self.world_size, out=w, casting="unsafe")

    # ------------------------------------------------------------------ collectives
    @_validate.reports_invalid
    def all_reduce(self, in_array: Any, out_array: Any, op: str = "sum", stream: Any = None) -> None:
        _validate.all_reduce(in_array, out_array, op)
        self._plane.check()
        w = _flat(out_array)
        _copy_unless_same(w, _flat(in_array))
        n = self.world_size
        if n > 1:
            fn, code = _REDUCE[op], _OP["all_reduce"]
            if w.nbytes <= SMALL_BYTES or w.size < n:
                self._recursive_doubling(w, fn, code)
            else:
                parts = _bounds(w.size, n)
                self._ring_reduce_scatter(w, parts, fn, code)
                self._ring_all_gather(w, parts, code)
        self._average(w, op)

    @_validate.reports_invalid
    def reduce(self, in_array: Any, out_array: Any, root: int = 0, op: str = "sum", stream: Any = None) -> None:
        root = _validate.reduce(in_array, out_array, root, op, self.rank, self.world_size)
        self._plane.check()
        plane, me, n = self._plane, self.rank, self.world_size
        fn, code = _REDUCE[op], _OP["reduce"]
        src = _flat(in_array)
        if n == 1:
            np.copyto(_flat(out_array), src)
            self._average(_flat(out_array), op)
            return
        if src.nbytes <= SMALL_BYTES or src.size < n:
            if me != root:
                plane.send(root, _raw(src), code)
                plane.wait()
                return
            rows = np.empty((n, src.size), dtype=src.dtype)
            rows[root] = src
            for peer in range(n):
                if peer != root:
                    plane.recv(peer, rows[peer].nbytes, code, dest=_raw(rows[peer]))
            plane.wait()
            w = _flat(out_array)
            np.copyto(w, rows[0])
            for peer in range(1, n):
                fn(w, rows[peer], out=w)
            self._average(w, op)
            return
        # Large: a ring reduce-scatter, then each rank's reduced part to the root.
        w = _flat(out_array) if me == root else src.copy()
        if me == root:
            _copy_unless_same(w, src)
        parts = _bounds(w.size, n)
        self._ring_reduce_scatter(w, parts, fn, code)
        raw, its = _raw(w), w.itemsize
        if me == root:
            for peer in range(n):
                if peer != root:
                    p0, p1 = parts[(peer + 1) % n]
                    plane.recv(peer, (p1 - p0) * its, code, dest=raw[p0 * its : p1 * its])
            plane.wait()
            self._average(w, op)
        else:
            p0, p1 = parts[(me + 1) % n]
            plane.send(root, raw[p0 * its : p1 * its], code)
            plane.wait()

    @_validate.reports_invalid
    def broadcast(self, in_out_array: Any, root: int = 0, stream: Any = None) -> None:
        root = _validate.broadcast(in_out_array, root, self.world_size)
        self._plane.check()
        plane, me, n = self._plane, self.rank, self.world_size
        if n == 1:
            return
        raw = _raw(_flat(in_out_array))
        code = _OP["broadcast"]
        v = (me - root) % n
        if len(raw) <= SMALL_BYTES:
            # Binomial tree on ranks relative to the root: v gets it from v minus its top bit,
            # then passes it to v + 2**k for every 2**k above v.
            if v:
                parent = v - (1 << (v.bit_length() - 1))
                plane.recv((parent + root) % n, len(raw), code, dest=raw)
                plane.wait()
            step = 1 << v.bit_length() if v else 1
            while v + step < n:
                plane.send((v + step + root) % n, raw, code)
                step <<= 1
            plane.wait()
            return
        # A chain in ring order from the root; every middle rank forwards each frame on arrival.
        nxt, prev = (me + 1) % n, (me - 1) % n
        if v == 0:
            plane.send(nxt, raw, code)
        elif v == n - 1:
            plane.recv(prev, len(raw), code, dest=raw)
        else:
            onward = plane.send(nxt, raw, code, ready=0)
            plane.recv(prev, len(raw), code, dest=raw, after=onward.advance)
        plane.wait()

    @_validate.reports_invalid
    def reduce_scatter(self, in_array: Any, out_array: Any, count: int, op: str = "sum", stream: Any = None) -> None:
        count = _validate.reduce_scatter(in_array, out_array, count, op, self.world_size)
        self._plane.check()
        me, n = self.rank, self.world_size
        w = _flat(in_array).copy()
        if n > 1:
            fn, code = _REDUCE[op], _OP["reduce_scatter"]
            if w.nbytes <= SMALL_BYTES or count == 0:
                self._recursive_doubling(w, fn, code)
            else:
                self._ring_reduce_scatter(w, self._by_rank(count), fn, code)
        out = _flat(out_array)
        np.copyto(out, w[me * count : (me + 1) * count])
        self._average(out, op)

    @_validate.reports_invalid
    def all_gather(self, in_array: Any, out_array: Any, count: int, stream: Any = None) -> None:
        count = _validate.all_gather(in_array, out_array, count, self.world_size)
        self._plane.check()
        w = _flat(out_array)
        me = self.rank
        np.copyto(w[me * count : (me + 1) * count], _flat(in_array))
        if self.world_size > 1:
            self._ring_all_gather(w, self._by_rank(count), _OP["all_gather"])

    @_validate.reports_invalid
    def send(self, array: Any, peer: int, stream: Any = None) -> None:
        _validate.check_array("send", "array", array)
        peer = _validate.peer("send", peer, self.rank, self.world_size)
        self._plane.check()
        self._plane.send(peer, _raw(_flat(array)), _OP["p2p"])
        self._plane.wait()

    @_validate.reports_invalid
    def recv(self, out_array: Any, peer: int, stream: Any = None) -> None:
        _validate.check_array("recv", "out_array", out_array)
        peer = _validate.peer("recv", peer, self.rank, self.world_size)
        self._plane.check()
        raw = _raw(_flat(out_array))
        self._plane.recv(peer, len(raw), _OP["p2p"], dest=raw)
        self._plane.wait()

    @_validate.reports_invalid
    def send_recv(self, in_array: Any, out_array: Any, peer: int, stream: Any = None) -> None:
        peer = _validate.send_recv(in_array, out_array, peer, self.rank, self.world_size)
        self._plane.check()
        if peer == self.rank:
            _raw(_flat(out_array))[:] = _raw(_flat(in_array))
            return
        self._exchange(peer, _raw(_flat(in_array)), _raw(_flat(out_array)), _OP["p2p"])

    @_validate.reports_invalid
    def scatter(self, in_array: Any, out_array: Any, root: int = 0, stream: Any = None) -> None:
        root = _validate.scatter(in_array, out_array, root, self.rank, self.world_size)
        self._plane.check()
        plane, code = self._plane, _OP["scatter"]
        out = _raw(_flat(out_array))
        if self.rank == root:
            rows = np.asarray(in_array).reshape(self.world_size, -1)
            for peer in range(self.world_size):
                if peer != root:
                    plane.send(peer, _raw(rows[peer]), code)
            out[:] = _raw(rows[root])
        else:
            plane.recv(root, len(out), code, dest=out)
        plane.wait()

    @_validate.reports_invalid
    def gather(self, in_array: Any, out_array: Any, root: int = 0, stream: Any = None) -> None:
        root = _validate.gather(in_array, out_array, root, self.rank, self.world_size)
        self._plane.check()
        plane, code = self._plane, _OP["gather"]
        mine = _raw(_flat(in_array))
        if self.rank == root:
            rows = np.asarray(out_array).reshape(self.world_size, -1)
            for peer in range(self.world_size):
                if peer != root:
                    plane.recv(peer, rows[peer].nbytes, code, dest=_raw(rows[peer]))
            _raw(rows[root])[:] = mine
        else:
            plane.send(root, mine, code)
        plane.wait()

    @_validate.reports_invalid
    def all_to_all(self, in_array: Any, out_array: Any, stream: Any = None) -> None:
        _validate.all_to_all(in_array, out_array, self.world_size)
        self._plane.check()
        plane, code, me = self._plane, _OP["all_to_all"], self.rank
        ins = np.asarray(in_array).reshape(self.world_size, -1)
        outs = np.asarray(out_array).reshape(self.world_size, -1)
        # Why this order: each rank starts with the peer after it, so the n - 1 transfers of one
        # call spread over all links instead of queueing on rank 0's first.
        for i in range(1, self.world_size):
            peer = (me + i) % self.world_size
            plane.send(peer, _raw(ins[peer]), code)
            plane.recv(peer, outs[peer].nbytes, code, dest=_raw(outs[peer]))
        _raw(outs[me])[:] = _raw(ins[me])
        plane.wait()

    # ------------------------------------------------------------------ support
    def exchange_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` (same length everywhere), in rank order (used by split)."""
        mine = np.asarray(values, dtype=np.int64)
        out = np.empty(len(values) * self.world_size, dtype=np.int64)
        self.all_gather(mine, out, len(values))
        return out.reshape(self.world_size, len(values)).tolist()

    def abort(self, error: Exception | None = None) -> None:
        """Ends the call in progress (from any thread) and every later one with ``error``."""
        self._plane.abort(error if error is not None else GridcommError(f"rank {self.rank}: aborted"))

    def destroy(self) -> None:
        """Closes this rank's links (a goodbye frame first when it stops cleanly). Idempotent."""
        self._plane.close()
