"""Lock-outs: one reconnecting client holding every unauthenticated connection it can keeps nobody
out of the coordinator's port, its health port or a rank's health port.

The coordinator (``gridcomm serve``, with a token and a health port) and the ranks run in
processes of their own; the attacker is one more process that opens thousands of idle HTTP/2
connections (the client preface and SETTINGS, then nothing) to each of the three ports, and opens
another the moment one is closed. Without the admission's early drop the connection caps filled
and new connections were closed at once: a token holder's ``Status`` and kubelet's probes got
UNAVAILABLE, again after every idle eviction. With it a token holder's ``Status``, health probes on
both ports and a new rank's join are served (each attempt bounded by :data:`CALL_S`, generous on
a loaded machine); the coordinator's memory growth under the flood is printed.
"""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gridcomm._client.client import fetch_status
from tests.support.procs import ROOT
from tests.support.ranks import Rank, free_port, serving

TOKEN = "lockout-token"
#: Connections the attacker holds per port: above what gRPC's caps were before the admission (the
#: coordinator's 4 x world + 8,192; a health port's 4,096, or 1/8 of the open-file limit), within
#: what one process may open.
FLOOD = {"coordinator": 9_000, "coordinator health": 3_000, "rank health": 3_000}
#: The bound on each served call (the aim is under a second; a loaded CI machine gets room).
CALL_S = 5.0
#: How long the ports are probed under the flood: past a health port's idle eviction (3 s), so a
#: flood that refills what eviction frees is probed too.
PROBE_WINDOW_S = 8.0

ATTACKER = r"""
import os, resource, selectors, socket, sys, time
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
targets = [(int(p), int(n)) for p, n in (t.split("x") for t in sys.argv[1:])]
sel = selectors.DefaultSelector()
held = {port: 0 for port, _ in targets}
opened = 0

def dial(port):
    global opened
    s = socket.socket()
    s.setblocking(False)
    try:
        s.connect_ex(("127.0.0.1", port))
        sel.register(s, selectors.EVENT_WRITE, (port, False))
    except OSError:
        s.close()
        return
    held[port] += 1
    opened += 1

for port, count in targets:
    for _ in range(count):
        dial(port)
full = False
while True:
    for key, events in sel.select(0.5):
        s, (port, hello) = key.fileobj, key.data
        if not hello:
            try:
                s.send(HELLO)
                sel.modify(s, selectors.EVENT_READ, (port, True))
                continue
            except OSError:
                pass
        else:
            try:
                if s.recv(65536):
                    continue
            except BlockingIOError:
                continue
            except OSError:
                pass
        sel.unregister(s)
        s.close()
        held[port] -= 1
        dial(port)  # the slot it held is taken again at once
    if not full and opened >= sum(n for _, n in targets):
        full = True
        print("FULL", flush=True)
"""

RANK = r"""
import os, time
import gridcomm
health = os.environ.get("HEALTH")
if health:
    gridcomm.start_health_server(int(health))
print("HEALTHY", flush=True)
client = gridcomm.CoordinatorClient("127.0.0.1", int(os.environ["PORT"]), int(os.environ["GRIDCOMM_RANK"]), 3,
                                    token=os.environ["TOKEN"], timeout_s=90)
started = time.monotonic()
client.join()
print("JOINED", f"{time.monotonic() - started:.3f}", flush=True)
time.sleep(120)
"""


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _probe(port: int) -> float:
    """One kubelet-style probe (a fresh connection, one Check); returns its seconds."""
    started = time.monotonic()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=CALL_S)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING, reply
    return time.monotonic() - started


def _status(port: int) -> float:
    started = time.monotonic()
    fetch_status("127.0.0.1", port, TOKEN, timeout_s=CALL_S)
    return time.monotonic() - started


