"""Stragglers: a rank 40 ms slower per step has the largest entry lag, `gridcomm status` and
`/metrics` name it, the shipped alert fires on its series, and nobody is failed.

One OS process per rank (host backend), a coordinator in the test process with metrics.
"""

from __future__ import annotations

import shutil

import pytest

from gridcomm._cli.status import render, render_live
from gridcomm._client.client import fetch_status
from tests.support.procs import RankProcesses, report, wait_for
from tests.support.ranks import free_port
from tests.test_alerts import expect, promtool_test, scrape, series

HB = 3.0
WORLD = 3
SLOW = 2

CODE = r"""
import os, threading, time
import numpy as np
import gridcomm

rank = int(os.environ["GRIDCOMM_RANK"]); world = int(os.environ["GRIDCOMM_WORLD_SIZE"])
comm = gridcomm.init_process_group(world, rank, backend="host", timeout_s=60)
x = np.zeros(16)
stop = os.environ["STOP_FILE"]
steps = 0
while steps < 4000:
    time.sleep(0.01 + (0.04 if rank == int(os.environ["SLOW_RANK"]) else 0.0))  # the step's own work
    # The stop is agreed in the all_reduce itself: a rank that checked the file a moment after the
    # others would otherwise run one all_reduce more than they do while they wait in the barrier.
    x[0] = float(os.path.exists(stop))
    comm.all_reduce(x, x, op="max")
    steps += 1
    if x[0] > 0:
        break
comm.barrier("end")
print("DONE", steps, flush=True)
comm.stop()
"""


@pytest.mark.timeout(150)
def test_a_slow_rank_is_named_a_straggler_and_never_failed(tmp_path, coordinator_factory):
    metrics = free_port()
    server = coordinator_factory(WORLD, heartbeat_timeout_s=HB, stall_timeout_s=10, metrics_port=metrics)
    stop = tmp_path / "stop"
    env = {"GRIDCOMM_COORDINATOR": "external", "GRIDCOMM_HOST": "127.0.0.1", "GRIDCOMM_PORT": str(server.port),
           "GRIDCOMM_HEARTBEAT_TIMEOUT_S": f"{HB:g}", "STOP_FILE": str(stop), "SLOW_RANK": str(SLOW)}
    procs = RankProcesses(CODE, WORLD, env=env)
    try:
        reply = wait_for(lambda: (r := fetch_status("127.0.0.1", server.port, timeout_s=10)).stragglers and r,
                         "a straggler is listed", 90)
        lags = scrape(metrics)["gridcomm_rank_entry_lag_seconds"]
    finally:
        stop.write_text("")
    results = procs.wait(60)
    everything = report(results)
    assert [s.rank for s in reply.stragglers] == [SLOW], reply
    by_rank = {int(dict(labels)["rank"]): value for labels, value in lags.items()}
    assert max(by_rank, key=lambda r: by_rank[r]) == SLOW, by_rank
    assert 0.02 < by_rank[SLOW] < 0.2, by_rank
    text = "\n".join(render(reply))
    assert f"STRAGGLER rank {SLOW} enters collectives" in text, text
    assert f"rank {SLOW} enters collectives" in "\n".join(render_live(reply, (), 40))
    for rank in range(WORLD):
        assert "DONE" in results[rank].stdout, everything  # nobody was failed
    assert not server.state.failures
    print(f"\nentry lags: { {r: round(v * 1000, 1) for r, v in sorted(by_rank.items())} } ms")

    if shutil.which("promtool") is None:
        return
    values = [by_rank[SLOW]] * 14
    result = promtool_test(tmp_path, [{
        "interval": "1m",
        "input_series": [series("gridcomm_rank_entry_lag_seconds", {"job": "gridcomm", "rank": str(SLOW)}, values),
                         series("gridcomm_rank_entry_lag_seconds", {"job": "gridcomm", "rank": "0"},
                                [by_rank[0]] * 14)],
        "alert_rule_test": [
            {"eval_time": "5m", "alertname": "GridcommStraggler", "exp_alerts": []},  # not yet for 10 m
            {"eval_time": "12m", "alertname": "GridcommStraggler",
             "exp_alerts": [expect("GridcommStraggler", severity="warning", job="gridcomm", rank=str(SLOW))]},
        ],
    }])
    assert result.returncode == 0, result.stdout + result.stderr
