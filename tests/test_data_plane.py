"""The host backend's peer-to-peer data plane over real processes and sockets: a rank killed
inside a large collective, a wrong token and bad bytes on the data plane, and 8 ranks across two
network-namespace hosts (shared memory inside each host, TCP between them)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import conftest_netns
import netns
import pytest

from gridcomm._backends.host.frames import HANDSHAKE_S
from tests.support.procs import ROOT, WORKER, free_port, shm_names
from tests.support.tls import tls_env

make_topology = conftest_netns.make_topology
netns_usable = conftest_netns.netns_usable

HB = 3.0  # GRIDCOMM_HEARTBEAT_TIMEOUT_S in these tests
SLACK_S = 2.0  # the allowance on top of the liveness bound (scheduling on a loaded CI machine)
STARTUP_S = 60.0  # starting Python, NumPy and gRPC in several processes on two cores


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env.update(PYTHONUNBUFFERED="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               GRIDCOMM_PORT=str(free_port()), GRIDCOMM_BIND="127.0.0.1", GRIDCOMM_BACKEND="host",
               GRIDCOMM_HEARTBEAT_TIMEOUT_S=str(HB), GRIDCOMM_TIMEOUT_S="30")
    env.update(extra)
    return env


class Ranks:
    """One real OS process per rank, whose stdout lines the test can wait for (with deadlines);
    every process is killed, by PID, in :meth:`close`."""

    def __init__(self, code: str, world: int, env: dict[str, str]) -> None:
        self._logdir = tempfile.mkdtemp(prefix="gridcomm-test-")
        self.procs: dict[int, netns.HostProcess] = {}
        for rank in range(world):
            err = os.path.join(self._logdir, f"{rank}.stderr")
            argv = [sys.executable, "-c", code]
            with open(err, "wb") as handle:
                popen = subprocess.Popen(argv, env=dict(env, GRIDCOMM_RANK=str(rank), GRIDCOMM_WORLD_SIZE=str(world)),
                                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=handle)
            self.procs[rank] = netns.HostProcess(rank, argv, popen, err)

    def expect(self, rank: int, pattern: str, timeout_s: float) -> re.Match[str]:
        return self.procs[rank].expect_line(pattern, timeout_s)

    def report(self) -> str:
        return "\n".join(f"--- rank {r} (rc {p.popen.poll()})\nstdout:\n{p.stdout()[-2500:]}\nstderr:\n{p.stderr()[-3000:]}"
                         for r, p in sorted(self.procs.items()))

    def close(self) -> None:
        for proc in self.procs.values():
            proc.kill()
        for name in os.listdir(self._logdir):
            os.unlink(os.path.join(self._logdir, name))
        os.rmdir(self._logdir)


@pytest.fixture
def ranks() -> Iterator[Callable[..., Ranks]]:
    made: list[Ranks] = []

    def start(code: str, world: int, env: dict[str, str]) -> Ranks:
        made.append(Ranks(code, world, env))
        return made[-1]

    yield start
    for job in made:
        job.close()


OUTCOME = re.compile(r"^OUTCOME (\w+) rank=(\S*) at=([\d.]+) msg=(.*)$")


def outcome(job: Ranks, rank: int, timeout_s: float) -> tuple[str, str, float, str]:
    match = OUTCOME.match(job.expect(rank, r"^OUTCOME ", timeout_s).string)
    assert match, job.report()
    return match.group(1), match.group(2), float(match.group(3)), match.group(4)


KILLED_INSIDE = """
import os, sys, time, numpy as np, gridcomm
rank = int(os.environ["GRIDCOMM_RANK"]); world = int(os.environ["GRIDCOMM_WORLD_SIZE"])
victim = int(os.environ["VICTIM"])
comm = gridcomm.init_process_group(backend="host")
x = np.ones(2_000_000, dtype=np.float32)  # 8 MB: the ring, through shared memory
y = np.empty_like(x)
comm.all_reduce(x, y)
try:
    for step in range(1_000_000):
        if rank == victim:
            print(f"CALL {step}", flush=True)
        comm.all_reduce(x, y)
        assert y[0] == world and y[-1] == world, (y[0], y[-1])
