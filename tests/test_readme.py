"""The README's first program runs as written on a CPU machine, from the source tree and from the
wheel a library user installs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile

import pytest

from tests.support.procs import ROOT

README = os.path.join(ROOT, "README.md")


def first_program() -> tuple[str, str, list[str]]:
    """The section's script (its name from its first line), its command and the output shown."""
    text = open(README, encoding="utf-8").read()
    section = text.split("## A first program", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    console = re.search(r"```console\n\$ (.*?)\n(.*?)```", section, re.S)
    assert code and console, "README's first-program section lost its script or its console block"
    return code.group(1), console.group(1), console.group(2).splitlines()


def run_it(tmp_path, env: dict[str, str]) -> subprocess.CompletedProcess:
    script, command, _ = first_program()
    name = script.splitlines()[0].lstrip("# ").strip()
    (tmp_path / name).write_text(script)
    argv = command.split()
    assert argv[0] == "gridcomm", command
    return subprocess.run([sys.executable, "-m", "gridcomm", *argv[1:]], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env=env)


@pytest.mark.timeout(150)
def test_the_readme_first_program_runs_as_written(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, GRIDCOMM_TIMEOUT_S="60")
    done = run_it(tmp_path, env)
    assert done.returncode == 0, done.stdout + done.stderr
    # Ranks print in either order; each line the README shows, and nothing else.
    assert sorted(done.stdout.splitlines()) == sorted(first_program()[2]), done.stdout


@pytest.mark.timeout(300)
def test_the_wheel_builds_installs_and_runs_the_first_program(tmp_path):
    wheels = tmp_path / "wheels"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), ROOT],
                           capture_output=True, text=True, timeout=240)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = wheels.glob("gridcomm-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("gridcomm/__init__.py", "gridcomm/py.typed", "gridcomm/_proto/coordinator_pb2.py",
                   "gridcomm/_proto/coordinator_pb2_grpc.py", "gridcomm/_proto/coordinator.proto"):
        assert needed in names, f"{needed} is not in {wheel.name}"
    assert not any(n.startswith("tests/") for n in names), "the wheel ships the tests"
    site = tmp_path / "site"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                                str(wheel)], capture_output=True, text=True, timeout=120)
    assert installed.returncode == 0, installed.stderr
    # The installed copy, not the source tree (the run's folder is outside it).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(site), GRIDCOMM_TIMEOUT_S="60")
    where = subprocess.run([sys.executable, "-c", "import gridcomm; print(gridcomm.__file__)"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60, env=env)
    assert where.stdout.startswith(str(site)), where.stdout + where.stderr
    run = tmp_path / "run"
    run.mkdir()
    done = run_it(run, env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(done.stdout.splitlines()) == sorted(first_program()[2]), done.stdout
