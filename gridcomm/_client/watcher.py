"""Liveness, on the process-wide background loop (:mod:`gridcomm._runtime.loop`).

The loop hosts, for every joined coordinator client of this process (a communicator's, or a bare
one), a watcher that long-polls the coordinator's Heartbeat (so the coordinator knows the rank is alive, and the
rank learns of any failure at once). When a watcher learns that a rank failed, or cannot reach
the coordinator for the heartbeat timeout, it calls the communicator's failure handler from this
thread (which aborts NCCL work that may be spinning on the GPU). After a peer's failure it goes
on heartbeating until the rank stops: the rank is alive (it may be writing a checkpoint), and a
rank that went silent would be reported failed too, one crash reading as several.

One heartbeat is in flight at all times, in every phase: the coordinator holds it (also while
a generation is failed, once this process has been told of its failures), so this rank's death
always ends a call there and is seen within the connection grace, never only by its silence.
With the coordinator inside a rank's process (rank 0's, embedded), that call is also how the
coordinator's death shows here: its connection drops, the watcher dials again for the same
grace, and a port that refused it meanwhile is that rank's failure (:class:`CoordinatorLost`);
a coordinator that answers again was only cut off for a moment, and one that neither answers nor
refuses is judged by the silence bound.
The per-rank grpc.health.v1 server kubelet probes lives in :mod:`gridcomm._runtime.health`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import time
from collections.abc import Iterable
from typing import Protocol

import grpc

from gridcomm import _config
from gridcomm._client.session import Session, StreamBroken
from gridcomm._errors import (
    CollectiveMismatch,
    CoordinatorLost,
    CoordinatorUnavailable,
    GridcommError,
    RankFailedError,
    RankStalled,
)
from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._proto import coordinator_pb2_grpc as pb_grpc
from gridcomm._relay.silence import reported
from gridcomm._runtime.channel import make_aio_channel
from gridcomm._runtime.loop import current as _current_loop
from gridcomm._runtime.loop import lag_s as _lag_s
from gridcomm._runtime.loop import loop as _runtime
from gridcomm._wire import translate

log = logging.getLogger(__name__)

#: How long start() waits for the background loop to take the watcher on.
START_WAIT_S = 10.0
#: How long a dropped connection to a coordinator hosted in a rank's process may refuse to come
#: back before that rank is taken as failed: the coordinator's own grace for a rank's dropped
#: connection (``min(2 s, bound / 2)``, gridcomm._coordinator.server).
CONNECTION_GRACE_S = 2.0
#: Pause between two attempts to reach that coordinator again (each fails at once while nothing
#: listens; the channel's own reconnect backoff starts at 0.1 s).
REDIAL_PAUSE_S = 0.1


#: Time kept between the end of the hold a heartbeat asks for and its deadline, for the answer's
#: trip (the interval, if shorter).
HOLD_MARGIN_S = 1.0


def hold_for(interval: float, call_s: float) -> float:
    """How long a heartbeat with ``call_s`` to its deadline may ask the coordinator (or relay) to
    hold it: the interval, or, with less time than that left (an attempt went unanswered and the
    bound is running out), nothing: it is answered at once. Why: a Session operation has no
    deadline at the server, which holds it for the whole wait it asks for; asking for more than
    the deadline allows makes the attempt fail against a coordinator that is back in time (at
    8,192 ranks, leaders and ranks leaving a starved relay took the coordinator for gone that
    way, stopped heartbeating, and were then failed as silent)."""
    return interval if call_s >= interval + min(HOLD_MARGIN_S, interval) else 0.0


class _Dropped(Exception):
    """The Session stream to a coordinator hosted in a rank's process broke under a heartbeat."""


def _refused(exc: grpc.RpcError) -> bool:
    """Whether a failed call says nothing listens at the coordinator's address (its process is
    gone). Why only this: a coordinator that is slow, overloaded or cut off by the network does
    not refuse a connection; it answers late or never, and the silence bound judges that."""
    return exc.code() == grpc.StatusCode.UNAVAILABLE and "connection refused" in (exc.details() or "").lower()