except gridcomm.GridcommError as exc:
    print(f"OUTCOME {type(exc).__name__} rank={getattr(exc, 'rank', '')} at={time.time():.3f} msg={exc}", flush=True)
comm.stop()
print("STOPPED", flush=True)
"""


@pytest.mark.timeout(150)
def test_rank_killed_inside_a_large_all_reduce_is_named_on_the_others(ranks: Callable[..., Ranks]) -> None:
    victim, survivors = 2, [0, 1, 3]
    before = shm_names()
    job = ranks(KILLED_INSIDE, 4, base_env(VICTIM=str(victim)))
    job.expect(victim, r"^CALL 5$", STARTUP_S)
    # The victim printed CALL 5 and went into an 8 MB all_reduce that takes tens of ms; the kill
    # lands inside it (and the survivors are inside theirs, waiting on it).
    killed_at = time.time()
    os.kill(job.procs[victim].pid, signal.SIGKILL)
    for rank in survivors:
        kind, failed, at, msg = outcome(job, rank, HB + SLACK_S + 30)
        assert kind == "RankFailedError" and failed == str(victim), f"rank {rank}: {kind}({failed}) {msg}\n{job.report()}"
        assert at - killed_at < HB + SLACK_S, f"rank {rank} was told {at - killed_at:.2f} s after the kill"
    for rank in survivors:
        assert job.procs[rank].wait(30) == 0, job.report()
    assert job.procs[victim].popen.wait(10) == -signal.SIGKILL
    leaked = shm_names() - before
    assert not leaked, f"segments left in /dev/shm: {sorted(leaked)}"


WRONG_TOKEN = """
import dataclasses, os, secrets, socket, numpy as np, gridcomm
from gridcomm._backends.host import plane as _p2p
from gridcomm._backends.host.frames import MAGIC, VERSION
from gridcomm._backends.host.handshake import _ACCEPT_HEAD, _HELLO
rank = int(os.environ["GRIDCOMM_RANK"])
comm = gridcomm.init_process_group(backend="host")
x = np.ones(4)
comm.all_reduce(x, x)  # rank 0 has dialled rank 1 with the job's token
if rank == 0:
    raw = comm._backend._card_of(1)
    card = _p2p.Card.decode(raw, "rank 1")
    # 1. A dialler with another token: it finds that rank 1 cannot prove the token it holds.
    rogue = _p2p.Plane(dataclasses.replace(comm._backend.config, token="not-the-token"), "world", 0, 2, lambda r: raw)
    rogue.check()
    try:
        rogue.link(1)
        print("ROGUE ADMITTED", flush=True)
    except gridcomm.AuthenticationError as exc:
        print("ROGUE REFUSED", exc, flush=True)
    finally:
        rogue.close()
    # 2. Rank 1's side: a hello for its communicator, then a made-up proof: refused, closed.
    with socket.create_connection((card.host, card.port), timeout=10) as sock:
        hello = _HELLO.pack(MAGIC, VERSION, 0, card.id, secrets.token_bytes(16), 0, 1, b"",
                                 secrets.token_bytes(32))
        sock.sendall(hello)
        answer = b""
        while len(answer) < _ACCEPT_HEAD.size + 32:
            answer += sock.recv(4096)
        sock.sendall(secrets.token_bytes(32))
        verdict = sock.recv(1)
        rest = sock.recv(1)
        print("PROOF VERDICT", verdict.hex(), "THEN", repr(rest), flush=True)
    # 3. Bytes that are no handshake at all: closed.
    with socket.create_connection((card.host, card.port), timeout=10) as sock:
        sock.sendall(b"GET / HTTP/1.1\\r\\n" + bytes(200))
        try:
            answer = repr(sock.recv(100))
        except ConnectionResetError:  # closed with the rest of the garbage unread
            answer = "reset"
        print("GARBAGE ANSWER", answer, flush=True)
