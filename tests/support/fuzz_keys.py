"""Hypothesis strategies for key-value store keys and operations (tests/test_torch_store.py), and
the model they are judged by: a plain dict that does what torch's stores do."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

#: The coordinator's bound on a key (Limits.max_key_bytes), in UTF-8 bytes.
MAX_KEY_BYTES = 1024

_ALPHABET = st.characters(codec="utf-8")


def _fits(key: str) -> bool:
    return 0 < len(key.encode()) <= MAX_KEY_BYTES


#: Keys the store takes: any UTF-8 text of 1 to 1024 bytes (NULs, slashes, torch's prefixes, 4-byte characters).
keys = st.one_of(
    st.text(_ALPHABET, min_size=1, max_size=40),
    st.sampled_from(["default_pg/0//cpu//0", "store_based_barrier_key:1", "/", "\x00", "k" * MAX_KEY_BYTES,
                     "\U0001f600" * (MAX_KEY_BYTES // 4)]),
    st.text(_ALPHABET, min_size=200, max_size=MAX_KEY_BYTES),
).filter(_fits)

#: Keys the store refuses: empty, or longer than 1024 UTF-8 bytes.
too_long_keys = st.one_of(st.just(""), st.integers(MAX_KEY_BYTES + 1, 4 * MAX_KEY_BYTES).map(lambda n: "x" * n),
                          st.just("\u00e9" * (MAX_KEY_BYTES // 2 + 1)))

values = st.binary(max_size=64)

#: One store operation: (name, key, arguments).
operations = st.one_of(
    st.tuples(st.just("set"), keys, values),
    st.tuples(st.just("add"), keys, st.integers(-(1 << 40), 1 << 40)),
    st.tuples(st.just("compare_set"), keys, st.tuples(values, values)),
    st.tuples(st.just("delete_key"), keys, st.none()),
    st.tuples(st.just("check"), keys, st.none()),
)


class Model:
    """What a torch store holds after each operation, and what each answers."""

    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}

    def apply(self, name: str, key: str, arg: Any) -> Any:
        """The answer the store must give, or ``ValueError`` when it must refuse."""
        kv = self.kv
        if name == "set":
            kv[key] = arg
            return None
        if name == "add":
            old = kv.get(key, b"0")
            if len(old) > 20:  # longer than any int64 in decimal: refused unread
                return ValueError
            try:
                current = int(old.decode("ascii"))
            except (UnicodeDecodeError, ValueError):
                return ValueError
            kv[key] = str(current + arg).encode()
            return current + arg
        if name == "compare_set":
            expected, desired = arg
            if key not in kv:
                if expected:
                    return expected
                kv[key] = desired
                return desired
            if kv[key] != expected:
                return kv[key]
            kv[key] = desired
            return desired
        if name == "delete_key":
            return kv.pop(key, None) is not None
        if name == "check":
            return key in kv
        raise AssertionError(name)
