"""Calling the coordinator from tests and judging what comes back: gRPC calls that return an
Outcome (code, details, trailers) instead of raising, the checks every answer must pass, health,
and a real coordinator on loopback with a client flow that proves it still serves."""



from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import note as hypothesis_note

import gridcomm
from gridcomm._proto import coordinator_pb2 as pb
from gridcomm._wire import WIRE

# ------------------------------------------------------------------------------------ constants

SERVICE = "gridcomm.v1.Coordinator"
MISSING_KEY = "gridcomm-missing-ranks"
FAILED_KEY = "gridcomm-failed-rank"
#: Deadline of every fuzzed call: long enough for a few MB on a loaded CI box, short enough that
#: a hang is seen as the transport's DEADLINE_EXCEEDED ("Deadline Exceeded").
CALL_S = 8.0
#: Socket timeout of the raw-bytes exchanges.
RAW_TIMEOUT_S = 4.0
#: A status message travels percent-encoded in the grpc-message trailer (3 bytes for every byte
#: outside printable ASCII); trailers above gRPC's soft metadata limit (8 KiB) are dropped by
#: clients at random and above 16 KiB always, and the caller then sees "Stream removed" instead
#: of the server's reason. Leave room for the other trailers.
MAX_DETAILS_WIRE_BYTES = 8192 - 512
#: Longest job id the main fuzzers send (the server quotes them back shortened; see
#: test_huge_job_id_* and test_huge_take_key_*).
_FUZZ_TEXT_MAX = 20_000

OK = grpc.StatusCode.OK
INVALID = grpc.StatusCode.INVALID_ARGUMENT
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
ABORTED = grpc.StatusCode.ABORTED
EXISTS = grpc.StatusCode.ALREADY_EXISTS
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
DEADLINE = grpc.StatusCode.DEADLINE_EXCEEDED
NEVER = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}

# The coordinator's documented default limits (gridcomm._coordinator.state.Limits).
MAX_KEY_BYTES = 1024
MAX_NAME_BYTES = 1024
MAX_HOSTNAME_BYTES = 256
MAX_VALUE_BYTES = 64 * 1024 * 1024
#: The largest message the coordinator reads, and the size of a value's pieces.
MAX_REQUEST_BYTES = (1 << 20) + 64 * 1024
CHUNK_BYTES = 1 << 20

HEARTBEAT_HAS_WAIT = "wait_s" in pb.HeartbeatRequest.DESCRIPTOR.fields_by_name


# ------------------------------------------------------------------------------------ calls


@dataclass
class Outcome:
    code: grpc.StatusCode
    details: str
    trailing: dict[str, str]
    response: Any
    elapsed_s: float


