"""deploy/monitoring's alert rules, tested with Prometheus's own rule engine (`promtool test rules`)
against series scraped from a real coordinator's /metrics: a rank stalled (and so failed), and a
rank that went quiet while the job forms. Skips where promtool is missing (`.ci/run` installs
Debian's prometheus package)."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
import urllib.request

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

import gridcomm
from gridcomm._client.tracker import Tracker
from tests.support.procs import ROOT, wait_for
from tests.support.ranks import free_port

RULES = os.path.join(ROOT, "deploy", "monitoring", "gridcomm-rules.yaml")
OPERATOR_RULES = os.path.join(ROOT, "deploy", "monitoring", "prometheusrule.yaml")
PROMTOOL = shutil.which("promtool")


def scrape(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """{sample name: {sorted labels: value}} of one scrape."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def series(name: str, labels: dict[str, str], values: list[float]) -> dict[str, str]:
    """One promtool input series: ``values`` one minute apart."""
    label_text = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return {"series": f"{name}{{{label_text}}}", "values": " ".join(f"{v:g}" for v in values)}


def annotations(alert: str, labels: dict[str, str]) -> dict[str, str]:
    """The rule's annotations as Prometheus renders them for ``labels`` (what promtool compares)."""
    with open(RULES, encoding="utf-8") as handle:
        rules = [r for g in yaml.safe_load(handle)["groups"] for r in g["rules"]]
    (rule,) = [r for r in rules if r.get("alert") == alert]
    out = {}
    for key, text in rule.get("annotations", {}).items():
        for name, value in labels.items():
            text = text.replace("{{ $labels." + name + " }}", value)
        out[key] = text
    return out


def expect(alert: str, **labels: str) -> dict:
    return {"exp_labels": labels, "exp_annotations": annotations(alert, labels)}


def promtool_test(tmp_path, tests: list[dict]) -> subprocess.CompletedProcess:
    spec = tmp_path / "alerts-test.yaml"
    spec.write_text(yaml.safe_dump({"rule_files": [RULES], "evaluation_interval": "1m", "tests": tests}))
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, "test", "rules", str(spec)], capture_output=True, text=True, timeout=60)


def test_the_operator_rules_are_the_plain_rules():
    with open(RULES, encoding="utf-8") as plain, open(OPERATOR_RULES, encoding="utf-8") as operator:
        rule = yaml.safe_load(operator)
        assert rule["kind"] == "PrometheusRule" and rule["spec"] == yaml.safe_load(plain)


@pytest.mark.skipif(PROMTOOL is None, reason="promtool (Debian's prometheus package) is not installed")
@pytest.mark.timeout(120)
def test_a_stalled_rank_fires_the_failure_and_stall_alerts(tmp_path, coordinator_factory):
    metrics = free_port()
    # Three ranks: a laggard is named only when the ranks ahead of it are the majority.
    server = coordinator_factory(3, heartbeat_timeout_s=1.0, stall_timeout_s=1.0, metrics_port=metrics)
    clients = [gridcomm.CoordinatorClient("127.0.0.1", server.port, r, 3, timeout_s=20) for r in range(3)]
    threads = [threading.Thread(target=c.join) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    trackers = [Tracker("world", c.generation) for c in clients]
    for client, tracker in zip(clients, trackers, strict=True):
        client.track(tracker)
    before = scrape(metrics)
    trackers[0].enter("all_reduce")  # ranks 0 and 2 wait in all_reduce #1; rank 1 never enters it
    trackers[2].enter("all_reduce")
    wait_for(lambda: server.state.failures, "the stall is named", 30)
    after = scrape(metrics)
    for c in clients:
        c.close()
    assert server.state.failures[0].rank == 1 and server.state.failures[0].cause == "stall"
    failures = [before["gridcomm_rank_failures_total"][()]] * 3 + [after["gridcomm_rank_failures_total"][()]] * 8
    stalls = [before["gridcomm_hangs_total"][(("cause", "stall"),)]] * 3 + \
        [after["gridcomm_hangs_total"][(("cause", "stall"),)]] * 8
    assert failures[-1] > failures[0] and stalls[-1] > stalls[0]
    result = promtool_test(tmp_path, [{
        "interval": "1m",
        "input_series": [series("gridcomm_rank_failures_total", {"job": "gridcomm"}, failures),
                         series("gridcomm_hangs_total", {"job": "gridcomm", "cause": "stall"}, stalls)],
        "alert_rule_test": [
            {"eval_time": "2m", "alertname": "GridcommRankFailed", "exp_alerts": []},
            {"eval_time": "5m", "alertname": "GridcommRankFailed",
             "exp_alerts": [expect("GridcommRankFailed", severity="page", job="gridcomm")]},
            {"eval_time": "5m", "alertname": "GridcommRankStalled",
             "exp_alerts": [expect("GridcommRankStalled", severity="page", job="gridcomm", cause="stall")]},
        ],
    }])
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(PROMTOOL is None, reason="promtool (Debian's prometheus package) is not installed")
@pytest.mark.timeout(120)
def test_a_rank_that_went_quiet_fires_the_quiet_alert_after_two_minutes(tmp_path, coordinator_factory):
    metrics = free_port()
    server = coordinator_factory(2, heartbeat_timeout_s=1.0, metrics_port=metrics)
    client = gridcomm.CoordinatorClient("127.0.0.1", server.port, 0, 2, timeout_s=1.0)
    with pytest.raises(gridcomm.RendezvousTimeout):
        client.join()  # rank 0 joined, then went quiet (its process hangs); rank 1 never came
    time.sleep(1.6)  # past the heartbeat timeout: joined, not connected
    quiet = scrape(metrics)
    client.close()
    connected = quiet["gridcomm_ranks_connected"][()]
    joined = quiet["gridcomm_ranks"][(("state", "joined"),)]
    assert connected < joined, quiet
    inputs = [series("gridcomm_ranks_connected", {"job": "gridcomm"}, [connected] * 6),
              series("gridcomm_ranks", {"job": "gridcomm", "state": "joined"}, [joined] * 6)]
    result = promtool_test(tmp_path, [{
        "interval": "1m",
        "input_series": inputs,
        "alert_rule_test": [
            {"eval_time": "1m", "alertname": "GridcommRanksQuiet", "exp_alerts": []},  # not yet for 2 m
            {"eval_time": "4m", "alertname": "GridcommRanksQuiet",
             "exp_alerts": [expect("GridcommRanksQuiet", severity="warning", job="gridcomm")]},
        ],
    }])
    assert result.returncode == 0, result.stdout + result.stderr
