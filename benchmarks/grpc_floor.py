"""A floor for gridcomm's barrier in the deployment shape: the same pattern on bare gRPC.

N ranks, each with a connection and a bidirectional stream of its own (P processes x T threads,
every thread a rank with its own channel, as rendezvous.py's gridcomm ranks); per barrier every
rank writes one message on its stream, and a server that only counts answers every stream once
all N have. Messages are raw bytes (no protobuf) and the server does nothing else, so what this
costs is gRPC's share of a barrier: server CPU per rank-operation and wall time per barrier, and
the server's peak memory per connected rank (peak RSS once every rank holds its stream, less the RSS
after start).

    python benchmarks/grpc_floor.py --ranks 512 --barriers 100
    python benchmarks/grpc_floor.py --ranks 512 --servers tcp     # asyncio sockets, no gRPC

The default (``--servers grpc,tcp,gridcomm``) also runs gridcomm's own clients and coordinator
through the same harness in the same run (barriers only, one Session stream per rank).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import struct
import sys
import threading
import time
from typing import Any

import grpc
from rendezvous import proc_stats  # this directory is the script's: sys.path[0]

METHOD = "/floor.Floor/Barrier"


def _same(data: bytes) -> bytes:
    return data


# ---------------------------------------------------------------------------- servers
def grpc_server(world: int, port_out: Any, ready: Any) -> None:
    async def main() -> None:
        waiting: list[Any] = []
        writers: list[asyncio.Task[None]] = []

        async def barrier(request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
            while True:
                message = await context.read()
                if message is grpc.aio.EOF:
                    return
                waiting.append(context)
                if len(waiting) == world:
                    released = waiting[:]
                    waiting.clear()
                    for ctx in released:
                        writers.append(asyncio.ensure_future(ctx.write(message)))
                    writers.clear()

        server = grpc.aio.server(options=[("grpc.so_reuseport", 0), ("grpc.max_concurrent_streams", 1 << 16)],
                                 maximum_concurrent_rpcs=None)
        handler = grpc.stream_stream_rpc_method_handler(barrier, request_deserializer=_same, response_serializer=_same)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("floor.Floor", {"Barrier": handler}),))
        port_out.value = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ready.set()
        await server.wait_for_termination()

    asyncio.run(main())


def tcp_server(world: int, port_out: Any, ready: Any) -> None:
    async def main() -> None:
        waiting: list[asyncio.StreamWriter] = []

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                try:
                    await reader.readexactly(4)
                except asyncio.IncompleteReadError:
                    return
                waiting.append(writer)
                if len(waiting) == world:
                    for w in waiting:
                        w.write(b"done")
                    waiting.clear()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port_out.value = server.sockets[0].getsockname()[1]
        ready.set()
        await server.serve_forever()

    asyncio.run(main())


def gridcomm_server(world: int, port_out: Any, ready: Any) -> None:
    import gridcomm

    server = gridcomm.Coordinator(world, bind="127.0.0.1", port=0).start()
    port_out.value = server.port
    ready.set()
    threading.Event().wait()


# ---------------------------------------------------------------------------- ranks
def ranks_process(kind: str, ranks: list[int], world: int, port: int, barriers: int, start: Any, out: Any) -> None:
    """T ranks of one process, each with its own connection; returns per-barrier times of its first rank."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    times: list[float] = []

    def grpc_rank(rank: int) -> None:
        async def connect() -> Any:
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
            return channel, channel.stream_stream(METHOD, request_serializer=_same, response_deserializer=_same)()

        channel, call = asyncio.run_coroutine_threadsafe(connect(), loop).result(30)
        start.wait()
        for _ in range(barriers):
            t = time.monotonic()
            asyncio.run_coroutine_threadsafe(call.write(b"b"), loop).result(60)
            asyncio.run_coroutine_threadsafe(call.read(), loop).result(60)
            if rank == ranks[0]:
                times.append(time.monotonic() - t)
        asyncio.run_coroutine_threadsafe(channel.close(), loop).result(10)

    def tcp_rank(rank: int) -> None:
        import socket

        sock = socket.create_connection(("127.0.0.1", port))
        start.wait()
        for _ in range(barriers):
            t = time.monotonic()
            sock.sendall(struct.pack(">I", rank))
            got = b""
            while len(got) < 4:
                got += sock.recv(4 - len(got))
            if rank == ranks[0]:
                times.append(time.monotonic() - t)
        sock.close()

    def gridcomm_rank(rank: int) -> None:
        import gridcomm

        client = gridcomm.CoordinatorClient("127.0.0.1", port, rank, world, timeout_s=120, session="client")
        client.join()
        start.wait()
        for i in range(barriers):
            t = time.monotonic()
            client.barrier(f"b{i}")
            if rank == ranks[0]:
                times.append(time.monotonic() - t)
        client.leave()

    run = {"grpc": grpc_rank, "tcp": tcp_rank, "gridcomm": gridcomm_rank}[kind]
    threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(times)
    out.close()
    out.join_thread()  # flushed before the exit below (no atexit hooks: some clients block at exit)
    os._exit(0)


