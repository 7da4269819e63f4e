"""Rank 0 hosting the embedded coordinator whose script ends without ``stop()``: it leaves as a
``stop()`` would (no "lost its connection" about itself, no wait for ranks that already left), and
a script that ends on an uncaught exception fails the rank naming it. Real processes per rank."""

from __future__ import annotations

import pytest

from tests.support.procs import RankProcesses, free_port, report

CODE = r"""
import os, sys, time
import gridcomm

rank = int(os.environ["GRIDCOMM_RANK"])
comm = gridcomm.init_process_group(backend="host", timeout_s=60)
comm.barrier("ready")
if rank == 0:
    if os.environ["HOW"] == "raise":
        raise ValueError("the user's bug")
    print("RANK0 ENDS", time.time(), flush=True)  # no stop(): the script just ends
else:
    if os.environ["HOW"] == "raise":
        try:
            comm.barrier("after")
        except gridcomm.RankFailedError as exc:
            print("SAW", exc, flush=True)
    comm.stop()
"""


def run(how: str) -> dict:
    env = {"GRIDCOMM_HOST": "127.0.0.1", "GRIDCOMM_PORT": str(free_port()), "GRIDCOMM_BIND": "127.0.0.1",
           "HOW": how}
    return RankProcesses(CODE, 2, env=env).wait(90)


@pytest.mark.timeout(120)
def test_rank_0_ending_without_stop_leaves_cleanly():
    results = run("end")
    everything = report(results)
    assert results[0].returncode == 0 and results[1].returncode == 0, everything
    assert "RANK0 ENDS" in results[0].stdout, everything
    # Not blamed for its own connection, and no wait for rank 1, which had left (the wait says
    # so after 1 s: "waiting up to N s more for 1 rank(s) still joined").
    assert "lost its connection" not in everything, everything
    assert "still joined" not in everything, everything


@pytest.mark.timeout(120)
def test_rank_0_ending_on_an_uncaught_exception_fails_naming_it():
    results = run("raise")
    everything = report(results)
    assert results[0].returncode == 1 and "ValueError: the user's bug" in results[0].stderr, everything
    assert results[1].returncode == 0, everything
    assert "SAW" in results[1].stdout and "rank 0" in results[1].stdout, everything
    assert "uncaught ValueError: the user's bug" in results[1].stdout, everything
    assert "lost its connection" not in everything, everything
