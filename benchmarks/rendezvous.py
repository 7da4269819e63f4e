"""Rendezvous at scale on one CPU machine: gridcomm's coordinator against torch's TCPStore, JAX's
coordination service and cupyx's store, under one harness.

For each rank count N the peers are run in turn, and the order rotates every repetition, so noise
from other work on the machine lands on all of them alike; the tables give medians and min..max.

One run of one peer at one N:
- the server runs in a process of its own, so its RSS and CPU time are read from /proc;
- ranks: one OS process per rank up to 128 ranks, above that 32 processes with N/32 threads each
  up to 4,096 ranks, and above that N/128 processes of 128 threads (--threads-per-process-max);
  every rank has a client of its own (its own connection);
- connect: from a common start until every client is constructed and connected (gridcomm's join,
  JAX's connect, torch's constructor; cupyx has no connect step);
- T1: from "every client ready" until every rank holds a 128-byte blob published by rank 0;
- T2: the mean of 20 consecutive barriers after that;
- then an idle period with all clients connected, to see whether the server's RSS grows.
Phases are separated by gates that the driver opens once every rank has arrived, so each phase
starts at one recorded instant (CLOCK_MONOTONIC is shared by all processes).

Every wait is bounded: a phase that does not finish in time, or a rank that raises, ends the run
with that status, and its processes are killed by PID. A peer that fails at some N is skipped for
larger N; one whose barriers alone fail keeps being measured for T1, without barriers.

    python benchmarks/rendezvous.py --ranks 8,128,512,2048 --reps 3 --markdown BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import multiprocessing
import os
import platform
import re
import select
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RANK_COUNTS = (8, 32, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
DEFAULT_RANKS = (8, 32, 128, 512, 2048)
PEER_NAMES = ("gridcomm", "gridcomm-no-template", "gridcomm-direct", "gridcomm+agent", "torch", "jax", "cupyx")
BLOB = bytes(range(128))
BLOB_KEY = "bench/blob"
#: Up to this many ranks each rank is an OS process; above it, PROCESSES processes of threads.
PROCESS_PER_RANK_MAX = 128
PROCESSES = 32
#: At most this many rank threads per process: 32 processes up to 4,096 ranks (the shape of every
#: earlier table), then more processes (8,192: 64 x 128; 16,384: 128 x 128). Why: a deployment has
#: one rank per process; 256 rank threads sharing one process's background loop on 2 cores starved
#: it (its relay and its ranks' heartbeats), which measured the harness, not the coordinator.
THREADS_PER_PROCESS_MAX = 128
#: The gates between phases, in order; each is opened by the driver once every rank arrived.
PHASES = ("go", "t1", "t2", "done")
SECTION_BEGIN = "<!-- rendezvous:begin (written by benchmarks/rendezvous.py) -->"
SECTION_END = "<!-- rendezvous:end -->"


# --------------------------------------------------------------------------- the peers
class Peer:
    """One implementation under test: its server, and a rank's steps through the benchmark."""

    name = ""

    def load(self) -> None:
        """Imports the client library (in the driver, before it forks the rank processes)."""

    def serve(self, world: int, timeout_s: float) -> tuple[Any, int]:
        """Starts the server in this process; returns a handle to keep alive and its port."""
        raise NotImplementedError

    def connect(self, port: int, rank: int, world: int, timeout_s: float) -> Any:
        """A connected client for ``rank`` (everything a rank does before it can exchange data)."""
        raise NotImplementedError

    def fetch_blob(self, client: Any, rank: int, world: int, timeout_s: float) -> bytes:
        """Rank 0 publishes BLOB; every rank returns the blob it holds."""
        raise NotImplementedError

    def barrier(self, client: Any, index: int, world: int, timeout_s: float) -> None:
        raise NotImplementedError

    def close(self, client: Any) -> None:
        """Best effort, bounded."""

    def start_process(self, port: int, world: int, timeout_s: float) -> None:
        """Once per rank process, before its ranks connect (a node agent's part, if the peer has one)."""

    def report(self, handle: Any) -> dict[str, Any]:
        """In the server's process at the end of a run: what the server knows of it."""
        return {}


class GridcommPeer(Peer):
    """gridcomm as it runs in an Indexed Job or a JobSet of this many pods: from 256 ranks the relay
    tree, every group's relay at an address known before the join (GRIDCOMM_RELAY_ADDRESSES, which
    the Kubernetes detectors derive from the pods' names), so ranks join through it. Here the
    addresses are loopback ports, one per group (the harness runs in a network namespace of its own)."""

    name = "gridcomm"

    def start_process(self, port: int, world: int, timeout_s: float) -> None:
        os.environ["GRIDCOMM_RELAY_ADDRESSES"] = "127.0.0.1:2{group:04d}"
        self.start_loop()

    @staticmethod
    def start_loop() -> None:
        """The process's background loop, before its rank threads start, as a deployed rank's
        process starts it with nothing else running. Why: started by the first of 128 rank threads
        while 16,384 others start on 2 cores, its thread did not run within 10 s."""
        from gridcomm._runtime import loop

        loop.loop()

    def load(self) -> None:
        global gridcomm
        import gridcomm

    def serve(self, world: int, timeout_s: float) -> tuple[Any, int]:
        self.load()
        server = gridcomm.Coordinator(world, bind="127.0.0.1", port=0).start()
        return server, server.port

    def report(self, handle: Any) -> dict[str, Any]:
        # Every rank failed in the run (none was killed: each is a false failure), with when.
        failures = list(handle.state.failures)
        wall = time.time() - time.monotonic()
        servicer = handle._servicer
        return {"messages": dict(servicer.metrics.messages) if servicer is not None else {},
                "first_contacts": dict(servicer.metrics.first_contacts) if servicer is not None else {},
                "rpcs": {f"{m} {c}": n for (m, c), n in servicer.metrics.rpcs.items()} if servicer is not None else {},
                "failed_ranks": len(failures),
                "failures": [{"rank": f.rank, "at_unix_s": wall + f.at, "reason": f.reason[:300]} for f in failures[:5]]}

    def connect(self, port: int, rank: int, world: int, timeout_s: float) -> Any:
        # Why session="client": a rank stands for a pod, so it must not share its process's
        # stream and connection with the other ranks of this harness process (a deployment
        # has one rank per process; see "Deployment shapes" in docs/design.md).
        client = gridcomm.CoordinatorClient("127.0.0.1", port, rank, world, timeout_s=timeout_s, session="client")
        client.join()
        return self.counted(client)

    @staticmethod
    def counted(client: Any) -> Any:
        """Every deployed rank has a communicator, whose progress its heartbeats carry: so do these."""
        from gridcomm._client.tracker import Tracker

        client.bench_tracker = Tracker("world", client.generation)
        client.track(client.bench_tracker)
        return client

    def fetch_blob(self, client: Any, rank: int, world: int, timeout_s: float) -> bytes:
        if rank == 0:
            client.set(BLOB_KEY, BLOB)
            return BLOB
        return client.get(BLOB_KEY)

    def barrier(self, client: Any, index: int, world: int, timeout_s: float) -> None:
        client.bench_tracker.enter("barrier")
        try:
            client.barrier(f"bench-{index}")
        finally:
            client.bench_tracker.leave()

    def close(self, client: Any) -> None:
        client.leave()


