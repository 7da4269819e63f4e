"""Sampled GPU time inside NCCL collectives: what a rank's straggler figure is made of on NCCL.

On NCCL a collective returns to the host once it is enqueued, so the host's time inside the call
says nothing about waiting. The waiting happens on the GPU: a rank's NCCL kernel spins until the
last peer's arrives, so the rank that enters late spends the least GPU time inside. Every
:data:`EVERY`-th collective of a communicator (by its count: the same collectives on every rank)
the backend records a timing CUDA event on the call's stream before and after it (main thread,
from a small pool of event pairs; none free, or a stream being captured into a graph: not timed).
The sampler's thread (gridcomm._backends.nccl.sampler) reads each pair's elapsed time once its
end event has completed. :meth:`GpuTimer.inside_s` is then an estimate of the seconds this rank's
collectives spent inside on the GPU in all, the figure the coordinator's entry lag compares between
ranks (gridcomm._coordinator.state.lag), as it compares host time on the host backend: at each
report, the collectives entered since the last one count at the mean of the last :data:`RECENT`
samples. Why not each sample times ``EVERY``: a heartbeat's window would then hold two samples on
one rank and three on another, a difference that reads as lag between ranks that wait alike.

A non-sampled call pays one integer test (``count & MASK``).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

#: Every this many collectives of a communicator one is timed (a power of two: see MASK).
EVERY = 64
#: ``count & MASK == 0``: the collective numbered ``count`` is timed.
MASK = EVERY - 1
#: Event pairs per communicator: samples recorded but not yet read by the sampler's thread.
POOL = 4
#: Samples the mean time inside is taken over.
RECENT = 8


class GpuTimer:
    """One communicator's timed collectives. ``make_event`` makes a timing CUDA event (CuPy's
    ``Event(disable_timing=False)``: its ``record(stream)`` and ``ptr``); ``is_capturing(ptr)``
    says whether a stream is being captured into a graph (then nothing is recorded on it)."""

    def __init__(self, make_event: Callable[[], Any], is_capturing: Callable[[int], Any], *,
                 every: int = EVERY, pool: int = POOL) -> None:
        self.every = every
        self._is_capturing = is_capturing
        #: Free event pairs (the main thread takes, the sampler's thread gives back).
        self._free: list[tuple[Any, Any]] = [(make_event(), make_event()) for _ in range(pool)]
        #: Pairs recorded around a collective, oldest first, for the sampler's thread.
        self._recorded: collections.deque[tuple[Any, Any]] = collections.deque()
        self._lock = threading.Lock()
        #: Read elapsed times: how many, and their sum in seconds.
        self.samples = 0
        self.sampled_s = 0.0
        self._recent: collections.deque[float] = collections.deque(maxlen=RECENT)
        #: The estimate so far, and the count it covers (see inside_s).
        self._estimate = 0.0
        self._counted = 0
        #: Collectives not timed for want of a free pair, or because their stream was capturing.
        self.skipped = 0
        self._broken = False

    # ------------------------------------------------------------------ main thread
    def start(self, stream: Any) -> tuple[Any, Any] | None:
        """Before a timed collective: a pair whose start event is recorded on ``stream``, or None
        (nothing recorded: no pair free, a capturing stream, or CUDA refused)."""
        if self._broken:
            return None
        try:
            pair = self._free.pop()
        except IndexError:
            self.skipped += 1
            return None
        try:
            capturing = self._is_capturing(stream.ptr)
        except Exception:  # noqa: BLE001 - CUDA refuses the question (e.g. another capture): not now
            capturing = True
        if capturing:
            self._free.append(pair)
            self.skipped += 1
            return None
        try:
            pair[0].record(stream)
        except Exception as exc:  # noqa: BLE001 - a sample is a courtesy: never an error of the call
            log.debug("GPU timing off: recording an event failed: %s", exc)
            self._broken = True
            return None
        return pair

    def end(self, pair: tuple[Any, Any], stream: Any) -> None:
        """After the timed collective was enqueued: records the end event, hands the pair over."""
        try:
            pair[1].record(stream)
        except Exception as exc:  # noqa: BLE001 - as in start
            log.debug("GPU timing off: recording an event failed: %s", exc)
            self._broken = True
            return
        with self._lock:
            self._recorded.append(pair)

    def cancel(self, pair: tuple[Any, Any]) -> None:
        """The timed call raised: the pair goes back unread."""
        self._free.append(pair)

    # ------------------------------------------------------------------ the sampler's thread
    def collect(self, elapsed_ms: Callable[[int, int], float | None]) -> int:
        """Reads the recorded pairs in order while ``elapsed_ms(start ptr, end ptr)`` has their
        time (None: the end event has not completed; stops there). Returns how many were read."""
        read = 0
        while True:
            with self._lock:
                if not self._recorded:
                    return read
                pair = self._recorded[0]
            ms = elapsed_ms(pair[0].ptr, pair[1].ptr)
            if ms is None:
                return read
            seconds = max(0.0, float(ms)) / 1000.0
            with self._lock:
                self._recorded.popleft()
                self.samples += 1
                self.sampled_s += seconds
                self._recent.append(seconds)
            self._free.append(pair)
            read += 1

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._recorded)

    # ------------------------------------------------------------------ reports
    def inside_s(self, entered: int) -> float:
        """Estimated seconds inside this communicator's first ``entered`` collectives on the GPU
        (called once per report): those entered since the last call count at the mean of the
        recent samples; 0 until a sample was read (then every collective so far counts at it)."""
        with self._lock:
            if not self._recent:
                return 0.0
            mean = sum(self._recent) / len(self._recent)
            if entered > self._counted:
                self._estimate += (entered - self._counted) * mean
                self._counted = entered
            return self._estimate
