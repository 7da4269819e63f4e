"""Prometheus metrics at /metrics: `gridcomm serve --metrics-port` and GRIDCOMM_METRICS_PORT on
rank 0, scraped over HTTP from real processes and parsed with prometheus_client's own parser."""

from __future__ import annotations

import gzip
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

import gridcomm
from gridcomm import _config
from gridcomm._coordinator import metrics
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
    # A 1 s linger: rank 0's clean end keeps /metrics up that long (the default 30 s would only slow this test).
    env = {"GRIDCOMM_PORT": str(port), "GRIDCOMM_HOST": "127.0.0.1", "GRIDCOMM_BIND": "127.0.0.1",
           "GRIDCOMM_METRICS_PORT": str(metrics_port), "GRIDCOMM_METRICS_LINGER_S": "1"}
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


# ---------------------------------------------------------------------- after a failure (issue 26, item 1)

LOOP = r"""
import os, time, gridcomm
rank = int(os.environ["GRIDCOMM_RANK"])
try:
    with gridcomm.init_process_group(3, rank, backend="host") as comm:
        comm.barrier("up")
        print("UP", flush=True)
        while True:
            comm.barrier("tick")
            time.sleep(0.05)
except gridcomm.RankFailedError as exc:
    print("FAILED", exc.rank, flush=True)
"""


def try_scrape(port: int, timeout_s: float = 2.0) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout_s) as answer:
            text = answer.read().decode()
    except OSError:
        return None
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.mark.timeout(120)
def test_a_scraper_sees_the_failure_of_a_killed_rank_on_rank_zeros_metrics():
    """Three embedded ranks; rank 1 is killed (-9) and an outside scraper polls rank 0's /metrics
    every 0.5 s. Rank 0 hears of the failure ~2 s later and stops; its metrics must stay up for
    the linger so the scrapes see the failure, also through the SIGTERM Kubernetes sends it when
    another rank's exit fails the Job, and then the process must end (within the linger)."""
    linger = 6.0
    port, metrics_port = free_port(), free_port()
    env = {"GRIDCOMM_PORT": str(port), "GRIDCOMM_HOST": "127.0.0.1", "GRIDCOMM_BIND": "127.0.0.1",
           "GRIDCOMM_METRICS_PORT": str(metrics_port), "GRIDCOMM_METRICS_LINGER_S": f"{linger:g}",
           "GRIDCOMM_TIMEOUT_S": "60"}
    ranks = [Rank(r, LOOP, {**env, "GRIDCOMM_RANK": str(r)}) for r in range(3)]
    try:
        for r in ranks:
            r.expect("UP", 60)
        killed = time.monotonic()
        ranks[1].proc.kill()
        seen: list[tuple[float, float, float]] = []  # (s after the kill, failures_total, ranks{failed})
        termed = None
        while ranks[0].proc.poll() is None and time.monotonic() - killed < 60:
            samples = try_scrape(metrics_port)
            if samples is not None and value(samples, "gridcomm_rank_failures_total") > 0:
                seen.append((time.monotonic() - killed, value(samples, "gridcomm_rank_failures_total"),
                             value(samples, "gridcomm_ranks", state="failed")))
                if termed is None and "so the last scrapes see the failure of rank(s) 1" in ranks[0].stderr():
                    ranks[0].proc.send_signal(signal.SIGTERM)  # as the Job controller does once rank 2 exits 3
                    termed = time.monotonic()
            time.sleep(0.5)  # the scrape interval under test
        assert seen, f"no scrape saw the failure\n{ranks[0].report()}"
        assert all(total == 1 and failed == 1 for _, total, failed in seen), seen
        assert termed is not None, ranks[0].report()
        after_term = [t for t, _, _ in seen if t > termed - killed]
        assert len(after_term) >= 2, (seen, termed - killed)  # still scraped after the SIGTERM
        assert ranks[0].wait(30) == -signal.SIGTERM, ranks[0].report()  # the held SIGTERM is delivered
        ended = time.monotonic() - killed
        # Within the linger of rank 0's stop (which comes ~2 s after the kill), with room for a loaded machine.
        assert ended < 2 + linger + 10, (ended, ranks[0].report())
        assert ranks[2].expect("FAILED", 30) == "FAILED 1" and ranks[2].wait(30) == 0, ranks[2].report()
    finally:
        kill_all(ranks)


# ---------------------------------------------------------------------- a bounded server (issue 26, item 3)