class _Redial:
    """Attempts to reach the coordinator again after its connection dropped: heartbeats answered
    at once (``wait_s`` 0) on a channel of their own without gRPC's retries, so each attempt says
    at once whether the coordinator's port refused it (the client's channel retries a refused
    unary call for ~1.5 s). The channel is closed once the coordinator answers or is lost."""

    def __init__(self, client: Watched) -> None:
        self._client = client
        self._channel = make_aio_channel(client.target, client.tls, retries=False)
        self._stub = pb_grpc.CoordinatorStub(self._channel)

    async def attempt(self, timeout_s: float) -> pb.HeartbeatResponse:
        client = self._client
        request = pb.HeartbeatRequest(caller=client.caller, progress=client.progress())
        reply: pb.HeartbeatResponse = await self._stub.Heartbeat(request, timeout=timeout_s, metadata=client.metadata)
        return reply

    async def close(self) -> None:
        try:
            await self._channel.close()
        except Exception:  # noqa: BLE001 - closing anyway
            pass


def failure_error(failure: pb.Failure, observer: int) -> RankFailedError:
    when = time.strftime("%H:%M:%S", time.localtime(failure.at_unix_s)) if failure.at_unix_s else "?"
    if failure.cause == pb.FAILURE_CAUSE_MISMATCH:
        return CollectiveMismatch(f"mismatched collectives (seen at {when}): {failure.reason} (seen by rank {observer})",
                                  rank=failure.rank, reason=failure.reason)
    kind = RankStalled if failure.cause == pb.FAILURE_CAUSE_STALL else RankFailedError
    return kind(f"rank {failure.rank} failed at {when}: {failure.reason} (seen by rank {observer})",
                rank=failure.rank, reason=failure.reason)


class Watched(Protocol):
    """What a watcher reads of the client it watches for (gridcomm._client.client.CoordinatorClient)."""

    rank: int
    target: str
    tls: _config.TlsFiles | None
    heartbeat_timeout_s: float
    coordinator_rank: int | None

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]: ...

    @property
    def caller(self) -> pb.Caller: ...

    @property
    def generation(self) -> int: ...

    def watched(self, error: GridcommError, generation: int) -> None: ...

    def abandon(self, error: GridcommError) -> None:
        """The coordinator is lost: the client's calls in flight end with ``error``."""
        ...

    def aio_channel(self) -> grpc.aio.Channel:
        """The client's channel on the background loop (shared with its Session stream)."""
        ...

    def session_stream(self) -> Session | None:
        """The client's Session stream, which its operations and heartbeats ride (None: unary calls)."""
        ...

    def relay_unreachable(self, session: Session) -> None:
        """The relay ``session`` dials did not answer a heartbeat in time."""
        ...

    def progress(self) -> list[pb.Progress]:
        """The rank's progress in its communicators, for the next heartbeat."""
        ...

    def probed(self, probes: Iterable[pb.DigestProbe]) -> None:
        """The coordinator asks for digests; the next heartbeat's progress answers."""
        ...


