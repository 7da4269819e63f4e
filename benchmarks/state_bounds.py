"""What an authenticated rank can make the coordinator hold (issue 27, items 4 and 5), replayed
against a real ``gridcomm serve`` with a token, one fresh server per attack:

- ``barriers``: arrivals at distinct barrier names nobody else reaches (each stays pending);
- ``keys``: sets of distinct keys of ``--key-chars`` characters with empty values;
- ``values``: sets of distinct keys with values of ``--value-mb`` MB;
- ``gets``: gets of keys nobody sets, parked on Session streams of one connection.

Every rank of the job is a real ``CoordinatorClient`` (heartbeating); the attacker uses rank 0's
identity on connections of its own. For each attack it prints the server's RSS before and after
(and its peak), how many operations were accepted, the first refusal, and what the state costs a
scan: the time of one Status call and one /metrics scrape, the coordinator's loop lag meanwhile,
and the worst latency a rank's cheap call saw while they ran (the loop stall). Then every rank
passes one barrier (still served) or the script says it could not.

    python benchmarks/state_bounds.py                                  # this checkout, every attack
    python benchmarks/state_bounds.py --only barriers --names 200000   # one attack, fewer operations
    python benchmarks/state_bounds.py --gridcomm /tmp/old/checkout     # the server of another checkout
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import secrets
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import grpc  # noqa: E402

import gridcomm  # noqa: E402
from gridcomm._proto import coordinator_pb2 as pb  # noqa: E402
from gridcomm._proto import coordinator_pb2_grpc as pb_grpc  # noqa: E402

TOKEN = "state-bounds-" + secrets.token_hex(8)
METADATA = (("authorization", f"Bearer {TOKEN}"),)
#: Client channels take answers up to the server's own send cap and a bit more, so an answer the
#: server cannot send shows as the server's error, not this side's.
OPTIONS = [("grpc.max_receive_message_length", 128 * 1024 * 1024), ("grpc.max_send_message_length", 2 * 1024 * 1024),
           ("grpc.use_local_subchannel_pool", 1)]


def _kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
    return int(match.group(1)) if match else 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A ``gridcomm serve`` process with a token and a metrics port, on loopback."""

    def __init__(self, world: int, checkout: str, log_path: str) -> None:
        env = dict(os.environ, GRIDCOMM_TOKEN=TOKEN, PYTHONPATH=checkout, PYTHONUNBUFFERED="1")
        metrics_port = _free_port()
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gridcomm", "serve", "--world-size", str(world), "--bind", "127.0.0.1",
             "--port", "0", "--metrics-port", str(metrics_port)],
            cwd="/", env=env, stdout=subprocess.PIPE, stderr=self._log, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout is not None else ""
        match = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
        if not match:
            self.stop()
            raise SystemExit(f"gridcomm serve did not start: {line!r} (log: {log_path})")
        self.port = int(match.group(1))
        self.metrics_port = metrics_port

    def rss_mb(self) -> float:
        return _kb(self.proc.pid, "VmRSS") / 1024

    def peak_mb(self) -> float:
        return _kb(self.proc.pid, "VmHWM") / 1024

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


@contextmanager
def job(world: int, checkout: str, log_path: str) -> Iterator[tuple[Server, list[gridcomm.CoordinatorClient]]]:
    server = Server(world, checkout, log_path)
    clients: list[gridcomm.CoordinatorClient] = []
    try:
        clients = [gridcomm.CoordinatorClient("127.0.0.1", server.port, rank, world, token=TOKEN, timeout_s=60.0)
                   for rank in range(world)]
        threads = [threading.Thread(target=c.join) for c in clients]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90.0)
        yield server, clients
    finally:
        for c in clients:
            try:
                c.close()
            except Exception:  # noqa: BLE001 - the server may be gone already
                pass
        server.stop()


# ------------------------------------------------------------------------------ the attacks


def _ops_over_session(port: int, batches: Iterator[list[pb.SessionOp]]) -> tuple[int, str]:
    """Sends each batch on one Session stream and waits for its answers; stops at the first
    RESOURCE_EXHAUSTED. Returns (operations answered without it, the first refusal or '')."""

    async def run() -> tuple[int, str]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS) as channel:
            call = pb_grpc.CoordinatorStub(channel).Session(metadata=METADATA)
            accepted = 0
            for batch in batches:
                await call.write(pb.SessionRequest(ops=batch))
                waiting = {op.id for op in batch}
                refusal = ""
                while waiting:
                    reply = await call.read()
                    if reply is grpc.aio.EOF:
                        return accepted, f"the stream ended: {await call.code()} {await call.details()}"
                    for result in reply.results:
                        waiting.discard(result.id)
                        if result.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]:
                            refusal = refusal or f"RESOURCE_EXHAUSTED: {result.details}"
                        else:
                            accepted += 1
                if refusal:
                    await call.done_writing()
                    return accepted, refusal
            await call.done_writing()
            return accepted, ""

    return asyncio.run(run())


