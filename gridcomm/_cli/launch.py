"""``gridcomm launch``: N local ranks, like torchrun. A failing rank stops the rest, or, with
``--max-restarts N``, is started again as its own replacement (survivors ``rebuild()``)."""

from __future__ import annotations

import collections
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO

from gridcomm import _config
from gridcomm._cli.placement import gpu_sharing, placed_gpus, visible_gpus
from gridcomm._errors import ConfigError

__all__ = ["free_port", "launch", "rank_environments", "visible_gpus"]

#: Once the ranks are told to stop, SIGKILL follows SIGTERM after this grace.
STOP_GRACE_S = 10.0
#: After a rank fails for good, the others get this long to see the failure and report it
#: (RankFailedError names the rank within about 2 s) before they get SIGTERM.
REPORT_GRACE_S = 5.0
#: How many of each rank's last output lines the launcher keeps for its summary at a failure.
LAST_LINES = 3


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free now (the coordinator binds it a moment later; a clash is reported)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def rank_environments(nproc: int, backend: str, port: int, environ: Mapping[str, str],
                      master_port: int | None = None, coordinator_rank: int | None = 0,
                      gpus: list[str] | None = None) -> list[dict[str, str]]:
    """Each rank's environment: gridcomm's settings, and torchrun's names for the same facts (a
    torchrun-style script reads RANK, WORLD_SIZE ...). MASTER_PORT is a port of its own, free at
    launch: a torch program makes its TCPStore there, which must not be gridcomm's coordinator.

    Per-process ports are offset by the local rank (GRIDCOMM_HEALTH_PORT + i), so ranks of one
    host do not clash; GRIDCOMM_METRICS_PORT goes to ``coordinator_rank`` alone (None: the
    coordinator runs outside the ranks, which then dial it as an external one). Rank r gets GPU
    ``gpus[r % len(gpus)]`` (default: the visible ones), and NCCL's several-ranks-per-GPU settings
    where ranks outnumber GPUs (see placement.gpu_sharing)."""
    if gpus is None:
        gpus = visible_gpus(environ)
    sharing, _ = gpu_sharing(nproc, gpus, backend, environ)
    health = _config.health_port(None, environ)
    if health is not None and health + nproc - 1 > 65535:
        raise ConfigError(f"GRIDCOMM_HEALTH_PORT={health} leaves no room for {nproc} ranks' health ports "
                          f"({health}..{health + nproc - 1}); choose a port at most {65536 - nproc}.")
    master = master_port
    while master is None or master == port:
        master = free_port()
    envs = []
    for rank in range(nproc):
        env = dict(environ)
        env.update(GRIDCOMM_RANK=str(rank), GRIDCOMM_LOCAL_RANK=str(rank), GRIDCOMM_WORLD_SIZE=str(nproc),
                   GRIDCOMM_HOST="127.0.0.1", GRIDCOMM_PORT=str(port), GRIDCOMM_BACKEND=backend,
                   GRIDCOMM_BIND=env.get("GRIDCOMM_BIND", "127.0.0.1"), PYTHONUNBUFFERED="1",
                   RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master))
        if health is not None:
            env["GRIDCOMM_HEALTH_PORT"] = str(health + rank)
        if rank != coordinator_rank:
            env.pop("GRIDCOMM_METRICS_PORT", None)
        if coordinator_rank is None:
            env["GRIDCOMM_COORDINATOR"] = "external"
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = gpus[rank % len(gpus)]
        env.update(sharing)
        envs.append(env)
    return envs


def describe_exit(code: int) -> str:
    """``code 3``, or ``code -9 (SIGKILL)`` for a rank a signal ended."""
    if code < 0:
        try:
            return f"code {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"code {code}"


