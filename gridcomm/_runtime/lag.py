"""How far behind its event loop runs: the time a server could not hear anyone.

A coordinator whose loop is busy (thousands of ranks' messages on two cores) reads heartbeats
late; that time is its own lag, not the ranks' silence. :class:`LagMeter` keeps the cumulative
seconds by which a short timer fired late, so liveness can leave them out of a rank's silence:
a rank is silent for ``(now - last_heartbeat) - (lag now - lag at that heartbeat)``.
"""

from __future__ import annotations

import asyncio

#: The meter's timer period: 20 wake-ups a second, a few microseconds each.
TICK_S = 0.05
#: A timer this late or less is the loop's ordinary jitter, not lag.
SLACK_S = 0.01


class LagMeter:
    """Cumulative loop lag in seconds (:attr:`total_s`, never decreasing) and the worst single
    delay seen (:attr:`worst_s`). Run :meth:`run` as a task on the loop it measures."""

    def __init__(self, tick_s: float = TICK_S, slack_s: float = SLACK_S) -> None:
        self.tick_s = tick_s
        self.slack_s = slack_s
        self.total_s = 0.0
        self.worst_s = 0.0

    def note(self, late_s: float) -> None:
        """A timer fired ``late_s`` after it was due."""
        if late_s > self.slack_s:
            self.total_s += late_s
            if late_s > self.worst_s:
                self.worst_s = late_s

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.tick_s
            await asyncio.sleep(self.tick_s)
            self.note(loop.time() - due)
