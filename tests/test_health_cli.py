"""grpc.health.v1 on the coordinator port, and the `gridcomm probe` / `status` / `serve` commands."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import gridcomm
from tests.support.procs import ROOT
from tests.support.ranks import serving

ENV = dict(os.environ, PYTHONPATH=ROOT)


def gridcomm_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gridcomm", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("service", ["", "gridcomm.v1.Coordinator"])
def test_standard_health_client_sees_serving(coordinator_factory, service):
    server = coordinator_factory(2)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.timeout(30)
def test_health_needs_no_token(coordinator_factory):
    server = coordinator_factory(1, token="secret")
    assert gridcomm_cli("probe", f"127.0.0.1:{server.port}").returncode == 0


@pytest.mark.timeout(60)
def test_probe_exit_codes(coordinator_factory):
    server = coordinator_factory(2)
    ok = gridcomm_cli("probe", f"127.0.0.1:{server.port}")
    assert ok.returncode == 0, ok.stderr
    assert "SERVING" in ok.stdout

    unknown = gridcomm_cli("probe", f"127.0.0.1:{server.port}", "--service", "nope")
    assert unknown.returncode == 3 and "NOT_FOUND" in unknown.stderr

    # A rank reports a failure: the coordinator turns NOT_SERVING.
    clients = [gridcomm.CoordinatorClient("127.0.0.1", server.port, r, 2, timeout_s=10) for r in range(2)]

    threads = [threading.Thread(target=c.join) for c in clients]
    [t.start() for t in threads]
    [t.join(10) for t in threads]
    clients[1].report_failure("test failure")
    # The coordinator's readiness follows the job; its liveness ("") only says it answers.
    bad = gridcomm_cli("probe", f"127.0.0.1:{server.port}", "--service", "gridcomm.v1.Coordinator")
    assert bad.returncode == 4 and "NOT_SERVING" in bad.stderr
    live = gridcomm_cli("probe", f"127.0.0.1:{server.port}")
    assert live.returncode == 0, live.stderr

    with socket.socket() as sock:  # a port with nothing listening
        sock.bind(("127.0.0.1", 0))
        free = sock.getsockname()[1]
    down = gridcomm_cli("probe", f"127.0.0.1:{free}", "--timeout-s", "1")
    assert down.returncode == 2 and str(free) in down.stderr
    assert len(down.stderr.strip().splitlines()) == 1
    assert "connection refused" in down.stderr, down.stderr

    assert gridcomm_cli("probe", "not-an-address").returncode == 1


@pytest.mark.timeout(60)
def test_serve_and_status(tmp_path):
    with serving(["--world-size", "3", "--bind", "127.0.0.1", "--port", "0"], ENV) as (proc, line):
        assert "listening on 127.0.0.1:" in line, line + proc.stderr.read()
        port = int(line.rsplit(":", 1)[1])
        client = gridcomm.CoordinatorClient("127.0.0.1", port, 1, 3, timeout_s=0.5)
        with pytest.raises(gridcomm.RendezvousTimeout):
            client.join()
        status = gridcomm_cli("status", f"127.0.0.1:{port}")
        assert status.returncode == 0, status.stderr
        assert "1 of 3 ranks joined" in status.stdout
        assert "missing ranks (2): [0, 2]" in status.stdout
        client.close()
    assert proc.returncode == 0


@pytest.mark.timeout(120)
def test_demo_prints_its_table():
    result = gridcomm_cli("demo", "--nproc", "3", "--iters", "5", "--backend", "host", timeout=100)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all checks passed" in result.stdout
    assert result.stdout.count("  ok") == 10 and "WRONG" not in result.stdout



@pytest.mark.timeout(60)
def test_probe_fails_at_once_on_a_refused_connection_as_kubelet_does():
    """A refusal is an answer (the host is up, nothing listens): kubelet's gRPC probe and grpc-js
    fail in milliseconds, and so does ours, however long its timeout. Timed against the same
    command's start-up (a probe of a bad address), not against a constant."""
    started = time.monotonic()
    assert gridcomm_cli("probe", "not-an-address").returncode == 1
    startup = time.monotonic() - started
    started = time.monotonic()
    down = gridcomm_cli("probe", "127.0.0.1:1", "--timeout-s", "30", timeout=60)
    took = time.monotonic() - started
    assert down.returncode == 2 and "connection refused" in down.stderr, down.stderr
    # 30 s of dialling would be far more than start-up plus a generous margin on a loaded machine.
    assert took < startup + 10, (took, startup)


@pytest.mark.timeout(90)
def test_status_keeps_dialling_until_its_deadline(coordinator_factory):
    """A port that opens 1.5 s after `status` started (a job still starting, a port-forward being
    set up): the operator's command dials until its timeout (`probe` answers a refusal at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for command in (["status", f"127.0.0.1:{port}"],):
        proc = subprocess.Popen([sys.executable, "-m", "gridcomm", *command, "--timeout-s", "20"], env=ENV,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            time.sleep(1.5)  # the probe is dialling a closed port meanwhile
            server = coordinator_factory(2, port=port)
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        assert proc.returncode == 0, (command, out, err)
        server.stop()
