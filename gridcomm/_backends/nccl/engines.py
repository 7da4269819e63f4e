"""The two engines that create and drive NCCL communicators (CuPy's binding, nccl4py), the unique
id in the forms each takes, and the hot-path call tables. Which one drives a communicator is
chosen when it is built (``GRIDCOMM_NCCL_ENGINE``):

- ``nccl4py`` (NVIDIA's binding, ``pip install nccl4py``; the ``cuda12``/``cuda13`` extras pull it
  in): the communicator is created non-blocking (``NCCLConfig(blocking=False)``) and polled to
  completion against the caller's deadline; on the deadline it is aborted (``ncclCommAbort``) and
  :class:`RendezvousTimeout` is raised, and as soon as ``failed()`` reports a peer's failure it is
  aborted and that error is raised. A peer that dies inside NCCL init therefore ends in an error,
  never a hang. Worlds larger than ``GRIDCOMM_RANKS_PER_ROOT`` ranks (128 by default) bootstrap
  through several unique IDs (``ncclCommInitRankScalable``), one per NCCL root partition.
  Collectives run on a blocking child made by a non-blocking ``ncclCommSplit`` of that
  communicator (so every call is enqueued when it returns, as with CuPy, and no call can come back
  ``ncclInProgress``). The split is finished in the background, bounded like the init: the backend
  is returned once the parent is up (every rank has reached NCCL), and the first collective waits
  for the child; the non-blocking parent is destroyed once the child is up.
- ``cupy`` (``cupy.cuda.nccl``): ``ncclCommInitRank`` blocks until every rank arrives; CuPy has no
  non-blocking init, so a peer that dies inside it leaves the others blocked there until NCCL's
  own bootstrap timeout, if any (the deadline and ``failed()`` are checked only before init).
- ``auto`` (the default): nccl4py where it imports and loads libnccl, else cupy.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from gridcomm._backends.nccl.loader import _load, _load_nccl4py, engine, nccl4py_why
from gridcomm._errors import ConfigError, GridcommError, RendezvousTimeout

log = logging.getLogger(__name__)


#: NCCL init is polled every _POLL_FIRST_S at first, backing off to _POLL_MAX_S. Why so often: the
#: init and its split take tens of ms each at small world sizes, so a coarse poll's late wakeup
#: would add a large share of init_process_group (benchmarks/nccl_init_probe.py compares caps);
#: a poll is one ncclCommGetAsyncError, ~1,000 a second at most.
_POLL_FIRST_S, _POLL_MAX_S = 0.0002, 0.001


#: ncclInProgress.
_IN_PROGRESS = 7


def new_unique_id(engine_name: str | None = None) -> bytes:
    """A fresh NCCL unique ID as 128 bytes (the bootstrap root lives in this process)."""
    if (engine_name or engine()) == "nccl4py":
        return id_to_bytes(bytes(_engine_for("nccl4py").core.get_unique_id()))
    _, nccl = _load()
    return id_to_bytes(nccl.get_unique_id())


def nccl_version(engine_name: str | None = None) -> int:
    """The NCCL_VERSION_CODE (23206: 2.32.6) of the libnccl the engine loads (default: the one a
    communicator built now uses); raises ConfigError where none loads."""
    return int(_engine_for(engine_name or engine()).version())


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

    def version(self) -> int:
        """The loaded libnccl's NCCL_VERSION_CODE (23206: 2.32.6)."""
        return int(self._nccl.get_version())


class _Nccl4pyEngine:
    """nccl4py: non-blocking, abortable init polled against the deadline; several unique IDs
    (ncclCommInitRankScalable); collectives on a blocking child (see the module docstring)."""

    name = "nccl4py"

    def __init__(self) -> None:
        loaded = _load_nccl4py()
        if loaded is None:
            raise ConfigError(f"nccl4py cannot be used here ({nccl4py_why()}).")
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
            # A non-blocking parent makes the split non-blocking too (NCCL works on it in a thread
            # of its own); the child it makes is blocking.
            child = parent.split(0, rank, core.NCCLConfig(blocking=True))
        except BaseException as exc:
            self._abort_all(parent, child)
            if isinstance(exc, self.bindings.NCCLError) or isinstance(exc, core.NcclInvalid):
                raise GridcommError(f"{what} failed: {exc}") from exc
            raise
        # Every rank is in NCCL now (the parent's bootstrap needed them all), and the split runs
        # in NCCL's background. What init_process_group returns does not wait for it: the first
        # collective does (see _Split), so work the program does between init and its first
        # collective (building a model, loading data) hides the split's ~20-40 ms.
        return _Split(self, parent, child, deadline, failed, what, others, total)

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
              others: list[int], total: float, lock: Any = None) -> None:
        """Polls ``comm`` until NCCL says success; raises on an NCCL error, as soon as ``failed()``
        returns an error (that error), and at the deadline (the caller aborts). With ``lock``,
        each poll holds it (another thread may abort the communicator meanwhile)."""
        delay = _POLL_FIRST_S
        left = deadline - time.monotonic()
        while left > 0:
            if self._done(comm, what, lock):
                return
            error = failed()
            if error is not None:
                raise error
            time.sleep(min(delay, left))
            delay = min(delay * 2, _POLL_MAX_S)
            left = deadline - time.monotonic()
        if self._done(comm, what, lock):  # completed during the last sleep
            return
        listed = f" (the other ranks: {others})" if len(others) <= 16 else ""
        raise RendezvousTimeout(
            f"{what} did not complete within {total:.1f} s and was aborted (ncclCommAbort): NCCL does not say "
            f"which ranks it still waited for{listed}; every rank must call init with the same unique ID(s) - is "
            "each rank's process running, on its own GPU?")

    def _done(self, comm: Any, what: str, lock: Any = None) -> bool:
        """True once ``comm`` is up; False while NCCL works on it (or has not written its handle yet)."""
        if lock is not None:
            with lock:
                return self._done(comm, what)
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

    def version(self) -> int:
        """The loaded libnccl's NCCL_VERSION_CODE (23206: 2.32.6)."""
        return int(self.bindings.get_version())


