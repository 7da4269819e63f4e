"""The example job the manifests in deploy/k8s run in every pod (``python /app/train.py``).

Everything comes from the environment the pod is given: the rank from ``JOB_COMPLETION_INDEX``,
the world size, rank 0's address, the backend and the token from ``GRIDCOMM_*``. Each rank
all-reduces a buffer a few times, checks the sum, meets the others at a barrier and exits.

The first thing it does is start the pod's health server (``gridcomm.start_health_server()``), so
kubelet's startup and liveness probes pass while a real job would load its data or model before
``init_process_group``.

Exit codes, which the Job's ``podFailurePolicy`` relies on:
  0  done;
  2  a configuration error, a missing token Secret (its file is absent) or a refused token
     (retrying the same pod cannot help);
  3  another rank failed, the coordinator went away, or the ranks never all met;
  1  anything else (counted against the Job's ``backoffLimit``).

``TRAIN_STEPS`` (default 10) and ``TRAIN_ELEMENTS`` (default 1048576) size the work.
``TRAIN_STEP_SLEEP_S`` (default 0) paces it: each step then also sleeps that long, standing in
for the compute between collectives, and logs one line (tests/test_pod_simulation.py uses it to
keep pods running, and to kill one between two steps).
"""

from __future__ import annotations

import logging
import os
import sys
import time

import gridcomm

EXIT_CONFIG_ERROR = 2
EXIT_PEER_FAILED = 3

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


def run(steps: int, elements: int, step_sleep_s: float = 0.0) -> None:
    with gridcomm.init_process_group() as comm:
        xp = _array_module(os.environ.get("GRIDCOMM_BACKEND", "nccl"))
        log.info("rank %d of %d joined; %d all_reduce steps of %d float32", comm.rank, comm.world_size, steps, elements)
        send = xp.full(elements, comm.rank + 1, dtype=xp.float32)
        recv = xp.empty_like(send)
        started = time.perf_counter()
        for step in range(steps):
            comm.all_reduce(send, recv, op="sum")
            if step_sleep_s > 0:
                log.info("rank %d: step %d of %d done", comm.rank, step + 1, steps)
                time.sleep(step_sleep_s)
        expected = comm.world_size * (comm.world_size + 1) / 2
        # Comparing on the array's own device keeps the check cheap; bool() waits for the stream.
        if not bool((recv == expected).all()):
            raise RuntimeError(f"rank {comm.rank}: all_reduce gave {float(recv[0])}, expected {expected}")
        elapsed = time.perf_counter() - started
        comm.barrier("train-done")
        print(f"rank {comm.rank}/{comm.world_size}: {steps} all_reduce of {elements} float32 correct "
              f"in {elapsed:.3f} s", flush=True)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    steps = int(os.environ.get("TRAIN_STEPS", "10"))
    elements = int(os.environ.get("TRAIN_ELEMENTS", str(1 << 20)))
    step_sleep_s = float(os.environ.get("TRAIN_STEP_SLEEP_S", "0"))
    try:
        # Before anything slow: liveness answers from here on, readiness once the ranks have met.
        gridcomm.start_health_server()
        run(steps, elements, step_sleep_s)
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
