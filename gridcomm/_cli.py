"""The ``gridcomm`` command line. Only this module configures logging handlers."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gridcomm import _config
from gridcomm._channel import channel_options
from gridcomm._client import fetch_status
from gridcomm._errors import GridcommError
from gridcomm._server import Coordinator

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
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run a standalone coordinator")
    serve.add_argument("--world-size", type=int, default=None, help="number of ranks (default: GRIDCOMM_WORLD_SIZE)")
    serve.add_argument("--bind", default=None, help="listen address (default: GRIDCOMM_BIND or 0.0.0.0)")
    serve.add_argument("--port", type=int, default=None, help="listen port (default: GRIDCOMM_PORT or 13333; 0 picks one)")
    serve.add_argument("--job-id", default=None, help="job id every rank must present (default: GRIDCOMM_JOB_ID)")
    serve.add_argument("--exit-when-done", action="store_true",
                       help="exit 0 once every rank has left (non-zero if a rank failed)")

    probe = sub.add_parser("probe", help="grpc.health.v1 Check; exit 0 only when SERVING")
    probe.add_argument("target", help="HOST:PORT")
    probe.add_argument("--service", default="", help="service name to check (default: '' = the whole server)")
    probe.add_argument("--timeout-s", type=float, default=5.0, help="deadline of the check (default 5 s)")

    status = sub.add_parser("status", help="who joined, who is missing, pending barriers, failures")
    status.add_argument("target", help="HOST:PORT")
    status.add_argument("--timeout-s", type=float, default=10.0)

    launch = sub.add_parser("launch", help="start N local ranks (like torchrun); a failing rank stops the rest")
    launch.add_argument("--nproc", type=int, required=True, help="number of local ranks")
    launch.add_argument("--backend", default=None, help="auto, nccl or host (default: GRIDCOMM_BACKEND or auto)")
    launch.add_argument("-m", dest="module", default=None, help="run a module (like python -m)")
    launch.add_argument("argv", nargs=argparse.REMAINDER, help="SCRIPT [ARGS] (or the module's ARGS)")

    demo = sub.add_parser("demo", help="the main job on its embedded default")
    demo.add_argument("--nproc", type=int, default=4, help="local ranks (default 4)")
    demo.add_argument("--backend", default=None, help="auto, nccl or host (default: auto)")
    demo.add_argument("--iters", type=int, default=None, help="timed calls per collective (default: 20 host, 500 nccl)")
    return parser


def _serve(args: argparse.Namespace) -> int:
    bind = _config.bind_address(args.bind)
    _, port = _config.coordinator_address("localhost", args.port)
    server = Coordinator(_config.world_size(args.world_size), bind=bind, port=port, token=_config.token(),
                         job_id=args.job_id, tls=_config.tls(), health_port=_config.health_port()).start()
    print(f"gridcomm coordinator for {server.world_size} ranks listening on "
          f"{_config.format_target(bind, server.port)}"
          + (f" (TLS; plaintext health on port {server.health_port})" if server.tls else "")
          + (f" (health on port {server.health_port})" if server.health_port and not server.tls else ""), flush=True)
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
    with grpc.insecure_channel(address, options=channel_options()) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            code = exc.code()  # type: ignore[attr-defined]
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return PROBE_UNREACHABLE, f"{address}: no health answer within {timeout_s:g} s ({code.name}: {exc.details()})"  # type: ignore[attr-defined]
            return PROBE_RPC_FAILED, f"{address}: health check of service {service!r} failed: {code.name}: {exc.details()}"  # type: ignore[attr-defined]
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    if response.status == health_pb2.HealthCheckResponse.SERVING:
        return PROBE_SERVING, f"{address}: service {service!r} is SERVING"
    return PROBE_NOT_SERVING, f"{address}: service {service!r} is {name}"


def _status(args: argparse.Namespace) -> int:
    host, port = _config.parse_target(args.target)
    reply = fetch_status(host, port, timeout_s=args.timeout_s)
    joined = [m for m in reply.members]
    print(f"job {reply.job_id!r}: {len(joined)} of {reply.world_size} ranks joined, generation {reply.generation}, "
          f"{'SERVING' if reply.serving else 'NOT_SERVING'}, up {reply.uptime_s:.1f} s")
    if reply.missing_ranks:
        print(f"missing ranks ({len(reply.missing_ranks)}): {list(reply.missing_ranks)[:64]}")
    states = {1: "joined", 2: "left", 3: "failed"}
    for m in joined[:256]:
        print(f"  rank {m.rank:>5}  {states.get(m.state, '?'):<7} {m.hostname}  incarnation {m.incarnation:#018x}")
    if len(joined) > 256:
        print(f"  ... {len(joined) - 256} more")
    for b in reply.barriers:
        print(f"barrier {b.name!r} #{b.seq}: {len(b.arrived_ranks)} arrived, waiting {b.waiting_s:.1f} s for "
              f"{list(b.missing_ranks)[:32]}")
    for f in reply.failures:
        print(f"FAILED rank {f.rank}: {f.reason}")
    return 0


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
        if args.command == "launch":
            from gridcomm._launch import launch

            command = list(args.argv)
            if args.module:
                command = ["-m", args.module, *command]
            return launch(args.nproc, command, backend=args.backend)
        if args.command == "demo":
            from gridcomm._demo import run_demo

            return run_demo(nproc=args.nproc, backend=args.backend, iters=args.iters)
    except GridcommError as exc:
        print(f"gridcomm {args.command}: {exc}", file=sys.stderr)
        return 2
    raise AssertionError(f"unknown command {args.command}")
