"""Recovery in place: real OS processes per rank on loopback, host backend, a
standalone coordinator in the test process (``GRIDCOMM_COORDINATOR=external``, so any rank may
fail), and ranks that die by SIGKILL mid-loop.

Every rank runs checked ``all_reduce`` steps: rank r contributes ``job_rank + 1 + 1000 * step``,
so the expected sum depends on which job ranks are members, and a result mixed across steps or
generations is caught. On ``RankFailedError`` a survivor calls ``rebuild()`` or ``shrink()``
(again if that raises ``RankFailedError``), then the new communicator's rank 0 broadcasts the
step to resume from (what a job reloads from its checkpoint); a replacement process calls
``init_process_group`` as the first did and joins that broadcast. Recovery time, from the death
to the first good step of the new generation, is printed (``-s``), not asserted.
"""

from __future__ import annotations

import json
import signal
import time
from typing import Any

import pytest

import gridcomm
from tests.support.procs import RankProcesses, report, wait_for
from tests.support.ranks import LIVENESS, READINESS, check, free_port, wait_status

HB = 2.0
WORLD = 4

RANK_CODE = r"""
import json, os, signal, sys, time
import numpy as np
import gridcomm

rank = int(os.environ["GRIDCOMM_RANK"]); world = int(os.environ["GRIDCOMM_WORLD_SIZE"])
mode = os.environ["RECOVERY"]
die_rank, die_step = int(os.environ.get("DIE_RANK", "-1")), int(os.environ.get("DIE_STEP", "5"))
die_in_recovery = int(os.environ.get("DIE_IN_RECOVERY", "-1"))
recover_delay = float(os.environ.get("RECOVER_DELAY_S", "0"))
steps_after = int(os.environ.get("STEPS_AFTER", "20"))
max_steps = int(os.environ.get("MAX_STEPS", "0"))  # 0: until steps_after good steps after a recovery
step_sleep = float(os.environ.get("STEP_SLEEP_S", "0"))


def emit(tag, **fields):
    print(tag, json.dumps(dict(fields, at=time.time())), flush=True)


comm = gridcomm.init_process_group(world, rank, backend="host", timeout_s=60)
emit("JOINED", generation=comm.generation, members=list(comm.members), rank=comm.rank)
x = np.empty(1024)
y = np.empty(1024)
step_box = np.zeros(1, dtype=np.int64)
step, good_after, wrong = 0, 0, 0
resync = comm.generation > 0  # a replacement learns the step from the survivors
while good_after < steps_after and not (max_steps and step >= max_steps):
    time.sleep(step_sleep)
    if resync:
        step_box[0] = step
        comm.broadcast(step_box, root=0)
        step = int(step_box[0])
        resync = False
        emit("RESUME", step=step, generation=comm.generation)
    if rank == die_rank and comm.generation == 0 and step == die_step:
        emit("DYING")
        os.kill(os.getpid(), signal.SIGKILL)
    x[:] = comm.members[comm.rank] + 1 + 1000.0 * step
    try:
        comm.all_reduce(x, y, op="sum")
    except gridcomm.RankFailedError as exc:
        emit("FAILED", failed=exc.rank, generation=comm.generation)
        if rank == die_in_recovery:
            time.sleep(0.5)  # the others are inside their recovery call by now
            emit("DYING")
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(recover_delay)
        gate = os.environ.get("RECOVER_GATE")
        if gate:  # the test says when the survivors call their recovery
            until = time.monotonic() + 60
            while not os.path.exists(gate) and time.monotonic() < until:
                time.sleep(0.02)
        while True:
            try:
                comm = comm.rebuild(timeout_s=60) if mode == "rebuild" else comm.shrink(timeout_s=60)
                break
            except gridcomm.RankFailedError as again:
                emit("RETRY", failed=again.rank, message=str(again)[:300])
        emit("RECOVERED", generation=comm.generation, members=list(comm.members), rank=comm.rank)
        resync = True
        continue
    want = sum(m + 1 + 1000.0 * step for m in comm.members)
    if not np.all(y == want):
        wrong += 1
        emit("WRONG", step=step, got=float(y[0]), want=want)
    if comm.generation > 0:
        good_after += 1
        if good_after == 1:
            emit("FIRST_GOOD", step=step, generation=comm.generation)
    step += 1
comm.barrier("end")
emit("DONE", generation=comm.generation, members=list(comm.members), rank=comm.rank, step=step, wrong=wrong)
comm.stop()
"""


