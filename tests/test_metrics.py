"""Prometheus metrics at /metrics: `gridcomm serve --metrics-port` and GRIDCOMM_METRICS_PORT on
rank 0, scraped over HTTP from real processes and parsed with prometheus_client's own parser."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

import gridcomm
from tests.support.procs import ROOT, RankProcesses, report
from tests.support.ranks import Rank, free_port, kill_all, serving

ENV = dict(os.environ, PYTHONPATH=ROOT)


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of one scrape."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        assert answer.status == 200
        assert answer.headers["Content-Type"].startswith("text/plain")
        text = answer.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


# Three ranks against `gridcomm serve`: three barriers, then rank 2 dies and the others' next
# barrier fails naming it.
JOB = r"""
import os, gridcomm
rank = int(os.environ["GRIDCOMM_RANK"])
try:
    with gridcomm.init_process_group(3, rank, backend="host") as comm:
        for _ in range(3):
            comm.barrier("step")
        if rank == 2:
            os._exit(1)
        comm.barrier("after")
except gridcomm.RankFailedError as exc:
    print("FAILED", exc.rank)
"""


@pytest.mark.timeout(120)
def test_serve_metrics_port_serves_the_named_series():
    token = "metrics-test-token"
    serve_env = dict(ENV, GRIDCOMM_TOKEN=token, GRIDCOMM_HEARTBEAT_TIMEOUT_S="2")
    with serving(["--world-size", "3", "--bind", "127.0.0.1", "--port", "0", "--metrics-port", "0"],
                 serve_env) as (proc, line):
        assert "metrics on port" in line, line + proc.stderr.read()
        port = int(line.split("listening on 127.0.0.1:")[1].split()[0])
        metrics_port = int(line.rsplit("metrics on port ", 1)[1].rstrip(")\n"))

        before = scrape(metrics_port)
        assert value(before, "gridcomm_coordinator_responsive") == 1
        assert value(before, "gridcomm_world_size") == 3 and value(before, "gridcomm_ranks_joined") == 0
        assert value(before, "gridcomm_rendezvous_complete") == 0 and value(before, "gridcomm_generation") == -1

        # A caller without the token, and a rank with the wrong world size: both refused, both counted.
        with pytest.raises(gridcomm.AuthenticationError):
            gridcomm.CoordinatorClient("127.0.0.1", port, 0, 3, token="wrong", timeout_s=5).join()
        with pytest.raises(gridcomm.ConfigError, match="world size"):
            gridcomm.CoordinatorClient("127.0.0.1", port, 1, 4, token=token, timeout_s=5).join()

        job_env = {"GRIDCOMM_COORDINATOR": "external", "GRIDCOMM_HOST": "127.0.0.1", "GRIDCOMM_PORT": str(port),
                   "GRIDCOMM_TOKEN": token, "GRIDCOMM_TIMEOUT_S": "30"}
        with RankProcesses(JOB, 3, env=job_env) as ranks:
            results = ranks.wait(60)
        assert [results[r].stdout.strip() for r in (0, 1)] == ["FAILED 2", "FAILED 2"], report(results)

        after = scrape(metrics_port)
        assert value(after, "gridcomm_ranks_joined") == 3
        assert value(after, "gridcomm_rendezvous_complete") == 1 and value(after, "gridcomm_generation") >= 0
        assert value(after, "gridcomm_ranks", state="failed") == 1
        assert value(after, "gridcomm_rank_failures_total") == 1
        assert value(after, "gridcomm_serving") == 0
        # Three instances of "step" completed (and whatever the host backend's own setup used),
        # each once, with its wait in the histogram; "after" never completed.
        completed = value(after, "gridcomm_barriers_completed_total")
        assert completed >= 3
        assert value(after, "gridcomm_barrier_wait_seconds_count") == completed
        assert value(after, "gridcomm_barrier_wait_seconds_bucket", le="+Inf") == completed
        assert value(after, "gridcomm_barrier_arrivals_total") >= 9
        assert value(after, "gridcomm_barrier_wait_seconds_sum") >= 0
        # Operations by kind (heartbeats ride the Session stream); calls by method and status:
        # the streams, the refused token, the refused join.
        assert value(after, "gridcomm_ops_total", op="heartbeat") >= 2
        rpcs = {labels: v for (name, labels), v in after.items() if name == "gridcomm_rpcs_total"}
        assert any(dict(labels)["method"] == "Session" for labels in rpcs), rpcs
        assert any(dict(labels)["code"] == "UNAUTHENTICATED" for labels in rpcs), rpcs
        assert value(after, "gridcomm_refused_calls_total") >= 1
        assert value(after, "gridcomm_join_refusals_total", code="INVALID_ARGUMENT") == 1
        assert value(after, "gridcomm_ops_total", op="join") >= 3
        assert value(after, "gridcomm_session_op_errors_total", op="barrier", code="ABORTED") >= 1

        # `gridcomm status` names the refused join, with its reason.
        status = subprocess.run([sys.executable, "-m", "gridcomm", "status", f"127.0.0.1:{port}"], capture_output=True,
                                text=True, timeout=30, env=dict(ENV, GRIDCOMM_TOKEN=token))
        assert status.returncode == 0, status.stderr
        assert "REFUSED join: rank 1 (from " in status.stdout and "world size is 4" in status.stdout, status.stdout


RANK = r"""
import os, sys, gridcomm
comm = gridcomm.init_process_group(2, int(os.environ["GRIDCOMM_RANK"]), backend="host")
comm.barrier("one")
print("UP", flush=True)
sys.stdin.readline()
comm.stop()
"""


@pytest.mark.timeout(90)
def test_rank_zero_serves_metrics_on_gridcomm_metrics_port():
    port, metrics_port = free_port(), free_port()
    env = {"GRIDCOMM_PORT": str(port), "GRIDCOMM_HOST": "127.0.0.1", "GRIDCOMM_BIND": "127.0.0.1",
           "GRIDCOMM_METRICS_PORT": str(metrics_port)}
    ranks = [Rank(r, RANK, {**env, "GRIDCOMM_RANK": str(r)}) for r in range(2)]
    try:
        for r in ranks:
            r.expect("UP", 60)
        samples = scrape(metrics_port)
        assert value(samples, "gridcomm_ranks_joined") == 2 and value(samples, "gridcomm_ranks_connected") == 2
        assert value(samples, "gridcomm_rank_failures_total") == 0 and value(samples, "gridcomm_serving") == 1
        assert value(samples, "gridcomm_barriers_completed_total") >= 1
        # Two ranks keep nobody's loop behind: well under the liveness bound in all.
        assert 0 <= value(samples, "gridcomm_coordinator_loop_lag_seconds_total") < 5
        for r in ranks:
            r.send("")
        for r in ranks:
            assert r.wait(60) == 0, r.report()
    finally:
        kill_all(ranks)
