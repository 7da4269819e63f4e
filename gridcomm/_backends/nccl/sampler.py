"""How far the GPU has got through a communicator's collectives, sampled without ever blocking
the process's background loop.

The heartbeat (on the background loop) asks :meth:`GpuSampler.poll` for the count known complete
and how long the pending sample has waited; ``poll`` never calls CUDA. A thread of its own
(``gridcomm-gpu-sampler``) does: it records one CUDA event after the last collective entered, on
that collective's stream (never on a stream being captured into a graph), and queries it. It
calls the CUDA driver through ctypes, which releases the GIL for the call, so a CUDA call that
blocks while the GPU hangs (a driver lock held by a stream synchronize, an NCCL enqueue) blocks
that thread only: the heartbeats go on and report the wait growing, and the coordinator names the
GPU hang at its stall bound. The time a CUDA call of the sampler has been blocked counts as
waiting too (no sample could be taken meanwhile). The same thread reads the elapsed time of the
collectives the backend timed (gridcomm._backends.nccl.timing), once their end event completed.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from typing import Any, Protocol

from gridcomm._backends.nccl.timing import GpuTimer

log = logging.getLogger(__name__)

#: How often the sampler thread looks again when nobody asked (it wakes at once when asked).
IDLE_S = 1.0

_NOT_READY = 600  # CUDA_ERROR_NOT_READY
_RELAXED = 2  # CU_STREAM_CAPTURE_MODE_RELAXED
_DISABLE_TIMING = 2  # CU_EVENT_DISABLE_TIMING


class Driver(Protocol):
    """The CUDA calls the sampler makes (all on its own thread)."""

    def bind(self, device: int) -> None: ...
    def new_event(self) -> Any: ...
    def is_capturing(self, stream: int) -> bool: ...
    def record(self, event: Any, stream: int) -> None: ...
    def query(self, event: Any) -> bool: ...
    def destroy_event(self, event: Any) -> None: ...
    def elapsed(self, start: int, end: int) -> float | None: ...


class CudaDriver:
    """The CUDA driver API through ctypes (``libcuda.so.1``, already loaded by CuPy)."""

    def __init__(self) -> None:
        self._cuda = ctypes.CDLL("libcuda.so.1")
        # The same call under both names (a driver may export only the newer one).
        self._elapsed = next((n for n in ("cuEventElapsedTime", "cuEventElapsedTime_v2") if hasattr(self._cuda, n)),
                             "cuEventElapsedTime")

    def _call(self, name: str, *args: Any) -> int:
        result = int(getattr(self._cuda, name)(*args))
        if result not in (0, _NOT_READY):
            raise OSError(f"{name} returned CUresult {result}")
        return result

    def bind(self, device: int) -> None:
        """Makes ``device``'s primary context (CuPy's) current on this thread, in the relaxed
        capture mode: a CUDA call here can then never invalidate a graph the main thread captures."""
        dev, ctx, mode = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_int(_RELAXED)
        self._call("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(device))
        self._call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
        self._call("cuCtxSetCurrent", ctx)
        self._call("cuThreadExchangeStreamCaptureMode", ctypes.byref(mode))

    def new_event(self) -> Any:
        event = ctypes.c_void_p()
        self._call("cuEventCreate", ctypes.byref(event), ctypes.c_uint(_DISABLE_TIMING))
        return event

    def is_capturing(self, stream: int) -> bool:
        status = ctypes.c_int()
        self._call("cuStreamIsCapturing", ctypes.c_void_p(stream), ctypes.byref(status))
        return status.value != 0

    def record(self, event: Any, stream: int) -> None:
        self._call("cuEventRecord", event, ctypes.c_void_p(stream))

    def query(self, event: Any) -> bool:
        return self._call("cuEventQuery", event) == 0

    def destroy_event(self, event: Any) -> None:
        self._call("cuEventDestroy_v2", event)

    def elapsed(self, start: int, end: int) -> float | None:
        """Milliseconds between two timing events (raw handles), None while ``end`` is pending."""
        ms = ctypes.c_float()
        result = self._call(self._elapsed, ctypes.byref(ms), ctypes.c_void_p(start), ctypes.c_void_p(end))
        return None if result == _NOT_READY else float(ms.value)


class GpuSampler:
    """One communicator's GPU progress sampler (see the module docstring)."""

    def __init__(self, device: int, driver: Driver | None = None, timer: GpuTimer | None = None) -> None:
        self._device = device
        self._driver = driver
        #: The communicator's timed collectives, read here (None: none are timed).
        self.timer = timer
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._stopped = False
        #: Asked of the thread: the last count entered and its stream (the object: it keeps the
        #: stream alive, so no event is recorded on a stream its owner destroyed since).
        self._asked: tuple[int, Any] = (0, None)
        #: What the thread found: the count known complete, the pending sample's count and when
        #: it was recorded, and since when a CUDA call of the thread has not returned.
        self.completed = 0
        self._pending: tuple[int, float] | None = None
        self._busy_since: float | None = None
        self._broken: str | None = None
        self._thread: threading.Thread | None = None

    def poll(self, entered: int, stream: Any) -> tuple[int, float]:
        """(count known complete on the GPU, seconds the pending sample or a blocked CUDA call has
        waited; 0: none). Never calls CUDA; asks the thread for a fresh look."""
        with self._lock:
            if self._broken is not None or self._stopped:
                return max(self.completed, entered), 0.0
            self._asked = (entered, stream)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="gridcomm-gpu-sampler", daemon=True)
                self._thread.start()
            completed, pending, busy = self.completed, self._pending, self._busy_since
            # Read under the lock, after the times it is compared with (the thread sets them under
            # it): a clock read before waiting for the lock can precede them.
            now = time.monotonic()
        self._wake.set()
        since = [t for t in (pending[1] if pending is not None else None, busy) if t is not None]
        return completed, (now - min(since)) if since else 0.0

    def stop(self) -> None:
        """Ends the thread (at its next wake; a thread blocked in CUDA is a daemon)."""
        with self._lock:
            self._stopped = True
        self._wake.set()

    def _cuda(self, call: Any, *args: Any) -> Any:
        with self._lock:
            self._busy_since = time.monotonic()
        try:
            return call(*args)
        finally:
            with self._lock:
                self._busy_since = None

    def _run(self) -> None:
        try:
            driver = self._driver if self._driver is not None else CudaDriver()
            self._cuda(driver.bind, self._device)
            event = self._cuda(driver.new_event)
            while True:
                self._wake.wait(IDLE_S)
                self._wake.clear()
                with self._lock:
                    stopped = self._stopped
                    (entered, stream), pending = self._asked, self._pending
                if stopped:
                    self._cuda(driver.destroy_event, event)  # CUDA frees it once the GPU is done with it
                    return
                timer = self.timer
                if timer is not None and timer.pending:
                    timer.collect(lambda start, end: self._cuda(driver.elapsed, start, end))
                if pending is not None:
                    if not self._cuda(driver.query, event):
                        continue
                    with self._lock:
                        self.completed, self._pending = pending[0], None
                if entered > self.completed and stream is not None:
                    ptr = int(stream.ptr)
                    if self._cuda(driver.is_capturing, ptr):
                        continue
                    self._cuda(driver.record, event, ptr)
                    with self._lock:
                        self._pending = (entered, time.monotonic())
        except Exception as exc:  # noqa: BLE001 - a sample is a courtesy: never an error of the job
            log.debug("GPU progress sampler of device %d ended: %s", self._device, exc)
            with self._lock:
                self._broken = str(exc)
                self._pending = None