def attack_barriers(port: int, caller: pb.Caller, count: int, name_chars: int) -> tuple[int, str]:
    def batches() -> Iterator[list[pb.SessionOp]]:
        for start in range(0, count, 1000):
            yield [pb.SessionOp(id=i, barrier=pb.BarrierRequest(caller=caller, name=f"n{i}".ljust(name_chars, "x"),
                                                                seq=1, wait_s=0.0))
                   for i in range(start, min(count, start + 1000))]
    return _ops_over_session(port, batches())


def attack_keys(port: int, caller: pb.Caller, count: int, key_chars: int) -> tuple[int, str]:
    per = max(1, 900_000 // (key_chars + 64))

    def batches() -> Iterator[list[pb.SessionOp]]:
        for start in range(0, count, per):
            yield [pb.SessionOp(id=i, set=pb.SetRequest(caller=caller, key=f"k{i}".ljust(key_chars, "x"), value=b""))
                   for i in range(start, min(count, start + per))]
    return _ops_over_session(port, batches())


def attack_values(port: int, caller: pb.Caller, count: int, value_mb: float) -> tuple[int, str]:
    value = os.urandom(int(value_mb * 1_000_000))
    accepted = 0
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        for i in range(count):
            try:
                stub.Set(pb.SetRequest(caller=caller, key=f"v{i}", value=value), metadata=METADATA, timeout=60.0)
            except grpc.RpcError as exc:
                return accepted, f"{exc.code().name}: {exc.details()}"
            accepted += 1
    return accepted, ""


def attack_gets(port: int, caller: pb.Caller, count: int) -> tuple[int, str, Callable[[], None]]:
    """Parks ``count`` gets of keys nobody sets (300 s each) on Session streams of one channel,
    1,000 a stream; returns (gets parked, first refusal, a function that ends them)."""
    done = threading.Event()
    ready = threading.Event()
    result: dict[str, Any] = {}

    async def run() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            refusals: list[str] = []

            async def read(call: Any) -> None:
                # A refused get is answered at once; a parked one is not answered at all.
                while True:
                    reply = await call.read()
                    if reply is grpc.aio.EOF:
                        return
                    for r in reply.results:
                        if r.code:
                            refusals.append(f"{grpc.StatusCode.RESOURCE_EXHAUSTED.name if r.code == 8 else r.code}: "
                                            f"{r.details}")

            calls, readers = [], []
            for start in range(0, count, 1000):
                call = stub.Session(metadata=METADATA)
                calls.append(call)
                readers.append(asyncio.ensure_future(read(call)))
                await call.write(pb.SessionRequest(ops=[
                    pb.SessionOp(id=i, get=pb.GetRequest(caller=caller, key=f"never-{i}", wait_s=300.0))
                    for i in range(start, min(count, start + 1000))]))
            await asyncio.sleep(3.0)  # the refusals come back; the rest are parked
            result["parked"] = count - len(refusals)
            result["refusal"] = f"{refusals[0]} ({len(refusals)} refused)" if refusals else ""
            ready.set()
            while not done.is_set():
                await asyncio.sleep(0.1)
            for call in calls:
                call.cancel()
            for reader in readers:
                reader.cancel()

    thread = threading.Thread(target=lambda: asyncio.run(run()), daemon=True)
    thread.start()
    ready.wait(600.0)

    def end() -> None:
        done.set()
        thread.join(30.0)

    return result.get("parked", 0), result.get("refusal", "timed out"), end


# ------------------------------------------------------------------------------ the scans


def _lag_s(metrics_port: int) -> tuple[float, float]:
    """(the coordinator's cumulative loop lag, the scrape's own wall time)."""
    began = time.monotonic()
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30.0) as answer:
        text = answer.read().decode()
    took = time.monotonic() - began
    match = re.search(r"^gridcomm_coordinator_loop_lag_seconds_total (\S+)", text, re.M)
    return (float(match.group(1)) if match else float("nan")), took


@contextmanager
def probing(port: int, caller: pb.Caller) -> Iterator[list[float]]:
    """While inside, a rank's cheap call (a get of the key "probe", set before the attack) every
    10 ms; yields the list of their latencies (the worst is the loop stall a rank saw)."""
    latencies: list[float] = []
    stop = threading.Event()

    def run() -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            started.set()
            while not stop.is_set():
                began = time.monotonic()
                try:
                    stub.Get(pb.GetRequest(caller=caller, key="probe"), metadata=METADATA, timeout=30.0)
                except grpc.RpcError:
                    pass
                latencies.append(time.monotonic() - began)
                stop.wait(0.01)

    started = threading.Event()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    started.wait(30.0)
    time.sleep(0.3)  # a few calls before the scan: the baseline
    try:
        yield latencies
    finally:
        time.sleep(0.3)
        stop.set()
        thread.join(30.0)


