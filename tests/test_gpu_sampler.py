"""The GPU progress sampler's threading, without a GPU: the CUDA driver is stood in for by an
object whose calls block until released (CUDA does not run here; on a GPU, tests/test_gpu.py's
GPU-hang test runs the real one). What is checked: the heartbeat's poll never waits for CUDA,
and the wait it reports grows while the GPU (or a CUDA call) hangs, so the GPU hang is named."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from gridcomm._backends.nccl.sampler import GpuSampler

STREAM = SimpleNamespace(ptr=0x1234)


class Driver:
    def __init__(self, *, done: bool = False, record_blocks: bool = False, capturing: bool = False,
                 broken: bool = False) -> None:
        self.release = threading.Event()
        self.recorded = threading.Event()
        self.destroyed = threading.Event()
        self.done, self.record_blocks, self.capturing, self.broken = done, record_blocks, capturing, broken
        self.calls: list[str] = []

    def bind(self, device: int) -> None:
        if self.broken:
            raise OSError("cuDeviceGet returned CUresult 100")

    def new_event(self) -> object:
        return object()

    def is_capturing(self, stream: int) -> bool:
        assert stream == STREAM.ptr
        return self.capturing

    def record(self, event: object, stream: int) -> None:
        self.calls.append("record")
        if self.record_blocks:
            self.release.wait(60)
        self.recorded.set()

    def query(self, event: object) -> bool:
        self.calls.append("query")
        return self.done or self.release.is_set()

    def destroy_event(self, event: object) -> None:
        self.calls.append("destroy_event")
        self.destroyed.set()


def _poll_until(sampler: GpuSampler, entered: int, ok, what: str) -> tuple[int, float]:
    """Polls as the heartbeat does (each poll must return at once) until ``ok(result)``."""
    deadline = time.monotonic() + 30
    while True:
        start = time.monotonic()
        result = sampler.poll(entered, STREAM)
        assert time.monotonic() - start < 5, "poll waited for CUDA"
        if ok(result):
            return result
        assert time.monotonic() < deadline, f"{what}: last {result}"
        time.sleep(0.02)


def test_a_hung_gpu_shows_as_a_growing_wait_and_completion_once_it_ends():
    driver = Driver()
    sampler = GpuSampler(0, driver)
    try:
        completed, wait = _poll_until(sampler, 3, lambda r: r[1] > 0.3, "the wait did not grow")
        assert completed == 0
        driver.release.set()  # the GPU gets through
        _poll_until(sampler, 3, lambda r: r == (3, 0.0), "completion not seen")
        sampler.stop()
        assert driver.destroyed.wait(30)  # the thread ends and frees its event
        assert sampler.poll(4, STREAM) == (4, 0.0)  # stopped: nothing more is sampled
    finally:
        driver.release.set()
        sampler.stop()


def test_a_cuda_call_that_blocks_counts_as_waiting_and_never_holds_the_poll():
    driver = Driver(record_blocks=True)
    sampler = GpuSampler(0, driver)
    try:
        completed, wait = _poll_until(sampler, 5, lambda r: r[1] > 0.3, "a blocked record did not count")
        assert completed == 0 and not driver.recorded.is_set()
    finally:
        driver.release.set()
        sampler.stop()


def test_a_stream_being_captured_gets_no_event():
    driver = Driver(capturing=True)
    sampler = GpuSampler(0, driver)
    try:
        for _ in range(5):
            assert sampler.poll(2, STREAM) == (0, 0.0)
        assert "record" not in driver.calls
    finally:
        sampler.stop()


def test_a_sampler_that_cannot_use_cuda_reports_everything_complete():
    sampler = GpuSampler(0, Driver(broken=True))
    try:
        _poll_until(sampler, 4, lambda r: r == (4, 0.0), "a broken sampler still reported waits")
    finally:
        sampler.stop()
