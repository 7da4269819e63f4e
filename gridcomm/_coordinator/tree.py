"""The relay tree as the coordinator's state: the directed join.

A rank of the tree that does not know its relay's address (no GRIDCOMM_RELAY_ADDRESSES: Slurm,
bare metal, a launcher of the user's own) first asks the coordinator where to join
(``JoinRequest.first_contact``). The answer comes at once, or, for a member whose leader has not
asked yet, when that leader asks (at most :data:`HOLD_S` later):

- "you lead" (``host_relay``): the rank hosts its group's relay, then joins the coordinator with
  the relay's address, as a leader with a template does. A rank that expects to lead (its own
  fan-in makes it a group's first rank) starts its relay before it asks and names it in the first
  contact (``relay_address``): when the coordinator agrees, the address is its group's at once, so
  its members are rarely told to come back;
- "your relay is at HOST:PORT" (``relay_address``): its leader's relay is registered; the rank
  joins through it, and the relay's one aggregate waits at the coordinator for the whole group;
- "come back in t" (``retry_after_s``): the relay does not listen yet; the rank asks again after
  about ``t`` (with jitter), holding no connection meanwhile;
- none of these: join the coordinator directly (a group of one, a leader that joined without a
  relay, or a job already formed: a replacement's join is its own).

Groups are ``fanin`` consecutive ranks from the coordinator's own setting (GRIDCOMM_RELAY_FANIN);
where that is auto, from the first first contact that names one (the ranks' GRIDCOMM_RELAY_FANIN,
as a standalone coordinator may be started without it), else from the world size by the rule the
ranks use. Once a first contact is answered the groups are fixed. A group's first rank leads it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import grpc

from gridcomm._coordinator.answers import Abort
from gridcomm._proto import coordinator_pb2 as pb

#: The shortest and the longest "come back in t". Why it grows with the ranks still undirected:
#: they ask again about every t, so the coordinator answers about undirected / t first contacts a
#: second; ASKS_PER_S bounds that while the relays come up.
RETRY_MIN_S = 0.1
RETRY_MAX_S = 2.0
ASKS_PER_S = 4000.0
#: A leader told to host a relay that has registered none this long after (or one that has not
#: asked this long after its group's first member did) is taken for gone: its members then join
#: the coordinator directly (slower at scale, never wrong). Why the coordinator decides, not each
#: member's own clock: members that gave up together at scale all dialled the coordinator at once.
LEAD_GRACE_S = 60.0
#: The longest a first contact whose leader has not named its relay yet is held at the coordinator
#: before "come back": answered the moment the leader asks (or joins). Why: asked again every
#: 0.1-2 s, each member of a late leader's group cost a call at both ends per ask; held, a member
#: usually asks once. A held ask is a waiting call on the connection the member keeps between asks.
HOLD_S = 2.0


def address_problem(address: str) -> str | None:
    """Why ``address`` is not a relay's HOST:PORT, or None."""
    if len(address) > 300 or ":" not in address or any(c.isspace() for c in address):
        return f"relay address {address[:80]!r} is not HOST:PORT."
    return None


