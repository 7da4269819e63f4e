"""Hangs on NCCL (marker ``gpu``; run by scripts/gpu_check.sh on the device machine): two NCCL
ranks, a GPU each where there are two, else sharing one in NCCL's multi-rank mode (NCCL >= 2.30;
skipped, saying why, otherwise; see tests/support/gpus.py).

- A mismatch once at step 5 of an unpaced loop of 10,000 all_reduces, and of a short loop paced
  at one per 50 ms (GRIDCOMM_DEBUG=collectives): named on every rank within two heartbeat
  intervals (as tests/test_mismatch.py on the host backend).
- A stall with GRIDCOMM_TRACE_DIR: a file per rank with the NCCL backend's own entries (no debug
  flag), and ``gridcomm trace`` names the laggard and the collective it did not enter.
- A rank 40 ms slower per step (a host sleep before its all_reduce, GPU work between): its entry
  lag, measured from sampled GPU time inside collectives, is the largest, the coordinator's
  status names it, nobody is failed.
- One rank (any NCCL): the flight record's NCCL entries, GPU timing samples read through the CUDA
  driver, none recorded on a stream being captured into a graph, and a split child's own samples.

One OS process per rank, a coordinator in the test process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from gridcomm._cli.status import render
from gridcomm._client.client import fetch_status
from tests.support.gpus import ranks_on_gpus
from tests.support.procs import ROOT, RankProcesses, free_port, report, wait_for
from tests.test_alerts import scrape

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")

HB = 3.0
WORLD = 2


def _env(server, **extra: str) -> dict[str, str]:
    return {"GRIDCOMM_COORDINATOR": "external", "GRIDCOMM_HOST": "127.0.0.1", "GRIDCOMM_PORT": str(server.port),
            "GRIDCOMM_HEARTBEAT_TIMEOUT_S": f"{HB:g}", "NCCL_NVLS_ENABLE": "0", **extra}


MISMATCH = r"""
import json, os, time
import cupy
import gridcomm

rank = int(os.environ["GRIDCOMM_RANK"]); world = int(os.environ["GRIDCOMM_WORLD_SIZE"])
steps, pace = int(os.environ["STEPS"]), float(os.environ["PACE_S"])
comm = gridcomm.init_process_group(world, rank, backend="nccl", timeout_s=120)
x = cupy.ones(4, dtype=cupy.float32)
comm.all_reduce(x, x)   # collective #1
comm.barrier("warm")    # collective #2
at_mismatch, done = None, None
try:
    for step in range(steps):  # step s is collective #3 + s
        if step == 5:
            at_mismatch = time.monotonic()
        comm.all_reduce(x, x, op="max" if rank == 1 and step == 5 else "sum")
        if pace:
            cupy.cuda.get_current_stream().synchronize()
            time.sleep(pace)
    cupy.cuda.get_current_stream().synchronize()
    done = time.monotonic()
    for _ in range(600):
        comm.barrier("after")
        time.sleep(0.1)
    print("NO ERROR", flush=True)
except gridcomm.GridcommError as exc:
    print("OUTCOME", json.dumps({"kind": type(exc).__name__, "rank": getattr(exc, "rank", None),
                                 "after": time.monotonic() - at_mismatch,
                                 "loop_done": None if done is None else done - at_mismatch,
                                 "message": str(exc)}), flush=True)
comm.stop()
"""


def _outcome(stdout: str) -> dict:
    (line,) = [ln for ln in stdout.splitlines() if ln.startswith("OUTCOME ")]
    return json.loads(line.split(" ", 1)[1])


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("steps", "pace_s"), [(10_000, 0.0), (40, 0.05)], ids=["unpaced", "paced"])
def test_a_mismatch_at_step_5_is_named_on_every_nccl_rank(coordinator_factory, steps, pace_s):
    placed = ranks_on_gpus(WORLD)
    server = coordinator_factory(WORLD, heartbeat_timeout_s=HB, stall_timeout_s=100)
    env = _env(server, GRIDCOMM_DEBUG="collectives", STEPS=str(steps), PACE_S=str(pace_s))
    results = RankProcesses(MISMATCH, WORLD, env=env, per_rank_env=placed).wait(240)
    everything = report(results)
    for rank in range(WORLD):
        outcome = _outcome(results[rank].stdout)
        assert outcome["kind"] == "CollectiveMismatch" and outcome["rank"] == 1, everything
        message = outcome["message"]
        assert "collective #8 of communicator 'world'" in message, everything
        assert "rank 1 called all_reduce(max, 4 x float32)" in message, everything
        assert "rank 0 called all_reduce(sum, 4 x float32)" in message, everything
        assert outcome["after"] < 2 * HB + 5, everything
    print(f"\nNCCL, {'unpaced' if not pace_s else 'paced'}: named after "
          f"{max(_outcome(results[r].stdout)['after'] for r in range(WORLD)):.1f} s")


STALL = r"""
import os, time
import cupy
import gridcomm

