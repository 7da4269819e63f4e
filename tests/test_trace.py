"""Flight records: a stall with GRIDCOMM_TRACE_DIR leaves a file per rank, and `gridcomm trace`
names the laggard (rank, host, PID) and the collective it did not enter.

Real OS processes per rank (host backend), a coordinator in the test process with a short stall
bound; `gridcomm trace` is run as a user runs it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from gridcomm._client.tracker import Tracker
from tests.support.procs import ROOT, RankProcesses, report

HB = 3.0
STALL = 5.0
WORLD = 3

CODE = r"""
import os, time
import numpy as np
import gridcomm

rank = int(os.environ["GRIDCOMM_RANK"]); world = int(os.environ["GRIDCOMM_WORLD_SIZE"])
comm = gridcomm.init_process_group(world, rank, backend="host", timeout_s=60)
x = np.ones(16)
try:
    for step in range(50):  # step s: all_reduce #2s+1, barrier #2s+2
        if rank == 2 and step == 3:
            print("STUCK", os.getpid(), flush=True)
            time.sleep(25)  # a deadlock in user code
        comm.all_reduce(x, x, op="sum")
        comm.barrier("step")
except gridcomm.RankFailedError as exc:
    print("FAILED", type(exc).__name__, flush=True)
comm.stop()
"""


@pytest.mark.timeout(150)
def test_a_stall_leaves_a_record_per_rank_and_trace_names_the_laggard(tmp_path, coordinator_factory):
    server = coordinator_factory(WORLD, heartbeat_timeout_s=HB, stall_timeout_s=STALL)
    trace_dir = tmp_path / "trace"
    env = {"GRIDCOMM_COORDINATOR": "external", "GRIDCOMM_HOST": "127.0.0.1", "GRIDCOMM_PORT": str(server.port),
           "GRIDCOMM_HEARTBEAT_TIMEOUT_S": f"{HB:g}", "GRIDCOMM_TRACE_DIR": str(trace_dir)}
    results = RankProcesses(CODE, WORLD, env=env).wait(120)
    everything = report(results)
    assert sorted(os.listdir(trace_dir)) == [f"rank-{r}.json" for r in range(WORLD)], everything
    records = {r: json.loads((trace_dir / f"rank-{r}.json").read_text()) for r in range(WORLD)}
    (stuck_pid,) = [int(line.split()[1]) for line in results[2].stdout.splitlines() if line.startswith("STUCK")]
    assert records[2]["pid"] == stuck_pid and records[2]["host"] == socket.gethostname()
    (world,) = [c for c in records[0]["communicators"] if c["name"] == "world"]
    assert world["inside"] and world["entered"] == 7 and world["kind"] == "all_reduce", world
    assert world["records"][-1]["number"] == 6 and world["records"][0]["call"] == "all_reduce(op=sum, 16 x float64)"
    # The stall's message says how long the others waited, from their entry (not a heartbeat's sample).
    reason = server.state.failures[0].reason
    assert "rank 2 has not entered all_reduce #7" in reason, reason

    merged = subprocess.run([sys.executable, "-m", "gridcomm", "trace", str(trace_dir)], capture_output=True,
                            text=True, timeout=60, env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT)
    assert merged.returncode == 0, merged.stdout + merged.stderr
    text = merged.stdout
    assert (f"BEHIND rank 2 (host {socket.gethostname()}, PID {stuck_pid}) has not entered #7 (all_reduce); "
            "ranks 0, 1 entered it") in text, text
    assert "completed #6 barrier('step'); in #7 all_reduce for " in text, text
    print("\n" + text)


def test_trace_refuses_a_directory_without_records(tmp_path):
    merged = subprocess.run([sys.executable, "-m", "gridcomm", "trace", str(tmp_path)], capture_output=True,
                            text=True, timeout=60, env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT)
    assert merged.returncode == 2 and "no flight records" in merged.stdout, merged.stdout + merged.stderr


def test_a_call_in_progress_reports_its_own_entry_time():
    tracker = Tracker("world", 1)
    tracker.enter("barrier")
    time.sleep(0.2)
    # The first sample comes after the entry: the age is still counted from the entry itself.
    assert tracker.progress().age_s >= 0.2
    tracker.leave()
