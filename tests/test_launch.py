"""`gridcomm launch`, and a cupyx-style program run through it unchanged but for its import."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.support.procs import ROOT

ENV = dict(os.environ, PYTHONPATH=ROOT, GRIDCOMM_TIMEOUT_S="60")


def launch(*args: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gridcomm", "launch", *args], capture_output=True, text=True,
                          timeout=timeout, env=env or ENV)


def start_script(script, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def finish(procs: list, timeout: float) -> list[tuple[str, str]]:
    """Each process's output; any still running at the end (a failed wait) is killed, by PID."""
    try:
        return [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


@pytest.mark.timeout(60)
def test_launch_sets_environment_and_prefixes_output(tmp_path):
    script = tmp_path / "show.py"
    script.write_text("import os, sys\n"
                      "keys = ['GRIDCOMM_RANK', 'GRIDCOMM_LOCAL_RANK', 'GRIDCOMM_WORLD_SIZE', 'GRIDCOMM_HOST',\n"
                      "        'GRIDCOMM_PORT', 'GRIDCOMM_BACKEND']\n"
                      "print(' '.join(k + '=' + os.environ[k] for k in keys), sys.argv[1:])\n")
    result = launch("--nproc", "3", "--backend", "host", str(script), "a", "--flag")
    assert result.returncode == 0, result.stderr
    lines = sorted(result.stdout.splitlines())
    assert len(lines) == 3
    ports = set()
    for rank, line in enumerate(lines):
        assert line.startswith(f"[rank {rank}] GRIDCOMM_RANK={rank} GRIDCOMM_LOCAL_RANK={rank} GRIDCOMM_WORLD_SIZE=3")
        assert "GRIDCOMM_BACKEND=host" in line and "['a', '--flag']" in line
        ports.add(line.split("GRIDCOMM_PORT=")[1].split()[0])
    assert len(ports) == 1


@pytest.mark.timeout(90)
def test_launch_sets_torchruns_names_too_and_a_torchrun_style_script_runs(tmp_path):
    script = tmp_path / "torchrun_style.py"
    script.write_text("import os, numpy as np, gridcomm\n"
                      "rank, world = int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])\n"
                      "assert os.environ['LOCAL_RANK'] == str(rank) and os.environ['LOCAL_WORLD_SIZE'] == str(world)\n"
                      "assert os.environ['MASTER_ADDR'] == '127.0.0.1'\n"
                      "assert os.environ['MASTER_PORT'] != os.environ['GRIDCOMM_PORT']\n"
                      "comm = gridcomm.init_process_group(world, rank, backend='host')\n"
                      "x = np.full(2, rank + 1.0); comm.all_reduce(x, x)\n"
                      "print('SUM', x[0], 'MASTER_PORT', os.environ['MASTER_PORT'])\n"
                      "comm.stop()\n")
    result = launch("--nproc", "2", "--backend", "host", str(script))
    assert result.returncode == 0, result.stdout + result.stderr
    lines = sorted(result.stdout.splitlines())
    assert [line.split()[2:4] for line in lines] == [["SUM", "3.0"], ["SUM", "3.0"]], result.stdout
    assert len({line.split()[-1] for line in lines}) == 1  # one MASTER_PORT for the job


@pytest.mark.timeout(60)
def test_failing_rank_stops_the_others(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['GRIDCOMM_RANK'] == '1':\n"
                      "    sys.exit(3)\n"
                      "time.sleep(120)\n")
    t0 = time.monotonic()
    result = launch("--nproc", "3", "--backend", "host", str(script))
    elapsed = time.monotonic() - t0
    assert result.returncode == 3, result.stderr
    assert "rank 1 exited with code 3; stopping the other ranks" in result.stderr
    assert elapsed < 20, elapsed


@pytest.mark.timeout(120)
def test_launch_module_with_collectives():
    result = launch("--nproc", "2", "--backend", "host", "-m", "gridcomm._cli.demo")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count('"ok": true') == 20  # 10 checked collectives on each of 2 ranks


@pytest.mark.timeout(120)
@pytest.mark.parametrize("nproc", [2, 3])
def test_cupyx_style_program_runs_unchanged_on_host(nproc):
    program = os.path.join(ROOT, "examples", "cupyx_style.py")
    text = open(program, encoding="utf-8").read()
    # Outside the docstring, the only line that names gridcomm is the import: swapping it for
    # `from cupyx.distributed import init_process_group` gives the cupyx program.
    code = text.split('"""', 2)[2]
    assert [line for line in code.splitlines() if "gridcomm" in line] == ["from gridcomm import init_process_group"]
    result = launch("--nproc", str(nproc), "--backend", "host", program)
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in range(nproc):
        assert f"[rank {rank}] rank {rank}: cupyx-style program ok" in result.stdout


@pytest.mark.timeout(90)
def test_init_process_group_from_a_torchrun_environment(tmp_path):
    """No arguments at all: rank, world size and rank 0's address come from torchrun's variables
    through the cluster detector (GRIDCOMM_PORT, since torchrun's own agent holds MASTER_PORT)."""
    from tests.support.procs import free_port

    script = tmp_path / "torchrun_style.py"
    script.write_text("import numpy as np, gridcomm\n"
                      "with gridcomm.init_process_group(backend='host') as comm:\n"
                      "    x = np.full(3, comm.rank + 1.0); comm.all_reduce(x, x)\n"
                      "    print('RESULT', comm.rank, comm.world_size, x.tolist(), flush=True)\n")
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {k: v for k, v in ENV.items() if not k.startswith("GRIDCOMM_")}
        env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT="1", GRIDCOMM_PORT=port, GRIDCOMM_BIND="127.0.0.1", GRIDCOMM_TIMEOUT_S="30",
                   PYTHONPATH=ROOT)
        procs.append(start_script(script, env))
    outs = finish(procs, 60)
    for rank, (out, err) in enumerate(outs):
        assert procs[rank].returncode == 0, err
        assert f"RESULT {rank} 2 [3.0, 3.0, 3.0]" in out


