"""Several NCCL ranks on one GPU (marker ``gpu``; run by scripts/gpu_check.sh on the device
machine): with fewer GPUs than ranks they share GPUs in NCCL's multi-rank mode (NCCL >= 2.30,
skipped, saying why, with an older NCCL). Conformance at world size 2 and 4 with both engines,
stop() after graph capture, the ConfigError of a shared GPU without the mode, a GPU hang named
while the control plane keeps answering, and the demo's 4 ranks on NCCL."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.support.gpus import ranks_on_gpus
from tests.support.procs import ROOT, WORKER, RankProcesses, free_port, report

pytestmark = pytest.mark.gpu

cupy = pytest.importorskip("cupy")

ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), GRIDCOMM_TIMEOUT_S="120")


def _env(**extra: str) -> dict[str, str]:
    return {"GRIDCOMM_PORT": str(free_port()), "GRIDCOMM_BIND": "127.0.0.1", "GRIDCOMM_TIMEOUT_S": "120", **extra}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("engine", ["auto", "cupy"])
@pytest.mark.parametrize("world", [2, 4])
def test_conformance_with_ranks_sharing_gpus(world, engine):
    placed = ranks_on_gpus(world)
    results = RankProcesses(WORKER, world, env=_env(BACKEND="nccl", GRIDCOMM_NCCL_ENGINE=engine),
                            per_rank_env=placed).wait(560)
    for rank in range(world):
        match = re.search(r"SUMMARY passed=(\d+) failed=(\d+)", results[rank].stdout)
        assert match and results[rank].returncode == 0, report(results)
        print(f"NCCL conformance, world size {world}, engine {engine}, rank {rank}: passed={match.group(1)} "
              f"failed={match.group(2)}")
        assert int(match.group(2)) == 0 and int(match.group(1)) > 150


GRAPH_THEN_STOP = """
import os, time, cupy, gridcomm
rank, world = int(os.environ["GRIDCOMM_RANK"]), int(os.environ["GRIDCOMM_WORLD_SIZE"])
comm = gridcomm.init_process_group(world, rank, backend="nccl")
stream = cupy.cuda.Stream(non_blocking=True)
x = cupy.full(1024, rank + 1, dtype=cupy.float32)
y = cupy.empty_like(x)
with stream:
    comm.all_reduce(x, y)
    stream.synchronize()
    stream.begin_capture()
    for _ in range(4):
        comm.all_reduce(x, y)
    graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
assert float(y[0].get()) == world * (world + 1) / 2
t0 = time.monotonic()
comm.stop()   # the graph is still alive: NCCL's destroy may wait for it; stop() must not
print(f"STOPPED rank={rank} after={time.monotonic() - t0:.2f}", flush=True)
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_stop_returns_while_a_captured_graph_is_alive(world):
    placed = ranks_on_gpus(world)
    results = RankProcesses(GRAPH_THEN_STOP, world, env=_env(), per_rank_env=placed).wait(240)
    for rank in range(world):
        assert results[rank].returncode == 0 and f"STOPPED rank={rank}" in results[rank].stdout, report(results)


SHARED_WITHOUT_MODE = """
import os, gridcomm
rank = int(os.environ["GRIDCOMM_RANK"])
try:
    comm = gridcomm.init_process_group(2, rank, backend="nccl")
except gridcomm.GridcommError as exc:
    print(f"OUTCOME {type(exc).__name__} {exc}", flush=True)
    os._exit(0)
comm.stop()
print("NO ERROR", flush=True)
"""


@pytest.mark.timeout(300)
def test_two_ranks_on_one_gpu_without_the_mode_get_a_config_error_not_a_hang():
    placed = {r: {"CUDA_VISIBLE_DEVICES": "0", "NCCL_MULTI_RANK_GPU_ENABLE": "0"} for r in range(2)}
    results = RankProcesses(SHARED_WITHOUT_MODE, 2, env=_env(GRIDCOMM_TIMEOUT_S="60", GRIDCOMM_HEARTBEAT_TIMEOUT_S="5"),
                            per_rank_env=placed).wait(240)
    outs = [results[r].stdout for r in range(2)]
    assert all("OUTCOME" in out for out in outs), report(results)
    assert any("OUTCOME ConfigError" in out and "NCCL_MULTI_RANK_GPU_ENABLE=1" in out for out in outs), report(results)


GPU_HANG = """
import os, threading, time, cupy, gridcomm
comm = gridcomm.init_process_group(1, 0, backend="nccl")
spin = cupy.RawKernel(r'''extern "C" __global__ void spin(long long cycles) {
    long long start = clock64(); while (clock64() - start < cycles) {} }''', "spin")
x = cupy.ones(1024, dtype=cupy.float32)
comm.all_reduce(x, x); cupy.cuda.get_current_stream().synchronize()
spin((1,), (1,), (cupy.int64(int(os.environ["SPIN_CYCLES"])),))  # the GPU is busy for ~a minute
comm.all_reduce(x, x)            # enqueued behind it
t0 = time.monotonic()
answered = []
def barriers():
    for i in range(60):
        try:
            comm.barrier(f"b{i}", timeout_s=5)
            answered.append(time.monotonic() - t0)
        except gridcomm.GridcommError as exc:
            print(f"OUTCOME {type(exc).__name__} after={time.monotonic() - t0:.1f} {exc}", flush=True)
            os._exit(0)
        time.sleep(1)
threading.Thread(target=barriers, daemon=True).start()
cupy.cuda.get_current_stream().synchronize()   # the main thread waits in CUDA meanwhile
print(f"NO FAILURE answered={len(answered)}", flush=True)
os._exit(0)
"""


@pytest.mark.timeout(300)
def test_a_gpu_hang_is_named_while_the_control_plane_keeps_answering():
    ranks_on_gpus(1)
    clock = int(cupy.cuda.Device().attributes.get("ClockRate") or 2_000_000) * 1000  # kHz -> cycles per second
    env = _env(GRIDCOMM_STALL_TIMEOUT_S="10", GRIDCOMM_HEARTBEAT_TIMEOUT_S="15", SPIN_CYCLES=str(clock * 90))
    results = RankProcesses(GPU_HANG, 1, env=env).wait(240)
    out = results[0].stdout
    assert "OUTCOME" in out, report(results)
    after = float(out.split("after=")[1].split()[0])
    assert "GPU" in out and "has not completed collective" in out and "sent no heartbeat" not in out, report(results)
    assert after < 10 + 15, report(results)


@pytest.mark.timeout(300)
def test_the_demo_runs_its_four_ranks_on_nccl():
    ranks_on_gpus(4)
    result = subprocess.run([sys.executable, "-m", "gridcomm", "demo", "--nproc", "4"],
                            capture_output=True, text=True, timeout=280, env=ENV)
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "backend nccl" in result.stdout and "all checks passed" in result.stdout