def measure(kind: str, world: int, processes: int, barriers: int) -> dict[str, float]:
    ctx = mp.get_context("fork")
    port, ready = ctx.Value("i", 0), ctx.Event()
    server = ctx.Process(target={"grpc": grpc_server, "tcp": tcp_server, "gridcomm": gridcomm_server}[kind],
                         args=(world, port, ready), daemon=True)
    server.start()
    try:
        assert ready.wait(30), "the server did not start"
        assert server.pid is not None
        base_mb = proc_stats(server.pid)["rss_mb"]
        start, out = ctx.Event(), ctx.Queue()
        per = max(1, world // processes)
        groups = [list(range(i, min(i + per, world))) for i in range(0, world, per)]
        procs = [ctx.Process(target=ranks_process, args=(kind, g, world, port.value, barriers, start, out), daemon=True)
                 for g in groups]
        for p in procs:
            p.start()
        time.sleep(2.0 + world / 200)  # every rank connected (joined) before the clock starts
        connected = proc_stats(server.pid)
        before = connected["cpu_s"]
        t0 = time.monotonic()
        start.set()
        times = [out.get(timeout=600) for _ in procs][0]
        wall = time.monotonic() - t0
        cpu = proc_stats(server.pid)["cpu_s"] - before
        for p in procs:
            p.join(30)
        return {"t2_ms": statistics.median(times) * 1e3, "wall_per_barrier_ms": wall / barriers * 1e3,
                "server_cpu_us_per_rank_op": cpu / (world * barriers) * 1e6,
                "server_kb_per_rank": (connected["hwm_mb"] - base_mb) * 1024 / world}
    finally:
        server.kill()
        server.join(10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=512)
    ap.add_argument("--processes", type=int, default=32)
    ap.add_argument("--barriers", type=int, default=100)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--servers", default="grpc,tcp,gridcomm", help="which of grpc, tcp, gridcomm (default %(default)s)")
    args = ap.parse_args()
    kinds = [k for k in args.servers.split(",") if k]
    rows: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    for rep in range(args.reps):
        for kind in kinds[rep % len(kinds):] + kinds[: rep % len(kinds)]:
            res = measure(kind, args.ranks, args.processes, args.barriers)
            rows[kind].append(res)
            print(f"rep {rep} {kind:<9} " + " ".join(f"{k}={v:.1f}" for k, v in res.items()), flush=True)
    print(f"\n{args.ranks} ranks ({args.processes} processes), {args.barriers} barriers, {args.reps} repetitions: "
          "median [min..max]")
    print("| server | wall ms per barrier | server CPU us per rank-op | server KB per connected rank |\n"
          "| --- | ---: | ---: | ---: |")
    for kind, res in rows.items():
        wall = [r["wall_per_barrier_ms"] for r in res]
        cpu = [r["server_cpu_us_per_rank_op"] for r in res]
        kb = [r["server_kb_per_rank"] for r in res]
        print(f"| {kind} | {statistics.median(wall):.1f} [{min(wall):.1f}..{max(wall):.1f}] "
              f"| {statistics.median(cpu):.0f} [{min(cpu):.0f}..{max(cpu):.0f}] "
              f"| {statistics.median(kb):.1f} [{min(kb):.1f}..{max(kb):.1f}] |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