def lines(text: str, tag: str) -> list[dict[str, Any]]:
    return [json.loads(line.split(" ", 1)[1]) for line in text.splitlines() if line.startswith(tag + " ")]


class Run:
    """The job's first processes plus the replacements the test starts (by rank)."""

    def __init__(self, server: gridcomm.Coordinator, per_rank_env: dict[int, dict[str, str]] | None = None,
                 **env: str) -> None:
        self.server = server
        self.env = {"GRIDCOMM_COORDINATOR": "external", "GRIDCOMM_HOST": "127.0.0.1",
                    "GRIDCOMM_PORT": str(server.port), "GRIDCOMM_HEARTBEAT_TIMEOUT_S": f"{HB:g}",
                    "GRIDCOMM_BACKEND": "host", **env}
        self.first = RankProcesses(RANK_CODE, WORLD, env=self.env, per_rank_env=per_rank_env)
        self.replacements: list[RankProcesses] = []
        self.results: dict[str, Any] = {}

    def died(self, rank: int, timeout_s: float = 60.0) -> None:
        proc = self.first.procs[rank]
        wait_for(lambda: proc.poll() is not None, f"rank {rank} dies", timeout_s)
        assert proc.returncode == -signal.SIGKILL, proc.returncode

    def replace(self, rank: int) -> None:
        self.replacements.append(RankProcesses(RANK_CODE, WORLD, env=self.env, ranks=[rank]))

    def wait(self, timeout_s: float) -> tuple[dict[int, Any], list[dict[int, Any]]]:
        first = self.first.wait(timeout_s)
        later = [r.wait(30) for r in self.replacements]
        return first, later

    def close(self) -> None:
        self.first.close()
        for r in self.replacements:
            r.close()


@pytest.fixture
def run(coordinator_factory):
    made: list[Run] = []

    def make(per_rank_env: dict[int, dict[str, str]] | None = None, **env: str) -> Run:
        server = coordinator_factory(WORLD, heartbeat_timeout_s=HB)
        made.append(Run(server, per_rank_env, **env))
        return made[-1]

    yield make
    for r in made:
        r.close()


def check_finished(results: dict[int, Any], survivors: list[int], members: list[int], generation: int,
                   everything: str) -> dict[int, dict[str, Any]]:
    done = {}
    for rank in survivors:
        r = results[rank]
        assert r.returncode == 0, everything
        (last,) = lines(r.stdout, "DONE")
        assert last["wrong"] == 0 and last["generation"] == generation and last["members"] == members, everything
        assert not lines(r.stdout, "WRONG"), everything
        done[rank] = last
    return done


def recovery_time(results: dict[int, Any], victim_out: str, survivors: list[int]) -> float:
    (death,) = lines(victim_out, "DYING")
    first_good = max(lines(results[r].stdout, "FIRST_GOOD")[0]["at"] for r in survivors)
    return first_good - death["at"]


@pytest.mark.timeout(150)
def test_rebuild_a_replacement_joins_and_everyone_finishes_20_checked_steps(run):
    job = run(RECOVERY="rebuild", DIE_RANK="2")
    job.died(2)
    time.sleep(1.0)  # the restarted pod comes a second later
    job.replace(2)
    first, (again,) = job.wait(120)
    everything = report(first) + "\n--- replacement\n" + report(again)
    check_finished(first, [0, 1, 3], [0, 1, 2, 3], 1, everything)
    check_finished(again, [2], [0, 1, 2, 3], 1, everything)
    for rank in (0, 1, 3):
        (failed,) = lines(first[rank].stdout, "FAILED")
        assert failed["failed"] == 2, everything
        (recovered,) = lines(first[rank].stdout, "RECOVERED")
        assert recovered["rank"] == rank and recovered["generation"] == 1, everything
    # The replacement entered generation 1 (never 0) and resumed where the survivors were.
    (joined,) = lines(again[2].stdout, "JOINED")
    (resumed,) = lines(again[2].stdout, "RESUME")
    assert joined["generation"] == 1 and resumed["step"] == 5, everything
    print(f"\nrebuild: death of rank 2 to the first good step of generation 1: "
          f"{recovery_time(first, first[2].stdout, [0, 1, 3]):.2f} s (replacement started 1 s after the death)")


