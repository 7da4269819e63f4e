"""The NCCL backend's flight record and its sampled GPU time, without a GPU.

CUDA and NCCL do not run here: the backend's own collective methods run over NumPy arrays with
CuPy's two extra attributes, NCCL's per-call functions are stand-ins that log their calls, and
timing events are stand-ins that log where they were recorded (the GPU tests,
tests/test_gpu_hangs.py, run the real ones). What is checked: every collective of the backend
puts an entry in the flight record without GRIDCOMM_DEBUG, rendered as the host backend's are;
exactly every timing.EVERY-th collective is timed, with its events around its NCCL call; the
sampler's thread reads the timed pairs in order once complete; and a rank whose collectives spent
least time inside on the GPU is the straggler the coordinator names.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from gridcomm._backends.nccl import timing
from gridcomm._backends.nccl.backend import NcclBackend
from gridcomm._backends.nccl.sampler import GpuSampler
from gridcomm._backends.nccl.timing import GpuTimer
from gridcomm._client import flight
from gridcomm._client.tracker import Tracker
from gridcomm._coordinator.state.lag import EntryLag

STREAM = SimpleNamespace(ptr=0x5151)


class Arr(np.ndarray):
    """A NumPy array with what the backend's fast paths read of a CuPy array."""

    @property
    def _c_contiguous(self) -> bool:
        return bool(self.flags.c_contiguous)

    @property
    def data(self) -> Any:  # type: ignore[override]
        return SimpleNamespace(ptr=self.ctypes.data)


def arr(n: int, dtype: str = "float32", shape: tuple[int, ...] | None = None) -> Arr:
    return np.zeros(shape or (n,), dtype=dtype).view(Arr)


class Event:
    """A timing event: logs where it is recorded."""

    made = 0

    def __init__(self, log: list[Any]) -> None:
        Event.made += 1
        self.ptr = Event.made
        self._log = log

    def record(self, stream: Any) -> None:
        self._log.append(("event", self.ptr, stream.ptr))


def bare_backend(world: int = 2, rank: int = 0, *, record: int = 1024, capturing: bool = False
                 ) -> tuple[NcclBackend, Tracker, list[Any]]:
    """The backend's collective methods over stand-ins for NCCL's per-call functions and CUDA."""
    log: list[Any] = []
    b = object.__new__(NcclBackend)
    b.rank, b.world_size, b._c = rank, world, "comm"
    b.on_invalid = None
    b._current_stream = lambda: STREAM
    b._dtypes = {np.dtype(n): (i, 1) for i, n in enumerate(("float32", "float64", "int32"))}
    b._dtypes[np.dtype("complex64")] = (0, 2)
    b._by_id = {id(dt): e for dt, e in b._dtypes.items()}
    b._ops = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}
    b._reduce_by_id = {op: {id(dt): (t, m, code) for dt, (t, m) in b._dtypes.items()} for op, code in b._ops.items()}
    def stand_in(name: str) -> Any:
        return lambda *args: log.append((name[6:], *args))

    for name in NcclBackend._PER_CALL:
        setattr(b, name, stand_in(name))
    b._group_start = lambda: log.append(("group_start",))
    b._group_end = lambda: log.append(("group_end",))
    b._timer = GpuTimer(lambda: Event(log), lambda ptr: capturing)
    tracker = Tracker("world", 1, record=record)
    b.progress = tracker
    return b, tracker, log


def call_every_collective(comm: Any) -> None:
    x, y = arr(8), arr(8)
    comm.all_reduce(x, y, "max")
    comm.reduce(x, y, 1, "sum")
    comm.broadcast(x, 1)
    comm.reduce_scatter(arr(8), arr(4), 4, "min")
    comm.all_gather(arr(4), arr(8), 4)
    comm.scatter(arr(8, shape=(2, 4)), arr(4), 0)
    comm.gather(arr(4), arr(8, shape=(2, 4)), 0)
    comm.all_to_all(arr(8, shape=(2, 4)), arr(8, shape=(2, 4)))
    comm.all_reduce(arr(3, "complex64"), arr(3, "complex64"))  # NCCL counts 6 floats; the record 3 complex64


