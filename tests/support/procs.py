"""Real OS processes per rank for tests: started with RANK/WORLD in their environment, always
killed by PID, their output reported on failure; and the paths and ports tests share."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: The NCCL/host conformance program, run by one process per rank.
WORKER = open(os.path.join(ROOT, "tests", "conformance.py"), encoding="utf-8").read()


def wait_for(predicate: Callable[[], Any], what: str, timeout_s: float = 10.0) -> Any:
    """Polls ``predicate`` until it is truthy (its value is returned) or fails after ``timeout_s``:
    for waiting on state a test can read (the coordinator's, a process's) where no event exists."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.02)


def shm_names() -> set[str]:
    """gridcomm's segment names in /dev/shm (there should be none once the ranks have set up)."""
    try:
        return {name for name in os.listdir("/dev/shm") if name.startswith("gridcomm-")}
    except FileNotFoundError:
        return set()


def free_port() -> int:
    """A port the OS just handed out (for settings that take no 0)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class RankResult:
    rank: int
    returncode: int | None
    stdout: str
    stderr: str


class RankProcesses:
    """One real OS process per rank, each running ``code`` with RANK/WORLD/PORT in its environment.

    Always killed (by PID) in ``close()``; ``wait()`` reports every rank's output on failure.
    """

    def __init__(self, code: str, n: int, env: dict[str, str] | None = None, ranks: Sequence[int] | None = None,
                 per_rank_env: dict[int, dict[str, str]] | None = None) -> None:
        self.procs: dict[int, subprocess.Popen] = {}
        # Why files, not pipes: a rank blocked on a full pipe while we wait on another rank
        # would stall the whole job.
        self._files: dict[int, tuple] = {}
        base = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        base.update(env or {})
        source = textwrap.dedent(code)
        for rank in (range(n) if ranks is None else ranks):
            rank_env = dict(base, GRIDCOMM_RANK=str(rank), GRIDCOMM_WORLD_SIZE=str(n))
            rank_env.update((per_rank_env or {}).get(rank, {}))
            out = tempfile.TemporaryFile(mode="w+")
            err = tempfile.TemporaryFile(mode="w+")
            self._files[rank] = (out, err)
            self.procs[rank] = subprocess.Popen([sys.executable, "-c", source], env=rank_env, stdout=out, stderr=err,
                                                text=True)

    def wait(self, timeout_s: float) -> dict[int, RankResult]:
        results: dict[int, RankResult] = {}
        deadline = time.monotonic() + timeout_s
        try:
            for rank, proc in self.procs.items():
                try:
                    code: int | None = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
                    code = None
                out, err = self._files[rank]
                out.seek(0)
                err.seek(0)
                results[rank] = RankResult(rank, code, out.read(), err.read())
        finally:
            self.close()
        return results

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    pass
        for out, err in self._files.values():
            out.close()
            err.close()
        self._files = {}

    def __enter__(self) -> RankProcesses:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def report(results: dict[int, RankResult]) -> str:
    lines = []
    for rank, r in sorted(results.items()):
        lines.append(f"--- rank {rank}: returncode {r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}")
    return "\n".join(lines)


def assert_all_ok(results: dict[int, RankResult]) -> None:
    bad = [r for r in results.values() if r.returncode != 0]
    assert not bad, "ranks failed:\n" + report(results)
