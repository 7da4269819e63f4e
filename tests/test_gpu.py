"""GPU-only checks (marker ``gpu``), run on the device machine: see the README's GPU command.

One GPU: world size 1, plus 2-rank NCCL inits whose peer never arrives (they must end in an error,
aborted, within the deadline). Two ranks (``multi_gpu``: a GPU each, or both on one GPU in NCCL's
multi-rank mode with NCCL >= 2.30, skipped otherwise): conformance at world size 2, a peer killed
inside an NCCL all_reduce, and recovery in place (``rebuild()`` with a replacement process,
``shrink()`` to the survivor). tests/test_gpu_ranks.py runs more ranks on one GPU.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import pytest

from tests.support.gpus import ranks_on_gpus
from tests.support.procs import ROOT, WORKER, RankProcesses, report

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
def test_nccl_collectives_are_counted_for_the_heartbeats(comm):
    x = cupy.ones(4, dtype=cupy.float32)
    y = cupy.empty_like(x)
    before = comm._client.progress()[0].entered
    for _ in range(5):
        comm.all_reduce(x, y)
    comm.broadcast(y, root=0)
    comm.all_gather(x, cupy.empty(4, dtype=cupy.float32), 4)
    comm.send_recv(x, y, 0)  # pairs make send/recv: not counted
    comm.barrier("counted")
    report = comm._client.progress()[0]
    assert report.communicator == "world" and report.entered - before == 8 and report.kind == "barrier"


@pytest.mark.timeout(120)
def test_gpu_completion_is_sampled_from_another_thread_and_never_into_a_capture(comm):
    x = cupy.ones(1024, dtype=cupy.float32)
    y = cupy.empty_like(x)
    tracker = comm._tracker
    samples = []

    def sample():  # as the watcher does, on its own thread
        thread = threading.Thread(target=lambda: samples.append(tracker.progress()))
        thread.start()
        thread.join(10)
        return samples[-1]

    def settled(entered):  # a sample asks the sampler's thread for a fresh look: it answers a look later
        deadline = time.monotonic() + 10
        while (latest := sample()).completed < entered and time.monotonic() < deadline:
            time.sleep(0.01)
        return latest

    for _ in range(5):
        comm.all_reduce(x, y)
    pending = sample()  # records a CUDA event after the 5th
    cupy.cuda.Device().synchronize()
    done = settled(5)  # finds it complete
    assert done.completed == done.entered >= 5 and done.gpu_wait_s == 0, (pending, done)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        comm.all_reduce(x, y)
        stream.synchronize()
        stream.begin_capture()
        comm.all_reduce(x, y)
        during = sample()  # the stream is being captured: no event is recorded into the graph
        graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    assert during.gpu_wait_s == 0
    after = sample()
    cupy.cuda.Device().synchronize()
    assert settled(after.entered).completed == after.entered


@pytest.mark.timeout(120)
def test_a_sample_pending_while_another_stream_is_captured_leaves_the_capture_intact(comm):
    try:
        spin = cupy.RawKernel(r'''extern "C" __global__ void spin(long long cycles) {
            long long start = clock64(); while (clock64() - start < cycles) {} }''', "spin")
        spin.compile()
    except Exception as exc:  # noqa: BLE001 - no NVRTC on this machine
        pytest.skip(f"cannot compile a kernel here: {exc}")
    x = cupy.ones(1024, dtype=cupy.float32)
    y = cupy.empty_like(x)
    busy = cupy.cuda.Stream(non_blocking=True)
    captured = cupy.cuda.Stream(non_blocking=True)
    results = []

    def sample():
        thread = threading.Thread(target=lambda: results.append(comm._tracker.progress()))
        thread.start()
        thread.join(10)
        return results[-1]

    with busy:
        spin((1,), (1,), (cupy.int64(3_000_000_000),))  # about a second of GPU time
        comm.all_reduce(x, y)
    sample()  # an event after the spin: pending for a while
    with captured:
        comm.all_reduce(x, y)
        captured.synchronize()
        captured.begin_capture()  # CuPy's default: global capture mode
        z = cupy.empty_like(x)
        comm.all_reduce(x, z)
        waiting = sample()  # queries the pending event while the capture runs
        graph = captured.end_capture()  # raises if the query invalidated the capture
    assert waiting.gpu_wait_s > 0, waiting
    graph.launch(captured)
    captured.synchronize()
    assert bool((z == 1).all())


@pytest.mark.timeout(120)
def test_fast_paths_refuse_what_the_shared_checks_refuse(comm):
    """all_reduce, broadcast, all_gather, send, recv and send_recv skip the shared checks for plain
    C-contiguous CuPy arrays; what they must not skip: every invalid call below still raises the
    shared ArgumentError and reaches the on_invalid hook (which fails the rank), and valid calls
    that miss the fast path (F-order arrays, NumPy integers, a send_recv with itself) still work."""
    import numpy

    import gridcomm

    backend = comm._backend
    seen: list[Exception] = []
    hook, backend.on_invalid = backend.on_invalid, seen.append
    x = cupy.arange(4, dtype=cupy.float32)
    wide = cupy.zeros((4, 4), dtype=cupy.float32)
    bad = [
        (lambda: comm.broadcast(x, root=True), "root=True must be an integer rank"),
        (lambda: comm.broadcast(x, root=1), "root=1 is out of range"),
        (lambda: comm.broadcast(x, root=-1), "root=-1 is out of range"),
        (lambda: comm.broadcast(wide[:, 1]), "not contiguous"),
        (lambda: comm.broadcast(cupy.zeros(4, dtype=cupy.int16)), "int16"),
        (lambda: comm.all_gather(x, cupy.zeros(4, dtype=cupy.float32), -1), "count=-1"),
        (lambda: comm.all_gather(x, cupy.zeros(4, dtype=cupy.float32), True), "count=True"),
        (lambda: comm.all_gather(x, cupy.zeros(5, dtype=cupy.float32), 4), "count x world size"),
        (lambda: comm.all_gather(x, cupy.zeros(4, dtype=cupy.float64), 4), "dtype float64"),
        (lambda: comm.all_gather(x, wide[:, 1], 4), "not contiguous"),
        (lambda: comm.send(x, 0), "is this rank itself"),
        (lambda: comm.recv(x, 1), "out of range"),
        (lambda: comm.send(wide[:, 1], 0), "not contiguous"),
        (lambda: comm.send_recv(x, wide[:, 1], 0), "not contiguous"),
        (lambda: comm.send_recv(x, x, 1), "out of range"),
        (lambda: comm.send_recv(x, x, False), "must be an integer rank"),
        (lambda: comm.send_recv(x, cupy.zeros(4, dtype=cupy.int16), 0), "int16"),
        (lambda: comm.all_reduce(x, cupy.zeros(4, dtype=cupy.float64)), "dtype float64"),
    ]
    try:
        for i, (call, words) in enumerate(bad):
            with pytest.raises(gridcomm.ArgumentError, match=words):
                call()
            assert len(seen) == i + 1, f"on_invalid not called for the case expecting {words!r}"
        f_order = cupy.asfortranarray(cupy.arange(6, dtype=cupy.float32).reshape(2, 3))
        out = cupy.zeros_like(f_order)
        comm.all_reduce(f_order, out)
        comm.broadcast(f_order, root=numpy.int64(0))
        gathered = cupy.zeros(4, dtype=cupy.float32)
        comm.all_gather(x, gathered, numpy.int64(4))
        got = cupy.zeros(4, dtype=cupy.float32)
        comm.send_recv(x, got, 0)
        cupy.cuda.get_current_stream().synchronize()
        assert bool((out == f_order).all()) and bool((gathered == x).all()) and bool((got == x).all())
        assert len(seen) == len(bad)
    finally:
        backend.on_invalid = hook


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


TEMPORARY_STREAMS = """
import os, sys, time, socket
import cupy
from cupy.cuda import nccl
import gridcomm

