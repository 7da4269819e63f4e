"""A relay's state, shared by its parts: what it serves (gridcomm._relay.server), what it sends
upstream (gridcomm._relay.upstream) and its heartbeats (gridcomm._relay.beats).

``Relay`` is one object on the process's background loop, built in layers that each add one
concern: ``RelayState`` (its fields) < ``Upstream`` < ``Beats`` < ``Relay``.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Hashable, Iterable
from typing import Any

import grpc

from gridcomm import _config
from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._relay.aggregate import Group, Route
from gridcomm._relay.children import Child
from gridcomm._relay.silence import Silence
from gridcomm._runtime.admission import Admission
from gridcomm._runtime.guard import GuardedServer


class RelayState:
    """The fields of a relay (see gridcomm._relay.server.Relay)."""

    def __init__(self, upstream: str, *, token: str | None = None, tls: _config.TlsFiles | None = None,
                 bind: str = "127.0.0.1", port: int = 0,
                 heartbeat_timeout_s: float = _config.DEFAULT_HEARTBEAT_TIMEOUT_S, ranks: Iterable[int] = (),
                 tls_name: str | None = None, world_size: int = 0) -> None:
        self.upstream = upstream
        #: The job's size (0: unknown; a child's bound grows with it), and the host name members
        #: verify where they dial it by another address than target (see gridcomm._relay.tls).
        self.world_size, self.tls_name = world_size, tls_name
        #: The ranks this relay serves, where its host knows them (a tree group): whom its first
        #: joins wait for.
        self._group = frozenset(ranks)
        #: Those of them whose first join it has sent up (a join of one of them again is a long
        #: poll repeated, which is not held).
        self._joins_sent: set[int] = set()
        self._token = token.encode() if token is not None else None
        self._metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self._tls = tls
        self.bind = bind
        self._requested_port = port
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.port = 0
        self._server: GuardedServer | None = None
        self._admission: Admission | None = None
        self._channel: grpc.aio.Channel | None = None
        self._up: Any = None  # the upstream Session call
        self._up_tasks: tuple[asyncio.Task[None], ...] = ()
        self._outbox: list[pb.SessionOp] = []
        self._has_work: asyncio.Event | None = None
        self._routes: dict[int, tuple[str, Route, Callable[[pb.SessionResult], None] | None]] = {}
        self._next_id = 0
        self._groups: dict[tuple[Any, ...], Group] = {}
        self._children: set[Child] = set()
        #: Set while no rank is connected (made when it starts; see Relay.stop_when_idle).
        self._idle: asyncio.Event | None = None
        #: rank -> (the stream it reaches this relay on, the generation its latest operation named):
        #: whom a barrier's arrivals wait for.
        self._ranks: dict[int, tuple[Child, int]] = {}
        #: The latest barriers sent up (their group keys), oldest first.
        self._went_up: collections.OrderedDict[tuple[Any, ...], None] = collections.OrderedDict()
        #: rank -> (its latest caller, when its last heartbeat arrived (loop time), and the
        #: background loop's lag then: lag after it is left out of the age the relay reports)
        self._beats: dict[int, tuple[pb.Caller, float, float]] = {}
        #: rank -> its last heartbeat's progress entries (their ages as of that heartbeat's arrival),
        #: and what they say (gridcomm._wire.progress_said; None: they go up in full every time).
        self._progress: dict[int, tuple[list[pb.Progress], Hashable | None]] = {}
        #: rank -> (generation, what its entries said) as this relay last reported them in a
        #: heartbeat the coordinator answered: while they say the same, they go up as a flag.
        self._progress_up: dict[int, tuple[int, Hashable]] = {}
        #: Progress entries sent up in full, and ranks whose progress went up as the same.
        self.progress_sent = 0
        #: rank -> the coordinator's digest probes for it, given with its next heartbeat's answer.
        self._probes_down: dict[int, list[pb.DigestProbe]] = {}
        self.progress_same = 0
        self._beat_waiters: set[asyncio.Future[None]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._latest = pb.HeartbeatResponse()
        self._beat_task: asyncio.Task[None] | None = None
        #: How long the coordinator has not answered (see gridcomm._relay.silence).
        self._silence: Silence | None = None
        self._stopped = False
        #: How many operations carried upstream were aggregates of several ranks.
        self.aggregated = 0
        #: Rank operations carried upstream, by kind (an aggregate counts each rank it names).
        self.ranks_carried: collections.Counter[str] = collections.Counter()
        #: Operations sent upstream, by kind (an aggregate counts once).
        self.sent: collections.Counter[str] = collections.Counter()

    @property
    def target(self) -> str:
        host = "127.0.0.1" if self.bind in ("0.0.0.0", "::", "") else self.bind
        return _config.format_target(host, self.port)
