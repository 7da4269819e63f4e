"""TLS on every hop of the relay tree (gridcomm/_relay/tls.py), whatever TLS files the ranks
have: a relay serves what its members dial, and a relay its members could not dial is a ConfigError
at start, never a timeout.

Real coordinators over TLS, a real relay, and one OS process per group of ranks where ranks dial
their relay (the tree: GRIDCOMM_RELAY=on, fan-in 4, rank 0 hosts the relay of ranks 0-3).
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

import gridcomm
from gridcomm import _config
from gridcomm._relay.server import Relay
from tests.support.procs import RankProcesses, assert_all_ok
from tests.support.tls import tls_env

pytestmark = pytest.mark.skipif(subprocess.run(["which", "openssl"], capture_output=True).returncode != 0,
                                reason="needs the openssl command to make test certificates")

TOKEN = "relay-tls-token"

#: Each process runs THREADS ranks (rank = process x THREADS + thread), one CoordinatorClient each.
WORKER = """
import json, os, threading, gridcomm
proc, threads, world = int(os.environ["GRIDCOMM_RANK"]), int(os.environ["THREADS"]), int(os.environ["WORLD"])
out = {}
def run(c):
    try:
        c.join()
        if c.rank == 0:
            c.set("blob", b"t" * 100)
        assert c.get("blob") == b"t" * 100
        for _ in range(3):
            c.barrier("tls")
        out[c.rank] = {"ok": True, "relayed": c.relay_target is not None, "hosts": c.relay is not None}
        c.leave()
    except Exception as exc:
        out[c.rank] = {"ok": False, "error": repr(exc)[:400]}
clients = [gridcomm.CoordinatorClient("127.0.0.1", int(os.environ["PORT"]), proc * threads + t, world, token=os.environ[
    "TOKEN"], timeout_s=float(os.environ.get("TIMEOUT_S", "30"))) for t in range(threads)]
