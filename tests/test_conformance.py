"""The conformance suite over real OS processes: host backend at 2, 3 and 4 ranks (CI), NCCL on a GPU."""

from __future__ import annotations

import json
import re

import pytest

from tests.support.procs import WORKER, RankProcesses, free_port, report, shm_names


def run_suite(backend: str, world: int, timeout_s: float, **extra: str) -> dict:
    env = {"BACKEND": backend, "GRIDCOMM_PORT": str(free_port()), "GRIDCOMM_BIND": "127.0.0.1",
           "GRIDCOMM_TIMEOUT_S": "60", **extra}
    results = RankProcesses(WORKER, world, env=env).wait(timeout_s)
    summaries = {}
    for rank, r in results.items():
        match = re.search(r"SUMMARY passed=(\d+) failed=(\d+)", r.stdout)
        assert match and r.returncode == 0, report(results)
        summaries[rank] = (int(match.group(1)), int(match.group(2)))
        transports = re.search(r"^TRANSPORTS (.*)$", r.stdout, re.MULTILINE)
        TRANSPORTS[rank] = json.loads(transports.group(1)) if transports else {}
    return summaries


#: The last run's "TRANSPORTS" line of each rank: peer -> how the link moved payloads.
TRANSPORTS: dict[int, dict[str, str]] = {}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_host_backend_conformance(world):
    summaries = run_suite("host", world, 280)
    counts = {s for s in summaries.values()}
    assert len(counts) == 1, summaries  # every rank ran the same cases
    passed, failed = counts.pop()
    assert failed == 0 and passed > 150, summaries


@pytest.mark.timeout(400)
def test_host_backend_conformance_at_bandwidth_sizes_over_shared_memory():
    # 25,001 elements per rank and case: past the 64 KiB where all_reduce, reduce, broadcast and
    # reduce_scatter leave their latency algorithms for the ring (or the pipelined chain), and
    # past the 32 KiB above which ranks of one host move payloads through /dev/shm.
    before = shm_names()
    summaries = run_suite("host", 4, 380, SIZE="25001")
    passed, failed = summaries[0]
    assert {s for s in summaries.values()} == {(passed, 0)} and passed > 150, summaries
    for rank, links in TRANSPORTS.items():
        ring = {str((rank + 1) % 4), str((rank - 1) % 4)}
        assert ring <= set(links) and {links[p] for p in ring} == {"shm"}, (rank, links)
    leaked = shm_names() - before
    assert not leaked, f"segments left in /dev/shm: {sorted(leaked)}"


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_nccl_backend_conformance_one_gpu():
    pytest.importorskip("cupy")
    summaries = run_suite("nccl", 1, 580)
    passed, failed = summaries[0]
    print(f"NCCL conformance at world size 1: passed={passed} failed={failed}")
    assert failed == 0 and passed > 150
