"""The host data plane's vocabulary: frame and slot sizes, the frame header, call kinds, and the
signals a blocked wait can end with."""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gridcomm._backends.host.link import Link

VERSION = 1


MAGIC = b"GCP1"


#: Bound on connecting and authenticating one link (dial or accept).
HANDSHAKE_S = 10.0


#: At most this many connections are being authenticated at once per process; more are closed.
MAX_HANDSHAKES = 64


#: Payload bytes per frame on a socket; also the size of a link's receive scratch for reductions.
SOCKET_FRAME = 256 * 1024


#: Shared-memory slots per direction of a same-host link, and their size: 2 MiB per direction.
SHM_SLOTS = 4


SHM_SLOT_BYTES = 512 * 1024


#: Largest slot geometry accepted from a peer (what this process will map).
MAX_SHM_SLOTS = 64


MAX_SHM_SLOT_BYTES = 16 * 1024 * 1024


#: Messages up to this size travel inline on the socket even between ranks of one host: one
#: send beats a copy into a slot plus a doorbell plus a credit.
INLINE_BYTES = 32 * 1024


#: Frames whose payload is at most this are copied into one buffer with their header (one iovec).
_COALESCE_BYTES = 4096


#: Size of a link's staging buffer for headers and small payloads read from the socket.
_RBUF_BYTES = 64 * 1024


#: A frame payload at least this large is read straight into its destination.
_DIRECT_BYTES = 16 * 1024


#: Bytes of frames prepared ahead of the socket per link (several small frames go out in one call).
_BATCH_BYTES = 1024 * 1024


#: TLS sockets are written in record-sized pieces (a retried SSL write must repeat the same piece).
_TLS_PIECE = 16 * 1024


_IOV_MAX = 64


# Frame header: kind, call kind, flags, pad, slot, message number, payload bytes.
_FRAME = struct.Struct("<BBBxIIQ")


_DATA, _SHM, _CREDIT, _BYE = 1, 2, 3, 4


_LAST = 1


_FRAME_KINDS = {_DATA: "data", _SHM: "shared-memory", _CREDIT: "credit", _BYE: "goodbye"}


#: Call kinds carried in frame headers (send, recv and send_recv pair with each other).
OPS = {"all_reduce": 1, "reduce": 2, "broadcast": 3, "reduce_scatter": 4, "all_gather": 5, "p2p": 6,
       "scatter": 7, "gather": 8, "all_to_all": 9}


_OP_NAMES = {v: k for k, v in OPS.items()}


class _Woken(Exception):
    """The wake-up pipe was written: the communicator failed or the endpoint is closing."""


class _Expired(Exception):
    """A deadline passed."""


class _Lost(Exception):
    """A link's connection broke (``clean``: the peer said goodbye first)."""

    def __init__(self, link: Link, why: str, clean: bool = False) -> None:
        super().__init__(why)
        self.link = link
        self.why = why
        self.clean = clean

