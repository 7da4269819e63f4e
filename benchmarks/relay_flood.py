"""A relay's memory under a child that never reads its answers (issue: relay strictness, attack d).

A coordinator runs in this process; a relay runs in a process of its own (its RSS is what is
measured). Rank 1 of a 2-rank job, a member in good standing, opens a Session stream to the relay
and for ``--seconds`` writes heartbeats that the relay answers at once (wait_s 0), never reading
an answer (its receive window small, so the relay's writes stall). Reported per run: the relay's
peak RSS growth over its RSS before the flood, heartbeats written, and how the stream ended (a
relay with per-child bounds ends it with RESOURCE_EXHAUSTED, which a client that reads nothing
for seconds after its writes stall sees only as its own deadline, as at the coordinator; a relay
without them keeps every answer and ends it OK).

    python benchmarks/relay_flood.py --seconds 9 --reps 3
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

import gridcomm  # noqa: E402
from gridcomm._proto import coordinator_pb2 as pb  # noqa: E402
from gridcomm._proto import coordinator_pb2_grpc as pb_grpc  # noqa: E402

TOKEN = "relay-flood"

RELAY = """
import sys
from gridcomm._relay.server import Relay
relay = Relay(sys.argv[1], token=sys.argv[2], heartbeat_timeout_s=30.0).start()
print(relay.target, flush=True)
sys.stdin.read()
relay.stop()
"""


def rss_kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} for process {pid}")


def run_once(seconds: float) -> tuple[float, int, str]:
    server = gridcomm.Coordinator(2, bind="127.0.0.1", port=0, token=TOKEN, heartbeat_timeout_s=30.0).start()
    relay = subprocess.Popen([sys.executable, "-c", RELAY, server.address, TOKEN], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env={"PYTHONPATH": str(ROOT)})
    clients = [gridcomm.CoordinatorClient("127.0.0.1", server.port, r, 2, token=TOKEN, timeout_s=30) for r in (0, 1)]
    try:
        assert relay.stdout is not None
        target = relay.stdout.readline().strip()
        joins = [threading.Thread(target=c.join) for c in clients]
        [t.start() for t in joins]
        [t.join(60) for t in joins]
        caller = pb.Caller(job_id=server.state.job_id, rank=1, incarnation=clients[1].incarnation,
                           generation=server.state.generation)
        beat = pb.HeartbeatRequest(caller=caller, wait_s=0.0)
        time.sleep(0.5)
        base = rss_kb(relay.pid, "VmRSS")
        sent = [0]
        end = time.monotonic() + seconds

        def requests() -> Iterator[pb.SessionRequest]:
            while time.monotonic() < end:
                yield pb.SessionRequest(ops=[pb.SessionOp(id=sent[0] + i, heartbeat=beat) for i in range(500)])
                sent[0] += 500

        options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 16384)]
        with grpc.insecure_channel(target, options=options) as channel:
            answers = pb_grpc.CoordinatorStub(channel).Session(requests(), metadata=(("authorization",
                                                                                        f"Bearer {TOKEN}"),),
                                                               timeout=seconds + 15)
            while time.monotonic() < end:  # unread all along
                time.sleep(0.1)
            peak = rss_kb(relay.pid, "VmHWM")
            ended = "OK"
            try:
                for _ in answers:
                    pass
            except grpc.RpcError as exc:
                ended = exc.code().name
        return (peak - base) / 1024, sent[0], ended
    finally:
        for c in clients:
            c.close()
        if relay.stdin is not None:
            relay.stdin.close()
        try:
            relay.wait(10)
        except subprocess.TimeoutExpired:
            relay.kill()
            relay.wait(10)
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=9.0)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    growth = []
    print("| run | heartbeats written unread | relay peak RSS growth | stream ended |")
    print("| --- | ---: | ---: | --- |")
    for rep in range(args.reps):
        mb, sent, ended = run_once(args.seconds)
        growth.append(mb)
        print(f"| {rep + 1} | {sent:,} | +{mb:.1f} MB | {ended} |", flush=True)
    print(f"\nmedian relay peak RSS growth over {args.seconds:g} s: +{statistics.median(growth):.1f} MB")


if __name__ == "__main__":
    main()
