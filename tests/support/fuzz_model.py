"""The model the coordinator fuzz tests judge answers against: the case budget, hypothesis
strategies for requests, a model of one job (who joined, keys, barriers, failures) that says
which statuses each request may get, and the driver that sends steps and follows them up.

Job ids go up to ``_FUZZ_TEXT_MAX`` (20,000 characters). Some step-arounds written
while bugs were open remain as narrower judging, each saying which test it defers to: long
failure reasons stay ASCII; a barrier name a refused arrival named is judged no further
(``Job.dead_names``); :path values are UTF-8."""



from __future__ import annotations

import collections
import math
import os
import random
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._proto import coordinator_pb2_grpc as pb_grpc
from gridcomm._wire import WIRE
from tests.support.calls import (
    _FUZZ_TEXT_MAX,
    ABORTED,
    CALL_S,
    CHUNK_BYTES,
    DEADLINE,
    EXHAUSTED,
    EXISTS,
    FAILED_KEY,
    HEARTBEAT_HAS_WAIT,
    INVALID,
    MAX_HOSTNAME_BYTES,
    MAX_KEY_BYTES,
    MAX_NAME_BYTES,
    MAX_REQUEST_BYTES,
    MAX_VALUE_BYTES,
    MISSING_KEY,
    OK,
    PRECONDITION,
    Outcome,
    assert_proper,
    call_unary,
    describe,
    note,
)

# ------------------------------------------------------------------------------------ budget

#: Cases the default (CI) run makes; GRIDCOMM_FUZZ_EXAMPLES asks for more.
DEFAULT_CASES = 1000
CASES = max(DEFAULT_CASES, int(os.environ.get("GRIDCOMM_FUZZ_EXAMPLES", "0") or 0))
SCALE = CASES / DEFAULT_CASES

#: Share of the cases each fuzz test makes (they add up to more than 1, so the total is >= CASES).
_SHARES = {
    "shared": 0.40,
    "lifecycle": 0.30,
    "absurd_wait": 0.08,
    "bodies": 0.15,
    "raw": 0.25,
}
#: Cases each fuzz test ran (checked against its share, so a fuzzer that quietly stops early fails).
RAN: dict[str, int] = {}


def examples(name: str) -> int:
    return max(1, math.ceil(_SHARES[name] * CASES))


def time_limit(base_s: float) -> int:
    """A pytest-timeout bound that grows with the requested case count."""
    return int(base_s * SCALE) + 60


def ran(name: str) -> None:
    RAN[name] = RAN.get(name, 0) + 1


def assert_ran(name: str) -> None:
    assert RAN.get(name, 0) >= examples(name), f"{name}: ran {RAN.get(name, 0)} cases, expected >= {examples(name)}"
    print(f"fuzz {name}: {RAN[name]} cases")


def fuzz_settings(name: str) -> settings:
    # Why database=None: the suite must leave no files behind in the checkout; a failure prints
    # a blob that reproduces it (@reproduce_failure).
    return settings(
        max_examples=examples(name),
        deadline=None,
        database=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )


# ------------------------------------------------------------------------------------ strategies

_UTF8 = st.characters(codec="utf-8")  # no lone surrogates: they cannot be a protobuf string
_ODD = ["\x00", "a\x00b", "\u2603", "\u540d\u524d", "\U0001f600", "\r\n", " ", "\u202e", "\ufeff", "../..", "%s%n"]


def _repeat(chars: Sequence[str], low: int, high: int) -> st.SearchStrategy[str]:
    """Long strings without asking hypothesis for that many draws."""
    return st.builds(lambda c, n: (c * n)[:n], st.sampled_from(list(chars)), st.integers(low, high))


def texts(*, huge: bool, pool: Sequence[str] = ()) -> st.SearchStrategy[str]:
    """Empty, short random unicode, NUL and friends, around the 1 KiB limits, and (huge=True) up
    to 200 KB."""
    options = [
        st.just(""),
        st.text(_UTF8, max_size=24),
        st.sampled_from(_ODD),
        _repeat(["k", "\x00", "\u00e9", "\U0001f600"], 250, 260),
    ]
    if pool:
        options = [st.sampled_from(list(pool))] * 3 + options
    if huge:
        options += [
            _repeat(["k", "\x00", "\u00e9", "\U0001f600"], 1000, 1100),
            _repeat(["k", "\x00", "\u2603"], 1025, 200_000),
        ]
    return st.one_of(options)