def timed_scrape(port: int) -> float:
    """Seconds one scrape took (it must answer 200 with the series)."""
    started = time.monotonic()
    samples = scrape(port)
    assert value(samples, "gridcomm_coordinator_responsive") == 1
    return time.monotonic() - started


def closed_by_peer(sock: socket.socket, timeout_s: float) -> bool:
    """Whether the server closes ``sock`` (EOF or reset) within ``timeout_s``."""
    sock.settimeout(timeout_s)
    try:
        while sock.recv(4096):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def serve_metrics_port(proc_line: str) -> int:
    return int(proc_line.rsplit("metrics on port ", 1)[1].rstrip(")\n"))


@pytest.mark.timeout(90)
def test_idle_and_trickling_connections_do_not_hold_a_scrape():
    """Ten idle sockets and one client sending a header byte every 2 s, all without a token: a
    scrape still answers at once (bound: well inside Prometheus's 10 s scrape timeout), and the
    server closes every one of them at its deadline from accept."""
    with serving(["--world-size", "2", "--bind", "127.0.0.1", "--port", "0", "--metrics-port", "0"], ENV) as (_, line):
        port = serve_metrics_port(line)
        timed_scrape(port)  # first scrape: imports the exposition code
        idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(10)]
        trickler = socket.create_connection(("127.0.0.1", port), timeout=5)
        stop = threading.Event()

        def trickle() -> None:
            for byte in b"GET /metrics HTTP/1.1\r\nHost: x\r\n":
                try:
                    trickler.send(bytes([byte]))
                except OSError:
                    return
                if stop.wait(2.0):
                    return

        thread = threading.Thread(target=trickle, daemon=True)
        thread.start()
        try:
            time.sleep(0.3)  # let the server accept them first (a scrape after them, not before)
            took = [timed_scrape(port) for _ in range(3)]
            assert max(took) < 3.0, took
            bound = metrics.REQUEST_DEADLINE_S + 10.0
            assert all(closed_by_peer(sock, bound) for sock in idle), "an idle socket stayed open"
            assert closed_by_peer(trickler, bound), "the trickling client was not cut off"
        finally:
            stop.set()
            thread.join(5)
            for sock in (*idle, trickler):
                sock.close()


def tasks_and_fds(pid: int) -> tuple[int, int]:
    return len(os.listdir(f"/proc/{pid}/task")), len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.timeout(90)
def test_many_connections_grow_neither_threads_nor_descriptors():
    """200 connections at once: the serving process keeps its threads (a fixed pool), holds at most
    MAX_CONNECTIONS of them open (the oldest idle ones are evicted), and a scrape still answers."""
    with serving(["--world-size", "2", "--bind", "127.0.0.1", "--port", "0", "--metrics-port", "0"], ENV) as (proc, line):
        port = serve_metrics_port(line)
        timed_scrape(port)
        threads_before, fds_before = tasks_and_fds(proc.pid)
        socks = []
        try:
            for _ in range(200):
                socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            time.sleep(0.5)  # let the server accept what it will
            threads, fds = tasks_and_fds(proc.pid)
            assert threads <= threads_before, (threads_before, threads)
            assert fds <= fds_before + metrics.MAX_CONNECTIONS + 2, (fds_before, fds)
            assert timed_scrape(port) < 3.0
            evicted = sum(closed_by_peer(sock, 0.05) for sock in socks[:100])
            assert evicted >= 100 - metrics.MAX_CONNECTIONS, evicted
            assert tasks_and_fds(proc.pid)[0] <= threads_before
        finally:
            for sock in socks:
                sock.close()


