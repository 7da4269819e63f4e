"""What an operator reads: waits that speak, clean exits, hints that are true, and
`gridcomm status --watch`. Real processes, no logging configured unless a test says so."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

import gridcomm
from tests.support.procs import ROOT, RankProcesses, report
from tests.support.ranks import free_port, serving

ENV = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
ENV.pop("GRIDCOMM_TOKEN", None)


def run_py(code: str, env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s,
                          env={**ENV, **env})


def cli(*args: str, timeout_s: float = 60, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gridcomm", *args], capture_output=True, text=True,
                          timeout=timeout_s, env={**ENV, **(env or {})})


# --- waits that speak ------------------------------------------------------------------------------

ALONE = """
import gridcomm
try:
    gridcomm.init_process_group(2, 0, backend="host", port={port})
except gridcomm.GridcommError as exc:
    print("ERROR", type(exc).__name__, exc)
"""

NO_COORDINATOR = """
import gridcomm
try:
    gridcomm.init_process_group(2, 1, backend="host", host="127.0.0.1", port={port})
except gridcomm.GridcommError as exc:
    print("ERROR", type(exc).__name__, exc)
"""


@pytest.mark.timeout(90)
def test_a_waiting_rank_says_who_it_waits_for_and_where_on_stderr():
    """No logging configured: rank 0 waits for rank 1, and rank 1 of another job dials a port
    nobody listens on. Each says so on stderr within 35 s (after 10 s), once per 30 s, and ends
    with one error that names what is missing."""
    alone_port, dead_port = free_port(), free_port()
    env = {"GRIDCOMM_TIMEOUT_S": "22", "GRIDCOMM_BIND": "127.0.0.1"}
    results: dict[str, subprocess.CompletedProcess] = {}

    def run(name: str, code: str) -> None:
        results[name] = run_py(code, env, 60)

    threads = [threading.Thread(target=run, args=("alone", ALONE.format(port=alone_port))),
               threading.Thread(target=run, args=("lost", NO_COORDINATOR.format(port=dead_port)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(70)
    alone, lost = results["alone"], results["lost"]

    waiting = [line for line in alone.stderr.splitlines() if "waiting for 1 of 2 ranks: [1]" in line]
    assert len(waiting) == 1, alone.stderr  # said after 10 s; the next would come after 40 s
    assert f"at the coordinator 127.0.0.1:{alone_port}" in waiting[0] and "rank 0 of 2: join" in waiting[0]
    assert "is the process for rank 1 running?" in waiting[0]
    assert alone.stdout.startswith("ERROR RendezvousTimeout rank 0 of 2: join did not complete within 22.0 s")
    assert "join: join" not in alone.stdout + alone.stderr and "Traceback" not in alone.stderr

    no_answer = [line for line in lost.stderr.splitlines() if "no answer from the coordinator" in line]
    assert len(no_answer) == 1 and f"127.0.0.1:{dead_port}" in no_answer[0], lost.stderr
    assert "ran" not in no_answer[0].split("gives up after")[1], no_answer  # its loop kept up: no blame
    assert lost.stdout.startswith("ERROR CoordinatorUnavailable"), lost.stdout + lost.stderr


# This process's loop, which reads the answers, is held for 8 s of the join's first 10 (a process
# starved of CPU, as 128 processes of 128 simulated ranks each were on 2 cores). Why the pause
# first: the loop's lag meter starts on the loop, and must be ticking before the loop is held.
STARVED = """
import time
from gridcomm._runtime import loop
running = loop.loop()
time.sleep(0.3)
running.call_soon_threadsafe(lambda: [time.sleep(0.5) for _ in range(16)])
""" + NO_COORDINATOR


@pytest.mark.timeout(60)
def test_a_rank_whose_own_loop_ran_behind_says_so_when_no_answer_came():
    """No answer from the coordinator is not always the coordinator's doing: the waiting rank's
    own process may not have had the CPU to read one. Its message says how far behind it ran."""
    lost = run_py(STARVED.format(port=free_port()), {"GRIDCOMM_TIMEOUT_S": "12", "GRIDCOMM_BIND": "127.0.0.1"}, 45)
    no_answer = [line for line in lost.stderr.splitlines() if "no answer from the coordinator" in line]
    assert len(no_answer) == 1, lost.stderr
    assert "background loop, which reads the answers, ran" in no_answer[0] and "short of CPU" in no_answer[0], \
        no_answer[0]


REFUSED = """
import gridcomm
try:
    gridcomm.init_process_group(3, 1, backend="host", host="127.0.0.1", port={port})
