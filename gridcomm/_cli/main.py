"""The ``gridcomm`` command line. Only this module configures logging handlers."""

from __future__ import annotations

import argparse
import logging
import platform
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gridcomm import _config
from gridcomm._coordinator.server import Coordinator
from gridcomm._errors import ConfigError, GridcommError
from gridcomm._runtime.channel import channel_options

log = logging.getLogger("gridcomm")

# Exit codes of `gridcomm probe`, as grpc_health_probe uses them (kubelet only reads zero/non-zero).
PROBE_SERVING = 0
PROBE_BAD_ARGS = 1
PROBE_UNREACHABLE = 2
PROBE_RPC_FAILED = 3
PROBE_NOT_SERVING = 4


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gridcomm", description="NCCL/host communicators with a gRPC control plane.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)")
    parser.add_argument("--version", action="version", version=version_text(),
                        help="print gridcomm's version (and grpcio's, protobuf's, Python's) and exit")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run a standalone coordinator")
    serve.add_argument("--world-size", type=int, default=None, help="number of ranks (default: GRIDCOMM_WORLD_SIZE)")
    serve.add_argument("--bind", default=None, help="listen address (default: GRIDCOMM_BIND or 0.0.0.0)")
    serve.add_argument("--port", type=int, default=None, help="listen port (default: GRIDCOMM_PORT or 13333; 0 picks one)")
    serve.add_argument("--job-id", default=None, help="job id every rank must present (default: GRIDCOMM_JOB_ID)")
    serve.add_argument("--exit-when-done", action="store_true",
                       help="exit 0 once every rank has left (non-zero if a rank failed)")
    serve.add_argument("--metrics-port", type=int, default=None,
                       help="serve Prometheus metrics at http://BIND:PORT/metrics (default: GRIDCOMM_METRICS_PORT, "
                            "else none; 0 picks a free port)")

    probe = sub.add_parser("probe", help="grpc.health.v1 Check; exit 0 only when SERVING")
    probe.add_argument("target", help="HOST:PORT")
    probe.add_argument("--service", default="", help="service name to check (default: '' = the whole server)")
    probe.add_argument("--timeout-s", type=float, default=5.0, help="deadline of the check (default 5 s)")

    status = sub.add_parser("status", help="who joined, who is missing, pending barriers, failures")
    status.add_argument("target", help="HOST:PORT")
    status.add_argument("--timeout-s", type=float, default=10.0, help="deadline of each Status call (default 10 s)")
    status.add_argument("--watch", action="store_true", help="a live view, redrawn every --interval-s until Ctrl-C")
    status.add_argument("--interval-s", type=float, default=2.0, help="--watch: seconds between frames (default 2)")
    status.add_argument("--count", type=int, default=None, help="--watch: stop after this many frames")

    trace = sub.add_parser("trace", help="merge the flight records ranks wrote to GRIDCOMM_TRACE_DIR")
    trace.add_argument("directory", help="the GRIDCOMM_TRACE_DIR the ranks wrote to")
    launch = sub.add_parser("launch", help="start N local ranks (like torchrun); a failing rank stops the rest, or is restarted (--max-restarts)")
    launch.add_argument("--nproc", type=int, required=True, help="number of local ranks")
    launch.add_argument("--backend", default=None, help="auto, nccl or host (default: GRIDCOMM_BACKEND or auto)")
    launch.add_argument("--gpus", type=int, default=None,
                        help="place ranks round-robin on the first N visible GPUs (default: all; 0: leave "
                             "CUDA_VISIBLE_DEVICES alone); ranks beyond N share GPUs in NCCL's multi-rank mode")
    launch.add_argument("--max-restarts", type=int, default=0,
                        help="start a rank whose process fails again as its replacement, at most N times in all "
                             "(the launcher then hosts the coordinator; survivors rebuild()); default 0")
    launch.add_argument("-m", dest="module", default=None, help="run a module (like python -m)")
    launch.add_argument("argv", nargs=argparse.REMAINDER, help="SCRIPT [ARGS] (or the module's ARGS)")

    demo = sub.add_parser("demo", help="the main job on its embedded default")
    demo.add_argument("--nproc", type=int, default=4, help="local ranks (default 4)")
    demo.add_argument("--backend", default=None, help="auto, nccl or host (default: auto)")
    demo.add_argument("--iters", type=int, default=None, help="timed calls per collective (default: 20 host, 500 nccl)")
    return parser


def version_text() -> str:
    """``gridcomm X (grpcio Y, protobuf Z, Python W)``: what a bug report needs."""
    from google import protobuf

    from gridcomm import __version__

    return (f"gridcomm {__version__} (grpcio {grpc.__version__}, protobuf {protobuf.__version__}, "
            f"Python {platform.python_version()})")


