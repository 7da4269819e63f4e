"""Digests: the first collective ranks called differently, however fast they call them.

With ``GRIDCOMM_DEBUG=collectives`` each rank folds the fingerprint of every collective of a
communicator into a running digest (gridcomm._client.digest) and reports it, as of its count,
with each heartbeat. Per communicator the coordinator runs rounds, one at a time:

- *compare*: at ``t``, the lowest count the ranks reported, it needs every rank's digest; a rank
  that reported a later count is asked for its digest after ``t`` (a ``DigestProbe``, delivered
  with its next heartbeat's answer and answered by the heartbeat after it). All equal: the ranks
  agree up to ``t``, and the next round starts from there.
- *narrow*: the digests differ, so one collective in (last agreed count, ``t``] differs first.
  One rank per group of equal digests is asked for its digests after up to :data:`PROBE_COUNTS`
  counts spread over that range; the first count whose digests differ narrows it, until it is
  short enough to ask for every count in it with its fingerprint, which names the collective and
  both calls.

A rank answers a count it no longer keeps as lost; a mismatch older than what ranks keep is then
named as a range. What is kept here is bounded: per rank its last report, and per round at most
:data:`PROBE_COUNTS` answers per group's rank. Pure: no clock, no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

#: Counts asked of a rank per narrowing probe (and the range asked in full, with fingerprints).
PROBE_COUNTS = 64
#: Groups of equal digests followed while narrowing (the largest first); more are left out.
MAX_GROUPS = 8
#: Counts a probe's answer may carry (what a report is refused beyond).
MAX_ANSWERS = 1024


@dataclasses.dataclass(frozen=True)
class Answers:
    """A rank's answers to probes, as one report carries them (checked by the caller)."""

    counts: tuple[int, ...] = ()
    digests: tuple[int, ...] = ()
    prints: tuple[str, ...] = ()
    lost: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Found:
    """The first differing collective (``first == last``) or a range that holds it, with the
    fingerprints of the rank named (``odd``) and of one rank of the largest group (``main``)."""

    first: int
    last: int
    odd: int
    main: int
    odd_print: str
    main_print: str
    groups: tuple[tuple[int, ...], ...]


@dataclasses.dataclass
class _Ask:
    counts: tuple[int, ...]
    prints: bool
    delivered: bool = False


