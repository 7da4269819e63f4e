"""Hangs: a live rank that stops making progress is named, and mismatched collectives are caught.

Real OS processes per rank (host backend), a coordinator in the test process
(``GRIDCOMM_COORDINATOR=external``) with a short stall bound. A stuck rank keeps heartbeating (its
background loop is alive); only its progress, which its heartbeats carry, shows it stopped.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from gridcomm._cli.status import render
from gridcomm._client.client import fetch_status
from tests.support.procs import RankProcesses, report, wait_for
from tests.support.ranks import LIVENESS, READINESS, check, free_port

HB = 3.0
STALL = 5.0
WORLD = 4

RANK_CODE = r"""
import json, os, sys, time
import numpy as np
import gridcomm

rank = int(os.environ["GRIDCOMM_RANK"]); world = int(os.environ["GRIDCOMM_WORLD_SIZE"])
stuck_rank = int(os.environ.get("STUCK_RANK", "-1"))
stuck_step = int(os.environ.get("STUCK_STEP", "3"))
where = os.environ.get("STUCK_WHERE", "all_reduce")
slow_rank = int(os.environ.get("SLOW_RANK", "-1"))
step_s = float(os.environ.get("STEP_S", "0"))
steps = int(os.environ.get("STEPS", "8"))
recover = os.environ.get("RECOVER") == "1"


def emit(tag, **fields):
    print(tag, json.dumps(dict(fields, at=time.monotonic())), flush=True)


def stuck_in_user_code():
    emit("STUCK")
    time.sleep(float(os.environ.get("STUCK_S", "600")))  # a deadlock in user code


comm = gridcomm.init_process_group(world, rank, backend="host", timeout_s=90)
emit("JOINED", generation=comm.generation)
x = np.empty(16)
y = np.empty(16)
step, wrong = 0, 0
while step < steps:
    time.sleep(step_s * (3 if rank == slow_rank else 1))
    if comm.generation == 0 and rank == stuck_rank and step == stuck_step:
        if where == "all_reduce":
            stuck_in_user_code()
    x[:] = comm.members[comm.rank] + 1 + 1000.0 * step
    try:
        comm.all_reduce(x, y, op="sum")
        if comm.generation == 0 and rank == stuck_rank and step == stuck_step and where == "barrier":
            stuck_in_user_code()
        comm.barrier("step")
    except gridcomm.RankFailedError as exc:
        emit("FAILED", kind=type(exc).__name__, failed=exc.rank, message=str(exc)[:600])
        if not recover:
            comm.stop()
            sys.exit(0)
        comm = comm.rebuild(timeout_s=60)
        emit("RECOVERED", generation=comm.generation)
        box = np.array([step], dtype=np.int64)
        comm.broadcast(box, root=0)
        continue
    want = sum(m + 1 + 1000.0 * step for m in comm.members)
    wrong += int(not np.all(y == want))
    step += 1