rank = int(os.environ["GRIDCOMM_RANK"]); world = int(os.environ["GRIDCOMM_WORLD_SIZE"])
comm = gridcomm.init_process_group(world, rank, backend="nccl", timeout_s=120)
x = cupy.ones(16, dtype=cupy.float32)
stream = cupy.cuda.get_current_stream()
try:
    for step in range(50):  # step s: all_reduce #s+1
        if rank == 1 and step == 6:
            print("STUCK", os.getpid(), flush=True)
            time.sleep(25)  # a deadlock in user code
        comm.all_reduce(x, x, op="sum")
        stream.synchronize()  # rank 0 waits here, on the GPU, for rank 1's #7
        if step < 6:
            time.sleep(0.6)  # heartbeats (1 s apart) see the first collectives complete on the GPU
except Exception as exc:  # RankFailedError; or NCCL's error once the communicator was aborted
    print("FAILED", type(exc).__name__, flush=True)
comm.stop()
"""


@pytest.mark.timeout(300)
def test_an_nccl_stall_leaves_records_with_nccl_entries_and_trace_names_the_laggard(tmp_path, coordinator_factory):
    placed = ranks_on_gpus(WORLD)
    server = coordinator_factory(WORLD, heartbeat_timeout_s=HB, stall_timeout_s=5.0)
    trace_dir = tmp_path / "trace"
    results = RankProcesses(STALL, WORLD, env=_env(server, GRIDCOMM_TRACE_DIR=str(trace_dir)),
                            per_rank_env=placed).wait(240)
    everything = report(results)
    assert sorted(os.listdir(trace_dir)) == [f"rank-{r}.json" for r in range(WORLD)], everything
    records = {r: json.loads((trace_dir / f"rank-{r}.json").read_text()) for r in range(WORLD)}
    (stuck_pid,) = [int(line.split()[1]) for line in results[1].stdout.splitlines() if line.startswith("STUCK")]
    assert records[1]["pid"] == stuck_pid
    (world0,) = [c for c in records[0]["communicators"] if c["name"] == "world"]
    (world1,) = [c for c in records[1]["communicators"] if c["name"] == "world"]
    # The NCCL backend's own entries, without GRIDCOMM_DEBUG: rank 0 entered #7, rank 1 stopped at #6.
    assert world0["entered"] == 7 and world1["entered"] == 6, (world0, world1)
    assert [r["number"] for r in world0["records"]] == list(range(1, 8)), world0
    assert all(r["call"] == "all_reduce(op=sum, 16 x float32)" for r in world0["records"]), world0
    # The sampler saw the first collectives complete (synchronized, seconds apart), never #7.
    assert 1 <= world0["gpu_completed"] < 7, world0
    assert world0["records"][0]["complete_on_gpu"] is True and world0["records"][-1]["complete_on_gpu"] is False
    reason = server.state.failures[0].reason
    assert "rank 1 has not entered all_reduce #7" in reason, reason

    merged = subprocess.run([sys.executable, "-m", "gridcomm", "trace", str(trace_dir)], capture_output=True,
                            text=True, timeout=60, env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}, cwd=ROOT)
    assert merged.returncode == 0, merged.stdout + merged.stderr
    text = merged.stdout
    assert (f"BEHIND rank 1 (host {socket.gethostname()}, PID {stuck_pid}) has not entered "
            "#7 all_reduce(op=sum, 16 x float32); ranks 0 entered it") in text, text
    print("\n" + text)


STRAGGLER = r"""
import os, time
import cupy
import gridcomm

rank = int(os.environ["GRIDCOMM_RANK"]); world = int(os.environ["GRIDCOMM_WORLD_SIZE"])
comm = gridcomm.init_process_group(world, rank, backend="nccl", timeout_s=120)
a = cupy.random.random((2048, 2048), dtype=cupy.float32)
x = cupy.zeros(1024, dtype=cupy.float32)
stream = cupy.cuda.get_current_stream()
stop = os.environ["STOP_FILE"]
steps = 0
while steps < 3000:
    b = a @ a  # the step's GPU work
    time.sleep(0.01 + (0.04 if rank == int(os.environ["SLOW_RANK"]) else 0.0))  # the step's host work
    # The stop is agreed in the all_reduce itself: a rank that checked the file a moment after the
    # others would otherwise run one all_reduce more than they do while they wait in the barrier.
    x[0] = float(os.path.exists(stop))
    comm.all_reduce(x, x, op="max")
    stream.synchronize()
    steps += 1
    if float(x[0]) > 0:
        break
