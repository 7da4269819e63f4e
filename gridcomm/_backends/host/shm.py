"""Shared memory between two ranks of one host: segments in ``/dev/shm`` and the test of "same host".

Two ranks are taken to share a host only when three things agree: the kernel's per-boot id
(``/proc/sys/kernel/random/boot_id``, the same for every container of one node and different on
every other machine or after a reboot), the host name (pods of one node share the boot id but
each has its own host name and its own ``/dev/shm``), and a probe: the other rank opens the
segment by name and finds the random cookie written into it. Addresses are never compared (pods
behind NAT, hostNetwork pods and network namespaces make IP guesswork wrong both ways).

A segment is created with ``O_EXCL`` and mode 0600 under a random name (and a peer's is opened
only when it is this user's, with that mode), its pages are reserved
at once (``posix_fallocate``: a full ``/dev/shm`` is an error at creation, not a SIGBUS at the
first write), and its name is unlinked as soon as the peer has mapped it, so a segment outlives
neither of its two processes, whatever kills them. Names still linked (a process stopped between
creation and the peer's mapping) are unlinked by :func:`unlink_all`, which the data plane calls
on stop, abort and failure, and at interpreter exit.

The trust boundary is the user id: a process of the same user that opens a name in its window
(between creation and the peer's mapping) could change what flows through it or truncate it, but
such a process can already ptrace a rank or write its memory through /proc/PID/mem, so no check
inside the segment would raise the bar. Ranks that must not trust each other's user run as
different users (or in different pods) or with ``GRIDCOMM_SHM=0``.
"""

from __future__ import annotations

import atexit
import hashlib
import hmac
import logging
import mmap
import os
import re
import secrets
import socket
import threading
import time

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
#: Every segment name starts with this, then the creating pid and 16 random hex digits.
PREFIX = "gridcomm-"
_NAME = re.compile(r"^gridcomm-[0-9]{1,10}-[0-9a-f]{16}$")
COOKIE_BYTES = 32
#: Bytes before the first slot (the cookie, padded so slots start cache-line aligned).
HEADER_BYTES = 64

#: Names this process created and has not unlinked yet.
_linked: set[str] = set()
_lock = threading.Lock()
_atexit_registered = False
_swept = False
#: A segment whose creator is gone is swept only once it is this old (seconds): a live creator
#: unlinks its name within a handshake, and a creator in another pid namespace that shares this
#: /dev/shm must not lose a segment it is still handing to its peer.
SWEEP_AGE_S = 60.0


def sweep_dead(now: float | None = None) -> list[str]:
    """Unlinks gridcomm segment names of this user whose creating process is gone (a SIGKILL
    between creating a segment and its peer mapping it leaves one behind); returns them."""
    now = time.time() if now is None else now
    gone: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return gone
    for name in names:
        if not _NAME.match(name) or name in _linked:
            continue
        pid = int(name[len(PREFIX):].split("-", 1)[0])
        path = os.path.join(SHM_DIR, name)
        try:
            info = os.lstat(path)
            if info.st_uid != os.getuid() or now - info.st_mtime < SWEEP_AGE_S:
                continue
            try:
                os.kill(pid, 0)
                continue  # alive (or its pid reused): left alone
            except ProcessLookupError:
                pass
            except PermissionError:
                continue  # alive, another user's
            os.unlink(path)
            gone.append(name)
        except OSError:
            continue
    return gone


class ShmUnavailable(OSError):
    """Raised when a segment cannot be created or opened; the caller falls back to sockets."""