class _Split:
    """What a nccl4py init returns: a non-blocking parent, up, whose split to the blocking child
    the collectives run on is finished by a thread of its own (``gridcomm-nccl-split``): it polls
    the split against the init's deadline and ``failed()``, then destroys the parent.

    :meth:`ready` (the backend's first call) waits for that and returns the child's handle, or
    raises what ended the split (the split's parent and child are aborted then). Why a thread
    and not the caller: NCCL's split proceeds on its own, but the parent's ncclCommDestroy can
    take a large part of a second, which nobody should wait for; it has run no operation, so it has
    nothing to flush, and the child does not share its resources (NCCL's splitShare is 0).

    Every touch of the parent or child while the split is unfinished holds ``_lock``: an abort
    (the watcher's thread, on a peer's failure) frees them, and a poll must never read freed
    memory."""

    def __init__(self, engine: _Nccl4pyEngine, parent: Any, child: Any, deadline: float,
                 failed: Callable[[], BaseException | None], what: str, others: list[int], total: float) -> None:
        self._engine, self._parent, self._child = engine, parent, child
        self._deadline, self._what = deadline, what
        self._lock = threading.Lock()
        self._settled = threading.Event()  # the split completed, or failed (then _error says why)
        self._error: BaseException | None = None
        self._aborted = False
        self._child_state = ""  # "destroying", then maybe "aborted" (a hung destroy); or "aborted"
        self._comm: Any = None  # the child's handle once it is up

        def ended() -> BaseException | None:
            return self._error if self._aborted else failed()

        self._thread = threading.Thread(target=self._finish, args=(ended, others, total),
                                        name="gridcomm-nccl-split", daemon=True)
        self._thread.start()

    def _finish(self, ended: Callable[[], BaseException | None], others: list[int], total: float) -> None:
        eng, what = self._engine, self._what
        try:
            eng._wait(self._parent, self._deadline, ended, what + " (ncclCommSplit to its blocking child)", others,
                      total, self._lock)
            # NCCL writes the child's handle when the split completes.
            eng._wait(self._child, self._deadline, ended, what + " (its blocking child)", others, total, self._lock)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits in ready()
            with self._lock:
                self._give_up(exc)
            self._settled.set()
            return
        with self._lock:
            if self._aborted:  # abort() came between the last poll and here: it freed both
                self._settled.set()
                return
            self._comm = self._child._comm
            parent, self._parent = self._parent, None
        self._settled.set()
        try:
            parent.destroy()
        except Exception as exc:  # noqa: BLE001 - nothing depends on it; say so and go on
            log.warning("ncclCommDestroy of an init's parent communicator failed: %s", exc)

    def _give_up(self, error: BaseException) -> None:
        """With ``_lock`` held: the split ends in ``error`` (unless it already ended), aborting the
        parent (which ends a split in progress) and the child."""
        if not self._aborted:
            self._aborted = True
            self._error = error
            self._engine._abort_all(self._parent, self._child)

    @property
    def ready_now(self) -> bool:
        """True once the child is up (no wait left for the first call)."""
        return self._comm is not None

    def ready(self) -> Any:
        """The child's per-call handle, once the split is complete (waits for it, bounded by the
        init's deadline); raises what ended the split, or the abort that came first."""
        left = self._deadline - time.monotonic()
        # The thread ends at the deadline at the latest; the margin covers its abort.
        if not self._settled.wait(max(left, 0.0) + 30.0):
            raise GridcommError(f"{self._what}: the split to its blocking child did not settle within "
                                f"{max(left, 0.0) + 30.0:.1f} s of the first collective")
        if self._error is not None:  # set by every path that settles without the child
            raise self._error
        return self._comm

    def abort(self) -> None:
        with self._lock:
            if self._comm is None:  # unfinished: the parent's abort ends the split, then the child
                self._give_up(GridcommError(f"{self._what}: aborted before its split to the blocking child "
                                            "completed"))
                self._settled.set()
                return
            # Why under the lock: a destroy that has not begun the child's never begins it now. A
            # destroy already under way is the one that hangs (lifecycle aborts it past its bound).
            if self._child_state == "aborted":
                return
            self._child_state = "aborted"
        # Why no wait for the parent's release: abort may come while the parent's destroy hangs.
        self._child.abort()

    def destroy(self) -> None:
        """The parent's destroy (the split thread's), then the child's, in this order on every rank:
        NCCL's destroy is a collective over a node's ranks, and ranks that destroyed the two in
        different orders waited for each other for good. The caller bounds the whole (see
        lifecycle.bounded_destroy) and aborts past it."""
        try:
            self.ready()
        except BaseException as exc:  # noqa: BLE001 - nothing left to destroy: both were aborted
            log.debug("%s: destroy after a split that did not complete: %s", self._what, exc)
            return
        self._thread.join()
        with self._lock:
            if self._child_state == "aborted":  # aborted meanwhile: the child is freed
                return
            self._child_state = "destroying"
        self._child.destroy()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._child, name)


_engines: dict[str, Any] = {}


def _engine_for(name: str) -> Any:
    if name not in _engines:
        _engines[name] = _Nccl4pyEngine() if name == "nccl4py" else _CupyEngine()
    return _engines[name]

