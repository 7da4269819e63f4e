"""The NCCL backend: one NCCL communicator per rank, with cupyx's argument conventions.

Two engines drive NCCL, chosen when a communicator is built (``GRIDCOMM_NCCL_ENGINE``): nccl4py
(non-blocking init, bounded by the deadline and ``failed()``) and CuPy's binding; :mod:`.engines`
says how each creates, bounds and splits a communicator. :mod:`.build` puts a backend together.

No gRPC here: unique IDs travel as bytes through the coordinator client ``connect`` is given.
The per-call path is kept short (one dict lookup for the dtype, one for the op, a few attribute
reads) and calls NCCL through the engine's low-level function with raw pointers (nccl4py:
``nccl.bindings.nccl.*``), and makes no host synchronisation, allocation or control-plane call,
so collectives can be captured in a CUDA graph. Invalid calls fall to the shared checks in
``_validate`` for the error message.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from gridcomm import _config
from gridcomm._backends import validate as _validate
from gridcomm._backends.base import NO_HOOKS, Hooks
from gridcomm._backends.nccl import build, lifecycle
from gridcomm._backends.nccl.engines import _engine_for
from gridcomm._backends.nccl.loader import _load_cupy, engine
from gridcomm._backends.nccl.sampler import GpuSampler
from gridcomm._backends.nccl.timing import MASK
from gridcomm._config.settings import NcclSettings
from gridcomm._errors import ArgumentError, GridcommError

log = logging.getLogger(__name__)

_clock = time.monotonic


class NcclBackend:
    """One rank's NCCL communicator. Built by :func:`connect` (the communicator calls it after the
    rendezvous); ``unique_id`` is one ID (bytes) or the list of a multi-root init."""

    kind = "nccl"
    #: The communicator counts this backend's collectives through :attr:`progress` (one frame
    #: less per call than a wrapper: NCCL's small calls are a few microseconds).
    counts_itself = True

    def __init__(self, world_size: int, rank: int, unique_id: bytes | Sequence[bytes], *,
                 engine_name: str | None = None, deadline: float | None = None,
                 failed: Callable[[], BaseException | None] = lambda: None, label: str = "world",
                 hooks: Hooks = NO_HOOKS, settings: NcclSettings | None = None) -> None:
        #: Where each collective is counted as it is entered (the communicator's tracker; see
        #: gridcomm._client.tracker): anything with ``entered`` and ``kind``.
        self.progress: Any = build._Count()
        #: Called with an ArgumentError before it propagates (the communicator's hook).
        self.on_invalid: Callable[[Exception], None] | None = hooks.on_invalid
        #: The engine settings it was made with (a split child made through connect reuses them).
        self.settings = settings
        cupy = _load_cupy()
        eng = _engine_for(engine_name or engine(setting=None if settings is None else settings.engine))
        ids = [bytes(unique_id)] if isinstance(unique_id, (bytes, bytearray)) else [bytes(u) for u in unique_id]
        self.rank = rank
        self.world_size = world_size
        self.engine = eng.name
        self._engine = eng
        self._cupy = cupy
        self._current_stream = cupy.cuda.get_current_stream
        self._dtypes, self._ops, self._by_id, self._reduce_by_id = build.call_tables(cupy, eng)
        self._group_start, self._group_end = eng.group_start, eng.group_end
        # NCCL's per-call functions, in the engine's one shape (see the engines above).
        self._nccl_all_reduce, self._nccl_reduce, self._nccl_broadcast = eng.all_reduce, eng.reduce, eng.broadcast
        self._nccl_reduce_scatter, self._nccl_all_gather = eng.reduce_scatter, eng.all_gather
        self._nccl_send, self._nccl_recv = eng.send, eng.recv
        if deadline is None:
            deadline = time.monotonic() + _config.DEFAULT_TIMEOUT_S
        #: This rank's mark on its GPU while the communicator lives (see sharing): checked
        #: before NCCL init, so ranks sharing a GPU without NCCL's mode get a ConfigError.
        self._marker = build._check_sharing(cupy, eng, ids[0], rank, world_size)
        try:
            #: What owns the communicator (abort/destroy), and the handle the per-call functions take.
            self._owner: Any = eng.create(world_size, rank, ids, deadline, failed, label)
        except BaseException:
            if self._marker is not None:
                self._marker.remove()
            raise
        #: While calls wait for a split (see build.defer_to_first_call): the real per-call functions
        #: and group_start, to put back.
        self._pending: tuple[dict[str, Any], Callable[[], None]] | None = None
        if getattr(self._owner, "ready_now", True):
            self._c: Any = eng.handle(self._owner)
        else:
            build.defer_to_first_call(self)
        #: GPU completion and the timed collectives' GPU time, sampled on a thread of its own
        #: (see gpu_progress, sampler and timing).
        self._device_id = cupy.cuda.Device().id
        self._timer = build._timer(cupy)
        self._sampler = GpuSampler(self._device_id, timer=self._timer)

    # ------------------------------------------------------------------ a split still under way
    _PER_CALL = ("_nccl_all_reduce", "_nccl_reduce", "_nccl_broadcast", "_nccl_reduce_scatter", "_nccl_all_gather",
                 "_nccl_send", "_nccl_recv")

    def ready(self) -> Any:
        """Waits until this communicator's calls go straight to NCCL and returns the handle they
        pass: with nccl4py, until the split to the blocking child is complete (bounded by the
        init's deadline; raises what ended it); at once otherwise. A first collective does the
        same by itself."""
        owner = self._owner
        if owner is None:
            raise self._gone()
        pending = self._pending
        if pending is None:
            return self._c
        handle = owner.ready()  # waits (bounded) for the split; raises what ended it
        self._c = handle
        if self._owner is None:  # aborted meanwhile: abort() swapped in the null handle after this read
            self._c = self._engine.null
            raise self._gone()
        real, group_start = pending
        self.__dict__.update(real)
        self._group_start = group_start
        self._pending = None
        return handle

    def _gone(self) -> GridcommError:
        return GridcommError(f"rank {self.rank}: this NCCL communicator was aborted or destroyed.")

    # ------------------------------------------------------------------ helpers
    def _stream(self, stream: Any) -> int:
        # The fast paths below spell this out inline: they avoid even one extra method call.
        return self._current_stream().ptr if stream is None else stream.ptr

    def _typed(self, array: Any, method: str, name: str) -> tuple[int, int]:
        """(NCCL type, count) for a contiguous supported array; raises the shared error otherwise."""
        try:
            nccl_type, mult = self._dtypes[array.dtype]
        except (KeyError, AttributeError):
            _validate.check_array(method, name, array)
            raise ArgumentError(f"{method}: {name} dtype {array.dtype} is not supported by this NCCL") from None
        flags = array.flags
        if not (flags.c_contiguous or flags.f_contiguous):
            _validate.check_contiguous(method, name, array)
        return nccl_type, array.size * mult

    # ------------------------------------------------------------------ timed collectives
    # Every timing.EVERY-th collective (by count, so the same one on every rank) runs through
    # these: timing events recorded around it on its stream (see timing).
    def _time_start(self, stream: Any) -> tuple[Any, Any] | None:
        timer = self._timer
        return None if timer is None else timer.start(stream)

    def _timed(self, stream: Any, call: Callable[..., Any], *args: Any) -> None:
        timer = self._timer
        pair = None if timer is None else timer.start(stream)
        if pair is None:
            call(*args)
            return
        try:
            call(*args)
        except BaseException:
            timer.cancel(pair)  # type: ignore[union-attr]
            raise
        timer.end(pair, stream)  # type: ignore[union-attr]

    # ------------------------------------------------------------------ collectives
    # all_reduce, broadcast, all_gather, send, recv and send_recv have a fast path: an identity
    # lookup of the dtype, C-contiguous CuPy arrays (``_c_contiguous``, a plain attribute, where
    # ``flags`` builds an object), exact sizes and a plain int rank. It only ever accepts calls the
    # shared checks accept, with the same NCCL arguments; anything else (invalid calls, F-order
    # arrays, NumPy integers as ranks) goes through ``_*_args``, which run the shared checks, raise
    # the precise ArgumentError through ``on_invalid``, or return the NCCL arguments.
    def all_reduce(self, in_array: Any, out_array: Any, op: str = "sum", stream: Any = None) -> None:
        counter = self.progress  # the communicator's count of collectives entered
        counter.entered = n = counter.entered + 1
        counter.kind = "all_reduce"
        counter.stream = st = self._current_stream() if stream is None else stream
        s = st.ptr
        try:
            dtype = in_array.dtype
            nccl_type, mult, code = self._reduce_by_id[op][id(dtype)]
            count = in_array.size
            fast = (in_array._c_contiguous and out_array._c_contiguous and out_array.size == count
                    and out_array.dtype is dtype)
            count *= mult
        except (KeyError, AttributeError, TypeError):
            fast = False
        if not fast:
            nccl_type, count, code = self._all_reduce_args(in_array, out_array, op)
        rec = counter.record  # the flight record (see gridcomm._client.flight): what was asked, never an array
        if rec is not None:
            rec.append((n, "all_reduce", _clock(), in_array.size, in_array.dtype, op))
        if n & MASK:
            self._nccl_all_reduce(in_array.data.ptr, out_array.data.ptr, count, nccl_type, code, self._c, s)
        else:
            self._timed(st, self._nccl_all_reduce, in_array.data.ptr, out_array.data.ptr, count, nccl_type, code,
                        self._c, s)

    @_validate.reports_invalid
    def _all_reduce_args(self, in_array: Any, out_array: Any, op: str) -> tuple[int, int, int]:
        _validate.all_reduce(in_array, out_array, op)
        nccl_type, count = self._typed(in_array, "all_reduce", "in_array")
        return nccl_type, count, self._ops[op]

    @_validate.reports_invalid
    def reduce(self, in_array: Any, out_array: Any, root: int = 0, op: str = "sum", stream: Any = None) -> None:
        counter = self.progress  # the communicator's count of collectives entered
        counter.entered = n = counter.entered + 1
        counter.kind = "reduce"
        counter.stream = st = self._current_stream() if stream is None else stream
        s = st.ptr
        root = _validate.reduce(in_array, out_array, root, op, self.rank, self.world_size)
        nccl_type, count = self._typed(in_array, "reduce", "in_array")
        out_ptr = out_array.data.ptr if self.rank == root else in_array.data.ptr
        rec = counter.record
        if rec is not None:
            rec.append((n, "reduce", _clock(), in_array.size, in_array.dtype, root, op))
        if n & MASK:
            self._nccl_reduce(in_array.data.ptr, out_ptr, count, nccl_type, self._ops[op], root, self._c, s)
        else:
            self._timed(st, self._nccl_reduce, in_array.data.ptr, out_ptr, count, nccl_type, self._ops[op], root,
                        self._c, s)

    def broadcast(self, in_out_array: Any, root: int = 0, stream: Any = None) -> None:
        counter = self.progress  # the communicator's count of collectives entered
        counter.entered = n = counter.entered + 1
        counter.kind = "broadcast"
        counter.stream = st = self._current_stream() if stream is None else stream
        s = st.ptr
        try:
            nccl_type, mult = self._by_id[id(in_out_array.dtype)]
            fast = in_out_array._c_contiguous and type(root) is int and 0 <= root < self.world_size
            count = in_out_array.size * mult
        except (KeyError, AttributeError):
            fast = False
        if not fast:
            nccl_type, count, root = self._broadcast_args(in_out_array, root)
        ptr = in_out_array.data.ptr
        rec = counter.record
        if rec is not None:
            rec.append((n, "broadcast", _clock(), in_out_array.size, in_out_array.dtype, root))
        if n & MASK:
            self._nccl_broadcast(ptr, ptr, count, nccl_type, root, self._c, s)
        else:
            self._timed(st, self._nccl_broadcast, ptr, ptr, count, nccl_type, root, self._c, s)

    @_validate.reports_invalid
    def _broadcast_args(self, in_out_array: Any, root: int) -> tuple[int, int, int]:
        root = _validate.broadcast(in_out_array, root, self.world_size)
        nccl_type, count = self._typed(in_out_array, "broadcast", "in_out_array")
        return nccl_type, count, root

    @_validate.reports_invalid
    def reduce_scatter(self, in_array: Any, out_array: Any, count: int, op: str = "sum", stream: Any = None) -> None:
        counter = self.progress  # the communicator's count of collectives entered
        counter.entered = n = counter.entered + 1
        counter.kind = "reduce_scatter"
        counter.stream = st = self._current_stream() if stream is None else stream
        s = st.ptr
        count = _validate.reduce_scatter(in_array, out_array, count, op, self.world_size)
        nccl_type, mult = self._dtypes[in_array.dtype]
        rec = counter.record
        if rec is not None:
            rec.append((n, "reduce_scatter", _clock(), in_array.size, in_array.dtype, count, op))
        if n & MASK:
            self._nccl_reduce_scatter(in_array.data.ptr, out_array.data.ptr, count * mult, nccl_type, self._ops[op],
                                      self._c, s)
        else:
            self._timed(st, self._nccl_reduce_scatter, in_array.data.ptr, out_array.data.ptr, count * mult, nccl_type,
                        self._ops[op], self._c, s)

    def all_gather(self, in_array: Any, out_array: Any, count: int, stream: Any = None) -> None:
        counter = self.progress  # the communicator's count of collectives entered
        counter.entered = n = counter.entered + 1
        counter.kind = "all_gather"
        counter.stream = st = self._current_stream() if stream is None else stream
        s = st.ptr
        try:
            dtype = in_array.dtype
            nccl_type, mult = self._by_id[id(dtype)]
            fast = (type(count) is int and in_array.size == count and in_array._c_contiguous
                    and out_array._c_contiguous and out_array.size == count * self.world_size
                    and out_array.dtype is dtype)
        except (KeyError, AttributeError):
            fast = False
        if not fast:
            nccl_type, mult, count = self._all_gather_args(in_array, out_array, count)
        rec = counter.record
        if rec is not None:
            rec.append((n, "all_gather", _clock(), in_array.size, in_array.dtype, count))
        if n & MASK:
            self._nccl_all_gather(in_array.data.ptr, out_array.data.ptr, count * mult, nccl_type, self._c, s)
        else:
            self._timed(st, self._nccl_all_gather, in_array.data.ptr, out_array.data.ptr, count * mult, nccl_type,
                        self._c, s)

    @_validate.reports_invalid
    def _all_gather_args(self, in_array: Any, out_array: Any, count: int) -> tuple[int, int, int]:
        count = _validate.all_gather(in_array, out_array, count, self.world_size)
        nccl_type, mult = self._dtypes[in_array.dtype]
        return nccl_type, mult, count

    @_validate.reports_invalid
    def _p2p_args(self, method: str, name: str, array: Any, peer: Any) -> tuple[int, int, int]:
        nccl_type, count = self._typed(array, method, name)  # the shared checks, array first
        return nccl_type, count, _validate.peer(method, peer, self.rank, self.world_size)

    # send and recv spell their fast check out rather than share a helper: a helper's frame is a
    # sizeable share of what they add to NCCL's call (benchmarks/overhead_probe.py measures it).
    def send(self, array: Any, peer: int, stream: Any = None) -> None:
        try:
            nccl_type, mult = self._by_id[id(array.dtype)]
            fast = array._c_contiguous and type(peer) is int and 0 <= peer < self.world_size and peer != self.rank
            count = array.size * mult
        except (KeyError, AttributeError):
            fast = False
        if not fast:
            nccl_type, count, peer = self._p2p_args("send", "array", array, peer)
        self._nccl_send(array.data.ptr, count, nccl_type, peer, self._c,
                        self._current_stream().ptr if stream is None else stream.ptr)

    def recv(self, out_array: Any, peer: int, stream: Any = None) -> None:
        try:
            nccl_type, mult = self._by_id[id(out_array.dtype)]
            fast = (out_array._c_contiguous and type(peer) is int and 0 <= peer < self.world_size
                    and peer != self.rank)
            count = out_array.size * mult
        except (KeyError, AttributeError):
            fast = False
        if not fast:
            nccl_type, count, peer = self._p2p_args("recv", "out_array", out_array, peer)
        self._nccl_recv(out_array.data.ptr, count, nccl_type, peer, self._c,
                        self._current_stream().ptr if stream is None else stream.ptr)

    def send_recv(self, in_array: Any, out_array: Any, peer: int, stream: Any = None) -> None:
        try:
            in_type, in_mult = self._by_id[id(in_array.dtype)]
            out_type, out_mult = self._by_id[id(out_array.dtype)]
            fast = (in_array._c_contiguous and out_array._c_contiguous and type(peer) is int
                    and 0 <= peer < self.world_size)  # oneself allowed: both halves are in one group
            in_count, out_count = in_array.size * in_mult, out_array.size * out_mult
        except (KeyError, AttributeError):
            fast = False
        if not fast:
            in_type, in_count, out_type, out_count, peer = self._send_recv_args(in_array, out_array, peer)
        s = self._current_stream().ptr if stream is None else stream.ptr
        self._group_start()
        c = self._c  # after group_start: a first call's group_start may have just set it
        try:
            self._nccl_send(in_array.data.ptr, in_count, in_type, peer, c, s)
            self._nccl_recv(out_array.data.ptr, out_count, out_type, peer, c, s)
        finally:
            self._group_end()

    @_validate.reports_invalid
    def _send_recv_args(self, in_array: Any, out_array: Any, peer: int) -> tuple[int, int, int, int, int]:
        peer = _validate.send_recv(in_array, out_array, peer, self.rank, self.world_size)
        in_type, in_count = self._typed(in_array, "send_recv", "in_array")
        out_type, out_count = self._typed(out_array, "send_recv", "out_array")
        return in_type, in_count, out_type, out_count, peer

    @_validate.reports_invalid
    def scatter(self, in_array: Any, out_array: Any, root: int = 0, stream: Any = None) -> None:
        counter = self.progress  # the communicator's count of collectives entered
        counter.entered = n = counter.entered + 1
        counter.kind = "scatter"
        counter.stream = st = self._current_stream() if stream is None else stream
        s = st.ptr
        root = _validate.scatter(in_array, out_array, root, self.rank, self.world_size)
        out_type, out_count = self._typed(out_array, "scatter", "out_array")
        rec = counter.record
        if rec is not None:
            rec.append((n, "scatter", _clock(), out_array.size, out_array.dtype, root))
        pair = None if n & MASK else self._time_start(st)
        self._group_start()
        send, recv, c = self._nccl_send, self._nccl_recv, self._c  # after group_start (see send_recv)
        try:
            if self.rank == root:
                for dst in range(self.world_size):
                    send(in_array[dst].data.ptr, out_count, out_type, dst, c, s)
            recv(out_array.data.ptr, out_count, out_type, root, c, s)
        finally:
            self._group_end()
        if pair is not None:
            self._timer.end(pair, st)  # type: ignore[union-attr]

    @_validate.reports_invalid
    def gather(self, in_array: Any, out_array: Any, root: int = 0, stream: Any = None) -> None:
        counter = self.progress  # the communicator's count of collectives entered
        counter.entered = n = counter.entered + 1
        counter.kind = "gather"
        counter.stream = st = self._current_stream() if stream is None else stream
        s = st.ptr
        root = _validate.gather(in_array, out_array, root, self.rank, self.world_size)
        in_type, in_count = self._typed(in_array, "gather", "in_array")
        rec = counter.record
        if rec is not None:
            rec.append((n, "gather", _clock(), in_array.size, in_array.dtype, root))
        pair = None if n & MASK else self._time_start(st)
        self._group_start()
        send, recv, c = self._nccl_send, self._nccl_recv, self._c  # after group_start (see send_recv)
        try:
            if self.rank == root:
                for src in range(self.world_size):
                    recv(out_array[src].data.ptr, in_count, in_type, src, c, s)
            send(in_array.data.ptr, in_count, in_type, root, c, s)
        finally:
            self._group_end()
        if pair is not None:
            self._timer.end(pair, st)  # type: ignore[union-attr]

    @_validate.reports_invalid
    def all_to_all(self, in_array: Any, out_array: Any, stream: Any = None) -> None:
        counter = self.progress  # the communicator's count of collectives entered
        counter.entered = n = counter.entered + 1
        counter.kind = "all_to_all"
        counter.stream = st = self._current_stream() if stream is None else stream
        s = st.ptr
        _validate.all_to_all(in_array, out_array, self.world_size)
        nccl_type, mult = self._dtypes[in_array.dtype]
        count = in_array.size // self.world_size * mult
        rec = counter.record
        if rec is not None:
            rec.append((n, "all_to_all", _clock(), in_array.size, in_array.dtype))
        pair = None if n & MASK else self._time_start(st)
        self._group_start()
        send, recv, c = self._nccl_send, self._nccl_recv, self._c  # after group_start (see send_recv)
        try:
            for peer in range(self.world_size):
                send(in_array[peer].data.ptr, count, nccl_type, peer, c, s)
                recv(out_array[peer].data.ptr, count, nccl_type, peer, c, s)
        finally:
            self._group_end()
        if pair is not None:
            self._timer.end(pair, st)  # type: ignore[union-attr]

    # ------------------------------------------------------------------ support
    def split(self, color: int, key: int, new_rank: int, new_size: int, hooks: Hooks = NO_HOOKS) -> NcclBackend | None:
        """ncclCommSplit with the cupy engine where CuPy has commSplit (every rank calls; color < 0
        joins no group). None otherwise, and always with nccl4py: the caller then builds the child
        through :func:`connect`, whose init is non-blocking and bounded (a split of this blocking
        communicator would block, unbounded, on a peer that died)."""
        return build.split_child(self, color, key, new_rank, new_size, hooks)

    def exchange_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` in rank order, through an NCCL all_gather (used by split)."""
        return build.exchange_ints(self, values)

    def gpu_progress(self) -> tuple[int, float]:
        """On the background loop, once per heartbeat: how many of this communicator's collectives
        are known complete on the GPU, and how long the pending sample has waited (0: none).
        Never calls CUDA here (see sampler: a thread of its own records and queries one event at
        a time after the last collective entered); the main thread pays nothing for it but noting
        the stream."""
        counter = self.progress
        if self._owner is None:
            return self._sampler.completed, 0.0
        return self._sampler.poll(counter.entered, counter.stream)

    def gpu_completed(self) -> int:
        """How many of this communicator's collectives the sampler last found complete on the GPU
        (for the flight record; never calls CUDA)."""
        return self._sampler.completed

    def gpu_inside_s(self) -> float:
        """Estimated seconds this rank's collectives here spent inside on the GPU in all (see
        timing; 0 until a timed collective was read)."""
        timer = self._timer
        return 0.0 if timer is None else timer.inside_s(self.progress.entered)

    def synchronize(self) -> None:
        self._current_stream().synchronize()

    def abort(self, error: Exception | None = None) -> None:
        """ncclCommAbort: releases a collective spinning on the GPU (callable from another thread).
        The per-call handle is swapped for the engine's null one first, so a later call fails in
        NCCL's own argument check instead of touching freed memory."""
        owner, self._owner = self._owner, None
        self._c = self._engine.null
        build.unmark(self)
        if owner is not None:
            owner.abort()  # CuPy's NcclCommunicator and nccl.core's Communicator alike

    #: Its abort may block (ncclCommAbort waits for the GPU): the communicator runs it off the
    #: thread that heard of a failure (the background loop, which must go on heartbeating).
    abort_may_block = True

    def destroy(self) -> None:
        """ncclCommDestroy (every rank of the communicator calls it, as ``stop()`` does), bounded:
        past ``lifecycle.DESTROY_WAIT_S`` the communicator is aborted instead (see lifecycle)."""
        owner, self._owner = self._owner, None
        self._c = self._engine.null
        build.unmark(self)
        if owner is not None:
            lifecycle.bounded_destroy(owner, f"rank {self.rank} of {self.world_size} ({self.engine})")