@pytest.mark.timeout(150)
def test_readiness_goes_down_at_the_failure_and_up_when_the_rebuild_completes(run):
    port = free_port()
    job = run({0: {"GRIDCOMM_HEALTH_PORT": str(port)}}, RECOVERY="rebuild", DIE_RANK="2", STEP_SLEEP_S="0.1")
    wait_status(port, READINESS, "SERVING", 40)
    job.died(2)
    seen_dead = time.monotonic()
    down_after = wait_status(port, READINESS, "NOT_SERVING", 10) - seen_dead
    assert check(port, LIVENESS) == "SERVING"  # a survivor is not killed by its liveness probe
    job.replace(2)  # only now: readiness stays down until the recovery completes
    replaced = time.monotonic()
    up_after = wait_status(port, READINESS, "SERVING", 40) - replaced
    first, (again,) = job.wait(120)
    everything = report(first) + report(again)
    check_finished(first, [0, 1, 3], [0, 1, 2, 3], 1, everything)
    check_finished(again, [2], [0, 1, 2, 3], 1, everything)
    print(f"\nrank 0's readiness: NOT_SERVING {down_after:.2f} s after the death was seen, SERVING again "
          f"{up_after:.2f} s after the replacement started")


@pytest.mark.timeout(150)
def test_shrink_three_survivors_finish_20_checked_steps(run):
    job = run(RECOVERY="shrink", DIE_RANK="2")
    first, _ = job.wait(120)
    everything = report(first)
    assert first[2].returncode == -signal.SIGKILL, everything
    done = check_finished(first, [0, 1, 3], [0, 1, 3], 1, everything)
    assert [done[r]["rank"] for r in (0, 1, 3)] == [0, 1, 2], everything  # renumbered in job-rank order
    print(f"\nshrink: death of rank 2 to the first good step of generation 1: "
          f"{recovery_time(first, first[2].stdout, [0, 1, 3]):.2f} s")


@pytest.mark.timeout(180)
def test_a_second_failure_during_the_rebuild_is_a_rank_failed_error_and_the_retry_succeeds(run):
    job = run(RECOVERY="rebuild", DIE_RANK="2", DIE_IN_RECOVERY="3")
    job.died(2)
    job.died(3)
    job.replace(2)
    job.replace(3)
    first, (again2, again3) = job.wait(150)
    everything = report(first) + report(again2) + report(again3)
    check_finished(first, [0, 1], [0, 1, 2, 3], 1, everything)
    check_finished(again2, [2], [0, 1, 2, 3], 1, everything)
    check_finished(again3, [3], [0, 1, 2, 3], 1, everything)
    for rank in (0, 1):
        retries = lines(first[rank].stdout, "RETRY")
        # Rank 3 may have died before or after this survivor entered rebuild(): either its first
        # failure names 3, or its rebuild() did (once), and the retry went through.
        failures = [f["failed"] for f in lines(first[rank].stdout, "FAILED")] + [r["failed"] for r in retries]
        assert 3 in failures and len(retries) <= 1, everything


@pytest.mark.timeout(150)
def test_a_replacement_that_arrives_before_the_survivors_call_rebuild_waits_for_them(run):
    job = run(RECOVERY="rebuild", DIE_RANK="2", RECOVER_DELAY_S="4")
    job.died(2)
    job.replace(2)  # at once: it joins while the survivors still sit in their 4 s before rebuild()
    first, (again,) = job.wait(120)
    everything = report(first) + report(again)
    check_finished(first, [0, 1, 3], [0, 1, 2, 3], 1, everything)
    check_finished(again, [2], [0, 1, 2, 3], 1, everything)
    (joined_at,) = lines(again[2].stdout, "JOINED")
    recovered = [lines(first[r].stdout, "RECOVERED")[0]["at"] for r in (0, 1, 3)]
    failed = [lines(first[r].stdout, "FAILED")[0]["at"] for r in (0, 1, 3)]
    # The replacement's join returned only once the survivors had called rebuild (4 s after they
    # learned of the failure), with everyone's generation.
    assert joined_at["generation"] == 1 and joined_at["at"] >= max(failed) + 3.0, everything
    assert abs(joined_at["at"] - max(recovered)) < 3.0, everything


