"""The job's key-value store: values set whole or in pieces, bounded in keys and in bytes.

What a key costs counts against the state's budget (:meth:`Limits.state_budget`, shared with the
barriers): its key's and value's objects as Python holds them and the entries that index them
(:data:`KEY_OVERHEAD`). A value arriving in pieces counts its announced size from its first piece
on. Counting is O(1) a set: sizes are read off the objects, never summed over the store.
"""

from __future__ import annotations

import dataclasses
import sys

from gridcomm._coordinator.state.common import INVALID_ARGUMENT, RESOURCE_EXHAUSTED, StateBase, StateError, quote

#: What a key costs beyond its key's string object and its value's bytes: the value's object
#: header, its entries in ``kv`` and ``_versions`` and its version number (a few hundred bytes
#: in CPython; a dict that grows holds twice its table for a moment, hence the margin).
KEY_OVERHEAD = 224
#: What a value arriving in pieces costs beyond its announced size and its key: its record, its
#: (rank, key) entry, and the bytearray's spare room as it grows (counted as an eighth more).
PIECE_OVERHEAD = 256


@dataclasses.dataclass
class _Pieces:
    """A value arriving in pieces: its announced size, the bytes so far, the last piece's offset,
    and what it is counted as (bytes against the budget, and its key's and value's own bytes)."""

    total: int
    cost: int
    raw: int
    data: bytearray = dataclasses.field(default_factory=bytearray)
    last: int = -1


class KeyValue(StateBase):
    """Keys of the current generation (a recovery starts with an empty store)."""

    kv: dict[str, bytes]
    _versions: dict[str, int]
    _sets: int
    _pieces: dict[tuple[int, str], _Pieces]
    #: The keys' and values' own bytes (UTF-8 keys, values; pieces as announced), for
    #: Limits.max_total_value_bytes.
    _raw_bytes: int
    #: The sizes values in pieces announced (their whole cost is in _pieces_cost).
    _pieces_bytes: int

    def _clear_keys(self) -> None:
        """An empty store (a new generation's)."""
        self.kv = {}
        self._kv_bytes = 0
        self._raw_bytes = 0
        #: Each key's version: the count of sets when it was last set (a reader of a value in
        #: pieces names it, so a value set again midway is not read torn).
        self._versions = {}
        #: Values arriving in pieces, by (rank, key): the announced size and what came so far.
        self._pieces = {}
        self._pieces_bytes = 0
        self._pieces_cost = 0

    def _check_key(self, key: str) -> int:
        """The key's size in UTF-8 bytes, once it is checked."""
        size = len(key) if key.isascii() else len(key.encode())
        if size == 0 or size > self.limits.max_key_bytes:
            raise StateError(INVALID_ARGUMENT, f"key length {size} bytes must be between 1 and {self.limits.max_key_bytes}.")
        return size

    def set(self, key: str, value: bytes) -> None:
        size = self._check_key(key)
        self._check_value_size(key, len(value))
        old = self.kv.get(key)
        if old is None:
            if len(self.kv) >= self.limits.max_keys:
                raise StateError(RESOURCE_EXHAUSTED, f"the store holds {len(self.kv)} keys, its limit; key {quote(key)} was not set.")
            # Why getsizeof: it is what the key's string holds (up to 4 bytes a character), O(1).
            grow, raw = sys.getsizeof(key) + len(value) + KEY_OVERHEAD, size + len(value)
        else:
            grow = raw = len(value) - len(old)
        self._check_room(key, grow, raw)
        self.kv[key] = value
        self._kv_bytes += grow
        self._raw_bytes += raw
        self._sets += 1
        self._versions[key] = self._sets

    def _check_value_size(self, key: str, size: int) -> None:
        if size > self.limits.max_value_bytes:
            raise StateError(
                RESOURCE_EXHAUSTED,
                f"value for key {quote(key)} is {size} bytes; the limit is {self.limits.max_value_bytes}.",
            )

    def _check_room(self, key: str, grow: int, raw: int) -> None:
        if grow <= 0:
            return
        limit = self.limits.max_total_value_bytes
        if limit is not None and self._raw_bytes + raw > limit:
            raise StateError(
                RESOURCE_EXHAUSTED,
                f"the store would hold more than {limit} bytes of keys and values; key {quote(key)} was not set.",
            )
        if self._state_bytes() + grow > self._budget():
            raise self._full_error(f"key {quote(key)}", grow)

    def set_piece(self, rank: int, key: str, offset: int, total: int, data: bytes) -> bool:
        """One piece of a value that travels in several (see SetRequest); returns True when it
        was the last and the key now holds the whole value."""
        size = self._check_key(key)
        self._check_value_size(key, total)
        pending = self._pieces.get((rank, key))
        if offset == 0:
            # Why a first piece restarts: the sender began again (its earlier attempt broke off).
            self._drop_piece(rank, key)
            cost, raw = total + total // 8 + sys.getsizeof(key) + PIECE_OVERHEAD, size + total
            self._check_room(key, cost, raw)
            pending = self._pieces[(rank, key)] = _Pieces(total, cost, raw)
            self._pieces_bytes += total
            self._pieces_cost += cost
            self._raw_bytes += raw
        elif pending is None or pending.total != total or offset != len(pending.data):
            if pending is not None and offset == pending.last and offset + len(data) == len(pending.data):
                return False  # the same piece again (a call repeated after a broken stream)
            got = "no earlier piece" if pending is None else f"{len(pending.data)} of {pending.total} bytes"
            self._drop_piece(rank, key)
            raise StateError(
                INVALID_ARGUMENT,
                f"a piece of key {quote(key)} at offset {offset} (of {total} bytes) does not follow what rank {rank} "
                f"sent before ({got}); send the value again from offset 0.",
            )
        if offset + len(data) > total:
            self._drop_piece(rank, key)
            raise StateError(INVALID_ARGUMENT, f"a piece of key {quote(key)} ends at {offset + len(data)}, past the "
                             f"announced {total} bytes.")
        pending.last = offset
        pending.data += data
        if len(pending.data) < total:
            return False
        self._drop_piece(rank, key)
        self.set(key, bytes(pending.data))
        return True

    def _drop_piece(self, rank: int, key: str) -> None:
        pending = self._pieces.pop((rank, key), None)
        if pending is not None:
            self._pieces_bytes -= pending.total
            self._pieces_cost -= pending.cost
            self._raw_bytes -= pending.raw

    def _drop_pieces(self, rank: int) -> None:
        """A rank that left or failed will not finish its values in pieces."""
        if not self._pieces:
            return
        for rank_key in [k for k in self._pieces if k[0] == rank]:
            self._drop_piece(*rank_key)

    def version(self, key: str) -> int:
        return self._versions.get(key, 0)

    def get(self, key: str) -> bytes | None:
        self._check_key(key)
        return self.kv.get(key)
