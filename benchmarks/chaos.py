"""Chaos on loopback: how long a killed rank keeps the job from good steps (`make chaos`).

Two measurements, default bounds (liveness 15 s, connection grace 2 s), host backend, 4 ranks:

1. Kill cycles, with recovery in place. A standalone coordinator (``gridcomm serve``, so any rank
   may die, rank 0 included) and 4 rank processes that run checked ``all_reduce`` steps and call
   ``rebuild()`` on ``RankFailedError`` (again if that raises). Each cycle waits until every rank
   has had a good step, kills a random rank with SIGKILL and starts its replacement at once (a
   pod restarted without delay); some cycles kill a second rank (another survivor) 0.5-3 s after
   the first, while the survivors recover; some kill the replacement again 0.3-1.5 s after its start,
   while it waits in its join. A cycle ends when every rank of the job (the
   replacements too) has a good step (right sums) in one generation formed after the last kill.
   Printed: last kill -> every rank good again (and, for the double kills, first kill -> good),
   and per victim the kill -> first survivor told, with the reason the coordinator gave.
2. Rank 0 hosting the coordinator (the default layout: its death ends the job). A fresh 4-rank
   job per cycle, rank 0 killed with SIGKILL or SIGTERM (alternating) once every rank has had a
   good step; printed: kill -> every other rank has raised ``CoordinatorLost``, and what it said.

    python benchmarks/chaos.py                       # 20 kill cycles, 6 rank-0 cycles
    python benchmarks/chaos.py --cycles 5 --rank0-cycles 2 --seed 7 --json /tmp/chaos.json

Every process is started here and killed by PID; every wait is bounded (``--cycle-timeout-s``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORLD = 4

#: One rank: checked steps; on a rank's failure rebuild() (kill cycles) or report and exit (rank 0
#: cycles, where the coordinator is gone with rank 0). Every line is TAG {json}.
RANK_CODE = r"""
import json, os, sys, time
import numpy as np
import gridcomm

rank = int(os.environ["GRIDCOMM_RANK"]); world = int(os.environ["GRIDCOMM_WORLD_SIZE"])
recover = os.environ["CHAOS_RECOVER"] == "1"
pause = float(os.environ.get("CHAOS_STEP_S", "0.02"))


def emit(tag, **fields):
    print(tag, json.dumps(dict(fields, at=time.time())), flush=True)


comm = gridcomm.init_process_group(world, rank, backend="host", timeout_s=120)
emit("JOINED", generation=comm.generation)
x, y, box = np.empty(256), np.empty(256), np.zeros(1)
step, resync, reported = 0, comm.generation > 0, -1
while True:
    try:
        if resync:  # every rank, the replacement too, goes on from the furthest step
            box[0] = step
            comm.all_reduce(box, box, op="max")
            step, resync = int(box[0]), False
        x[:] = comm.members[comm.rank] + 1 + 1000.0 * (step % 1000)
        comm.all_reduce(x, y, op="sum")
        want = sum(m + 1 + 1000.0 * (step % 1000) for m in comm.members)
        if not (y == want).all():
            emit("WRONG", generation=comm.generation, step=step, got=float(y[0]), want=want)
        elif comm.generation != reported:
            reported = comm.generation
            emit("GOOD", generation=comm.generation, step=step)
        step += 1
        time.sleep(pause)
    except gridcomm.RankFailedError as exc:
        emit("FAILED", failed=exc.rank, kind=type(exc).__name__, generation=comm.generation, message=str(exc)[:400])
        if not recover:
            sys.exit(0)
        while True:
            try:
                comm = comm.rebuild(timeout_s=120)
                break
            except gridcomm.RankFailedError as again:
                emit("FAILED", failed=again.rank, kind=type(again).__name__, generation=comm.generation,
                     message=str(again)[:400], retry=True)
        resync = True
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Proc:
    """One process whose stdout lines TAG {json} are collected by a thread (stderr to a file)."""

    def __init__(self, args: list[str], env: dict[str, str], name: str, log_dir: str) -> None:
        self.name = name
        self.events: list[tuple[str, dict[str, Any]]] = []
        self._lock = threading.Lock()
        self._err = open(os.path.join(log_dir, f"{name}.stderr"), "w")  # noqa: SIM115 - closed in close()
        self.popen = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=self._err, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            tag, _, rest = line.strip().partition(" ")
            try:
                fields = json.loads(rest) if rest.startswith("{") else {"text": rest}
            except json.JSONDecodeError:
                fields = {"text": rest}
            with self._lock:
                self.events.append((tag, fields))

    def seen(self, tag: str) -> list[dict[str, Any]]:
        with self._lock:
            return [f for t, f in self.events if t == tag]

    def kill(self, sig: int = signal.SIGKILL) -> float:
        at = time.time()
        if self.popen.poll() is None:
            os.kill(self.popen.pid, sig)
        return at

    def close(self) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, signal.SIGKILL)
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self._reader.join(5)
        self._err.close()


