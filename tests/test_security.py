"""Token, TLS and mTLS: happy paths and every wrong-credential path, over real gRPC."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import grpc
import pytest

import gridcomm
from gridcomm import _config
from gridcomm._wire import WIRE
from tests.support.procs import ROOT, RankProcesses, report
from tests.support.tls import tls_env

pytestmark = pytest.mark.skipif(subprocess.run(["which", "openssl"], capture_output=True).returncode != 0,
                                reason="needs the openssl command to make test certificates")


def server_tls(pki: dict[str, str], mtls: bool = False) -> _config.TlsFiles:
    files = _config.tls(tls_env(pki, mtls=mtls))
    assert files is not None
    return files


def client_tls(pki: dict[str, str], **kw) -> _config.TlsFiles:
    env = tls_env(pki, **kw)
    del env["GRIDCOMM_TLS_CERT"], env["GRIDCOMM_TLS_KEY"]  # a rank without the server's key
    files = _config.tls(env)
    assert files is not None
    return files


def join_one(port: int, tls, **kw) -> int:
    client = gridcomm.CoordinatorClient("localhost", port, 0, 1, timeout_s=kw.pop("timeout_s", 10.0), tls=tls, **kw)
    try:
        generation = client.join()
        client.set("id", b"\x01" * 128)
        assert client.get("id") == b"\x01" * 128
        client.leave()
        return generation
    finally:
        client.close()


@pytest.mark.timeout(60)
def test_tls_happy_path(coordinator_factory, pki):
    server = coordinator_factory(1, tls=server_tls(pki))
    assert join_one(server.port, client_tls(pki)) == 1


@pytest.mark.timeout(60)
def test_plaintext_client_cannot_talk_to_tls_server(coordinator_factory, pki):
    server = coordinator_factory(1, tls=server_tls(pki))
    client = gridcomm.CoordinatorClient("127.0.0.1", server.port, 0, 1, timeout_s=1.5, tls=None)
    client.tls = None
    with pytest.raises(gridcomm.CoordinatorUnavailable):
        client.join()
    client.close()


@pytest.mark.timeout(60)
def test_client_trusting_another_ca_is_refused(coordinator_factory, pki):
    server = coordinator_factory(1, tls=server_tls(pki))
    with pytest.raises(gridcomm.CoordinatorUnavailable):
        join_one(server.port, client_tls(pki, ca="rogue-ca"), timeout_s=1.5)


@pytest.mark.timeout(60)
def test_mtls_happy_path_and_wrong_client_certificates(coordinator_factory, pki):
    server = coordinator_factory(1, tls=server_tls(pki, mtls=True))
    assert join_one(server.port, client_tls(pki, client="client")) == 1
    with pytest.raises(gridcomm.CoordinatorUnavailable):
        join_one(server.port, client_tls(pki), timeout_s=1.5)  # no client certificate
    with pytest.raises(gridcomm.CoordinatorUnavailable):
        join_one(server.port, client_tls(pki, client="rogue-client"), timeout_s=1.5)


@pytest.mark.timeout(60)
def test_token_on_top_of_tls(coordinator_factory, pki):
    server = coordinator_factory(1, tls=server_tls(pki), token="t0k")
    with pytest.raises(gridcomm.AuthenticationError):
        join_one(server.port, client_tls(pki), token="wrong")
    assert join_one(server.port, client_tls(pki), token="t0k") == 1


@pytest.mark.timeout(60)
def test_plaintext_health_port_beside_a_tls_main_port(coordinator_factory, pki):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        health_port = sock.getsockname()[1]
    server = coordinator_factory(1, tls=server_tls(pki), health_port=health_port)
    env = dict(os.environ, PYTHONPATH=ROOT)
    probe = subprocess.run([sys.executable, "-m", "gridcomm", "probe", f"127.0.0.1:{server.health_port}"],
                           capture_output=True, text=True, timeout=30, env=env)
    assert probe.returncode == 0, probe.stderr
    # The plaintext port carries health only: the coordinator service is not there.
    import grpc

    from gridcomm._proto import coordinator_pb2 as pb
    from gridcomm._proto import coordinator_pb2_grpc as pb_grpc

    with grpc.insecure_channel(f"127.0.0.1:{health_port}") as channel:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.CoordinatorStub(channel).Status(pb.StatusRequest(), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    # And the main port does not answer plaintext health checks.
    plain = subprocess.run([sys.executable, "-m", "gridcomm", "probe", f"127.0.0.1:{server.port}", "--timeout-s", "1"],
                           capture_output=True, text=True, timeout=30, env=env)
    assert plain.returncode != 0


@pytest.mark.timeout(90)
def test_init_process_group_over_mtls_with_token(pki):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = tls_env(pki, mtls=True, client="client")
    env.update(GRIDCOMM_HOST="localhost", GRIDCOMM_PORT=str(port), GRIDCOMM_BIND="127.0.0.1",
               GRIDCOMM_BACKEND="host", GRIDCOMM_TOKEN="shared-secret", GRIDCOMM_TIMEOUT_S="30",
               GRIDCOMM_TLS_SERVER_NAME="localhost")
    code = """