comm.barrier("end")
print("DONE", steps, flush=True)
comm.stop()
"""


@pytest.mark.timeout(300)
def test_an_nccl_rank_slower_per_step_is_named_a_straggler_from_gpu_time(tmp_path, coordinator_factory):
    placed = ranks_on_gpus(WORLD)
    slow = 1
    metrics = free_port()
    server = coordinator_factory(WORLD, heartbeat_timeout_s=HB, stall_timeout_s=10, metrics_port=metrics)
    stop = tmp_path / "stop"
    procs = RankProcesses(STRAGGLER, WORLD, env=_env(server, STOP_FILE=str(stop), SLOW_RANK=str(slow)),
                          per_rank_env=placed)
    try:
        reply = wait_for(lambda: (r := fetch_status("127.0.0.1", server.port, timeout_s=10)).stragglers and r,
                         "a straggler is listed", 150)
        lags = scrape(metrics)["gridcomm_rank_entry_lag_seconds"]
    finally:
        stop.write_text("")
    results = procs.wait(120)
    everything = report(results)
    assert [s.rank for s in reply.stragglers] == [slow], reply
    by_rank = {int(dict(labels)["rank"]): value for labels, value in lags.items()}
    assert max(by_rank, key=lambda r: by_rank[r]) == slow, by_rank
    assert 0.01 < by_rank[slow] < 0.5, by_rank
    text = "\n".join(render(reply))
    assert f"STRAGGLER rank {slow} enters collectives" in text, text
    for rank in range(WORLD):
        assert "DONE" in results[rank].stdout, everything  # nobody was failed
    assert not server.state.failures
    print(f"\nNCCL entry lags (sampled GPU time): { {r: round(v * 1000, 1) for r, v in sorted(by_rank.items())} } ms")


ONE_RANK = r"""
import json, os, time
import cupy
import gridcomm
from gridcomm._backends.nccl import timing
from gridcomm._client import flight

comm = gridcomm.init_process_group(1, 0, backend="nccl", timeout_s=120)
backend = comm._backend
x = cupy.ones(4, dtype=cupy.float32)
y = cupy.zeros(4, dtype=cupy.float32)
stream = cupy.cuda.get_current_stream()
for i in range(3 * timing.EVERY):
    comm.all_reduce(x, y, "sum")
    if i % 10 == 0:
        stream.synchronize()
comm.reduce(x, y, 0, "max")
comm.broadcast(x, 0)
comm.reduce_scatter(x, y, 4)
comm.all_gather(x, y, 4)
stream.synchronize()


def until(ok, timeout_s=30):
    deadline = time.monotonic() + timeout_s
    while not ok() and time.monotonic() < deadline:
        time.sleep(0.1)


until(lambda: backend._timer.samples >= 3 and backend.gpu_completed() >= comm._tracker.entered)
out = {"samples": backend._timer.samples, "sampled_s": backend._timer.sampled_s,
       "inside_s": comm._tracker.progress().inside_s, "record": flight.tracker_record(comm._tracker)}
capturing = cupy.cuda.Stream(non_blocking=True)
skipped = backend._timer.skipped
with capturing:
    comm.all_reduce(x, y)
    capturing.synchronize()
    capturing.begin_capture()
    for _ in range(2 * timing.EVERY):
        comm.all_reduce(x, y)
    graph = capturing.end_capture()
    graph.launch(capturing)
    capturing.synchronize()
out["capture_skipped"] = backend._timer.skipped - skipped
out["after_graph"] = float(y[0].get())
child = comm.split(0)
for _ in range(2 * timing.EVERY):
    child.all_reduce(x, y)
stream.synchronize()
until(lambda: child._backend._timer.samples >= 2)
out["child_samples"] = child._backend._timer.samples
out["child_entries"] = len(child._tracker.record or ())
comm.stop()
print("RESULT", json.dumps(out), flush=True)
"""


@pytest.mark.timeout(300)
def test_one_rank_records_nccl_entries_and_reads_gpu_time():
    placed = ranks_on_gpus(1)
    env = {"GRIDCOMM_BIND": "127.0.0.1", "GRIDCOMM_PORT": str(free_port()), "GRIDCOMM_HEARTBEAT_TIMEOUT_S": "3",
           "NCCL_NVLS_ENABLE": "0"}
    results = RankProcesses(ONE_RANK, 1, env=env, per_rank_env=placed).wait(240)
    everything = report(results)
    (line,) = [ln for ln in results[0].stdout.splitlines() if ln.startswith("RESULT ")] or [""]
    assert line, everything
    out = json.loads(line.split(" ", 1)[1])
    # Every 64th collective timed, read through cuEventElapsedTime on the sampler's thread.
    assert out["samples"] >= 3 and out["sampled_s"] > 0 and out["inside_s"] > 0, out
    record = out["record"]
    calls = [r["call"] for r in record["records"]]
    assert calls[-5:] == ["all_reduce(op=sum, 4 x float32)", "reduce(root=0, op=max, 4 x float32)",
                          "broadcast(root=0, 4 x float32)", "reduce_scatter(count=4, op=sum, 4 x float32)",
                          "all_gather(count=4, 4 x float32)"], calls[-5:]
    assert record["gpu_completed"] == record["entered"] >= 3 * 64 + 4, record
    assert all(r["complete_on_gpu"] for r in record["records"]), record
    # The captured calls took no events (two of them were due), and the graph ran.
    assert out["capture_skipped"] == 2 and out["after_graph"] == 1.0, out
    assert out["child_samples"] >= 2 and out["child_entries"] >= 2 * 64, out