comm.barrier("probed")
x = np.full(4, rank + 1.0)
comm.all_reduce(x, x)
assert (x == 3).all(), x
comm.stop()
print("OK", flush=True)
"""


@pytest.mark.timeout(120)
def test_a_wrong_token_on_the_data_plane_is_refused(ranks: Callable[..., Ranks]) -> None:
    job = ranks(WRONG_TOKEN, 2, base_env(GRIDCOMM_TOKEN="the-token"))
    refused = job.expect(0, r"^ROGUE ", STARTUP_S).string
    assert refused.startswith("ROGUE REFUSED") and "did not prove the job's token" in refused, refused
    verdict = job.expect(0, r"^PROOF VERDICT ", 30).string
    assert verdict == "PROOF VERDICT 02 THEN b''", verdict  # refused, then the connection closed
    assert job.expect(0, r"^GARBAGE ANSWER ", 30).string in ("GARBAGE ANSWER b''", "GARBAGE ANSWER reset")
    for rank in (0, 1):
        job.expect(rank, r"^OK$", 60)
        assert job.procs[rank].wait(30) == 0, job.report()
    # Rank 1 logged the first refusal (then at most one line per 10 s, with a count).
    assert "dropped a connection from" in job.procs[1].stderr(), job.report()


BAD_BYTES = """
import os, time, numpy as np, gridcomm
rank = int(os.environ["GRIDCOMM_RANK"])
comm = gridcomm.init_process_group(backend="host")
x = np.ones(4)
comm.all_reduce(x, x)
comm.barrier("ready")
try:
    if rank == 1:
        # A peer that writes bytes no frame starts with, on its established link.
        link = comm._backend._plane.link(0)
        link.sock.setblocking(True)
        link.sock.sendall(bytes([0xFF]) * 40)
        comm.all_reduce(x, x)
    else:
        comm.recv(np.empty(4), 1)
    print("NO ERROR", flush=True)
except gridcomm.GridcommError as exc:
    print(f"OUTCOME {type(exc).__name__} rank={getattr(exc, 'rank', '')} at={time.time():.3f} msg={exc}", flush=True)