@pytest.mark.timeout(240)
def test_a_reconnecting_flood_of_idle_connections_locks_nobody_out() -> None:
    health, rank_health = free_port(), free_port()
    env = dict(os.environ, PYTHONPATH=ROOT, GRIDCOMM_TOKEN=TOKEN, GRIDCOMM_HEALTH_PORT=str(health))
    with serving(["--world-size", "3", "--bind", "127.0.0.1", "--port", "0"], env) as (coordinator, line):
        assert "listening on 127.0.0.1:" in line, line
        port = int(line.split("listening on 127.0.0.1:", 1)[1].split()[0])
        rank_env = {"PORT": str(port), "TOKEN": TOKEN}
        ranks = [Rank(0, RANK, dict(rank_env, GRIDCOMM_RANK="0", HEALTH=str(rank_health))),
                 Rank(1, RANK, dict(rank_env, GRIDCOMM_RANK="1"))]
        attacker = None
        try:
            for rank in ranks:
                rank.expect("HEALTHY", 60)
            _status(port)
            _probe(health)
            _probe(rank_health)
            before = _rss_mb(coordinator.pid)
            attacker = subprocess.Popen(
                [sys.executable, "-c", ATTACKER, f"{port}x{FLOOD['coordinator']}",
                 f"{health}x{FLOOD['coordinator health']}", f"{rank_health}x{FLOOD['rank health']}"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            assert attacker.stdout is not None
            assert attacker.stdout.readline().strip() == "FULL", attacker.stderr.read() if attacker.stderr else ""
            took: dict[str, list[float]] = {"Status": [], "coordinator health": [], "rank health": []}
            until = time.monotonic() + PROBE_WINDOW_S
            while time.monotonic() < until:
                took["Status"].append(_status(port))
                took["coordinator health"].append(_probe(health))
                took["rank health"].append(_probe(rank_health))
            # A new rank joins under the flood (and completes the job's rendezvous).
            newcomer = Rank(2, RANK, dict(rank_env, GRIDCOMM_RANK="2"))
            ranks.append(newcomer)
            joined = float(newcomer.expect("JOINED", 60).split()[1])
            for rank in ranks[:2]:
                rank.expect("JOINED", 60)
            grown = _rss_mb(coordinator.pid) - before
        finally:
            if attacker is not None:
                attacker.kill()
                attacker.wait(10)
            for rank in ranks:
                rank.kill()
    worst = {what: max(times) for what, times in took.items()}
    print(f"served under the flood: {', '.join(f'{w} {len(took[w])}x, worst {t * 1000:.0f} ms' for w, t in worst.items())};"
          f" the new rank's join {joined * 1000:.0f} ms; coordinator RSS {grown:+.0f} MB")
    assert all(len(times) >= 2 for times in took.values()), took


def test_the_admission_drops_the_oldest_idle_connections_of_the_peer_holding_the_most() -> None:
    # The policy on plain sockets (no gRPC): a listener of this process, its accepted ends held as
    # gRPC would hold them. Past the cap, those older than the grace and never admitted go, oldest
    # first; an admitted one and a young one stay.
    from gridcomm._runtime.admission import Admission, connections

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    admission = Admission("test", cap=8, authenticates=True, grace_s=1e9)
    admission._port = lambda: port
    clients, served = [], []
    try:
        for _ in range(30):
            clients.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            served.append(listener.accept()[0])
        admission.admitted(f"ipv4:127.0.0.1:{clients[0].getsockname()[1]}")
        assert admission.sweep() == 0  # every one is within its grace
        clients.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        served.append(listener.accept()[0])
        admission.sweep()
        young = {inode for (_, peer), inode in connections(port) if peer == clients[-1].getsockname()[1]}
        for inode in young:
            admission._seen[inode] = time.monotonic() + 60  # seen just now
        admission.grace_s = 0.0
        dropped = admission.sweep()
        assert dropped == 30 - 8, dropped  # 30 unauthenticated (the admitted one aside) down to the cap of 8
        deadline = time.monotonic() + 10
        ended: list[socket.socket] = []
        while len(ended) < dropped and time.monotonic() < deadline:  # each dropped one reads its end
            ended = select.select(clients, [], [], 1.0)[0]
        assert len(ended) == dropped, (len(ended), dropped)
        assert clients[0] not in ended and clients[-1] not in ended, "the admitted and the young connection stay"
    finally:
        for s in clients + served + [listener]:
            s.close()