import numpy as np, gridcomm
with gridcomm.init_process_group() as comm:
    x = np.arange(5, dtype=np.float64) * (comm.rank + 1)
    comm.all_reduce(x, x)
    assert (x == np.arange(5) * 3).all(), x
    comm.barrier()
print("OK", flush=True)
"""
    results = RankProcesses(code, 2, env=env).wait(60)
    for rank in (0, 1):
        assert results[rank].returncode == 0 and "OK" in results[rank].stdout, report(results)


def test_tls_settings_errors(tmp_path):
    with pytest.raises(gridcomm.ConfigError, match="GRIDCOMM_TLS_CERT and GRIDCOMM_TLS_KEY"):
        cert = tmp_path / "c.pem"
        cert.write_text("x")
        _config.tls({"GRIDCOMM_TLS_CERT": str(cert)})
    with pytest.raises(gridcomm.ConfigError, match="cannot be read"):
        _config.tls({"GRIDCOMM_TLS_CA": str(tmp_path / "missing.pem")})
    with pytest.raises(gridcomm.ConfigError, match="needs GRIDCOMM_TLS_CA"):
        _config.tls({"GRIDCOMM_TLS_REQUIRE_CLIENT_CERT": "1", "GRIDCOMM_TLS_CLIENT_CERT": str(cert),
                     "GRIDCOMM_TLS_CLIENT_KEY": str(cert)})
    assert _config.tls({}) is None


@pytest.mark.timeout(60)
def test_tls_on_both_hops_of_a_relay(coordinator_factory, pki):
    from gridcomm._relay.server import Relay

    world = 3
    server = coordinator_factory(world, tls=server_tls(pki), token="t0ken", bind="127.0.0.1")
    # The relay serves with the job's certificate and dials the coordinator over TLS with the token.
    relay = Relay(f"localhost:{server.port}", token="t0ken", tls=server_tls(pki)).start()
    try:
        clients = [gridcomm.CoordinatorClient("localhost", server.port, r, world, token="t0ken", timeout_s=20,
                                              tls=client_tls(pki), relay=relay.target) for r in range(world)]
        errors: list[str] = []

        def run(c: gridcomm.CoordinatorClient) -> None:
            try:
                c.join()
                if c.rank == 0:
                    c.set("id", b"\x02" * 128)
                assert c.get("id") == b"\x02" * 128
                c.barrier("tls")
                assert c.relay_target == relay.target  # still through the relay
                c.leave()
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(repr(exc))

        threads = [threading.Thread(target=run, args=(c,)) for c in clients]
        [t.start() for t in threads]
        [t.join(30) for t in threads]
        assert not errors, errors
        assert relay.carried >= world  # the operations went through the relay
        # A plaintext dial of the relay gets no answer from it.
        channel = grpc.insecure_channel(relay.target)
        with pytest.raises(grpc.RpcError):
            list(channel.stream_stream("/gridcomm.v1.Coordinator/Session")(iter([b""]), timeout=3))
        channel.close()
    finally:
        relay.stop()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("inherit", ["", "1"])
def test_the_token_is_taken_out_of_the_environment_once_read(inherit):
    """A rank's children (a data loader, a shell-out) do not inherit GRIDCOMM_TOKEN unless
    GRIDCOMM_TOKEN_INHERIT asks; the rank itself keeps using it."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, GRIDCOMM_HOST="127.0.0.1", GRIDCOMM_PORT=str(port), GRIDCOMM_BIND="127.0.0.1",
               GRIDCOMM_BACKEND="host", GRIDCOMM_TOKEN="shared-secret", GRIDCOMM_TIMEOUT_S="30",
               GRIDCOMM_TOKEN_INHERIT=inherit)
    code = """
import os, subprocess, sys
import numpy as np, gridcomm
from gridcomm import _config
with gridcomm.init_process_group() as comm:
    child = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('GRIDCOMM_TOKEN'))"],
                           capture_output=True, text=True, timeout=30).stdout.strip()
    print("CHILD", child, flush=True)
    assert _config.token() == "shared-secret"  # read again in the rank: still the token
    x = np.ones(3) * (comm.rank + 1)
    comm.all_reduce(x, x)
    assert (x == 3).all(), x
print("OK", flush=True)
"""
    results = RankProcesses(code, 2, env=env).wait(60)
    expected = "shared-secret" if inherit else "None"
    for rank in (0, 1):
        assert results[rank].returncode == 0 and "OK" in results[rank].stdout, report(results)
        assert f"CHILD {expected}" in results[rank].stdout, report(results)