sock = socket.socket(); sock.bind(("127.0.0.1", 0)); port = sock.getsockname()[1]; sock.close()
g = gridcomm.init_process_group(1, 0, backend="nccl", host="127.0.0.1", port=port)
x = cupy.ones(1, dtype=cupy.float32)
for i in range(int(sys.argv[1])):
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        g.all_reduce(x, x)
    s.synchronize()
    del s  # the stream of the last collective is gone before the next heartbeat samples it
    for _ in range(5):  # streams come and go meanwhile, and an NCCL communicator (~0.5 s each)
        t = cupy.cuda.Stream(non_blocking=True)
        del t
    c = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    c.destroy()
    time.sleep(0.3)
assert float(x.get()[0]) == 1.0
g.stop()
print("TEMPORARY STREAMS OK", flush=True)
"""


@pytest.mark.timeout(120)
def test_a_collective_on_a_temporary_stream_leaves_the_heartbeat_sample_safe():
    """A collective's stream that its owner destroys right after: the watcher's GPU progress
    sample (a CUDA event on that stream, at the next heartbeat, once a second here) must not
    touch the destroyed stream. It did: the process died of SIGSEGV in the sample within a few
    heartbeats in every run before the counter held the stream object (4 of 4: 2 with 30 rounds of 5 NCCL communicators each, 2 of this test)."""
    result = subprocess.run([sys.executable, "-X", "faulthandler", "-c", TEMPORARY_STREAMS, "16"],
                            capture_output=True, text=True, timeout=100,
                            env={**ENV, "GRIDCOMM_HEARTBEAT_TIMEOUT_S": "3"})
    assert result.returncode == 0 and "TEMPORARY STREAMS OK" in result.stdout, \
        f"rc {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"


@pytest.mark.multi_gpu
@pytest.mark.timeout(600)
def test_nccl_conformance_two_gpus():
    placed = ranks_on_gpus(2)  # one GPU: both on it in NCCL's multi-rank mode (NCCL >= 2.30)
    from tests.support.procs import free_port

    env = {"BACKEND": "nccl", "GRIDCOMM_PORT": str(free_port()), "GRIDCOMM_BIND": "127.0.0.1",
           "GRIDCOMM_TIMEOUT_S": "120"}
    results = RankProcesses(WORKER, 2, env=env, per_rank_env=placed).wait(560)
    for rank in (0, 1):
        match = re.search(r"SUMMARY passed=(\d+) failed=(\d+)", results[rank].stdout)
        assert match and results[rank].returncode == 0, report(results)
        print(f"NCCL conformance at world size 2, rank {rank}: passed={match.group(1)} failed={match.group(2)}")
        assert int(match.group(2)) == 0 and int(match.group(1)) > 150


@pytest.mark.multi_gpu
@pytest.mark.timeout(180)
def test_peer_killed_inside_an_nccl_collective_aborts_the_survivor():
    placed = ranks_on_gpus(2)
    from tests.support.procs import free_port

    code = """
