"""Ending an NCCL communicator without hanging the process that ends it.

``ncclCommDestroy`` can block for good: it waits for work that CUDA graphs captured on the
communicator (while such a graph is alive), and it is a collective over the ranks of a node
(every rank destroys the same communicators in the same order, nccl4py says), so a peer that
never calls it holds the others. :func:`bounded_destroy` runs it on a thread of its own and,
past a bound, aborts the communicator instead (``ncclCommAbort`` frees it without waiting for
anyone). The abort is bounded the same way, so ``stop()`` returns whatever NCCL does.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

#: How long ``stop()`` waits for one communicator's ncclCommDestroy before aborting it.
DESTROY_WAIT_S = 10.0


def _bounded(call: Callable[[], Any], name: str, wait_s: float) -> tuple[bool, BaseException | None]:
    """Runs ``call`` on a daemon thread ``name``; (finished within ``wait_s``, what it raised)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            outcome.append(exc)
        else:
            outcome.append(None)

    thread = threading.Thread(target=run, name=name, daemon=True)
    try:
        thread.start()
    except RuntimeError:  # the interpreter is shutting down: no new threads; unbounded, as NCCL's own
        run()
        return True, outcome[0]
    thread.join(wait_s)
    if thread.is_alive():
        return False, None
    return True, outcome[0] if outcome else None


def bounded_destroy(owner: Any, what: str, wait_s: float | None = None) -> bool:
    """``owner.destroy()`` (CuPy's NcclCommunicator, nccl4py's Communicator, the engines' split
    owner), waited for at most ``wait_s`` (default :data:`DESTROY_WAIT_S`); past it,
    ``owner.abort()``, bounded alike. True when the destroy completed; never raises (``what``
    names the communicator in the warnings)."""
    wait = DESTROY_WAIT_S if wait_s is None else wait_s
    done, error = _bounded(owner.destroy, "gridcomm-nccl-destroy", wait)
    if done:
        if error is not None:
            log.warning("%s: ncclCommDestroy failed: %s", what, error)
        return error is None
    log.warning("%s: ncclCommDestroy did not return within %g s (a CUDA graph that captured this communicator's "
                "collectives is still alive, or a peer rank has not called stop()); aborting it (ncclCommAbort)",
                what, wait)
    done, error = _bounded(owner.abort, "gridcomm-nccl-abort", wait)
    if not done:
        log.warning("%s: ncclCommAbort did not return within %g s either; leaving it to the process's exit",
                    what, wait)
    elif error is not None:
        log.warning("%s: ncclCommAbort failed: %s", what, error)
    return False