class Tree:
    """Which group and leader each rank has, which leaders were told to lead (and when), and which
    ranks were sent to which relay."""

    def __init__(self, world_size: int, fanin: int, *, configured: bool = True) -> None:
        self.world_size = world_size
        self.fanin = max(2, fanin)
        #: Whether the groups are fixed (the coordinator's own setting, or a first contact answered).
        self._fixed = configured
        #: leader -> when it was told to host its group's relay.
        self._told_lead: dict[int, float] = {}
        #: leader -> when a member of its group first asked.
        self._first_ask: dict[int, float] = {}
        #: Per rank, 1 once it was sent to its leader's relay (the groups are fixed by then, so
        #: that leader is :meth:`leader`). Why a byte a rank, not a dict or a set: the tree is
        #: kept for every rank of the job, up to 100,000 and more.
        self._sent = bytearray(world_size)
        #: Per rank, 1 once it was told where to join (lead, relay or directly); how many are.
        self._settled = bytearray(world_size)
        self._settled_count = 0
        #: leader -> the address of the relay it named in its first contact.
        self._announced: dict[int, str] = {}
        #: The longest a first contact is held for its leader (HOLD_S).
        self.hold_s = HOLD_S
        #: leader -> set when it asks or joins: the held first contacts of its group look again.
        self._news: dict[int, asyncio.Event] = {}

    def leader(self, rank: int) -> int:
        return rank - rank % self.fanin

    def group(self, leader: int) -> range:
        return range(leader, min(leader + self.fanin, self.world_size))

    def retry_after_s(self) -> float:
        undirected = self.world_size - self._settled_count
        return min(RETRY_MAX_S, max(RETRY_MIN_S, undirected / ASKS_PER_S))

    def first_contact(self, request: pb.JoinRequest, *, job_id: str, formed: bool, relay_at: Callable[[int], str],
                      leader_joined: Callable[[int], bool], now: float) -> tuple[str, pb.JoinResponse]:
        """The answer to a first contact, and its kind (``lead``, ``relay``, ``retry``, ``direct``).
        ``relay_at(leader)``: the address a leader registered ('' if none); ``leader_joined(leader)``:
        whether its own join has arrived; ``formed``: the job's first generation formed."""
        rank = request.rank
        if request.job_id != job_id:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"first contact of rank {rank}: job id {request.job_id[:80]!r} does not match this "
                        f"coordinator's job {job_id!r}; set the same GRIDCOMM_JOB_ID on every rank.")
        if request.world_size != self.world_size:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"first contact of rank {rank}: it says the world size is {request.world_size}, but this "
                        f"coordinator was started for {self.world_size} ranks; launch every rank with the same "
                        "world size.")
        if not 0 <= rank < self.world_size:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"first contact of rank {rank}: the rank is outside 0..{self.world_size - 1}.")
        if not self._fixed:
            self._fixed = True
            if 2 <= request.fanin <= 4096:
                self.fanin = request.fanin
        leader = self.leader(rank)
        answer = pb.JoinResponse(world_size=self.world_size, leader=leader, fanin=self.fanin)
        if formed or leader + 1 >= self.world_size:
            return self._settle(rank, "direct", answer)
        if rank == leader:
            self._told_lead[leader] = now
            self.leader_news(leader)
            answer.host_relay = True
            if request.relay_address:
                problem = address_problem(request.relay_address)
                if problem is not None:
                    raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"first contact of rank {rank}: {problem}")
                self._announced[leader] = request.relay_address
            return self._settle(rank, "lead", answer)
        # Once the leader has joined, only the relay its join registered stands.
        address = relay_at(leader) or ("" if leader_joined(leader) else self.announced(leader))
        if address:
            self._sent[rank] = 1
            answer.relay_address = address
            return self._settle(rank, "relay", answer)
        waited_since = self._told_lead.get(leader, self._first_ask.setdefault(leader, now))
        if leader_joined(leader) or now - waited_since > LEAD_GRACE_S:
            return self._settle(rank, "direct", answer)  # its leader hosts no relay
        answer.retry_after_s = self.retry_after_s()
        return "retry", answer

    def leader_news(self, leader: int) -> None:
        """``leader`` asked or joined: the first contacts of its group held meanwhile look again."""
        event = self._news.pop(leader, None)
        if event is not None:
            event.set()

    async def hold(self, leader: int, timeout_s: float) -> None:
        """Waits, at most ``timeout_s``, for news of ``leader`` (see :meth:`leader_news`)."""
        if timeout_s <= 0:
            return
        event = self._news.setdefault(leader, asyncio.Event())
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(event.wait(), timeout_s)

    def announced(self, leader: int) -> str:
        """The relay address ``leader`` named in its first contact ('' if none). Why it stands
        before the leader's own join: its members join through the relay, whose one aggregate
        waits at the coordinator; a leader that dies first leaves them a relay that does not
        answer, and they join the coordinator directly after their relay grace."""
        return self._announced.get(leader, "")

    def _settle(self, rank: int, kind: str, answer: pb.JoinResponse) -> tuple[str, pb.JoinResponse]:
        if not self._settled[rank]:
            self._settled[rank] = 1
            self._settled_count += 1
        return kind, answer

    def aggregate_problem(self, ranks: list[int]) -> str | None:
        """Why a relay's aggregate of first joins must not be taken as one, or None. The ranks this
        coordinator sent to a relay must all have been sent to the same one: a relay speaks for its
        own group only."""
        sent, world = self._sent, self.world_size
        leaders = {self.leader(r) for r in ranks if 0 <= r < world and sent[r]}
        if len(leaders) > 1:
            return (f"it names ranks that were sent to the relays of ranks {sorted(leaders)[:8]}; a relay "
                    "speaks for its own group only")
        if leaders:
            (leader,) = leaders
            outside = [r for r in ranks if r not in self.group(leader)]
            if outside:
                return (f"rank(s) {outside[:8]} are outside the group of rank {leader}'s relay "
                        f"({leader}..{self.group(leader)[-1]})")
        return None