@pytest.mark.timeout(120)
def test_launch_with_relay_on_carries_the_ranks_through_its_relay(tmp_path):
    script = tmp_path / "through.py"
    script.write_text("import os, gridcomm\n"
                      "with gridcomm.init_process_group(backend='host') as comm:\n"
                      "    comm.barrier()\n"
                      "print('RELAY', os.environ['GRIDCOMM_RELAY_ADDRESS'])\n")
    # With a token: the launcher reads it (for its relay) and still passes it on to its ranks.
    result = launch("--nproc", "3", "--backend", "host", str(script),
                    env=dict(ENV, GRIDCOMM_RELAY="on", GRIDCOMM_TOKEN="launch-secret"))
    assert result.returncode == 0, result.stderr
    relays = {line.split("RELAY ")[1] for line in result.stdout.splitlines() if "RELAY " in line}
    assert len(relays) == 1 and relays.pop().startswith("127.0.0.1:"), result.stdout
    # Nobody lost the relay on the way (a rank that did would say so and go on directly).
    assert "is gone" not in result.stderr and "did not answer" not in result.stderr, result.stderr
    result = launch("--nproc", "2", "--backend", "host", "-m", "gridcomm._cli.demo", env=dict(ENV, GRIDCOMM_RELAY="on"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.count('"ok": true') == 20


@pytest.mark.timeout(120)
def test_two_torchrun_jobs_with_agent_stores_on_one_host_do_not_collide(tmp_path):
    """Under torchrun's agent store (its TCPStore on MASTER_PORT) and no GRIDCOMM_PORT, each job's
    ranks derive one coordinator port of their own: two such jobs run side by side."""
    import socket

    script = tmp_path / "torchrun_style.py"
    script.write_text("import numpy as np, gridcomm\n"
                      "with gridcomm.init_process_group(backend='host') as comm:\n"
                      "    x = np.full(3, comm.rank + 1.0); comm.all_reduce(x, x)\n"
                      "    comm.barrier('both-up')\n"
                      "    print('RESULT', comm.rank, comm.world_size, x.tolist(), flush=True)\n")
    stores = []
    for _ in range(2):  # what torchrun's agents hold: a listening store port per job
        store = socket.socket()
        store.bind(("127.0.0.1", 0))
        store.listen()
        stores.append(store)
    procs = []
    try:
        for job, store in enumerate(stores):
            for rank in range(2):
                env = {k: v for k, v in ENV.items() if not k.startswith("GRIDCOMM_")}
                env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(store.getsockname()[1]), TORCHELASTIC_USE_AGENT_STORE="True",
                           TORCHELASTIC_RUN_ID=f"job-{job}", GRIDCOMM_BIND="127.0.0.1", GRIDCOMM_TIMEOUT_S="30",
                           PYTHONPATH=ROOT)
                procs.append(start_script(script, env))
        outs = finish(procs, 90)
    finally:
        for store in stores:
            store.close()
    for i, (out, err) in enumerate(outs):
        assert procs[i].returncode == 0, err
        assert f"RESULT {i % 2} 2 [3.0, 3.0, 3.0]" in out, out + err
