"""A rank's progress in one communicator, as its heartbeats carry it to the coordinator.

The communicator counts every collective all its members take part in (all_reduce, reduce,
broadcast, reduce_scatter, all_gather, scatter, gather, all_to_all), its barriers and splits;
send/recv are left out (pairs make them, so ranks' counts of them differ in a healthy pipeline).
The count, the last kind, when it was entered and whether the call is still in it are read by
the watcher on the background loop for each heartbeat (see ``gridcomm._coordinator.state.progress``
for what the coordinator makes of them). The main thread's cost per call is one tuple and one
clock read; with ``GRIDCOMM_DEBUG=collectives`` also a fingerprint of the call's arguments.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

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


class Tracker:
    """How many counted calls this rank has entered in one communicator of one generation."""

    __slots__ = ("name", "generation", "_state", "_inside", "_recent", "_lock")

    def __init__(self, name: str, generation: int, *, fingerprints: bool = False) -> None:
        self.name = name
        #: The wire's generation the communicator belongs to (its client's at construction).
        self.generation = generation
        #: (entered, kind of the last, when it was entered): one tuple, so a reader on another
        #: thread never sees a count with another call's kind or time.
        self._state: tuple[int, str, float] = (0, "", time.monotonic())
        self._inside = False
        self._recent: collections.deque[str] | None = collections.deque(maxlen=RECENT) if fingerprints else None
        #: Only with fingerprints: the window and the count must be read together.
        self._lock = threading.Lock() if fingerprints else None

    @property
    def fingerprints(self) -> bool:
        return self._recent is not None

    def enter(self, kind: str, print_: str | None = None) -> None:
        if self._lock is None:
            self._state = (self._state[0] + 1, kind, time.monotonic())
        else:
            assert self._recent is not None
            with self._lock:
                self._recent.append(print_ or f"{kind}()")
                self._state = (self._state[0] + 1, kind, time.monotonic())
        self._inside = True

    def leave(self) -> None:
        self._inside = False

    @property
    def entered(self) -> int:
        return self._state[0]

    def progress(self) -> pb.Progress:
        """The report for the next heartbeat (read on the background loop)."""
        if self._lock is None:
            entered, kind, at = self._state
            recent: list[str] = []
        else:
            assert self._recent is not None
            with self._lock:
                entered, kind, at = self._state
                recent = list(self._recent)
        return pb.Progress(communicator=self.name, entered=entered, kind=kind,
                           age_s=max(0.0, time.monotonic() - at), inside=self._inside, recent=recent)

    def counted(self, kind: str, call: Callable[..., Any]) -> Callable[..., Any]:
        """``call`` (a backend's collective), counted as it is entered and left."""
        enter, leave = self.enter, self.leave
        if self._recent is None:
            def tracked(*args: Any, **kwargs: Any) -> Any:
                enter(kind)
                try:
                    return call(*args, **kwargs)
                finally:
                    leave()
        else:
            def tracked(*args: Any, **kwargs: Any) -> Any:
                enter(kind, fingerprint(kind, args, kwargs))
                try:
                    return call(*args, **kwargs)
                finally:
                    leave()
        tracked.__name__ = kind
        tracked.__doc__ = getattr(call, "__doc__", None)
        return tracked