emit("DONE", generation=comm.generation, wrong=wrong, step=step)
comm.stop()
"""

REPLACEMENT_CODE = RANK_CODE.replace(
    "comm = gridcomm.init_process_group(world, rank, backend=\"host\", timeout_s=90)\n",
    "comm = gridcomm.init_process_group(world, rank, backend=\"host\", timeout_s=90)\n"
    "box = np.zeros(1, dtype=np.int64)\ncomm.broadcast(box, root=0)\nstep_start = int(box[0])\n",
).replace("step, wrong = 0, 0", "step, wrong = step_start, 0")


def lines(text: str, tag: str) -> list[dict[str, Any]]:
    return [json.loads(line.split(" ", 1)[1]) for line in text.splitlines() if line.startswith(tag + " ")]


def job_env(server, **extra: str) -> dict[str, str]:
    return {"GRIDCOMM_COORDINATOR": "external", "GRIDCOMM_HOST": "127.0.0.1", "GRIDCOMM_PORT": str(server.port),
            "GRIDCOMM_HEARTBEAT_TIMEOUT_S": f"{HB:g}", "GRIDCOMM_BACKEND": "host", **extra}


@pytest.fixture
def stall_server(coordinator_factory):
    return coordinator_factory(WORLD, heartbeat_timeout_s=HB, stall_timeout_s=STALL)


@pytest.mark.timeout(150)
def test_a_rank_stuck_in_user_code_is_named_on_every_rank_shows_its_stack_and_fails_liveness(stall_server):
    health = free_port()
    env = job_env(stall_server, STUCK_RANK="2", RECOVER="1", STEPS="8")
    first = RankProcesses(RANK_CODE, WORLD, env=env, per_rank_env={2: {"GRIDCOMM_HEALTH_PORT": str(health)}})
    replacement: RankProcesses | None = None
    try:
        # Liveness is SERVING while rank 2 runs, and while it is stuck, until the job names it.
        wait_for(lambda: check(health, LIVENESS) == "SERVING", "rank 2's liveness answers", 60)
        # Before the bound: `gridcomm status` says who is late and each rank's last collective.
        def rank_2_late() -> Any:
            lines = fetch_status("127.0.0.1", stall_server.port).late
            return any("rank 2 has not entered" in line for line in lines) or stall_server.state.failures

        late = wait_for(rank_2_late, "status shows rank 2 late", 60)
        if not stall_server.state.failures:
            reply = fetch_status("127.0.0.1", stall_server.port)
            text = "\n".join(render(reply))
            assert "LATE world: rank 2 has not entered all_reduce #" in text, text
            assert "rank     2  joined" in text and "last world: all_reduce #" in text, text
        else:
            pytest.fail(f"the stall was named before status could show it late: {late}")
        wait_for(lambda: stall_server.state.failures, "the coordinator names a failure", 60)
        (failure,) = stall_server.state.failures
        assert failure.rank == 2 and failure.cause == "stall", failure
        assert stall_server.metrics.hangs == {"stall": 1}
        assert "has not entered all_reduce #" in failure.reason and "ranks 0-1, 3 wait in it" in failure.reason, failure
        # The stuck process is alive, its heartbeats go on, and its liveness turns NOT_SERVING.
        wait_for(lambda: check(health, LIVENESS) == "NOT_SERVING", "rank 2's liveness turns NOT_SERVING", 10)
        assert check(health, READINESS) == "NOT_SERVING"
        assert first.procs[2].poll() is None
        # kubelet restarts the pod: the stuck process goes, a new one for rank 2 comes.
        first.procs[2].kill()
        replacement = RankProcesses(REPLACEMENT_CODE, WORLD, env=env, ranks=[2])
        results = first.wait(90)
        again = replacement.wait(30)
    finally:
        first.close()
        if replacement is not None:
            replacement.close()
    everything = report(results) + "\n--- replacement\n" + report(again)
    (stuck,) = lines(results[2].stdout, "STUCK")
    for rank in (0, 1, 3):
        assert results[rank].returncode == 0, everything
        (failed,) = lines(results[rank].stdout, "FAILED")
        assert failed["kind"] == "RankStalled" and failed["failed"] == 2, everything
        # Named within the stall bound plus the heartbeat's reporting period, counted from the entry.
        assert failed["at"] - stuck["at"] < STALL + 5, everything
        (done,) = lines(results[rank].stdout, "DONE")
        assert done["generation"] == 1 and done["wrong"] == 0 and done["step"] == 8, everything
    (done,) = lines(again[2].stdout, "DONE")
    assert done["generation"] == 1 and done["wrong"] == 0, everything
    # Its stack, with the line where it waits, is on its stderr.
    err = results[2].stderr
    assert "rank 2 is stalled" in err and "in stuck_in_user_code" in err, everything


@pytest.mark.timeout(120)
@pytest.mark.parametrize("relay", ["direct", "through-relays"])
def test_a_rank_stuck_before_a_barrier_is_named(stall_server, relay):
    # Rank 1 comes back after 15 s (past the bound): its next call raises, naming itself.
    # Through relays (ranks 0 and 2 host one each), rank 1's progress reaches the coordinator in
    # rank 0's relay's aggregated heartbeat.
    tree = {"GRIDCOMM_RELAY": "on", "GRIDCOMM_RELAY_FANIN": "2"} if relay == "through-relays" else {}
    env = job_env(stall_server, STUCK_RANK="1", STUCK_WHERE="barrier", STEPS="6", STUCK_S="15", **tree)
    procs = RankProcesses(RANK_CODE, WORLD, env=env)
    try:
        wait_for(lambda: stall_server.state.failures, "the coordinator names a failure", 60)
        (failure,) = stall_server.state.failures
        results = procs.wait(60)
    finally:
        procs.close()
    everything = report(results)
    assert failure.rank == 1 and failure.cause == "stall", everything
    assert "has not entered barrier #" in failure.reason, everything
    (stuck,) = lines(results[1].stdout, "STUCK")
    for rank in (0, 2, 3):
        (failed,) = lines(results[rank].stdout, "FAILED")
        assert failed["kind"] == "RankStalled" and failed["failed"] == 1, everything
        assert failed["at"] - stuck["at"] < STALL + 5, everything
    assert "in stuck_in_user_code" in results[1].stderr, everything
    (own,) = lines(results[1].stdout, "FAILED")
    assert own["kind"] == "RankStalled" and own["failed"] == 1, everything


@pytest.mark.timeout(150)
def test_a_slow_but_progressing_rank_is_never_failed(stall_server):
    # Rank 3's steps take 3x as long: the others wait for it in every all_reduce (1.2 s of the
    # bound's 5 s each time), the whole run is 6x the bound, and nobody is failed.
    env = job_env(stall_server, SLOW_RANK="3", STEP_S="0.6", STEPS="16")
    start = time.monotonic()
    results = RankProcesses(RANK_CODE, WORLD, env=env).wait(130)
    everything = report(results)
    assert time.monotonic() - start > 3 * STALL, everything
    assert not stall_server.state.failures, everything
    for rank in range(WORLD):
        assert results[rank].returncode == 0, everything
        (done,) = lines(results[rank].stdout, "DONE")
        assert done["wrong"] == 0 and done["step"] == 16, everything


MISMATCH_CODE = r"""
import json, os, sys, time
import numpy as np
import gridcomm