class GridcommDirectPeer(GridcommPeer):
    """gridcomm without the relay tree (GRIDCOMM_RELAY=off): every rank's stream to the coordinator."""

    name = "gridcomm-direct"

    def start_process(self, port: int, world: int, timeout_s: float) -> None:
        os.environ["GRIDCOMM_RELAY"] = "off"
        self.start_loop()


class GridcommNoTemplatePeer(GridcommPeer):
    """gridcomm launched the way Slurm, bare metal or a user's own launcher start it: every rank
    its own client, the relay tree on from 256 ranks (GRIDCOMM_RELAY=auto), but no address
    template, so no rank knows where its group's relay listens before it asks the coordinator."""

    name = "gridcomm-no-template"

    def start_process(self, port: int, world: int, timeout_s: float) -> None:
        os.environ.pop("GRIDCOMM_RELAY_ADDRESSES", None)
        self.start_loop()


class GridcommRelayPeer(GridcommPeer):
    """gridcomm with a relay per rank process, as `GRIDCOMM_RELAY=on gridcomm launch` hosts one per
    node: each rank still has a connection of its own, to its node's relay; the coordinator sees one
    stream per relay (32 above 128 ranks)."""

    name = "gridcomm+agent"
    relay: Any = None

    def start_process(self, port: int, world: int, timeout_s: float) -> None:
        from gridcomm._relay.server import Relay
        self.relay = Relay(f"127.0.0.1:{port}").start()

    def connect(self, port: int, rank: int, world: int, timeout_s: float) -> Any:
        client = gridcomm.CoordinatorClient("127.0.0.1", port, rank, world, timeout_s=timeout_s, session="client",
                                            relay=self.relay.target)
        client.join()
        return self.counted(client)


class TorchPeer(Peer):
    """torch.distributed.TCPStore with the libuv server. Addresses are numeric: torch resolves
    names per socket, and a rank that waits on a resolver pays seconds."""

    name = "torch"

    def load(self) -> None:
        global TCPStore
        from torch.distributed import TCPStore

    def serve(self, world: int, timeout_s: float) -> tuple[Any, int]:
        self.load()
        store = TCPStore("127.0.0.1", 0, world, True, datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False, use_libuv=True)
        return store, store.port

    def connect(self, port: int, rank: int, world: int, timeout_s: float) -> Any:
        return TCPStore("127.0.0.1", port, world, False, datetime.timedelta(seconds=timeout_s),
                        wait_for_workers=False, use_libuv=True)

    def fetch_blob(self, client: Any, rank: int, world: int, timeout_s: float) -> bytes:
        if rank == 0:
            client.set(BLOB_KEY, BLOB)
            return BLOB
        return client.get(BLOB_KEY)  # waits for the key, up to the store's timeout

    def barrier(self, client: Any, index: int, world: int, timeout_s: float) -> None:
        # torch's own store barrier (native in the libuv server), at its best.
        client.barrier(f"bench/barrier/{index}", world, datetime.timedelta(seconds=timeout_s))


class JaxPeer(Peer):
    """jaxlib's distributed runtime (the coordination service behind jax.distributed)."""

    name = "jax"

    def load(self) -> None:
        global _jax
        try:
            import jaxlib._jax as _jax
        except ImportError:  # jaxlib before 0.7 named the module xla_extension
            import jaxlib.xla_extension as _jax

    def serve(self, world: int, timeout_s: float) -> tuple[Any, int]:
        self.load()
        last: Exception | None = None
        for _ in range(5):  # the service takes no port 0: pick a free one, retry if it was taken
            port = free_port()
            try:
                service = _jax.get_distributed_runtime_service(
                    f"127.0.0.1:{port}", world, heartbeat_timeout=int(timeout_s) * 10,
                    cluster_register_timeout=int(timeout_s), shutdown_timeout=5)
                return service, port
            except Exception as exc:  # noqa: BLE001 - a lost race for the port
                last = exc
        raise RuntimeError(f"the JAX service could not bind: {last}")

    def connect(self, port: int, rank: int, world: int, timeout_s: float) -> Any:
        missed: list[str] = []
        client = _jax.get_distributed_runtime_client(
            f"127.0.0.1:{port}", rank, rpc_timeout=int(timeout_s), init_timeout=int(timeout_s),
            heartbeat_timeout=int(timeout_s) * 10, shutdown_timeout=5, shutdown_on_destruction=False,
            # Why: the default reaction to a missed heartbeat aborts the whole process.
            missed_heartbeat_callback=lambda status: missed.append(str(status)))
        client.connect()  # registers and waits until every task has
        return client

    def fetch_blob(self, client: Any, rank: int, world: int, timeout_s: float) -> bytes:
        if rank == 0:
            client.key_value_set_bytes(BLOB_KEY, BLOB)
            return BLOB
        return client.blocking_key_value_get_bytes(BLOB_KEY, int(timeout_s * 1000))

    def barrier(self, client: Any, index: int, world: int, timeout_s: float) -> None:
        client.wait_at_barrier(f"bench-{index}", int(timeout_s * 1000))


class CupyxPeer(Peer):
    """cupyx.distributed's store: one TCP connection per request, a server thread per connection.
    Its get does not wait, so the blob goes the way NCCLBackend sends its NCCL ID: rank 0 sets it,
    all meet at a barrier, then the others read it."""

    name = "cupyx"

    def load(self) -> None:
        global _store
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # CuPy warns that it finds no CUDA here
            from cupyx.distributed import _store

    def serve(self, world: int, timeout_s: float) -> tuple[Any, int]:
        self.load()
        port = free_port()
        store = _store.TCPStore(world)
        # The serving loop TCPStore.run() starts in a child process, run here, on a thread of
        # the server process, so /proc of this process is the server's.
        threading.Thread(target=store._server_loop, args=("127.0.0.1", port), daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return store, port
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"the cupyx store did not listen on port {port} within {timeout_s} s")

    def connect(self, port: int, rank: int, world: int, timeout_s: float) -> Any:
        return _store.TCPStoreProxy("127.0.0.1", port)

    def fetch_blob(self, client: Any, rank: int, world: int, timeout_s: float) -> bytes:
        if rank == 0:
            client[BLOB_KEY] = BLOB
        client.barrier()
        return BLOB if rank == 0 else client[BLOB_KEY]

    def barrier(self, client: Any, index: int, world: int, timeout_s: float) -> None:
        client.barrier()


