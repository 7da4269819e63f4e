"""``gridcomm launch --max-restarts N``: a rank killed by SIGKILL is started again in place and
the survivors rebuild; the README's recipe as written; per-rank ports; and, without restarts,
the survivors' own reports of the failure before they are stopped. Real processes throughout."""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys

import pytest

from tests.support.procs import ROOT, wait_for

ENV = dict(os.environ, PYTHONPATH=ROOT, GRIDCOMM_TIMEOUT_S="60")
README = os.path.join(ROOT, "README.md")

RANK_CODE = r"""
import os, sys, time
import numpy as np
import gridcomm

out = sys.argv[1]
restart = os.environ.get("GRIDCOMM_RESTART_COUNT", "0")
comm = gridcomm.init_process_group(backend="host")
rank = comm.rank
with open(os.path.join(out, f"pid-{rank}-{restart}"), "w") as f:
    f.write(str(os.getpid()))
print("ENV", rank, restart, os.environ.get("TORCHELASTIC_RESTART_COUNT", "-"), flush=True)


def agreed(comm, mine):
    box = np.array([float(mine)])
    comm.all_reduce(box, box, op="max")
    return int(box[0])


step = agreed(comm, 0) if comm.generation > 0 else 0
good_after = 0
while good_after < 10:
    assert step < 3000, "no failure came"
    time.sleep(0.02)
    x = np.full(8, float(rank + 1 + step))
    y = np.empty_like(x)
    try:
        comm.all_reduce(x, y)
    except gridcomm.RankFailedError as exc:
        print("FAILED", rank, exc.rank, flush=True)
        comm = comm.rebuild(timeout_s=60)
        step = agreed(comm, step)
        continue
    assert y[0] == sum(r + 1 + step for r in range(comm.world_size)), (step, y[0])
    if comm.generation > 0:
        good_after += 1
    step += 1
comm.barrier("end")
print("DONE", rank, comm.generation, flush=True)
comm.stop()
"""


def free_block(count: int) -> int:
    """A port whose next ``count`` are free now, below the ephemeral range (where outgoing
    connections take their local ports, so a free port's neighbour may be taken a moment later)."""
    for _ in range(200):
        base = random.randrange(20000, 30000, 10)
        socks = []
        try:
            for port in range(base, base + count):
                socks.append(socket.socket())
                socks[-1].bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise AssertionError("no block of free ports")


def launch(*args: str, env: dict | None = None, timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gridcomm", "launch", *args], capture_output=True, text=True,
                          timeout=timeout, env=env or ENV, cwd=ROOT)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("victim", "relay"), [(0, "off"), (2, "off"), (0, "on"), (2, "on")])
def test_a_rank_killed_by_sigkill_is_restarted_and_the_survivors_rebuild(tmp_path, victim, relay):
    """Rank 0 too: with restarts the launcher hosts the coordinator, so rank 0 is a rank like any.
    With GRIDCOMM_RELAY=on the launcher's relay carries its ranks: the killed rank is named within
    the connection grace there too (its relay reports its stream's end), before the survivors'
    rebuild looks for the failure."""
    script = tmp_path / "ranks.py"
    script.write_text(RANK_CODE)
    out = tmp_path / "out"
    out.mkdir()
    log = open(tmp_path / "stdout", "w+")
    err = open(tmp_path / "stderr", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "gridcomm", "launch", "--nproc", "3", "--max-restarts", "1",
                             "--backend", "host", str(script), str(out)], stdout=log, stderr=err,
                            env=dict(ENV, GRIDCOMM_RELAY=relay))
    try:
        # Written, not merely created: a rank writes its pid file after it opens it.
        wait_for(lambda: all((out / f"pid-{r}-0").exists() and (out / f"pid-{r}-0").read_text().strip()
                             for r in range(3)), "every rank started", 90)
        os.kill(int((out / f"pid-{victim}-0").read_text()), signal.SIGKILL)
        code = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    log.seek(0)
    err.seek(0)
    stdout, stderr = log.read(), err.read()
    everything = stdout + stderr
    assert code == 0, everything
    # Named within the connection grace, not at the silence bound (the survivors' verdict wait).
    through = "its relay at " if relay == "on" else "the coordinator "
    assert f"rank {victim} on " in everything and f"lost its connection to {through}" in everything, everything
    assert f"rank {victim} exited with code -9 (SIGKILL); starting it again (restart 1 of at most 1)" in stderr
    assert f"[rank {victim}] ENV {victim} 1 1" in stdout, everything  # GRIDCOMM_ and TORCHELASTIC_RESTART_COUNT
    for rank in range(3):
        assert f"[rank {rank}] DONE {rank} 1" in stdout, everything
        if rank != victim:
            assert f"[rank {rank}] FAILED {rank} {victim}" in stdout, everything