except gridcomm.ConfigError as exc:
    print("REFUSED", exc)
"""


@pytest.mark.timeout(90)
def test_a_rank_refused_for_its_world_size_is_named_as_refused_not_missing():
    port = free_port()
    env = {"GRIDCOMM_TIMEOUT_S": "14", "GRIDCOMM_BIND": "127.0.0.1"}
    rank0 = subprocess.Popen([sys.executable, "-c", ALONE.format(port=port)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env={**ENV, **env})
    try:
        deadline = time.monotonic() + 30
        while True:  # rank 1 dials once rank 0's coordinator is up (it would wait for it anyway)
            refused = run_py(REFUSED.format(port=port), env, 60)
            if refused.stdout.startswith("REFUSED"):
                break
            assert time.monotonic() < deadline, refused.stdout + refused.stderr
        assert "world size is 3" in refused.stdout, refused.stdout
        out, err = rank0.communicate(timeout=60)
    finally:
        if rank0.poll() is None:
            rank0.kill()
            rank0.wait(10)
    # The coordinator logged the refusal; the waiting rank said it, and its error says it too,
    # instead of asking whether rank 1 runs.
    assert re.search(r"refused the join of rank 1 from .*world size is 3", err), err
    assert re.search(r"waiting for 1 of 2 ranks: \[1\].*rank 1 \(from .* was refused: .*world size is 3", err), err
    assert "ERROR RendezvousTimeout" in out and "was refused" in out, out
    assert "is the process for rank 1 running" not in out + err


# --- clean exits ---------------------------------------------------------------------------------

# The README's snippet, on the host backend (NumPy arrays): every line, split included.
README_SPLIT = """
import os, numpy, gridcomm
rank = int(os.environ["GRIDCOMM_RANK"]); n_devices = 2
comm = gridcomm.init_process_group(n_devices, rank, backend="host")
x = numpy.ones(1024, dtype=numpy.float32)
comm.all_reduce(x, x, op="sum")
comm.broadcast(x, root=0); comm.barrier("step")
sub = comm.split(color=rank % 2)
comm.stop()
print("OK", float(x[0]))
"""

# The README's control-plane snippet, rank 0 hosting the coordinator.
README_CONTROL_PLANE = """
import os, gridcomm
rank = int(os.environ["GRIDCOMM_RANK"])
if rank == 0:
    server = gridcomm.Coordinator(world_size=2, bind="127.0.0.1", port=int(os.environ["GRIDCOMM_PORT"])).start()
client = gridcomm.CoordinatorClient("127.0.0.1", int(os.environ["GRIDCOMM_PORT"]), rank=rank, world_size=2)
client.join()
if rank == 0:
    client.set("nccl-id", b"...")
value = client.get("nccl-id")
client.barrier("ready")
client.leave()
if rank == 0:
    server.stop(grace_s=10)
print("OK", value)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("code", [README_SPLIT, README_CONTROL_PLANE], ids=["split", "control-plane"])
def test_the_readme_snippets_run_without_a_traceback(code: str):
    env = {"GRIDCOMM_PORT": str(free_port()), "GRIDCOMM_HOST": "127.0.0.1", "GRIDCOMM_BIND": "127.0.0.1"}
    with RankProcesses(code, 2, env=env) as ranks:
        results = ranks.wait(90)
    for r in results.values():
        assert r.returncode == 0 and r.stdout.startswith("OK"), report(results)
        assert "Traceback" not in r.stderr and "Exception in thread" not in r.stderr, report(results)


