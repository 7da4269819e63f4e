"""GPU-only checks (marker ``gpu``), run on the device machine: see the README's GPU command.

World size 1 here: NCCL refuses two ranks on one GPU, and multi-GPU machines are not lent now.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")

ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), GRIDCOMM_TIMEOUT_S="60")


@pytest.fixture
def comm(monkeypatch):
    import socket

    import gridcomm

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("GRIDCOMM_BIND", "127.0.0.1")
    c = gridcomm.init_process_group(1, 0, backend="nccl", port=port, timeout_s=60)
    yield c
    c.stop()


@pytest.mark.timeout(120)
def test_graph_capture_and_replay(comm):
    stream = cupy.cuda.Stream(non_blocking=True)
    x = cupy.arange(16, dtype=cupy.float32)
    y = cupy.zeros_like(x)
    z = cupy.zeros_like(x)
    with stream:
        comm.all_reduce(x, y, op="sum")  # warm up outside capture (NCCL connects lazily)
        stream.synchronize()
        stream.begin_capture()
        for _ in range(10):
            comm.all_reduce(x, y, op="sum")
            comm.all_reduce(y, z, op="max")
            comm.broadcast(z, root=0)
        graph = stream.end_capture()
    x += 1
    graph.launch(stream)
    stream.synchronize()
    # The graph read x after the update: replay uses the captured pointers, not old values.
    assert bool((z == cupy.arange(16, dtype=cupy.float32) + 1).all())


@pytest.mark.timeout(120)
def test_abort_from_a_watcher_thread_releases_a_collective_loop(comm):
    import gridcomm

    x = cupy.ones(1 << 20, dtype=cupy.float32)
    stream = cupy.cuda.get_current_stream()
    errors: list[BaseException] = []
    calls = [0]
    started = threading.Event()

    def loop() -> None:
        try:
            while True:
                comm.all_reduce(x, x, op="sum")
                stream.synchronize()  # where a real rank waits while a collective spins
                calls[0] += 1
                started.set()
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            errors.append(exc)

    worker = threading.Thread(target=loop, daemon=True)
    worker.start()
    assert started.wait(30)
    t0 = time.monotonic()
    comm.abort("test: watcher aborts the communicator")
    worker.join(30)
    assert not worker.is_alive(), "the collective loop did not end after abort()"
    assert isinstance(errors[0], gridcomm.CommAborted), errors
    print(f"abort released the loop after {calls[0]} calls in {time.monotonic() - t0:.3f} s")


@pytest.mark.timeout(120)
def test_cupyx_style_program_on_nccl():
    program = os.path.join(ROOT, "examples", "cupyx_style.py")
    result = subprocess.run([sys.executable, "-m", "gridcomm", "launch", "--nproc", "1", "--backend", "nccl",
                             program], capture_output=True, text=True, timeout=100, env=ENV)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[rank 0] rank 0: cupyx-style program ok" in result.stdout


@pytest.mark.timeout(180)
def test_demo_on_nccl():
    result = subprocess.run([sys.executable, "-m", "gridcomm", "demo", "--nproc", "1", "--backend", "nccl"],
                            capture_output=True, text=True, timeout=170, env=ENV)
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all checks passed" in result.stdout
