"""The NCCL backend: ``cupy.cuda.nccl.NcclCommunicator`` with cupyx's argument conventions.

No gRPC here: the unique ID arrives as bytes from whoever ran the rendezvous. The per-call path
is kept short (one dict lookup for the dtype, one for the op, a few attribute reads), and makes
no host synchronisation, allocation or control-plane call, so collectives can be captured in a
CUDA graph. Invalid calls fall to the shared checks in ``_validate`` for the error message.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gridcomm import _validate
from gridcomm._errors import ArgumentError, ConfigError, GridcommError

_cupy: Any = None
_nccl: Any = None


def _load() -> tuple[Any, Any]:
    """Imports CuPy and its NCCL binding on first use (never at ``import gridcomm``)."""
    global _cupy, _nccl
    if _nccl is None:
        try:
            import cupy
            from cupy.cuda import nccl
        except Exception as exc:  # noqa: BLE001 - ImportError, or CUDA library load errors
            raise ConfigError(f"the nccl backend needs CuPy with NCCL (pip install 'gridcomm[cuda12]' or "
                              f"'gridcomm[cuda13]'); importing it failed: {exc}. On a machine without GPUs use "
                              f"backend='host' (NumPy arrays), or backend='auto', which picks host there "
                              f"(GRIDCOMM_BACKEND=host or auto).") from exc
        if not getattr(nccl, "available", False):
            raise ConfigError("CuPy is installed but NCCL is not available to it; install nvidia-nccl-cu12 "
                              "(or -cu13) matching your cupy-cuda package, or use backend='host' (NumPy arrays) or "
                              "backend='auto' (NCCL where it works, else host); GRIDCOMM_BACKEND sets either.")
        _cupy, _nccl = cupy, nccl
    return _cupy, _nccl


def available() -> bool:
    """True when CuPy imports, sees at least one GPU, and has NCCL (what backend='auto' asks)."""
    try:
        cupy, _ = _load()
        return bool(cupy.cuda.runtime.getDeviceCount() > 0)
    except Exception:  # noqa: BLE001 - any failure means "not available"
        return False


def require_gpu() -> None:
    """Raises ConfigError, before any rendezvous, when backend='nccl' cannot work here: no CuPy
    or NCCL (see _load), or no GPU that CuPy sees."""
    cupy, _ = _load()
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # noqa: BLE001 - CUDA driver errors: no usable GPU
        count, why = 0, f" ({exc})"
    else:
        why = ""
    if count == 0:
        raise ConfigError(f"backend='nccl' needs a GPU, but CuPy sees none{why}; on a machine without GPUs use "
                          "backend='host' (NumPy arrays) or backend='auto' (NCCL where a GPU is, else host); "
                          "GRIDCOMM_BACKEND sets either.")


def connect(client: Any, name: str, rank: int, size: int, *,
            failed: Callable[[], BaseException | None] = lambda: None) -> NcclBackend:
    """This rank's NCCL communicator ``name`` of ``size`` ranks: its rank 0 makes the unique ID (the
    NCCL bootstrap root lives in the creating process) and publishes it through ``client`` (a
    CoordinatorClient: ``set``/``get``); the others fetch it. ``failed()``: a peer's failure seen
    by this rank's watcher, or None."""
    key = f"{name}/nccl-unique-id"
    if rank == 0:
        unique_id = new_unique_id()
        client.set(key, unique_id)
    else:
        unique_id = client.get(key)
    return NcclBackend(size, rank, unique_id)


def new_unique_id() -> bytes:
    """A fresh NCCL unique ID as 128 bytes (the bootstrap root lives in this process)."""
    _, nccl = _load()
    return id_to_bytes(nccl.get_unique_id())


def id_to_bytes(uid: Any) -> bytes:
    """One place for both forms CuPy has used: a tuple of signed chars, or bytes."""
    if isinstance(uid, (bytes, bytearray)):
        data = bytes(uid)
    else:
        data = bytes(int(c) & 0xFF for c in uid)
    if len(data) != 128:
        raise ConfigError(f"an NCCL unique ID has 128 bytes, not {len(data)}.")
    return data