@pytest.mark.timeout(150)
def test_a_replacement_killed_while_it_waits_in_its_join_is_not_admitted(run, tmp_path):
    gate = tmp_path / "rebuild"
    job = run(RECOVERY="rebuild", DIE_RANK="2", RECOVER_GATE=str(gate))
    job.died(2)
    job.replace(2)
    doomed = job.replacements[0].procs[2]
    state = job.server.state
    # It waits in its join for the survivors (who wait for the gate): the replacement of rank 2.
    wait_for(lambda: state.recovery is not None and 2 in state.recovery.replacements, "the replacement waits", 60)
    doomed.kill()
    doomed.wait(10)
    wait_for(lambda: 2 not in state.recovery.replacements, "the dead replacement is dropped", 20)
    gate.touch()  # the survivors call rebuild() right after: the dead replacement must not complete it
    # (The old code formed generation 1 here, with the dead process as rank 2.)
    wait_for(lambda: state.generation > 1 or state.recovery is not None and
             all(r in state.recovery.survivors for r in (0, 1, 3)), "the survivors are in rebuild()", 60)
    job.replace(2)  # the pod restarted again
    first, (_, again) = job.wait(120)
    everything = report(first) + "\n--- second replacement\n" + report(again)
    check_finished(first, [0, 1, 3], [0, 1, 2, 3], 1, everything)  # one recovery: generation 1, nobody failed twice
    check_finished(again, [2], [0, 1, 2, 3], 1, everything)
    for rank in (0, 1, 3):
        assert [f["failed"] for f in lines(first[rank].stdout, "FAILED")] == [2], everything
        assert not lines(first[rank].stdout, "RETRY"), everything


@pytest.mark.timeout(120)
def test_a_replacement_for_a_rank_that_never_failed_is_refused_and_the_job_goes_on(run):
    job = run(RECOVERY="rebuild", MAX_STEPS="80", STEP_SLEEP_S="0.1")  # nobody dies: about 8 s of steps
    # A second process for rank 1 of the running job: refused, saying why; nobody is failed.
    code = r"""
import gridcomm
try:
    gridcomm.init_process_group(4, 1, backend="host", timeout_s=30)
    print("ADMITTED", flush=True)
except gridcomm.GridcommError as exc:
    print("REFUSED", type(exc).__name__, exc, flush=True)
"""
    wait_for(lambda: job.server.state.generation >= 1, "the job's rendezvous", 40)
    started = time.monotonic()
    out = RankProcesses(code, WORLD, env=job.env, ranks=[1]).wait(60)[1]
    refused_in = time.monotonic() - started
    first, _ = job.wait(90)
    everything = report(first) + "\n--- duplicate\n" + out.stdout + out.stderr
    assert "REFUSED ConfigError" in out.stdout and "held by a live process" in out.stdout, everything
    for rank in range(WORLD):
        assert first[rank].returncode == 0 and not lines(first[rank].stdout, "FAILED"), everything
        assert lines(first[rank].stdout, "DONE")[0]["step"] == 80, everything
    print(f"\nduplicate of a live rank refused {refused_in:.2f} s after it started (process start included)")