def _serve(args: argparse.Namespace) -> int:
    settings = _config.CoordinatorSettings.serve(args.world_size, args.bind, args.port, args.job_id,
                                                 args.metrics_port)
    server = Coordinator(settings=settings).start()
    print(f"gridcomm coordinator for {server.world_size} ranks listening on "
          f"{_config.format_target(settings.bind, server.port)}"
          + (f" (TLS; plaintext health on port {server.health_port})" if server.tls else "")
          + (f" (health on port {server.health_port})" if server.health_port and not server.tls else "")
          + (f" (metrics on port {server.metrics_port})" if server.metrics_port else ""), flush=True)
    done = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("received signal %d; stopping", signum)
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        while not done.is_set():
            if args.exit_when_done and server.wait_all_left(0.2):
                break
            done.wait(0.2)
    finally:
        server.stop()
    return 1 if server.state.failed else 0


def probe(target: str, service: str = "", timeout_s: float = 5.0) -> tuple[int, str]:
    """One grpc.health.v1 Check, as kubelet's gRPC probe does; returns (exit code, one-line reason)."""
    try:
        host, port = _config.parse_target(target)
        timeout_s = _config.parse_duration("--timeout-s", timeout_s)
    except GridcommError as exc:
        return PROBE_BAD_ARGS, str(exc)
    address = _config.format_target(host, port)
    started = time.monotonic()
    refused = _refused(host, port, timeout_s)
    if refused:
        return PROBE_UNREACHABLE, (f"{address}: connection refused ({refused}); nothing listens on port {port}: is "
                                   f"the process running and serving health there?")
    with grpc.insecure_channel(address, options=channel_options()) as channel:
        # Why connect first, within the whole deadline: a port that accepts but is slow to answer
        # (HTTP/2 settings arriving late) gets the whole timeout, as kubelet and grpc_health_probe give it.
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            return PROBE_UNREACHABLE, (f"{address}: cannot connect within {timeout_s:g} s; is the process running and "
                                       f"serving health on port {port}?")
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), wait_for_ready=True,
                timeout=max(0.05, timeout_s - (time.monotonic() - started)))
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details()  # type: ignore[attr-defined]
            took = time.monotonic() - started
            if code == grpc.StatusCode.UNAVAILABLE:
                return PROBE_UNREACHABLE, (f"{address}: the connection failed ({details}; after {took:.1f} s); is the "
                                           f"process running and serving health on port {port}?")
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                return PROBE_UNREACHABLE, f"{address}: no health answer within {timeout_s:g} s ({details})"
            return PROBE_RPC_FAILED, f"{address}: health check of service {service!r} failed: {code.name}: {details}"

    name = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    if response.status == health_pb2.HealthCheckResponse.SERVING:
        return PROBE_SERVING, f"{address}: service {service!r} is SERVING"
    return PROBE_NOT_SERVING, f"{address}: service {service!r} is {name}"


def _refused(host: str, port: int, timeout_s: float) -> str | None:
    """Why a TCP connection to ``host:port`` was refused, or None. A refusal is an answer: the host
    is up and nothing listens, so the probe fails at once, as kubelet's does (its next period is
    the retry). Anything else (a name that does not resolve yet, no answer, no route) may still
    come right, so the probe dials on, until its deadline."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except ConnectionRefusedError as exc:
        return exc.strerror or "refused"
    except OSError:
        return None


def _status(args: argparse.Namespace) -> int:
    from gridcomm._cli import status as _statusview

    host, port = _config.parse_target(args.target)
    timeout_s = _config.parse_duration("--timeout-s", args.timeout_s)
    if not args.watch:
        return _statusview.show(host, port, timeout_s, sys.stdout)
    interval_s = _config.parse_duration("--interval-s", args.interval_s)
    if args.count is not None and args.count < 1:
        raise ConfigError(f"--count={args.count} must be at least 1.")
    return _statusview.watch(host, port, interval_s, args.count, timeout_s, sys.stdout)


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "probe":
            code, reason = probe(args.target, args.service, args.timeout_s)
            print(reason, file=sys.stdout if code == PROBE_SERVING else sys.stderr)
            return code
        if args.command == "status":
            return _status(args)
        if args.command == "trace":
            from gridcomm._cli import trace as _trace

            return _trace.show(args.directory, sys.stdout)
        if args.command == "launch":
            from gridcomm._cli.launch import launch

            command = list(args.argv)
            if args.module:
                command = ["-m", args.module, *command]
            return launch(args.nproc, command, backend=args.backend, max_restarts=args.max_restarts,
                          gpus=args.gpus)
        if args.command == "demo":
            from gridcomm._cli.demo import run_demo

            return run_demo(nproc=args.nproc, backend=args.backend, iters=args.iters)
    except GridcommError as exc:
        text = str(exc)
        # Why: an error raised for a call named after the command already starts with its name.
        if text.startswith(f"{args.command}: "):
            text = text[len(args.command) + 2:]
        print(f"gridcomm {args.command}: {text}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"gridcomm {args.command}: interrupted", file=sys.stderr)
        return 130
    raise AssertionError(f"unknown command {args.command}")
