"""The process-wide background event loop: one thread per process, whatever the number of
communicators or clients.

It hosts the liveness watchers and per-rank health servers (:mod:`gridcomm._client.watcher`) and the
Session streams that carry coordinator calls (:mod:`gridcomm._client.session`). It starts on first use,
never at import, and is wound down (bounded) at interpreter exit.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import os
import threading
import weakref
from collections.abc import Coroutine
from typing import Any

from gridcomm._errors import GridcommError
from gridcomm._runtime.lag import LagMeter

log = logging.getLogger(__name__)

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
#: The process that started _loop: a forked child has the loop object but not its thread.
_pid = 0
#: The loop's thread (a blocking call made on it would wait for itself).
_thread_id = 0
_thread: threading.Thread | None = None
#: What serves or dials on the loop, wound down in order at exit (see _shutdown): servers (anything
#: with ``async stop(grace_s)``) and channels (``async close()``).
_servers: weakref.WeakSet[Any] = weakref.WeakSet()
_channels: weakref.WeakSet[Any] = weakref.WeakSet()
#: Names the tasks that stop a grpc.aio server: never cancelled at exit (see _shutdown).
SERVER_STOP_TASK = "gridcomm-server-stop"


def loop() -> asyncio.AbstractEventLoop:
    """The process-wide loop, started on first use."""
    global _loop, _pid
    with _lock:
        if _loop is None or _loop.is_closed() or _pid != os.getpid():
            new = asyncio.new_event_loop()
            drop_late_grpc_events(new)
            ready = threading.Event()

            def run() -> None:
                global _thread_id
                _thread_id = threading.get_ident()
                asyncio.set_event_loop(new)
                new.call_soon(ready.set)
                new.run_forever()

            thread = threading.Thread(target=run, name="gridcomm-loop", daemon=True)
            thread.start()
            if not ready.wait(10.0):
                raise GridcommError("the gridcomm background thread did not start within 10 s.")
            global _thread
            _loop, _pid, _thread = new, os.getpid(), thread
            _servers.clear()
            _channels.clear()
            global _lag, _lag_task
            _lag = LagMeter()
            _lag_task = asyncio.run_coroutine_threadsafe(_measure(_lag), new)
            atexit.register(_shutdown)
        return _loop


#: How far behind the background loop runs (see gridcomm._runtime.lag): a rank's watcher and a
#: relay leave that time out of the silences they judge, as the coordinator leaves out its own.
_lag: LagMeter | None = None
_lag_task: concurrent.futures.Future[None] | None = None


async def _measure(meter: LagMeter) -> None:
    await meter.run()


def lag_s() -> float:
    """The background loop's cumulative lag so far (0.0 before it starts)."""
    meter = _lag
    return meter.total_s if meter is not None and _pid == os.getpid() else 0.0


def _late_grpc_event(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    exc = context.get("exception")
    if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed" and \
            "_handle_events" in repr(context.get("handle")):
        log.debug("dropped a gRPC completion for an event loop that was closed: %s", context.get("handle"))
        return
    loop.default_exception_handler(context)


def drop_late_grpc_events(loop: asyncio.AbstractEventLoop) -> None:
    """Makes ``loop`` drop, quietly, a gRPC completion that arrives for another loop of this
    process after that loop was closed. Why: grpc.aio has one completion queue per process, and any
    loop bound to it delivers events for the others; a completion for a closed loop (a coordinator
    stopped in this process, whose server's last events come late) raised 'Event loop is closed'
    inside the delivering loop, printed as a traceback at the end of a run that went well, which an operator reads as a fault.
    Nothing can act on such an event: its loop is gone."""
    loop.set_exception_handler(_late_grpc_event)


def current() -> asyncio.AbstractEventLoop | None:
    """The loop if it runs, else None (never starts it)."""
    running = _loop
    return running if running is not None and not running.is_closed() and _pid == os.getpid() else None


def on_loop_thread() -> bool:
    return threading.get_ident() == _thread_id and current() is not None


def stops_at_exit(server: Any) -> None:
    """``server`` (serving on the process-wide loop, with ``async stop(grace_s)``) is stopped at exit
    if it still serves then."""
    _servers.add(server)


def closes_at_exit(channel: Any) -> None:
    """``channel`` (a grpc.aio channel used on the process-wide loop) is closed at exit if still open."""
    _channels.add(channel)


def _shutdown() -> None:
    """At exit, in this order, bounded: stop the servers that still serve (a relay waiting for its
    group to leave), close the channels, cancel what is left, stop the loop and wait for its thread.
    Why the order and the wait: a grpc.aio server whose stop was cancelled half-way, or a loop still
    running gRPC code while the interpreter finalizes, crashes the process in grpcio's core
    (SIGSEGV after the program's last line); so a server's stop is never cancelled, and the
    interpreter goes on only once the loop's thread has returned."""
    running = current()
    if running is None:
        return

    async def wind_down() -> None:
        stops = [asyncio.ensure_future(server.stop(0)) for server in list(_servers)]
        if stops:
            await asyncio.wait(stops, timeout=2.0)
        closes = [asyncio.ensure_future(channel.close()) for channel in list(_channels)]
        if closes:
            await asyncio.wait(closes, timeout=1.0)
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()
                 and t.get_name() != SERVER_STOP_TASK]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=2.0)

    try:
        asyncio.run_coroutine_threadsafe(wind_down(), running).result(6.0)
    except Exception:  # noqa: BLE001 - best effort at exit
        pass
    running.call_soon_threadsafe(running.stop)
    thread = _thread
    if thread is not None and thread is not threading.current_thread():
        thread.join(3.0)


def submit(coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
    return asyncio.run_coroutine_threadsafe(coro, loop())


def run_soon(coro: Coroutine[Any, Any, Any], timeout_s: float) -> None:
    """Runs ``coro`` on the loop: waits (bounded) from other threads, only schedules from the
    loop's own thread (a failure handler), where waiting would deadlock."""
    target = loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is target:
        asyncio.ensure_future(coro)
    else:
        future = asyncio.run_coroutine_threadsafe(coro, target)
        try:
            future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            # A starved loop: what was asked stays scheduled and runs when the loop gets to it.
            log.warning("the gridcomm background loop did not get to a task within %g s (starved?); it runs later",
                        timeout_s)