def scans(server: Server, caller: pb.Caller) -> str:
    with probing(server.port, caller) as latencies:
        lag0, _ = _lag_s(server.metrics_port)
        began = time.monotonic()
        status = ""
        with grpc.insecure_channel(f"127.0.0.1:{server.port}", options=OPTIONS) as channel:
            try:
                reply = pb_grpc.CoordinatorStub(channel).Status(pb.StatusRequest(), metadata=METADATA, timeout=60.0)
                status = f"{len(reply.barriers)} barriers listed, {len(reply.late)} late lines"
            except grpc.RpcError as exc:
                status = f"{exc.code().name}: {exc.details()[:160]}"
        status_s = time.monotonic() - began
        lag1, scrape_s = _lag_s(server.metrics_port)
        lag2, _ = _lag_s(server.metrics_port)
    worst = max(latencies, default=float("nan"))
    lag = "the scrapes got no snapshot (the loop did not answer within 2 s)" if lag0 != lag0 or lag1 != lag1 or \
        lag2 != lag2 else f"loop lag +{(lag1 - lag0) * 1e3:.0f} ms over Status, +{(lag2 - lag1) * 1e3:.0f} ms over a scrape"
    return (f"Status {status_s * 1e3:.0f} ms ({status}); scrape {scrape_s * 1e3:.0f} ms; {lag}; a rank's cheap call: "
            f"worst {worst * 1e3:.0f} ms of {len(latencies)}")


def still_served(clients: list[gridcomm.CoordinatorClient]) -> str:
    """Every rank passes one barrier; the attacker's rank (0) arrives last, as its share of
    pending barriers may be spent (a barrier it would open is refused, one it joins is not)."""
    errors: list[str] = []

    def rank(c: gridcomm.CoordinatorClient) -> None:
        try:
            c.barrier("after-the-attack", timeout_s=30.0)
        except gridcomm.GridcommError as exc:
            errors.append(f"rank {c.rank}: {type(exc).__name__}: {str(exc)[:160]}")

    threads = [threading.Thread(target=rank, args=(c,)) for c in clients]
    for t in threads[1:]:
        t.start()
    time.sleep(1.0)
    threads[0].start()
    for t in threads:
        t.join(60.0)
    return "every rank passed a barrier" if not errors else "NOT SERVED: " + "; ".join(errors[:3])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--only", default="barriers,keys,values,gets", help="comma-separated attacks")
    ap.add_argument("--names", type=int, default=1_000_000, help="barrier names (barriers)")
    ap.add_argument("--name-chars", type=int, default=8)
    ap.add_argument("--keys", type=int, default=1_000_000, help="keys (keys)")
    ap.add_argument("--key-chars", type=int, default=1000)
    ap.add_argument("--values", type=int, default=1100, help="values (values)")
    ap.add_argument("--value-mb", type=float, default=1.0)
    ap.add_argument("--gets", type=int, default=131_072, help="parked gets (gets)")
    ap.add_argument("--gridcomm", default=ROOT, help="the checkout the server runs (default: this one)")
    ap.add_argument("--log", default="/tmp/state_bounds.serve.log")
    args = ap.parse_args()
    logging.getLogger("gridcomm").setLevel(logging.CRITICAL)  # the ranks' own reports are summed up below
    print(f"server from {args.gridcomm}, world size {args.world_size}, token set")
    for attack in args.only.split(","):
        with job(args.world_size, args.gridcomm, args.log) as (server, clients):
            caller = clients[0].caller
            clients[1].set("probe", b"1")
            time.sleep(0.5)
            before = server.rss_mb()
            with open(f"/proc/{server.proc.pid}/clear_refs", "w") as f:
                f.write("5")  # the peak from here on
            began = time.monotonic()
            end: Callable[[], None] = lambda: None  # noqa: E731
            if attack == "barriers":
                accepted, refusal = attack_barriers(server.port, caller, args.names, args.name_chars)
                what = f"{args.names} names of {args.name_chars} characters"
            elif attack == "keys":
                accepted, refusal = attack_keys(server.port, caller, args.keys, args.key_chars)
                what = f"{args.keys} keys of {args.key_chars} characters"
            elif attack == "values":
                accepted, refusal = attack_values(server.port, caller, args.values, args.value_mb)
                what = f"{args.values} values of {args.value_mb:g} MB"
            elif attack == "gets":
                accepted, refusal, end = attack_gets(server.port, caller, args.gets)
                what = f"{args.gets} parked gets on one connection"
            else:
                raise SystemExit(f"unknown attack {attack!r}")
            took = time.monotonic() - began
            after, peak = server.rss_mb(), server.peak_mb()
            print(f"\n{attack}: {what}: {accepted} accepted in {took:.1f} s; RSS {before:.0f} -> {after:.0f} MB "
                  f"(peak {peak:.0f} MB); {'alive' if server.alive() else 'THE SERVER DIED'}")
            print(f"  first refusal: {refusal[:300] or 'none'}")
            if server.alive():
                print(f"  scans: {scans(server, clients[1].caller)}")
                end()
                lost = [f"rank {c.rank}: {type(c.failure).__name__}" for c in clients if c.failure is not None]
                print(f"  watchers: {'; '.join(lost) if lost else 'no rank saw a failure'}")
                print(f"  after: {still_served(clients)}")
            else:
                end()


if __name__ == "__main__":
    main()