class Watcher:
    """Heartbeats for one joined client, on the background loop, and hands every failure it
    learns of to ``client.watched(error, generation)`` (the client keeps the first of each
    generation). It reads the client's identity afresh for each heartbeat, so it goes on across
    the generations of a recovery in place."""

    def __init__(self, client: Watched) -> None:
        self._client = client
        self._task: asyncio.Task[None] | None = None
        self._stopped = False

    def start(self) -> None:
        loop = _runtime()

        async def begin() -> None:
            if not self._stopped:
                self._task = asyncio.ensure_future(self._run())

        started = asyncio.run_coroutine_threadsafe(begin(), loop)
        try:
            started.result(START_WAIT_S)
        except concurrent.futures.TimeoutError:
            # Why not an error: the loop is starved (many ranks on few cores can take longer
            # than this); the watcher is scheduled and starts when the loop gets to it, and the
            # coordinator counts a late first heartbeat from when this rank could reach it.
            log.warning("rank %d: the background loop is %.0f s behind; liveness starts when it catches up",
                        self._client.rank, START_WAIT_S)

    def stop(self) -> None:
        """Stops heartbeating (before a clean leave). Idempotent; bounded."""
        self._stopped = True
        task = self._task
        running = _current_loop()
        if task is not None and running is not None:
            running.call_soon_threadsafe(task.cancel)

    def _give_up(self, error: GridcommError, generation: int) -> None:
        """The coordinator is lost: reported, and the client's calls in flight end with it."""
        self._report(error, generation)
        if not self._stopped:
            try:
                self._client.abandon(error)
            except Exception:  # noqa: BLE001 - the verdict stands; the calls meet their deadlines
                log.exception("rank %d: ending the calls in flight raised", self._client.rank)

    def _report(self, error: GridcommError, generation: int) -> None:
        if self._stopped:
            return
        try:
            self._client.watched(error, generation)
        except Exception:  # noqa: BLE001 - a handler bug must not kill the liveness task
            log.exception("rank %d: the failure handler raised", self._client.rank)

    async def _run(self) -> None:
        client = self._client
        timeout_s = client.heartbeat_timeout_s
        interval = max(0.05, timeout_s / 3)
        grace = min(CONNECTION_GRACE_S, timeout_s / 2)
        last_ok = time.monotonic()
        lag_ok = _lag_s()
        backoff = 0.05
        #: (generation, failure count) of the last answer that carried failures.
        told: tuple[int, int] | None = None
        #: With the coordinator in a rank's process: when its connection was found dropped (the
        #: first attempt that failed since the last answer), and whether it refused one since.
        down_since: float | None = None
        refused = False
        redial: _Redial | None = None
        #: When the heartbeat answered last was sent (None: it was an attempt answered at once).
        started: float | None = None
        try:
            while not self._stopped:
                generation = client.generation
                if down_since is not None:
                    if redial is None:
                        redial = _Redial(client)
                    try:
                        reply = await redial.attempt(max(0.2, min(1.0, timeout_s - self._silent(last_ok, lag_ok))))
                    except grpc.RpcError as exc:
                        refused = refused or _refused(exc)
                        down_s = time.monotonic() - down_since
                        if refused and down_s >= grace:
                            self._give_up(self._dropped(down_s, grace, exc.details() or exc.code().name), generation)
                            return
                        silent = self._silent(last_ok, lag_ok)
                        if silent > timeout_s:
                            self._give_up(self._lost(silent, f"{exc.code().name}: {exc.details()}"), generation)
                            return
                        await asyncio.sleep(REDIAL_PAUSE_S)
                        continue
                    started = None  # an attempt answered at once: nothing to pace
                    # It answered: a live coordinator whose connection merely dropped (it re-bound
                    # its port, a proxy cut it); the held heartbeat goes on on a fresh stream.
                    down_since, refused = None, False
                    await redial.close()
                    redial = None
                    log.info("rank %d: the coordinator at %s answered again after its connection dropped",
                             client.rank, client.target)
                else:
                    # Why a deadline well past the server's answer (at ``interval``): a call the
                    # client gives up on is cancelled on the server, which reads a dropped heartbeat
                    # as a dead process after its short grace: with ``interval + 1`` an overloaded
                    # but live rank (many processes on few cores) would be failed that way.
                    call_s = interval + max(1.0, timeout_s / 2)
                    # Why bounded by what is left of the bound: a heartbeat on a stream that has to be
                    # opened again waits for the coordinator (wait_for_ready); a coordinator that is
                    # gone must still be noticed within the bound, not a call's deadline after it.
                    call_s = min(call_s, max(0.2, timeout_s - self._silent(last_ok, lag_ok) + 0.1))
                    request = pb.HeartbeatRequest(caller=client.caller, wait_s=hold_for(interval, call_s),
                                                  progress=client.progress())
                    started = time.monotonic()
                    try:
                        reply = await self._beat(request, call_s)
                    except _Dropped as exc:
                        log.debug("rank %d: %s; dialling the coordinator again", client.rank, exc)
                        down_since = time.monotonic()
                        continue
                    except grpc.RpcError as exc:
                        code = exc.code()
                        if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                                        grpc.StatusCode.CANCELLED):
                            self._report(translate(exc, f"rank {client.rank}: heartbeat", client.target), generation)
                            return
                        # Why the relay's count too: it answers this rank's heartbeats itself, so
                        # only it can tell how long the coordinator has been silent (see
                        # gridcomm._relay.silence).
                        silent = max(self._silent(last_ok, lag_ok), reported(exc))
                        if silent > timeout_s:
                            self._give_up(self._lost(silent, f"{code.name}: {exc.details()}"), generation)
                            return
                        if client.coordinator_rank is not None and code == grpc.StatusCode.UNAVAILABLE:
                            down_since, refused = time.monotonic(), _refused(exc)
                            continue
                        # Jittered, bounded backoff; the loop ends at the heartbeat timeout above.
                        await asyncio.sleep(backoff * (0.5 + random.random()))
                        backoff = min(1.0, backoff * 2)
                        continue
                last_ok, lag_ok = time.monotonic(), _lag_s()
                backoff = 0.05
                if reply.digest_probes:
                    client.probed(reply.digest_probes)
                if not reply.failures:
                    continue
                self._report(failure_error(reply.failures[0], client.rank), reply.generation or generation)
                news = (reply.generation or generation, len(reply.failures))
                if started is not None and news == told and time.monotonic() - started < interval / 2:
                    # Why the pause: this coordinator (one that predates held heartbeats, or a
                    # relay) answers at once while a generation is failed; keep the bound's pace.
                    await asyncio.sleep(interval - (time.monotonic() - started))
                told = news
        except asyncio.CancelledError:
            pass
        finally:
            if redial is not None:
                await asyncio.shield(redial.close())

    @staticmethod
    def _silent(since: float, lag_then: float) -> float:
        """Seconds without an answer since ``since``, less the time this process's loop ran behind
        (a starved rank process cannot read the answers it was sent; that is not the coordinator's
        silence)."""
        return (time.monotonic() - since) - max(0.0, _lag_s() - lag_then)

    async def _beat(self, request: pb.HeartbeatRequest, call_s: float) -> pb.HeartbeatResponse:
        """One heartbeat: an operation on the client's Session stream (a message on a stream
        the coordinator already serves; a unary call per heartbeat is a new call for it to set
        up, and with thousands of ranks those calls can wait behind the streams' traffic for
        longer than the liveness bound), or the Heartbeat RPC when there is no stream or it broke."""
        timeout_s = self._client.heartbeat_timeout_s
        session = self._client.session_stream()
        if session is not None:
            started, lag_before = time.monotonic(), _lag_s()
            try:
                if not session.relay:
                    return await session.run("heartbeat", request, call_s)
                # Why a shorter deadline: the relay answers at the wait (it is near, and does not
                # wait on the coordinator to); one that does not is hung or cut off, and this
                # rank must reach the coordinator directly before the bound names it silent
                # (the coordinator last heard of it from the relay up to bound / 6 before that).
                return await session.run("heartbeat", request, min(call_s, request.wait_s + max(2.0, timeout_s / 4)))
            except StreamBroken as exc:
                if self._client.coordinator_rank is not None and not session.relay and not session.closed:
                    # Why not repeated as a unary call at once: with the coordinator in a rank's
                    # process, a stream that breaks is how that process's death shows; the
                    # watcher dials again within the connection grace and tells which it was.
                    raise _Dropped(str(exc)) from None
                log.debug("rank %d: %s; heartbeat as a unary call", self._client.rank, exc)
            except grpc.RpcError as exc:
                if not session.relay or exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
                if _lag_s() - lag_before > 1.0:
                    raise  # this process ran behind, not the relay: try the relay again
                log.warning("rank %d: the relay did not answer a heartbeat in time; going to the coordinator directly",
                            self._client.rank)
                self._client.relay_unreachable(session)
            call_s = max(0.1, call_s - (time.monotonic() - started))
        # Why the client's channel, and only now: one connection per rank, shared with its Session
        # stream; a rank whose heartbeats ride its relay's stream never opens one to the coordinator.
        stub = pb_grpc.CoordinatorStub(self._client.aio_channel())
        reply: pb.HeartbeatResponse = await stub.Heartbeat(request, timeout=call_s, metadata=self._client.metadata)
        return reply

    def _dropped(self, down_s: float, grace: float, why: str) -> GridcommError:
        """The coordinator in a rank's process is gone: its connection dropped, and it refused
        this rank's attempts to reach it again for the connection grace."""
        client = self._client
        rank = client.coordinator_rank
        assert rank is not None  # only a coordinator in a rank's process is redialled
        text = (f"the coordinator it hosts at {client.target} dropped this rank's connection, and refused it again "
                f"for {down_s:.1f} s (connection grace {grace:g} s): its process is gone (killed, crashed or "
                f"exited); last attempt: {why}")
        return CoordinatorLost(f"rank {rank} failed: {text} (seen by rank {client.rank})", rank=rank, reason=text)

    def _lost(self, silent: float, why: str) -> GridcommError:
        client = self._client
        text = (f"the coordinator at {client.target} has not answered for {silent:.1f} s "
                f"(heartbeat timeout {client.heartbeat_timeout_s:g} s): {why}")
        if client.coordinator_rank is not None:
            # Why: the coordinator lives in that rank's process; its silence is that rank's failure.
            return CoordinatorLost(f"rank {client.coordinator_rank} failed: {text} (seen by rank {client.rank})",
                                   rank=client.coordinator_rank, reason=text)
        return CoordinatorUnavailable(f"rank {client.rank}: {text}")
