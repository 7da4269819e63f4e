"""What every backend is, and what a backend needs of the control plane, as Protocols.

A backend never imports the coordinator client: it is handed something that satisfies
:class:`ControlPlane` (the communicator passes its ``CoordinatorClient``), so the data plane stays
testable and loadable without gRPC.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol


@dataclasses.dataclass(frozen=True)
class Hooks:
    """What a backend calls back into its communicator, given when the backend is made (never
    assigned afterwards). ``on_invalid``: a collective was called with invalid arguments (the
    communicator reports this rank failed); ``on_broken``: the host data plane broke on its own;
    ``coordinator_rank``: the rank hosting the coordinator, so losing it is that rank's failure."""

    on_invalid: Callable[[Exception], None] | None = None
    on_broken: Callable[[BaseException], None] | None = None
    coordinator_rank: int | None = None


#: A backend made outside a communicator (tests, probes) calls nothing back.
NO_HOOKS = Hooks()


class ControlPlane(Protocol):
    """The part of the coordinator client a backend uses: a key-value store for addresses and
    unique IDs, a barrier, and the default deadline."""

    timeout_s: float

    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str, timeout_s: float | None = None) -> bytes: ...

    def barrier(self, name: str = "barrier", timeout_s: float | None = None, *,
                participants: Sequence[int] = ()) -> None: ...


class Backend(Protocol):
    """One rank's communicator in a backend, with cupyx's argument conventions (``stream`` is
    ignored by the host backend)."""

    kind: str
    rank: int
    world_size: int
    on_invalid: Callable[[Exception], None] | None

    def all_reduce(self, in_array: Any, out_array: Any, op: str = "sum", stream: Any = None) -> None: ...

    def reduce(self, in_array: Any, out_array: Any, root: int = 0, op: str = "sum", stream: Any = None) -> None: ...

    def broadcast(self, in_out_array: Any, root: int = 0, stream: Any = None) -> None: ...

    def reduce_scatter(self, in_array: Any, out_array: Any, count: int, op: str = "sum",
                       stream: Any = None) -> None: ...

    def all_gather(self, in_array: Any, out_array: Any, count: int, stream: Any = None) -> None: ...

    def send(self, array: Any, peer: int, stream: Any = None) -> None: ...

    def recv(self, out_array: Any, peer: int, stream: Any = None) -> None: ...

    def send_recv(self, in_array: Any, out_array: Any, peer: int, stream: Any = None) -> None: ...

    def scatter(self, in_array: Any, out_array: Any, root: int = 0, stream: Any = None) -> None: ...

    def gather(self, in_array: Any, out_array: Any, root: int = 0, stream: Any = None) -> None: ...

    def all_to_all(self, in_array: Any, out_array: Any, stream: Any = None) -> None: ...

    def exchange_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values``, in rank order (what ``split`` needs before it builds a child)."""
        ...

    def abort(self, error: Exception | None = None) -> None: ...

    def destroy(self) -> None: ...
