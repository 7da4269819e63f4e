"""The communicator: one backend (NCCL or host) plus the control-plane client that built it.

This is where gRPC (through the client) and CuPy (through the NCCL backend) meet; neither
backend module imports the other side. Collective methods are bound at construction to the
backend's, counted on the way (one frame and one clock read: the progress the heartbeats carry,
see gridcomm._client.tracker); after ``stop()``, ``abort()`` or a reported failure they are
rebound to raise, so no per-call flag check is needed.
"""

from __future__ import annotations

import copy
import faulthandler
import logging
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from gridcomm._backends.base import Hooks
from gridcomm._client import flight
from gridcomm._client.client import SHORT_CALL_S, CoordinatorClient
from gridcomm._client.tracker import COUNTED, Tracker
from gridcomm._communicator.building import EmbeddedServer as EmbeddedServer
from gridcomm._communicator.building import Job, build_backend
from gridcomm._communicator.recovery import recover
from gridcomm._errors import (
    CommAborted,
    ConfigError,
    CoordinatorUnavailable,
    GridcommError,
    RankFailedError,
    RankStalled,
    coordinator_lost,
)
from gridcomm._wire import shown_generation

log = logging.getLogger(__name__)

#: How long a rank that saw a peer fail waits for its leave to be answered.
LEAVE_AFTER_FAILURE_S = 2.0

#: How long stop() and rebuild() wait for backend aborts still running on their own thread.
ABORT_WAIT_S = 10.0


COLLECTIVES = ("all_reduce", "reduce", "broadcast", "reduce_scatter", "all_gather", "send", "recv", "send_recv",
               "scatter", "gather", "all_to_all")


