"""Calls in flight end with the watcher's verdict.

When a rank's watcher declares the coordinator lost (silent for the liveness bound, or its process
gone), a call this rank has in flight would otherwise wait for its own deadline: a partitioned
rank's 120 s ``get`` ended only when its connection gave up, long after the watcher knew. The
client's unary calls are therefore issued as futures and kept here while they run, and
:meth:`InFlight.abandon` cancels them with the watcher's error; the Session stream's waiting
operations are ended the same way (``Session.abandon``). Each caller then raises a copy of that
error (the same type, message, rank and reason).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from gridcomm._errors import GridcommError

_T = TypeVar("_T")


class Abandoned(Exception):
    """The operation was in flight when the watcher declared the coordinator lost."""

    def __init__(self, error: GridcommError) -> None:
        super().__init__(str(error))
        self.error = error

    def raised(self) -> GridcommError:
        """What the caller raises: a copy of the watcher's error (one instance is not raised from
        several threads at once: each raise writes its traceback into it)."""
        return copy.copy(self.error)


class InFlight:
    """One client's unary calls in flight (any thread), and the verdict that ended them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: future -> None while it runs, or the error it was abandoned with.
        self._calls: dict[Any, GridcommError | None] = {}

    def unary(self, method: Callable[..., _T], request: Any, *, timeout: float,
              metadata: tuple[tuple[str, str], ...], wait_for_ready: bool) -> _T:
        """``method(request)`` as a future this object can end; raises :class:`Abandoned` when
        :meth:`abandon` ended it, else what the call raises."""
        future = method.future(request, timeout=timeout, metadata=metadata,  # type: ignore[attr-defined]
                               wait_for_ready=wait_for_ready)
        with self._lock:
            self._calls[future] = None
        try:
            result: _T = future.result()
            return result
        except (grpc.RpcError, grpc.FutureCancelledError):
            with self._lock:
                error = self._calls.get(future)
            if error is not None:
                raise Abandoned(error) from None
            raise
        finally:
            with self._lock:
                self._calls.pop(future, None)
            if not future.done():
                future.cancel()  # interrupted (KeyboardInterrupt): nobody waits for its answer

    def abandon(self, error: GridcommError) -> int:
        """Ends every call in flight with ``error``; returns how many."""
        with self._lock:
            running = [f for f, e in self._calls.items() if e is None]
            for future in running:
                self._calls[future] = error
        for future in running:
            future.cancel()
        return len(running)