comm.stop()
"""


@pytest.mark.timeout(120)
def test_bad_bytes_from_a_peer_are_a_named_error_not_a_hang(ranks: Callable[..., Ranks]) -> None:
    job = ranks(BAD_BYTES, 2, base_env())
    kind, _, at0, msg = outcome(job, 0, STARTUP_S)
    assert kind == "DataPlaneError" and "from rank 1" in msg and "unknown kind 255" in msg, msg
    # Rank 0 reported itself failed (its link is half read): rank 1 is told, naming it.
    kind, failed, at1, msg = outcome(job, 1, HB + SLACK_S + 10)
    assert kind == "RankFailedError" and failed == "0" and "data plane broke" in msg, msg
    assert at1 - at0 < HB + SLACK_S
    for rank in (0, 1):
        assert job.procs[rank].wait(30) == 0, job.report()


@pytest.mark.netns
@pytest.mark.timeout(400)
def test_eight_ranks_on_two_namespace_hosts_pass_the_conformance_suite(
        make_topology: Callable[..., netns.Topology]) -> None:
    topo = make_topology(2)
    env = base_env(GRIDCOMM_HOST="job-0.svc", GRIDCOMM_PORT="29400", GRIDCOMM_BIND="0.0.0.0", GRIDCOMM_TIMEOUT_S="120",
                   BACKEND="host", SIZE="1001")
    procs = {}
    for rank in range(8):
        host = rank // 4
        procs[rank] = topo.popen(host, [sys.executable, "-c", WORKER], hostname=f"job-{host}",
                                 env=dict(env, GRIDCOMM_RANK=str(rank), GRIDCOMM_WORLD_SIZE="8"))
    deadline = time.monotonic() + 360
    for rank, proc in procs.items():
        summary = proc.expect_line(r"^SUMMARY ", max(1.0, deadline - time.monotonic())).string
        assert summary.endswith("failed=0"), proc.stdout()[-4000:]
        links = json.loads(proc.expect_line(r"^TRANSPORTS ", 5).string.split(" ", 1)[1])
        for peer, transport in links.items():
            want = "shm" if int(peer) // 4 == rank // 4 else "tcp"
            assert transport == want, f"rank {rank} -> rank {peer}: {transport}, want {want} ({links})"
        assert {str((rank + 1) % 8), str((rank - 1) % 8)} <= set(links), links
    for rank, proc in procs.items():
        assert proc.wait(60) == 0, f"rank {rank}:\n{proc.stderr()[-3000:]}"


TLS_JOB = """
import json, os, numpy as np, gridcomm
rank = int(os.environ["GRIDCOMM_RANK"])
with gridcomm.init_process_group(backend="host") as comm:
    for n in (1, 300_000):  # 4 B inline; 1.2 MB in socket frames (or shared-memory slots)
        x = np.arange(n, dtype=np.float32) * (rank + 1)
        comm.all_reduce(x, x)
        assert (x == np.arange(n, dtype=np.float32) * 3).all()
    print("TRANSPORTS " + json.dumps(comm._backend.transports()), flush=True)
print("OK", flush=True)
"""


@pytest.mark.skipif(subprocess.run(["which", "openssl"], capture_output=True).returncode != 0,
                    reason="needs the openssl command to make test certificates")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("shm, transport", [("0", "tcp+tls"), ("1", "shm+tls")])
def test_the_data_plane_uses_tls_when_the_job_does(ranks: Callable[..., Ranks], pki: dict[str, str], shm: str,
                                                   transport: str) -> None:
    env = base_env(GRIDCOMM_HOST="localhost", GRIDCOMM_TLS_SERVER_NAME="localhost", GRIDCOMM_TOKEN="the-token",
                   GRIDCOMM_SHM=shm, **tls_env(pki, mtls=True, client="client"))
    job = ranks(TLS_JOB, 2, env)
    for rank in (0, 1):
        links = json.loads(job.expect(rank, r"^TRANSPORTS ", STARTUP_S).string.split(" ", 1)[1])
        assert links == {str(1 - rank): transport}, links
        job.expect(rank, r"^OK$", 30)
        assert job.procs[rank].wait(30) == 0, job.report()


def test_tls_key_material_never_touches_the_disk(pki: dict[str, str], monkeypatch) -> None:
    """The data plane's TLS contexts load the PEMs from memory files: no folder is made for them
    (a kill there would leave the key on disk)."""
    import tempfile

    from gridcomm import _config
    from gridcomm._backends.host.tls import tls_contexts

    made: list[str] = []
    real = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    env = {"GRIDCOMM_TLS_CERT": pki["server"] + ".pem", "GRIDCOMM_TLS_KEY": pki["server"] + ".key",
           "GRIDCOMM_TLS_CA": pki["ca"] + ".pem", "GRIDCOMM_TLS_REQUIRE_CLIENT_CERT": "1"}
    tls = _config.tls(env)
    assert tls is not None
    server, client = tls_contexts(tls)
    assert server.verify_mode.name == "CERT_REQUIRED" and made == []


def test_segment_names_left_by_dead_processes_are_swept_and_live_ones_kept(tmp_path) -> None:
    """A SIGKILL between creating a segment and its peer mapping it leaves its name in /dev/shm;
    the next process that makes segments removes it (if old enough), and never a live one's."""
    import secrets
    import subprocess
    import sys

    from gridcomm._backends.host import shm

    if not shm.usable():
        pytest.skip("no usable /dev/shm")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)  # this process has exited
    names = {"dead_old": f"gridcomm-{dead_pid}-{secrets.token_hex(8)}",
             "dead_new": f"gridcomm-{dead_pid}-{secrets.token_hex(8)}",
             "alive_old": f"gridcomm-{os.getpid()}-{secrets.token_hex(8)}"}
    paths = {k: os.path.join(shm.SHM_DIR, n) for k, n in names.items()}
    try:
        for key, path in paths.items():
            with open(path, "wb") as handle:
                handle.write(b"x" * 4096)
            if key.endswith("old"):
                old = time.time() - 2 * shm.SWEEP_AGE_S
                os.utime(path, (old, old))
        swept = shm.sweep_dead()
        assert names["dead_old"] in swept and not os.path.exists(paths["dead_old"])
        assert os.path.exists(paths["dead_new"]) and os.path.exists(paths["alive_old"])
    finally:
        for path in paths.values():
            if os.path.exists(path):
                os.unlink(path)


