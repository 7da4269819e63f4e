"""A relay's port is admitted as the coordinator's is (gridcomm._runtime.admission): one client
holding every unauthenticated connection it can on it keeps no member of the relay's group out.

The coordinator (``gridcomm serve``, with a token), the relay (a process of its own, as a node
agent's) and ranks 0-2 (each a process, dialling the relay with GRIDCOMM_RELAY_ADDRESS) are real;
the attacker is the process of tests/test_lockouts.py: thousands of idle HTTP/2 connections to the
relay's port, more than gRPC accepts there, each taken again the moment it is closed. Ranks 0 and
1 wait in their join; rank 2 starts under the flood, once the admission has begun dropping, so its
connection to the relay is a new one. Without the admission the flood filled gRPC's cap of the
port and rank 2's connection was closed at once, again and again, until idle eviction freed a slot
(tens of seconds). Now rank 2's join, a barrier of the three and a get are served through the relay, each within
:data:`CALL_S`, and the relay's memory grows by less than :data:`RSS_BUDGET_MB` (its figures are
printed).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest

from gridcomm._runtime.admission import connections
from tests.support.procs import ROOT, wait_for
from tests.support.ranks import Rank, serving
from tests.test_lockouts import ATTACKER, _rss_mb

TOKEN = "relay-lockout-token"
#: Connections the attacker tries to hold on the relay's port: more than gRPC accepts there (4,096
#: before the relay's admission, 11,264 now, or half the open-file limit where that is less).
FLOOD = 15_000
#: Connections held on the relay's port before rank 2 starts (more than gRPC's cap there was).
HELD = 9_000
#: The bound on each of rank 2's calls (the aim is well under a second; a loaded machine gets room).
CALL_S = 10.0
#: The relay's host may grow by this much under the flood (an idle connection costs it ~17 KB, and
#: it holds at most its gRPC cap of them).
RSS_BUDGET_MB = 400.0

RELAY = r"""
import os, sys
from gridcomm._relay.server import Relay
relay = Relay(os.environ["UPSTREAM"], token=os.environ["GRIDCOMM_TOKEN"], world_size=3).start()
print("RELAY", relay.target, flush=True)
for line in sys.stdin:
    print("DROPPED", relay.dropped, flush=True)
"""

MEMBER = r"""
import json, os, time
import gridcomm
client = gridcomm.CoordinatorClient(timeout_s=90)
took = {}
started = time.monotonic()
client.join()
took["join"] = time.monotonic() - started
print("JOINED", flush=True)
if client.rank == 0:
    client.set("relay-lockout", b"answer")
started = time.monotonic()
client.barrier("under-the-flood", participants=[0, 1, 2])
took["barrier"] = time.monotonic() - started
started = time.monotonic()
assert client.get("relay-lockout") == b"answer"
took["get"] = time.monotonic() - started
print("DONE", json.dumps({"took": took, "relay": client.relay_target}), flush=True)
time.sleep(300)
"""


def dropped(relay: Rank) -> int:
    """How many unauthenticated connections the relay's admission has dropped so far."""
    relay.send("dropped")
    return int(relay.expect("DROPPED", 30).split()[1])


@pytest.mark.timeout(300)
def test_a_flood_on_the_relays_port_keeps_no_member_of_its_group_out() -> None:
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < FLOOD + 1024:
        pytest.skip(f"the attacker needs {FLOOD} open files (ulimit -Hn)")
    env = dict(os.environ, PYTHONPATH=ROOT, GRIDCOMM_TOKEN=TOKEN)
    with serving(["--world-size", "3", "--bind", "127.0.0.1", "--port", "0"], env) as (_, line):
        assert "listening on 127.0.0.1:" in line, line
        port = int(line.split("listening on 127.0.0.1:", 1)[1].split()[0])
        relay = Rank(99, RELAY, {"UPSTREAM": f"127.0.0.1:{port}", "GRIDCOMM_TOKEN": TOKEN})
        ranks: list[Rank] = []
        attacker = None
        try:
            target = relay.expect("RELAY", 60).split()[1]
            relay_port = int(target.rsplit(":", 1)[1])
            member_env = {"GRIDCOMM_HOST": "127.0.0.1", "GRIDCOMM_PORT": str(port), "GRIDCOMM_TOKEN": TOKEN,
                          "GRIDCOMM_WORLD_SIZE": "3", "GRIDCOMM_RELAY_ADDRESS": target}
            ranks = [Rank(r, MEMBER, dict(member_env, GRIDCOMM_RANK=str(r))) for r in (0, 1)]
            before = _rss_mb(relay.proc.pid)
            attacker = subprocess.Popen([sys.executable, "-c", ATTACKER, f"{relay_port}x{FLOOD}"],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            assert attacker.stdout is not None
            assert attacker.stdout.readline().strip() == "FULL", attacker.stderr.read() if attacker.stderr else ""
            # The attacker's dials are out; rank 2 starts once they fill what gRPC accepts on the
            # port and the admission has begun dropping the idle ones.
            wait_for(lambda: len(connections(relay_port)) >= HELD, f"{HELD} connections held on the relay's port", 60)
            wait_for(lambda: dropped(relay) > 0, "the relay's admission dropping the flood's idle connections", 30)
            newcomer = Rank(2, MEMBER, dict(member_env, GRIDCOMM_RANK="2"))
            ranks.append(newcomer)
            done = {rank.rank: json.loads(rank.expect("DONE", 120).split(" ", 1)[1]) for rank in ranks}
            grown = _rss_mb(relay.proc.pid) - before
            assert attacker.poll() is None, "the attacker ended before the members were done"
        finally:
            if attacker is not None:
                attacker.kill()
                attacker.wait(10)
            for rank in [*ranks, relay]:
                rank.kill()
    took = done[2]["took"]
    print(f"rank 2 under a flood of {FLOOD} connections on the relay's port: "
          f"{', '.join(f'{what} {s * 1000:.0f} ms' for what, s in took.items())}; relay RSS {grown:+.0f} MB")
    assert all(out["relay"] == target for out in done.values()), f"a member went around the relay: {done}"
    assert all(s < CALL_S for s in took.values()), took
    assert grown < RSS_BUDGET_MB, f"the relay grew by {grown:.0f} MB under the flood"