class CommunicatorDigests:
    """One communicator's digest reports and the round in progress (see the module's docstring)."""

    def __init__(self, name: str) -> None:
        self.name = name
        #: rank -> (count, digest) of its last report.
        self._at: dict[int, tuple[int, int]] = {}
        #: The ranks that agreed, and up to which count.
        self._agreed = 0
        self._agreed_ranks: frozenset[int] = frozenset()
        #: The round: the count compared (None: no round), its ranks, and what they said.
        self._target: int | None = None
        self._members: frozenset[int] = frozenset()
        self._known: dict[int, dict[int, tuple[int, str]]] = {}
        self._lost: dict[int, set[int]] = {}
        self._asked: dict[int, _Ask] = {}
        #: Narrowing: the groups of equal digests at the target (largest first), their ranks
        #: asked, and the range (lo: agreed, hi: differs).
        self._groups: list[tuple[int, ...]] = []
        self._lo = 0
        self._hi = 0
        self.found: Found | None = None

    # ------------------------------------------------------------------ reports
    def report(self, rank: int, count: int, digest: int, answers: Answers | None) -> None:
        old = self._at.get(rank)
        if old is None or count >= old[0]:
            self._at[rank] = (count, digest)
        if answers is None:
            return
        ask = self._asked.get(rank)
        if ask is None:
            return
        wanted = set(ask.counts)
        known = self._known.setdefault(rank, {})
        prints = answers.prints if len(answers.prints) == len(answers.counts) else ()
        for i, (c, d) in enumerate(zip(answers.counts, answers.digests, strict=False)):
            if c in wanted:
                known[c] = (d, prints[i] if prints else known.get(c, (0, ""))[1])
        lost = self._lost.setdefault(rank, set())
        lost.update(c for c in answers.lost if c in wanted)
        if all(c in lost or (c in known and (known[c][1] or not ask.prints)) for c in ask.counts):
            del self._asked[rank]

    def remove(self, rank: int) -> None:
        self._at.pop(rank, None)
        self._agreed_ranks = self._agreed_ranks - {rank}
        if rank in self._members:
            self._end_round()

    # ------------------------------------------------------------------ probes
    def probes(self, rank: int, fresh_only: bool = False) -> tuple[tuple[int, ...], bool] | None:
        """What to ask ``rank`` now (marks it delivered); ``fresh_only``: only if never delivered."""
        ask = self._asked.get(rank)
        if ask is None or (fresh_only and ask.delivered):
            return None
        ask.delivered = True
        return ask.counts, ask.prints

    def waiting(self, rank: int) -> bool:
        """Whether ``rank`` has a probe it was never given."""
        ask = self._asked.get(rank)
        return ask is not None and not ask.delivered

    def fresh(self) -> bool:
        return any(not a.delivered for a in self._asked.values())

    def _ask(self, rank: int, counts: Sequence[int], prints: bool) -> None:
        known = self._known.get(rank, {})
        lost = self._lost.get(rank, set())
        need = tuple(c for c in counts if c not in lost and (c not in known or (prints and not known[c][1])))
        if need:
            self._asked[rank] = _Ask(need, prints)

    # ------------------------------------------------------------------ rounds
    def _end_round(self) -> None:
        self._target = None
        self._members = frozenset()
        self._known.clear()
        self._lost.clear()
        self._asked.clear()
        self._groups = []

    def check(self) -> Found | None:
        """Moves the round on (called periodically); the first difference once found."""
        if self.found is not None:
            return self.found
        if self._target is None:
            self._start()
        elif self._asked:
            return None
        elif not self._groups:
            self._compared()
        else:
            self._narrowed()
        return self.found

    def _start(self) -> None:
        ranks = frozenset(self._at)
        if len(ranks) < 2:
            return
        target = min(c for c, _ in self._at.values())
        if target == 0 or (target <= self._agreed and ranks <= self._agreed_ranks):
            return
        self._target, self._members = target, ranks
        for rank in ranks:
            count, digest = self._at[rank]
            if count == target:
                self._known.setdefault(rank, {})[target] = (digest, "")
            else:
                self._ask(rank, (target,), False)

    def _digest(self, rank: int, count: int) -> int | None:
        got = self._known.get(rank, {}).get(count)
        return None if got is None else got[0]

    def _compared(self) -> None:
        target = self._target
        assert target is not None
        groups: dict[int, list[int]] = {}
        for rank in self._members:
            digest = self._digest(rank, target)
            if digest is None:  # lost (a rank far ahead): try again at a later count
                self._end_round()
                return
            groups.setdefault(digest, []).append(rank)
        if len(groups) == 1:
            self._agreed, self._agreed_ranks = target, self._members
            self._end_round()
            return
        ordered = sorted((tuple(sorted(g)) for g in groups.values()), key=lambda g: (-len(g), g[0]))
        self._groups = ordered[:MAX_GROUPS]
        self._lo = self._agreed if self._members <= self._agreed_ranks else 0
        self._hi = target
        self._probe_range()

    def _reps(self) -> list[int]:
        return [g[0] for g in self._groups]

    def _probe_range(self) -> None:
        lo, hi = self._lo, self._hi
        if hi - lo <= PROBE_COUNTS:
            counts: Sequence[int] = range(lo + 1, hi + 1)
            prints = True
        else:
            step = (hi - lo) / PROBE_COUNTS
            counts = sorted({lo + max(1, round(step * i)) for i in range(1, PROBE_COUNTS)} - {hi})
            prints = False
        for rank in self._reps():
            self._ask(rank, counts, prints)

    def _narrowed(self) -> None:
        reps = self._reps()
        lo, hi = self._lo, self._hi
        exact = hi - lo <= PROBE_COUNTS
        counts = range(lo + 1, hi + 1) if exact else sorted({c for r in reps for c in self._known.get(r, {})
                                                              if lo < c < hi})
        agreed = lo
        for c in counts:
            digests = [self._digest(r, c) for r in reps]
            if any(d is None for d in digests):  # lost on some rank: older than it keeps
                continue
            if len(set(digests)) == 1:
                agreed = c
                continue
            if exact and agreed == c - 1:
                self._name(c, c)
            elif agreed == lo and any(self._lost.get(r) for r in reps):
                self._name(lo + 1, c)  # the first differing count is among those lost
            else:
                self._lo, self._hi = agreed, c
                self._probe_range()
            return
        if exact or agreed == lo and any(self._lost.get(r) for r in reps):
            self._name(lo + 1, hi)
            return
        self._lo = agreed
        self._probe_range()

    def _name(self, first: int, last: int) -> None:
        main_group, odd_group = self._groups[0], self._groups[-1]
        main, odd = main_group[0], odd_group[0]

        def shown(rank: int) -> str:
            got = self._known.get(rank, {}).get(last)
            return got[1] if got is not None and got[1] else "?"

        self.found = Found(first, last, odd, main, shown(odd), shown(main), tuple(self._groups))
        self._end_round()


def check_answers(entered: int, counts: Sequence[int], digests: Sequence[int], prints: Sequence[str],
                  lost: Sequence[int], max_print: int) -> str | None:
    """What is wrong with a report's answers to probes, in words (None: nothing)."""
    if len(counts) + len(lost) > MAX_ANSWERS:
        return f"a progress entry answers {len(counts) + len(lost)} probed counts (at most {MAX_ANSWERS})"
    if len(digests) != len(counts) or (prints and len(prints) != len(counts)):
        return (f"a progress entry answers {len(counts)} probed counts with {len(digests)} digests and "
                f"{len(prints)} fingerprints")
    if any(c > entered for c in counts) or any(c > entered for c in lost):
        return f"a progress entry answers a probe for a count past the {entered} collectives it entered"
    if any(len(p) > max_print for p in prints):
        return f"a progress entry's fingerprint is longer than {max_print} characters"
    return None


def answers_of(counts: Iterable[int], digests: Iterable[int], prints: Iterable[str], lost: Iterable[int]) -> Answers | None:
    """The answers a report carries (None: it answers nothing)."""
    out = Answers(tuple(counts), tuple(digests), tuple(prints), tuple(lost))
    return out if out.counts or out.lost else None