import os, sys, time, cupy, gridcomm
rank = int(os.environ["GRIDCOMM_RANK"])
comm = gridcomm.init_process_group(2, rank, backend="nccl")
x = cupy.ones(1 << 20, dtype=cupy.float32)
comm.all_reduce(x, x); cupy.cuda.get_current_stream().synchronize()
comm.barrier("warm")
if rank == 1:
    os.kill(os.getpid(), 9)
t0 = time.monotonic()
try:
    for _ in range(1000000):
        comm.all_reduce(x, x)   # rank 1 never joins: without an abort this spins forever
        cupy.cuda.get_current_stream().synchronize()
except Exception as exc:
    print(f"OUTCOME {type(exc).__name__} rank={getattr(exc, 'rank', '')} after={time.monotonic() - t0:.2f} {exc}",
          flush=True)
    os._exit(0)
print("NO FAILURE", flush=True)
"""
    env = {"GRIDCOMM_PORT": str(free_port()), "GRIDCOMM_BIND": "127.0.0.1", "GRIDCOMM_HEARTBEAT_TIMEOUT_S": "4",
           "GRIDCOMM_TIMEOUT_S": "60"}
    results = RankProcesses(code, 2, env=env, per_rank_env=placed).wait(120)
    out = results[0].stdout
    print(out)
    assert "OUTCOME" in out, report(results)
    after = float(out.split("after=")[1].split()[0])
    assert after < 4 + 5, after


# ---------------------------------------------------------------------- NCCL init that cannot hang
ABSENT_PEER = """
import os, time, gridcomm
rank = int(os.environ["GRIDCOMM_RANK"])
client = gridcomm.CoordinatorClient("127.0.0.1", int(os.environ["PORT"]), rank, 2, timeout_s=60)
client.join()
time.sleep(float(os.environ["STAY_S"]))   # joined, but never calls NCCL init
client.leave()
"""


def _needs_nccl4py() -> None:
    from gridcomm._backends import nccl as _nccl

    if _nccl.engine() != "nccl4py":
        pytest.skip("needs nccl4py: CuPy's ncclCommInitRank cannot be aborted (it blocks until the peer comes)")


def _rank0_beside_an_absent_peer(coordinator_factory, stay_s: float):
    """A 2-rank coordinator, rank 1 a process that joins and never calls NCCL init, rank 0's
    joined client here: what _nccl.connect (the communicator's own path) gets as ``client``."""
    import gridcomm

    server = coordinator_factory(2)
    peer = RankProcesses(ABSENT_PEER, 2, ranks=[1], env={"PORT": str(server.port), "STAY_S": str(stay_s)})
    client = gridcomm.CoordinatorClient("127.0.0.1", server.port, 0, 2, timeout_s=60)
    client.join()
    return client, peer


@pytest.mark.timeout(120)
def test_nccl_init_whose_peer_never_arrives_ends_at_the_deadline_aborted(coordinator_factory):
    """Rank 0 of 2 publishes the unique ID and starts NCCL init; rank 1 never does. With a 3 s
    deadline the init is aborted and RendezvousTimeout raised, within the deadline plus 2 s; the
    GPU then builds a new communicator (nothing was left spinning)."""
    _needs_nccl4py()
    import gridcomm
    from gridcomm._backends import nccl as _nccl

    client, peer = _rank0_beside_an_absent_peer(coordinator_factory, 20)
    with peer:
        t0 = time.monotonic()
        with pytest.raises(gridcomm.RendezvousTimeout, match=r"did not complete within .* aborted \(ncclCommAbort\)"):
            _nccl.connect(client, "world", 0, 2, timeout_s=3.0)
        took = time.monotonic() - t0
        print(f"absent peer: NCCL init ended in RendezvousTimeout after {took:.2f} s (deadline 3.0 s)")
        assert took < 3.0 + 2.0, took
        solo = _nccl.NcclBackend(1, 0, _nccl.new_unique_id())
        x = cupy.arange(8, dtype=cupy.float32)
        y = cupy.zeros_like(x)
        solo.all_reduce(x, y)
        solo.synchronize()
        assert bool((y == x).all())
        solo.destroy()
        client.leave()


@pytest.mark.timeout(120)
def test_nccl_init_is_aborted_as_soon_as_a_peer_is_reported_failed(coordinator_factory):
    """The same absent peer, a 60 s deadline, and a watcher that reports rank 1 failed 1 s into
    the init: connect raises that RankFailedError at once, not at the deadline."""
    _needs_nccl4py()
    import gridcomm
    from gridcomm._backends import nccl as _nccl

    client, peer = _rank0_beside_an_absent_peer(coordinator_factory, 20)
    with peer:
        error = gridcomm.RankFailedError("rank 1 failed: test watcher", rank=1, reason="test")
        t0 = time.monotonic()
        with pytest.raises(gridcomm.RankFailedError, match="test watcher") as caught:
            _nccl.connect(client, "world", 0, 2, timeout_s=60.0,
                          failed=lambda: error if time.monotonic() - t0 > 1.0 else None)
        took = time.monotonic() - t0
        print(f"failed() during NCCL init: RankFailedError after {took:.2f} s (reported at 1.0 s)")
        assert caught.value is error and took < 1.0 + 1.5, took
        client.leave()


def _first_calls():
    """(name, call, check) for every kind of call, each made as a communicator's first."""
    x = cupy.arange(1, 9, dtype=cupy.float32)
    out = cupy.zeros_like(x)
    rows = cupy.arange(1, 9, dtype=cupy.float32).reshape(1, 8)
    row_out = cupy.zeros_like(rows)
    return [
        ("all_reduce", lambda b: b.all_reduce(x, out), lambda: out),
        ("reduce", lambda b: b.reduce(x, out, 0), lambda: out),
        ("broadcast", lambda b: (out.__setitem__(slice(None), x), b.broadcast(out, 0)), lambda: out),
        ("reduce_scatter", lambda b: b.reduce_scatter(x, out, 8), lambda: out),
        ("all_gather", lambda b: b.all_gather(x, out, 8), lambda: out),
        ("send_recv", lambda b: b.send_recv(x, out, 0), lambda: out),
        ("scatter", lambda b: b.scatter(rows, out, 0), lambda: out),
        ("gather", lambda b: b.gather(x, row_out, 0), lambda: row_out.ravel()),
        ("all_to_all", lambda b: b.all_to_all(rows, row_out), lambda: row_out.ravel()),
    ], x, out, row_out


@pytest.mark.timeout(120)
def test_every_kind_of_call_works_as_the_first_call_while_the_split_finishes():
    """nccl4py: init returns once the non-blocking parent is up, and the split to the blocking
    child finishes in the background; whatever call comes first (a single collective, or a
    group of sends and receives) waits for it and gives the right result, and afterwards the
    per-call functions are NCCL's own again (no check left on the fast path)."""
    _needs_nccl4py()
    from gridcomm._backends import nccl as _nccl

    calls, x, out, row_out = _first_calls()
    pending = 0
    for name, call, result in calls:
        out.fill(0)
        row_out.fill(0)
        backend = _nccl.NcclBackend(1, 0, _nccl.new_unique_id())
        pending += not backend._owner.ready_now
        call(backend)
        backend.synchronize()
        assert bool((result() == x).all()), (name, result())
        eng = backend._engine
        assert backend._nccl_all_reduce is eng.all_reduce and backend._nccl_send is eng.send, name
        assert backend._group_start is eng.group_start and backend._c is backend._owner._comm, name
        assert backend.ready() is backend._c, name
        backend.destroy()
    print(f"{pending} of {len(calls)} first calls found the split still under way")
    assert pending > 0, "no first call met an unfinished split: the deferred path was not exercised"


@pytest.mark.timeout(120)
def test_abort_or_destroy_before_the_first_call_ends_at_once_and_frees_the_gpu():
    """A communicator aborted (a peer's failure, seen by the watcher) or destroyed before its
    first call: abort returns within a second and a later call raises GridcommError instead of
    waiting or touching freed memory; destroy waits for the split and frees both communicators;
    a new communicator then works."""
    _needs_nccl4py()
    import gridcomm
    from gridcomm._backends import nccl as _nccl

    x = cupy.arange(8, dtype=cupy.float32)
    y = cupy.zeros_like(x)
    for _ in range(3):
        backend = _nccl.NcclBackend(1, 0, _nccl.new_unique_id())
        t0 = time.monotonic()
        backend.abort()
        took = time.monotonic() - t0
        with pytest.raises(gridcomm.GridcommError, match="aborted"):
            backend.all_reduce(x, y)
        with pytest.raises(gridcomm.GridcommError, match="aborted"):
            backend.send_recv(x, y, 0)
        backend.destroy()
        assert took < 5.0, took
        backend = _nccl.NcclBackend(1, 0, _nccl.new_unique_id())
        t0 = time.monotonic()
        backend.destroy()
        print(f"abort before the first call {took:.3f} s; destroy {time.monotonic() - t0:.3f} s")
    solo = _nccl.NcclBackend(1, 0, _nccl.new_unique_id())
    solo.all_reduce(x, y)
    solo.synchronize()
    assert bool((y == x).all())
    solo.destroy()


# ---------------------------------------------------------------------- recovery in place (2 GPUs)
RECOVERY = """
import os, sys, time, cupy, gridcomm
rank = int(os.environ["GRIDCOMM_RANK"])
mode, replacement = os.environ["MODE"], os.environ.get("REPLACEMENT") == "1"
sync = cupy.cuda.get_current_stream().synchronize


def checked_steps(comm, n):
    x = cupy.empty(1 << 16, dtype=cupy.float32)
    for i in range(n):
        x.fill((comm.members[comm.rank] + 1) * (i + 1))
        comm.all_reduce(x, x)
        sync()
        want = sum(m + 1 for m in comm.members) * (i + 1)
        got = float(x[0])
        assert got == want and bool((x == want).all()), (i, got, want)


comm = gridcomm.init_process_group(2, rank, backend="nccl", timeout_s=120)
print(f"START rank={rank} generation={comm.generation} replacement={replacement}", flush=True)
if not replacement:
    checked_steps(comm, 5)
    comm.barrier("warm")
    t_dead = None
    try:
        for i in range(1000000):
            if rank == 1 and i == 50:
                os.kill(os.getpid(), 9)   # dies inside the loop
            checked_steps(comm, 1)
        print("NO FAILURE", flush=True)
        sys.exit(1)
    except gridcomm.RankFailedError as exc:
        t_dead = time.monotonic()
        print(f"FAILED rank={exc.rank} {exc}", flush=True)
    comm = comm.rebuild(timeout_s=120) if mode == "rebuild" else comm.shrink(timeout_s=120)
    print(f"RECOVERED {mode} in {time.monotonic() - t_dead:.2f} s", flush=True)
checked_steps(comm, 20)
print(f"DONE rank={comm.rank} world={comm.world_size} members={tuple(comm.members)} "
      f"generation={comm.generation}", flush=True)
comm.stop()
"""


def _recovery(mode: str) -> dict:
    import gridcomm
    from tests.support.procs import wait_for

    server = gridcomm.Coordinator(2, bind="127.0.0.1", port=0).start()
    env = {"GRIDCOMM_COORDINATOR": "external", "GRIDCOMM_HOST": "127.0.0.1", "GRIDCOMM_PORT": str(server.port),
           "GRIDCOMM_HEARTBEAT_TIMEOUT_S": "4", "GRIDCOMM_TIMEOUT_S": "120", "MODE": mode}
    gpus = ranks_on_gpus(2)
    try:
        first = RankProcesses(RECOVERY, 2, env=env, per_rank_env=gpus)
        replacement = None
        try:
            wait_for(lambda: first.procs[1].poll() is not None, "rank 1 killed itself", 120)
            if mode == "rebuild":
                replacement = RankProcesses(RECOVERY, 2, ranks=[1], env=dict(env, REPLACEMENT="1"), per_rank_env=gpus)
            results = first.wait(240)
            if replacement is not None:
                results[1] = replacement.wait(60)[1]
        finally:
            first.close()
            if replacement is not None:
                replacement.close()
    finally:
        server.stop()
    print(report(results))
    return results


@pytest.mark.multi_gpu
@pytest.mark.timeout(400)
def test_rank_killed_in_an_nccl_loop_is_replaced_and_the_survivor_rebuilds():
    results = _recovery("rebuild")
    out0, out1 = results[0].stdout, results[1].stdout
    assert results[0].returncode == 0 and results[1].returncode == 0, report(results)
    assert "FAILED rank=1" in out0 and "RECOVERED rebuild" in out0, report(results)
    assert "START rank=1 generation=1 replacement=True" in out1, report(results)
    for out, rank in ((out0, 0), (out1, 1)):
        assert f"DONE rank={rank} world=2 members=(0, 1) generation=1" in out, report(results)


@pytest.mark.multi_gpu
@pytest.mark.timeout(400)
def test_rank_killed_in_an_nccl_loop_the_survivor_shrinks_to_one():
    results = _recovery("shrink")
    out0 = results[0].stdout
    assert results[0].returncode == 0, report(results)
    assert "FAILED rank=1" in out0 and "RECOVERED shrink" in out0, report(results)
    assert "DONE rank=0 world=1 members=(0,) generation=1" in out0, report(results)