rank = int(os.environ["GRIDCOMM_RANK"]); world = int(os.environ["GRIDCOMM_WORLD_SIZE"])
comm = gridcomm.init_process_group(world, rank, backend="host", timeout_s=60)
x = np.ones(4, dtype=np.float32)
comm.all_reduce(x, x)
comm.barrier("warm")
t0 = time.monotonic()
try:
    # The host data plane cannot tell these apart (the same messages flow): only the
    # fingerprints can. Rank 1's result is silently wrong without them.
    comm.all_reduce(x, x, op="max" if rank == 1 else "sum")
    for _ in range(200):
        comm.barrier("after")
        time.sleep(0.1)
    print("NO ERROR", flush=True)
except gridcomm.GridcommError as exc:
    print("OUTCOME", json.dumps({"kind": type(exc).__name__, "rank": getattr(exc, "rank", None),
                                 "after": time.monotonic() - t0, "message": str(exc)}), flush=True)
comm.stop()
"""


@pytest.mark.timeout(120)
def test_a_mismatched_collective_is_named_on_every_rank(coordinator_factory):
    # The stall bound is long: the mismatch, not a stall, must name it.
    server = coordinator_factory(WORLD, heartbeat_timeout_s=HB, stall_timeout_s=50)
    env = job_env(server, GRIDCOMM_DEBUG="collectives")
    results = RankProcesses(MISMATCH_CODE, WORLD, env=env).wait(100)
    everything = report(results)
    for rank in range(WORLD):
        (outcome,) = lines(results[rank].stdout, "OUTCOME")
        assert outcome["kind"] == "CollectiveMismatch" and outcome["rank"] == 1, everything
        assert outcome["after"] < 2 * HB + 5, everything
        message = outcome["message"]
        assert "collective #3 of communicator 'world'" in message, everything
        assert "rank 1 called all_reduce(max, 4 x float32)" in message, everything
        assert "rank 0 called all_reduce(sum, 4 x float32)" in message, everything


def test_without_the_debug_flag_nothing_is_fingerprinted(coordinator_factory):
    server = coordinator_factory(WORLD, heartbeat_timeout_s=HB, stall_timeout_s=50)
    results = RankProcesses(MISMATCH_CODE.replace("range(200)", "range(3 * 10 * 3)"), WORLD,
                            env=job_env(server)).wait(100)
    everything = report(results)
    for rank in range(WORLD):
        assert "NO ERROR" in results[rank].stdout, everything