@pytest.mark.timeout(120)
def test_restarts_are_bounded_in_all_and_then_the_job_fails_as_without_them(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['GRIDCOMM_RANK'] == '1':\n"
                      "    print('START', os.environ.get('GRIDCOMM_RESTART_COUNT', '0'), flush=True)\n"
                      "    sys.exit(3)\n"
                      "time.sleep(120)\n")
    result = launch("--nproc", "2", "--max-restarts", "2", "--backend", "host", str(script))
    assert result.returncode == 3, result.stderr
    assert sorted(re.findall(r"\[rank 1\] START (\d)", result.stdout)) == ["0", "1", "2"], result.stdout
    assert "rank 1 exited with code 3; no restarts left; stopping the other ranks" in result.stderr


@pytest.mark.timeout(120)
def test_without_restarts_the_survivors_report_the_failure_before_they_are_stopped(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import os, gridcomm\n"
                      "comm = gridcomm.init_process_group(backend='host')\n"
                      "if comm.rank == 1:\n"
                      "    os._exit(3)\n"
                      "comm.barrier('after')\n")
    result = launch("--nproc", "3", "--backend", "host", str(script))
    assert result.returncode == 3, result.stdout + result.stderr
    assert "rank 1 exited with code 3; stopping the other ranks" in result.stderr
    summary = result.stderr.split("gridcomm launch: the other ranks' last lines:\n", 1)
    assert len(summary) == 2, result.stderr
    for rank in (0, 2):
        assert re.search(rf"\[rank {rank}\] gridcomm\._errors\.RankFailedError: .*rank 1 failed",
                         summary[1]), result.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("restarts", ["0", "1"])
def test_health_ports_are_offset_by_the_local_rank_and_metrics_served_once(tmp_path, restarts):
    health = free_block(3)
    metrics = health + 2
    script = tmp_path / "ports.py"
    script.write_text("import os, urllib.request, gridcomm\n"
                      "from gridcomm._cli.main import probe\n"
                      "comm = gridcomm.init_process_group(backend='host')\n"
                      "port = os.environ['GRIDCOMM_HEALTH_PORT']\n"
                      "code, why = probe('127.0.0.1:' + port, timeout_s=10)\n"
                      "page = urllib.request.urlopen(f'http://127.0.0.1:{os.environ[\"WANT_METRICS\"]}/metrics',"
                      " timeout=10).read().decode()\n"
                      "print('PORTS', comm.rank, port, code, os.environ.get('GRIDCOMM_METRICS_PORT', '-'),"
                      " 'gridcomm_ranks_joined' in page, flush=True)\n"
                      "comm.barrier('end')\n"
                      "comm.stop()\n")
    env = dict(ENV, GRIDCOMM_HEALTH_PORT=str(health), GRIDCOMM_METRICS_PORT=str(metrics), WANT_METRICS=str(metrics),
               GRIDCOMM_METRICS_LINGER_S="0")
    result = launch("--nproc", "2", "--max-restarts", restarts, "--backend", "host", str(script), env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    # Rank 0's process serves /metrics when it hosts the coordinator; with restarts the launcher does.
    rank0_metrics = str(metrics) if restarts == "0" else "-"
    assert f"[rank 0] PORTS 0 {health} 0 {rank0_metrics} True" in result.stdout, result.stdout + result.stderr
    assert f"[rank 1] PORTS 1 {health + 1} 0 - True" in result.stdout, result.stdout + result.stderr


def readme_recipe() -> list[str]:
    text = open(README, encoding="utf-8").read()
    section = text.split("#### launch --max-restarts", 1)[1].split("\n#", 1)[0]
    found = re.search(r"```console\n\$ (gridcomm launch .*?)\n", section)
    assert found, "README's launch --max-restarts section lost its command"
    return found.group(1).split()


@pytest.mark.timeout(180)
def test_the_readme_recovery_recipe_runs_as_written():
    argv = readme_recipe()
    assert "--max-restarts" in argv and "examples/recover.py" in argv, argv
    result = launch(*argv[2:], env=dict(ENV, GRIDCOMM_BACKEND="host"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "starting it again (restart 1 of at most 1)" in result.stderr
    nproc = int(argv[argv.index("--nproc") + 1])
    done = re.findall(r"rank (\d+): 20 checked steps, generation 1, restart (\d)", result.stdout)
    assert sorted(done) == sorted([(str(r), "1" if f"--crash-rank {r}" in " ".join(argv) else "0")
                                   for r in range(nproc)]), result.stdout + result.stderr


def test_a_negative_max_restarts_is_a_clear_error():
    result = launch("--nproc", "2", "--max-restarts", "-1", "x.py", timeout=60)
    assert result.returncode == 2
    assert "--max-restarts=-1 must be a whole number, 0 or more" in result.stderr

