"""Interactive rank processes and a standard health client, for tests that walk a job through
phases: each rank runs a script that reads commands on stdin and reports on stdout, so a test
moves every rank from phase to phase and checks each phase as it holds (no sleeps).

The health client is grpc's own ``grpc.health.v1`` stub over a fresh plaintext channel per check,
as kubelet dials one per probe.
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterable, Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.procs import ROOT

READINESS = "gridcomm.v1.Coordinator"
LIVENESS = ""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def check(port: int, service: str, timeout_s: float = 2.0) -> str:
    """One grpc.health.v1 Check, as kubelet makes it: the status name, or the gRPC code's name."""
    options = [("grpc.use_local_subchannel_pool", 1), ("grpc.enable_http_proxy", 0)]
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=timeout_s)
        except grpc.RpcError as exc:
            return str(exc.code().name)  # type: ignore[attr-defined]
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def wait_status(port: int, service: str, want: str, timeout_s: float) -> float:
    """Checks until ``service`` answers ``want``; returns when it did. Fails at the deadline."""
    deadline = time.monotonic() + timeout_s
    seen = []
    while True:
        status = check(port, service)
        if status == want:
            return time.monotonic()
        seen.append(status)
        assert time.monotonic() < deadline, f"port {port} {service!r} never answered {want} ({seen[-5:]})"
        time.sleep(0.05)  # the probe period, not a synchronisation: the answer is what is waited for


def observe(port: int, service: str, window_s: float) -> set[str]:
    """Every answer ``service`` gives over ``window_s`` (a prober's view of a period of time)."""
    seen = set()
    end = time.monotonic() + window_s
    while time.monotonic() < end:
        seen.add(check(port, service))
        time.sleep(0.1)
    return seen


class Rank:
    """One rank's process: ``code`` runs with the environment given; ``send`` writes a command
    line on its stdin; ``expect`` waits for a line of its stdout that starts with a word."""

    def __init__(self, rank: int, code: str, env: dict[str, str]) -> None:
        self.rank = rank
        full = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        full.update(env)
        self._err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=full, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._err, text=True, bufsize=1)
        self._lines: queue.Queue[str] = queue.Queue()
        self.stdout: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def expect(self, word: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"rank {self.rank} printed no {word!r} line within {timeout_s} s\n"
                                     f"{self.report()}") from None
            self.stdout.append(line)
            if line.split(" ", 1)[0] == word:
                return line

    def stderr(self) -> str:
        self._err.seek(0)
        return self._err.read()

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"rank {self.rank} still running after {timeout_s} s\n{self.report()}") from None

    def report(self) -> str:
        return (f"--- rank {self.rank} (returncode {self.proc.poll()})\nstdout: {self.stdout[-20:]}\n"
                f"stderr:\n{self.stderr()[-4000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass


@contextlib.contextmanager
def serving(args: list[str], env: dict[str, str]) -> Iterator[tuple[subprocess.Popen, str]]:
    """``gridcomm serve ARGS`` in a process of its own: yields it and its first line (where it
    listens); terminated (then killed) on the way out."""
    proc = subprocess.Popen([sys.executable, "-m", "gridcomm", "serve", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        yield proc, proc.stdout.readline()
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def kill_all(ranks: Iterable[Rank]) -> None:
    for rank in ranks:
        rank.kill()