def test_every_collective_is_in_the_nccl_flight_record_as_the_host_backend_writes_it():
    backend, tracker, log = bare_backend()
    call_every_collective(backend)
    assert tracker.entered == 9 and len(log) > 9  # NCCL was called for each
    nccl = flight.tracker_record(tracker)
    # The host backend's record of the same calls (the tracker's generated wrappers).
    host_tracker = Tracker("world", 1, record=1024)
    host = SimpleNamespace(**{kind: host_tracker.counted(kind, lambda *a, **k: None) for kind in
                              ("all_reduce", "reduce", "broadcast", "reduce_scatter", "all_gather", "scatter",
                               "gather", "all_to_all")})
    call_every_collective(host)
    expected = flight.tracker_record(host_tracker)
    assert [(r["number"], r["call"]) for r in nccl["records"]] == [(r["number"], r["call"])
                                                                  for r in expected["records"]]
    assert nccl["records"][0]["call"] == "all_reduce(op=max, 8 x float32)"
    assert nccl["records"][-1]["call"] == "all_reduce(op=sum, 3 x complex64)"
    # No array is kept (only sizes and dtypes), and the entry time is a wall-clock time.
    assert not any(isinstance(v, np.ndarray) for entry in tracker.record or () for v in entry)
    assert abs(nccl["records"][0]["entered_unix_s"] - time.time()) < 60


def test_the_record_says_which_collectives_the_gpu_sampler_found_complete():
    backend, tracker, _ = bare_backend()
    call_every_collective(backend)
    tracker.gpu_completed = lambda: 4
    out = flight.tracker_record(tracker)
    assert out["gpu_completed"] == 4
    assert [r["complete_on_gpu"] for r in out["records"]] == [True] * 4 + [False] * 5


def test_no_record_costs_nothing_but_the_count():
    backend, tracker, _ = bare_backend(record=0)
    call_every_collective(backend)
    assert tracker.entered == 9 and tracker.record is None


def _timed_counts(log: list[Any]) -> list[tuple[int, str]]:
    """(count of the NCCL call, its name) for each NCCL call bracketed by two events."""
    out = []
    calls = [i for i, item in enumerate(log) if item[0] not in ("group_start", "group_end", "event")]
    for n, i in enumerate(calls, start=1):
        if i > 0 and log[i - 1][0] == "event" and i + 1 < len(log) and log[i + 1][0] == "event":
            out.append((n, log[i][0]))
    return out


def test_exactly_every_kth_collective_is_timed_with_events_around_its_nccl_call():
    backend, tracker, log = bare_backend()
    x, y = arr(1), arr(1)
    for _ in range(3 * timing.EVERY + 5):
        backend.all_reduce(x, y)
    assert _timed_counts(log) == [(timing.EVERY * k, "all_reduce") for k in (1, 2, 3)]
    assert all(e[2] == STREAM.ptr for e in log if e[0] == "event")
    assert backend._timer.pending == 3


def test_group_collectives_are_timed_around_the_whole_group():
    backend, tracker, log = bare_backend()
    tracker.entered = timing.EVERY - 1  # the next call is a timed one
    backend.all_to_all(arr(8, shape=(2, 4)), arr(8, shape=(2, 4)))
    names = [e[0] for e in log]
    assert names[0] == "event" and names[1] == "group_start" and names[-2] == "group_end" and names[-1] == "event"


def test_a_stream_being_captured_and_an_empty_pool_get_no_events():
    backend, tracker, log = bare_backend(capturing=True)
    for _ in range(2 * timing.EVERY):
        backend.all_reduce(arr(1), arr(1))
    assert not [e for e in log if e[0] == "event"] and backend._timer.skipped == 2
    backend, tracker, log = bare_backend()
    for _ in range((timing.POOL + 2) * timing.EVERY):  # nobody reads the pairs: the pool runs out
        backend.all_reduce(arr(1), arr(1))
    assert backend._timer.pending == timing.POOL and backend._timer.skipped == 2


class Driver:
    """The sampler's CUDA calls: events complete when ``done`` says so."""

    def __init__(self, times_ms: dict[int, float]) -> None:
        self.times_ms = times_ms  # end event ptr -> elapsed ms, once complete
        self.asked: list[tuple[int, int]] = []

    def bind(self, device: int) -> None:
        pass

    def new_event(self) -> object:
        return object()

    def is_capturing(self, stream: int) -> bool:
        return False

    def record(self, event: object, stream: int) -> None:
        pass

    def query(self, event: object) -> bool:
        return True

    def destroy_event(self, event: object) -> None:
        pass

    def elapsed(self, start: int, end: int) -> float | None:
        self.asked.append((start, end))
        return self.times_ms.get(end)