PEERS: dict[str, Callable[[], Peer]] = {
    "gridcomm": GridcommPeer, "gridcomm-no-template": GridcommNoTemplatePeer, "gridcomm-direct": GridcommDirectPeer, "gridcomm+agent": GridcommRelayPeer, "torch": TorchPeer, "jax": JaxPeer, "cupyx": CupyxPeer,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- /proc
def proc_stats(pid: int) -> dict[str, float]:
    """RSS and peak RSS (MB) and CPU seconds (user + system) of one process."""
    out: dict[str, float] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                out["rss_mb" if line.startswith("VmRSS") else "hwm_mb"] = int(line.split()[1]) / 1024
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # Fields 14 and 15 of stat (utime, stime); the split above starts at field 3.
    out["cpu_s"] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def listen_overflows() -> int | None:
    """How many connections this network namespace's listen queues have dropped so far (TcpExt
    ListenOverflows: a connect that arrived while its listener's accept queue was full, and waits
    out a SYN retry of 1-3 s); None where the kernel does not say."""
    try:
        lines = Path("/proc/net/netstat").read_text().splitlines()
    except OSError:
        return None
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            found = dict(zip(names.split()[1:], values.split()[1:], strict=False))
            return int(found["ListenOverflows"]) if "ListenOverflows" in found else None
    return None


# --------------------------------------------------------------------------- one run (driver)
def ranks_cpu_s(procs: list[Any]) -> dict[int, float]:
    """CPU seconds of each rank process so far, by pid (one that has exited is left out)."""
    each: dict[int, float] = {}
    for p in procs:
        try:
            each[p.pid] = proc_stats(p.pid)["cpu_s"]
        except OSError:
            pass
    return each


def rank_groups(world: int, process_per_rank_max: int = PROCESS_PER_RANK_MAX,
                threads_max: int = THREADS_PER_PROCESS_MAX) -> list[list[int]]:
    procs = world if world <= process_per_rank_max else max(PROCESSES, math.ceil(world / threads_max))
    per = math.ceil(world / procs)
    return [list(range(i, min(i + per, world))) for i in range(0, world, per)]


def worker_main(peer: Peer, wid: int, ranks: list[int], world: int, port: int, queue: Any,
                gates: dict[str, tuple[int, int]], progress: Any, barriers: int, timeout_s: float,
                barrier_timeout_s: float, fetched: Any) -> None:
    """One rank process: a thread per rank, gates relayed from the driver to the threads."""
    for _, write_end in gates.values():
        os.close(write_end)  # only the driver may hold these: its close opens the gate
    threading.stack_size(512 * 1024)
    local = {phase: threading.Event() for phase in PHASES}
    lock = threading.Lock()
    arrived = dict.fromkeys(PHASES, 0)
    latest = dict.fromkeys(PHASES, 0.0)
    woke = dict.fromkeys(PHASES, 0.0)  # when the last thread here passed the previous gate
    deadline = time.monotonic() + 3 * timeout_s + barrier_timeout_s

    def arrive(phase: str, when: float, passed_gate: float) -> None:
        with lock:
            arrived[phase] += 1
            latest[phase] = max(latest[phase], when)
            woke[phase] = max(woke[phase], passed_gate)
            last = arrived[phase] == len(ranks)
        if last:
            queue.put(("arrive", phase, wid, latest[phase], woke[phase]))

    def relay() -> None:
        for phase in PHASES:
            readable, _, _ = select.select([gates[phase][0]], [], [], max(0.0, deadline - time.monotonic()))
            if not readable:
                return
            local[phase].set()

    def wait(phase: str) -> float:
        if not local[phase].wait(max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"gate {phase!r} did not open")
        return time.monotonic()

    def run_rank(rank: int) -> None:
        step = "start"
        try:
            arrive("go", time.monotonic(), 0.0)
            passed = wait("go")
            step = "connect"
            client = peer.connect(port, rank, world, timeout_s)
            arrive("t1", time.monotonic(), passed)
            passed = wait("t1")
            step = "rendezvous"
            blob = peer.fetch_blob(client, rank, world, timeout_s)
            if blob != BLOB:
                raise ValueError(f"rank {rank} got a wrong blob ({len(blob)} bytes)")
            fetched[rank] = 1
            arrive("t2", time.monotonic(), passed)
            passed = wait("t2")
            step = "barriers"
            for index in range(barriers):
                peer.barrier(client, index, world, barrier_timeout_s)
                progress[rank] = index + 1
            arrive("done", time.monotonic(), passed)
            wait("done")
            step = "close"
            peer.close(client)
        except BaseException as exc:  # noqa: BLE001 - reported to the driver, which ends the run
            queue.put(("error", step, rank, f"{type(exc).__name__}: {exc}"[:400]))

    threading.Thread(target=relay, daemon=True).start()
    try:
        peer.start_process(port, world, timeout_s)
    except BaseException as exc:  # noqa: BLE001 - reported to the driver, which ends the run
        queue.put(("error", "start", ranks[0], f"{type(exc).__name__}: {exc}"[:400]))
    threads = [threading.Thread(target=run_rank, args=(rank,), daemon=True) for rank in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    queue.close()
    queue.join_thread()
    os._exit(0)  # no atexit hooks: some clients block at exit


def start_server(peer_name: str, world: int, timeout_s: float, env: dict[str, str]) -> tuple[subprocess.Popen, int]:
    server = subprocess.Popen(
        [sys.executable, __file__, "--_serve", peer_name, "--world", str(world), "--timeout-s", str(timeout_s)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=sys.stderr, text=True, env=env)
    assert server.stdout is not None
    ready, _, _ = select.select([server.stdout], [], [], timeout_s)
    line = server.stdout.readline() if ready else ""
    if not line:
        server.kill()
        raise RuntimeError(f"the {peer_name} server did not report its port within {timeout_s} s")
    return server, int(json.loads(line)["port"])


def drive(peer_name: str, world: int, barriers: int, timeout_s: float, barrier_timeout_s: float,
          idle_s: float, process_per_rank_max: int = PROCESS_PER_RANK_MAX,
          threads_max: int = THREADS_PER_PROCESS_MAX) -> dict[str, Any]:
    """Runs one peer at one N; returns what was measured and a status."""
    result: dict[str, Any] = {"peer": peer_name, "world": world, "barriers": barriers, "status": "ok"}
    server, port = start_server(peer_name, world, timeout_s, dict(os.environ))
    procs: list[multiprocessing.process.BaseProcess] = []
    try:
        time.sleep(0.2)  # let the server settle before its baseline is read
        base = proc_stats(server.pid)
        overflows_before = listen_overflows()
        result["server_start_mb"] = base["rss_mb"]
        peer = PEERS[peer_name]()
        peer.load()
        ctx = multiprocessing.get_context("fork")  # the client library is imported once, above
        queue = ctx.Queue()
        # A gate is a pipe whose write end only the driver holds: closing it wakes every process
        # at once (EOF), where a multiprocessing.Event would wake its waiters one by one.
        gates = {phase: os.pipe() for phase in PHASES}
        progress = ctx.Array("i", world, lock=False)  # barriers each rank has passed
        fetched = ctx.Array("b", world, lock=False)  # whether each rank holds the blob
        groups = rank_groups(world, process_per_rank_max, threads_max)
        result["processes"], result["threads_per_process"] = len(groups), len(groups[0])
        for wid, ranks in enumerate(groups):
            p = ctx.Process(target=worker_main, daemon=True, args=(
                peer, wid, ranks, world, port, queue, gates, progress, barriers, timeout_s, barrier_timeout_s, fetched))
            p.start()
            procs.append(p)
        for read_end, _ in gates.values():
            os.close(read_end)
        opened: dict[str, float] = {}
        phase_cpu: dict[str, float] = {}  # the server's CPU seconds when each phase opened
        ranks_cpu: dict[str, dict[int, float]] = {}  # each rank process's CPU seconds, likewise
        idle_end_cpu_s = 0.0  # the server's CPU seconds at the end of the idle period
        latest: dict[str, float] = {}
        woke: dict[str, float] = {}
        counts = dict.fromkeys(PHASES, 0)
        errors: list[tuple[str, int, str]] = []
        for phase in PHASES:
            limit = barrier_timeout_s if phase == "done" else timeout_s
            deadline = time.monotonic() + limit
            while counts[phase] < len(groups) and time.monotonic() < deadline:
                try:
                    msg = queue.get(timeout=max(0.01, min(1.0, deadline - time.monotonic())))
                except Exception:  # noqa: BLE001 - queue.Empty: check the deadline and the workers
                    if not any(p.is_alive() for p in procs):
                        break
                    continue
                if msg[0] == "arrive":
                    counts[msg[1]] += 1
                    latest[msg[1]] = max(latest.get(msg[1], 0.0), msg[3])
                    woke[msg[1]] = max(woke.get(msg[1], 0.0), msg[4])
                else:
                    errors.append(msg[1:])
                    deadline = min(deadline, time.monotonic() + 2.0)  # let a few more errors in
            if errors or counts[phase] < len(groups):
                step = {"go": "start", "t1": "connect", "t2": "rendezvous", "done": "barriers"}[phase]
                if errors:
                    steps = sorted({e[0] for e in errors})
                    result["status"] = f"{'/'.join(steps)} failed on {len(errors)}+ ranks: {errors[0][2]}"
                    result["failed_step"] = errors[0][0]
                else:
                    result["status"] = f"{step} timed out after {limit:.0f} s"
                    if step == "barriers":
                        passed = list(progress)
                        result["status"] += (f" (each rank had passed {min(passed)} to {max(passed)} "
                                             f"of {barriers} barriers)")
                        result["behind"] = [r for r, n in enumerate(passed) if n == min(passed)][:64]
                    elif step == "rendezvous":
                        result["behind"] = [r for r, got in enumerate(fetched) if not got][:64]
                    result["failed_step"] = step
                break
            if phase == "done":
                end = proc_stats(server.pid)
                time.sleep(idle_s)
                idle = proc_stats(server.pid)
                # Where the server's CPU went: the connect (joins), T1 (the blob), the barriers.
                result["server_cpu_by_phase_s"] = {
                    "connect": round(phase_cpu["t1"] - phase_cpu["go"], 3),
                    "t1": round(phase_cpu["t2"] - phase_cpu["t1"], 3),
                    "barriers": round(end["cpu_s"] - phase_cpu["t2"], 3)}
                # The same for the rank processes (clients, and relays where the peer has them):
                # on 2 cores, theirs and the server's together bound each phase's time.
                each_end = ranks_cpu_s(procs)
                total = {phase: sum(each.values()) for phase, each in ranks_cpu.items()}
                result["ranks_cpu_by_phase_s"] = {
                    "connect": round(total["t1"] - total["go"], 3),
                    "t1": round(total["t2"] - total["t1"], 3),
                    "barriers": round(sum(each_end.values()) - total["t2"], 3)}
                # The busiest rank process in the barriers: with a relay tree, one that hosts a
                # relay (its relay shares it with its rank threads, so this bounds the relay's).
                spent = sorted((round(cpu - ranks_cpu["t2"].get(pid, cpu), 3) for pid, cpu in each_end.items()),
                               reverse=True)
                result["rank_processes_barriers_cpu_s"] = spent  # each process's, the busiest first
                result["busiest_rank_process_barriers_cpu_s"] = spent[0] if spent else 0.0
                overflows_after = listen_overflows()
                if overflows_before is not None and overflows_after is not None:
                    result["listen_overflows"] = overflows_after - overflows_before
                # Idle: every client connected and heartbeating, nothing else: liveness's own cost.
                idle_end_cpu_s = idle["cpu_s"]
                result.update(server_peak_mb=idle["hwm_mb"], server_cpu_s=end["cpu_s"] - base["cpu_s"],
                              idle_growth_mb=idle["rss_mb"] - end["rss_mb"], idle_s=idle_s,
                              server_idle_cpu_s=round(idle["cpu_s"] - end["cpu_s"], 3))
            opened[phase] = time.monotonic()
            phase_cpu[phase] = proc_stats(server.pid)["cpu_s"]
            ranks_cpu[phase] = ranks_cpu_s(procs)
            os.close(gates[phase][1])
            if phase == "t1":
                result["connect_s"] = latest["t1"] - opened["go"]
            elif phase == "t2":
                result["t1_s"] = latest["t2"] - opened["t1"]
                # Harness overhead inside T1: until the last rank had passed the gate.
                result["gate_release_s"] = woke["t2"] - opened["t1"]
            elif phase == "done" and barriers:
                result["t2_s"] = (latest["done"] - opened["t2"]) / barriers
        if result["status"] != "ok":
            stats = proc_stats(server.pid)
            result.update(server_peak_mb=stats["hwm_mb"], server_cpu_s=stats["cpu_s"] - base["cpu_s"])
        else:
            result["measured_at_unix_s"] = time.time()
            # They close their clients and exit; the server still runs meanwhile. Why the queue is
            # read meanwhile: a process whose errors fill the pipe cannot exit until they are read.
            closing = time.monotonic() + 10 + 2 * timeout_s
            close_errors: list[tuple[str, int, str]] = []
            while any(p.is_alive() for p in procs) and time.monotonic() < closing:
                try:
                    msg = queue.get(timeout=0.5)
                except Exception:  # noqa: BLE001 - queue.Empty
                    continue
                if msg[0] == "error":
                    close_errors.append(msg[1:])
            result["close_errors"] = len(close_errors)
            # The job's end: every rank leaves (and closes its connection) at once.
            result["server_close_cpu_s"] = round(proc_stats(server.pid)["cpu_s"] - idle_end_cpu_s, 3)
            if close_errors:
                result["close_error"] = close_errors[0][2]
    finally:
        for p in procs:
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGKILL)
        for p in procs:
            p.join(5)
        result.update(server_report(server))
        server.kill()
        server.wait(10)
    return result


def server_report(server: subprocess.Popen) -> dict[str, Any]:
    """What the server says of the run once its stdin closes (gridcomm: the ranks it failed)."""
    try:
        assert server.stdin is not None and server.stdout is not None
        server.stdin.close()
        ready, _, _ = select.select([server.stdout], [], [], 10.0)
        line = server.stdout.readline() if ready else ""
        return json.loads(line) if line.startswith("{") else {}
    except (OSError, ValueError, AssertionError):
        return {}


def serve(peer_name: str, world: int, timeout_s: float) -> None:
    """The server process: starts the server, prints its port, serves until stdin closes."""
    peer = PEERS[peer_name]()
    handle, port = peer.serve(world, timeout_s)
    print(json.dumps({"port": port}), flush=True)
    sys.stdin.read()
    print(json.dumps(peer.report(handle)), flush=True)
    del handle
    os._exit(0)


# --------------------------------------------------------------------------- the harness
def run_one(args: argparse.Namespace, peer: str, world: int, barriers: int, env: dict[str, str]) -> dict[str, Any]:
    """One run in a driver process of its own (own session), killed by PID if it overruns."""
    limit = 4 * args.timeout_s + args.barrier_timeout_s + args.idle_s + 60
    cmd = [sys.executable, __file__, "--_run", peer, "--world", str(world), "--barriers", str(barriers),
           "--timeout-s", str(args.timeout_s), "--barrier-timeout-s", str(args.barrier_timeout_s),
           "--idle-s", str(args.idle_s), "--process-per-rank-max", str(args.process_per_rank_max),
           "--threads-per-process-max", str(args.threads_per_process_max)]
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            out = ""
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: the driver, its ranks, its server
                proc.wait(10)
        err.seek(0)
        stderr = err.read()
    lines = out.strip().splitlines()
    if lines and lines[-1].startswith("{"):
        return json.loads(lines[-1])
    tail = " | ".join(stderr.strip().splitlines()[-3:])[-400:]
    status = f"run timed out after {limit:.0f} s" if proc.returncode in (-9, None) else \
        f"driver exited {proc.returncode}: {tail}"
    return {"peer": peer, "world": world, "barriers": barriers, "status": status, "failed_step": "run"}


def gridcomm_source(rev: str | None) -> tuple[Path, str]:
    """Where gridcomm is imported from, and a provenance line (commit, dirty or not)."""
    def git(*cmd: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *cmd], capture_output=True, text=True, check=True).stdout.strip()

    if rev is None:
        dirty = bool(git("status", "--porcelain", "--", "gridcomm", "protos"))
        return ROOT, git("rev-parse", "--short", "HEAD") + (" with uncommitted changes in gridcomm/" if dirty else "")
    target = Path(tempfile.mkdtemp(prefix="gridcomm-bench-"))
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "gridcomm"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    return target, git("rev-parse", "--short", rev)


def machine() -> str:
    model = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as f:
        mem_gib = int(f.readline().split()[1]) / 2**20
    return f"{os.cpu_count()} cores ({model}), {mem_gib:.0f} GiB, Linux {platform.release()}, Python {platform.python_version()}"


def versions() -> str:
    from importlib import metadata
    found = []
    for dist in ("grpcio", "protobuf", "torch", "jaxlib", "cupy-cuda12x"):
        try:
            found.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    return ", ".join(found)


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    source, provenance = gridcomm_source(args.gridcomm_rev)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(source), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               PYTHONWARNINGS="ignore", TORCH_CPP_LOG_LEVEL="ERROR", TF_CPP_MIN_LOG_LEVEL="3")
    report: dict[str, Any] = {
        "command": "python benchmarks/rendezvous.py " + shlex.join(sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(), "versions": versions(), "gridcomm": provenance,
        "ranks": args.ranks, "reps": args.reps, "peers": args.peers, "runs": [],
    }
    dropped: dict[str, int] = {}  # peer -> N at which it failed
    no_barriers: dict[str, int] = {}  # peer -> N at which its barriers failed
    for world in args.ranks:
        for rep in range(args.reps):
            shift = rep % len(args.peers)
            for peer in args.peers[shift:] + args.peers[:shift]:
                if peer in dropped or (args.only_up_to.get(peer, world) < world):
                    continue
                barriers = 0 if peer in no_barriers else args.barriers
                t0 = time.monotonic()
                res = run_one(args, peer, world, barriers, env)
                res.update(rep=rep, wall_s=time.monotonic() - t0)
                report["runs"].append(res)
                print(f"N={world:<6} rep {rep} {peer:<9} {describe(res)} ({res['wall_s']:.0f} s)", flush=True)
                if res["status"] != "ok":
                    if res.get("failed_step") == "barriers" and "t1_s" in res:
                        no_barriers.setdefault(peer, world)
                    else:
                        dropped[peer] = world
                if args.json:
                    Path(args.json).write_text(json.dumps(report, indent=1))
    return report


def describe(res: dict[str, Any]) -> str:
    parts = [f"{k}={res[k] * 1e3:.1f} ms" for k in ("connect_s", "t1_s", "t2_s") if k in res]
    if "server_peak_mb" in res:
        parts.append(f"peak {res['server_peak_mb']:.0f} MB")
    return " ".join(parts + [res["status"] if res["status"] == "ok" else f"FAILED: {res['status']}"])


# --------------------------------------------------------------------------- tables and plot
def summary(report: dict[str, Any]) -> dict[tuple[int, str], dict[str, Any]]:
    """Per (N, peer): lists of each measure over the repetitions, and the statuses."""
    out: dict[tuple[int, str], dict[str, Any]] = {}
    for res in report["runs"]:
        cell = out.setdefault((res["world"], res["peer"]),
                              {"runs": 0, "ok": 0, "failures": [], "skipped_t2": False, "dropped": False})
        cell["runs"] += 1
        cell["ok"] += res["status"] == "ok"
        if res["status"] != "ok":
            cell["failures"].append(res["status"])
            # As in run_all: only a failure before the barriers drops the peer for larger N.
            cell["dropped"] |= res.get("failed_step") != "barriers" or "t1_s" not in res
        if res.get("barriers") == 0:
            cell["skipped_t2"] = True
        for key in ("connect_s", "gate_release_s", "t1_s", "t2_s", "server_peak_mb", "server_start_mb", "idle_growth_mb", "server_cpu_s"):
            if res.get(key) is not None:
                cell.setdefault(key, []).append(res[key])
        if res["status"] == "ok" and res.get("server_cpu_s") is not None:
            cell.setdefault("cpu_per_op_us", []).append(res["server_cpu_s"] / rank_operations(res) * 1e6)
        for phase, seconds in (res.get("ranks_cpu_by_phase_s") or {}).items():
            cell.setdefault(f"ranks_cpu_{phase}", []).append(seconds)
        for key in ("busiest_rank_process_barriers_cpu_s", "listen_overflows"):
            if res.get(key) is not None:
                cell.setdefault(key, []).append(res[key])
    return out


def rank_operations(res: dict[str, Any]) -> int:
    """What the server answered in a run: per rank a connect (join), the blob (set or get) and
    each barrier."""
    return int(res["world"]) * (2 + int(res.get("barriers") or 0))


def ms(seconds: float) -> str:
    value = seconds * 1e3
    return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 100 else f"{value:.0f}"


def median_ms(values: list[float] | None) -> str:
    return ms(statistics.median(values)) if values else "–"


def spread_ms(values: list[float] | None) -> str:
    if not values:
        return "–"
    return f"{ms(statistics.median(values))} [{ms(min(values))}..{ms(max(values))}]"


def median_of(values: list[float] | None, fmt: str = "{:.0f}") -> str:
    return fmt.format(statistics.median(values)) if values else "–"


def status_of(cell: dict[str, Any]) -> str:
    text = f"ok ({cell['ok']}/{cell['runs']})"
    if cell["failures"]:
        first = cell["failures"][0].replace("|", "/")
        if len(first) > 200:
            first = first[:197] + "..."
        text = f"{len(cell['failures'])}/{cell['runs']} failed: {first}"
    if cell["skipped_t2"]:
        text += "; barriers not run in later repetitions (they failed before)"
    return text


def row(world: int, peer: str, cell: dict[str, Any]) -> str:
    peak = median_of(cell.get("server_peak_mb"))
    if cell.get("server_start_mb"):
        peak += f" ({median_of(cell['server_start_mb'])})"
    return (f"| {world} | {peer} | {median_ms(cell.get('connect_s'))} "
            f"| {spread_ms(cell.get('t1_s'))} | {median_ms(cell.get('gate_release_s'))} "
            f"| {spread_ms(cell.get('t2_s'))} | {peak} "
            f"| {median_of(cell.get('idle_growth_mb'), '{:+.1f}')} | {median_of(cell.get('server_cpu_s'), '{:.2f}')} "
            f"| {median_of(cell.get('cpu_per_op_us'), '{:.0f}')} "
            f"| {' / '.join(median_of(cell.get('ranks_cpu_' + p), '{:.2f}') for p in ('connect', 't1', 'barriers'))} "
            f"| {median_of(cell.get('busiest_rank_process_barriers_cpu_s'), '{:.2f}')} "
            f"| {median_of(cell.get('listen_overflows'), '{:.0f}')} "
            f"| {status_of(cell)} |")


def markdown(report: dict[str, Any]) -> str:
    cells = summary(report)
    lines = [
        "| N | peer | connect ms | T1 ms median [min..max] | of which gate ms | T2 ms median [min..max] "
        "| server peak RSS MB (start) | RSS growth over idle MB | server CPU s | server CPU us per rank-op "
        "| rank processes' CPU s: connect / T1 / barriers | busiest rank process's CPU s in the barriers "
        "| listen overflows | status |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for world in sorted(report["ranks"]):
        for peer in sorted(report["peers"], key=PEER_NAMES.index):
            if (world, peer) not in cells:
                failed_at = [w for (w, p), c in cells.items() if p == peer and w < world and c["dropped"]]
                why = f"not run (failed at {min(failed_at)} ranks)" if failed_at else "not run"
                lines.append(f"| {world} | {peer} |" + " – |" * 11 + f" {why} |")
                continue
            lines.append(row(world, peer, cells[world, peer]))
    worlds = sorted({w for w, _ in cells})
    ratio_rows = []
    for world in worlds:
        ratios = [str(world)]
        for other in ("torch", "jax"):
            for key in ("t1_s", "t2_s", "cpu_per_op_us"):
                mine = cells.get((world, "gridcomm"), {}).get(key)
                theirs = cells.get((world, other), {}).get(key)
                # Why the > 0: a server's CPU over a short run can read 0 ticks.
                ratios.append(f"{statistics.median(mine) / statistics.median(theirs):.2f}x"
                              if mine and theirs and statistics.median(theirs) > 0 else "–")
        ratio_rows.append("| " + " | ".join(ratios) + " |")
    lines += ["", "Ratios of medians (below 1.00x: gridcomm is faster):", "",
              "| N | T1 gridcomm/torch | T2 gridcomm/torch | server CPU gridcomm/torch | T1 gridcomm/JAX "
              "| T2 gridcomm/JAX | server CPU gridcomm/JAX |",
              "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |", *ratio_rows]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = summary(report)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, title in ((axes[0], "t1_s", "T1: every rank holds rank 0's 128-byte blob"),
                           (axes[1], "t2_s", "T2: one barrier (mean of 20)")):
        for peer in report["peers"]:
            pts = sorted((w, c[key]) for (w, p), c in cells.items() if p == peer and c.get(key))
            if not pts:
                continue
            xs = [w for w, _ in pts]
            meds = [statistics.median(v) * 1e3 for _, v in pts]
            lo = [m - min(v) * 1e3 for m, (_, v) in zip(meds, pts, strict=True)]
            hi = [max(v) * 1e3 - m for m, (_, v) in zip(meds, pts, strict=True)]
            ax.errorbar(xs, meds, yerr=[lo, hi], marker="o", capsize=3, label=peer)
        ax.set_xscale("log", base=2)
        # Why "8k": 8192 and 16384 sit one step apart on the axis and their full labels overlap.
        ax.set_xticks(sorted(report["ranks"]), [str(n) if n < 4096 else f"{n // 1024}k" for n in sorted(report["ranks"])])
        ax.minorticks_off()
        ax.set_yscale("log")
        ax.set_xlabel("ranks (N)")
        ax.set_ylabel("ms (median, bars: min..max)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    machine_text = listed(report["machine"]).split(" (")[0]
    fig.suptitle(f"Rendezvous on {machine_text}; gridcomm {listed(report['gridcomm'])}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


NOTES = (
    "Notes:",
    "",
    "- *of which gate*: the harness opens each phase by closing a pipe every rank process waits on; the "
    "time until the last rank thread had passed that gate is part of T1. On 2 cores it is the floor of T1 "
    "(waking 32-128 processes and up to 512 threads each), and it grows where the server, busy with the "
    "ranks already woken, competes with them for the cores.",
    "- Everything runs in a network namespace that has only loopback (`unshare --net`; `--no-netns` turns "
    "it off): torch's TCPStore looks up the name of every socket's peer, and the PTR query for 127.0.0.1 "
    "otherwise goes to the machine's resolver (measured before: 15 s of connect at 128 ranks, a connect "
    "timeout at 2048). In the namespace the query fails at once and nothing leaves the machine.",
    "- cupyx's store: its barrier object is shared by all waiters and every waiter clears it on the way out, "
    "so a rank that returns first and enters the next barrier creates a new one, which a late waiter of the "
    "previous barrier then clears; the ranks end up split over barrier objects that never fill. Back-to-back "
    "barriers therefore hang; the harness bounds the phase and records it, and runs cupyx without barriers "
    "afterwards (its T1 still includes the one barrier of its NCCL-ID exchange). Each request is a new TCP "
    "connection and a server thread.",
    "- JAX's client starts 3 OS threads per rank; with this machine's `kernel.pid_max` of 32768, 12,288 ranks "
    "or more cannot start, so the large-N runs cover gridcomm and torch only.",
)


def section(report: dict[str, Any], png: str | None) -> str:
    body = [
        SECTION_BEGIN,
        "## Rendezvous at scale (CPU)",
        "",
        "gridcomm's coordinator against `torch.distributed.TCPStore` (libuv server), JAX's coordination "
        "service (jaxlib's distributed runtime) and cupyx's store, one harness, peers interleaved per "
        "repetition. Ranks are OS processes up to 128 (`--process-per-rank-max`), above that 32 processes "
        "of N/32 threads (above 4,096 ranks, N/128 processes of 128: `--threads-per-process-max`); every rank has its own client and its own connection, as a pod would (gridcomm: "
        "`session=\"client\"`, a Session stream per rank; see \"Deployment shapes\" in docs/design.md); each "
        "server runs in a process of its own. *connect*: from a "
        "common start until every client is connected (gridcomm's join and JAX's connect wait for all ranks; "
        "torch's constructor opens a socket; cupyx has no connect step). *T1*: from every client ready until "
        "every rank holds a 128-byte blob published by rank 0 (cupyx: set, barrier, get, as NCCLBackend does). "
        "*T2*: mean of 20 consecutive barriers after that (torch: its native `TCPStore.barrier`). Server "
        "figures: peak RSS (VmHWM) with the RSS after start in brackets, "
        f"RSS change over {report['runs'][0].get('idle_s', 0) if report['runs'] else 0:g} s idle with every "
        "client connected, CPU seconds from start to the last barrier, and that CPU per rank-operation "
        "(each rank's join, blob and barriers). The rank processes' CPU (clients, and gridcomm's relays, "
        "all processes together) in each phase: on 2 cores, with the server's, it bounds each phase's time. "
        "The busiest rank process's CPU in the barriers bounds the busiest relay's (gridcomm's relay shares its "
        "process with rank threads). Listen overflows: connects the network namespace's listen queues dropped "
        "during the run (each waits out a SYN retry).",
        "",
        f"gridcomm's figures are from {measured_library(report)}; earlier runs are in git history.",
        "",
        f"- command: {listed(public_command(report['command']), code=True)}",
        f"- machine: {listed(report['machine'])}; shared with other work while it ran, hence medians and min..max",
        f"- versions: {listed(report['versions'])}",
        f"- date: {listed(report['date'])}",
        "",
        markdown(report),
        "",
        *NOTES,
        "",
    ]
    if png:
        body += [f"![T1 and T2 against N, log-log]({png})", ""]
    body.append(SECTION_END)
    return "\n".join(body)


def public_command(command: str | list[str]) -> str | list[str]:
    """A run's command as BENCHMARKS.md shows it: without where its raw results went (``--json``,
    ``--from-json``: files of the person who ran it, often temporary) and with a commit hash given
    to ``--gridcomm-rev`` as ``REV``, so the document holds no temporary path and no commit hash
    (git history has both)."""
    if isinstance(command, list):
        return [str(public_command(c)) for c in command]
    argv, out = shlex.split(command), []
    dropped = ("--json", "--from-json")
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in dropped:
            skip = "=" not in arg
            continue
        out.append(arg)
    for i, arg in enumerate(out):
        # A revision by name (HEAD, a branch) says nothing dated; a commit's hash is history.
        if arg.startswith("--gridcomm-rev="):
            out[i] = "--gridcomm-rev=" + as_rev(arg.split("=", 1)[1])
        elif i and out[i - 1] == "--gridcomm-rev":
            out[i] = as_rev(arg)
    return shlex.join(out)


def as_rev(rev: str) -> str:
    return "REV" if re.fullmatch(r"[0-9a-fA-F]{7,40}", rev) else rev


def measured_library(report: dict[str, Any]) -> str:
    """Which gridcomm was measured, in words: the JSON keeps the commit; the document names none."""
    found = report["gridcomm"] if isinstance(report["gridcomm"], list) else [report["gridcomm"]]
    commands = report["command"] if isinstance(report["command"], list) else [report["command"]]
    if any("--gridcomm-rev" in c for c in commands):
        return "the library as committed at the command's `--gridcomm-rev` when it ran"
    if any("uncommitted" in p for p in found):
        return ("the library as committed with this section (`git log -1 -- BENCHMARKS.md`), measured from a working "
                "tree whose gridcomm/ had changes not yet committed")
    return "the library as committed with this section (`git log -1 -- BENCHMARKS.md`)"


def write_markdown(path: Path, text: str) -> None:
    """Replaces this benchmark's own section of the file (others write the rest of it)."""
    old = path.read_text() if path.exists() else "# gridcomm benchmarks\n"
    if SECTION_BEGIN in old and SECTION_END in old:
        head, rest = old.split(SECTION_BEGIN, 1)
        new = head + text + rest.split(SECTION_END, 1)[1]
    else:
        new = old.rstrip("\n") + "\n\n" + text + "\n"
    path.write_text(new)


def merge(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One report from several runs of the harness (e.g. the default subset, then larger N)."""
    out = dict(reports[0], runs=[run for r in reports for run in r["runs"]])
    for key in ("command", "date", "gridcomm", "machine", "versions"):
        seen = list(dict.fromkeys(r[key] for r in reports))
        out[key] = seen[0] if len(seen) == 1 else seen
    out["peers"] = list(dict.fromkeys(p for r in reports for p in r["peers"]))
    out["ranks"] = sorted({n for r in reports for n in r["ranks"]})
    return out


def pooled(reports: list[dict[str, Any]]) -> str:
    """Per-repetition ratios pooled over runs: each gridcomm repetition divided by each other
    peer's in the same repetition of the same run (the machine drifts between runs, less within
    one), then the median [min..max] and how many fell below 1.0 (gridcomm faster)."""
    ratios: dict[tuple[int, str, str], list[float]] = {}
    for report in reports:
        ok = [run for run in report["runs"] if run.get("status") == "ok"]
        by = {(run["world"], run["peer"], run["rep"]): run for run in ok}
        for (world, peer, rep), run in by.items():
            ours = by.get((world, "gridcomm", rep))
            if peer == "gridcomm" or ours is None:
                continue
            for key in ("t1_s", "t2_s", "gate_release_s"):
                if ours.get(key) and run.get(key):
                    ratios.setdefault((world, peer, key), []).append(ours[key] / run[key])
            if all(r.get(k) for r in (ours, run) for k in ("t1_s", "gate_release_s")):
                rest = (ours["t1_s"] - ours["gate_release_s"], run["t1_s"] - run["gate_release_s"])
                if rest[1] > 0:
                    ratios.setdefault((world, peer, "T1 after its gate"), []).append(rest[0] / rest[1])
    lines = ["| N | against | measure | repetitions | gridcomm/peer median [min..max] | below 1.0 |",
             "| ---: | --- | --- | ---: | --- | ---: |"]
    for (world, peer, key), values in sorted(ratios.items()):
        name = {"t1_s": "T1", "t2_s": "T2", "gate_release_s": "T1's gate"}.get(key, key)
        lines.append(f"| {world} | {peer} | {name} | {len(values)} | {statistics.median(values):.2f}x "
                     f"[{min(values):.2f}..{max(values):.2f}] | {sum(v < 1.0 for v in values)} |")
    return "\n".join(lines)


def listed(value: str | list[str], code: bool = False) -> str:
    items = value if isinstance(value, list) else [value]
    return "; ".join(f"`{v}`" if code else v for v in items)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default=",".join(map(str, DEFAULT_RANKS)),
                    help=f"comma-separated rank counts, from {RANK_COUNTS} (default %(default)s)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions, at least 3 (default %(default)s)")
    ap.add_argument("--peers", default=",".join(PEER_NAMES), help="default %(default)s")
    ap.add_argument("--only-up-to", default="", metavar="PEER=N,...",
                    help="run these peers only up to N ranks (e.g. jax=2048,cupyx=2048)")
    ap.add_argument("--barriers", type=int, default=20)
    ap.add_argument("--timeout-s", type=float, default=120.0, help="bound on each phase and each call")
    ap.add_argument("--barrier-timeout-s", type=float, default=120.0,
                    help="bound on the barrier phase (all barriers together, and so each one)")
    ap.add_argument("--idle-s", type=float, default=5.0, help="idle period for the RSS growth")
    ap.add_argument("--gridcomm-rev", default=None,
                    help="measure gridcomm as committed at this revision (git archive), not the working tree")
    ap.add_argument("--json", default=None, help="write the raw results here (also read by --from-json)")
    ap.add_argument("--from-json", default=None, metavar="FILE[,FILE...]",
                    help="only render tables and plot from earlier --json files (runs merged)")
    ap.add_argument("--pool", default=None, metavar="FILE[,FILE...]",
                    help="print per-repetition ratios against each peer, pooled over these --json files, and exit")
    ap.add_argument("--markdown", default=None, help="write the section into this file (e.g. BENCHMARKS.md)")
    ap.add_argument("--plot", default="benchmarks/rendezvous.png", help="PNG path ('' for none)")
    ap.add_argument("--no-netns", action="store_true",
                    help="do not re-run in a loopback-only network namespace (see loopback_only)")
    ap.add_argument("--_serve", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_run", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--process-per-rank-max", type=int, default=PROCESS_PER_RANK_MAX,
                    help="up to this many ranks every rank is an OS process of its own; above it, "
                         f"{PROCESSES} processes of threads (default %(default)s)")
    ap.add_argument("--threads-per-process-max", type=int, default=THREADS_PER_PROCESS_MAX,
                    help=f"above --process-per-rank-max: at least {PROCESSES} processes, and more where a process "
                         "would hold more rank threads than this (default %(default)s)")
    ap.add_argument("--world", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.ranks = [int(x) for x in args.ranks.split(",") if x]
    args.peers = [p for p in args.peers.split(",") if p]
    unknown = [p for p in args.peers if p not in PEERS]
    if unknown:
        ap.error(f"unknown peer(s) {unknown}; choose from {list(PEERS)}")
    bad = [n for n in args.ranks if n not in RANK_COUNTS]
    if bad:
        ap.error(f"rank counts {bad} are not among {RANK_COUNTS}")
    if args.reps < 3 and not (args._serve or args._run or args.from_json):
        ap.error(f"--reps {args.reps}: at least 3 repetitions are needed for a median and a spread")
    args.only_up_to = {k: int(v) for k, v in (item.split("=") for item in args.only_up_to.split(",") if item)}
    return args


def loopback_only(argv: list[str]) -> None:
    """Re-runs this harness in a network namespace of its own that has only loopback, so nothing
    leaves the machine: torch looks up the name of every socket's peer (a PTR query for
    127.0.0.1), which otherwise goes to the machine's resolver. Needs root; else says so and goes on."""
    if os.environ.get("RENDEZVOUS_BENCH_NETNS") == "1":
        import fcntl
        import struct
        siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            flags = struct.unpack("16sH14s", fcntl.ioctl(s, siocgifflags, struct.pack("16sH14s", b"lo", 0, b"")))[1]
            fcntl.ioctl(s, siocsifflags, struct.pack("16sH14s", b"lo", flags | iff_up, b""))
        return
    if os.geteuid() != 0 or not shutil.which("unshare"):
        print("note: not root or no unshare(1): running in this network namespace; torch's per-socket name "
              "lookups will go to the configured resolver", file=sys.stderr)
        return
    os.environ["RENDEZVOUS_BENCH_NETNS"] = "1"
    sys.stdout.flush()
    os.execvp("unshare", ["unshare", "--net", "--", sys.executable, os.path.abspath(__file__), *argv])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args._serve:
        serve(args._serve, args.world, args.timeout_s)
        return 0
    if args._run:
        print(json.dumps(drive(args._run, args.world, args.barriers, args.timeout_s, args.barrier_timeout_s,
                               args.idle_s, args.process_per_rank_max, args.threads_per_process_max)), flush=True)
        return 0
    if args.pool:
        print(pooled([json.loads(Path(f).read_text()) for f in args.pool.split(",")]))
        return 0
    if not args.from_json and not args.no_netns:
        loopback_only(argv)
    report = merge([json.loads(Path(f).read_text()) for f in args.from_json.split(",")]) if args.from_json \
        else run_all(args)
    print()
    print(markdown(report))
    png = None
    if args.plot:
        plot(report, args.plot)
        png = os.path.relpath(Path(args.plot).resolve(), Path(args.markdown).resolve().parent) if args.markdown else args.plot
        print(f"\nplot: {args.plot}")
    if args.markdown:
        write_markdown(Path(args.markdown), section(report, png))
        print(f"section written into {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