class _Ranks:
    """The ranks' processes: started (and started again), their output pumped to the launcher's
    with a ``[rank i]`` prefix, and each rank's last lines kept for the summary at a failure."""

    def __init__(self, command: Sequence[str], envs: Sequence[dict[str, str]]) -> None:
        self.command = list(command)
        self.envs = envs
        self.lock = threading.Lock()
        self.out = sys.stdout.buffer
        self.err = sys.stderr.buffer
        self.procs: list[subprocess.Popen[bytes]] = []
        self.by_pid: dict[int, int] = {}
        self.last: list[collections.deque[str]] = [collections.deque(maxlen=LAST_LINES) for _ in envs]
        self.pumps: list[threading.Thread] = []

    def start(self, rank: int, restart: int = 0) -> None:
        """Starts ``rank``'s process; a restart gets the same environment plus the restart count."""
        env = self.envs[rank]
        if restart:
            env = dict(env, GRIDCOMM_RESTART_COUNT=str(restart), TORCHELASTIC_RESTART_COUNT=str(restart))
        proc = subprocess.Popen([sys.executable, *self.command], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        if rank < len(self.procs):
            self.procs[rank] = proc
        else:
            self.procs.append(proc)
        self.by_pid[proc.pid] = rank
        prefix = f"[rank {rank}] ".encode()
        for stream, sink in ((proc.stdout, self.out), (proc.stderr, self.err)):
            assert stream is not None
            pump = threading.Thread(target=self._pump, args=(stream, prefix, sink, rank), daemon=True)
            pump.start()
            self.pumps.append(pump)

    def _pump(self, stream: IO[bytes], prefix: bytes, sink: IO[bytes], rank: int) -> None:
        for line in iter(stream.readline, b""):
            with self.lock:
                sink.write(prefix + line)
                sink.flush()
                text = line.decode(errors="replace").rstrip()
                if text.strip():
                    self.last[rank].append(text)
        stream.close()

    def say(self, text: str) -> None:
        with self.lock:
            self.err.write(f"gridcomm launch: {text}\n".encode())
            self.err.flush()

    def signal(self, ranks: Sequence[int], signum: int) -> None:
        _signal_all([self.procs[r] for r in ranks], signum)

    def summary(self, ranks: Sequence[int]) -> None:
        """Each of ``ranks``' last output lines, together at the end (they were interleaved)."""
        with self.lock:
            shown = [(r, line) for r in ranks for line in self.last[r]]
            if not shown:
                return
            self.err.write(b"gridcomm launch: the other ranks' last lines:\n")
            for rank, line in shown:
                self.err.write(f"  [rank {rank}] {line}\n".encode())
            self.err.flush()

    def close(self) -> None:
        _stop(self.procs)
        for pump in self.pumps:
            pump.join(5)


def launch(nproc: int, command: Sequence[str], backend: str | None = None,
           environ: Mapping[str, str] | None = None, max_restarts: int = 0, gpus: int | None = None) -> int:
    """Runs ``command`` as ``nproc`` ranks; returns 0 when every rank ends with 0, else the code
    of the failure that ended the job. With ``max_restarts`` a rank whose process fails is started
    again (same rank and environment, GRIDCOMM_RESTART_COUNT set), at most that many times in all;
    the coordinator then runs in this process, so any rank, rank 0 too, may be replaced.
    ``gpus``: place the ranks on the first ``gpus`` visible GPUs (default all; 0: none)."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ConfigError(f"--nproc={nproc!r} must be a positive integer.")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ConfigError(f"--max-restarts={max_restarts!r} must be a whole number, 0 or more.")
    if not command:
        raise ConfigError("launch needs a script (or -m MODULE) to run.")
    # Why a copy: the launcher adds each rank's settings to what it passes on (the token included:
    # its ranks are the children it is asked to give it to), and never changes its own environment.
    env_in = dict(_config.process_environ() if environ is None else environ)
    chosen = _config.launch_backend(backend, env_in)
    port = _config.launch_port(env_in)
    coordinator = None
    coordinator_rank: int | None = 0
    if max_restarts:
        # Why here: embedded in rank 0, the coordinator would die with rank 0, and with it the job.
        from gridcomm._coordinator.server import Coordinator

        bind = env_in.get("GRIDCOMM_BIND") or "127.0.0.1"
        settings = _config.CoordinatorSettings.resolve(
            nproc, bind=bind, port=port or 0, token=_config.token(None, env_in), tls=_config.tls(env_in),
            metrics_port=_config.metrics_port(None, env_in), environ=env_in)
        coordinator = Coordinator(settings=settings).start()
        port = coordinator.port
        coordinator_rank = None
    port = port or free_port()
    relay = None
    try:
        if _config.relay_mode(env_in) == "on":
            # The node agent's relay: the ranks started here reach the coordinator through it, on
            # one connection, the same operation of several ranks as one.
            from gridcomm._relay.server import Relay

            relay = Relay(_config.format_target("127.0.0.1", port), token=_config.token(None, env_in),
                          tls=_config.tls(env_in),
                          heartbeat_timeout_s=_config.heartbeat_timeout_s(None, env_in)).start()
            env_in = {**env_in, "GRIDCOMM_RELAY_ADDRESS": relay.target}
        placed = placed_gpus(env_in, gpus)
        _, shared = gpu_sharing(nproc, placed, chosen, env_in)
        if shared is not None:
            sys.stderr.buffer.write(f"{shared}\n".encode())
            sys.stderr.buffer.flush()
        envs = rank_environments(nproc, chosen, port, env_in, coordinator_rank=coordinator_rank, gpus=placed)
        return _run(_Ranks(command, envs), max_restarts)
    finally:
        if relay is not None:
            relay.stop()
        if coordinator is not None:
            coordinator.stop()


def _run(ranks: _Ranks, max_restarts: int) -> int:
    nproc = len(ranks.envs)
    interrupted: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        if not interrupted:
            interrupted.append(signum)
            ranks.say(f"got {signal.Signals(signum).name}; passing it to every rank and waiting for them to stop "
                      f"(up to {STOP_GRACE_S:g} s)")
        ranks.signal(range(len(ranks.procs)), signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    first_failure: tuple[int, int] | None = None
    restarts = 0
    running = set(range(nproc))
    timers: list[threading.Timer] = []
    try:
        for rank in range(nproc):
            ranks.start(rank)
        while running:
            # Blocks until some child exits (no polling); signals are forwarded meanwhile.
            try:
                pid, status = os.wait()
            except ChildProcessError:
                # Reaped elsewhere (a Popen method): what Popen recorded is their exit.
                for rank in sorted(running):
                    code = ranks.procs[rank].wait(10)
                    if code != 0 and first_failure is None:
                        first_failure = (rank, code)
                running.clear()
                break
            rank = ranks.by_pid.pop(pid, -1)
            if rank not in running or ranks.procs[rank].pid != pid:
                continue
            code = os.waitstatus_to_exitcode(status)
            ranks.procs[rank].returncode = code
            if code != 0 and first_failure is None and not interrupted and restarts < max_restarts:
                restarts += 1
                ranks.say(f"rank {rank} exited with {describe_exit(code)}; starting it again (restart {restarts} "
                          f"of at most {max_restarts})")
                ranks.start(rank, restart=restarts)
                continue
            running.discard(rank)
            if code == 0 or first_failure is not None:
                continue
            first_failure = (rank, code)
            if interrupted:
                # Why: the rank ended because of the signal this launcher passed on; that is
                # not a failure of the rank to report (Ctrl-C must not read as "rank 2 failed").
                timers.append(_later(STOP_GRACE_S, ranks, signal.SIGKILL))
                continue
            spent = "no restarts left; " if max_restarts else ""
            ranks.say(f"rank {rank} exited with {describe_exit(code)}; {spent}stopping the other ranks (they have "
                      f"{REPORT_GRACE_S:g} s to report it)")
            timers.append(_later(REPORT_GRACE_S, ranks, signal.SIGTERM))
            timers.append(_later(REPORT_GRACE_S + STOP_GRACE_S, ranks, signal.SIGKILL))
    finally:
        for timer in timers:
            timer.cancel()
        ranks.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if interrupted:
        return 128 + interrupted[0]
    if first_failure is None:
        return 0
    ranks.summary([r for r in range(nproc) if r != first_failure[0]])
    return first_failure[1] if first_failure[1] > 0 else 128 - first_failure[1]


def _signal_all(procs: Sequence[subprocess.Popen[bytes]], signum: int) -> None:
    # Why os.kill, not Popen.send_signal: that polls first, reaping a child that exited, and the
    # launcher's os.wait() then found no child to wait for (ChildProcessError after a Ctrl-C, seen
    # on a loaded machine). An exited child not yet waited for keeps its pid, so this is safe.
    for proc in procs:
        if proc.returncode is None:
            try:
                os.kill(proc.pid, signum)
            except ProcessLookupError:
                pass


def _later(delay_s: float, ranks: _Ranks, signum: int) -> threading.Timer:
    """``signum`` for the ranks still running ``delay_s`` from now (those not yet reaped)."""
    timer = threading.Timer(delay_s, lambda: ranks.signal(range(len(ranks.procs)), signum))
    timer.daemon = True
    timer.start()
    return timer


def _stop(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    alive = [p for p in procs if p.returncode is None and p.poll() is None]
    for proc in alive:
        proc.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in alive:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
