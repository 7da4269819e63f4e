"""Recovery in place on one machine: a rank dies, ``gridcomm launch --max-restarts 1`` starts it
again, the survivors ``rebuild()``, and every rank finishes the same checked steps.

    gridcomm launch --nproc 3 --max-restarts 1 examples/recover.py --crash-rank 1 --crash-step 5

``--crash-rank R --crash-step S``: rank R's first process kills itself (SIGKILL) at step S, the
failure this recipe is for. The "checkpoint" here is the step number: after a recovery the ranks
agree on the furthest step any of them reached (the replacement knows none).
"""

import argparse
import os
import signal

import numpy as np

import gridcomm

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--crash-rank", type=int, default=-1)
parser.add_argument("--crash-step", type=int, default=5)
args = parser.parse_args()

restart = int(os.environ.get("GRIDCOMM_RESTART_COUNT", "0"))  # set by launch in a restarted rank
comm = gridcomm.init_process_group()  # rank, world size and coordinator from gridcomm launch
rank = comm.rank


def agreed_step(comm, mine):
    """Where every rank, the replacement too, goes on: the furthest step any of them reached."""
    box = np.array([float(mine)])
    comm.all_reduce(box, box, op="max")
    return int(box[0])


step = agreed_step(comm, 0) if comm.generation > 0 else 0  # a replacement joins a later generation
while step < args.steps:
    if rank == args.crash_rank and step == args.crash_step and restart == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    x = np.full(4, float(rank + 1 + step))
    y = np.empty_like(x)
    try:
        comm.all_reduce(x, y)
    except gridcomm.RankFailedError as exc:
        print(f"rank {rank}: {exc.__class__.__name__} (rank {exc.rank} failed); rebuilding", flush=True)
        comm = comm.rebuild(timeout_s=300)  # waits for the replacement the launcher starts
        step = agreed_step(comm, step)
        continue
    want = sum(r + 1 + step for r in range(comm.world_size))
    assert y[0] == want, (step, y[0], want)
    step += 1
print(f"rank {rank}: {step} checked steps, generation {comm.generation}, restart {restart}", flush=True)
comm.stop()
