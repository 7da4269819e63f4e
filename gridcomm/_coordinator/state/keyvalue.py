"""The job's key-value store: values set whole or in pieces, bounded in keys and bytes."""

from __future__ import annotations

import dataclasses

from gridcomm._coordinator.state.common import INVALID_ARGUMENT, RESOURCE_EXHAUSTED, StateBase, StateError, quote


@dataclasses.dataclass
class _Pieces:
    """A value arriving in pieces: its announced size, the bytes so far, the last piece's offset."""

    total: int
    data: bytearray = dataclasses.field(default_factory=bytearray)
    last: int = -1


class KeyValue(StateBase):
    """Keys of the current generation (a recovery starts with an empty store)."""

    kv: dict[str, bytes]
    _kv_bytes: int
    _versions: dict[str, int]
    _sets: int
    _pieces: dict[tuple[int, str], _Pieces]
    _pieces_bytes: int

    def _check_key(self, key: str) -> None:
        size = len(key.encode())
        if size == 0 or size > self.limits.max_key_bytes:
            raise StateError(INVALID_ARGUMENT, f"key length {size} bytes must be between 1 and {self.limits.max_key_bytes}.")

    def set(self, key: str, value: bytes) -> None:
        self._check_key(key)
        self._check_value_size(key, len(value))
        old = self.kv.get(key)
        grow = len(value) - (len(old) if old is not None else 0)
        if old is None and len(self.kv) >= self.limits.max_keys:
            raise StateError(RESOURCE_EXHAUSTED, f"the store holds {len(self.kv)} keys, its limit; key {quote(key)} was not set.")
        self._check_room(key, grow)
        self.kv[key] = value
        self._kv_bytes += grow
        self._sets += 1
        self._versions[key] = self._sets

    def _check_value_size(self, key: str, size: int) -> None:
        if size > self.limits.max_value_bytes:
            raise StateError(
                RESOURCE_EXHAUSTED,
                f"value for key {quote(key)} is {size} bytes; the limit is {self.limits.max_value_bytes}.",
            )

    def _check_room(self, key: str, grow: int) -> None:
        if self._kv_bytes + self._pieces_bytes + grow > self.limits.max_total_value_bytes:
            raise StateError(
                RESOURCE_EXHAUSTED,
                f"the store would hold more than {self.limits.max_total_value_bytes} bytes; key {quote(key)} was not set.",
            )

    def set_piece(self, rank: int, key: str, offset: int, total: int, data: bytes) -> bool:
        """One piece of a value that travels in several (see SetRequest); returns True when it
        was the last and the key now holds the whole value."""
        self._check_key(key)
        self._check_value_size(key, total)
        pending = self._pieces.get((rank, key))
        if offset == 0:
            # Why a first piece restarts: the sender began again (its earlier attempt broke off).
            self._drop_piece(rank, key)
            self._check_room(key, total)
            pending = self._pieces[(rank, key)] = _Pieces(total)
            self._pieces_bytes += total
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
