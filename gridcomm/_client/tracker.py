"""A rank's progress in one communicator, as its heartbeats carry it to the coordinator.

The communicator counts every collective all its members take part in (all_reduce, reduce,
broadcast, reduce_scatter, all_gather, scatter, gather, all_to_all), its barriers and splits;
send/recv are left out (pairs make them, so ranks' counts of them differ in a healthy pipeline).
The count, the last kind and whether the call is still in it are read by the watcher on the
background loop for each heartbeat (see ``gridcomm._coordinator.state.progress`` for what the
coordinator makes of them). The main thread's cost per call is three attribute stores; with
``GRIDCOMM_DEBUG=collectives`` also a lock, a fingerprint of the call's arguments and its fold
into the communicator's running digest (see gridcomm._client.digest).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gridcomm._client.digest import DigestLog
from gridcomm._client.flight import describe
from gridcomm._proto import coordinator_pb2 as pb

#: Fingerprints kept per communicator (the coordinator's limit per report).
RECENT = 64
#: Collectives every member of a communicator takes part in (counted), with their parameters.
COUNTED: Mapping[str, tuple[str, ...]] = {
    "all_reduce": ("in_array", "out_array", "op"),
    "reduce": ("in_array", "out_array", "root", "op"),
    "broadcast": ("in_out_array", "root"),
    "reduce_scatter": ("in_array", "out_array", "count", "op"),
    "all_gather": ("in_array", "out_array", "count"),
    "scatter": ("in_array", "out_array", "root"),
    "gather": ("in_array", "out_array", "root"),
    "all_to_all": ("in_array", "out_array"),
}
#: Which array of each call is the same on every rank (scatter's input and gather's output
#: matter only on the root).
_SAME_ON_ALL = {"scatter": "out_array", "gather": "in_array", "broadcast": "in_out_array"}


def _shape(array: Any) -> str:
    size = getattr(array, "size", None)
    dtype = getattr(array, "dtype", None)
    return f"{size} x {dtype}" if size is not None else type(array).__name__


def fingerprint(kind: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    """``all_reduce(sum, 4 x float32)``, ``broadcast(root=0, 4 x float32)``: what a call asks of
    every rank (never the data)."""
    names = COUNTED[kind]
    bound = dict(zip(names, args, strict=False))
    bound.update((k, v) for k, v in kwargs.items() if k in names)
    parts = []
    if "op" in names:
        parts.append(str(bound.get("op", "sum")))
    if "root" in names:
        parts.append(f"root={bound.get('root', 0)}")
    if "count" in names:
        parts.append(f"{bound.get('count')} x {getattr(bound.get('in_array'), 'dtype', '?')}")
    else:
        parts.append(_shape(bound.get(_SAME_ON_ALL.get(kind, "in_array"))))
    return f"{kind}({', '.join(parts)})"[:256]


#: Each counted collective's parameters with their defaults (the Communicator API's).
_SIGNATURES: Mapping[str, str] = {
    "all_reduce": 'in_array, out_array, op="sum", stream=None',
    "reduce": 'in_array, out_array, root=0, op="sum", stream=None',
    "broadcast": "in_out_array, root=0, stream=None",
    "reduce_scatter": 'in_array, out_array, count, op="sum", stream=None',
    "all_gather": "in_array, out_array, count, stream=None",
    "scatter": "in_array, out_array, root=0, stream=None",
    "gather": "in_array, out_array, root=0, stream=None",
    "all_to_all": "in_array, out_array, stream=None",
}
# Why generated: a wrapper with the collective's own parameters forwards them positionally, with
# no *args/**kwargs packing: a generic wrapper costs about a microsecond a call, a sizeable share
# of a small NCCL collective; this shape tens of ns. Its two clock reads time the call (how long
# this rank waits inside collectives: a straggler's peers wait for it, so it waits least; see
# state.lag).
# The flight record's line (when on) appends what the call asked, never the data or an array.
_WRAPPER = """
def {kind}({params}):
    tracker.entered += 1
    tracker.kind = "{kind}"
    tracker.inside = True
    tracker.started = start = clock()
    try:
        return call({args})
    finally:
        tracker.inside = False
        end = clock()
        tracker.inside_s += end - start
        {record}