def http(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.timeout(60)
def test_bad_requests_get_readable_http_errors_and_the_port_keeps_serving(coordinator_factory):
    server = coordinator_factory(2, metrics_port=0)
    port = server.metrics_port
    assert http(port, b"POST /metrics HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.1 405 ")
    assert http(port, b"GET /other HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 404 ")
    assert http(port, b"\x16\x03\x01 garbage\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    assert http(port, b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 10000).startswith(b"HTTP/1.1 431 ")
    head = http(port, b"HEAD /metrics HTTP/1.0\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and head.endswith(b"\r\n\r\n"), head
    plain = http(port, b"GET /metrics HTTP/1.1\n\n")  # bare LF, as typed by hand
    assert plain.startswith(b"HTTP/1.1 200 ") and b"gridcomm_world_size 2.0" in plain
    zipped = http(port, b"GET /metrics HTTP/1.1\r\nAccept-Encoding: gzip\r\n"
                        b"Accept: application/openmetrics-text; version=1.0.0\r\n\r\n")
    head, _, body = zipped.partition(b"\r\n\r\n")
    assert b"Content-Encoding: gzip" in head and b"application/openmetrics-text" in head, head
    assert gzip.decompress(body).endswith(b"# EOF\n")
    assert value(scrape(port), "gridcomm_world_size") == 2


def test_metrics_linger_setting_is_checked():
    assert _config.CoordinatorSettings.resolve(2, environ={}).metrics_linger_s == 30.0
    assert _config.CoordinatorSettings.resolve(2, environ={"GRIDCOMM_METRICS_LINGER_S": "0"}).metrics_linger_s == 0
    for bad in ("-1", "soon", "601"):
        with pytest.raises(gridcomm.ConfigError, match="GRIDCOMM_METRICS_LINGER_S"):
            _config.CoordinatorSettings.resolve(2, environ={"GRIDCOMM_METRICS_LINGER_S": bad})


# ---------------------------------------------------------------------- a real Prometheus (issue 26, item 1)
PROMETHEUS = shutil.which("prometheus")


def prometheus_api(port: int, path: str) -> dict:
    import json

    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
        body = json.loads(answer.read().decode())
    assert body["status"] == "success", body
    return body["data"]  # type: ignore[no-any-return]


def instant(port: int, query: str) -> float | None:
    """The value of an instant query with one series in its answer (None when it has none)."""
    result = prometheus_api(port, "/api/v1/query?query=" + urllib.parse.quote(query))["result"]
    return float(result[0]["value"][1]) if result else None


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus (Debian's package) is not installed")
@pytest.mark.timeout(150)
def test_a_real_prometheus_scraping_rank_zero_fires_the_failure_alert_after_a_kill(tmp_path):
    """What the issue found with Prometheus 2.42 scraping every 2 s: after rank 1 was killed,
    ``max_over_time(gridcomm_ranks{state="failed"}[2m])`` stayed 0 and the shipped "a rank failed"
    alert never fired, because rank 0's metrics went dark first. Here Debian's prometheus server
    scrapes rank 0 every second with deploy/monitoring's rules loaded: both must see the failure."""
    linger = 8.0
    port, metrics_port, prom_port = free_port(), free_port(), free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"rule_files:\n  - {ROOT}/deploy/monitoring/gridcomm-rules.yaml\n"
        f"scrape_configs:\n  - job_name: gridcomm\n    static_configs:\n      - targets: ['127.0.0.1:{metrics_port}']\n")
    prom = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "w"))  # noqa: SIM115
    env = {"GRIDCOMM_PORT": str(port), "GRIDCOMM_HOST": "127.0.0.1", "GRIDCOMM_BIND": "127.0.0.1",
           "GRIDCOMM_METRICS_PORT": str(metrics_port), "GRIDCOMM_METRICS_LINGER_S": f"{linger:g}",
           "GRIDCOMM_TIMEOUT_S": "60"}
    ranks = [Rank(r, LOOP, {**env, "GRIDCOMM_RANK": str(r)}) for r in range(3)]
    try:
        for r in ranks:
            r.expect("UP", 60)
        # Scraped while healthy first (the counter's 0 is what increase() starts from).
        deadline = time.monotonic() + 60
        while instant(prom_port, 'up{job="gridcomm"}') != 1.0 or instant(prom_port, "gridcomm_rank_failures_total") != 0:
            assert time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()[-2000:]
            time.sleep(0.5)
        killed = time.monotonic()
        ranks[1].proc.kill()
        failed_max = firing = None
        while time.monotonic() - killed < linger + 20 and not (failed_max and firing):
            failed_max = instant(prom_port, 'max_over_time(gridcomm_ranks{state="failed"}[2m])')
            alerts = prometheus_api(prom_port, "/api/v1/alerts")["alerts"]
            firing = firing or [a for a in alerts if a["labels"]["alertname"] == "GridcommRankFailed"
                                and a["state"] == "firing"]
            time.sleep(0.5)
        seen_after = time.monotonic() - killed
        print(f"\nPrometheus (1 s scrapes): gridcomm_ranks{{state=\"failed\"}} max {failed_max}, GridcommRankFailed "
              f"{'firing' if firing else 'not firing'}, {seen_after:.1f} s after the kill")
        assert failed_max == 1.0, (failed_max, ranks[0].report())
        assert firing, (prometheus_api(prom_port, "/api/v1/alerts"), ranks[0].report())
        assert instant(prom_port, "max_over_time(gridcomm_rank_failures_total[2m])") == 1.0
    finally:
        kill_all(ranks)
        prom.kill()
        prom.wait(10)