@pytest.mark.timeout(120)
def test_a_rank_killed_while_it_waits_in_the_first_rendezvous_is_not_counted(coordinator_factory):
    server = coordinator_factory(3, heartbeat_timeout_s=HB)
    env = {"GRIDCOMM_COORDINATOR": "external", "GRIDCOMM_HOST": "127.0.0.1", "GRIDCOMM_PORT": str(server.port),
           "GRIDCOMM_HEARTBEAT_TIMEOUT_S": f"{HB:g}", "GRIDCOMM_BACKEND": "host"}
    code = r"""
import numpy as np, gridcomm
comm = gridcomm.init_process_group(3, backend="host", timeout_s=60)
x = np.full(4, comm.rank + 1.0)
comm.all_reduce(x, x, op="sum")
print("SUM", float(x[0]), comm.generation, flush=True)
comm.stop()
"""
    doomed = RankProcesses(code, 3, env=env, ranks=[2])
    wait_for(lambda: 2 in server.state.members, "rank 2 waits in the rendezvous", 60)
    doomed.close()  # SIGKILL while it waits
    wait_for(lambda: 2 not in server.state.members, "the dead rank 2 is dropped (its call was cancelled)", 20)
    # Ranks 0 and 1 join now: the rendezvous must not complete with the dead rank 2 (the old code
    # completed it, and rank 2's silence then failed the job).
    first = RankProcesses(code, 3, env=env, ranks=[0, 1])
    wait_for(lambda: all(r in server.state.members for r in (0, 1)), "ranks 0 and 1 wait", 60)
    assert server.state.generation == 0, "the rendezvous completed without a live rank 2"
    again = RankProcesses(code, 3, env=env, ranks=[2])  # the pod restarted
    results = {**first.wait(90), **again.wait(30)}
    for r in results.values():
        assert r.returncode == 0 and "SUM 6.0 0" in r.stdout, report(results)


@pytest.mark.timeout(90)
def test_a_killed_bare_client_reaches_its_peers_as_rank_failed_error_naming_it(coordinator_factory):
    server = coordinator_factory(WORLD, heartbeat_timeout_s=HB)
    code = r"""
import json, os, time, gridcomm
rank = int(os.environ["GRIDCOMM_RANK"])
c = gridcomm.CoordinatorClient("127.0.0.1", int(os.environ["PORT"]), rank, 4, timeout_s=60)
c.join()
i = 0
try:
    while True:
        if rank == 3 and i == 20:
            print("DYING", json.dumps({"at": time.time()}), flush=True)
            os._exit(1)  # no leave, no close: a crash
        c.barrier("loop")
        i += 1
except gridcomm.GridcommError as exc:
    print("ERROR", json.dumps({"at": time.time(), "kind": type(exc).__name__, "rank": getattr(exc, "rank", None),
                               "message": str(exc)[:300]}), flush=True)
c.close()
"""
    results = RankProcesses(code, WORLD, env={"PORT": str(server.port)}).wait(60)
    everything = report(results)
    (death,) = lines(results[3].stdout, "DYING")
    for rank in range(3):
        (error,) = lines(results[rank].stdout, "ERROR")
        assert error["kind"] == "RankFailedError" and error["rank"] == 3, everything
        assert error["at"] - death["at"] < HB + 5.0, everything  # the liveness bound + 5 s


@pytest.mark.timeout(90)
def test_split_children_close_with_the_old_generation_and_the_new_one_splits_again(coordinator_factory):
    server = coordinator_factory(3, heartbeat_timeout_s=HB)
    code = r"""
import json, os, signal, time
import numpy as np
import gridcomm
rank = int(os.environ["GRIDCOMM_RANK"])
comm = gridcomm.init_process_group(3, rank, backend="host", timeout_s=60)
child = comm.split(color=0)
x = np.ones(4)
child.all_reduce(x, x)
assert x[0] == 3.0
if rank == 2:
    os.kill(os.getpid(), signal.SIGKILL)
out = {}
try:
    child.all_reduce(x, x)
except gridcomm.RankFailedError as exc:
    out["child_error"] = exc.rank
try:
    child.rebuild()
except gridcomm.ConfigError as exc:
    out["child_rebuild"] = "split the new one again" in str(exc)
new = comm.shrink(timeout_s=30)
try:
    child.all_reduce(x, x)
except gridcomm.GridcommError as exc:
    out["old_child_after"] = type(exc).__name__
try:
    comm.barrier()
except gridcomm.GridcommError as exc:
    out["old_comm_after"] = type(exc).__name__
again = new.split(color=0)
y = np.full(4, rank + 1.0)
again.all_reduce(y, y)
out.update(sum=float(y[0]), members=list(new.members), generation=new.generation, child_members=list(again.members))
print("OUT", json.dumps(out), flush=True)
comm.stop()  # stops the communicator that replaced it (the job's part of this rank ends)
"""
    env = {"GRIDCOMM_COORDINATOR": "external", "GRIDCOMM_HOST": "127.0.0.1", "GRIDCOMM_PORT": str(server.port),
           "GRIDCOMM_HEARTBEAT_TIMEOUT_S": f"{HB:g}"}
    results = RankProcesses(code, 3, env=env).wait(60)
    everything = report(results)
    for rank in (0, 1):
        assert results[rank].returncode == 0, everything
        (out,) = lines(results[rank].stdout, "OUT")
        assert out["child_error"] == 2 and out["child_rebuild"] is True, everything
        assert out["old_child_after"] == "RankFailedError" and out["old_comm_after"] == "CommAborted", everything
        assert out["sum"] == 3.0 and out["members"] == [0, 1] and out["child_members"] == [0, 1], everything
        assert out["generation"] == 1, everything
    assert server.wait_all_left(10.0)