class Communicator:
    """A group of ranks that run collectives together (the ``cupyx.distributed.NCCLBackend`` API).

    Made by :func:`gridcomm.init_process_group` or :meth:`split`. A context manager: leaving the
    ``with`` block normally calls :meth:`stop`; an exception calls :meth:`abort`, so every other
    rank learns of it instead of hanging::

        with gridcomm.init_process_group(2, rank, backend="host") as comm:
            x = numpy.full(4, rank + 1.0)
            comm.all_reduce(x, x, op="sum")      # x == [3, 3, 3, 3] on both ranks
    """

    def __init__(self, make_backend: Callable[[Hooks], Any], client: CoordinatorClient, *, name: str = "world",
                 members: Sequence[int] | None = None, parent: Communicator | None = None,
                 job: Job | None = None, fingerprints: bool | None = None, record: int | None = None,
                 trace_dir: str | None = None) -> None:
        self._client = client
        self._parent = parent
        self.name = name
        self._children: list[Communicator] = []
        self._splits = 0
        self._closed: GridcommError | None = None
        self._finalized = False
        #: The rank hosting the coordinator (0 when embedded; None for `gridcomm serve`).
        self.coordinator_rank: int | None = client.coordinator_rank
        #: The rank's job (a root's; None for a split child): what it hosts (the embedded
        #: coordinator, the health port), and what makes the next generation's communicator.
        self._job = job
        #: 0 at the first init, +1 per recovery (see shown_generation for the wire's numbering).
        self.generation: int = shown_generation(client.generation)
        #: The communicator a rebuild() or shrink() of this one returned.
        self._successor: Communicator | None = None
        #: Aborts of backends whose abort may block (NCCL), running on a thread of their own.
        self._aborting: threading.Thread | None = None
        # Why the backend is made here, with its hooks: it has them from its first call on, and
        # nothing assigns them afterwards.
        backend = make_backend(Hooks(on_invalid=self._invalid_call, on_broken=self._broken_data_plane,
                                     coordinator_rank=self.coordinator_rank))
        self._backend = backend
        self.rank: int = backend.rank
        self.world_size: int = backend.world_size
        self.backend: str = backend.kind
        #: Global (job) rank of each member, indexed by this communicator's rank.
        self.members: tuple[int, ...] = tuple(range(self.world_size)) if members is None else tuple(members)
        self._participants: tuple[int, ...] = () if parent is None else tuple(sorted(self.members))
        #: This rank's progress here, carried on its heartbeats (see gridcomm._client.tracker).
        # Fingerprints (GRIDCOMM_DEBUG=collectives, resolved with the job): as asked, else as the parent's.
        if fingerprints is None:
            fingerprints = parent is not None and parent._tracker.fingerprints
        # The flight record's length (GRIDCOMM_FLIGHT_RECORD, resolved with the job): as asked, else
        # as the parent's.
        if record is None:
            kept = parent._tracker.record if parent is not None else None
            record = kept.maxlen or 0 if kept is not None else 0
        self._tracker: Tracker = Tracker(name, client.generation, fingerprints=fingerprints, record=record)
        counts_itself = getattr(backend, "counts_itself", False) and not self._tracker.fingerprints
        if counts_itself:
            backend.progress = self._tracker
        # NCCL: completion on the GPU, sampled (the backend counts its calls either way).
        self._tracker.sampler = getattr(backend, "gpu_progress", None)
        self._tracker.gpu_inside = getattr(backend, "gpu_inside_s", None)
        if counts_itself:  # its count is the tracker's (with fingerprints the backend counts apart)
            self._tracker.gpu_completed = getattr(backend, "gpu_completed", None)
        for method in COLLECTIVES:
            call = getattr(backend, method)
            counted = method in COUNTED and not counts_itself
            setattr(self, method, self._tracker.counted(method, call) if counted else call)
        client.track(self._tracker)
        self._set_ready(True)
        #: GRIDCOMM_TRACE_DIR (a root's): where this rank's flight record goes at a failure.
        self._trace_dir = trace_dir if parent is None else None
        if self._trace_dir:
            flight.on_sigterm(self._write_trace)
        if parent is None:
            # Hears of this generation's first failure (at once if it came before this was made).
            client.on_failure(self._on_failure)

    # ------------------------------------------------------------------ failure handling
    def _root(self) -> Communicator:
        root = self
        while root._parent is not None:
            root = root._parent
        return root

    def _on_failure(self, error: GridcommError) -> None:
        """Called from the liveness thread: another rank failed, or the coordinator is gone.
        Every later call raises ``error``; NCCL work in flight is aborted, not left spinning."""
        root = self._root()
        if root._closed is not None:
            return
        log.error("rank %d: %s; aborting the communicator", root.rank, error)
        root._write_trace(str(error))  # before closing: that lets go of the trackers
        root._close(error)
        root._abort_backends(error)
        # Readiness only: liveness stays SERVING while this process answers, so kubelet does not
        # kill a survivor while it reports the failure or recovers.
        root._set_ready(False)
        if isinstance(error, RankStalled) and error.rank == self._client.rank:
            root._stalled(error)

    def _write_trace(self, reason: str) -> None:
        """This rank's flight record of every communicator into GRIDCOMM_TRACE_DIR (if set)."""
        if not self._trace_dir:
            return
        client = self._client
        flight.write(self._trace_dir, client.rank, shown_generation(client.generation), reason,
                     [flight.tracker_record(t) for t in client.trackers()])

    def _stalled(self, error: RankStalled) -> None:
        """This rank is the one the others waited for: show where it hangs and have it restarted.
        Its main thread is stuck somewhere (it may never call gridcomm again), so this runs on the
        watcher's thread: every thread's stack goes to stderr, and liveness turns NOT_SERVING
        (the one case where a live process must fail its liveness probe: kubelet restarts the pod,
        and the survivors' rebuild() gets a replacement)."""
        sys.stderr.write(f"gridcomm: rank {self.rank} is stalled: {error.reason}\n"
                         "gridcomm: the stacks of this process's threads (the main thread shows where it waits):\n")
        sys.stderr.flush()
        try:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        except (OSError, ValueError, RuntimeError) as exc:  # no fd (stderr replaced): Python's own view
            log.warning("rank %d: faulthandler could not write the stacks (%s)", self.rank, exc)
            for ident, frame in sys._current_frames().items():
                sys.stderr.write(f"Thread {ident}:\n{''.join(traceback.format_stack(frame))}")
        sys.stderr.flush()
        if self._job is not None and self._job.health is not None:
            self._job.health.set_live(False)

    def _set_ready(self, ready: bool) -> None:
        """Readiness on the rank's health port, held up by each root communicator that is up."""
        if self._job is not None and self._job.health is not None:
            self._job.health.set_ready(self, ready)

    def _abort_backends(self, error: GridcommError) -> None:
        """Aborts every backend. Those whose abort may block (NCCL's waits for the GPU) are
        aborted on a thread of their own (``gridcomm-abort``): a failure is heard of on the
        process's background loop, which must go on heartbeating and answering while a GPU is
        hung. :meth:`_await_aborts` waits for them (bounded) before anything is freed."""
        later = []
        for backend in self._all_backends():
            if getattr(backend, "abort_may_block", False):
                later.append(backend)
            else:
                self._abort_one(backend, error)
        if later:
            def abort_later() -> None:
                for backend in later:
                    self._abort_one(backend, error)

            thread = threading.Thread(target=abort_later, name="gridcomm-abort", daemon=True)
            self._aborting = thread
            thread.start()

    def _abort_one(self, backend: Any, error: GridcommError) -> None:
        try:
            backend.abort(error)
        except Exception as exc:  # noqa: BLE001 - best effort
            log.warning("rank %d: backend abort failed: %s", self.rank, exc)

    def _await_aborts(self) -> None:
        thread = self._aborting
        if thread is not None:
            thread.join(ABORT_WAIT_S)
            if thread.is_alive():
                log.warning("rank %d: a backend's abort has not returned after %g s; going on without it",
                            self.rank, ABORT_WAIT_S)

    def _all_backends(self) -> list[Any]:
        backends = [self._backend]
        for child in self._children:
            backends.extend(child._all_backends())
        return backends

    def _invalid_call(self, error: Exception) -> None:
        """A collective was called with invalid arguments: peers may already wait inside it, so
        this rank is reported failed (they get RankFailedError naming it instead of hanging)."""
        self.abort(f"invalid call: {error}")

    def _broken_data_plane(self, error: BaseException) -> None:
        """The host backend's data plane broke on its own (bad bytes from a peer, a call past its
        deadline): its messages are half moved, so this rank is reported failed and its peers get
        RankFailedError naming it instead of waiting for bytes that will not come."""
        self.abort(f"its data plane broke: {error}")

    # ------------------------------------------------------------------ collectives (bound per instance)
    def all_reduce(self, in_array: Any, out_array: Any, op: str = "sum", stream: Any = None) -> None:
        """out_array = op over every rank's in_array (op: sum, prod, min, max, avg)."""
        raise AssertionError("bound at construction")

    def reduce(self, in_array: Any, out_array: Any, root: int = 0, op: str = "sum", stream: Any = None) -> None:
        """out_array on ``root`` = op over every rank's in_array."""
        raise AssertionError("bound at construction")

    def broadcast(self, in_out_array: Any, root: int = 0, stream: Any = None) -> None:
        """Copies ``root``'s array into every rank's array."""
        raise AssertionError("bound at construction")

    def reduce_scatter(self, in_array: Any, out_array: Any, count: int, op: str = "sum", stream: Any = None) -> None:
        """Reduces in_array (count x world_size elements) and gives rank r the r-th count elements."""
        raise AssertionError("bound at construction")

    def all_gather(self, in_array: Any, out_array: Any, count: int, stream: Any = None) -> None:
        """out_array (count x world_size elements) = every rank's in_array, in rank order."""
        raise AssertionError("bound at construction")

    def send(self, array: Any, peer: int, stream: Any = None) -> None:
        """Sends array to ``peer`` (pair with its recv)."""
        raise AssertionError("bound at construction")

    def recv(self, out_array: Any, peer: int, stream: Any = None) -> None:
        """Receives from ``peer`` into out_array."""
        raise AssertionError("bound at construction")

    def send_recv(self, in_array: Any, out_array: Any, peer: int, stream: Any = None) -> None:
        """Sends in_array to ``peer`` and receives its array into out_array, without deadlock."""
        raise AssertionError("bound at construction")

    def scatter(self, in_array: Any, out_array: Any, root: int = 0, stream: Any = None) -> None:
        """Rank r gets ``root``'s in_array[r] (in_array.shape[0] == world_size on the root)."""
        raise AssertionError("bound at construction")

    def gather(self, in_array: Any, out_array: Any, root: int = 0, stream: Any = None) -> None:
        """``root``'s out_array[r] = rank r's in_array (out_array.shape[0] == world_size on the root)."""
        raise AssertionError("bound at construction")

    def all_to_all(self, in_array: Any, out_array: Any, stream: Any = None) -> None:
        """Rank r's out_array[s] = rank s's in_array[r] (shape[0] == world_size on every rank)."""
        raise AssertionError("bound at construction")

    # ------------------------------------------------------------------ control plane
    def _check_open(self) -> None:
        if self._closed is not None:
            raise copy.copy(self._closed)  # keeps .rank and .reason

    def barrier(self, name: str | None = None, timeout_s: float | None = None) -> None:
        """A control-plane barrier over this communicator's ranks; on timeout raises
        :class:`RendezvousTimeout` naming the missing ranks (job ranks, as `gridcomm status` shows)."""
        self._check_open()
        label = "barrier" if name is None else name
        if not isinstance(label, str) or not label:
            raise ConfigError(f"barrier name must be a non-empty str, not {name!r}.")
        self._tracker.enter("barrier", f"barrier({label!r})")
        try:
            self._client.barrier(f"{self.name}/{label}", timeout_s, participants=self._participants)
        except GridcommError as exc:
            root = self._root()
            raise (root._closed if isinstance(root._closed, RankFailedError) else
                   coordinator_lost(exc, root.coordinator_rank)) from exc
        finally:
            self._tracker.leave()

    def split(self, color: int | None, key: int | None = None) -> Communicator | None:
        """A sub-communicator of the ranks that pass the same ``color``, ordered by ``key`` (then
        rank). Every rank must call it. A negative or None color joins no group and gets None."""
        self._check_open()
        for label, value in (("color", color), ("key", key)):
            if value is not None and (isinstance(value, bool) or not hasattr(value, "__index__")):
                raise ConfigError(f"split: {label}={value!r} must be an integer or None.")
        color_v = -1 if color is None or int(color) < 0 else int(color)
        key_v = self.rank if key is None else int(key)
        self._tracker.enter("split", "split()")
        try:
            table = self._backend.exchange_ints([color_v, key_v])
        finally:
            self._tracker.leave()
        self._splits += 1
        # Members ordered by (key, parent rank), as ncclCommSplit orders them.
        ranks = [r for _, r in sorted((k, r) for r, (c, k) in enumerate(table) if c == color_v)]
        new_rank = ranks.index(self.rank) if color_v >= 0 else -1
        name = f"{self.name}.s{self._splits}c{color_v}"
        members = [self.members[r] for r in ranks]
        parent_backend = self._backend
        client = self._client
        if self.backend == "nccl" and color_v < 0:
            parent_backend.split(color_v, key_v, new_rank, len(ranks), Hooks())  # ncclCommSplit: every rank calls it
        if color_v < 0:
            return None

        def make(hooks: Hooks) -> Any:
            # ncclCommSplit where the engine has it; else (host, nccl4py) a new backend of the members.
            child = parent_backend.split(color_v, key_v, new_rank, len(ranks), hooks) if self.backend == "nccl" else None
            if child is not None:
                return child
            return build_backend(self.backend, client, name, new_rank, len(ranks), hooks,
                                 plane=getattr(parent_backend, "config", None), participants=sorted(members),
                                 failed=lambda: client.failure, nccl=getattr(parent_backend, "settings", None))
        child = Communicator(make, self._client, name=name, members=members, parent=self)
        self._children.append(child)
        return child

    def _close(self, error: GridcommError) -> None:
        self._closed = error
        self._client.untrack(self._tracker)

        def refuse(*_args: Any, **_kwargs: Any) -> None:
            raise copy.copy(error)  # keeps .rank and .reason

        for method in COLLECTIVES:
            setattr(self, method, refuse)
        for child in self._children:
            if child._closed is None:
                child._close(error)

    # ------------------------------------------------------------------ recovery in place
    def rebuild(self, timeout_s: float | None = None) -> Communicator:
        """After :class:`RankFailedError`: the next generation's communicator, with the same world
        size and this rank's rank. Waits (bounded by ``timeout_s``, else the init's timeout) until
        every failed rank has a replacement: a new process that calls ``init_process_group(n,
        rank)`` as the first one did (a restarted pod). Every survivor must call it. This
        communicator and its split children are aborted and refuse calls; split the new one again.
        A rank that fails meanwhile raises :class:`RankFailedError` naming it; call again."""
        return self._recover("rebuild", timeout_s)

    def shrink(self, timeout_s: float | None = None) -> Communicator:
        """After :class:`RankFailedError`: a communicator of the survivors only, renumbered in the
        order of their job ranks (``members`` says which job ranks they are). Every survivor must
        call it; otherwise as :meth:`rebuild`."""
        return self._recover("shrink", timeout_s)

    def _recover(self, mode: str, timeout_s: float | None) -> Communicator:
        return recover(self, mode, timeout_s)

    def _latest(self) -> Communicator:
        root = self._root()
        while root._successor is not None:
            root = root._successor
        return root

    # ------------------------------------------------------------------ leaving
    def stop(self) -> None:
        """Leaves cleanly and frees the backend; idempotent. Also the way out after another
        rank failed. On the rank that hosts the coordinator, waits (bounded) for every rank to
        leave or fail before the server stops. On a communicator that a rebuild() or shrink()
        replaced, stops the one that replaced it (the ``with`` block of the first init ends the
        rank's part in the job whatever generation it reached)."""
        if self._root()._successor is not None:
            self._latest().stop()
            return
        if self._closed is None:
            self._close(CommAborted(f"communicator {self.name!r} was stopped; create a new one"))
            for backend in self._all_backends():
                backend.destroy()
        if self._parent is None:
            self._finalize(report=None)

    def abort(self, reason: str = "aborted by the user") -> None:
        """Fails this rank on purpose: every other rank gets RankFailedError naming it, and this
        rank's backends are aborted (NCCL work in flight is released). Idempotent."""
        root = self._root()
        if root._successor is not None:
            root._latest().abort(reason)
            return
        if root._finalized:
            return
        if root._closed is None:
            error = CommAborted(f"rank {root.rank} aborted: {reason}")
            root._write_trace(str(error))
            root._close(error)
            root._abort_backends(error)
        root._finalize(report=reason)

    def _finalize(self, report: str | None) -> None:
        """Ends this rank's part in the job once: stops heartbeats, then reports a failure
        (``report``) or leaves cleanly, then stops health and the embedded coordinator."""
        if self._finalized:
            return
        self._finalized = True
        self._client.stop_watching()
        # Why every backend, also after a failure or abort (where stop() frees none): the host
        # backend's sockets and shared memory go now, not at interpreter exit. Idempotent.
        self._await_aborts()
        for backend in self._all_backends():
            try:
                backend.destroy()
            except Exception as exc:  # noqa: BLE001 - best effort; leaving still matters more
                log.warning("rank %d: freeing a backend failed: %s", self.rank, exc)
        self._set_ready(False)
        try:
            if report is not None:
                self._client.report_failure(report)
            elif isinstance(self._closed, CoordinatorUnavailable):
                pass  # the coordinator is gone: nobody to leave (a leave would wait out its deadline)
            else:
                # Why a short bound after a failure: the leave only tidies up; the job is over.
                self._client.leave(LEAVE_AFTER_FAILURE_S if isinstance(self._closed, RankFailedError) else SHORT_CALL_S)
        except GridcommError as exc:
            log.warning("rank %d: could not tell the coordinator (%s): %s", self.rank,
                        "failure" if report else "leave", exc)
        finally:
            self._client.close()
            if self._job is not None and self._job.coordinator is not None:
                self._job.coordinator.stop(grace_s=self._job.grace_s)

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        root = self._root()
        if exc is None:
            self.stop()
        elif isinstance(exc, RankFailedError) or (isinstance(exc, GridcommError) and root._closed is not None):
            # Another rank failed (or this one already aborted): leave; nothing new to report.
            # Why RankFailedError on its own: a call can learn of a peer's failure before this
            # rank's watcher does; reporting this rank failed too made one crash read as several.
            if root._closed is None:
                root._on_failure(exc)
            root.stop()
        else:
            self.abort(f"{exc_type.__name__ if exc_type else 'error'} in user code: {exc}")

    def __repr__(self) -> str:
        return (f"<gridcomm.Communicator {self.name!r} rank {self.rank} of {self.world_size} backend={self.backend}"
                f"{' closed' if self._closed else ''}>")