def id_forms(data: bytes) -> tuple[bytes, tuple[int, ...]]:
    """The two forms ``NcclCommunicator`` has taken: bytes (CuPy 14) and a tuple of 128 signed
    chars (older CuPy). Checked for length first, so a wrong value never reaches NCCL."""
    if len(data) != 128:
        raise ConfigError(f"an NCCL unique ID has 128 bytes, not {len(data)}; the key-value store gave a "
                          "different value.")
    return bytes(data), tuple(b - 256 if b > 127 else b for b in data)


class NcclBackend:
    """One rank's NCCL communicator. Built by the communicator after the rendezvous."""

    kind = "nccl"
    #: Called with an ArgumentError before it propagates (set by the communicator).
    on_invalid: Callable[[Exception], None] | None = None

    def __init__(self, world_size: int, rank: int, unique_id: bytes) -> None:
        cupy, nccl = _load()
        self.rank = rank
        self.world_size = world_size
        self._cupy = cupy
        self._nccl = nccl
        self._current_stream = cupy.cuda.get_current_stream
        # Precomputed tables: dtype -> (NCCL type, elements per array element), op -> NCCL op.
        self._dtypes: dict[Any, tuple[int, int]] = {}
        for name, code in (("int8", "NCCL_INT8"), ("uint8", "NCCL_UINT8"), ("int32", "NCCL_INT32"),
                           ("uint32", "NCCL_UINT32"), ("int64", "NCCL_INT64"), ("uint64", "NCCL_UINT64"),
                           ("float16", "NCCL_FLOAT16"), ("float32", "NCCL_FLOAT32"), ("float64", "NCCL_FLOAT64")):
            self._dtypes[cupy.dtype(name)] = (getattr(nccl, code), 1)
        self._dtypes[cupy.dtype("complex64")] = (nccl.NCCL_FLOAT32, 2)
        self._dtypes[cupy.dtype("complex128")] = (nccl.NCCL_FLOAT64, 2)
        if hasattr(nccl, "NCCL_BFLOAT16"):
            try:  # CuPy 14 knows "bfloat16" through ml_dtypes
                self._dtypes[cupy.dtype("bfloat16")] = (nccl.NCCL_BFLOAT16, 1)
            except TypeError:
                pass
        self._ops = {"sum": nccl.NCCL_SUM, "prod": nccl.NCCL_PROD, "min": nccl.NCCL_MIN, "max": nccl.NCCL_MAX}
        # ncclAvg exists from NCCL 2.10; CuPy may not export its constant (its value is 4).
        self._ops["avg"] = getattr(nccl, "NCCL_AVG", 4)
        # The per-call tables are keyed by id(dtype): hashing a NumPy dtype costs more than the rest
        # of a fast path. The dtype objects are held by self._dtypes, so an id found here is that
        # very dtype; any other object (an equal dtype included) misses and takes the checked path.
        #   id(dtype) -> (NCCL type, elements per array element)
        #   op -> id(dtype) -> (NCCL type, elements per array element, NCCL op), valid pairs only
        #   (complex: sum only; avg: floating types only).
        self._by_id: dict[int, tuple[int, int]] = {id(dt): entry for dt, entry in self._dtypes.items()}
        self._reduce_by_id: dict[str, dict[int, tuple[int, int, int]]] = {op: {} for op in self._ops}
        for dt, (nccl_type, mult) in self._dtypes.items():
            for op, code in self._ops.items():
                if (mult == 2 and op != "sum") or (op == "avg" and dt.kind != "f" and dt.name != "bfloat16"):
                    continue
                self._reduce_by_id[op][id(dt)] = (nccl_type, mult, code)
        self._group_start, self._group_end = nccl.groupStart, nccl.groupEnd
        as_bytes, as_tuple = id_forms(unique_id)
        try:
            try:
                self._comm = nccl.NcclCommunicator(world_size, as_bytes, rank)
            except TypeError:
                # Why: the argument type is checked before NCCL runs, so retrying is safe.
                self._comm = nccl.NcclCommunicator(world_size, as_tuple, rank)
        except Exception as exc:  # noqa: BLE001 - NcclError, CUDA errors
            raise GridcommError(f"rank {rank} of {world_size}: building the NCCL communicator failed: {exc}") from exc

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

    # ------------------------------------------------------------------ collectives
    # all_reduce, broadcast, all_gather, send, recv and send_recv have a fast path: an identity
    # lookup of the dtype, C-contiguous CuPy arrays (``_c_contiguous``, a plain attribute, where
    # ``flags`` builds an object), exact sizes and a plain int rank. It only ever accepts calls the
    # shared checks accept, with the same NCCL arguments; anything else (invalid calls, F-order
    # arrays, NumPy integers as ranks) goes through ``_*_args``, which run the shared checks, raise
    # the precise ArgumentError through ``on_invalid``, or return the NCCL arguments.
    def all_reduce(self, in_array: Any, out_array: Any, op: str = "sum", stream: Any = None) -> None:
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
        self._comm.allReduce(in_array.data.ptr, out_array.data.ptr, count, nccl_type, code,
                             self._current_stream().ptr if stream is None else stream.ptr)

    @_validate.reports_invalid
    def _all_reduce_args(self, in_array: Any, out_array: Any, op: str) -> tuple[int, int, int]:
        _validate.all_reduce(in_array, out_array, op)
        nccl_type, count = self._typed(in_array, "all_reduce", "in_array")
        return nccl_type, count, self._ops[op]

    @_validate.reports_invalid
    def reduce(self, in_array: Any, out_array: Any, root: int = 0, op: str = "sum", stream: Any = None) -> None:
        root = _validate.reduce(in_array, out_array, root, op, self.rank, self.world_size)
        nccl_type, count = self._typed(in_array, "reduce", "in_array")
        out_ptr = out_array.data.ptr if self.rank == root else in_array.data.ptr
        self._comm.reduce(in_array.data.ptr, out_ptr, count, nccl_type, self._ops[op], root, self._stream(stream))

    def broadcast(self, in_out_array: Any, root: int = 0, stream: Any = None) -> None:
        try:
            nccl_type, mult = self._by_id[id(in_out_array.dtype)]
            fast = in_out_array._c_contiguous and type(root) is int and 0 <= root < self.world_size
            count = in_out_array.size * mult
        except (KeyError, AttributeError):
            fast = False
        if not fast:
            nccl_type, count, root = self._broadcast_args(in_out_array, root)
        ptr = in_out_array.data.ptr
        self._comm.broadcast(ptr, ptr, count, nccl_type, root,
                             self._current_stream().ptr if stream is None else stream.ptr)

    @_validate.reports_invalid
    def _broadcast_args(self, in_out_array: Any, root: int) -> tuple[int, int, int]:
        root = _validate.broadcast(in_out_array, root, self.world_size)
        nccl_type, count = self._typed(in_out_array, "broadcast", "in_out_array")
        return nccl_type, count, root

    @_validate.reports_invalid
    def reduce_scatter(self, in_array: Any, out_array: Any, count: int, op: str = "sum", stream: Any = None) -> None:
        count = _validate.reduce_scatter(in_array, out_array, count, op, self.world_size)
        nccl_type, mult = self._dtypes[in_array.dtype]
        self._comm.reduceScatter(in_array.data.ptr, out_array.data.ptr, count * mult, nccl_type, self._ops[op],
                                 self._stream(stream))

    def all_gather(self, in_array: Any, out_array: Any, count: int, stream: Any = None) -> None:
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
        self._comm.allGather(in_array.data.ptr, out_array.data.ptr, count * mult, nccl_type,
                             self._current_stream().ptr if stream is None else stream.ptr)

    @_validate.reports_invalid
    def _all_gather_args(self, in_array: Any, out_array: Any, count: int) -> tuple[int, int, int]:
        count = _validate.all_gather(in_array, out_array, count, self.world_size)
        nccl_type, mult = self._dtypes[in_array.dtype]
        return nccl_type, mult, count

    @_validate.reports_invalid
    def _p2p_args(self, method: str, name: str, array: Any, peer: Any) -> tuple[int, int, int]:
        nccl_type, count = self._typed(array, method, name)  # the shared checks, array first
        return nccl_type, count, _validate.peer(method, peer, self.rank, self.world_size)

    # send and recv spell their fast check out rather than share a helper: a helper's frame was
    # 40 ns of the ~280 ns they add to NCCL's call (benchmarks/overhead_probe.py).
    def send(self, array: Any, peer: int, stream: Any = None) -> None:
        try:
            nccl_type, mult = self._by_id[id(array.dtype)]
            fast = array._c_contiguous and type(peer) is int and 0 <= peer < self.world_size and peer != self.rank
            count = array.size * mult
        except (KeyError, AttributeError):
            fast = False
        if not fast:
            nccl_type, count, peer = self._p2p_args("send", "array", array, peer)
        self._comm.send(array.data.ptr, count, nccl_type, peer,
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
        self._comm.recv(out_array.data.ptr, count, nccl_type, peer,
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
        comm = self._comm
        self._group_start()
        try:
            comm.send(in_array.data.ptr, in_count, in_type, peer, s)
            comm.recv(out_array.data.ptr, out_count, out_type, peer, s)
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
        root = _validate.scatter(in_array, out_array, root, self.rank, self.world_size)
        s = self._stream(stream)
        out_type, out_count = self._typed(out_array, "scatter", "out_array")
        nccl = self._nccl
        nccl.groupStart()
        try:
            if self.rank == root:
                for dst in range(self.world_size):
                    part = in_array[dst]
                    self._comm.send(part.data.ptr, out_count, out_type, dst, s)
            self._comm.recv(out_array.data.ptr, out_count, out_type, root, s)
        finally:
            nccl.groupEnd()

    @_validate.reports_invalid
    def gather(self, in_array: Any, out_array: Any, root: int = 0, stream: Any = None) -> None:
        root = _validate.gather(in_array, out_array, root, self.rank, self.world_size)
        s = self._stream(stream)
        in_type, in_count = self._typed(in_array, "gather", "in_array")
        nccl = self._nccl
        nccl.groupStart()
        try:
            if self.rank == root:
                for src in range(self.world_size):
                    self._comm.recv(out_array[src].data.ptr, in_count, in_type, src, s)
            self._comm.send(in_array.data.ptr, in_count, in_type, root, s)
        finally:
            nccl.groupEnd()

    @_validate.reports_invalid
    def all_to_all(self, in_array: Any, out_array: Any, stream: Any = None) -> None:
        _validate.all_to_all(in_array, out_array, self.world_size)
        s = self._stream(stream)
        nccl_type, mult = self._dtypes[in_array.dtype]
        count = in_array.size // self.world_size * mult
        nccl = self._nccl
        nccl.groupStart()
        try:
            for peer in range(self.world_size):
                self._comm.send(in_array[peer].data.ptr, count, nccl_type, peer, s)
                self._comm.recv(out_array[peer].data.ptr, count, nccl_type, peer, s)
        finally:
            nccl.groupEnd()

    # ------------------------------------------------------------------ support
    def split(self, color: int, key: int, new_rank: int, new_size: int) -> NcclBackend | None:
        """ncclCommSplit where CuPy offers it (every rank calls; color < 0 joins no group);
        None when this CuPy has no commSplit (the caller then builds a fresh communicator)."""
        split = getattr(self._comm, "commSplit", None)
        if split is None:
            return None
        try:
            comm = split(color, key)
        except Exception as exc:  # noqa: BLE001 - NcclError
            raise GridcommError(f"rank {self.rank}: ncclCommSplit(color={color}, key={key}) failed: {exc}") from exc
        if color < 0:
            return None
        child = object.__new__(NcclBackend)
        child.__dict__.update(self.__dict__)
        child.rank, child.world_size, child._comm = new_rank, new_size, comm
        return child

    def exchange_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` in rank order, through an NCCL all_gather (used by split)."""
        cupy = self._cupy
        mine = cupy.asarray(values, dtype=cupy.int64)
        out = cupy.empty(len(values) * self.world_size, dtype=cupy.int64)
        self.all_gather(mine, out, len(values))
        return out.get().reshape(self.world_size, len(values)).tolist()

    def synchronize(self) -> None:
        self._current_stream().synchronize()

    def abort(self, error: Exception | None = None) -> None:
        """ncclCommAbort: releases a collective spinning on the GPU (callable from another thread)."""
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.abort()

    def destroy(self) -> None:
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.destroy()
