"""Liveness, on the process-wide background loop (:mod:`gridcomm._eventloop`).

The loop hosts, for every communicator of this process, a watcher
that long-polls the coordinator's Heartbeat (so the coordinator knows the rank is alive, and the
rank learns of any failure at once). When a watcher learns that a rank failed, or cannot reach
the coordinator for the heartbeat timeout, it calls the communicator's failure handler from this
thread (which aborts NCCL work that may be spinning on the GPU). After a peer's failure it goes
on heartbeating until the rank stops: the rank is alive (it may be writing a checkpoint), and a
rank that went silent would be reported failed too, one crash reading as several.
The per-rank grpc.health.v1 server kubelet probes lives in :mod:`gridcomm._health`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable

import grpc

from gridcomm import _config
from gridcomm._channel import make_aio_channel
from gridcomm._client import translate
from gridcomm._errors import CoordinatorLost, CoordinatorUnavailable, GridcommError, RankFailedError
from gridcomm._eventloop import current as _current_loop
from gridcomm._eventloop import loop as _runtime
from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._proto import coordinator_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

def failure_error(failure: pb.Failure, observer: int) -> RankFailedError:
    when = time.strftime("%H:%M:%S", time.localtime(failure.at_unix_s)) if failure.at_unix_s else "?"
    return RankFailedError(f"rank {failure.rank} failed at {when}: {failure.reason} (seen by rank {observer})",
                           rank=failure.rank, reason=failure.reason)


class Watcher:
    """Heartbeats for one rank and reports the first failure to ``on_failure`` (once)."""

    def __init__(self, target: str, tls: _config.TlsFiles | None, metadata: tuple[tuple[str, str], ...],
                 caller: pb.Caller, heartbeat_timeout_s: float,
                 on_failure: Callable[[GridcommError], None], coordinator_rank: int | None = None) -> None:
        self._target = target
        self._tls = tls
        self._metadata = metadata
        self._caller = caller
        self._timeout_s = heartbeat_timeout_s
        self._on_failure = on_failure
        #: The rank whose process hosts the coordinator (0 when embedded), or None (standalone).
        self._coordinator_rank = coordinator_rank
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        self._reported = False

    def start(self) -> None:
        loop = _runtime()

        async def begin() -> None:
            self._task = asyncio.ensure_future(self._run())

        asyncio.run_coroutine_threadsafe(begin(), loop).result(10.0)

    def stop(self) -> None:
        """Stops heartbeating (before a clean leave). Idempotent; bounded."""
        self._stopped = True
        task = self._task
        running = _current_loop()
        if task is not None and running is not None:
            running.call_soon_threadsafe(task.cancel)

    def _report(self, error: GridcommError) -> None:
        if self._stopped or self._reported:
            return
        self._reported = True
        try:
            self._on_failure(error)
        except Exception:  # noqa: BLE001 - a handler bug must not kill the liveness thread
            log.exception("rank %d: the failure handler raised", self._caller.rank)

    async def _run(self) -> None:
        channel = make_aio_channel(self._target, self._tls)
        stub = pb_grpc.CoordinatorStub(channel)
        interval = max(0.05, self._timeout_s / 3)
        last_ok = time.monotonic()
        backoff = 0.05
        try:
            while not self._stopped:
                if self._reported:
                    # Why the pause: once the job has failed, the coordinator answers a heartbeat
                    # at once (with the failures); heartbeats go on at the bound's pace.
                    await asyncio.sleep(interval)
                request = pb.HeartbeatRequest(caller=self._caller, wait_s=interval)
                try:
                    reply = await stub.Heartbeat(request, timeout=interval + 1.0, metadata=self._metadata)
                except grpc.aio.AioRpcError as exc:
                    code = exc.code()
                    if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                                    grpc.StatusCode.CANCELLED):
                        self._report(translate(exc, f"rank {self._caller.rank}: heartbeat", self._target))
                        return
                    silent = time.monotonic() - last_ok
                    if silent > self._timeout_s:
                        self._report(self._lost(silent, f"{code.name}: {exc.details()}"))
                        return
                    # Jittered, bounded backoff; the loop ends at the heartbeat timeout above.
                    await asyncio.sleep(backoff * (0.5 + random.random()))
                    backoff = min(1.0, backoff * 2)
                    continue
                last_ok = time.monotonic()
                backoff = 0.05
                if reply.failures:
                    self._report(failure_error(reply.failures[0], self._caller.rank))
        except asyncio.CancelledError:
            pass
        finally:
            await channel.close()


    def _lost(self, silent: float, why: str) -> GridcommError:
        text = (f"the coordinator at {self._target} has not answered for {silent:.1f} s "
                f"(heartbeat timeout {self._timeout_s:g} s): {why}")
        if self._coordinator_rank is not None:
            # Why: the coordinator lives in that rank's process; its silence is that rank's failure.
            return CoordinatorLost(f"rank {self._coordinator_rank} failed: {text} (seen by rank {self._caller.rank})",
                                   rank=self._coordinator_rank, reason=text)
        return CoordinatorUnavailable(f"rank {self._caller.rank}: {text}")
