"""Stragglers: ranks that enter collectives late, slowing every other rank, but never stall.

A rank's heartbeats carry, per communicator, how many collectives it entered and how long its
calls spent inside them in all. In a collective every rank leaves at about the same moment (when
the last one has entered and the data moved), so a rank that enters ``d`` seconds after the first
entrant spends ``d`` seconds less inside it. Over a recent window (the last :data:`WINDOW`
reports of each rank), a rank's entry lag in a communicator is therefore the mean time per
collective the rank that waits most spent inside, less its own; clocks of different hosts never
meet. A rank's lag is its largest over its communicators.

A straggler is a rank whose lag is at least :data:`MIN_LAG_S` and more than :data:`FACTOR` times
the lower median of the ranks' lags: a slow but progressing rank, named in ``gridcomm status`` and on ``/metrics``,
never failed. Pure: the caller passes what the reports said.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics

#: Reports per rank and communicator the window holds (one per heartbeat: bound / 3 apart).
WINDOW = 8
#: Below this lag no rank is a straggler (timer and scheduling noise).
MIN_LAG_S = 0.005
#: A straggler's lag is more than this many times the median rank's.
FACTOR = 3.0
#: Communicators followed, the first reported (a bound on what reports make the coordinator hold).
MAX_COMMUNICATORS = 4


@dataclasses.dataclass
class _Series:
    entered: int
    inside_s: float
    #: (collectives, seconds inside) between consecutive reports, the last WINDOW of them.
    steps: collections.deque[tuple[int, float]] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=WINDOW))

    def per_call(self) -> float | None:
        calls = sum(n for n, _ in self.steps)
        return None if calls == 0 else sum(s for _, s in self.steps) / calls


@dataclasses.dataclass(frozen=True)
class Straggler:
    rank: int
    lag_s: float
    communicator: str


class EntryLag:
    """Per communicator and rank, the time per collective spent inside over a recent window."""

    def __init__(self) -> None:
        self._series: dict[str, dict[int, _Series]] = {}

    def reset(self) -> None:
        self._series.clear()

    def report(self, communicator: str, rank: int, entered: int, inside_s: float) -> None:
        ranks = self._series.get(communicator)
        if ranks is None:
            if len(self._series) >= MAX_COMMUNICATORS:
                return
            ranks = self._series[communicator] = {}
        old = ranks.get(rank)
        if old is None:
            ranks[rank] = _Series(entered, inside_s)
            return
        calls, spent = entered - old.entered, inside_s - old.inside_s
        if calls < 0 or spent < 0:  # a report older than one read, or a new process: start again
            ranks[rank] = _Series(entered, inside_s)
            return
        if calls > 0:
            old.steps.append((calls, spent))
        old.entered, old.inside_s = entered, inside_s

    def remove(self, rank: int) -> None:
        for ranks in self._series.values():
            ranks.pop(rank, None)

    def lags(self) -> dict[int, tuple[float, str]]:
        """rank -> (its entry lag in seconds, the communicator where it is largest)."""
        out: dict[int, tuple[float, str]] = {}
        for name, ranks in self._series.items():
            per_call = {r: v for r, s in ranks.items() if (v := s.per_call()) is not None}
            if len(per_call) < 2:
                continue
            most = max(per_call.values())
            for rank, value in per_call.items():
                lag = most - value
                if rank not in out or lag > out[rank][0]:
                    out[rank] = (lag, name)
        return out

    def stragglers(self, limit: int = 16) -> list[Straggler]:
        """The persistent stragglers, the latest first (see the module's docstring)."""
        lags = self.lags()
        if len(lags) < 2:
            return []
        median = statistics.median_low(lag for lag, _ in lags.values())
        found = [Straggler(rank, lag, name) for rank, (lag, name) in lags.items()
                 if lag >= MIN_LAG_S and lag > FACTOR * median]
        return sorted(found, key=lambda s: -s.lag_s)[:limit]