def bounded_texts(pool: Sequence[str] = ()) -> st.SearchStrategy[str]:
    return texts(huge=False, pool=pool).map(lambda s: s[:_FUZZ_TEXT_MAX])


INT32 = st.one_of(
    st.integers(-2, 5),
    st.sampled_from([-(2**31), 2**31 - 1, -1, 1 << 20]),
    st.integers(-(2**31), 2**31 - 1),
)
UINT64 = st.one_of(st.integers(0, 3), st.sampled_from([2**63, 2**64 - 1, 2**32]), st.integers(0, 2**64 - 1))
UINT32 = st.one_of(st.integers(0, 4), st.sampled_from([2**31, 2**32 - 1]), st.integers(0, 2**32 - 1))
#: wait_s values that must be answered at once or within a few tens of ms.
WAITS = st.one_of(
    st.just(0.0),
    st.just(-0.0),
    st.just(math.nan),
    st.just(-math.inf),
    st.just(5e-324),
    st.floats(-1e308, 0.0),
    st.floats(0.0, 0.02),
)
#: wait_s values no server may honour literally.
ABSURD_WAITS = st.one_of(
    st.sampled_from([math.inf, 1e300, 1.7976931348623157e308, float(2**63), 1e18, 3.6e6, 1e9]),
    st.floats(1e6, 1e308),
)