def test_a_segment_of_another_user_or_with_open_permissions_is_not_mapped() -> None:
    """A peer's segment is mapped only when it is this user's with mode 600 (as the peer made it):
    one another user planted under the announced name, or one opened up to others, is refused
    (the link then falls back to sockets)."""
    from gridcomm._backends.host import shm

    if not shm.usable():
        pytest.skip("no usable /dev/shm")
    made = shm.Segment.create(2, 4096)
    path = os.path.join(shm.SHM_DIR, made.name)
    try:
        shm.Segment.open(made.name, made.cookie, 2, 4096).close()  # as made: mapped
        os.chmod(path, 0o660)
        with pytest.raises(shm.ShmUnavailable, match="mode 660"):
            shm.Segment.open(made.name, made.cookie, 2, 4096)
        os.chmod(path, 0o600)
        if os.geteuid() == 0:  # CI runs as root: it can give the file away
            os.chown(path, 12345, 12345)
            with pytest.raises(shm.ShmUnavailable, match="owned by uid 12345"):
                shm.Segment.open(made.name, made.cookie, 2, 4096)
    finally:
        shm.unlink(made.name)
        made.close()


# ---------------------------------------------------------------------------------------------- idle sockets
# Issue 27, item 1: sockets that never authenticate (idle, or trickling bytes) held against each
# rank's data-plane port must not stop the job's first links, nor a split's.

ATTACKER = """
import select, socket, sys, time
ports = [int(p) for p in sys.argv[1].split(",")]
idle, trickle, pause = int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
poller = select.poll()
held = {}  # fd -> [socket, port, trickler, next byte due]
reconnects = 0
def dial(port, trickler):
    sock = socket.socket()
    sock.setblocking(False)
    sock.connect_ex(("127.0.0.1", port))
    held[sock.fileno()] = [sock, port, trickler, time.monotonic() + 0.25]
    poller.register(sock.fileno(), select.POLLIN)
for port in ports:
    for i in range(idle + trickle):
        dial(port, i >= idle)
print("HOLDING", len(held), flush=True)
last = time.monotonic()
while True:
    closed = []
    for fd, _ in poller.poll(pause * 1000):
        try:
            if held[fd][0].recv(4096):
                continue
        except BlockingIOError:
            continue
        except OSError:
            pass
        closed.append(fd)
    now = time.monotonic()
    for fd, entry in list(held.items()):
        if entry[2] and fd not in closed and now >= entry[3]:
            entry[3] = now + 0.25
            try:
                entry[0].send(b"G")  # a byte of something that may become a handshake, never finished
            except BlockingIOError:
                pass
            except OSError:
                closed.append(fd)
    for fd in closed:
        sock, port, trickler, _ = held.pop(fd)
        poller.unregister(fd)
        sock.close()
        reconnects += 1
        dial(port, trickler)
    if now - last >= 1.0:
        print("RECONNECTS", reconnects, flush=True)
        last = now
    time.sleep(pause)
"""