def _poll_until(sampler: GpuSampler, ok: Any, what: str) -> None:
    deadline = time.monotonic() + 30
    while not ok():
        sampler.poll(1, STREAM)
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_the_sampler_thread_reads_timed_pairs_in_order_once_complete():
    log: list[Any] = []
    timer = GpuTimer(lambda: Event(log), lambda ptr: False)
    pairs = [timer.start(STREAM) for _ in range(3)]
    for pair in pairs:
        assert pair is not None
        timer.end(pair, STREAM)
    ends = [p[1].ptr for p in pairs if p is not None]
    driver = Driver({ends[1]: 7.0})  # the second is complete, the first not yet: nothing is read
    sampler = GpuSampler(0, driver, timer=timer)
    try:
        _poll_until(sampler, lambda: driver.asked, "the thread never asked")
        time.sleep(0.2)
        sampler.poll(1, STREAM)
        assert timer.samples == 0 and timer.pending == 3
        assert {end for _, end in driver.asked} == {ends[0]}  # never past the first pending pair
        driver.times_ms.update({ends[0]: 3.0, ends[2]: 2.0})
        _poll_until(sampler, lambda: timer.samples == 3, "the pairs were not read")
        assert timer.pending == 0 and timer.sampled_s == pytest.approx(0.012)
        assert timer.inside_s(10) == pytest.approx(10 * 0.004)  # 10 collectives at the mean sample, 4 ms
        assert timer.inside_s(12) == pytest.approx(12 * 0.004)
        assert [end for _, end in driver.asked[-3:]] == ends  # in the order they were recorded
        assert timer.start(STREAM) is not None  # read pairs are free again
    finally:
        sampler.stop()


def _simulated_lag(times_ms: list[float], offsets: list[int], per_heartbeat: int = 25) -> EntryLag:
    """Ranks' reports as their trackers write them: each rank's timed collectives take
    ``times_ms[rank]`` on the GPU; rank r reports every ``per_heartbeat`` collectives, first
    after ``offsets[r]`` (heartbeats are not in step with the loop, nor with each other)."""
    lag = EntryLag()
    for rank, (ms, offset) in enumerate(zip(times_ms, offsets, strict=True)):
        tracker = Tracker("world", 1)
        timer = GpuTimer(lambda: Event([]), lambda ptr: False)
        tracker.gpu_inside = lambda t=tracker, tm=timer: tm.inside_s(t.entered)
        for beat in range(60):
            target = offset + beat * per_heartbeat
            while tracker.entered < target:
                tracker.entered += 1
                if not tracker.entered & timing.MASK:
                    pair = timer.start(STREAM)
                    assert pair is not None
                    timer.end(pair, STREAM)
            timer.collect(lambda start, end, ms=ms: ms)
            report = tracker.progress()
            if report.inside_s > 0:
                lag.report(report.communicator, rank, report.entered, report.inside_s)
    return lag


def test_a_rank_that_spends_least_gpu_time_inside_is_the_straggler():
    """Rank 0's timed collectives spin 41 ms on the GPU waiting for rank 1, rank 1's take 1 ms:
    the coordinator's entry lag names rank 1, from the same figure the host backend reports
    (seconds inside collectives in all)."""
    lag = _simulated_lag([41.0, 1.0], [0, 0])
    lags = lag.lags()
    assert 0.035 < lags[1][0] < 0.045 and lags[0][0] == 0.0, lags
    assert [s.rank for s in lag.stragglers()] == [1]


def test_ranks_that_wait_alike_are_never_stragglers_however_their_reports_fall():
    """Two ranks whose collectives take 20 ms each, reporting out of step: a window of 8 reports
    holds two samples on one rank and three on the other, which must not read as lag."""
    for offset in (0, 7, 12, 19):
        lag = _simulated_lag([20.0, 20.0], [0, offset])
        assert lag.stragglers() == [], (offset, lag.lags())
        assert all(value < 0.001 for value, _ in lag.lags().values()), (offset, lag.lags())


def test_a_capture_query_cuda_refuses_skips_that_sample_only():
    answers = iter([RuntimeError("cudaErrorStreamCaptureImplicit"), False])

    def is_capturing(ptr: int) -> bool:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    timer = GpuTimer(lambda: Event([]), is_capturing)
    assert timer.start(STREAM) is None and timer.skipped == 1
    assert timer.start(STREAM) is not None  # the next timed collective is timed


def test_timing_events_are_made_on_the_device_at_construction_only(monkeypatch):
    """The pool is made once (on the backend's device, at construction): a sampled call never
    creates an event on whatever device is current then."""
    made = threading.Event()
    timer = GpuTimer(lambda: (made.set(), Event([]))[1], lambda ptr: False, pool=2)
    assert made.is_set()
    made.clear()
    for _ in range(3):
        pair = timer.start(STREAM)
        if pair is not None:
            timer.end(pair, STREAM)
    assert not made.is_set() and timer.pending == 2 and timer.skipped == 1