def seeded_bytes(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


VALUES = st.one_of(
    st.binary(max_size=64),
    st.just(b""),
    st.builds(seeded_bytes, st.integers(64, 4096), st.integers(0, 2**32)),
    # Around the largest value one message carries (what a get then answers in pieces), and past
    # the largest message the coordinator reads (refused by the transport: RESOURCE_EXHAUSTED).
    st.builds(seeded_bytes, st.integers((1 << 20) - 64, (1 << 20) + 32768), st.integers(0, 2**32)),
    st.builds(seeded_bytes, st.integers(2 << 20, 3 << 20), st.integers(0, 2**32)),
)

JOB_IDS = bounded_texts(pool=["default", "default\x00", "Default", " default", "other-job"])
KEY_POOL = ["k", "nccl-unique-id", "\x00", "\u2603 key", "a/b/c"]
NAME_POOL = ["b", "barrier", "\x00", "\u2603", "world/c1"]


def _copy(message: Any, **changes: Any) -> Any:
    out = type(message)()
    out.CopyFrom(message)
    for name, value in changes.items():
        if isinstance(value, list):
            del getattr(out, name)[:]
            getattr(out, name).extend(value)
        else:
            setattr(out, name, value)
    return out


# ------------------------------------------------------------------------------------ the model


def _size_verdict(text: str, limit: int, *, allow_empty: bool = False) -> bool | None:
    """True: fits the limit however it is counted; False: refused however it is counted; None:
    it depends on counting characters or UTF-8 bytes (the server may do either)."""
    chars, size = len(text), len(text.encode())
    if size == 0:
        return allow_empty
    if size <= limit:
        return True
    return None if chars <= limit else False


@dataclass
class BarrierModel:
    members: tuple[int, ...]
    arrived: dict[int, int] = field(default_factory=dict)

    def missing(self, seq: int) -> list[int]:
        return [r for r in self.members if self.arrived.get(r, 0) < seq]


class Job:
    """What a correct coordinator knows after the requests it accepted; judges each answer.

    ``judge_<rpc>`` computes the statuses a correct server may answer from the state *before* the
    call, asserts the outcome is one of them (and that an OK carries the right content), then
    records what the server accepted. Where the contract leaves an order open (which of two
    defects is reported first) every defect's status is allowed.
    """

    def __init__(self, job_id: str, world_size: int) -> None:
        self.job_id = job_id
        self.world_size = world_size
        self.incarnations: dict[int, int] = {}
        self.last_seen: dict[int, float] = {}
        self.generation = 0
        self.left: set[int] = set()
        self.failed: list[int] = []
        self.kv: dict[str, bytes] = {}
        self.barriers: dict[str, BarrierModel] = {}
        #: Names a refused arrival may have polluted on a server with the refused-open bug
        #: (test_refused_barrier_arrival_leaves_no_trace); only generic checks apply to them.
        self.dead_names: set[str] = set()
        #: Replacements waiting for the next generation (rank -> incarnation): new processes for
        #: failed ranks. This driver's survivors never recover, so they wait, unless
        #: every rank is replaced (then the job restarts in place as the next generation).
        self.replacing: dict[int, int] = {}

    @property
    def serving_known(self) -> bool:
        """Whether the model can say what health must be (always: a new process for a live rank
        fails nobody, so health follows from the failures the model knows)."""
        return True

    # ---------------------------------------------------------------- identity
    @property
    def complete(self) -> bool:
        return self.generation > 0

    def valid_callers(self) -> list[pb.Caller]:
        return [pb.Caller(job_id=self.job_id, rank=r, incarnation=i, generation=self.generation)
                for r, i in sorted(self.incarnations.items()) if r not in self.left]

    def identity_codes(self, caller: pb.Caller) -> set[grpc.StatusCode]:
        """Every status the caller's identity alone earns (empty: a valid member)."""
        codes: set[grpc.StatusCode] = set()
        if caller.job_id != self.job_id:
            codes.add(INVALID)
        if not 0 <= caller.rank < self.world_size:
            codes.add(INVALID)
            return codes
        incarnation = self.incarnations.get(caller.rank)
        if incarnation is None:
            codes.add(PRECONDITION)
            return codes
        if incarnation != caller.incarnation or caller.generation != self.generation or caller.rank in self.left:
            codes.add(PRECONDITION)
        return codes

    def seen(self, caller: pb.Caller) -> None:
        if not self.identity_codes(caller):
            self.last_seen[caller.rank] = time.monotonic()

    def check_aborted(self, outcome: Outcome, what: str) -> None:
        if outcome.code is ABORTED and self.failed:
            assert outcome.trailing.get(FAILED_KEY) == str(self.failed[0]), (
                f"{what}: ABORTED should name failed rank {self.failed[0]} in {FAILED_KEY}: {outcome.trailing}")

    @staticmethod
    def expect(outcome: Outcome, allowed: set[grpc.StatusCode], what: str) -> None:
        assert outcome.code in allowed, (
            f"{what}: answered {outcome.code.name} ({outcome.details[:300]!r}); a correct coordinator answers "
            f"{sorted(c.name for c in allowed)}")

    # ---------------------------------------------------------------- RPCs
    def judge_Join(self, req: pb.JoinRequest, out: Outcome, what: str) -> None:
        definite = (req.job_id != self.job_id or req.world_size != self.world_size
                    or not 0 <= req.rank < self.world_size or req.incarnation == 0)
        host = _size_verdict(req.hostname, MAX_HOSTNAME_BYTES, allow_empty=True)
        if definite or host is False:
            self.expect(out, {INVALID}, what)
            return
        allowed = {INVALID} if host is None else set()
        rank = req.rank
        old = self.incarnations.get(rank)
        if self.complete and old is not None and old != req.incarnation:
            # A new process for a rank of the running job. For a failed rank (or one
            # that left, once some rank failed) it is the replacement and waits for the survivors'
            # recovery; for a live rank it waits (bounded) to be told that rank is alive, which
            # this driver's silent ranks never show, so it hears the wait answer; for a rank that
            # left of a job with no failure, it is refused. Nobody is failed by it.
            if rank in self.failed or (self.failed and rank in self.left):
                self.expect(out, allowed | {DEADLINE, OK}, what)
                if out.code in (DEADLINE, OK):
                    self.replacing[rank] = req.incarnation
                if out.code is OK:
                    # Every rank failed or left and each has a replacement now: a new generation.
                    assert len(self.replacing) == self.world_size, f"{what}: admitted with survivors waiting"
                    self.incarnations, self.replacing = dict(self.replacing), {}
                    self.generation += 1
                    self.failed, self.left, self.kv, self.barriers = [], set(), {}, {}
                    assert out.response.generation == self.generation, f"{what}: {out.response}"
            elif rank in self.left:
                self.expect(out, allowed | {PRECONDITION}, what)
            else:
                self.expect(out, allowed | {DEADLINE, EXISTS}, what)
                if out.code is DEADLINE:
                    assert out.trailing.get(MISSING_KEY) == str(rank), f"{what}: {out.trailing}"
            return
        if self.failed:
            self.expect(out, allowed | {ABORTED}, what)
            self.check_aborted(out, what)
            return
        if old is not None and old != req.incarnation:
            idle = time.monotonic() - self.last_seen.get(rank, 0.0)
            # The contract: a live holder keeps its rank; one silent for the stale bound (2 s) may be
            # replaced. Timing in between is left to the server.
            allowed |= {EXISTS} if idle < 1.5 else ({DEADLINE, OK} if idle > 3.0 else {EXISTS, DEADLINE, OK})
            self.expect(out, allowed, what)
            if out.code in (OK, DEADLINE):
                self.incarnations[rank] = req.incarnation
                self.left.discard(rank)
                self.last_seen[rank] = time.monotonic()
                self._check_join_answer(out, what)
            return
        would_complete = self.complete or (old is None and len(self.incarnations) + 1 == self.world_size)
        self.expect(out, allowed | ({OK} if would_complete else {DEADLINE}), what)
        if out.code in (OK, DEADLINE):
            self.incarnations[rank] = req.incarnation
            self.last_seen[rank] = time.monotonic()
            if len(self.incarnations) == self.world_size:
                self.generation = max(self.generation, 1)
            self._check_join_answer(out, what)

    def missing(self) -> list[int]:
        """Whom the forming generation waits for: the first rendezvous's missing ranks, or, while
        replacements wait, the survivors (none of which recovers here) and the unreplaced."""
        if not self.complete:
            return [r for r in range(self.world_size) if r not in self.incarnations]
        if not self.replacing:
            return []
        return [r for r in range(self.world_size)
                if (r not in self.failed and r not in self.left) or r not in self.replacing]

    def _check_members(self, members: Any, what: str) -> None:
        """Listed members are the model's, and no answer shows an incarnation (it proves a call
        comes from the rank's process): each process has a tag of its own, the same every time."""
        assert {m.rank for m in members} == set(self.incarnations), f"{what}: members {members}"
        tags = getattr(self, "_tags", None)
        if tags is None:
            tags = self._tags = {}
        for m in members:
            assert m.incarnation == 0, f"{what}: an answer shows rank {m.rank}'s incarnation"
            assert len(m.process_tag) == 8 and int(m.process_tag, 16) >= 0, f"{what}: tag {m.process_tag!r}"
            seen = tags.setdefault(self.incarnations[m.rank], m.process_tag)
            assert seen == m.process_tag, f"{what}: rank {m.rank}'s process changed tag {seen} -> {m.process_tag}"
        assert len(set(tags.values())) == len(tags), f"{what}: two processes share a tag: {tags}"

    def _check_join_answer(self, out: Outcome, what: str) -> None:
        if out.code is OK:
            assert out.response.generation == self.generation >= 1, f"{what}: generation {out.response.generation}"
            assert out.response.world_size == self.world_size, f"{what}: {out.response}"
            # Members may be left out of the answer (Status lists them); any listed must be right.
            if out.response.members:
                self._check_members(out.response.members, what)
        elif out.code is DEADLINE:
            missing = [r for r in range(self.world_size) if r not in self.incarnations]
            assert out.trailing.get(MISSING_KEY) == ",".join(map(str, missing)), f"{what}: {out.trailing}"

    def judge_Set(self, req: pb.SetRequest, out: Outcome, what: str) -> None:
        ident = self.identity_codes(req.caller)
        key = _size_verdict(req.key, MAX_KEY_BYTES)
        static = set() if key else {INVALID}
        if len(req.value) > MAX_VALUE_BYTES:
            static.add(EXHAUSTED)
        if ident:
            self.expect(out, ident | static, what)
            return
        self.seen(req.caller)
        failed = {ABORTED} if self.failed else set()
        if key is False or failed:
            self.expect(out, failed | static, what)
            self.check_aborted(out, what)
            return
        self.expect(out, static | {OK}, what)
        if out.code is OK:
            self.kv[req.key] = bytes(req.value)

    def judge_Get(self, req: pb.GetRequest, out: Outcome, what: str) -> None:
        ident = self.identity_codes(req.caller)
        key = _size_verdict(req.key, MAX_KEY_BYTES)
        static = set() if key else {INVALID}
        if ident:
            self.expect(out, ident | static, what)
            return
        self.seen(req.caller)
        present = req.key in self.kv
        if key is False:
            self.expect(out, static | ({ABORTED} if self.failed else set()), what)
            self.check_aborted(out, what)
            return
        if self.failed:
            # After a failure only waiting is refused; a key that is there may still be handed out.
            self.expect(out, static | {ABORTED} | ({OK} if present else set()), what)
            self.check_aborted(out, what)
        else:
            self.expect(out, static | ({OK} if present else {DEADLINE}), what)
        if out.code is OK:
            value = self.kv[req.key]
            # A value larger than a message comes as its first piece and its whole size.
            piece, total = (value[:CHUNK_BYTES], len(value)) if len(value) > CHUNK_BYTES else (value, 0)
            assert out.response.value == piece and out.response.total_bytes == total, (
                f"{what}: WRONG VALUE: {len(out.response.value)} bytes {out.response.value[:32]!r}... "
                f"(total {out.response.total_bytes}), set was {len(value)} bytes {value[:32]!r}...")

    def judge_Barrier(self, req: pb.BarrierRequest, out: Outcome, what: str) -> None:
        ident = self.identity_codes(req.caller)
        name = _size_verdict(req.name, MAX_NAME_BYTES)
        static = set() if name else {INVALID}
        if req.seq < 1:
            static.add(INVALID)
        if ident:
            self.expect(out, ident | static, what)
            return
        self.seen(req.caller)
        if name is False or req.seq < 1 or self.failed:
            # After a failure only waiting is refused; an instance already complete may be reported.
            model = self.barriers.get(req.name)
            done = (self.failed and model is not None and req.name not in self.dead_names and req.seq >= 1
                    and not model.missing(req.seq) and model.arrived.get(req.caller.rank, 0) >= req.seq)
            self.expect(out, static | ({ABORTED} if self.failed else set()) | ({OK} if done else set()), what)
            self.check_aborted(out, what)
            return
        if name is None or req.name in self.dead_names:
            # Only the generic checks (assert_proper) hold here.
            self.dead_names.add(req.name)
            return
        rank, seq, participants = req.caller.rank, req.seq, tuple(req.participants)
        barrier = self.barriers.get(req.name)
        refused = False
        if barrier is None:
            if participants:
                well_formed = (list(participants) == sorted(set(participants)) and participants[0] >= 0
                               and participants[-1] < self.world_size)
                if not well_formed:
                    refused = True
                elif rank not in participants:
                    # Refused; whether the refused arrival still opened the barrier is the bug
                    # pinned below, so the name is left out of further judging.
                    self.expect(out, {INVALID}, what)
                    self.dead_names.add(req.name)
                    return
            members = participants or tuple(range(self.world_size))
            candidate = BarrierModel(members)
        else:
            candidate = barrier
            # No participants means every rank: a name opened for some ranks refuses it too
            # (every member must name the same group).
            if (participants or tuple(range(self.world_size))) != barrier.members:
                refused = True
        if not refused and rank not in candidate.members:
            refused = True
        mine = candidate.arrived.get(rank, 0)
        if not refused and seq > mine + 1:
            refused = True
        if refused:
            self.expect(out, {INVALID}, what)
            return
        self.barriers[req.name] = candidate
        candidate.arrived[rank] = max(mine, seq)
        missing = candidate.missing(seq)
        if not missing:
            self.expect(out, {OK}, what)
            assert out.response.seq == seq, f"{what}: answered seq {out.response.seq}"
            return
        blockers = [r for r in missing if r in self.left]
        if blockers:
            self.expect(out, {ABORTED}, what)
            assert out.trailing.get(FAILED_KEY) == str(blockers[0]), f"{what}: {out.trailing}"
            return
        self.expect(out, {DEADLINE}, what)
        assert out.trailing.get(MISSING_KEY) == ",".join(map(str, missing)), (
            f"{what}: missing ranks {out.trailing.get(MISSING_KEY)!r}, expected {missing}")

    def judge_Heartbeat(self, req: pb.HeartbeatRequest, out: Outcome, what: str) -> None:
        ident = self.identity_codes(req.caller)
        if ident:
            self.expect(out, ident, what)
            return
        self.seen(req.caller)
        self.expect(out, {OK}, what)
        ranks = [f.rank for f in out.response.failures]
        assert ranks == self.failed, f"{what}: heartbeat reports failures {ranks}, expected {self.failed}"

    def judge_ReportFailure(self, req: pb.ReportFailureRequest, out: Outcome, what: str) -> None:
        ident = self.identity_codes(req.caller)
        if ident:
            self.expect(out, ident, what)
            return
        self.seen(req.caller)
        self.expect(out, {OK}, what)
        if req.caller.rank not in self.failed:
            self.failed.append(req.caller.rank)

    def judge_Leave(self, req: pb.LeaveRequest, out: Outcome, what: str) -> None:
        caller = req.caller
        if caller.rank in self.left and self.incarnations.get(caller.rank) == caller.incarnation:
            # Leaving twice is fine; a server may still insist on the rest of the identity.
            self.expect(out, {OK, INVALID, PRECONDITION}, what)
            return
        ident = self.identity_codes(caller)
        if ident:
            self.expect(out, ident, what)
            return
        self.expect(out, {OK}, what)
        if not self.complete and caller.rank not in self.failed:
            # Before the rendezvous completes, a joined rank that left is no member (it is
            # dropped; a new process may join in its place). A failed one stays failed.
            self.incarnations.pop(caller.rank, None)
            self.last_seen.pop(caller.rank, None)
            return
        if caller.rank not in self.failed:
            self.left.add(caller.rank)
            self.last_seen[caller.rank] = time.monotonic()

    def judge_Status(self, req: pb.StatusRequest, out: Outcome, what: str) -> None:
        self.expect(out, {OK}, what)
        s = out.response
        # Status shows the generation as people read it (the wire's - 1), absent before the first.
        shown = s.generation + 1 if s.HasField("generation") else 0
        assert (s.job_id, s.world_size, shown) == (self.job_id, self.world_size, self.generation), f"{what}: {s}"
        self._check_members(s.members, what)
        assert list(s.missing_ranks) == self.missing(), what
        assert [f.rank for f in s.failures] == self.failed, f"{what}: failures {s.failures}"
        if self.serving_known:
            assert s.serving == (not self.failed), f"{what}: serving={s.serving} with failures {self.failed}"
        states = {m.rank: m.state for m in s.members}
        for rank in self.failed:
            if rank in states:
                assert states[rank] == pb.MEMBER_STATE_FAILED, f"{what}: rank {rank} is {states[rank]}"
        for rank in self.left:
            assert states.get(rank) == pb.MEMBER_STATE_LEFT, f"{what}: rank {rank} is {states.get(rank)}"
        for entry in s.barriers:
            model = self.barriers.get(entry.name)
            if model is not None and entry.name not in self.dead_names:
                assert list(entry.missing_ranks) == model.missing(entry.seq), f"{what}: barrier {entry}"

    # ---------------------------------------------------------------- what the shared job must not see
    def destructive(self, rpc: str, request: Any) -> bool:
        """Requests that end a job by design (a failure, a departure, a restarted rank, or liveness
        tracking that a later silence would turn into a failure): kept off the long-lived job."""
        if rpc in ("Heartbeat", "ReportFailure", "Leave"):
            return not self.identity_codes(request.caller)
        if rpc == "Join":
            old = self.incarnations.get(request.rank)
            return old is not None and old != request.incarnation and request.job_id == self.job_id
        return False


# ------------------------------------------------------------------------------------ steps


# Why the draws below never depend on the model's state (how many keys, who joined): hypothesis
# replays choice sequences and insists that the same choices meet the same kinds of draws. State
# comes in only afterwards, when a drawn index is mapped onto what the job holds.


def _pick(draw: Any, items: Sequence[Any], fallback: st.SearchStrategy[Any]) -> Any:
    """Mostly one of ``items`` (by a drawn index), else a value from ``fallback``."""
    index = draw(st.sampled_from(range(8)))
    other = draw(fallback)
    return items[index % len(items)] if items and index < 6 else other


def _caller(draw: Any, job: Job, member_only: bool = False) -> pb.Caller:
    """A valid member (most often, or always with member_only), a member with one field changed,
    a stranger, or nobody."""
    kind = 0 if member_only else draw(st.sampled_from(range(8)))
    index = draw(st.sampled_from(range(8)))
    field_name = draw(st.sampled_from(["job_id", "rank", "incarnation", "generation"]))
    value = draw({"job_id": JOB_IDS, "rank": INT32, "incarnation": UINT64, "generation": UINT64}[field_name])
    near = pb.Caller(job_id=job.job_id, rank=draw(st.integers(-1, job.world_size)), generation=draw(st.integers(0, 2)),
                     incarnation=_pick(draw, sorted(job.incarnations.values()), UINT64))
    valid = job.valid_callers()
    if kind <= 4:
        if not valid:
            return near
        caller = valid[index % len(valid)]
        return _copy(caller, **{field_name: value}) if kind == 4 else caller
    if kind == 5:
        return near
    if kind == 6:
        return pb.Caller(job_id=draw(JOB_IDS), rank=draw(INT32), incarnation=draw(UINT64), generation=draw(UINT64))
    return pb.Caller()


RPCS = ["Join", "Set", "Get", "Barrier", "Heartbeat", "ReportFailure", "Leave", "Status"]
HUGE_KEYS = texts(huge=True, pool=KEY_POOL)
HUGE_NAMES = texts(huge=True, pool=NAME_POOL)
BARRIER_SEQS = st.sampled_from(["next"] * 5 + ["same", "skip", "any"]).flatmap(
    lambda how: UINT64 if how == "any" else st.just(how))


def participants_lists(world_size: int) -> st.SearchStrategy[Any]:
    """Mostly the whole world; else a subset, one as opened, or lists that are unsorted, repeat
    ranks, leave the range, or run to 100,000 entries."""
    return st.sampled_from(["all"] * 4 + ["as-opened", "subset", "near", "int32", "huge"]).flatmap(lambda how: {
        "all": st.just("all"),
        "as-opened": st.just("as-opened"),
        "subset": st.sets(st.integers(0, world_size - 1), min_size=1).map(sorted),
        "near": st.lists(st.integers(-1, world_size), max_size=6),
        "int32": st.lists(INT32, max_size=6),
        "huge": st.integers(1000, 100_000).map(lambda n: list(range(n))),
    }[how])


@st.composite
def steps(draw: Any, job: Job, *, member_only: bool = False, only: str | None = None) -> tuple[str, Any]:
    """One request of any RPC (or of ``only``), with the job's members, keys and barriers in reach."""
    # Why: the same choices make a different case once the job's state has moved on, but
    # hypothesis avoids replaying choices it has seen, which would starve the simple, valid
    # requests (seq "next", a member's caller) in favour of random ones. A drawn salt that
    # changes nothing keeps every shape available.
    draw(st.integers(0, 2**64 - 1))
    rpc = draw(st.sampled_from(RPCS)) if only is None else only
    ws = job.world_size
    if rpc == "Join":
        job_id = draw(st.one_of(st.just(job.job_id), st.just(job.job_id), JOB_IDS))
        rank = draw(st.one_of(st.integers(0, ws - 1), st.integers(0, ws - 1), INT32))
        world_size = draw(st.one_of(st.just(ws), st.just(ws), st.integers(-2, 8), INT32))
        how = draw(st.sampled_from(["known", "known", "new", "zero"]))
        fresh = draw(st.integers(1, 2**64 - 1))
        incarnation = {"known": job.incarnations.get(rank, fresh), "new": fresh, "zero": 0}[how]
        request: Any = pb.JoinRequest(job_id=job_id, rank=rank, world_size=world_size, incarnation=incarnation, wire=WIRE,
                                      hostname=draw(texts(huge=True, pool=["host-0", "localhost"])),
                                      wait_s=draw(WAITS))
    elif rpc == "Set":
        caller = _caller(draw, job, member_only)
        value = draw(VALUES)
        key = _pick(draw, sorted(job.kv), HUGE_KEYS)
        small_key = draw(st.sampled_from(KEY_POOL))
        if len(value) > 4096:
            key = small_key  # big values go to a few keys only, so a long-lived store stays small
        request = pb.SetRequest(caller=caller, key=key, value=value)
    elif rpc == "Get":
        request = pb.GetRequest(caller=_caller(draw, job, member_only), key=_pick(draw, sorted(job.kv), HUGE_KEYS),
                                wait_s=draw(WAITS))
    elif rpc == "Barrier":
        caller = _caller(draw, job, member_only)
        name = _pick(draw, sorted(job.barriers), HUGE_NAMES)
        if job.failed:
            # After a failure the server quotes the name before checking its length
            # (test_huge_barrier_name_after_a_failure_*), so names stay short then.
            name = name[:_FUZZ_TEXT_MAX]
        model = job.barriers.get(name)
        mine = model.arrived.get(caller.rank, 0) if model is not None else 0
        seq = draw(BARRIER_SEQS)
        seq = {"next": mine + 1, "same": max(mine, 1), "skip": mine + 2}.get(seq, seq)  # type: ignore[arg-type]
        participants = draw(participants_lists(ws))
        if participants == "all":
            participants = []
        elif participants == "as-opened":
            participants = list(model.members) if model is not None else []
        request = pb.BarrierRequest(caller=caller, name=name, seq=seq, wait_s=draw(WAITS), participants=participants)
    elif rpc == "Heartbeat":
        request = pb.HeartbeatRequest(caller=_caller(draw, job, member_only))
        if HEARTBEAT_HAS_WAIT:
            request.wait_s = draw(WAITS)
    elif rpc == "ReportFailure":
        # Long reasons stay ASCII: every later refusal quotes up to 2,048 characters of the reason,
        # which in other scripts overflows the metadata limit (test_long_non_ascii_failure_reason_*).
        caller = _caller(draw, job, member_only)
        reason = draw(texts(huge=True, pool=["boom"]))
        reason = reason if len(reason) <= _FUZZ_TEXT_MAX else reason.encode("ascii", "backslashreplace").decode()
        request = pb.ReportFailureRequest(caller=caller, reason=reason)
    elif rpc == "Leave":
        request = pb.LeaveRequest(caller=_caller(draw, job, member_only))
    else:
        request = pb.StatusRequest()
    return rpc, request


class Driver:
    """Sends steps to one coordinator and has the model judge every answer."""

    def __init__(self, channel: grpc.Channel, job: Job) -> None:
        self.channel = channel
        self.stub = pb_grpc.CoordinatorStub(channel)
        self.job = job
        #: How often each RPC got each status, follow-ups included.
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()

    def send(self, rpc: str, request: Any, timeout_s: float = CALL_S) -> Outcome:
        return call_unary(getattr(self.stub, rpc), request, timeout_s)

    def run(self, rpc: str, request: Any) -> Outcome:
        what = describe(rpc, request)
        note(what)
        outcome = self.send(rpc, request)
        note(f"  -> {outcome.code.name} {outcome.details[:200]!r} {outcome.trailing}")
        assert_proper(outcome, what)
        # No answer shows a process's incarnation (the proof that a call comes from that rank).
        shown = f"{outcome.details} {outcome.trailing} {outcome.response}".lower()
        for incarnation in self.job.incarnations.values():
            if incarnation >= 1 << 32:
                assert f"{incarnation:x}" not in shown and str(incarnation) not in shown, f"{what}: shows {incarnation:#x}"
        if request.ByteSize() > MAX_REQUEST_BYTES:
            # The transport refuses a message past its limit before any handler sees it.
            assert outcome.code is EXHAUSTED, f"{what}: {outcome.code} for a {request.ByteSize()}-byte message"
        else:
            getattr(self.job, f"judge_{rpc}")(request, outcome, what)
        self.counts[rpc, outcome.code.name] += 1
        return outcome

    def codes(self, rpc: str) -> set[str]:
        """The statuses ``rpc`` got so far."""
        return {code for name, code in self.counts if name == rpc}

    def follow_up(self, rpc: str, request: Any, outcome: Outcome) -> None:
        """Completes what a step began, so that accepted paths are fuzzed too, not only refusals:
        the missing members arrive at a barrier somebody waited at, a key that was set is read
        back by a member."""
        job = self.job
        callers = {c.rank: c for c in job.valid_callers()}
        if not callers:
            return
        if rpc == "Barrier" and outcome.code is DEADLINE and request.name in job.barriers \
                and request.name not in job.dead_names:
            model = job.barriers[request.name]
            behind = model.missing(request.seq)
            if all(r in callers and request.seq - model.arrived.get(r, 0) <= 4 for r in behind):
                for rank in behind:
                    for seq in range(model.arrived.get(rank, 0) + 1, request.seq + 1):
                        self.run("Barrier", pb.BarrierRequest(caller=callers[rank], name=request.name, seq=seq,
                                                              wait_s=0.0, participants=list(model.members)))
        elif rpc == "Set" and outcome.code is OK:
            self.run("Get", pb.GetRequest(caller=callers[max(callers)], key=request.key, wait_s=0.0))

    def join_all(self, ranks: Sequence[int], incarnations: Sequence[int]) -> None:
        """Joins ranks one by one (wait_s 0: every join but the completing one times out at once)."""
        for rank, incarnation in zip(ranks, incarnations, strict=True):
            self.run("Join", pb.JoinRequest(job_id=self.job.job_id, rank=rank, world_size=self.job.world_size,
                                            incarnation=incarnation, hostname=f"host-{rank}", wait_s=0.0, wire=WIRE))


def member_flow(channel: grpc.Channel, job: Job, tag: str) -> None:
    """Correct requests from every member of a job that is already joined: set/get, a barrier."""
    stub = pb_grpc.CoordinatorStub(channel)
    callers = job.valid_callers()
    value = f"{tag}-{time.monotonic()}".encode()
    assert call_unary(stub.Set, pb.SetRequest(caller=callers[0], key=f"{tag}-key", value=value)).code is OK
    for caller in callers:
        out = call_unary(stub.Get, pb.GetRequest(caller=caller, key=f"{tag}-key", wait_s=1.0))
        assert (out.code, out.response.value if out.response else None) == (OK, value), out
    name = f"{tag}-barrier-{time.monotonic()}"

    def arrive(caller: pb.Caller) -> grpc.StatusCode:
        return call_unary(stub.Barrier, pb.BarrierRequest(caller=caller, name=name, seq=1, wait_s=5.0)).code

    with ThreadPoolExecutor(len(callers)) as pool:
        assert list(pool.map(arrive, callers, timeout=30)) == [OK] * len(callers)