def host_key() -> bytes:
    """32 bytes equal for two processes exactly when they share a kernel boot and a host name;
    empty when the boot id cannot be read (then no pair counts as the same host)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
            boot = handle.read().strip()
    except OSError:
        return b""
    if not boot:
        return b""
    return hashlib.sha256(f"gridcomm host\0{boot}\0{socket.gethostname()}".encode()).digest()


def usable() -> bool:
    """Whether this process can create segments at all (``/dev/shm`` exists and is writable)."""
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK | os.X_OK)


def valid_name(name: str) -> bool:
    """Whether ``name`` is one this module makes (checked before opening a name a peer sent, so a
    peer cannot make this process open any other file)."""
    return bool(_NAME.match(name))


class Segment:
    """One mapped segment: a header holding the cookie, then ``slots`` slots of ``slot_bytes``."""

    def __init__(self, name: str, mapping: mmap.mmap, slots: int, slot_bytes: int, cookie: bytes) -> None:
        self.name = name
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.cookie = cookie
        self._map = mapping
        self._view = memoryview(mapping)
        self._slot_views = [self._view[HEADER_BYTES + i * slot_bytes : HEADER_BYTES + (i + 1) * slot_bytes]
                            for i in range(slots)]

    @staticmethod
    def size(slots: int, slot_bytes: int) -> int:
        return HEADER_BYTES + slots * slot_bytes

    @classmethod
    def create(cls, slots: int, slot_bytes: int) -> Segment:
        """A new segment under a fresh name, its pages reserved and its cookie written."""
        global _atexit_registered, _swept
        if not _swept:
            _swept = True
            swept = sweep_dead()
            if swept:
                log.info("removed %d shared-memory segment name(s) left by processes that died: %s", len(swept),
                         ", ".join(swept[:4]))
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        path = os.path.join(SHM_DIR, name)
        size = cls.size(slots, slot_bytes)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ShmUnavailable(exc.errno, f"cannot create {path}: {exc.strerror}") from exc
        with _lock:
            _linked.add(name)
            if not _atexit_registered:
                atexit.register(unlink_all)
                _atexit_registered = True
        try:
            try:
                os.posix_fallocate(fd, 0, size)
                mapping = mmap.mmap(fd, size)
            finally:
                os.close(fd)
        except OSError as exc:
            unlink(name)
            raise ShmUnavailable(exc.errno, f"cannot reserve {size} bytes in {path}: {exc.strerror}; is /dev/shm "
                                            "full? (Kubernetes: mount an emptyDir with medium Memory there)") from exc
        cookie = secrets.token_bytes(COOKIE_BYTES)
        mapping[:COOKIE_BYTES] = cookie
        return cls(name, mapping, slots, slot_bytes, cookie)

    @classmethod
    def open(cls, name: str, cookie: bytes, slots: int, slot_bytes: int) -> Segment:
        """Maps a peer's segment; raises :class:`ShmUnavailable` unless it exists here, has the
        announced size and carries ``cookie`` (the probe that both processes see the same /dev/shm)."""
        if not valid_name(name):
            raise ShmUnavailable(0, f"{name!r} is not a gridcomm segment name")
        path = os.path.join(SHM_DIR, name)
        size = cls.size(slots, slot_bytes)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise ShmUnavailable(exc.errno, f"cannot open {path}: {exc.strerror}") from exc
        try:
            info = os.fstat(fd)
            if info.st_uid != os.geteuid() or info.st_mode & 0o077:
                # Why: the peer made it 0600 as this user; anything else was put there by someone else.
                raise ShmUnavailable(0, f"{path} is owned by uid {info.st_uid} with mode {info.st_mode & 0o777:o}, not "
                                        f"by this user (uid {os.geteuid()}) with mode 600")
            if info.st_size != size:
                raise ShmUnavailable(0, f"{path} has {info.st_size} bytes, not the announced {size}")
            mapping = mmap.mmap(fd, size)
        except OSError as exc:
            if isinstance(exc, ShmUnavailable):
                raise
            raise ShmUnavailable(exc.errno, f"cannot map {path}: {exc.strerror}") from exc
        finally:
            os.close(fd)
        if not hmac.compare_digest(bytes(mapping[:COOKIE_BYTES]), cookie):
            mapping.close()
            raise ShmUnavailable(0, f"{path} does not carry the announced cookie (another /dev/shm?)")
        return cls(name, mapping, slots, slot_bytes, cookie)

    def slot(self, index: int) -> memoryview:
        """Slot ``index`` as a writable byte view (valid until :meth:`close`)."""
        return self._slot_views[index]

    def close(self) -> None:
        """Unmaps the segment (its name must already be unlinked, or be unlinked by the creator).
        Why the BufferErrors are ignored: a NumPy array still viewing a slot keeps the mapping
        alive; it is then unmapped when the last such view is gone."""
        views, self._slot_views = self._slot_views, []
        for view in [*views, self._view]:
            try:
                view.release()
            except BufferError:
                pass
        try:
            self._map.close()
        except BufferError:
            pass


def unlink(name: str) -> None:
    """Removes the name ``name`` from /dev/shm (the memory lives on while a process maps it)."""
    with _lock:
        _linked.discard(name)
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def unlink_all() -> list[str]:
    """Unlinks every name this process created and has not unlinked yet; returns them."""
    with _lock:
        names = sorted(_linked)
    for name in names:
        unlink(name)
    return names


def linked() -> list[str]:
    """Names this process created and has not unlinked yet (for tests and diagnostics)."""
    with _lock:
        return sorted(_linked)
