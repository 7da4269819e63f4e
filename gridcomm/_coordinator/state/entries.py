"""A rank's progress report as the coordinator reads it (see :mod:`.progress`): the bounds on a
report and on what is kept of it, :class:`Entry` and :func:`check_entry`, and :class:`Hang`, a hang
named, with the words that name ranks and a mismatch the digests found. Every name is also
importable from :mod:`gridcomm._coordinator.state.progress`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from gridcomm._coordinator.state.digests import Answers, Found

#: Communicators tracked per generation; reports naming more are ignored (a hostile or buggy
#: client cannot grow the coordinator's memory with names).
MAX_COMMUNICATORS = 1024

#: Per report: communicators a rank may report at once, and the length of names and kinds.
MAX_ENTRIES = 64
MAX_NAME = 256
MAX_KIND = 64

#: Fingerprints a report may carry per communicator, and the length of one.
MAX_RECENT = 64
MAX_FINGERPRINT = 256

#: Counts whose fingerprints are kept for comparison at once: per communicator (only counts within
#: this many of the slowest rank's), and in the whole job. Over either, the oldest are dropped:
#: the fingerprints in reports only name a mismatch early, the digests (state.digests) catch
#: every one. Worst case (every fingerprint distinct and 256 characters): about 1 KB a count.
MAX_PRINTED_COUNTS = 256
MAX_JOB_PRINTED_COUNTS = 16384

#: How fast a rank's count may plausibly advance between two of its reports: collectives per
#: second, plus a burst. Far above what any backend launches (NCCL enqueues a small collective in
#: microseconds), far below a forged count such as 1e9 a second after the join.
MAX_RATE = 1_000_000.0
MAX_BURST = 100_000

#: A hang's cause (Hang.cause).
STALL = "stall"
MISMATCH = "mismatch"


@dataclasses.dataclass(frozen=True)
class Entry:
    """One rank's report for one communicator (already checked, see :func:`check_entry`)."""

    communicator: str
    entered: int
    kind: str
    age_s: float
    inside: bool
    recent: tuple[str, ...] = ()
    #: NCCL: collectives known complete on the GPU, and how long its pending sample has waited.
    completed: int = 0
    gpu_wait_s: float = 0.0
    #: Debug mode: the running digest after collective ``entered`` (0: none), and answers to probes.
    digest: int = 0
    answers: Answers | None = None
    #: Seconds the rank's calls spent inside counted collectives in all (state.lag).
    inside_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class Hang:
    """A hang the coordinator names: ``rank`` is failed with ``reason`` (``cause``: STALL or MISMATCH)."""

    rank: int
    reason: str
    cause: str
    communicator: str


def check_entry(communicator: str, entered: int, kind: str, age_s: float, recent: Sequence[str],
                gpu_wait_s: float = 0.0) -> str | None:
    """What is wrong with one reported entry, in words (None: nothing)."""
    if not math.isfinite(gpu_wait_s) or gpu_wait_s < 0:
        return f"a progress entry's GPU wait is {gpu_wait_s!r} s"
    if not communicator or len(communicator) > MAX_NAME:
        return f"a progress entry's communicator name has {len(communicator)} characters (1 to {MAX_NAME})"
    if len(kind) > MAX_KIND:
        return f"a progress entry's kind has {len(kind)} characters (at most {MAX_KIND})"
    if entered >= 2**62:
        return f"a progress entry counts {entered} collectives"
    if not math.isfinite(age_s) or age_s < 0:
        return f"a progress entry's age is {age_s!r} s"
    if len(recent) > MAX_RECENT or len(recent) > entered:
        return f"a progress entry carries {len(recent)} fingerprints for {entered} collectives (at most {MAX_RECENT})"
    if any(len(f) > MAX_FINGERPRINT for f in recent):
        return f"a progress entry's fingerprint is longer than {MAX_FINGERPRINT} characters"
    return None


def _ranks_text(ranks: Sequence[int], limit: int = 16) -> str:
    """``0-2, 4-7`` (ranges; cut after ``limit`` groups)."""
    groups: list[str] = []
    start = prev = None
    for r in sorted(ranks):
        if prev is not None and r == prev + 1:
            prev = r
            continue
        if start is not None:
            groups.append(f"{start}" if start == prev else f"{start}-{prev}")
        start = prev = r
    if start is not None:
        groups.append(f"{start}" if start == prev else f"{start}-{prev}")
    if len(groups) > limit:
        return ", ".join(groups[:limit]) + f", ... ({len(ranks)} ranks)"
    return ", ".join(groups)


def digest_reason(name: str, found: Found) -> str:
    """A mismatch found by digests, in the words of a fingerprinted one."""
    odd_group, main_group = found.groups[-1], found.groups[0]
    groups = (f" (ranks {_ranks_text(odd_group)} as rank {found.odd}, ranks {_ranks_text(main_group)} as rank "
              f"{found.main})" if len(odd_group) > 1 or len(main_group) > 1 else "")
    if found.first == found.last:
        return (f"collective #{found.first} of communicator {name!r}: rank {found.odd} called {found.odd_print}, "
                f"rank {found.main} called {found.main_print}{groups}")
    return (f"collectives #{found.first} to #{found.last} of communicator {name!r}: rank {found.odd} called one of "
            f"them differently from rank {found.main}{groups} (which one is older than the collectives ranks keep)")