REBUILD_5_S = r"""
import json, os, signal, time
import numpy as np
import gridcomm

rank = int(os.environ["GRIDCOMM_RANK"]); world = int(os.environ["GRIDCOMM_WORLD_SIZE"])
comm = gridcomm.init_process_group(world, rank, backend="host")
x = np.ones(16); y = np.empty(16)
comm.all_reduce(x, y, op="sum")
if rank == 2:
    print("DYING", json.dumps({"at": time.time()}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
try:
    while True:
        comm.all_reduce(x, y, op="sum")
except gridcomm.RankFailedError:
    pass
started = time.monotonic()
try:
    comm.rebuild(timeout_s=5)
    print("REBUILT", json.dumps({}), flush=True)
except gridcomm.GridcommError as exc:
    print("GAVE_UP", json.dumps({"kind": type(exc).__name__, "after_s": time.monotonic() - started,
                                 "message": str(exc)[:300]}), flush=True)
"""

#: A replacement for rank 2 that joins the recovery but never builds its backend (hung in its
#: own start-up, say): the survivors' rendezvous completes and their data-plane barrier waits.
SILENT_REPLACEMENT = r"""
import time
import gridcomm

client = gridcomm.CoordinatorClient(rank=2, world_size=4, timeout_s=60)
client.join()
print("JOINED", flush=True)
time.sleep(40)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("replacement", ["none", "joins but never builds its backend"])
def test_a_rebuild_ends_at_its_own_timeout_s_not_the_inits(coordinator_factory, replacement):
    # The init's bound is the 300 s default; rebuild(timeout_s=5) bounds the whole recovery, the
    # host backend's data-plane barrier included, so the survivors give up at about 5 s.
    server = coordinator_factory(WORLD, heartbeat_timeout_s=HB)
    env = {"GRIDCOMM_COORDINATOR": "external", "GRIDCOMM_HOST": "127.0.0.1", "GRIDCOMM_PORT": str(server.port),
           "GRIDCOMM_HEARTBEAT_TIMEOUT_S": f"{HB:g}", "GRIDCOMM_TIMEOUT_S": ""}  # empty: the 300 s default
    ranks = RankProcesses(REBUILD_5_S, WORLD, env=env)
    late = None
    try:
        proc = ranks.procs[2]
        wait_for(lambda: proc.poll() is not None, "rank 2 dies", 60)
        if replacement != "none":
            late = RankProcesses(SILENT_REPLACEMENT, WORLD, env=env, ranks=[2])
        first = ranks.wait(90)
    finally:
        ranks.close()
        if late is not None:
            late.close()
    everything = report(first)
    assert first[2].returncode == -signal.SIGKILL, everything
    for rank in (0, 1, 3):
        (gave_up,) = lines(first[rank].stdout, "GAVE_UP")
        assert gave_up["kind"] == "RendezvousTimeout", everything
        # Measured, not tight: well under the 300 s default, and not before the 5 s asked for.
        assert 4.0 <= gave_up["after_s"] < 5.0 + 15.0, everything


@pytest.mark.timeout(180)
def test_a_death_during_the_rebuild_is_seen_by_its_dropped_connection_within_the_grace(coordinator_factory):
    # The default bound: a death found only by its silence takes 10-15 s there, one found by its
    # dropped connection the 2 s grace. Rank 3 dies 0.5 s into the survivors' rebuild(), when the
    # generation is failed: its heartbeat must still have been held at the coordinator.
    bound = 15.0
    server = coordinator_factory(WORLD, heartbeat_timeout_s=bound)
    job = Run(server, RECOVERY="rebuild", DIE_RANK="2", DIE_IN_RECOVERY="3", GRIDCOMM_HEARTBEAT_TIMEOUT_S=f"{bound:g}")
    try:
        job.died(2)
        job.replace(2)
        job.died(3)
        job.replace(3)
        first, (again2, again3) = job.wait(150)
    finally:
        job.close()
    everything = report(first) + report(again2) + report(again3)
    check_finished(first, [0, 1], [0, 1, 2, 3], 1, everything)
    check_finished(again2, [2], [0, 1, 2, 3], 1, everything)
    check_finished(again3, [3], [0, 1, 2, 3], 1, everything)
    state = server.state
    (failure,) = [f for f in state.past_failures + state.failures if f.rank == 3]
    (dying,) = lines(first[3].stdout, "DYING")
    seen_after = time.time() - (time.monotonic() - failure.at) - dying["at"]
    assert "lost its connection" in failure.reason, f"{failure.reason}\n{everything}"
    # Measured 2.0 s; generous for a loaded 2-core machine, far below the ~15 s of the silence bound.
    assert seen_after < 8.0, f"seen {seen_after:.2f} s after the death: {failure.reason}\n{everything}"
    print(f"\nrank 3 killed during the rebuild: marked failed {seen_after:.2f} s after its death ({failure.reason})")


RANK0_DIES_IN_REBUILD = r"""
import json, os, signal, time
import numpy as np
import gridcomm

