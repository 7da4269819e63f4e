"""The example job the manifests in deploy/k8s run in every pod (``python /app/train.py``).

Everything comes from the environment the pod is given: the rank from ``JOB_COMPLETION_INDEX``,
the world size, the coordinator's address, the backend and the token from ``GRIDCOMM_*``. Each
rank all-reduces a buffer a few times, checks every sum, meets the others at a barrier and exits.

The first thing it does is start the pod's health server (``gridcomm.start_health_server()``), so
kubelet's startup and liveness probes pass while a real job would load its data or model before
``init_process_group``.

Exit codes, which the Job's ``podFailurePolicy`` relies on:
  0  done;
  2  a configuration error, a missing token Secret (its file is absent) or a refused token
     (retrying the same pod cannot help);
  3  another rank failed and this one does not recover (recovery off, or it failed), the
     coordinator went away, or the ranks never all met;
  1  anything else (counted against the Job's ``backoffLimit`` or ``backoffLimitPerIndex``).

``TRAIN_STEPS`` (default 10) and ``TRAIN_ELEMENTS`` (default 1048576) size the work.
``TRAIN_STEP_SLEEP_S`` (default 0) paces it: each step then also sleeps that long, standing in
for the compute between collectives, and logs one line (tests/test_pod_simulation.py uses it to
keep pods running, and to kill one between two steps).

Recovery in place (what deploy/k8s/recoverable/ runs; off by default, so the other manifests
keep their behaviour: a peer's failure ends every rank with exit code 3):

``TRAIN_RECOVERY``
    ``off`` (default), ``rebuild`` or ``shrink``. On ``RankFailedError`` a survivor calls
    ``comm.rebuild()`` (same world size: it waits, bounded, until the Job controller has started
    a replacement pod for every lost index) or ``comm.shrink()`` (goes on with the survivors,
    renumbered), then resumes from the last checkpoint. A replacement pod needs no code of its
    own: it calls ``init_process_group()`` as the first pod did, lands in the recovery's
    generation (``comm.generation > 0``), loads the same checkpoint and goes on.
``TRAIN_CHECKPOINT_DIR``
    A folder every pod sees (needed when recovery is on). The state here is a step counter in
    ``checkpoint.json``, written by rank 0 every ``TRAIN_CHECKPOINT_EVERY`` steps (default 5) and
    after the last. A real job writes its model and optimizer state there. Pods on different
    nodes need a ReadWriteMany volume (the manifests' PersistentVolumeClaim; NFS, CephFS, a
    cloud file store) or an object store; an ``emptyDir`` lives and dies with one pod.
``TRAIN_RECOVERY_TIMEOUT_S``
    How long ``rebuild()`` waits for replacements (default: gridcomm's, ``GRIDCOMM_TIMEOUT_S``).
``TRAIN_MAX_RECOVERIES``
    Recoveries one process attempts before it gives up with exit code 3 (default 5).

Each step all-reduces ``(job rank + 1) * step`` from every rank and checks the sum, so a rank
that resumed at another step than its peers is caught at once, not averaged away.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

import gridcomm

EXIT_CONFIG_ERROR = 2
EXIT_PEER_FAILED = 3
RECOVERY_MODES = ("off", "rebuild", "shrink")
CHECKPOINT_FILE = "checkpoint.json"

log = logging.getLogger("train")


def _array_module(backend: str):
    """NumPy for the host backend, CuPy for NCCL ("auto" uses CuPy only where it sees a GPU)."""
    import numpy

    if backend == "host":
        return numpy
    try:
        import cupy
    except ImportError:
        if backend == "nccl":
            raise
        return numpy
    if backend == "auto" and cupy.cuda.runtime.getDeviceCount() == 0:
        return numpy
    return cupy


class Checkpoint:
    """The job's state in a folder every pod sees: here only the number of steps done."""

    def __init__(self, folder: str) -> None:
        self.path = os.path.join(folder, CHECKPOINT_FILE)

    def load(self) -> int:
        try:
            with open(self.path, encoding="utf-8") as handle:
                return int(json.load(handle)["step"])
        except FileNotFoundError:
            return 0

    def save(self, step: int, comm: Any) -> None:
        # Why write-then-rename: a writer killed halfway leaves the previous checkpoint whole.
        temporary = f"{self.path}.{os.getpid()}.tmp"
        with open(temporary, "w", encoding="utf-8") as handle:
            json.dump({"step": step, "generation": _generation(comm), "members": list(_members(comm))}, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, self.path)


