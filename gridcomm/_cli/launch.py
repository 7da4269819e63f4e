"""``gridcomm launch``: N local ranks, like torchrun, with a failing rank stopping the rest."""

from __future__ import annotations

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

#: After one rank fails, the others get SIGTERM, then SIGKILL once this grace has passed.
STOP_GRACE_S = 10.0


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free now (the coordinator binds it a moment later; a clash is reported)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def rank_environments(nproc: int, backend: str, port: int, environ: Mapping[str, str],
                      master_port: int | None = None, gpus: list[str] | None = None) -> list[dict[str, str]]:
    """Each rank's environment: gridcomm's settings, and torchrun's names for the same facts (a
    torchrun-style script reads RANK, WORLD_SIZE ...). MASTER_PORT is a port of its own, free at
    launch: a torch program makes its TCPStore there, which must not be gridcomm's coordinator.
    Rank r gets GPU ``gpus[r % len(gpus)]`` (default: the visible ones), and NCCL's
    several-ranks-per-GPU settings where ranks outnumber GPUs (see placement.gpu_sharing)."""
    if gpus is None:
        gpus = visible_gpus(environ)
    sharing, _ = gpu_sharing(nproc, gpus, backend, environ)
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
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = gpus[rank % len(gpus)]
        env.update(sharing)
        envs.append(env)
    return envs


def _pump(stream: IO[bytes], prefix: bytes, sink: IO[bytes], lock: threading.Lock) -> None:
    for line in iter(stream.readline, b""):
        with lock:
            sink.write(prefix + line)
            sink.flush()
    stream.close()


def launch(nproc: int, command: Sequence[str], backend: str | None = None,
           environ: Mapping[str, str] | None = None, gpus: int | None = None) -> int:
    """Runs ``command`` as ``nproc`` ranks; returns 0 when all exit 0, else the first failure's code.
    ``gpus``: place the ranks on the first ``gpus`` visible GPUs (default all; 0: none)."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ConfigError(f"--nproc={nproc!r} must be a positive integer.")
    if not command:
        raise ConfigError("launch needs a script (or -m MODULE) to run.")
    # Why a copy: the launcher adds each rank's settings to what it passes on (the token included:
    # its ranks are the children it is asked to give it to), and never changes its own environment.
    env_in = dict(_config.process_environ() if environ is None else environ)
    chosen = _config.launch_backend(backend, env_in)
    port = _config.launch_port(env_in) or free_port()
    relay = None
    if _config.relay_mode(env_in) == "on":
        # The node agent's relay: the ranks started here reach the coordinator (in rank 0) through
        # it, on one connection, the same operation of several ranks as one.
        from gridcomm._client.relay import Relay

        relay = Relay(_config.format_target("127.0.0.1", port), token=_config.token(None, env_in),
                      tls=_config.tls(env_in), heartbeat_timeout_s=_config.heartbeat_timeout_s(None, env_in)).start()
        env_in = {**env_in, "GRIDCOMM_RELAY_ADDRESS": relay.target}
    lock = threading.Lock()
    out = sys.stdout.buffer
    err = sys.stderr.buffer
    placed = placed_gpus(env_in, gpus)
    _, shared = gpu_sharing(nproc, placed, chosen, env_in)
    if shared is not None:
        err.write(f"{shared}\n".encode())
        err.flush()
    procs: list[subprocess.Popen[bytes]] = []
    pumps: list[threading.Thread] = []
    for rank, env in enumerate(rank_environments(nproc, chosen, port, env_in, gpus=placed)):
        proc = subprocess.Popen([sys.executable, *command], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        procs.append(proc)
        prefix = f"[rank {rank}] ".encode()
        for stream, sink in ((proc.stdout, out), (proc.stderr, err)):
            assert stream is not None
            pump = threading.Thread(target=_pump, args=(stream, prefix, sink, lock), daemon=True)
            pump.start()
            pumps.append(pump)

    interrupted: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        if not interrupted:
            interrupted.append(signum)
            with lock:
                err.write(f"gridcomm launch: got {signal.Signals(signum).name}; passing it to every rank and waiting "
                          f"for them to stop (up to {STOP_GRACE_S:g} s)\n".encode())
                err.flush()
        _signal_all(procs, signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    first_failure: tuple[int, int] | None = None
    by_pid = {proc.pid: rank for rank, proc in enumerate(procs)}
    try:
        running = set(range(nproc))
        while running:
            # Blocks until some child exits (no polling); signals are forwarded meanwhile.
            try:
                pid, status = os.wait()
            except ChildProcessError:
                # Reaped elsewhere (a Popen method): what Popen recorded is their exit.
                for rank in sorted(running):
                    code = procs[rank].wait(10)
                    if code != 0 and first_failure is None:
                        first_failure = (rank, code)
                running.clear()
                break
            found = by_pid.get(pid)
            if found is None or found not in running:
                continue
            rank = found
            running.discard(rank)
            code = os.waitstatus_to_exitcode(status)
            procs[rank].returncode = code
            if code != 0 and first_failure is None:
                first_failure = (rank, code)
                if interrupted:
                    # Why: the rank ended because of the signal this launcher passed on; that is
                    # not a failure of the rank to report (Ctrl-C must not read as "rank 2 failed").
                    _reap_later(procs, running)
                    continue
                with lock:
                    err.write(f"gridcomm launch: rank {rank} exited with code {code}; stopping the other "
                              f"ranks\n".encode())
                    err.flush()
                _signal_all(procs, signal.SIGTERM)
                _reap_later(procs, running)
    finally:
        _stop(procs)
        if relay is not None:
            relay.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for pump in pumps:
            pump.join(5)
    if interrupted:
        return 128 + interrupted[0]
    if first_failure is None:
        return 0
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


def _reap_later(procs: Sequence[subprocess.Popen[bytes]], running: set[int]) -> None:
    """SIGKILL for ranks still running STOP_GRACE_S after the first failure."""
    def kill() -> None:
        for rank in list(running):
            _signal_all([procs[rank]], signal.SIGKILL)

    timer = threading.Timer(STOP_GRACE_S, kill)
    timer.daemon = True
    timer.start()


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