# One rank dies; the survivors catch the failure, keep going for a while (a checkpoint), then stop.
FAILURE = """
import os, sys, time, numpy, gridcomm
rank = int(os.environ["GRIDCOMM_RANK"]); victim = int(os.environ["VICTIM"])
comm = gridcomm.init_process_group(3, rank, backend="host")
if rank == victim:
    comm.barrier("ready")
    os._exit(9)
try:
    # Why "ready" inside: the victim may exit (rank 0: with the coordinator) before the answer of
    # "ready" reached the others (seen on a loaded machine); that is the same failure, seen sooner.
    comm.barrier("ready")
    comm.barrier("after", timeout_s=30)
except gridcomm.RankFailedError as exc:
    print("FAILED", exc.rank, flush=True)
time.sleep(float(os.environ["CHECKPOINT_S"]))  # the survivor's own work after the failure
began = time.monotonic()
comm.stop()
print("STOP_S", round(time.monotonic() - began, 2), flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim", [2, 0], ids=["worker", "rank0"])
def test_after_a_failure_the_survivors_exit_quietly_and_promptly(victim: int):
    heartbeat_s = 2.0
    env = {"GRIDCOMM_PORT": str(free_port()), "GRIDCOMM_HOST": "127.0.0.1", "GRIDCOMM_BIND": "127.0.0.1",
           "GRIDCOMM_HEARTBEAT_TIMEOUT_S": str(heartbeat_s), "VICTIM": str(victim),
           # Longer than the heartbeat timeout: a survivor that stopped heartbeating would be failed too.
           "CHECKPOINT_S": str(2 * heartbeat_s + 1)}
    with RankProcesses(FAILURE, 3, env=env) as ranks:
        results = ranks.wait(90)
    survivors = [r for r in range(3) if r != victim]
    for r in survivors:
        out, err = results[r].stdout, results[r].stderr
        assert f"FAILED {victim}" in out, report(results)
        stop_s = float(re.search(r"STOP_S ([\d.]+)", out).group(1))  # type: ignore[union-attr]
        assert stop_s < 3.0, f"rank {r}'s stop() took {stop_s} s\n{report(results)}"
        assert "Traceback" not in err and "_ServerStoppedError" not in err, report(results)
        assert "sent no heartbeat" not in err, report(results)
        # The leave after a failure is skipped (coordinator gone) or bounded, never a wait that fails.
        assert "could not tell the coordinator" not in err, report(results)


# --- true hints and plain command lines -----------------------------------------------------------

def test_version():
    done = cli("--version")
    assert done.returncode == 0
    assert re.fullmatch(rf"gridcomm {re.escape(gridcomm.__version__)} \(grpcio [\d.]+, protobuf [\d.]+, "
                        r"Python [\d.]+\)\n", done.stdout), done.stdout


def test_errors_carry_one_prefix():
    dead = free_port()
    done = cli("status", f"127.0.0.1:{dead}", "--timeout-s", "2")
    assert done.returncode == 2
    assert done.stderr.startswith("gridcomm status: the coordinator at") and "status: status" not in done.stderr


@pytest.mark.timeout(60)
def test_barrier_errors_name_the_barrier_once(coordinator_factory):
    server = coordinator_factory(2)
    clients = [gridcomm.CoordinatorClient("127.0.0.1", server.port, r, 2, timeout_s=10) for r in range(2)]
    threads = [threading.Thread(target=c.join) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    with pytest.raises(gridcomm.RendezvousTimeout) as timeout:
        clients[0].barrier("x", timeout_s=1.0)
    text = str(timeout.value)
    assert text.startswith("rank 0: barrier 'x' #1 did not complete within 1.0 s: 1 of 2 ranks have not arrived: [1]")
    assert text.count("barrier 'x'") == 1, text
    clients[1].report_failure("test")
    with pytest.raises(gridcomm.RankFailedError) as failed:
        clients[0].barrier("y", timeout_s=5.0)
    assert str(failed.value).count("barrier 'y'") == 1, str(failed.value)
    for c in clients:
        c.close()


@pytest.mark.timeout(60)
def test_a_coordinator_port_in_use_is_said_without_grpcs_own_line():
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        port = held.getsockname()[1]
        done = cli("serve", "--world-size", "2", "--bind", "0.0.0.0", "--port", str(port))
    assert done.returncode == 2
    assert f"port {port} is already in use" in done.stderr, done.stderr
    assert "add_port" not in done.stderr and "Traceback" not in done.stderr


@pytest.mark.timeout(90)
def test_a_second_rank_0_is_named_as_a_duplicate_rank_not_told_to_change_the_port():
    port = free_port()
    code = ("import gridcomm\n"
            "try:\n"
            f"    gridcomm.init_process_group(2, 0, backend='host', port={port}, timeout_s=20)\n"
            "except gridcomm.GridcommError as exc:\n"
            "    print('ERROR', type(exc).__name__, exc, flush=True)\n")
    first = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**ENV, "GRIDCOMM_BIND": "127.0.0.1"})
    try:
        # The first rank 0's coordinator is up once its port answers.
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and first.poll() is None, first.stderr.read()
                time.sleep(0.05)
        second = run_py(code, {"GRIDCOMM_BIND": "127.0.0.1"}, 60)
    finally:
        first.kill()
        first.wait(10)
    assert "ERROR ConfigError rank 0 is already running" in second.stdout, second.stdout + second.stderr
    assert "started exactly once" in second.stdout and "GRIDCOMM_PORT" not in second.stdout, second.stdout


def test_the_nccl_backend_without_a_gpu_suggests_host_or_auto():
    done = run_py("import gridcomm\ntry:\n    gridcomm.init_process_group(1, 0, backend='nccl')\n"
                  "except gridcomm.ConfigError as exc:\n    print(exc)\n", {}, 60)
    if "needs a GPU" not in done.stdout and "needs CuPy" not in done.stdout:
        pytest.skip(f"this machine can run NCCL: {done.stdout or done.stderr}")
    assert "backend='host'" in done.stdout and "backend='auto'" in done.stdout, done.stdout


SLEEPER = """
import sys, time
print("READY", flush=True)
time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_ctrl_c_in_launch_is_an_interrupt_not_a_failed_rank(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    proc = subprocess.Popen([sys.executable, "-m", "gridcomm", "launch", "--nproc", "2", "--backend", "host",
                             str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                            start_new_session=True)
    try:
        ready = set()
        while len(ready) < 2:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            if line.endswith("READY\n"):
                ready.add(line.split("]")[0])
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole process group
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 130, err
    assert "got SIGINT" in err and "exited with code" not in err, err


# --- status --watch -------------------------------------------------------------------------------

@pytest.fixture
def serve():
    with serving(["--world-size", "4", "--bind", "127.0.0.1", "--port", "0"], ENV) as (proc, line):
        assert "listening on 127.0.0.1:" in line, line + proc.stderr.read()
        yield int(line.rsplit(":", 1)[1])


@pytest.mark.timeout(60)
def test_status_watch_redraws_a_bounded_view(serve):
    port = serve
    client = gridcomm.CoordinatorClient("127.0.0.1", port, 2, 4, timeout_s=0.5)
    with pytest.raises(gridcomm.RendezvousTimeout):
        client.join()
    done = cli("status", f"127.0.0.1:{port}", "--watch", "--count", "3", "--interval-s", "0.2")
    assert done.returncode == 0, done.stderr
    frames = [f for f in done.stdout.split("\n\n") if f.strip()]
    assert len(frames) == 3, done.stdout
    for frame in frames:
        lines = frame.splitlines()
        assert lines[0].startswith(f"gridcomm status 127.0.0.1:{port}")
        assert "1 of 4 ranks joined" in lines[1]
        assert "  missing  (3): 0-1, 3" in lines, frame
        assert "  joined   (1): 2" in lines, frame
        assert "failures: 0" in lines and len(lines) <= 60
    client.close()


PROGRESS_CODE = r"""
import os, time
import numpy as np
import gridcomm

comm = gridcomm.init_process_group(backend="host", timeout_s=60)
x = np.ones(4)
for _ in range(3):
    comm.all_reduce(x, x)
open(os.environ["GATE"] + f".{comm.rank}", "w").close()
until = time.monotonic() + 60
while not os.path.exists(os.environ["GATE"]) and time.monotonic() < until:
    time.sleep(0.05)
comm.barrier("end")
comm.stop()
"""


@pytest.mark.timeout(120)
def test_status_watch_keeps_the_per_rank_progress_that_status_shows(coordinator_factory, tmp_path):
    from gridcomm._client.client import fetch_status
    from tests.support.procs import wait_for

    server = coordinator_factory(2)
    gate = str(tmp_path / "gate")
    env = {"GRIDCOMM_COORDINATOR": "external", "GRIDCOMM_HOST": "127.0.0.1", "GRIDCOMM_PORT": str(server.port),
           "GATE": gate}
    ranks = RankProcesses(PROGRESS_CODE, 2, env=env)
    try:
        def at_3() -> bool:
            world = [p for p in fetch_status("127.0.0.1", server.port).progress if p.communicator == "world"]
            return len(world) == 2 and all(p.entered == 3 for p in world)

        wait_for(at_3, "both ranks' heartbeats carry all_reduce #3", 60)
        once = cli("status", f"127.0.0.1:{server.port}")
        live = cli("status", f"127.0.0.1:{server.port}", "--watch", "--count", "1")
        open(gate, "w").close()
        results = ranks.wait(60)
    finally:
        ranks.close()
    assert all(r.returncode == 0 for r in results.values()), report(results)
    for rank in (0, 1):
        assert re.search(rf"rank +{rank} +joined .* last world: all_reduce #3", once.stdout), once.stdout
    assert "last collective (world):" in live.stdout, live.stdout
    assert re.search(r"\n  all_reduce #3: ranks 0-1, up to [0-9.]+ s ago\n", live.stdout), live.stdout


@pytest.mark.timeout(60)
def test_status_watch_ends_cleanly_on_ctrl_c(serve):
    proc = subprocess.Popen([sys.executable, "-m", "gridcomm", "status", f"127.0.0.1:{serve}", "--watch",
                             "--interval-s", "0.2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        first = proc.stdout.readline()
        assert first.startswith("gridcomm status"), first + proc.stderr.read()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 130 and "Traceback" not in err, err


def _handle_events() -> None:
    """Named as grpc.aio's completion-queue callback is, for a real asyncio.Handle's repr."""


def test_a_late_grpc_event_for_a_closed_loop_is_dropped_quietly(caplog: pytest.LogCaptureFixture):
    """grpc.aio delivers a closed loop's completions through another loop of the process; the
    RuntimeError that raises there is dropped (nothing can act on it), anything else is not."""
    from gridcomm._runtime.loop import drop_late_grpc_events

    loop = asyncio.new_event_loop()
    try:
        drop_late_grpc_events(loop)
        late = asyncio.Handle(_handle_events, (), loop)
        with caplog.at_level(logging.DEBUG):
            loop.call_exception_handler({"message": "Exception in callback", "handle": late,
                                         "exception": RuntimeError("Event loop is closed")})
            assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
            loop.call_exception_handler({"message": "something else", "handle": late, "exception": ValueError("x")})
            assert [r for r in caplog.records if r.levelno >= logging.ERROR and "something else" in r.getMessage()]
    finally:
        loop.close()