@pytest.mark.timeout(60)
def test_a_token_holder_cannot_learn_an_incarnation_or_act_as_another_rank(coordinator_factory):
    """Status, the join answer and every refusal show a process tag, never the incarnation that
    proves a call comes from a rank's process; forged heartbeats and failure reports for another
    rank are refused and change nothing."""
    from gridcomm._proto import coordinator_pb2 as pb
    from gridcomm._proto import coordinator_pb2_grpc as pb_grpc

    server = coordinator_factory(2, token="t0ken", heartbeat_timeout_s=30)
    clients = [gridcomm.CoordinatorClient("127.0.0.1", server.port, r, 2, token="t0ken", timeout_s=20)
               for r in range(2)]
    try:
        joins = [threading.Thread(target=c.join) for c in clients]
        for t in joins:
            t.start()
        for t in joins:
            t.join(30)
        secret = clients[1].incarnation
        auth = (("authorization", "Bearer t0ken"),)
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            status = stub.Status(pb.StatusRequest(), metadata=auth, timeout=10)
            assert len(status.members) == 2
            assert all(m.incarnation == 0 and len(m.process_tag) == 8 for m in status.members), status.members
            assert len({m.process_tag for m in status.members}) == 2
            assert f"{secret:x}" not in str(status) and str(secret) not in str(status)
            # A second process for rank 1: refused, and the refusal does not name the holder's incarnation.
            with pytest.raises(grpc.RpcError) as refused:
                stub.Join(pb.JoinRequest(wire=WIRE, job_id=status.job_id, rank=1, world_size=2, incarnation=12345,
                                         hostname="intruder", wait_s=0.2), metadata=auth, timeout=10)
            assert f"{secret:x}" not in (refused.value.details() or "")
            # What Status shows, used as rank 1's identity: refused.
            for shown in (0, int(status.members[1].process_tag, 16)):
                forged = pb.Caller(job_id=status.job_id, rank=1, incarnation=shown,
                                    generation=status.generation + 1)  # the wire's numbering
                for rpc, request in (("Heartbeat", pb.HeartbeatRequest(caller=forged, wait_s=0)),
                                     ("ReportFailure", pb.ReportFailureRequest(caller=forged, reason="forged"))):
                    with pytest.raises(grpc.RpcError) as info:
                        getattr(stub, rpc)(request, metadata=auth, timeout=10)
                    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, (rpc, info.value.details())
                    assert f"{secret:x}" not in (info.value.details() or "")
            after = stub.Status(pb.StatusRequest(), metadata=auth, timeout=10)
            assert not after.failures and after.serving, after
        for c in clients:
            c.leave()
    finally:
        for c in clients:
            c.close()
