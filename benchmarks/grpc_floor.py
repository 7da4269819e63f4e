"""A floor for gridcomm's barrier: the same pattern with nothing of gridcomm in it.

P processes x T threads each; per barrier the last thread of a process to arrive sends one message
on its process's stream, a counting server answers every stream once all P have, and the
process's reader wakes its threads as a tree (each wakes the next two), as gridcomm's Session
does. Messages are raw bytes (no protobuf) and the server does nothing else, so what this costs is
gRPC's (or, with ``--transport tcp``, the kernel's and Python's threads') share of a barrier.

    python benchmarks/grpc_floor.py --processes 32 --threads 16 --barriers 300
    python benchmarks/grpc_floor.py --transport sync    # grpc's synchronous stream API
    python benchmarks/grpc_floor.py --transport unary   # one blocking unary call per process
    python benchmarks/grpc_floor.py --transport tcp     # a plain socket, no gRPC

Compare with gridcomm on the same machine: ``python benchmarks/rendezvous.py --ranks 512
--peers gridcomm`` (T2) or the per-barrier figures of ``benchmarks/session_probe.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import queue
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from session_probe import gate_and_collect, switches  # this directory is the script's: sys.path[0]


def _same(data: bytes) -> bytes:
    return data


def serve_grpc(processes: int, out: Any, stop: Any) -> None:
    async def main() -> None:
        state: dict[str, Any] = {"count": 0, "release": None}

        def arrived() -> asyncio.Future[bytes]:
            """Counts one process in; the future is done once all have arrived."""
            if state["release"] is None:
                state["release"] = asyncio.get_running_loop().create_future()
            release = state["release"]
            state["count"] += 1
            if state["count"] == processes:
                state["count"], state["release"] = 0, None
                release.set_result(b"go")
            return release  # type: ignore[no-any-return]

        async def stream(_: Any, context: grpc.aio.ServicerContext) -> None:
            while True:
                message = await context.read()
                if message is grpc.aio.EOF:
                    return
                await context.write(await arrived())

        async def arrive(_: bytes, context: grpc.aio.ServicerContext) -> bytes:
            return await arrived()

        handler = grpc.method_handlers_generic_handler(
            "floor.Floor", {"Barrier": grpc.stream_stream_rpc_method_handler(stream, _same, _same),
                            "Arrive": grpc.unary_unary_rpc_method_handler(arrive, _same, _same)})
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        out.put((port, os.getpid()))
        while not stop.is_set():
            await asyncio.sleep(0.1)
        await server.stop(0)

    asyncio.run(main())


def serve_tcp(processes: int, out: Any, stop: Any) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(processes)
    out.put((listener.getsockname()[1], os.getpid()))
    conns = [listener.accept()[0] for _ in range(processes)]
    selector = selectors.DefaultSelector()
    for conn in conns:
        selector.register(conn, selectors.EVENT_READ)
    arrived, open_conns = 0, processes
    while open_conns and not stop.is_set():
        for key, _ in selector.select(0.5):
            data = key.fileobj.recv(64)  # type: ignore[union-attr]
            if not data:
                selector.unregister(key.fileobj)
                open_conns -= 1
                continue
            arrived += len(data)
            while arrived >= processes:
                arrived -= processes
                for conn in conns:
                    conn.sendall(b"g")


class _Waiter:
    __slots__ = ("lock", "next")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lock.acquire()
        self.next: list[_Waiter] = []


def rank_process(transport: str, port: int, threads: int, barriers: int, ready: Any, go: Any, out: Any) -> None:
    arrived: list[_Waiter] = []
    mutex = threading.Lock()

    def release_all() -> None:
        with mutex:
            woken = arrived[:threads]
            del arrived[:threads]
        for i, waiter in enumerate(woken):
            waiter.next = woken[2 * i + 1 : 2 * i + 3]
        woken[0].lock.release()

    send: Callable[[], None]
    if transport == "tcp":
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def tcp_reader() -> None:
            while sock.recv(1):
                release_all()

        threading.Thread(target=tcp_reader, daemon=True).start()

        def send() -> None:
            sock.sendall(b"a")
    elif transport == "unary":
        # The last thread of a process makes one blocking unary call for all of them and wakes
        # them when it returns: no loop thread and no reader between the socket and the ranks.
        arrive = grpc.insecure_channel(f"127.0.0.1:{port}").unary_unary(
            "/floor.Floor/Arrive", request_serializer=_same, response_deserializer=_same)

        def send() -> None:
            arrive(b"a" * 40, timeout=60)
            release_all()
    elif transport == "sync":
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        outbox: queue.SimpleQueue[bytes] = queue.SimpleQueue()

        def requests() -> Iterator[bytes]:
            while True:
                yield outbox.get()

        replies = channel.stream_stream("/floor.Floor/Barrier", request_serializer=_same,
                                        response_deserializer=_same)(requests())

        def sync_reader() -> None:
            for _ in replies:
                release_all()

        threading.Thread(target=sync_reader, daemon=True).start()

        def send() -> None:
            outbox.put(b"a" * 40)
    else:
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()
        calls: list[Any] = []
        tasks: set[asyncio.Future[Any]] = set()  # referenced until done (the loop holds tasks weakly)

        def keep(task: asyncio.Future[Any]) -> None:
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        async def open_stream() -> None:
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
            call = channel.stream_stream("/floor.Floor/Barrier", request_serializer=_same, response_deserializer=_same)()
            outbox: asyncio.Queue[bytes] = asyncio.Queue()
            calls.append(outbox)

            async def aio_reader() -> None:
                async for _ in call:
                    release_all()

            async def aio_writer() -> None:  # one write in flight at a time, as gRPC requires
                while True:
                    await call.write(await outbox.get())

            keep(asyncio.ensure_future(aio_reader()))
            keep(asyncio.ensure_future(aio_writer()))

        asyncio.run_coroutine_threadsafe(open_stream(), loop).result(30)

        def send() -> None:
            loop.call_soon_threadsafe(calls[0].put_nowait, b"a" * 40)

    rank_cpu: list[tuple[float, int, int]] = []  # each rank thread's CPU and switches (append is atomic)

    def rank() -> None:
        started, (voluntary, involuntary) = time.thread_time(), switches()
        for _ in range(barriers):
            waiter = _Waiter()
            with mutex:
                arrived.append(waiter)
                last = len(arrived) == threads
            if last:
                send()
            waiter.lock.acquire()
            for following in waiter.next:
                following.lock.release()
        voluntary_end, involuntary_end = switches()
        rank_cpu.append((time.thread_time() - started, voluntary_end - voluntary, involuntary_end - involuntary))

    ready.put(os.getpid())
    go.wait(60)
    wall, cpu = time.perf_counter(), time.process_time()
    workers = [threading.Thread(target=rank) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(600)
    out.put((time.perf_counter() - wall, time.process_time() - cpu, *(sum(column) for column in zip(*rank_cpu, strict=True))))
    out.close()
    out.join_thread()
    os._exit(0)  # the reader threads and stream stay blocked; nothing to tidy in this process


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=32)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--barriers", type=int, default=300)
    ap.add_argument("--transport", choices=("aio", "sync", "unary", "tcp"), default="aio")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    out, stop, ready, go = ctx.Queue(), ctx.Event(), ctx.Queue(), ctx.Event()
    serve = serve_tcp if args.transport == "tcp" else serve_grpc
    server = ctx.Process(target=serve, args=(args.processes, out, stop))
    server.start()
    ranks: list[Any] = []
    try:
        port, server_pid = out.get(timeout=60)
        ranks = [ctx.Process(target=rank_process, args=(args.transport, port, args.threads, args.barriers, ready, go, out))
                 for _ in range(args.processes)]
        results, server_cpu = gate_and_collect(ranks, ready, go, out, server_pid, 600)
        n = args.barriers
        print(f"{args.transport}, {args.processes} processes x {args.threads} threads: "
              f"{max(r[0] for r in results) / n * 1e3:.2f} ms per barrier; per barrier, clients "
              f"{sum(r[1] for r in results) / n * 1e3:.3f} ms of CPU (of which rank threads "
              f"{sum(r[2] for r in results) / n * 1e3:.3f} ms; their voluntary and involuntary switches "
              f"{sum(r[3] for r in results) / n:.1f} and {sum(r[4] for r in results) / n:.1f}), "
              f"server {server_cpu / n * 1e3:.3f} ms")
        return 0
    finally:
        stop.set()  # the ranks end by themselves once done; the server on this
        for process in [*ranks, server]:
            process.join(30)
            if process.is_alive():
                process.kill()


if __name__ == "__main__":
    sys.exit(main())
