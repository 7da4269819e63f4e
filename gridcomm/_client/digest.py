"""A rank's running digest of the collectives it called in one communicator (``GRIDCOMM_DEBUG=collectives``).

Every counted call's fingerprint (``all_reduce(sum, 4 x float32)``) is folded into a 64-bit digest
that depends on every fingerprint before it and their order. A heartbeat carries the digest as of
the count it reports; the coordinator compares ranks' digests at a count they all passed, and where
they differ asks (a ``DigestProbe``) for the digests after earlier counts until it has the first
collective ranks called differently, whose fingerprints the last probe fetches. So a mismatch is
caught however fast the loop runs and however far the next heartbeat is from it.

What a rank keeps for that: the digest and the fingerprint of each of its last :data:`KEEP`
collectives, in two fixed arrays (about 12 bytes a collective; fingerprints are interned, a
distinct one is stored once). A mismatch older than that when the coordinator asks is still
caught, named as a range of collectives rather than one.

Why a 64-bit multiply-xor chain over a cached hash per distinct fingerprint: the main thread pays a
dict lookup and three integer operations per call; the hash (BLAKE2b) runs once per distinct
fingerprint. Two different sequences collide with a probability of about 2**-64 per comparison.
"""

from __future__ import annotations

import array
import hashlib

#: Collectives whose digest and fingerprint a rank keeps per communicator (a power of two).
KEEP = 1 << 17
#: Distinct fingerprints remembered per communicator; later new ones are kept as unnamed.
MAX_DISTINCT = 1 << 16
_PRIME = 0x100000001B3
_MASK = (1 << 64) - 1


def print_hash(fingerprint: str) -> int:
    """The 64-bit hash of one fingerprint (the same in every process)."""
    return int.from_bytes(hashlib.blake2b(fingerprint.encode(), digest_size=8).digest(), "little")


def fold(digest: int, fingerprint: str) -> int:
    """The digest after one more collective (what :meth:`DigestLog.add` computes)."""
    return ((digest ^ print_hash(fingerprint)) * _PRIME) & _MASK


class DigestLog:
    """The running digest of one communicator's collectives, with what the last :data:`KEEP` were.

    Not thread-safe: the tracker calls it under its lock."""

    __slots__ = ("digest", "_digests", "_prints", "_mask", "_keep", "_names", "_known")

    def __init__(self, keep: int = KEEP) -> None:
        if keep <= 0 or keep & (keep - 1):
            raise ValueError(f"keep must be a power of two, not {keep}")
        #: The digest after the last collective added (0: none yet).
        self.digest = 0
        self._keep = keep
        self._mask = keep - 1
        self._digests = array.array("Q", bytes(8 * keep))
        self._prints = array.array("I", bytes(4 * keep))
        #: id -> fingerprint (id 0: one not remembered), and fingerprint -> (id, hash).
        self._names: list[str] = ["?"]
        self._known: dict[str, tuple[int, int]] = {}

    def add(self, count: int, fingerprint: str) -> None:
        """Collective number ``count`` (1, 2, ...) was ``fingerprint``."""
        known = self._known.get(fingerprint)
        if known is None:
            known = self._learn(fingerprint)
        ident, hashed = known
        digest = ((self.digest ^ hashed) * _PRIME) & _MASK
        self.digest = digest
        slot = count & self._mask
        self._digests[slot] = digest
        self._prints[slot] = ident

    def _learn(self, fingerprint: str) -> tuple[int, int]:
        hashed = print_hash(fingerprint)
        if len(self._names) > MAX_DISTINCT:
            return 0, hashed
        known = (len(self._names), hashed)
        self._names.append(fingerprint)
        self._known[fingerprint] = known
        return known

    def kept(self, count: int, last: int) -> bool:
        """Whether collective ``count`` is still kept when ``last`` is the latest."""
        return 0 < count <= last and last - count < self._keep

    def fingerprint(self, count: int) -> str:
        """Collective ``count``'s fingerprint (check :meth:`kept` first)."""
        return self._names[self._prints[count & self._mask]]

    def recent(self, last: int, n: int) -> list[str]:
        """The fingerprints of the last ``n`` collectives up to ``last`` (oldest first)."""
        first = max(1, last - min(n, self._keep) + 1)
        return [self.fingerprint(c) for c in range(first, last + 1)]

    def answer(self, counts: list[int], prints: bool, last: int) -> tuple[list[int], list[int], list[str], list[int]]:
        """(counts, digests, fingerprints, lost): the digests after those of ``counts`` still kept
        (count 0: the initial digest, no fingerprint), fingerprints only when ``prints``, and the
        counts no longer kept (or never reached)."""
        out_counts: list[int] = []
        digests: list[int] = []
        names: list[str] = []
        lost: list[int] = []
        for count in counts:
            if count == 0:
                out_counts.append(0)
                digests.append(0)
                if prints:
                    names.append("")
            elif self.kept(count, last):
                out_counts.append(count)
                digests.append(self._digests[count & self._mask])
                if prints:
                    names.append(self.fingerprint(count))
            else:
                lost.append(count)
        return out_counts, digests, names, lost
