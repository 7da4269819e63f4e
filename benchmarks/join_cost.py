"""What one group of the relay tree costs its process at the join: one process of K rank threads
(one group: its first rank hosts the relay, the others join through it at an address known before
the join, as GRIDCOMM_RELAY_ADDRESSES gives in an Indexed Job), the coordinator in a process of its
own. Per stage, this process's CPU per rank (all its threads: the ranks, the background loop with
the relay, gRPC's) and the wall time, medians over ``--reps`` fresh processes.

``--prestart``: the relay is started before the join stage (the relay's host constructed it
earlier), so the join stage measures the join alone; without it the members race their relay's
start, as the pods of one job do. ``--relay-late-s S``: the relay's host joins S seconds into the
join stage (its pod started later than the others'); the join stage's wall time less S is how long
the members took to find the relay and join once it listened.

    python benchmarks/join_cost.py --ranks 64 --reps 5 [--prestart]

This is the shape of one process of ``rendezvous.py`` at 2,048 ranks (32 processes of 64 threads,
fan-in 64), alone on the machine: a floor for what that harness's join costs per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time

STAGES = ("construct", "join", "barrier")


def one_run(k: int, prestart: bool, barriers: int, relay_late_s: float = 0.0) -> dict[str, object]:
    os.environ.setdefault("GRIDCOMM_RELAY", "on")
    os.environ["GRIDCOMM_RELAY_FANIN"] = str(k)
    os.environ["GRIDCOMM_RELAY_ADDRESSES"] = "127.0.0.1:2{group:04d}"
    server = subprocess.Popen(
        [sys.executable, "-c", "import gridcomm, sys\n"
         f"s = gridcomm.Coordinator({k}, bind='127.0.0.1', port=0).start()\n"
         "print(s.port, flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        import gridcomm
        from gridcomm._runtime import loop

        loop.loop()  # started before the ranks, as a deployed rank's process does
        threading.stack_size(512 * 1024)
        gate = threading.Barrier(k + 1, timeout=120)
        clients: list[gridcomm.CoordinatorClient | None] = [None] * k
        errors: list[str] = []

        def rank(i: int) -> None:
            try:
                gate.wait()
                client = clients[i] = gridcomm.CoordinatorClient("127.0.0.1", port, i, k, timeout_s=60,
                                                                  session="client")
                if prestart:
                    client._tree()  # the leader starts its relay now; the others learn where it is
                gate.wait()
                gate.wait()
                if i == 0 and relay_late_s:
                    time.sleep(relay_late_s)
                client.join()
                gate.wait()
                gate.wait()
                for b in range(barriers):
                    client.barrier(f"b{b}")
                gate.wait()
                client.leave()
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(f"rank {i}: {exc!r}"[:300])
                gate.abort()

        threads = [threading.Thread(target=rank, args=(i,), daemon=True) for i in range(k)]
        for t in threads:
            t.start()
        out: dict[str, object] = {}
        for stage in STAGES:
            usage = resource.getrusage(resource.RUSAGE_SELF)
            cpu0, wall0 = usage.ru_utime + usage.ru_stime, time.monotonic()
            gate.wait()
            gate.wait()
            usage = resource.getrusage(resource.RUSAGE_SELF)
            cpu_us = (usage.ru_utime + usage.ru_stime - cpu0) * 1e6 / k
            wall_ms = (time.monotonic() - wall0) * 1e3
            ops = barriers if stage == "barrier" else 1
            out[stage] = {"cpu_us_per_rank": cpu_us / ops, "wall_ms": wall_ms / ops}
        for t in threads:
            t.join(30)
        if errors:
            raise RuntimeError(errors[0])
        return out
    finally:
        server.kill()
        server.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=64, help="rank threads in the process (one group)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--barriers", type=int, default=20)
    ap.add_argument("--prestart", action="store_true", help="start the relay before the join stage")
    ap.add_argument("--relay-late-s", type=float, default=0.0, help="the relay's host joins this late")
    ap.add_argument("--_one", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._one:
        print(json.dumps(one_run(args.ranks, args.prestart, args.barriers, args.relay_late_s)))
        return 0
    runs = []
    for _ in range(args.reps):
        cmd = [sys.executable, __file__, "--_one", "--ranks", str(args.ranks), "--barriers", str(args.barriers),
               "--relay-late-s", str(args.relay_late_s)]
        done = subprocess.run(cmd + (["--prestart"] if args.prestart else []), capture_output=True, text=True,
                              timeout=300)
        if done.returncode:
            print(done.stderr[-2000:], file=sys.stderr)
            return 1
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    late = f", {args.relay_late_s:g} s late" if args.relay_late_s else ""
    print(f"{args.ranks} ranks in one process, relay {'started before the join' if args.prestart else 'started by the join'}"
          f"{late}, {args.reps} runs (median [min-max]):")
    for stage in STAGES:
        for key, unit in (("cpu_us_per_rank", "us CPU per rank"), ("wall_ms", "ms wall")):
            values = sorted(r[stage][key] for r in runs)
            label = stage + (" (each)" if stage == "barrier" else "")
            print(f"  {label:15} {statistics.median(values):8.1f} [{values[0]:.1f}-{values[-1]:.1f}] {unit}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