"""
_RECORD = 'append((tracker.entered, "{kind}", ({params}), describe({array}), start, end))'



class Tracker:
    """How many counted calls this rank has entered in one communicator of one generation.

    The main thread only counts (``entered``, ``kind``, ``inside``); when an entry happened is
    read off the watcher's samples (:meth:`progress`, once per heartbeat): an entry first seen
    at a sample is dated then, at most one heartbeat period late, which only ever delays a
    stall's naming, never hastens it."""

    __slots__ = ("name", "generation", "entered", "kind", "inside", "stream", "sampler", "_log", "_lock", "_seen",
                 "_seen_at", "_probes", "inside_s", "started", "record", "_print", "gpu_inside", "gpu_completed")

    def __init__(self, name: str, generation: int, *, fingerprints: bool = False, record: int = 0) -> None:
        self.name = name
        #: The wire's generation the communicator belongs to (its client's at construction).
        self.generation = generation
        self.entered = 0
        self.kind = ""
        self.inside = False
        #: Seconds spent inside counted calls in all (a backend that counts itself: none).
        self.inside_s = 0.0
        #: When the last counted call was entered (monotonic; 0: none, or a backend counting itself).
        self.started = 0.0
        #: The flight record (gridcomm._client.flight): the last ``record`` calls, or None.
        self.record: collections.deque[tuple[Any, ...]] | None = collections.deque(maxlen=record) if record else None
        self._print: str = ""
        #: The stream object of the last collective (NCCL keeps it, and so keeps it alive, for
        #: its backend's gpu_progress; see there), or None.
        self.stream: Any = None
        #: NCCL: () -> (collectives known complete on the GPU, seconds its pending sample waited).
        self.sampler: Callable[[], tuple[int, float]] | None = None
        #: NCCL: () -> estimated seconds inside collectives on the GPU in all (sampled GPU time, see
        #: gridcomm._backends.nccl.timing), reported with inside_s; () -> collectives the sampler
        #: last found complete on the GPU (for the flight record).
        self.gpu_inside: Callable[[], float] | None = None
        self.gpu_completed: Callable[[], int] | None = None
        #: Only with fingerprints: the running digest and the last collectives' fingerprints.
        self._log = DigestLog() if fingerprints else None
        #: The coordinator's DigestProbes not yet answered: (counts, with fingerprints).
        self._probes: list[tuple[list[int], bool]] = []
        #: Only with fingerprints: the window and the count must be read together.
        self._lock = threading.Lock() if fingerprints else None
        #: The count at the last sample, and when it was first seen.
        self._seen = 0
        self._seen_at = time.monotonic()

    @property
    def fingerprints(self) -> bool:
        return self._log is not None

    def enter(self, kind: str, print_: str | None = None) -> None:
        if self._lock is None:
            self.entered += 1
            self.kind = kind
        else:
            assert self._log is not None
            with self._lock:
                count = self.entered + 1
                self._log.add(count, print_ or f"{kind}()")
                self.entered = count
                self.kind = kind
        self._print = print_ or f"{kind}()"
        self.inside = True
        self.started = time.monotonic()

    def leave(self) -> None:
        self.inside = False
        end = time.monotonic()
        self.inside_s += end - self.started
        if self.record is not None:
            self.record.append((self.entered, self.kind, self._print, None, self.started, end))

    def progress(self) -> pb.Progress:
        """The report for the next heartbeat (read on the background loop)."""
        recent: list[str] = []
        digest = 0
        answers: tuple[list[int], list[int], list[str], list[int]] = ([], [], [], [])
        if self._lock is None:
            entered, kind = self.entered, self.kind
        else:
            log = self._log
            assert log is not None
            with self._lock:
                entered, kind, digest = self.entered, self.kind, log.digest
                recent = log.recent(entered, RECENT)
                probes, self._probes = self._probes, []
                if probes:
                    # Fingerprints for all or none (the answer's lists are parallel).
                    prints = any(p for _, p in probes)
                    answers = log.answer([c for counts, _ in probes for c in counts], prints, entered)
        now = time.monotonic()
        if entered != self._seen:
            self._seen, self._seen_at = entered, now
        # Why the call's own entry time when it is still in it: the coordinator then knows how
        # long its peers really waited (a sample's date is up to one heartbeat late).
        started = self.started
        age_s = now - started if self.inside and started and started <= now else now - self._seen_at
        completed, gpu_wait_s = self.sampler() if self.sampler is not None else (0, 0.0)
        # NCCL: the host's time in a call is its enqueue; the waiting is on the GPU.
        inside_s = self.inside_s + (self.gpu_inside() if self.gpu_inside is not None else 0.0)
        return pb.Progress(communicator=self.name, entered=entered, kind=kind, age_s=max(0.0, age_s),
                           inside=self.inside, recent=recent[-entered:] if entered else [], completed=completed,
                           gpu_wait_s=gpu_wait_s, digest=digest, probe_counts=answers[0], probe_digests=answers[1],
                           probe_prints=answers[2], probe_lost=answers[3], inside_s=inside_s)

    def probe(self, counts: Sequence[int], prints: bool) -> None:
        """The coordinator asks for the digests after ``counts`` (and their fingerprints when
        ``prints``): the next :meth:`progress` answers (nothing without fingerprints)."""
        if self._lock is None:
            return
        with self._lock:
            if len(self._probes) < 8:
                self._probes.append((list(counts[:1024]), prints))

    def counted(self, kind: str, call: Callable[..., Any]) -> Callable[..., Any]:
        """``call`` (a backend's collective), counted as it is entered and left."""
        if self._log is None:
            params = _SIGNATURES[kind]
            args = ", ".join(p.split("=")[0] for p in params.split(", "))
            scope: dict[str, Any] = {"tracker": self, "call": call, "clock": time.monotonic, "describe": describe}
            record = ""
            if self.record is not None:
                scope["append"] = self.record.append
                names = [n for n in COUNTED[kind] if not n.endswith("_array")]
                record = _RECORD.format(kind=kind, params="".join(f"{n}, " for n in names),
                                        array=_SAME_ON_ALL.get(kind, "in_array"))
            exec(_WRAPPER.format(kind=kind, params=params, args=args, record=record), scope)  # noqa: S102 - ours
            tracked: Callable[..., Any] = scope[kind]
        else:
            enter, leave = self.enter, self.leave

            def tracked(*args: Any, **kwargs: Any) -> Any:
                enter(kind, fingerprint(kind, args, kwargs))
                try:
                    return call(*args, **kwargs)
                finally:
                    leave()
        tracked.__doc__ = getattr(call, "__doc__", None)
        return tracked