UNDER_ATTACK = """
import os, time, numpy as np, gridcomm
rank = int(os.environ["GRIDCOMM_RANK"]); world = int(os.environ["GRIDCOMM_WORLD_SIZE"])
comm = gridcomm.init_process_group(backend="host")
print(f"PORT {comm._backend._plane.card.port}", flush=True)
deadline = time.monotonic() + 120
while not os.path.exists(os.environ["GO_FILE"]):  # the attacker holds its sockets
    assert time.monotonic() < deadline, "no go"
    time.sleep(0.02)
want = world * (world + 1) / 2
try:
    start = time.monotonic()
    x = np.full(1000, rank + 1.0)
    comm.all_reduce(x, x)  # the first collective: every link is made now, under attack
    first = time.monotonic() - start
    assert (x == want).all(), x
    sub = comm.split(0, key=world - rank)  # new links again, between the same processes
    y = np.full(300_000, sub.rank + 1.0, dtype=np.float32)
    sub.all_reduce(y, y)
    assert (y == want).all(), y[:4]
    total = time.monotonic() - start
    print(f"OUTCOME ok rank= at={time.time():.3f} msg=first={first:.3f} total={total:.3f}", flush=True)
    sub.stop()
except gridcomm.GridcommError as exc:
    print(f"OUTCOME {type(exc).__name__} rank={getattr(exc, 'rank', '')} at={time.time():.3f} "
          f"msg=after {time.monotonic() - start:.2f} s: {exc}", flush=True)
comm.stop()
"""