def _generation(comm: Any) -> int:
    return getattr(comm, "generation", 0)


def _members(comm: Any) -> tuple[int, ...]:
    """The job ranks of the communicator's ranks (all of them until a shrink)."""
    return tuple(getattr(comm, "members", range(comm.world_size)))


class _Current:
    """The context of whichever communicator is current: a recovery replaces it, and leaving the
    block stops (or, on an error, reports) the one in use then, as ``with comm:`` would."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm

    def __enter__(self) -> _Current:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.comm.__exit__(*exc_info)


def _resume(comm: Any, xp: Any, checkpoint: Checkpoint | None) -> int:
    """The step every member goes on from: rank 0 reads the checkpoint and broadcasts it, so all
    members agree even where a shared file system shows a new file late. Without a checkpoint
    (recovery off), step 0 and no collective."""
    if checkpoint is None:
        return 0
    step = xp.zeros(1, dtype=xp.int64)
    if comm.rank == 0:
        step[0] = checkpoint.load()
    comm.broadcast(step, root=0)
    return int(step[0])


def _recover(comm: Any, mode: str, timeout_s: float | None, attempts: int) -> Any:
    """A new communicator after a peer's failure. A failure during the recovery is itself a
    RankFailedError, and the recovery can be tried again, up to ``attempts`` times."""
    for attempt in range(1, attempts + 1):
        try:
            return comm.rebuild(timeout_s=timeout_s) if mode == "rebuild" else comm.shrink(timeout_s=timeout_s)
        except gridcomm.RankFailedError as exc:
            if isinstance(exc, gridcomm.CoordinatorUnavailable) or attempt == attempts:
                raise
            log.warning("rank %d: %s failed (%s); trying again (%d of %d)", comm.rank, mode, exc, attempt + 1, attempts)
    raise AssertionError("unreachable")


def _train_from(comm: Any, step: int, steps: int, send: Any, recv: Any, *, checkpoint: Checkpoint | None,
                checkpoint_every: int, step_sleep_s: float, announce: bool) -> None:
    """Steps ``step + 1`` to ``steps``, each sum checked, then the closing barrier. ``announce``
    logs the first good step (after a recovery, or in a replacement pod)."""
    members = _members(comm)
    while step < steps:
        send.fill((members[comm.rank] + 1) * (step + 1))
        comm.all_reduce(send, recv, op="sum")
        expected = sum(m + 1 for m in members) * (step + 1)
        # Comparing on the array's own device keeps the check cheap; bool() waits for the stream.
        if not bool((recv == expected).all()):
            raise RuntimeError(f"rank {comm.rank}: step {step + 1} all_reduce gave {float(recv[0])}, expected {expected}")
        step += 1
        if announce:
            log.info("rank %d: first good step of generation %d: step %d (resumed at step %d)", comm.rank,
                     _generation(comm), step, step - 1)
            announce = False
        if checkpoint is not None and comm.rank == 0 and (step % checkpoint_every == 0 or step == steps):
            checkpoint.save(step, comm)
        if step_sleep_s > 0:
            log.info("rank %d: step %d of %d done", comm.rank, step, steps)
            time.sleep(step_sleep_s)
    comm.barrier("train-done")


def run(steps: int, elements: int, step_sleep_s: float = 0.0, *, recovery: str = "off",
        checkpoint_dir: str | None = None, checkpoint_every: int = 5, recovery_timeout_s: float | None = None,
        max_recoveries: int = 5) -> None:
    checkpoint = Checkpoint(checkpoint_dir) if checkpoint_dir else None
    with _Current(gridcomm.init_process_group()) as current:
        comm = current.comm
        xp = _array_module(os.environ.get("GRIDCOMM_BACKEND", "nccl"))
        log.info("rank %d of %d joined%s; %d all_reduce steps of %d float32", comm.rank, comm.world_size,
                 f" generation {_generation(comm)} as a replacement" if _generation(comm) else "", steps, elements)
        send = xp.empty(elements, dtype=xp.float32)
        recv = xp.empty_like(send)
        recoveries = 0
        first = step = _resume(comm, xp, checkpoint)
        options: dict[str, Any] = {"checkpoint": checkpoint, "checkpoint_every": checkpoint_every,
                                   "step_sleep_s": step_sleep_s}
        # A replacement pod (generation > 0) logs its first good step as a survivor does.
        announce = _generation(comm) > 0
        started = time.perf_counter()
        while True:
            try:
                _train_from(comm, step, steps, send, recv, announce=announce, **options)
                break
            except gridcomm.RankFailedError as exc:
                # Recovery needs a live coordinator: without one there is nothing to rebuild around.
                if recovery == "off" or isinstance(exc, gridcomm.CoordinatorUnavailable) or recoveries >= max_recoveries:
                    raise
                recoveries += 1
                log.warning("rank %d: %s: %s; recovering with %s() (%d of at most %d)", comm.rank,
                            type(exc).__name__, exc, recovery, recoveries, max_recoveries)
                current.comm = comm = _recover(comm, recovery, recovery_timeout_s, max_recoveries - recoveries + 1)
                step, announce = _resume(comm, xp, checkpoint), True
                log.info("rank %d of %d: generation %d, members %s, resuming at step %d", comm.rank, comm.world_size,
                         _generation(comm), list(_members(comm)), step)
        elapsed = time.perf_counter() - started
        extra = f" (generation {_generation(comm)}, {recoveries} recoveries, resumed at step {first})" \
            if recovery != "off" else ""
        print(f"rank {comm.rank}/{comm.world_size}: {steps} all_reduce of {elements} float32 correct "
              f"in {elapsed:.3f} s{extra}", flush=True)


def _settings() -> dict[str, Any]:
    """train.py's own TRAIN_* settings; a wrong value is a configuration error (exit code 2)."""
    env = os.environ
    try:
        settings: dict[str, Any] = {
            "steps": int(env.get("TRAIN_STEPS", "10")),
            "elements": int(env.get("TRAIN_ELEMENTS", str(1 << 20))),
            "step_sleep_s": float(env.get("TRAIN_STEP_SLEEP_S", "0")),
            "recovery": env.get("TRAIN_RECOVERY", "off").strip().lower(),
            "checkpoint_dir": env.get("TRAIN_CHECKPOINT_DIR") or None,
            "checkpoint_every": int(env.get("TRAIN_CHECKPOINT_EVERY", "5")),
            "recovery_timeout_s": float(env["TRAIN_RECOVERY_TIMEOUT_S"]) if env.get("TRAIN_RECOVERY_TIMEOUT_S") else None,
            "max_recoveries": int(env.get("TRAIN_MAX_RECOVERIES", "5")),
        }
    except ValueError as exc:
        raise gridcomm.ConfigError(f"a TRAIN_* variable is not a number: {exc}") from None
    if settings["recovery"] not in RECOVERY_MODES:
        raise gridcomm.ConfigError(f"TRAIN_RECOVERY={settings['recovery']!r} must be one of {', '.join(RECOVERY_MODES)}.")
    if settings["recovery"] != "off" and settings["checkpoint_dir"] is None:
        raise gridcomm.ConfigError(f"TRAIN_RECOVERY={settings['recovery']} needs TRAIN_CHECKPOINT_DIR: a folder every "
                                   "pod sees, to resume from after a recovery.")
    if settings["recovery"] != "off" and not hasattr(gridcomm.Communicator, settings["recovery"]):
        raise gridcomm.ConfigError(f"TRAIN_RECOVERY={settings['recovery']}: gridcomm {gridcomm.__version__} has no "
                                   f"Communicator.{settings['recovery']}(); use a gridcomm with recovery in place, or "
                                   "TRAIN_RECOVERY=off.")
    if settings["checkpoint_every"] < 1:
        raise gridcomm.ConfigError(f"TRAIN_CHECKPOINT_EVERY={settings['checkpoint_every']} must be at least 1.")
    return settings


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = _settings()
        # Before anything slow: liveness answers from here on, readiness once the ranks have met.
        gridcomm.start_health_server()
        run(**settings)
    except (gridcomm.ConfigError, gridcomm.AuthenticationError) as exc:
        log.error("configuration error: %s", exc)
        return EXIT_CONFIG_ERROR
    except (gridcomm.RankFailedError, gridcomm.RendezvousTimeout, gridcomm.CoordinatorUnavailable,
            gridcomm.CommAborted) as exc:
        log.error("%s: %s", type(exc).__name__, exc)
        return EXIT_PEER_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
