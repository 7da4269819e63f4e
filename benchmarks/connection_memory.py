"""What one open connection costs a gRPC Python server, and which server options change it.

A bare grpc.aio server (one unary method that echoes) in a process of its own, with gridcomm's
control-plane server options (``gridcomm._runtime.guard.control_server_options``) plus the
variant's; one client process opens N connections (a channel each, local subchannel pool), makes
one unary call on each with gridcomm-sized metadata, and keeps them open. The figure is the
server's RSS with all N open, less its RSS after start, per connection. Repeated per variant,
interleaved; medians and min..max. Loopback only.

    python benchmarks/connection_memory.py --connections 2000 --reps 3
    MALLOC_ARENA_MAX=1 python benchmarks/connection_memory.py --variants base

Why: the directed join costs the coordinator one such connection per rank while the ranks ask;
this says how much of that is gRPC's own, and whether an option lowers it.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

os.environ.setdefault("GRPC_VERBOSITY", "NONE")  # before gRPC starts: the closes' GOAWAY lines are noise here

import grpc  # noqa: E402
from rendezvous import proc_stats  # noqa: E402  (this directory is the script's: sys.path[0])

from gridcomm._runtime.guard import control_server_options  # noqa: E402

VARIANTS: dict[str, list[tuple[str, Any]]] = {
    "base": [],
    "no-channelz": [("grpc.enable_channelz", 0), ("grpc.max_channel_trace_event_memory_per_node", 0)],
    "hpack-0": [("grpc.http2.hpack_table_size.decoder", 0), ("grpc.http2.hpack_table_size.encoder", 0)],
    "read-chunk-1k": [("grpc.experimental.tcp_read_chunk_size", 1024),
                      ("grpc.experimental.tcp_min_read_chunk_size", 256)],
    "lookahead-16k": [("grpc.http2.lookahead_bytes", 16384)],
}
METADATA = (("authorization", "Bearer " + "t" * 40), ("gridcomm-rank", "12345"), ("gridcomm-job", "job-abcdef"))


def _serve(variant: str, ports: Any, stop: Any) -> None:
    extra = VARIANTS[variant]
    names = {name for name, _ in extra}
    options = [o for o in control_server_options(1 << 20) if o[0] not in names] + extra

    async def main() -> None:
        async def echo(request: bytes, context: Any) -> bytes:
            return request

        server = grpc.aio.server(options=options)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "probe.Probe", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ports.put(port)
        while not stop.is_set():
            await asyncio.sleep(0.1)
        await server.stop(0)

    asyncio.run(main())


async def _connect(port: int, n: int) -> list[grpc.aio.Channel]:
    channels: list[grpc.aio.Channel] = []
    gate = asyncio.Semaphore(256)

    async def one() -> None:
        async with gate:
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
            channels.append(channel)
            await channel.unary_unary("/probe.Probe/Echo")(b"x" * 200, metadata=METADATA, timeout=60)

    await asyncio.gather(*(one() for _ in range(n)))
    return channels


def measure(variant: str, n: int) -> float:
    """KB of server RSS per open connection."""
    ctx = mp.get_context("spawn")
    ports, stop = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=_serve, args=(variant, ports, stop), daemon=True)
    server.start()
    try:
        port = ports.get(timeout=60)
        time.sleep(0.5)
        before = proc_stats(server.pid)["rss_mb"]  # type: ignore[arg-type]

        async def hold() -> float:
            channels = await _connect(port, n)
            await asyncio.sleep(1.0)
            after = proc_stats(server.pid)["rss_mb"]  # type: ignore[arg-type]
            for channel in channels:
                await channel.close()
            return after

        after = asyncio.run(hold())
        return (after - before) * 1024 / n
    finally:
        stop.set()
        server.join(10)
        if server.is_alive():
            server.kill()
            server.join(5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connections", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"from {', '.join(VARIANTS)}")
    args = ap.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    results: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.reps):
        for variant in variants:
            results[variant].append(measure(variant, args.connections))
    print(f"{args.connections} connections, {args.reps} reps, MALLOC_ARENA_MAX={os.environ.get('MALLOC_ARENA_MAX', 'unset')}")
    print("| server options | KB per open connection, median [min..max] |")
    print("| --- | ---: |")
    for variant, values in results.items():
        print(f"| {variant} | {statistics.median(values):.1f} [{min(values):.1f}..{max(values):.1f}] |")


if __name__ == "__main__":
    main()