def _under_attack(ranks: Callable[..., Ranks], env: dict[str, str], tmp: str, world: int = 3, idle: int = 200,
                  trickle: int = 8) -> list[tuple[str, str, float, str]]:
    go = os.path.join(tmp, "go")
    job = ranks(UNDER_ATTACK, world, dict(env, GO_FILE=go))
    ports = [job.expect(rank, r"^PORT \d+$", STARTUP_S).string.split()[1] for rank in range(world)]
    attacker = subprocess.Popen([sys.executable, "-c", ATTACKER, ",".join(ports), str(idle), str(trickle), "0.02"],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert attacker.stdout is not None
        line = attacker.stdout.readline()
        assert line.startswith("HOLDING"), line
        time.sleep(2.0)  # the attack's steady state: every port's pending handshakes are the attacker's
        assert attacker.poll() is None
        open(go, "w").close()
        results = [outcome(job, rank, 60) for rank in range(world)]
    finally:
        attacker.kill()
        attacker.wait(10)
        counts = attacker.stdout.read() if attacker.stdout is not None else ""
        if attacker.stdout is not None:
            attacker.stdout.close()
    reopened = re.findall(r"^RECONNECTS (\d+)$", counts, re.M)
    for rank, (kind, _, _, msg) in enumerate(results):
        print(f"rank {rank}: {kind} {msg}")
    print(f"the attacker opened {reopened[-1] if reopened else 0} sockets again after they were dropped")
    for rank, (kind, failed, _, msg) in enumerate(results):
        assert kind == "ok", f"rank {rank}: {kind}({failed}) {msg}\n{job.report()}"
    for rank in range(world):
        assert job.procs[rank].wait(30) == 0, job.report()
    # The attack was on: every port's pending handshakes were full (the oldest was evicted).
    for rank in range(world):
        assert "dropped the oldest unauthenticated connection" in job.procs[rank].stderr(), job.report()
    return results


@pytest.mark.timeout(150)
def test_idle_and_trickling_sockets_do_not_stop_a_jobs_links(ranks: Callable[..., Ranks], tmp_path) -> None:
    """200 idle and 8 trickling sockets held (and opened again when dropped) against each of 3
    ranks' data-plane ports: the first all_reduce and a split's all_reduce give the right sums."""
    results = _under_attack(ranks, base_env(GRIDCOMM_TOKEN="the-token"), str(tmp_path))
    firsts = [float(re.search(r"first=([\d.]+)", msg).group(1)) for _, _, _, msg in results]  # type: ignore[union-attr]
    assert max(firsts) < 10.0, firsts


@pytest.mark.skipif(subprocess.run(["which", "openssl"], capture_output=True).returncode != 0,
                    reason="needs the openssl command to make test certificates")
@pytest.mark.timeout(150)
def test_idle_and_trickling_sockets_do_not_stop_a_jobs_links_with_mtls(ranks: Callable[..., Ranks],
                                                                       pki: dict[str, str], tmp_path) -> None:
    env = base_env(GRIDCOMM_HOST="localhost", GRIDCOMM_TLS_SERVER_NAME="localhost", GRIDCOMM_TOKEN="the-token",
                   **tls_env(pki, mtls=True, client="client"))
    _under_attack(ranks, env, str(tmp_path))


ROGUE_CERT = """
import dataclasses, os, time, numpy as np, gridcomm
from gridcomm._backends.host import plane as _p2p
rank = int(os.environ["GRIDCOMM_RANK"])
comm = gridcomm.init_process_group(backend="host")
x = np.ones(4)
comm.all_reduce(x, x)
if rank == 0:
    raw = comm._backend._card_of(1)
    config = comm._backend.config
    pem = lambda path: open(path, "rb").read()
    rogue_tls = dataclasses.replace(config.tls, client_cert=pem(os.environ["ROGUE"] + ".pem"),
                                    client_key=pem(os.environ["ROGUE"] + ".key"))
    rogue = _p2p.Plane(dataclasses.replace(config, tls=rogue_tls), "world", 0, 2, lambda r: raw)
    rogue.check()
    start = time.monotonic()
    try:
        rogue.link(1)
        print("ROGUE ADMITTED", flush=True)
    except gridcomm.GridcommError as exc:
        print(f"ROGUE {type(exc).__name__} after={time.monotonic() - start:.3f} {exc}", flush=True)
    finally:
        rogue.close()
comm.barrier("probed")
x = np.full(4, rank + 1.0)
comm.all_reduce(x, x)
assert (x == 3).all(), x
comm.stop()
print("OK", flush=True)
"""


@pytest.mark.skipif(subprocess.run(["which", "openssl"], capture_output=True).returncode != 0,
                    reason="needs the openssl command to make test certificates")
@pytest.mark.timeout(120)
def test_a_certificate_of_another_ca_is_refused_at_once_not_retried(ranks: Callable[..., Ranks],
                                                                     pki: dict[str, str]) -> None:
    """Dialers connect again after a reset before admission; a certificate the peer rejects is no
    reset: it is an AuthenticationError at once, and the job goes on."""
    env = base_env(GRIDCOMM_HOST="localhost", GRIDCOMM_TLS_SERVER_NAME="localhost", GRIDCOMM_TOKEN="the-token",
                   ROGUE=pki["rogue-client"], **tls_env(pki, mtls=True, client="client"))
    job = ranks(ROGUE_CERT, 2, env)
    line = job.expect(0, r"^ROGUE ", STARTUP_S).string
    print(line)
    match = re.match(r"^ROGUE AuthenticationError after=([\d.]+) .*TLS failed", line)
    assert match, line
    # Not retried: a refusal taken for a reset is dialled again until the dial's deadline (at least
    # HANDSHAKE_S, 10 s) and then ends in RendezvousTimeout. The refusal came after 3-5 ms here,
    # and after 2.2 s in CI beside a CPU hog; the bound is half the retry window.
    assert float(match.group(1)) < HANDSHAKE_S / 2, line
    for rank in (0, 1):
        job.expect(rank, r"^OK$", 60)
        assert job.procs[rank].wait(30) == 0, job.report()