def _metadata(pairs: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in pairs or ():
        out[key] = value if isinstance(value, str) else bytes(value).decode("latin-1")
    return out


def _outcome_of(exc: grpc.RpcError, started: float) -> Outcome:
    return Outcome(exc.code(), exc.details() or "", _metadata(exc.trailing_metadata()), None,  # type: ignore[attr-defined]
                   time.monotonic() - started)


def call_unary(method: Any, request: Any, timeout_s: float = CALL_S) -> Outcome:
    started = time.monotonic()
    try:
        response, call = method.with_call(request, timeout=timeout_s)
    except grpc.RpcError as exc:
        return _outcome_of(exc, started)
    return Outcome(OK, "", _metadata(call.trailing_metadata()), response, time.monotonic() - started)


def wire_size(details: str) -> int:
    """Bytes of the percent-encoded grpc-message trailer that carries ``details``."""
    return sum(1 if 0x20 <= b < 0x7F and b != 0x25 else 3 for b in details.encode("utf-8", "surrogatepass"))


def readable(details: str) -> bool:
    """A status message a person can act on: words, within what gRPC clients accept."""
    return bool(details.strip()) and wire_size(details) <= MAX_DETAILS_WIRE_BYTES


def assert_proper(outcome: Outcome, what: str, *, transport_deadline_ok: bool = False) -> None:
    """OK, or a status the server chose, with a readable message; never UNKNOWN/INTERNAL, never
    a hang (the transport's own DEADLINE_EXCEEDED), never a status the client made up because the
    server's answer did not fit ("Stream removed")."""
    code, details = outcome.code, outcome.details
    assert code not in NEVER, f"{what}: the server failed on an unexpected error: {code.name}: {details[:500]!r}"
    if code is OK:
        return
    assert not details.startswith("Stream removed"), (
        f"{what}: the server's answer was dropped by the client ({code.name}: {details[:300]!r}); its status "
        "message is probably larger than gRPC's metadata limit"
    )
    if code is DEADLINE and details == "Deadline Exceeded" and not transport_deadline_ok:
        raise AssertionError(f"{what}: no answer within the {CALL_S} s call deadline (a hang)")
    assert readable(details), (f"{what}: {code.name} with an unreadable message: {details[:300]!r} "
                               f"({len(details)} chars, {wire_size(details)} bytes on the wire)")


def health(channel: grpc.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=CALL_S).status


def assert_serving(channel: grpc.Channel, serving: bool = True, what: str = "") -> None:
    """``""`` (the coordinator's liveness: it answers) is SERVING whatever happened to the job;
    ``SERVICE`` (its readiness) is SERVING iff ``serving`` (no rank failed)."""
    for service, up in (("", True), (SERVICE, serving)):
        want = health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
        got = health(channel, service)
        assert got == want, (
            f"{what}: health of {service or '(all)'!r} is "
            f"{health_pb2.HealthCheckResponse.ServingStatus.Name(got)}, expected "
            f"{health_pb2.HealthCheckResponse.ServingStatus.Name(want)}"
        )


def note(text: str) -> None:
    """hypothesis.note inside an example; nothing in fixtures and plain tests."""
    with contextlib.suppress(Exception):
        hypothesis_note(text)


def _short(value: Any, limit: int = 400) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def render(message: Any) -> str:
    """A message on one line, long strings, bytes and lists cut short (text format would print
    every byte of a 3 MB value)."""
    parts = []
    for fd, value in message.ListFields():
        if hasattr(value, "ListFields"):
            text = "{" + render(value) + "}"
        elif isinstance(value, (str, bytes)):
            text = repr(value[:48]) + (f"... ({len(value)} {'chars' if isinstance(value, str) else 'bytes'})"
                                       if len(value) > 48 else "")
        elif hasattr(value, "__len__"):
            text = f"{list(value)[:8]}" + (f"... ({len(value)} in all)" if len(value) > 8 else "")
        else:
            text = repr(value)
        parts.append(f"{fd.name}={text}")
    return " ".join(parts)


def describe(rpc: str, request: Any) -> str:
    return f"{rpc}({render(request)})"


# ------------------------------------------------------------------------------------ coordinators


def start_coordinator(world_size: int, **kwargs: Any) -> gridcomm.Coordinator:
    kwargs.setdefault("bind", "127.0.0.1")
    kwargs.setdefault("port", 0)
    return gridcomm.Coordinator(world_size, **kwargs).start()


@contextlib.contextmanager
def coordinator(world_size: int, **kwargs: Any) -> Iterator[tuple[gridcomm.Coordinator, grpc.Channel]]:
    server = start_coordinator(world_size, **kwargs)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        yield server, channel
    finally:
        channel.close()
        server.stop()


def client_flow(port: int, world_size: int, tag: str) -> None:
    """The documented client flow, one thread per rank: join, set/get, barrier, leave."""

    def rank_main(rank: int) -> bytes:
        client = gridcomm.CoordinatorClient("127.0.0.1", port, rank, world_size, timeout_s=20.0)
        try:
            client.join()
            if rank == 0:
                client.set(f"{tag}-key", f"{tag}-value".encode())
            got = client.get(f"{tag}-key")
            client.barrier(f"{tag}-barrier")
            client.barrier(f"{tag}-barrier")
            client.leave()
            return got
        finally:
            client.close()

    with ThreadPoolExecutor(world_size) as pool:
        results = list(pool.map(rank_main, range(world_size), timeout=60))
    assert results == [f"{tag}-value".encode()] * world_size


# ------------------------------------------------------------------------------------ request bodies


METHODS = {
    "Join": "unary", "Set": "unary", "Get": "unary", "Barrier": "unary", "Heartbeat": "unary",
    "ReportFailure": "unary", "Leave": "unary", "Status": "unary",
}
REQUEST_TYPES = {
    "Join": pb.JoinRequest, "Set": pb.SetRequest, "Get": pb.GetRequest, "Barrier": pb.BarrierRequest,
    "Heartbeat": pb.HeartbeatRequest, "ReportFailure": pb.ReportFailureRequest, "Leave": pb.LeaveRequest,
    "Status": pb.StatusRequest,
}


def raw_call(channel: grpc.Channel, method: str, bodies: Sequence[bytes], timeout_s: float = CALL_S) -> Outcome:
    """Calls ``method`` with bytes as the request body (no serialisation on this side)."""
    path = f"/{SERVICE}/{method}"
    started = time.monotonic()
    try:
        response, call = channel.unary_unary(path).with_call(bodies[0], timeout=timeout_s)
    except grpc.RpcError as exc:
        return _outcome_of(exc, started)
    return Outcome(OK, "", _metadata(call.trailing_metadata()), response, time.monotonic() - started)


def decodes(method: str, body: bytes) -> bool:
    try:
        REQUEST_TYPES[method].FromString(body)
    except Exception:  # noqa: BLE001 - any parse error means "not this message"
        return False
    return True


def _mangle(body: bytes, seed: int, how: str) -> bytes:
    rnd = random.Random(seed)
    if not body or how == "append":
        return body + rnd.randbytes(rnd.randint(1, 8))
    i = rnd.randrange(len(body))
    if how == "flip":
        return body[:i] + bytes([body[i] ^ (1 << rnd.randrange(8))]) + body[i + 1:]
    if how == "cut":
        return body[:i]
    return body[:i] + rnd.randbytes(rnd.randint(1, 8)) + body[i:]


def _sample_bodies() -> dict[str, bytes]:
    """A well-formed request per method, for a job none of them belongs to (so no byte flip can
    turn one into a real member's Join or ReportFailure)."""
    caller = pb.Caller(job_id="not-this-job", rank=1, incarnation=0xABCDEF, generation=1)
    return {
        "Join": pb.JoinRequest(job_id="not-this-job", rank=1, world_size=2, incarnation=9, hostname="h", wait_s=0.0,
                               wire=WIRE),
        "Set": pb.SetRequest(caller=caller, key="k\u2603", value=b"\x00\x01value"),
        "Get": pb.GetRequest(caller=caller, key="k", wait_s=0.0),
        "Barrier": pb.BarrierRequest(caller=caller, name="b", seq=1, wait_s=0.0, participants=[0, 1]),
        "Heartbeat": pb.HeartbeatRequest(caller=caller),
        "ReportFailure": pb.ReportFailureRequest(caller=caller, reason="r\u00e9ason"),
        "Leave": pb.LeaveRequest(caller=caller),
        "Status": pb.StatusRequest(),
    }


_BODIES = {name: message.SerializeToString() for name, message in _sample_bodies().items()}
#: Bytes that parse as no message: a truncated varint, a length past the end, a bad wire type,
#: invalid UTF-8 in a string field, a field number 0.
UNDECODABLE = [b"\xff", b"\x0a\x05ab", b"\x0f", b"\x12\x02\xc3\x28", b"\x00\x01", b"\x0a\x80\x80\x80\x80\x10"]
