"""A relay's heartbeats: it answers its ranks' heartbeats itself, and sends the coordinator one
for all of them.

A rank's heartbeat is answered by the relay (at its wait, or at once when the relay learns of a
failure); the relay sends the coordinator one heartbeat for all its ranks every ``bound / 6``, with
the age of each one's last heartbeat, so the coordinator judges every rank by its own silence with
the same bound. While the coordinator does not answer for that bound, the ranks' heartbeats are
answered so at once (gridcomm._relay.silence).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Hashable

import grpc

from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._relay.children import Child
from gridcomm._relay.silence import silent_answer
from gridcomm._relay.upstream import Upstream
from gridcomm._runtime import loop as _eventloop
from gridcomm._wire import progress_said

log = logging.getLogger(__name__)

_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]


class Beats(Upstream):
    """A relay's heartbeats, both ways (on the loop)."""

    def _child_heartbeat(self, child: Child, op: pb.SessionOp) -> None:
        request = op.heartbeat
        loop = asyncio.get_running_loop()
        self._beats[request.caller.rank] = (request.caller, loop.time(), _eventloop.lag_s())
        if request.progress:
            entries = list(request.progress[:64])
            self._progress[request.caller.rank] = (entries, progress_said(entries))
        else:
            self._progress.pop(request.caller.rank, None)

        async def answer() -> None:
            if not self._latest.failures and not self._coordinator_silent():
                fut: asyncio.Future[None] = loop.create_future()
                self._beat_waiters.add(fut)
                wait_s = request.wait_s if request.wait_s == request.wait_s and request.wait_s > 0 else 0.0
                try:
                    await asyncio.wait_for(fut, min(wait_s, self.heartbeat_timeout_s))
                except asyncio.TimeoutError:
                    pass
                finally:
                    self._beat_waiters.discard(fut)
            silence = self._silence
            if silence is not None and silence.lost:
                child.answer(silent_answer(op.id, self.target, self.upstream, silence.seconds(loop.time())))
                return
            probes = self._probes_down.pop(request.caller.rank, None)
            if probes:  # digest probes for this rank (GRIDCOMM_DEBUG=collectives)
                beat = pb.HeartbeatResponse()
                beat.CopyFrom(self._latest)
                beat.digest_probes.extend(probes)
                child.answer(pb.SessionResult(id=op.id, heartbeat=beat))
                return
            child.answer(pb.SessionResult(id=op.id, heartbeat=self._latest))

        # Why kept: the loop holds tasks weakly.
        task = asyncio.ensure_future(answer())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _coordinator_silent(self) -> bool:
        """Whether the coordinator has not answered this relay for the liveness bound; the first
        time it is found so, the ranks' held heartbeats are answered with that now."""
        silence = self._silence
        if silence is None:
            return False
        if not silence.lost:
            silent_s = silence.seconds(asyncio.get_running_loop().time())
            if silent_s <= self.heartbeat_timeout_s:
                return False
            silence.lost = True
            log.warning("relay %s: no answer from the coordinator at %s for %.1f s (heartbeat timeout %g s); its "
                        "%d ranks are told it is lost", self.target, self.upstream, silent_s,
                        self.heartbeat_timeout_s, len(self._ranks))
            self._wake_beats()
        return True

    def _wake_beats(self) -> None:
        """Answers the ranks' held heartbeats now."""
        waiters, self._beat_waiters = self._beat_waiters, set()
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def _heartbeats(self) -> None:
        """One heartbeat upstream for every rank of this relay, every bound / 6 (a long-poll: a
        failure comes back at once)."""
        loop = asyncio.get_running_loop()
        while not self._stopped:
            # Read afresh: a rank hosting a relay learns the job's bound from its join's answer.
            period = max(0.05, self.heartbeat_timeout_s / 6)
            if not self._beats:
                if self._silence is not None:
                    self._silence.heard(loop.time())  # nothing asked of the coordinator: no silence
                await asyncio.sleep(period)
                continue
            now, lag = loop.time(), _eventloop.lag_s()
            beats = list(self._beats.values())
            # Why the lag is left out: this process's loop (the relay's, and in a node agent or a
            # simulation its ranks' too) ran behind, which is not the ranks' silence.
            ages = [max(0.0, (now - t) - (lag - at)) for _, t, at in beats]
            same: list[bool] = []
            full: dict[int, tuple[int, Hashable]] = {}
            request = pb.HeartbeatRequest(caller=beats[0][0], wait_s=period)
            aggregate = pb.Aggregate()
            for (caller, _, _), age in zip(beats, ages, strict=True):
                rank = caller.rank
                entries, said = self._progress.get(rank, ((), None))
                key = (caller.generation, said)
                repeated = said is not None and self._progress_up.get(rank) == key
                aggregate.ranks.add(rank=rank, incarnation=caller.incarnation, generation=caller.generation, age_s=age,
                                    progress_same=repeated)
                same.append(repeated)
                if repeated:
                    continue
                if said is not None:
                    full[rank] = key
                for entry in entries:
                    # Why the age added: the coordinator dates the entry from this message's arrival.
                    relayed = request.progress.add()
                    relayed.CopyFrom(entry)
                    relayed.rank = rank
                    relayed.age_s = entry.age_s + age if entry.age_s == entry.age_s else 0.0
                    if entry.gpu_wait_s > 0:
                        relayed.gpu_wait_s = entry.gpu_wait_s + age
            self.progress_sent += len(request.progress)
            self.progress_same += sum(same)
            answered: asyncio.Future[pb.SessionResult] = loop.create_future()

            def done(result: pb.SessionResult, answered: asyncio.Future[pb.SessionResult] = answered) -> None:
                if not answered.done():
                    answered.set_result(result)

            self._send("heartbeat", request, [], done, aggregate)
            wait_s = period + max(1.0, self.heartbeat_timeout_s / 2)
            if self._silence is not None and not self._silence.lost:
                # Why: the ranks are told the moment the silence passes the bound, not at a timeout.
                wait_s = min(wait_s, self._silence.left(loop.time(), self.heartbeat_timeout_s))
            try:
                result = await asyncio.wait_for(answered, wait_s)
            except asyncio.TimeoutError:
                self._progress_up.clear()  # whether the coordinator read it is unknown: all in full
                self._coordinator_silent()
                continue
            if result.code:
                self._progress_up.clear()
                (log.debug if result.code == _UNAVAILABLE else log.warning)(
                    "relay %s: the coordinator refused its heartbeat: %s", self.target, result.details)
                await asyncio.sleep(period)
                continue
            self._progress_up.update(full)
            for rank in result.aggregate.progress_resend:
                self._progress_up.pop(rank, None)
                self._probes_down.pop(rank, None)
            if result.heartbeat.digest_probes:
                for probe in result.heartbeat.digest_probes:
                    self._probes_down.setdefault(probe.rank, []).append(probe)
                result.heartbeat.ClearField("digest_probes")
                self._wake_beats()
            self._latest = result.heartbeat
            if result.heartbeat.failures:
                waiters, self._beat_waiters = self._beat_waiters, set()
                for fut in waiters:
                    if not fut.done():
                        fut.set_result(None)
                await asyncio.sleep(period)  # answered at once while failed: keep the pace