def wait_until(predicate: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:g} s")
        time.sleep(0.01)


def rank_env(port: int, rank: int, recover: bool, embedded: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRIDCOMM_")}
    env.update(PYTHONUNBUFFERED="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               GRIDCOMM_RANK=str(rank), GRIDCOMM_WORLD_SIZE=str(WORLD), GRIDCOMM_HOST="127.0.0.1",
               GRIDCOMM_PORT=str(port), GRIDCOMM_BACKEND="host", CHAOS_RECOVER="1" if recover else "0")
    if not embedded:
        env["GRIDCOMM_COORDINATOR"] = "external"
    return env


def good_generation(ranks: dict[int, Proc], after: float) -> tuple[int, float] | None:
    """The first generation in which every current rank had a good step after ``after``, and
    when the last of them had it."""
    per_rank = [{f["generation"]: f["at"] for f in p.seen("GOOD") if f["at"] > after} for p in ranks.values()]
    common = set.intersection(*(set(g) for g in per_rank))
    if not common:
        return None
    generation = min(common)
    return generation, max(g[generation] for g in per_rank)


def told(ranks: dict[int, Proc], victim: int, after: float) -> tuple[float, str] | None:
    """When a survivor first heard of ``victim``'s failure after ``after``, and the reason."""
    seen = [(f["at"], f["message"]) for r, p in ranks.items() if r != victim for f in p.seen("FAILED")
            if f["failed"] == victim and f["at"] > after]
    return min(seen) if seen else None


def reason_kind(message: str) -> str:
    if "lost its connection" in message:
        return "connection lost"
    if "sent no heartbeat" in message:
        return "heartbeat silence"
    return message[:80]


def kill_cycles(args: argparse.Namespace, log_dir: str) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    port = free_port()
    serve_env = {k: v for k, v in os.environ.items() if not k.startswith("GRIDCOMM_")}
    serve_env.update(PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
    server = subprocess.Popen([sys.executable, "-m", "gridcomm", "serve", "--world-size", str(WORLD), "--bind",
                               "127.0.0.1", "--port", str(port)], env=serve_env, stdout=subprocess.DEVNULL,
                              stderr=open(os.path.join(log_dir, "serve.stderr"), "w"))  # noqa: SIM115
    ranks: dict[int, Proc] = {}
    every: list[Proc] = []
    started = 0
    cycles: list[dict[str, Any]] = []

    def start(rank: int) -> Proc:
        nonlocal started
        started += 1
        proc = Proc([sys.executable, "-c", RANK_CODE], rank_env(port, rank, True, False), f"rank{rank}-{started}",
                    log_dir)
        every.append(proc)
        ranks[rank] = proc
        return proc

    try:
        for rank in range(WORLD):
            start(rank)
        for n in range(args.cycles):
            # A steady job: every rank has had a good step in the generation they all share.
            wait_until(lambda: good_generation(ranks, 0.0), args.cycle_timeout_s, f"cycle {n}: every rank good")
            time.sleep(0.3)
            first = rng.randrange(WORLD)
            second = rng.choice([r for r in range(WORLD) if r != first]) if rng.random() < args.double_share else None
            delay = rng.uniform(0.5, 3.0) if second is not None else 0.0
            before = dict(ranks)
            t_first = ranks[first].kill()
            start(first)
            kills = [(first, t_first)]
            joining: list[float] = []  # kills of replacements while they joined
            if rng.random() < args.join_kill_share:
                # The replacement dies too, while it waits in its join (a pod that crash-loops):
                # it must not be admitted; the next one is.
                time.sleep(rng.uniform(0.3, 1.5))
                joining.append(ranks[first].kill())
                start(first)
            if second is not None:
                time.sleep(max(0.0, t_first + delay - time.time()))
                t_second = ranks[second].kill()
                start(second)
                kills.append((second, t_second))
            t_last = max([t for _, t in kills] + joining)
            try:
                generation, at = wait_until(lambda t_last=t_last: good_generation(ranks, t_last), args.cycle_timeout_s,
                                            f"cycle {n}: every rank good after the kill")
            except TimeoutError as exc:
                cycles.append({"cycle": n, "kills": kills, "error": str(exc)})
                print(f"cycle {n:2d}: {exc}", flush=True)
                break
            cycle: dict[str, Any] = {"cycle": n, "kills": kills, "joining_kills": joining, "generation": generation,
                                     "good_after_last_s": at - t_last, "good_after_first_s": at - t_first,
                                     "wrong": sum(len(p.seen("WRONG")) for p in every), "victims": []}
            for victim, t_kill in kills:
                heard = told(before, victim, t_kill)
                cycle["victims"].append({"rank": victim, "told_s": None if heard is None else heard[0] - t_kill,
                                         "reason": None if heard is None else reason_kind(heard[1])})
            cycles.append(cycle)
            victims = ", ".join(f"rank {v['rank']} told {v['told_s']:.2f} s ({v['reason']})" if v["told_s"] is not None
                                else f"rank {v['rank']} (told: not seen)" for v in cycle["victims"])
            extra = f", first kill -> good {cycle['good_after_first_s']:.2f} s" if len(kills) > 1 or joining else ""
            extra += f", 2nd kill +{delay:.2f} s" if second is not None else ""
            extra += f", replacement killed while joining +{joining[0] - t_first:.2f} s" if joining else ""
            print(f"cycle {n:2d}: kill -> every rank good {cycle['good_after_last_s']:.2f} s{extra}; {victims}; "
                  f"generation {generation}, wrong {cycle['wrong']}", flush=True)
    finally:
        for proc in every:
            proc.close()
        if server.poll() is None:
            os.kill(server.pid, signal.SIGKILL)
        server.wait(10)
    return cycles


def rank0_cycles(args: argparse.Namespace, log_dir: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for n in range(args.rank0_cycles):
        sig = signal.SIGKILL if n % 2 == 0 else signal.SIGTERM
        port = free_port()
        ranks = {r: Proc([sys.executable, "-c", RANK_CODE], rank_env(port, r, False, True), f"embedded{n}-rank{r}",
                         log_dir) for r in range(WORLD)}
        try:
            wait_until(lambda ranks=ranks: good_generation(ranks, 0.0), args.cycle_timeout_s,
                       f"rank-0 cycle {n}: every rank good")
            time.sleep(0.3)
            t_kill = ranks[0].kill(sig)
            others = [ranks[r] for r in range(1, WORLD)]
            try:
                wait_until(lambda others=others: all(p.seen("FAILED") for p in others), args.cycle_timeout_s,
                           f"rank-0 cycle {n}: every other rank raised")
            except TimeoutError as exc:
                out.append({"cycle": n, "signal": sig.name, "error": str(exc)})
                print(f"rank-0 cycle {n}: {exc}", flush=True)
                continue
            seen = [p.seen("FAILED")[0] for p in others]
            cycle = {"cycle": n, "signal": sig.name, "lost_s": [f["at"] - t_kill for f in seen],
                     "kinds": sorted({f["kind"] for f in seen}), "named": sorted({f["failed"] for f in seen}),
                     "message": seen[0]["message"]}
            out.append(cycle)
            print(f"rank-0 cycle {n}: {sig.name}: every other rank raised {'/'.join(cycle['kinds'])} naming rank(s) "
                  f"{cycle['named']} within {max(cycle['lost_s']):.2f} s (first {min(cycle['lost_s']):.2f} s): "
                  f"{cycle['message'][:160]}", flush=True)
        finally:
            for proc in ranks.values():
                proc.close()
    return out


def summary(cycles: list[dict[str, Any]], rank0: list[dict[str, Any]]) -> dict[str, Any]:
    done = [c for c in cycles if "error" not in c]
    last = [c["good_after_last_s"] for c in done]
    told_s = [v["told_s"] for c in done for v in c["victims"] if v["told_s"] is not None]
    reasons: dict[str, int] = {}
    for c in done:
        for v in c["victims"]:
            reasons[str(v["reason"])] = reasons.get(str(v["reason"]), 0) + 1
    lost = [max(c["lost_s"]) for c in rank0 if "error" not in c]
    result: dict[str, Any] = {
        "cycles": len(cycles), "completed": len(done), "double_kills": sum(len(c["kills"]) > 1 for c in done),
        "wrong": done[-1]["wrong"] if done else 0,  # counted over every process so far
        "good_median_s": statistics.median(last) if last else None, "good_max_s": max(last) if last else None,
        "told_median_s": statistics.median(told_s) if told_s else None, "told_max_s": max(told_s) if told_s else None,
        "reasons": reasons,
        "rank0_cycles": len(rank0), "rank0_lost_median_s": statistics.median(lost) if lost else None,
        "rank0_lost_max_s": max(lost) if lost else None,
        "rank0_kinds": sorted({k for c in rank0 if "error" not in c for k in c["kinds"]}),
    }
    firsts = [c["good_after_first_s"] for c in done if len(c["kills"]) > 1]
    if firsts:
        result["double_first_kill_good_median_s"] = statistics.median(firsts)
        result["double_first_kill_good_max_s"] = max(firsts)
    joins = [c["good_after_first_s"] for c in done if c["joining_kills"]]
    result["joining_kills"] = len(joins)
    if joins:
        result["joining_first_kill_good_median_s"] = statistics.median(joins)
        result["joining_first_kill_good_max_s"] = max(joins)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cycles", type=int, default=20, help="kill cycles (default %(default)s)")
    ap.add_argument("--rank0-cycles", type=int, default=6,
                    help="cycles of rank 0 (hosting the coordinator) killed, SIGKILL and SIGTERM alternating")
    ap.add_argument("--double-share", type=float, default=0.3,
                    help="share of kill cycles that kill a second rank 0.5-3 s after the first")
    ap.add_argument("--join-kill-share", type=float, default=0.2,
                    help="share of cycles whose replacement is killed again while it joins (default %(default)s)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--cycle-timeout-s", type=float, default=90.0)
    ap.add_argument("--json", default=None, help="write the raw results here")
    ap.add_argument("--logs", default=None, help="directory for the processes' stderr (default: a temporary one)")
    args = ap.parse_args()
    if args.seed is None:
        args.seed = random.randrange(1 << 30)
    log_dir = args.logs or os.path.join("/tmp", f"gridcomm-chaos-{os.getpid()}")
    os.makedirs(log_dir, exist_ok=True)
    print(f"chaos: {WORLD} ranks, host backend, loopback, default bounds; seed {args.seed}; logs in {log_dir}",
          flush=True)
    cycles = kill_cycles(args, log_dir) if args.cycles else []
    rank0 = rank0_cycles(args, log_dir) if args.rank0_cycles else []
    result = summary(cycles, rank0)

    def s(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f} s"

    print(f"kill cycles: {result['completed']} of {result['cycles']} completed ({result['double_kills']} with a second "
          f"kill); last kill -> every rank good again: median {s(result['good_median_s'])}, max {s(result['good_max_s'])}; "
          f"wrong sums: {result['wrong']}")
    if "double_first_kill_good_median_s" in result:
        print(f"  double kills, from the first kill: median {s(result['double_first_kill_good_median_s'])}, "
              f"max {s(result['double_first_kill_good_max_s'])}")
    if "joining_first_kill_good_median_s" in result:
        print(f"  {result['joining_kills']} replacements killed while joining; from the first kill: median "
              f"{s(result['joining_first_kill_good_median_s'])}, max {s(result['joining_first_kill_good_max_s'])}")
    print(f"  kill -> first survivor told: median {s(result['told_median_s'])}, max {s(result['told_max_s'])}; "
          f"reasons {result['reasons']}")
    print(f"rank 0 (embedded coordinator) killed: {len(rank0)} cycles; kill -> every other rank raised: median "
          f"{s(result['rank0_lost_median_s'])}, max {s(result['rank0_lost_max_s'])} ({'/'.join(result['rank0_kinds'])})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seed": args.seed, "summary": result, "cycles": cycles, "rank0": rank0}, f, indent=1)
    ok = result["completed"] == result["cycles"] and all("error" not in c for c in rank0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
