"""Mismatched collectives are named whatever the loop's speed (GRIDCOMM_DEBUG=collectives).

One OS process per rank (host backend), a coordinator in the test process. Rank 1 calls
all_reduce with op max once, at step 5, where every other rank calls sum: the host data plane
cannot tell (the same messages flow), so only the digests can. Unpaced, the ranks are thousands
of collectives past the mismatch by their next heartbeat; paced, a few. Either way every rank is
told the collective's number and both calls.
"""

from __future__ import annotations

import json

import pytest

from tests.support.procs import RankProcesses, report

HB = 3.0
WORLD = 3

CODE = r"""
import json, os, time
import numpy as np
import gridcomm

rank = int(os.environ["GRIDCOMM_RANK"]); world = int(os.environ["GRIDCOMM_WORLD_SIZE"])
steps, pace = int(os.environ["STEPS"]), float(os.environ["PACE_S"])
comm = gridcomm.init_process_group(world, rank, backend="host", timeout_s=60)
x = np.ones(4, dtype=np.float32)
comm.all_reduce(x, x)   # collective #1
comm.barrier("warm")    # collective #2
at_mismatch, done = None, None
try:
    for step in range(steps):  # step s is collective #3 + s
        if step == 5:
            at_mismatch = time.monotonic()
        comm.all_reduce(x, x, op="max" if rank == 1 and step == 5 else "sum")
        if pace:
            time.sleep(pace)
    done = time.monotonic()
    for _ in range(600):
        comm.barrier("after")
        time.sleep(0.1)
    print("NO ERROR", flush=True)
except gridcomm.GridcommError as exc:
    print("OUTCOME", json.dumps({"kind": type(exc).__name__, "rank": getattr(exc, "rank", None),
                                 "after": time.monotonic() - at_mismatch,
                                 "loop_done": None if done is None else done - at_mismatch,
                                 "message": str(exc)}), flush=True)
comm.stop()
"""


def _outcome(stdout: str) -> dict:
    (line,) = [ln for ln in stdout.splitlines() if ln.startswith("OUTCOME ")]
    return json.loads(line.split(" ", 1)[1])


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("steps", "pace_s", "relay"), [(10_000, 0.0, False), (600, 0.05, False), (10_000, 0.0, True)],
                         ids=["unpaced", "paced", "unpaced-through-relays"])
def test_a_mismatch_at_step_5_is_named_on_every_rank(coordinator_factory, steps, pace_s, relay):
    # The stall bound is long: the mismatch, not a stall, must name it.
    server = coordinator_factory(WORLD, heartbeat_timeout_s=HB, stall_timeout_s=100)
    env = {"GRIDCOMM_COORDINATOR": "external", "GRIDCOMM_HOST": "127.0.0.1", "GRIDCOMM_PORT": str(server.port),
           "GRIDCOMM_HEARTBEAT_TIMEOUT_S": f"{HB:g}", "GRIDCOMM_DEBUG": "collectives", "STEPS": str(steps),
           "PACE_S": str(pace_s)}
    if relay:  # probes go down and answers up through the relay tree
        env.update(GRIDCOMM_RELAY="on", GRIDCOMM_RELAY_FANIN="2")
    results = RankProcesses(CODE, WORLD, env=env).wait(140)
    everything = report(results)
    for rank in range(WORLD):
        outcome = _outcome(results[rank].stdout)
        assert outcome["kind"] == "CollectiveMismatch" and outcome["rank"] == 1, everything
        message = outcome["message"]
        assert "collective #8 of communicator 'world'" in message, everything
        assert "rank 1 called all_reduce(max, 4 x float32)" in message, everything
        assert "rank 0 called all_reduce(sum, 4 x float32)" in message, everything
        # Two heartbeat intervals (HB / 3 each) after the first report past the mismatch, with a
        # loaded machine's slack; the loop's own time is not the detector's.
        assert outcome["after"] < 2 * HB + 5, everything
    print(f"\n{'unpaced' if not pace_s else 'paced'}{' through relays' if relay else ''}: named after "
          f"{max(_outcome(results[r].stdout)['after'] for r in range(WORLD)):.1f} s")
