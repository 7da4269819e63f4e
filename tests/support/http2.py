"""A raw HTTP/2 client for tests that must send what no gRPC client would: hand-built frames,
HPACK blocks and gRPC messages over a plain socket (the fuzz tests and the adversarial suite)."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

from gridcomm._proto import coordinator_pb2 as pb

SERVICE = "gridcomm.v1.Coordinator"
#: How long a raw exchange waits for the server's answer.
RAW_TIMEOUT_S = 4.0


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, CONTINUATION = 0, 1, 3, 4, 6, 7, 9
END_STREAM, END_HEADERS, PADDED, PRIORITY = 0x1, 0x4, 0x8, 0x20


def h2_frame(kind: int, flags: int, stream: int, payload: bytes, length: int | None = None) -> bytes:
    size = len(payload) if length is None else length
    return struct.pack(">I", size & 0xFFFFFF)[1:] + bytes([kind & 0xFF, flags & 0xFF]) + \
        struct.pack(">I", stream & 0xFFFFFFFF) + payload


def hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """RFC 7541 5.1 integer with an N-bit prefix."""
    top = (1 << prefix_bits) - 1
    if value < top:
        return bytes([first | value])
    out = bytearray([first | top])
    value -= top
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def hpack_literal(name: bytes, value: bytes) -> bytes:
    """A literal header field without indexing, new name, no Huffman coding (RFC 7541 6.2.2)."""
    return b"\x00" + hpack_int(len(name), 7) + name + hpack_int(len(value), 7) + value


def grpc_headers(method: str, extra: Sequence[tuple[bytes, bytes]] = ()) -> bytes:
    fields = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", f"/{SERVICE}/{method}".encode()),
              (b":authority", b"127.0.0.1"), (b"content-type", b"application/grpc"), (b"te", b"trailers"), *extra]
    return b"".join(hpack_literal(n, v) for n, v in fields)


def grpc_message(body: bytes, flag: int = 0, length: int | None = None) -> bytes:
    return bytes([flag & 0xFF]) + struct.pack(">I", (len(body) if length is None else length) & 0xFFFFFFFF) + body


def grpc_request(method: str, body: bytes, *, flag: int = 0, length: int | None = None,
                 extra: Sequence[tuple[bytes, bytes]] = (), stream: int = 1) -> bytes:
    return (PREFACE + h2_frame(SETTINGS, 0, 0, b"") + h2_frame(HEADERS, END_HEADERS, stream, grpc_headers(method, extra))
            + h2_frame(DATA, END_STREAM, stream, grpc_message(body, flag, length)))


@dataclass
class Frame:
    kind: int
    flags: int
    stream: int
    payload: bytes


@dataclass
class RawReply:
    frames: list[Frame]
    closed: bool
    trailing_bytes: bytes

    def stream_ended(self, stream: int) -> bool:
        return any(f.stream == stream and (f.kind == RST_STREAM or (f.kind in (HEADERS, DATA) and f.flags & END_STREAM))
                   for f in self.frames)

    def goaway(self) -> bool:
        return any(f.kind == GOAWAY for f in self.frames)


def parse_frames(buf: bytes) -> tuple[list[Frame], bytes]:
    frames, i = [], 0
    while i + 9 <= len(buf):
        size = int.from_bytes(buf[i:i + 3], "big")
        if i + 9 + size > len(buf):
            break
        frames.append(Frame(buf[i + 3], buf[i + 4], int.from_bytes(buf[i + 5:i + 9], "big") & 0x7FFFFFFF,
                            buf[i + 9:i + 9 + size]))
        i += 9 + size
    return frames, buf[i:]


def exchange(port: int, data: bytes, *, until_stream_end: int | None = None, half_close: bool = True,
             timeout_s: float = RAW_TIMEOUT_S) -> RawReply:
    """Sends bytes on a fresh connection and reads until the server closes it (or, with
    until_stream_end, until that stream ends), at most timeout_s."""
    deadline = time.monotonic() + timeout_s
    buf, closed = b"", False
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        try:
            sock.sendall(data)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server may hang up before it has read everything: that is an answer too
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            sock.settimeout(left)
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            except OSError:
                closed = True
                break
            if not chunk:
                closed = True
                break
            buf += chunk
            if until_stream_end is not None:
                frames, _ = parse_frames(buf[0:])
                if RawReply(frames, False, b"").stream_ended(until_stream_end):
                    break
    frames, rest = parse_frames(buf)
    return RawReply(frames, closed, rest)


_STATIC_NAMES = {8: ":status", 13: ":status", 31: "content-type"}


def hpack_headers(block: bytes, table: list[tuple[str, str]]) -> list[tuple[str, str | None]]:
    """Decodes the header fields this client needs from an HPACK block; a Huffman-coded string
    comes back as None (this decoder has no Huffman table)."""

    def integer(i: int, bits: int) -> tuple[int, int]:
        top = (1 << bits) - 1
        value = block[i] & top
        i += 1
        if value < top:
            return value, i
        shift = 0
        while True:
            b = block[i]
            i += 1
            value += (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return value, i

    def string(i: int) -> tuple[str | None, int]:
        huffman = bool(block[i] & 0x80)
        size, i = integer(i, 7)
        raw = block[i:i + size]
        return (None if huffman else raw.decode("latin-1")), i + size

    def name_of(index: int) -> str:
        if index > 61 and index - 62 < len(table):
            return table[index - 62][0]
        return _STATIC_NAMES.get(index, f"static-{index}")

    out: list[tuple[str, str | None]] = []
    i = 0
    while i < len(block):
        b = block[i]
        if b & 0x80:
            index, i = integer(i, 7)
            if index > 61 and index - 62 < len(table):
                out.append(table[index - 62])
            continue
        if b & 0xE0 == 0x20:
            _, i = integer(i, 5)
            continue
        bits = 6 if b & 0x40 else 4
        index, i = integer(i, bits)
        if index:
            name: str | None = name_of(index)
        else:
            name, i = string(i)
        value, i = string(i)
        if name is not None:
            out.append((name, value))
            if bits == 6 and value is not None:
                table.insert(0, (name, value))
    return out


def grpc_status_of(reply: RawReply, stream: int = 1) -> int | None:
    """The grpc-status the server sent on ``stream``, where it can be read without Huffman."""
    table: list[tuple[str, str]] = []
    block = b""
    for frame in reply.frames:
        if frame.kind not in (HEADERS, CONTINUATION):
            continue
        payload = frame.payload
        if frame.kind == HEADERS:
            pad = payload[0] if frame.flags & PADDED else 0
            payload = payload[(1 if frame.flags & PADDED else 0) + (5 if frame.flags & PRIORITY else 0):]
            payload = payload[:len(payload) - pad] if pad else payload
        block += payload
        if not frame.flags & END_HEADERS:
            continue
        headers = hpack_headers(block, table)
        block = b""
        if frame.stream == stream:
            for name, value in headers:
                if name == "grpc-status" and value is not None and value.isdigit():
                    return int(value)
    return None


def grpc_data_messages(reply: RawReply, stream: int = 1) -> list[bytes]:
    data = b"".join(f.payload for f in reply.frames if f.kind == DATA and f.stream == stream)
    out, i = [], 0
    while i + 5 <= len(data):
        size = int.from_bytes(data[i + 1:i + 5], "big")
        out.append(data[i + 5:i + 5 + size])
        i += 5 + size
    return out


def raw_status_call(port: int, token: str | None = None) -> pb.StatusResponse:
    """A correct Status request over a raw socket: proves the framing here is right, so the
    garbage below is garbage on purpose."""
    extra = [(b"authorization", f"Bearer {token}".encode())] if token is not None else []
    reply = exchange(port, grpc_request("Status", b"", extra=extra), until_stream_end=1, half_close=False)
    assert grpc_status_of(reply) == 0, reply
    messages = grpc_data_messages(reply)
    assert len(messages) == 1, reply
    return pb.StatusResponse.FromString(messages[0])


def status_when_back(port: int, within_s: float = 2.0, token: str | None = None) -> pb.StatusResponse:
    """raw_status_call, retried while the port refuses connections or the dying server answers
    GOAWAY (a server the watchdog is binding again) for at most ``within_s``; the last failure
    is raised after that."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return raw_status_call(port, token)
        except (OSError, AssertionError):
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.01)
