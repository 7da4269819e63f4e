"""The conformance suite over real OS processes: host backend at 2, 3 and 4 ranks (CI), NCCL on a GPU."""

from __future__ import annotations

import re

import pytest

from tests.support.procs import WORKER, RankProcesses, free_port, report


def run_suite(backend: str, world: int, timeout_s: float) -> dict:
    env = {"BACKEND": backend, "GRIDCOMM_PORT": str(free_port()), "GRIDCOMM_BIND": "127.0.0.1",
           "GRIDCOMM_TIMEOUT_S": "60"}
    results = RankProcesses(WORKER, world, env=env).wait(timeout_s)
    summaries = {}
    for rank, r in results.items():
        match = re.search(r"SUMMARY passed=(\d+) failed=(\d+)", r.stdout)
        assert match and r.returncode == 0, report(results)
        summaries[rank] = (int(match.group(1)), int(match.group(2)))
    return summaries


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_host_backend_conformance(world):
    summaries = run_suite("host", world, 280)
    counts = {s for s in summaries.values()}
    assert len(counts) == 1, summaries  # every rank ran the same cases
    passed, failed = counts.pop()
    assert failed == 0 and passed > 150, summaries


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_nccl_backend_conformance_one_gpu():
    pytest.importorskip("cupy")
    summaries = run_suite("nccl", 1, 580)
    passed, failed = summaries[0]
    print(f"NCCL conformance at world size 1: passed={passed} failed={failed}")
    assert failed == 0 and passed > 150