ts = [threading.Thread(target=run, args=(c,)) for c in clients]
[t.start() for t in ts]
[t.join(90) for t in ts]
print(json.dumps(out), flush=True)
"""


def coordinator_tls(pki: dict[str, str], mtls: bool = False) -> _config.TlsFiles:
    files = _config.tls(tls_env(pki, mtls=mtls))
    assert files is not None
    return files


def rank_env(pki: dict[str, str], shape: str, mtls: bool = False) -> dict[str, str]:
    """The ranks' TLS files: ``shared`` (the coordinator's certificate and the CA), ``client`` (the
    CA and a per-rank client certificate), ``client+serving`` (both), ``ca`` (the CA only)."""
    env = tls_env(pki, mtls=mtls, client="client" if "client" in shape else None)
    if shape in ("client", "ca"):
        del env["GRIDCOMM_TLS_CERT"], env["GRIDCOMM_TLS_KEY"]
    return env


def run_tree(server, pki, shape: str, relay: str, *, mtls: bool = False, procs: int = 2, threads: int = 2) -> dict:
    env = {"PORT": str(server.port), "THREADS": str(threads), "WORLD": str(procs * threads), "TOKEN": TOKEN,
           "GRIDCOMM_RELAY": relay, "GRIDCOMM_RELAY_FANIN": "4", **rank_env(pki, shape, mtls)}
    results = RankProcesses(WORKER, procs, env=env).wait(120)
    assert_all_ok(results)
    out = {}
    for r in results.values():
        out.update({int(k): v for k, v in json.loads(r.stdout.strip().splitlines()[-1]).items()})
    assert len(out) == procs * threads and all(v["ok"] for v in out.values()), out
    return out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("shape,mtls", [("shared", False), ("shared", True), ("client+serving", True)],
                         ids=["shared-cert", "shared-cert-mtls", "per-rank-client-certs-mtls"])
def test_members_reach_their_relay_over_tls(coordinator_factory, pki, shape, mtls):
    """Wherever the ranks have a serving certificate, rank 0 hosts a relay that serves TLS (mTLS
    where the coordinator requires client certificates) and ranks 1-3 (two of them in another
    process) reach the coordinator through it."""
    server = coordinator_factory(4, tls=coordinator_tls(pki, mtls), token=TOKEN)
    out = run_tree(server, pki, shape, "on", mtls=mtls)
    assert out[0]["hosts"] and all(out[r]["relayed"] for r in (1, 2, 3)), out
    assert not server.state.failures


@pytest.mark.timeout(150)
@pytest.mark.parametrize("shape", ["client", "ca"], ids=["per-rank-client-certs", "ca-only"])
def test_without_relays_a_tls_job_without_serving_certificates_runs_at_the_coordinator(coordinator_factory, pki,
                                                                                         shape):
    server = coordinator_factory(4, tls=coordinator_tls(pki), token=TOKEN)
    out = run_tree(server, pki, shape, "off")
    assert not any(v["relayed"] or v["hosts"] for v in out.values()), out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shape", ["client", "ca"], ids=["per-rank-client-certs", "ca-only"])
def test_relays_on_without_a_serving_certificate_is_a_config_error_at_once(coordinator_factory, pki, shape,
                                                                          monkeypatch):
    server = coordinator_factory(4, tls=coordinator_tls(pki), token=TOKEN)
    for name, value in {**rank_env(pki, shape), "GRIDCOMM_RELAY": "on", "GRIDCOMM_RELAY_FANIN": "4"}.items():
        monkeypatch.setenv(name, value)
    for rank in (0, 1):  # the relay's host and a member decide alike
        client = gridcomm.CoordinatorClient("127.0.0.1", server.port, rank, 4, token=TOKEN, timeout_s=30)
        started = time.monotonic()
        try:
            with pytest.raises(gridcomm.ConfigError, match="GRIDCOMM_RELAY=on.*GRIDCOMM_TLS_CERT"):
                client.join()
        finally:
            client.close()
        assert time.monotonic() - started < 10  # at once, not the join's timeout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shape", ["client", "ca"], ids=["per-rank-client-certs", "ca-only"])
def test_relays_auto_without_a_serving_certificate_builds_no_tree(pki, shape, monkeypatch):
    """At relay scale (GRIDCOMM_RELAY=auto, 256 ranks) such a job keeps every rank on the
    coordinator: no rank hosts a relay, and no member waits for one."""
    for name, value in {**rank_env(pki, shape), "GRIDCOMM_RELAY": "auto", "GRIDCOMM_RELAY_FANIN": "16"}.items():
        monkeypatch.setenv(name, value)
    for rank in (0, 1, 17):
        client = gridcomm.CoordinatorClient("127.0.0.1", 1, rank, 256, token=TOKEN, timeout_s=5)
        try:
            client._tree()  # what join() decides first
            assert client.relay is None and client._relay_rank is None and client._relay_join is None
        finally:
            client.close()


@pytest.mark.timeout(60)
def test_a_relay_whose_certificate_its_members_would_refuse_fails_at_start(coordinator_factory, pki):
    server = coordinator_factory(1, tls=coordinator_tls(pki), token=TOKEN)
    upstream = f"localhost:{server.port}"
    cases = {
        # A certificate that does not name the address members dial (its SAN is DNS:rank).
        "wrong name": (_config.tls(tls_env(pki, client=None) | {
            "GRIDCOMM_TLS_CERT": pki["client"] + ".pem", "GRIDCOMM_TLS_KEY": pki["client"] + ".key"}), None),
        # A certificate the job's CA did not sign.
        "another CA": (_config.tls({**tls_env(pki), "GRIDCOMM_TLS_CERT": pki["rogue-client"] + ".pem",
                                    "GRIDCOMM_TLS_KEY": pki["rogue-client"] + ".key"}), None),
        # Members that dial it by a template's host name the certificate does not have.
        "template name": (coordinator_tls(pki), "job-7.svc"),
        # No serving certificate at all: a plaintext relay would refuse every member.
        "CA only": (_config.tls(rank_env(pki, "ca")), None),
    }
    for case, (tls, name) in cases.items():
        started = time.monotonic()
        with pytest.raises(gridcomm.ConfigError) as refused:
            Relay(upstream, token=TOKEN, tls=tls, tls_name=name).start()
        assert time.monotonic() - started < 15, case
        assert "relay" in str(refused.value) and ("GRIDCOMM_TLS_CERT" in str(refused.value)), (case, refused.value)
    # The template's host name the certificate has: it starts.
    Relay(upstream, token=TOKEN, tls=coordinator_tls(pki), tls_name="job-0.svc").start().stop()
