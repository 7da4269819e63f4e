"""A rank's flight record: its last collectives per communicator, written out when things go wrong.

Each communicator's tracker keeps its last ``GRIDCOMM_FLIGHT_RECORD`` (256) counted calls in a
bounded ring: (number, kind, parameters, (size, dtype) or None, entered, returned), times on the
monotonic clock, appended when a call returns; the call a rank is still in is read off the tracker
(its kind, number and since when). The NCCL backend appends its own entries as a call is enqueued
(it returns before the GPU is done): (number, kind, entered, size, dtype, *parameters), written
with whether the GPU sampler had found that collective complete (``complete_on_gpu``). With ``GRIDCOMM_TRACE_DIR`` set, every rank writes
``rank-N.json`` there at a ``RankFailedError`` (a death, a stall, a mismatch, a lost
coordinator), at ``abort()`` and at SIGTERM; ``gridcomm trace DIR`` merges the files
(gridcomm._cli.trace).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger(__name__)

#: The record format's version (``gridcomm trace`` refuses others).
FORMAT = 1


def describe(array: Any) -> tuple[int, Any] | None:
    """(size, dtype) of an array argument, None for what is not one (a tensor's ``size`` is a
    method: no reference to the array is kept). The dtype is turned into words only when written."""
    size = getattr(array, "size", None)
    return (size, getattr(array, "dtype", "?")) if size.__class__ is int else None


#: Each kind's parameters the record keeps, in the order the wrapper stores their values.
def record_params(kind: str) -> tuple[str, ...]:
    from gridcomm._client.tracker import COUNTED

    return tuple(n for n in COUNTED.get(kind, ()) if not n.endswith("_array"))


def call_text(kind: str, params: Any, shape: Any) -> str:
    """``all_reduce(op=sum, 16 x float64)``: one record's call, in words."""
    if isinstance(params, str):
        return params  # a fingerprint (GRIDCOMM_DEBUG=collectives, barriers, splits)
    parts = [f"{name}={value}" for name, value in zip(record_params(kind), params or (), strict=False)]
    if shape:
        parts.append(f"{shape[0]} x {shape[1]}")
    return f"{kind}({', '.join(parts)})"


def tracker_record(tracker: Any, members: Iterable[int] = ()) -> dict[str, Any]:
    """One communicator's part of a rank's file (``tracker``: gridcomm._client.tracker.Tracker)."""
    wall = time.time() - time.monotonic()
    gpu_done = getattr(tracker, "gpu_completed", None)
    completed = gpu_done() if gpu_done is not None else None
    records = []
    for entry in list(tracker.record or ()):
        if entry[2].__class__ is float:  # NCCL's: (number, kind, entered, size, dtype, *parameters)
            number, kind, entered = entry[0], entry[1], entry[2]
            record = {"number": number, "call": call_text(kind, entry[5:], (entry[3], entry[4])), "kind": kind,
                      "entered_unix_s": round(entered + wall, 6)}
            if completed is not None:
                record["complete_on_gpu"] = number <= completed
            records.append(record)
            continue
        number, kind, params, shape, entered, returned = entry
        records.append({"number": number, "call": call_text(kind, params, shape), "kind": kind,
                        "entered_unix_s": round(entered + wall, 6), "took_s": round(returned - entered, 6)})
    now = time.monotonic()
    out: dict[str, Any] = {"name": tracker.name, "members": list(members), "entered": tracker.entered,
                           "kind": tracker.kind, "inside": tracker.inside, "records": records}
    if completed is not None:
        out["gpu_completed"] = completed
    if tracker.inside and tracker.started:
        out["inside_for_s"] = round(now - tracker.started, 6)
    return out


def write(directory: str, rank: int, generation: int, reason: str, communicators: list[dict[str, Any]]) -> str | None:
    """Writes ``rank-N.json`` into ``directory`` (atomically); returns its path (None: failed, logged)."""
    path = os.path.join(directory, f"rank-{rank}.json")
    body = {"format": FORMAT, "rank": rank, "host": socket.gethostname(), "pid": os.getpid(),
            "generation": generation, "reason": reason, "written_unix_s": time.time(),
            "communicators": communicators}
    try:
        os.makedirs(directory, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(body, handle)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("rank %d: could not write its flight record to %s: %s", rank, path, exc)
        return None
    log.info("rank %d: flight record written to %s", rank, path)
    return path


# SIGTERM: every live writer runs, then the signal's previous disposition.
_writers: list[weakref.WeakMethod[Callable[[str], None]]] = []
_lock = threading.Lock()
_installed = False


def on_sigterm(method: Callable[[str], None]) -> None:
    """``method(reason)`` runs at SIGTERM while its object lives (installs the handler once, from
    the main thread; elsewhere only failures and aborts write the record)."""
    global _installed
    with _lock:
        _writers[:] = [w for w in _writers if w() is not None]
        _writers.append(weakref.WeakMethod(method))  # type: ignore[arg-type]
        if _installed or threading.current_thread() is not threading.main_thread():
            return
        try:
            previous = signal.getsignal(signal.SIGTERM)
        except (ValueError, OSError):
            return

        def handler(signum: int, frame: Any) -> None:
            for ref in list(_writers):
                writer = ref()
                if writer is not None:
                    try:
                        writer("SIGTERM")
                    except Exception:  # noqa: BLE001 - the signal's own disposition must still run
                        log.exception("the flight record's SIGTERM writer raised")
            if callable(previous):
                previous(signum, frame)
            elif previous != signal.SIG_IGN:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)

        try:
            signal.signal(signal.SIGTERM, handler)
        except (ValueError, OSError):
            return
        _installed = True
