"""Waits that speak: what a rank says while it waits for peers or for the coordinator.

A long wait (join, barrier, get) is made of slices (see ``CoordinatorClient._long_poll``); after
each slice the waiting rank knows who is still missing. Every slice is logged at INFO, and at a
modest rate (after :data:`FIRST_S`, then every :data:`EVERY_S`) at WARNING, so a plain script
with no logging configured still prints it on stderr (Python's last-resort handler shows
warnings), as JAX's and torch's rendezvous do: who it waits for, where, and for how long.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Sequence

from gridcomm._errors import RendezvousTimeout
from gridcomm._runtime import loop as _eventloop
from gridcomm._wire import without_repeat

log = logging.getLogger(__name__)

#: The first wait worth a warning, and how often a wait that goes on says so again (seconds).
FIRST_S = 10.0
EVERY_S = 30.0

def _refused(details: str, rank: int) -> bool:
    return f"rank {rank} (from " in details and "was refused" in details


def _hint(missing: Sequence[int], details: str) -> str:
    """What to check about the first missing rank: it was refused (the server said so), or is it running?"""
    if not missing:
        return ""
    first = missing[0]
    if _refused(details, first):
        return ""  # the server's own words (in details) say why
    return f"; is the process for rank {first} running?"


class Wait:
    """Speaks for one long wait: INFO after every slice, WARNING at a modest rate."""

    def __init__(self, what: str, target: str, total_s: float, started: float,
                 progress: Callable[[list[int]], str]) -> None:
        self._what = what
        self._target = target
        self._total = total_s
        self._started = started
        self._progress = progress
        self._speak_at = started + FIRST_S
        #: This process's background loop lag when the wait began (see _starved).
        self._lag_then = _eventloop.lag_s()

    def slice_ended(self, timeout: RendezvousTimeout, answered: bool) -> None:
        """A slice ended without completion; ``answered``: the coordinator has answered this wait."""
        now = time.monotonic()
        loud = now >= self._speak_at
        if loud:
            self._speak_at = now + EVERY_S
        level = logging.WARNING if loud else logging.INFO
        if not log.isEnabledFor(level):
            return
        elapsed = now - self._started
        missing = list(timeout.missing_ranks)
        if not answered:
            log.log(level, "%s: no answer from the coordinator at %s for %.0f s; is rank 0 (or `gridcomm serve`) "
                    "running there, and does the name resolve? (still trying; gives up after %.0f s)%s",
                    self._what, self._target, elapsed, self._total, self._starved(elapsed))
            return
        details = timeout.details
        refusal = ""
        if missing and _refused(details, missing[0]):
            start = details.find(f"rank {missing[0]} (from ")
            refusal = f"; {details[start:]}"
        log.log(level, "%s: %s (%.0f s so far, at the coordinator %s; gives up after %.0f s)%s%s",
                self._what, self._progress(missing), elapsed, self._target, self._total, refusal,
                _hint(missing, details))

    def _starved(self, elapsed: float) -> str:
        """What to add when this process, not the coordinator, is why no answer came: its
        background loop (which reads every answer) ran behind for a good part of the wait: with
        many ranks on few cores the coordinator may be up and idle while its ranks, short of CPU,
        report that it did not answer."""
        behind = _eventloop.lag_s() - self._lag_then
        if behind < max(1.0, elapsed / 4):
            return ""
        return (f"; this process's background loop, which reads the answers, ran {behind:.0f} s behind "
                "meanwhile: is this process short of CPU?")


def timed_out(what: str, total_s: float, timeout: RendezvousTimeout) -> RendezvousTimeout:
    """The error of a wait that reached its deadline: what, how long, the server's words, a hint."""
    details = without_repeat(what, timeout.details or str(timeout))
    instance = re.match(r"#\d+: ", details)  # "barrier 'x' #3 did not complete ...: 1 of 2 ranks ..."
    if instance:
        what, details = f"{what} {instance.group(0)[:-2]}", details[instance.end():]
    return RendezvousTimeout(f"{what} did not complete within {total_s:.1f} s: {details}"
                             f"{_hint(timeout.missing_ranks, details)}", timeout.missing_ranks)
