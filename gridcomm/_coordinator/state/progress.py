"""Progress: how far each rank has got in each communicator, and who stalls the others.

Every rank's heartbeat says, per communicator, how many collectives it has entered (those every
member takes part in, barriers and splits), the kind of the last one, how long ago it entered it
and whether its call is still in it. From that the coordinator names two kinds of hang:

- a *laggard*: some ranks entered collective #k more than the stall bound ago and a live rank has
  not entered it (a deadlock in user code, a data loader stuck on storage, a rank that took
  another branch). The bound is counted from the first entry of #k, as the coordinator learns
  of it (a rank's entry time is its report's arrival less the age it reports), so a slow but
  progressing job, whose laggards enter #k within the bound, is never failed;
- a collective every rank entered that has not returned on some of them for the bound since the
  last one entered it (a network or data-plane hang).

With fingerprints (``GRIDCOMM_DEBUG=collectives``) it also names the first collective that ranks
called differently. Pure: the caller passes ``now`` (monotonic seconds) into every method.

Reports are each rank's own word, so none can frame another rank: an entry is never dated before
what the coordinator saw (the generation forming, the rank's previous report), a count that
advances faster than :data:`MAX_RATE` is refused, and ranks behind are named only when those ahead
are the majority (fewer ahead: the furthest ahead is the odd one out; an even split names the
laggard only when those ahead wait in the very next collective, or the laggard itself says its GPU
is stuck). A fingerprint mismatch names the smaller group,
and nobody on an even split.

Costs: a report is O(1) per communicator (a histogram of counts is kept, not scanned); a check is
O(distinct counts) per communicator, and a rank list is built only when a hang is named.

Here :class:`Progress`, the job's view (a generation's communicators, the caps over them, reports
that say nothing new); one communicator's ranks and the checks above in
:mod:`.communicator_progress`; a report's vocabulary and bounds in :mod:`.entries`. Their names are
importable from here too.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable
from typing import TypeVar

from gridcomm._coordinator.state.communicator_progress import CommunicatorProgress
from gridcomm._coordinator.state.entries import (
    MAX_BURST,
    MAX_COMMUNICATORS,
    MAX_JOB_PRINTED_COUNTS,
    MAX_RATE,
    Entry,
    Hang,
    _ranks_text,
)
from gridcomm._coordinator.state.entries import MAX_ENTRIES as MAX_ENTRIES
from gridcomm._coordinator.state.entries import MAX_FINGERPRINT as MAX_FINGERPRINT
from gridcomm._coordinator.state.entries import MAX_KIND as MAX_KIND
from gridcomm._coordinator.state.entries import MAX_NAME as MAX_NAME
from gridcomm._coordinator.state.entries import MAX_PRINTED_COUNTS as MAX_PRINTED_COUNTS
from gridcomm._coordinator.state.entries import MAX_RECENT as MAX_RECENT
from gridcomm._coordinator.state.entries import MISMATCH as MISMATCH
from gridcomm._coordinator.state.entries import STALL as STALL
from gridcomm._coordinator.state.entries import check_entry as check_entry
from gridcomm._coordinator.state.entries import digest_reason as digest_reason
from gridcomm._coordinator.state.lag import EntryLag

_V = TypeVar("_V", bound=Hashable)
#: The most distinct values :class:`Progress` shares between ranks before it starts afresh.
MAX_SHARED = 4096


class Progress:
    """Every communicator's progress in the current generation (see :class:`CommunicatorProgress`)."""

    def __init__(self) -> None:
        self.generation = 0
        self.communicators: dict[str, CommunicatorProgress] = {}
        #: rank -> the communicators it reported last time (one it stops reporting, it left).
        self._reported: dict[int, frozenset[str]] = {}
        #: rank -> what its last report said, as :meth:`unchanged` compares it.
        self._said: dict[int, Hashable] = {}
        #: Fingerprinted counts held over all communicators (MAX_JOB_PRINTED_COUNTS).
        self.printed = 0
        #: How late each rank enters collectives (stragglers).
        self.lag = EntryLag()
        #: One shared object for each value that ranks hold equal (the communicators a rank
        #: reported, what its last report said): ranks in step report the same, and a copy for
        #: each rank costs hundreds of bytes a rank. Bounded: cleared when full.
        self._shared: dict[Hashable, Hashable] = {}

    def _share(self, value: _V) -> _V:
        """``value``, or an equal one that other ranks already hold (see ``_shared``)."""
        shared = self._shared
        got = shared.get(value)
        if got is None:
            if len(shared) >= MAX_SHARED:
                shared.clear()
            shared[value] = got = value
        return got  # type: ignore[return-value]

    def reset(self, generation: int) -> None:
        """A new generation: its communicators are new (entries are dated no earlier than the
        ``floor`` that :meth:`report` is given: when the generation formed)."""
        self.generation = generation
        self.communicators.clear()
        self._reported.clear()
        self._said.clear()
        self._shared.clear()
        self.printed = 0
        self.lag.reset()

    def unchanged(self, rank: int, generation: int, said: Hashable, now: float) -> bool:
        """True when ``rank``'s last report of ``generation`` said ``said`` too (every count,
        kind and flag the same; only the ages grew): then the report only says that the rank
        was heard from at ``now``. Why: a rank between collectives reports the same entries
        with every heartbeat, and the full report is most of a relayed heartbeat's cost."""
        if generation != self.generation or self._said.get(rank) != said:
            return False
        self._restamp(rank, now)
        return True

    def _restamp(self, rank: int, now: float) -> None:
        """``rank``'s last report stands as of ``now`` (it was heard from saying the same)."""
        for name in self._reported.get(rank, ()):
            comm = self.communicators.get(name)
            entry = comm.ranks.get(rank) if comm is not None else None
            if entry is not None:
                entry.reported_at = now

    def refresh(self, ranks: Iterable[tuple[int, int]], now: float) -> list[int]:
        """Each (rank, generation)'s last report stands as of ``now`` (a relay said it is the
        same); returns the ranks with no such report that :meth:`unchanged` could compare."""
        missing = []
        for rank, generation in ranks:
            if generation != self.generation or self._said.get(rank) is None:
                missing.append(rank)
            else:
                self._restamp(rank, now)
        return missing

    def forget(self, rank: int) -> None:
        """``rank``'s last report stands for no later one (it was refused)."""
        self._said.pop(rank, None)

    def report(self, rank: int, generation: int, entries: Iterable[Entry], now: float,
               said: Hashable | None = None, floor: float = -math.inf) -> str | None:
        """``rank``'s report of ``generation`` (one of another generation is ignored); ``said``:
        what :meth:`unchanged` compares the next report with (None: nothing); ``floor``: no entry
        is dated earlier (when the generation formed or the rank joined). Returns why the report
        cannot be true (then nothing of it is kept), or None."""
        if generation != self.generation or generation == 0:
            return None
        entries = list(entries)
        for entry in entries:
            comm = self.communicators.get(entry.communicator)
            wrong = None if comm is None else comm.implausible(rank, entry, now, floor)
            if comm is None and entry.entered > MAX_BURST + MAX_RATE * max(0.0, now - floor):
                wrong = (f"communicator {entry.communicator!r}: {entry.entered} collectives entered "
                         f"{max(0.0, now - floor):.1f} s after the generation formed")
            if wrong is not None:
                self._said.pop(rank, None)
                return wrong
        names = set()
        for entry in entries:
            comm = self.communicators.get(entry.communicator)
            if comm is None:
                if len(self.communicators) >= MAX_COMMUNICATORS:
                    continue
                comm = self.communicators[entry.communicator] = CommunicatorProgress(entry.communicator)
            held = len(comm._prints)
            comm.report(rank, entry, now, floor)
            if entry.inside_s > 0:
                self.lag.report(entry.communicator, rank, entry.entered, entry.inside_s)
            self.printed += len(comm._prints) - held
            if self.printed > MAX_JOB_PRINTED_COUNTS:
                # Over the job's budget: the reporting rank's communicator gives up its oldest.
                over = len(comm._prints)
                self.printed -= over - comm.drop_prints(max(0, over - (self.printed - MAX_JOB_PRINTED_COUNTS)))
            names.add(entry.communicator)
        for gone in self._reported.get(rank, frozenset()) - names:
            self._drop(gone, rank)
        self._reported[rank] = self._share(frozenset(names))
        if said is None:
            self._said.pop(rank, None)
        else:
            self._said[rank] = self._share(said)
        return None

    def _drop(self, name: str, rank: int) -> None:
        comm = self.communicators.get(name)
        if comm is not None:
            comm.remove(rank)
            if not comm.ranks:
                del self.communicators[name]

    def remove(self, rank: int) -> None:
        """``rank`` left or failed: it is waited for no longer."""
        self._said.pop(rank, None)
        self.lag.remove(rank)
        for name in self._reported.pop(rank, frozenset()):
            self._drop(name, rank)

    def hang(self, now: float, bound_s: float, fresh_s: float) -> Hang | None:
        """A hang to name (a bound of 0: only mismatches); also recounts the fingerprints held
        (the job's budget), since the check forgets those that agree."""
        found = None
        for comm in self.communicators.values():
            found = comm.hang(now, bound_s, fresh_s)
            if found is not None:
                break
        self.printed = sum(len(c._prints) for c in self.communicators.values())
        return found

    def probing(self, rank: int) -> bool:
        """Whether the coordinator has a digest probe for ``rank`` not yet given to it."""
        return any(c.digests.waiting(rank) for c in self._comms_of(rank))

    def probing_any(self) -> bool:
        return any(c.digests.fresh() for c in self.communicators.values())

    def probes(self, rank: int) -> list[tuple[str, tuple[int, ...], bool]]:
        """The digest probes for ``rank`` (communicator, counts, with fingerprints), given now."""
        out = []
        for comm in self._comms_of(rank):
            got = comm.digests.probes(rank)
            if got is not None:
                out.append((comm.name, *got))
        return out

    def _comms_of(self, rank: int) -> list[CommunicatorProgress]:
        return [c for n in self._reported.get(rank, ()) if (c := self.communicators.get(n)) is not None]

    def longest_wait(self, now: float) -> float:
        return max((c.longest_wait(now) for c in self.communicators.values()), default=0.0)

    def late_lines(self, now: float, fresh_s: float, limit: int = 16) -> list[str]:
        """Who is late, per communicator with ranks behind, in words (for ``gridcomm status``)."""
        lines = []
        for comm in self.communicators.values():
            late = comm.late(now, fresh_s)
            if late is None:
                continue
            laggards, count, kind, waited, _ = late
            what = f"{kind} #{count}" if kind else f"collective #{count}"
            lines.append(f"{comm.name}: rank{'s' if len(laggards) > 1 else ''} {_ranks_text(laggards)} "
                         f"{'have' if len(laggards) > 1 else 'has'} not entered {what}, which others entered "
                         f"{waited:.0f} s ago")
            if len(lines) >= limit:
                break
        return lines