rank = int(os.environ["GRIDCOMM_RANK"])
comm = gridcomm.init_process_group(4, rank, backend="host", timeout_s=60)
x = np.ones(4)
if rank == 2:
    os.kill(os.getpid(), signal.SIGKILL)
try:
    while True:
        comm.all_reduce(x, x, op="sum")
except gridcomm.RankFailedError:
    pass
if rank == 0:
    time.sleep(1.0)  # the others wait in rebuild() for rank 2's replacement, which never comes
    print("DYING", json.dumps({"at": time.time()}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
try:
    comm.rebuild(timeout_s=60)
    print("REBUILT", json.dumps({}), flush=True)
except gridcomm.GridcommError as exc:
    print("GAVE_UP", json.dumps({"kind": type(exc).__name__, "rank": getattr(exc, "rank", None), "at": time.time(),
                                 "message": str(exc)[:300]}), flush=True)
"""


@pytest.mark.timeout(120)
def test_rank_0_dying_during_the_rebuild_is_coordinator_lost_naming_it() -> None:
    # The embedded coordinator (rank 0 hosts it): its death while the survivors wait in rebuild()
    # is rank 0's failure, CoordinatorLost (rank 0), within about the connection grace; not a
    # CoordinatorUnavailable that names nobody (what the old code raised).
    env = {"GRIDCOMM_HOST": "127.0.0.1", "GRIDCOMM_PORT": str(free_port()), "GRIDCOMM_BACKEND": "host"}
    results = RankProcesses(RANK0_DIES_IN_REBUILD, WORLD, env=env).wait(90)
    everything = report(results)
    (dying,) = lines(results[0].stdout, "DYING")
    for rank in (1, 3):
        (gave_up,) = lines(results[rank].stdout, "GAVE_UP")
        assert gave_up["kind"] == "CoordinatorLost" and gave_up["rank"] == 0, everything
        assert gave_up["at"] - dying["at"] < 10.0, everything  # measured ~1.5 s; the grace is 2 s
    print(f"\nrank 0 killed in rebuild(): CoordinatorLost on ranks 1 and 3 after "
          f"{max(lines(results[r].stdout, 'GAVE_UP')[0]['at'] for r in (1, 3)) - dying['at']:.2f} s")
