"""The NCCL backend: one NCCL communicator per rank, with cupyx's argument conventions.

Two engines drive NCCL, chosen when a communicator is built (``GRIDCOMM_NCCL_ENGINE``):

- ``nccl4py`` (NVIDIA's binding, ``pip install nccl4py``; the ``cuda12``/``cuda13`` extras pull it
  in): the communicator is created non-blocking (``NCCLConfig(blocking=False)``) and polled to
  completion against the caller's deadline; on the deadline it is aborted (``ncclCommAbort``) and
  :class:`RendezvousTimeout` is raised, and as soon as ``failed()`` reports a peer's failure it is
  aborted and that error is raised. A peer that dies inside NCCL init therefore ends in an error,
  never a hang. Worlds larger than ``GRIDCOMM_RANKS_PER_ROOT`` ranks (128 by default) bootstrap
  through several unique IDs (``ncclCommInitRankScalable``), one per NCCL root partition.
  Collectives run on a blocking child made by a non-blocking ``ncclCommSplit`` of that
  communicator (so every call is enqueued when it returns, as with CuPy, and no call can come back
  ``ncclInProgress``); the non-blocking parent is destroyed once the child is up.
- ``cupy`` (``cupy.cuda.nccl``): ``ncclCommInitRank`` blocks until every rank arrives; CuPy has no
  non-blocking init, so a peer that dies inside it leaves the others blocked there until NCCL's
  own bootstrap timeout, if any (the deadline and ``failed()`` are checked only before init).
- ``auto`` (the default): nccl4py where it imports and loads libnccl, else cupy.

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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gridcomm import _config
from gridcomm._backends import validate as _validate
from gridcomm._errors import ArgumentError, ConfigError, GridcommError, RendezvousTimeout

log = logging.getLogger(__name__)

#: Values of GRIDCOMM_NCCL_ENGINE.
ENGINES = ("auto", "nccl4py", "cupy")
#: Ranks per NCCL bootstrap root (GRIDCOMM_RANKS_PER_ROOT), as torch's TORCH_NCCL_RANKS_PER_ROOT.
DEFAULT_RANKS_PER_ROOT = 128
#: NCCL init is polled every _POLL_FIRST_S at first, backing off to _POLL_MAX_S.
_POLL_FIRST_S, _POLL_MAX_S = 0.0005, 0.01
#: ncclInProgress.
_IN_PROGRESS = 7
#: The oldest libnccl the nccl4py engine uses (NCCL_VERSION_CODE of 2.23.0).
_NCCL4PY_MIN_NCCL = 22300

_cupy: Any = None
_nccl: Any = None
_nccl4py: Any = None  # (nccl.core, nccl.bindings.nccl) once loaded; False when it cannot be used
_nccl4py_why = ""


def _load_cupy() -> Any:
    """Imports CuPy on first use (never at ``import gridcomm``)."""
    global _cupy
    if _cupy is None:
        try:
            import cupy
        except Exception as exc:  # noqa: BLE001 - ImportError, or CUDA library load errors
            raise ConfigError(f"the nccl backend needs CuPy with NCCL (pip install 'gridcomm[cuda12]' or "
                              f"'gridcomm[cuda13]'); importing it failed: {exc}. On a machine without GPUs use "
                              f"backend='host' (NumPy arrays), or backend='auto', which picks host there "
                              f"(GRIDCOMM_BACKEND=host or auto).") from exc
        _cupy = cupy
    return _cupy


def _load() -> tuple[Any, Any]:
    """CuPy and its NCCL binding (the cupy engine), imported on first use."""
    global _nccl
    cupy = _load_cupy()
    if _nccl is None:
        try:
            from cupy.cuda import nccl
        except Exception as exc:  # noqa: BLE001 - ImportError, or CUDA library load errors
            raise ConfigError(f"CuPy's NCCL binding does not import ({exc}); install nvidia-nccl-cu12 (or -cu13) "
                              "matching your cupy-cuda package, or use backend='host'.") from exc
        if not getattr(nccl, "available", False):
            raise ConfigError("CuPy is installed but NCCL is not available to it; install nvidia-nccl-cu12 "
                              "(or -cu13) matching your cupy-cuda package, or use backend='host' (NumPy arrays) or "
                              "backend='auto' (NCCL where it works, else host); GRIDCOMM_BACKEND sets either.")
        _nccl = nccl
    return cupy, _nccl


def _load_nccl4py() -> tuple[Any, Any] | None:
    """``(nccl.core, nccl.bindings.nccl)`` when nccl4py imports and its libnccl loads, else None
    (the reason is kept for the error message of GRIDCOMM_NCCL_ENGINE=nccl4py)."""
    global _nccl4py, _nccl4py_why
    if _nccl4py is None:
        try:
            import nccl.core as core
            from nccl.bindings import nccl as bindings

            version = int(bindings.get_version())  # loads libnccl: an import alone does not
            if version < _NCCL4PY_MIN_NCCL:
                raise ConfigError(f"libnccl {version} is older than 2.23 (ncclCommInitRankScalable, which nccl4py "
                                  "creates every communicator with)")
            _nccl4py = (core, bindings)
        except Exception as exc:  # noqa: BLE001 - ImportError, library load errors: "not usable here"
            _nccl4py, _nccl4py_why = False, f"{type(exc).__name__}: {exc}"
    return _nccl4py or None


def engine_setting(environ: Mapping[str, str] | None = None) -> str:
    """GRIDCOMM_NCCL_ENGINE as given: ``auto`` (unset or empty), ``nccl4py`` or ``cupy``."""
    env = _config.process_environ() if environ is None else environ
    value = (env.get("GRIDCOMM_NCCL_ENGINE") or "auto").strip().lower()
    if value not in ENGINES:
        raise ConfigError(f"GRIDCOMM_NCCL_ENGINE={env.get('GRIDCOMM_NCCL_ENGINE')!r} is not one of "
                          f"{', '.join(ENGINES)}; unset it (auto: nccl4py where installed, else CuPy's binding).")
    return value


def ranks_per_root(environ: Mapping[str, str] | None = None) -> int:
    """GRIDCOMM_RANKS_PER_ROOT: ranks per NCCL bootstrap root (default 128, at least 1)."""
    env = _config.process_environ() if environ is None else environ
    raw = (env.get("GRIDCOMM_RANKS_PER_ROOT") or "").strip()
    if not raw:
        return DEFAULT_RANKS_PER_ROOT
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"GRIDCOMM_RANKS_PER_ROOT={raw!r} must be a whole number of ranks >= 1 (default "
                          f"{DEFAULT_RANKS_PER_ROOT}); unset it to use the default.")
    return value


def engine(environ: Mapping[str, str] | None = None) -> str:
    """The engine a communicator built now uses: ``nccl4py`` or ``cupy`` (GRIDCOMM_NCCL_ENGINE;
    ``auto`` picks nccl4py where it imports and loads libnccl)."""
    setting = engine_setting(environ)
    if setting == "cupy":
        return "cupy"
    if _load_nccl4py() is not None:
        return "nccl4py"
    if setting == "nccl4py":
        raise ConfigError(f"GRIDCOMM_NCCL_ENGINE=nccl4py, but nccl4py cannot be used here ({_nccl4py_why}); "
                          "pip install 'gridcomm[cuda12]' (or cuda13), or set GRIDCOMM_NCCL_ENGINE=auto or cupy.")
    return "cupy"


def available() -> bool:
    """True when CuPy imports, sees at least one GPU, and an NCCL engine works (what backend='auto' asks)."""
    try:
        cupy = _load_cupy()
        if engine() == "cupy":
            _load()
        return bool(cupy.cuda.runtime.getDeviceCount() > 0)
    except Exception:  # noqa: BLE001 - any failure means "not available"
        return False


def require_gpu() -> None:
    """Raises ConfigError, before any rendezvous, when backend='nccl' cannot work here: no CuPy,
    no NCCL engine (see engine), or no GPU that CuPy sees."""
    cupy = _load_cupy()
    if engine() == "cupy":
        _load()
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


# ---------------------------------------------------------------------- unique IDs
def root_ranks(size: int, per_root: int) -> list[int]:
    """The ranks that create a unique ID, root i first: ``ceil(size / per_root)`` roots, root i at
    the first rank of the i-th partition NCCL itself assigns to root i (ncclCommInitRankScalable
    gives the first ``size % n`` roots one rank more), so each bootstrap root lives in a process
    it serves. One root (rank 0) when ``size <= per_root``."""
    if size < 1 or per_root < 1:
        raise ConfigError(f"root_ranks: size={size} and per_root={per_root} must be >= 1.")
    n = -(-size // per_root)
    return [i * (size // n) + min(i, size % n) for i in range(n)]


def id_key(name: str, index: int) -> str:
    """The coordinator key of communicator ``name``'s unique ID ``index``; ID 0 keeps the key a
    single-ID communicator has always used."""
    return f"{name}/nccl-unique-id" if index == 0 else f"{name}/nccl-unique-id/{index}"


def exchange_ids(client: Any, name: str, rank: int, roots: Sequence[int],
                 make_id: Callable[[], bytes], timeout_s: float) -> list[bytes]:
    """Every unique ID of communicator ``name``, root order. A root rank makes its own ID (the
    bootstrap root lives in the creating process) and ``set``s it; every rank ``get``s the others."""
    deadline = time.monotonic() + timeout_s
    mine = roots.index(rank) if rank in roots else -1
    ids: list[bytes] = []
    own = b""
    if mine >= 0:
        own = make_id()
        client.set(id_key(name, mine), own)
    for index in range(len(roots)):
        if index == mine:
            ids.append(own)
        else:
            ids.append(client.get(id_key(name, index), timeout_s=max(deadline - time.monotonic(), 0.001)))
    return ids


def connect(client: Any, name: str, rank: int, size: int, *,
            failed: Callable[[], BaseException | None] = lambda: None,
            timeout_s: float | None = None) -> NcclBackend:
    """This rank's NCCL communicator ``name`` of ``size`` ranks. The unique IDs travel through
    ``client`` (a CoordinatorClient: ``set``/``get``): one, made by rank 0, for worlds of up to
    GRIDCOMM_RANKS_PER_ROOT ranks; else one per root (see :func:`root_ranks`; nccl4py only). The
    whole exchange and NCCL init are bounded by ``timeout_s`` (default ``client.timeout_s``);
    ``failed()`` returns a peer's failure seen by this rank's watcher, or None: with nccl4py, init
    is aborted as soon as it is set and that error is raised."""
    timeout = float(client.timeout_s if timeout_s is None else timeout_s)
    deadline = time.monotonic() + timeout
    chosen = engine()
    roots = root_ranks(size, ranks_per_root()) if chosen == "nccl4py" else [0]
    ids = exchange_ids(client, name, rank, roots, lambda: new_unique_id(chosen), timeout)
    return NcclBackend(size, rank, ids, engine_name=chosen, deadline=deadline, failed=failed, label=name)


def new_unique_id(engine_name: str | None = None) -> bytes:
    """A fresh NCCL unique ID as 128 bytes (the bootstrap root lives in this process)."""
    if (engine_name or engine()) == "nccl4py":
        return id_to_bytes(bytes(_engine_for("nccl4py").core.get_unique_id()))
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


# ---------------------------------------------------------------------- engines
# Every engine offers NCCL's per-call functions in one shape, nccl4py's low-level one: CuPy's
# arguments with the communicator inserted before the stream, e.g.
# all_reduce(send_ptr, recv_ptr, count, nccl_type, op, comm, stream_ptr). nccl4py's are its own
# C-level functions (no Python frame between a fast path and NCCL); CuPy's methods take the
# communicator first, so its engine wraps each in a one-line function.
def _cupy_all_reduce(s: int, r: int, n: int, t: int, o: int, c: Any, st: int) -> None:
    c.allReduce(s, r, n, t, o, st)


def _cupy_reduce(s: int, r: int, n: int, t: int, o: int, root: int, c: Any, st: int) -> None:
    c.reduce(s, r, n, t, o, root, st)


def _cupy_broadcast(s: int, r: int, n: int, t: int, root: int, c: Any, st: int) -> None:
    c.broadcast(s, r, n, t, root, st)


def _cupy_reduce_scatter(s: int, r: int, n: int, t: int, o: int, c: Any, st: int) -> None:
    c.reduceScatter(s, r, n, t, o, st)


def _cupy_all_gather(s: int, r: int, n: int, t: int, c: Any, st: int) -> None:
    c.allGather(s, r, n, t, st)


def _cupy_send(s: int, n: int, t: int, peer: int, c: Any, st: int) -> None:
    c.send(s, n, t, peer, st)


def _cupy_recv(r: int, n: int, t: int, peer: int, c: Any, st: int) -> None:
    c.recv(r, n, t, peer, st)


_TYPE_NAMES = ("int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64")
_OP_NAMES = ("sum", "prod", "min", "max", "avg")


class _CupyEngine:
    """``cupy.cuda.nccl``: blocking init (CuPy has no other), ncclCommSplit where CuPy has commSplit."""

    name = "cupy"
    null: Any = None
    all_reduce, reduce, broadcast = staticmethod(_cupy_all_reduce), staticmethod(_cupy_reduce), staticmethod(
        _cupy_broadcast)
    reduce_scatter, all_gather = staticmethod(_cupy_reduce_scatter), staticmethod(_cupy_all_gather)
    send, recv = staticmethod(_cupy_send), staticmethod(_cupy_recv)

    def __init__(self) -> None:
        _, nccl = _load()
        self.types = {name: getattr(nccl, f"NCCL_{name.upper()}") for name in _TYPE_NAMES}
        if hasattr(nccl, "NCCL_BFLOAT16"):
            self.types["bfloat16"] = nccl.NCCL_BFLOAT16
        # ncclAvg exists from NCCL 2.10; CuPy may not export its constant (its value is 4).
        self.ops = {op: getattr(nccl, f"NCCL_{op.upper()}", 4) for op in _OP_NAMES}
        self.group_start, self.group_end = nccl.groupStart, nccl.groupEnd
        self._nccl = nccl

    def create(self, size: int, rank: int, ids: Sequence[bytes], deadline: float,
               failed: Callable[[], BaseException | None], label: str) -> Any:
        """ncclCommInitRank, which blocks until every rank arrives: only what is known before it
        (a peer's failure, a passed deadline) can stop it."""
        error = failed()
        if error is not None:
            raise error
        if len(ids) != 1:
            raise ConfigError(f"CuPy's NCCL binding takes one unique ID, not {len(ids)} (several need nccl4py).")
        if time.monotonic() >= deadline:
            raise RendezvousTimeout(f"rank {rank} of {size}: the deadline passed before NCCL init of communicator "
                                    f"{label!r} began.")
        as_bytes, as_tuple = id_forms(ids[0])
        try:
            try:
                return self._nccl.NcclCommunicator(size, as_bytes, rank)
            except TypeError:
                # Why: the argument type is checked before NCCL runs, so retrying is safe.
                return self._nccl.NcclCommunicator(size, as_tuple, rank)
        except Exception as exc:  # noqa: BLE001 - NcclError, CUDA errors
            raise GridcommError(f"rank {rank} of {size}: building the NCCL communicator failed: {exc}") from exc

    @staticmethod
    def handle(owner: Any) -> Any:
        return owner


class _Nccl4pyEngine:
    """nccl4py: non-blocking, abortable init polled against the deadline; several unique IDs
    (ncclCommInitRankScalable); collectives on a blocking child (see the module docstring)."""

    name = "nccl4py"

    def __init__(self) -> None:
        loaded = _load_nccl4py()
        if loaded is None:
            raise ConfigError(f"nccl4py cannot be used here ({_nccl4py_why}).")
        core, b = loaded
        self.core, self.bindings = core, b
        names = {"int8": "Int8", "uint8": "Uint8", "int32": "Int32", "uint32": "Uint32", "int64": "Int64",
                 "uint64": "Uint64", "float16": "Float16", "float32": "Float32", "float64": "Float64",
                 "bfloat16": "Bfloat16"}
        self.types = {name: int(getattr(b.DataType, member)) for name, member in names.items()}
        self.ops = {op: int(getattr(b.RedOp, op.capitalize())) for op in _OP_NAMES}
        self.group_start, self.group_end = b.group_start, b.group_end
        self.all_reduce, self.reduce, self.broadcast = b.all_reduce, b.reduce, b.broadcast
        self.reduce_scatter, self.all_gather, self.send, self.recv = b.reduce_scatter, b.all_gather, b.send, b.recv
        self.null = b.Comm()  # a call on it is ncclInvalidArgument: never freed memory

    def create(self, size: int, rank: int, ids: Sequence[bytes], deadline: float,
               failed: Callable[[], BaseException | None], label: str) -> Any:
        core = self.core
        uids = [core.UniqueId.from_bytes(uid) for uid in ids]
        what = f"rank {rank} of {size}: NCCL init of communicator {label!r}"
        total = max(deadline - time.monotonic(), 0.0)
        others = [r for r in range(size) if r != rank]
        parent = core.Communicator()
        child = None
        try:
            parent.initialize(size, rank, uids if len(uids) > 1 else uids[0], core.NCCLConfig(blocking=False))
            self._wait(parent, deadline, failed, what, others, total)
            # A non-blocking parent makes the split non-blocking too; the child it makes is blocking.
            child = parent.split(0, rank, core.NCCLConfig(blocking=True))
            self._wait(parent, deadline, failed, what + " (ncclCommSplit to its blocking child)", others, total)
            # NCCL writes the child's handle when the split completes.
            self._wait(child, deadline, failed, what + " (its blocking child)", others, total)
        except BaseException as exc:
            self._abort_all(parent, child)
            if isinstance(exc, self.bindings.NCCLError) or isinstance(exc, core.NcclInvalid):
                raise GridcommError(f"{what} failed: {exc}") from exc
            raise
        # The parent is never used again. Measured at world size 1 (H200, NCCL 2.28.9): its
        # ncclCommDestroy takes ~0.5 s, ncclCommAbort ~1.0 s, and the child's own destroy at
        # stop() then ~0.03 s (CuPy's one communicator: ~0.5 s at stop()). It has run no
        # operation, so its finalize has nothing to wait for.
        parent.destroy()
        return child

    def _abort_all(self, parent: Any, child: Any) -> None:
        # The parent first: aborting it also ends a split in progress (NCCL's childAbortFlag),
        # after which a child handle NCCL wrote is valid and is aborted too.
        for comm in (parent, child):
            if comm is not None:
                try:
                    comm.abort()
                except Exception as exc:  # noqa: BLE001 - best effort on a broken communicator
                    log.warning("ncclCommAbort after a failed init: %s", exc)

    def _wait(self, comm: Any, deadline: float, failed: Callable[[], BaseException | None], what: str,
              others: list[int], total: float) -> None:
        """Polls ``comm`` until NCCL says success; raises on an NCCL error, as soon as ``failed()``
        returns an error (that error), and at the deadline (the caller aborts)."""
        delay = _POLL_FIRST_S
        left = deadline - time.monotonic()
        while left > 0:
            if self._done(comm, what):
                return
            error = failed()
            if error is not None:
                raise error
            time.sleep(min(delay, left))
            delay = min(delay * 2, _POLL_MAX_S)
            left = deadline - time.monotonic()
        if self._done(comm, what):  # completed during the last sleep
            return
        listed = f" (the other ranks: {others})" if len(others) <= 16 else ""
        raise RendezvousTimeout(
            f"{what} did not complete within {total:.1f} s and was aborted (ncclCommAbort): NCCL does not say "
            f"which ranks it still waited for{listed}; every rank must call init with the same unique ID(s) - is "
            "each rank's process running, on its own GPU?")

    def _done(self, comm: Any, what: str) -> bool:
        """True once ``comm`` is up; False while NCCL works on it (or has not written its handle yet)."""
        if not comm.is_valid:
            return False
        state = int(comm.get_async_error())
        if state in (0, _IN_PROGRESS):
            return state == 0
        try:
            detail = comm.get_last_error()
        except Exception:  # noqa: BLE001 - the detail is a courtesy
            detail = ""
        raise GridcommError(f"{what} failed: {self.core.get_error_string(state)} (ncclResult {state})"
                            + (f": {detail}" if detail else ""))

    @staticmethod
    def handle(owner: Any) -> Any:
        return owner._comm  # nccl.bindings.nccl.Comm: what the low-level calls take


_engines: dict[str, Any] = {}


def _engine_for(name: str) -> Any:
    if name not in _engines:
        _engines[name] = _Nccl4pyEngine() if name == "nccl4py" else _CupyEngine()
    return _engines[name]


class NcclBackend:
    """One rank's NCCL communicator. Built by :func:`connect` (the communicator calls it after the
    rendezvous); ``unique_id`` is one ID (bytes) or the list of a multi-root init."""

    kind = "nccl"
    #: Called with an ArgumentError before it propagates (set by the communicator).
    on_invalid: Callable[[Exception], None] | None = None

    def __init__(self, world_size: int, rank: int, unique_id: bytes | Sequence[bytes], *,
                 engine_name: str | None = None, deadline: float | None = None,
                 failed: Callable[[], BaseException | None] = lambda: None, label: str = "world") -> None:
        cupy = _load_cupy()
        eng = _engine_for(engine_name or engine())
        ids = [bytes(unique_id)] if isinstance(unique_id, (bytes, bytearray)) else [bytes(u) for u in unique_id]
        self.rank = rank
        self.world_size = world_size
        self.engine = eng.name
        self._engine = eng
        self._cupy = cupy
        self._current_stream = cupy.cuda.get_current_stream
        # Precomputed tables: dtype -> (NCCL type, elements per array element), op -> NCCL op.
        self._dtypes: dict[Any, tuple[int, int]] = {}
        for name in _TYPE_NAMES:
            self._dtypes[cupy.dtype(name)] = (eng.types[name], 1)
        self._dtypes[cupy.dtype("complex64")] = (eng.types["float32"], 2)
        self._dtypes[cupy.dtype("complex128")] = (eng.types["float64"], 2)
        if "bfloat16" in eng.types:
            try:  # CuPy 14 knows "bfloat16" through ml_dtypes
                self._dtypes[cupy.dtype("bfloat16")] = (eng.types["bfloat16"], 1)
            except TypeError:
                pass
        self._ops = dict(eng.ops)
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
        self._group_start, self._group_end = eng.group_start, eng.group_end
        # NCCL's per-call functions, in the engine's one shape (see the engines above).
        self._nccl_all_reduce, self._nccl_reduce, self._nccl_broadcast = eng.all_reduce, eng.reduce, eng.broadcast
        self._nccl_reduce_scatter, self._nccl_all_gather = eng.reduce_scatter, eng.all_gather
        self._nccl_send, self._nccl_recv = eng.send, eng.recv
        if deadline is None:
            deadline = time.monotonic() + _config.timeout_s()
        #: What owns the communicator (abort/destroy), and the handle the per-call functions take.
        self._owner: Any = eng.create(world_size, rank, ids, deadline, failed, label)
        self._c: Any = eng.handle(self._owner)

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
        self._nccl_all_reduce(in_array.data.ptr, out_array.data.ptr, count, nccl_type, code, self._c,
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
        self._nccl_reduce(in_array.data.ptr, out_ptr, count, nccl_type, self._ops[op], root, self._c,
                          self._stream(stream))

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
        self._nccl_broadcast(ptr, ptr, count, nccl_type, root, self._c,
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
        self._nccl_reduce_scatter(in_array.data.ptr, out_array.data.ptr, count * mult, nccl_type, self._ops[op],
                                  self._c, self._stream(stream))

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
        self._nccl_all_gather(in_array.data.ptr, out_array.data.ptr, count * mult, nccl_type, self._c,
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
        c = self._c
        self._group_start()
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
        root = _validate.scatter(in_array, out_array, root, self.rank, self.world_size)
        s = self._stream(stream)
        out_type, out_count = self._typed(out_array, "scatter", "out_array")
        send, recv, c = self._nccl_send, self._nccl_recv, self._c
        self._group_start()
        try:
            if self.rank == root:
                for dst in range(self.world_size):
                    send(in_array[dst].data.ptr, out_count, out_type, dst, c, s)
            recv(out_array.data.ptr, out_count, out_type, root, c, s)
        finally:
            self._group_end()

    @_validate.reports_invalid
    def gather(self, in_array: Any, out_array: Any, root: int = 0, stream: Any = None) -> None:
        root = _validate.gather(in_array, out_array, root, self.rank, self.world_size)
        s = self._stream(stream)
        in_type, in_count = self._typed(in_array, "gather", "in_array")
        send, recv, c = self._nccl_send, self._nccl_recv, self._c
        self._group_start()
        try:
            if self.rank == root:
                for src in range(self.world_size):
                    recv(out_array[src].data.ptr, in_count, in_type, src, c, s)
            send(in_array.data.ptr, in_count, in_type, root, c, s)
        finally:
            self._group_end()

    @_validate.reports_invalid
    def all_to_all(self, in_array: Any, out_array: Any, stream: Any = None) -> None:
        _validate.all_to_all(in_array, out_array, self.world_size)
        s = self._stream(stream)
        nccl_type, mult = self._dtypes[in_array.dtype]
        count = in_array.size // self.world_size * mult
        send, recv, c = self._nccl_send, self._nccl_recv, self._c
        self._group_start()
        try:
            for peer in range(self.world_size):
                send(in_array[peer].data.ptr, count, nccl_type, peer, c, s)
                recv(out_array[peer].data.ptr, count, nccl_type, peer, c, s)
        finally:
            self._group_end()

    # ------------------------------------------------------------------ support
    def split(self, color: int, key: int, new_rank: int, new_size: int) -> NcclBackend | None:
        """ncclCommSplit with the cupy engine where CuPy has commSplit (every rank calls; color < 0
        joins no group). None otherwise, and always with nccl4py: the caller then builds the child
        through :func:`connect`, whose init is non-blocking and bounded (a split of this blocking
        communicator would block, unbounded, on a peer that died)."""
        split = getattr(self._owner, "commSplit", None) if self.engine == "cupy" else None
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
        child.rank, child.world_size, child._owner, child._c = new_rank, new_size, comm, comm
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
        """ncclCommAbort: releases a collective spinning on the GPU (callable from another thread).
        The per-call handle is swapped for the engine's null one first, so a later call fails in
        NCCL's own argument check instead of touching freed memory."""
        owner, self._owner = self._owner, None
        self._c = self._engine.null
        if owner is not None:
            owner.abort()  # CuPy's NcclCommunicator and nccl.core's Communicator alike

    def destroy(self) -> None:
        """ncclCommDestroy (every rank of the communicator calls it, as ``stop()`` does)."""
        owner, self._owner = self._owner, None
        self._c = self._engine.null
        if owner is not None:
            owner.destroy()
