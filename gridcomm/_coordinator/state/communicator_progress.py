"""One communicator's progress: the ranks that report it, what each entered, and the hangs and
mismatches named from them (the rules are in :mod:`gridcomm._coordinator.state.progress`'s
docstring). Pure: the caller passes ``now`` (monotonic seconds) into every method.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

from gridcomm._coordinator.state.digests import CommunicatorDigests
from gridcomm._coordinator.state.entries import (
    MAX_BURST,
    MAX_PRINTED_COUNTS,
    MAX_RATE,
    MISMATCH,
    STALL,
    Entry,
    Hang,
    _ranks_text,
    digest_reason,
)


@dataclasses.dataclass(slots=True)
class _Rank:
    entered: int
    kind: str
    entered_at: float
    inside: bool
    reported_at: float


class CommunicatorProgress:
    """The ranks of one communicator (those that report it) and what they entered."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.ranks: dict[int, _Rank] = {}
        #: count -> ranks now at it (a histogram: min and max without a scan of the ranks).
        self._at: dict[int, set[int]] = {}
        #: count -> (the earliest time any rank reported entering it, the kind it reported).
        self._first: dict[int, tuple[float, str]] = {}
        #: count -> the latest time a rank reported entering it (when every rank is at it: since
        #: when they all wait).
        self._last: dict[int, float] = {}
        #: Ranks whose call is still in their last one.
        self._inside: set[int] = set()
        #: count -> {fingerprint: ranks} for counts some rank fingerprinted (debug mode).
        self._prints: dict[int, dict[str, set[int]]] = {}
        #: NCCL ranks whose sampled GPU point was pending at their last report: rank -> (since
        #: when it waits, the count known complete). Healthy GPUs finish a sample within a
        #: heartbeat, so this holds few ranks and a check never scans them all.
        self._gpu_waiting: dict[int, tuple[float, int]] = {}
        #: Debug mode: the digests ranks report, compared (see state.digests).
        self.digests = CommunicatorDigests(name)

    def implausible(self, rank: int, entry: Entry, now: float, floor: float = -math.inf) -> str | None:
        """Why ``rank``'s ``entry`` cannot be true, in words (None: it can): its count advanced
        faster than :data:`MAX_RATE` since its previous report (or since ``floor``, when the
        generation formed, for its first)."""
        old = self.ranks.get(rank)
        since, before = (floor, 0) if old is None else (old.reported_at, old.entered)
        allowed = MAX_BURST + MAX_RATE * max(0.0, now - since)
        if entry.entered - before > allowed:
            return (f"communicator {self.name!r}: {entry.entered} collectives entered, {entry.entered - before} since "
                    f"the rank's previous report {max(0.0, now - since):.1f} s ago (at most {MAX_BURST:,} + "
                    f"{MAX_RATE:,.0f} per second)")
        return None

    def report(self, rank: int, entry: Entry, now: float, floor: float = -math.inf) -> None:
        """``rank``'s entry as of ``now``. Its entry time is ``now`` less its reported age, but never
        earlier than what the coordinator knows bounds it: ``floor`` (the generation formed, or the
        rank joined), its previous report when the count advanced since (it was not in this one
        then), and the first estimate when the count is the same. So a forged age moves no entry
        before a time the coordinator saw."""
        at = max(now - entry.age_s, floor)
        old = self.ranks.get(rank)
        before = -1 if old is None else old.entered
        if old is None:
            self.ranks[rank] = _Rank(entry.entered, entry.kind, at, entry.inside, now)
        else:
            if entry.entered < old.entered:
                return  # a report older than one already read (a relay's, overtaken): ignored
            self._at[old.entered].discard(rank)
            if not self._at[old.entered]:
                del self._at[old.entered]
            if entry.entered == old.entered:
                at = old.entered_at  # the same entry: the first estimate of when stands
            else:
                at = max(at, old.reported_at)
            old.entered, old.kind, old.entered_at, old.inside, old.reported_at = (entry.entered, entry.kind, at,
                                                                                    entry.inside, now)
        self._at.setdefault(entry.entered, set()).add(rank)
        first = self._first.get(entry.entered)
        if first is None or at < first[0]:
            self._first[entry.entered] = (at, entry.kind or (first[1] if first is not None else ""))
        if at > self._last.get(entry.entered, -math.inf):
            self._last[entry.entered] = at
        if entry.inside:
            self._inside.add(rank)
        else:
            self._inside.discard(rank)
        if entry.gpu_wait_s > 0:
            self._gpu_waiting[rank] = (now - entry.gpu_wait_s, entry.completed)
        else:
            self._gpu_waiting.pop(rank, None)
        ceiling = min(self._at) + MAX_PRINTED_COUNTS
        for offset, fingerprint in enumerate(entry.recent):
            count = entry.entered - len(entry.recent) + 1 + offset
            # Each count once per rank (the window repeats what was sent before), and none too far
            # ahead of the slowest rank (a rank far ahead cannot make the others' wait grow this).
            if before < count <= ceiling:
                self._prints.setdefault(count, {}).setdefault(fingerprint, set()).add(rank)
        if entry.digest or entry.answers is not None:
            self.digests.report(rank, entry.entered, entry.digest, entry.answers)
        self._prune()

    def remove(self, rank: int) -> None:
        old = self.ranks.pop(rank, None)
        if old is None:
            return
        self._at[old.entered].discard(rank)
        if not self._at[old.entered]:
            del self._at[old.entered]
        self._inside.discard(rank)
        self._gpu_waiting.pop(rank, None)
        self.digests.remove(rank)
        self._prune()

    def _gpu_stuck(self, ranks: Iterable[int], now: float, bound_s: float, fresh_s: float) -> list[tuple[int, float, int]]:
        """(rank, seconds, count complete) of those of ``ranks`` whose GPU sample has waited past the bound."""
        out = []
        for r in ranks:
            waiting = self._gpu_waiting.get(r)
            if waiting is not None and now - waiting[0] > bound_s and now - self.ranks[r].reported_at <= fresh_s:
                out.append((r, now - waiting[0], waiting[1]))
        return sorted(out)

    def _prune(self) -> None:
        """Forgets counts below every rank's (nothing more can be learned about them)."""
        if not self._at:
            self._first.clear()
            self._last.clear()
            self._prints.clear()
            return
        low = min(self._at)
        for table in (self._first, self._last):
            if len(table) > len(self._at) + 8 or (table and min(table) < low):
                for count in [c for c in table if c < low]:
                    del table[count]
        # Fingerprints stay until the check has compared them (it forgets the counts that agree),
        # within a cap: a count that can never be compared is dropped, oldest first.
        self.drop_prints(MAX_PRINTED_COUNTS)

    def drop_prints(self, keep: int) -> int:
        """Drops the oldest fingerprinted counts beyond ``keep``; returns how many are held."""
        if len(self._prints) > keep:
            for count in sorted(self._prints)[:len(self._prints) - keep]:
                del self._prints[count]
        return len(self._prints)

    def _first_at_or_above(self, count: int) -> tuple[float, str] | None:
        """The earliest known entry of collective ``count`` (a rank now past it entered it no later
        than it entered the one it is at, so that time bounds it from above)."""
        best: tuple[float, str] | None = None
        for c, (at, kind) in self._first.items():
            if c >= count and (best is None or at < best[0]):
                best = (at, kind if c == count else "")
        return best

    def longest_wait(self, now: float) -> float:
        """How long the ranks furthest ahead have waited for the last rank to enter their collective."""
        if len(self._at) < 2:
            return 0.0
        first = self._first_at_or_above(min(self._at) + 1)
        return 0.0 if first is None else max(0.0, now - first[0])

    def late(self, now: float, fresh_s: float) -> tuple[list[int], int, str, float, str] | None:
        """The ranks behind (whose reports are fresh), the collective they have not entered, its
        kind, how long since the first rank entered it, and the laggards' last kind."""
        if len(self._at) < 2:
            return None
        low = min(self._at)
        first = self._first_at_or_above(low + 1)
        if first is None:
            return None
        laggards = sorted(r for r in self._at[low] if now - self.ranks[r].reported_at <= fresh_s)
        if not laggards:
            return None
        return laggards, low + 1, first[1], now - first[0], self.ranks[laggards[0]].kind

    def hang(self, now: float, bound_s: float, fresh_s: float) -> Hang | None:
        """A hang past ``bound_s``, if any (see the module's docstring); ``fresh_s``: a rank whose
        last report is older than this is left to the liveness bound (it is silent, not stuck)."""
        mismatch = self._mismatch() or self._digest_mismatch()
        if mismatch is not None or bound_s <= 0:
            return mismatch
        if not self._at:
            return None
        if len(self._at) > 1 and self.longest_wait(now) <= bound_s:
            return None  # ranks are behind, but not for the bound (no rank list is built)
        late = self.late(now, fresh_s)
        if late is not None:
            laggards, count, kind, waited, their_kind = late
            if waited <= bound_s:
                return None
            ahead = [r for c, ranks in self._at.items() if c >= count for r in ranks]
            # Why a majority: counts are each rank's own word. Ranks behind are named only when
            # those ahead are more than half (so one rank, forged or buggy, claiming to be ahead
            # cannot get the rest named); when those ahead are fewer, the furthest ahead is the odd
            # one out; an even split names a laggard only on its own word (its GPU has not
            # completed its work for the bound) or when those ahead wait in the very next
            # collective (the shape of an honest wait: two ranks, one stopped, must still be named);
            # one claiming to be further ahead names nobody (the call timeouts still bound the wait).
            if 2 * len(ahead) < len(self.ranks):
                return self._odd_one_ahead(now, bound_s, fresh_s)
            gpu = self._gpu_stuck(laggards[:1], now, bound_s, fresh_s)
            if 2 * len(ahead) == len(self.ranks) and not gpu and max(self._at) != count:
                return None
            what = f"{kind} #{count}" if kind else f"collective #{count}"
            last = (f"; its last was {their_kind} #{count - 1}" if count > 1 and their_kind else
                    "; it has entered none")
            others = f"; ranks {_ranks_text(laggards)} are behind with it" if len(laggards) > 1 else ""
            waits = (f"; its GPU has not completed collective #{gpu[0][2] + 1} for {gpu[0][1]:.0f} s (it waits for its "
                     "GPU: an NCCL, GPU or network hang)" if gpu else "")
            reason = (f"rank {laggards[0]} has not entered {what} of communicator {self.name!r} for {waited:.0f} s; "
                      f"ranks {_ranks_text(ahead)} wait in it{last}{others}{waits} (stall bound {bound_s:g} s, "
                      "GRIDCOMM_STALL_TIMEOUT_S)")
            return Hang(laggards[0], reason, STALL, self.name)
        if len(self._at) == 1 and self._gpu_waiting:
            (count,) = self._at
            gpu = self._gpu_stuck(list(self._gpu_waiting), now, bound_s, fresh_s)
            if gpu:
                rank, waited, done = gpu[0]
                kind = self.ranks[rank].kind or "collective"
                reason = (f"every rank of communicator {self.name!r} entered {kind} #{count}, and on ranks "
                          f"{_ranks_text([g[0] for g in gpu])} the GPU has not completed collective #{done + 1} for "
                          f"{waited:.0f} s (an NCCL, GPU or network hang; stall bound {bound_s:g} s, "
                          "GRIDCOMM_STALL_TIMEOUT_S)")
                return Hang(rank, reason, STALL, self.name)
        if len(self._at) == 1 and self._inside:
            (count,) = self._at
            since = self._last.get(count)
            if since is None or now - since <= bound_s:
                return None
            stuck = sorted(r for r in self._inside if now - self.ranks[r].reported_at <= fresh_s)
            if not stuck:
                return None
            kind = self.ranks[stuck[0]].kind or "collective"
            reason = (f"every rank of communicator {self.name!r} entered {kind} #{count} {now - since:.0f} s ago and "
                      f"it has not returned on ranks {_ranks_text(stuck)} (a network or data-plane hang; stall bound "
                      f"{bound_s:g} s, GRIDCOMM_STALL_TIMEOUT_S)")
            return Hang(stuck[0], reason, STALL, self.name)
        return None

    def _odd_one_ahead(self, now: float, bound_s: float, fresh_s: float) -> Hang | None:
        """The rank furthest ahead, when the ranks behind it are the majority and it has waited
        in its collective past the bound (dated from its own entry, which is never earlier than
        its previous report)."""
        top = max(self._at)
        first = self._first.get(top)
        odd = sorted(r for r in self._at[top] if now - self.ranks[r].reported_at <= fresh_s)
        if first is None or not odd or now - first[0] <= bound_s:
            return None
        behind = [r for c, ranks in self._at.items() if c < top for r in ranks]
        what = f"{first[1]} #{top}" if first[1] else f"collective #{top}"
        reason = (f"rank {odd[0]} has entered {what} of communicator {self.name!r}, which ranks {_ranks_text(behind)} "
                  f"(the majority) have not entered for {now - first[0]:.0f} s: it is the odd one out (it called "
                  f"collectives the others did not; stall bound {bound_s:g} s, GRIDCOMM_STALL_TIMEOUT_S)")
        return Hang(odd[0], reason, STALL, self.name)

    def _mismatch(self) -> Hang | None:
        """The first count at which every rank reported a fingerprint and they differ; the rank
        named is one of the smallest group (the odd one out)."""
        for count in sorted(self._prints):
            groups = self._prints[count]
            # Ranks that have not reached this count yet will fingerprint it; wait for them.
            pending = any(c < count for c in self._at)
            if pending:
                return None
            if len(groups) < 2:
                del self._prints[count]  # every rank that will report it agreed
                continue
            ordered = sorted(groups.items(), key=lambda item: (len(item[1]), -min(item[1])))
            odd_print, odd = ordered[0]
            main_print, main = ordered[-1]
            if len(odd) == len(main):
                # Why nobody: fingerprints are each rank's own word; with an even split naming
                # either would let one rank get another named. The stall check and the call
                # timeouts still end the wait.
                del self._prints[count]
                continue
            odd_rank, main_rank = min(odd), min(main)
            reason = (f"collective #{count} of communicator {self.name!r}: rank {odd_rank} called {odd_print}, "
                      f"rank {main_rank} called {main_print}"
                      + (f" (ranks {_ranks_text(sorted(odd))} as rank {odd_rank}, ranks {_ranks_text(sorted(main))} "
                         f"as rank {main_rank})" if len(odd) > 1 or len(main) > 1 else ""))
            return Hang(odd_rank, reason, MISMATCH, self.name)
        return None

    def _digest_mismatch(self) -> Hang | None:
        """The first collective whose digests differ (see state.digests), once found."""
        found = self.digests.check()
        return None if found is None else Hang(found.odd, digest_reason(self.name, found), MISMATCH, self.name)

    def rows(self, now: float) -> list[tuple[int, int, str, float, bool]]:
        """(rank, entered, kind, seconds since it entered, inside) per rank, by rank."""
        return [(r, p.entered, p.kind, max(0.0, now - p.entered_at), p.inside) for r, p in sorted(self.ranks.items())]
