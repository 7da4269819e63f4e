"""The coordinator's ``/metrics`` port: a small HTTP/1.x server of its own threads, bounded in
connections, time and bytes whatever a client does (the port needs no token), that answers each
scrape from a ``prometheus_client`` registry (:mod:`gridcomm._coordinator.metrics` gives it the
coordinator's collector). ``prometheus_client`` is imported only when a port is served."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from gridcomm import _config
from gridcomm._errors import CoordinatorUnavailable
from gridcomm._runtime.guard import bind_problem

#: The metrics' logger (one name for the coordinator's metrics and their port).
log = logging.getLogger("gridcomm._coordinator.metrics")

#: How long one connection to /metrics may take, counted from its accept: reading the request,
#: the snapshot (at most SNAPSHOT_TIMEOUT_S) and writing the answer. Past it the connection is
#: closed, whatever it is doing, so a client that sends nothing or trickles bytes holds nothing.
REQUEST_DEADLINE_S = 5.0
#: Connections open at once; a new one past it closes the oldest that has not sent its whole request
#: (else the oldest of all), so idle or trickling sockets can never keep a scrape out.
MAX_CONNECTIONS = 32
#: Threads that build answers (a scrape waits up to SNAPSHOT_TIMEOUT_S for the coordinator's
#: loop); a few, so one slow snapshot does not hold the next scrape. Fixed at start.
WORKERS = 2
#: The most bytes of request head read (the request line and headers; Prometheus sends ~300).
MAX_REQUEST_BYTES = 8192


class _Connection:
    """One accepted connection: its deadline, what it sent, what it is owed."""

    __slots__ = ("sock", "deadline", "inbox", "outbox", "rendering")

    def __init__(self, sock: Any, deadline: float) -> None:
        self.sock = sock
        self.deadline = deadline
        self.inbox = bytearray()
        #: The answer still to write (None: the request is not read, or its answer not built yet).
        self.outbox: memoryview | None = None
        #: A worker is building its answer (the request is whole).
        self.rendering = False


class MetricsServer:
    """``/metrics`` over HTTP/1.x, served from threads of its own: one thread does all socket I/O
    (non-blocking, with :mod:`selectors`) and a fixed pool of :data:`WORKERS` threads builds the
    answers. Why this shape: the port needs no token, so nothing a client does may grow the
    process or hold a scrape back. Each connection has an absolute deadline from its accept
    (:data:`REQUEST_DEADLINE_S`), at most :data:`MAX_CONNECTIONS` are open (a newcomer evicts the
    oldest that has not sent its request), the threads are started once, and an idle socket costs
    a slot, never a thread. One request per connection (``Connection: close``), as Prometheus
    scrapes. Paths ``/metrics`` and ``/``; ``GET`` and ``HEAD``; the text or OpenMetrics format by
    ``Accept`` and gzip by ``Accept-Encoding``, as prometheus_client serves them."""

    def __init__(self, listener: Any, registry: Any) -> None:
        import selectors
        import socket

        self._listener = listener
        self._registry = registry
        self.port: int = listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        for sock in (listener, self._wake_r, self._wake_w):
            sock.setblocking(False)
        self._selector.register(listener, selectors.EVENT_READ, "accept")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        #: Open connections in accept order (dicts keep it): the first is the oldest.
        self._open: dict[_Connection, None] = {}
        self._jobs: collections.deque[_Connection] = collections.deque()
        self._jobs_ready = threading.Condition()
        self._done: collections.deque[tuple[_Connection, bytes]] = collections.deque()
        self._stopping = threading.Event()
        self._threads = [threading.Thread(target=self._io, name="gridcomm-metrics", daemon=True)]
        self._threads += [threading.Thread(target=self._work, name=f"gridcomm-metrics-{i}", daemon=True)
                          for i in range(WORKERS)]
        for thread in self._threads:
            thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Closes the port and every connection; waits (bounded) for the threads. Idempotent."""
        self._stopping.set()
        with self._jobs_ready:
            self._jobs_ready.notify_all()
        self._wake()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------------ the I/O thread
    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass  # its buffer is full (the I/O thread wakes anyway) or it is closed (stopped)

    def _io(self) -> None:
        import selectors

        try:
            while not self._stopping.is_set():
                now = time.monotonic()
                soonest = min((c.deadline for c in self._open), default=now + 1.0)
                for key, mask in self._selector.select(min(1.0, max(0.0, soonest - now))):
                    if key.data == "accept":
                        self._accept()
                    elif key.data == "wake":
                        self._drain_wake()
                    elif mask & selectors.EVENT_READ:
                        self._read(key.data)
                    elif mask & selectors.EVENT_WRITE:
                        self._write(key.data)
                self._deliver()
                now = time.monotonic()
                for conn in [c for c in self._open if c.deadline <= now]:
                    self._close(conn)
        except Exception:  # noqa: BLE001 - logged; the port then refuses (a scrape sees it down)
            log.exception("metrics: the server's thread ended on an error")
        finally:
            for conn in list(self._open):
                self._close(conn)
            self._selector.close()
            for sock in (self._listener, self._wake_r, self._wake_w):
                sock.close()

    def _accept(self) -> None:
        import selectors

        for _ in range(64):  # then back to the others' I/O; the rest wait in the listen queue
            try:
                sock, _peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors, or a connection reset before it was taken
                log.debug("metrics: accept failed: %s", exc)
                return
            sock.setblocking(False)
            if len(self._open) >= MAX_CONNECTIONS:
                self._close(self._eviction())
            conn = _Connection(sock, time.monotonic() + REQUEST_DEADLINE_S)
            self._open[conn] = None
            self._selector.register(sock, selectors.EVENT_READ, conn)
            # Why read at once: a scrape's request is often there already; once whole it is no
            # longer the first to be evicted by the connections accepted after it.
            self._read(conn)

    def _eviction(self) -> _Connection:
        """The connection a newcomer replaces: the oldest still sending its request (idle or
        trickling), else the oldest whose answer is not taken, else the oldest."""
        for wanted in (lambda c: not c.rendering and c.outbox is None, lambda c: c.outbox is not None):
            for conn in self._open:
                if wanted(conn):
                    return conn
        return next(iter(self._open))

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def _read(self, conn: _Connection) -> None:
        try:
            data = conn.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)  # the client went away before its request was whole
            return
        conn.inbox += data
        whole = b"\r\n\r\n" in conn.inbox or b"\n\n" in conn.inbox  # bare LF: a request typed by hand
        if not whole and len(conn.inbox) > MAX_REQUEST_BYTES:
            self._answer(conn, _response(431, "text/plain; charset=utf-8", b"request head too large\n"))
        elif whole:
            self._selector.unregister(conn.sock)  # nothing more is read from it
            conn.rendering = True
            with self._jobs_ready:
                self._jobs.append(conn)
                self._jobs_ready.notify()

    def _deliver(self) -> None:
        """Hands the answers the workers built to their connections' writers."""
        while self._done:
            conn, answer = self._done.popleft()
            conn.rendering = False
            if conn in self._open:
                self._answer(conn, answer)

    def _answer(self, conn: _Connection, answer: bytes) -> None:
        import selectors

        conn.outbox = memoryview(answer)
        try:
            self._selector.modify(conn.sock, selectors.EVENT_WRITE, conn)
        except KeyError:
            self._selector.register(conn.sock, selectors.EVENT_WRITE, conn)
        self._write(conn)

    def _write(self, conn: _Connection) -> None:
        assert conn.outbox is not None
        try:
            sent = conn.sock.send(conn.outbox)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        conn.outbox = conn.outbox[sent:]
        if not conn.outbox:
            self._close(conn)

    def _close(self, conn: _Connection) -> None:
        if conn not in self._open:
            return
        del self._open[conn]
        if conn.rendering:
            # Why: the queue then holds open connections only, so it stays within MAX_CONNECTIONS
            # however fast connections with whole requests come and are evicted.
            with self._jobs_ready:
                try:
                    self._jobs.remove(conn)
                except ValueError:
                    pass  # a worker has it already
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass  # not registered while a worker builds its answer
        conn.sock.close()

    # ------------------------------------------------------------------ the workers
    def _work(self) -> None:
        while True:
            with self._jobs_ready:
                while not self._jobs and not self._stopping.is_set():
                    self._jobs_ready.wait(0.5)
                if self._stopping.is_set():
                    return
                conn = self._jobs.popleft()
            if time.monotonic() >= conn.deadline:
                answer = b""  # past its deadline: the I/O thread closes it
            else:
                try:
                    answer = self._render(bytes(conn.inbox))
                except Exception:  # noqa: BLE001 - one bad scrape must not end a worker
                    log.debug("metrics: building an answer failed", exc_info=True)
                    answer = _response(500, "text/plain; charset=utf-8", b"the metrics could not be built\n")
            self._done.append((conn, answer))
            self._wake()

    def _render(self, head: bytes) -> bytes:
        """The HTTP answer to one request head (everything up to its blank line)."""
        import gzip
        from urllib.parse import urlsplit

        from prometheus_client.exposition import choose_encoder

        text = head.decode("latin-1").replace("\r\n", "\n")
        lines = text[:text.find("\n\n")].split("\n")  # the head only, never bytes sent after it
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            return _response(400, "text/plain; charset=utf-8", b"not an HTTP/1.x request\n")
        method, target, _version = parts
        if method not in ("GET", "HEAD"):
            return _response(405, "text/plain; charset=utf-8", b"only GET and HEAD\n", ("Allow: GET, HEAD",))
        url = urlsplit(target)
        if url.path not in ("/metrics", "/"):
            return _response(404, "text/plain; charset=utf-8", b"not found: the metrics are at /metrics\n")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, field = line.partition(":")
            if sep:
                headers[name.strip().lower()] = field.strip()
        encoder, content_type = choose_encoder(headers.get("accept", ""))
        body = encoder(self._registry)
        extra: tuple[str, ...] = ()
        if "gzip" in headers.get("accept-encoding", "").lower():
            body, extra = gzip.compress(body, compresslevel=1), ("Content-Encoding: gzip",)
        return _response(200, content_type, body, extra, head_only=method == "HEAD")


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large", 500: "Internal Server Error"}


def _response(status: int, content_type: str, body: bytes, extra: Sequence[str] = (), *,
              head_only: bool = False) -> bytes:
    head = [f"HTTP/1.1 {status} {_REASONS[status]}", f"Content-Type: {content_type}",
            f"Content-Length: {len(body)}", "Connection: close", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + (b"" if head_only else body)


def serve_http(collector: Any, port: int, bind: str) -> MetricsServer:
    """Serves ``collector``'s metrics as Prometheus text at ``http://BIND:PORT/metrics`` (see
    :class:`MetricsServer` for how it stays bounded); ``port=0`` picks a free port (``.port``
    says which)."""
    import socket

    from prometheus_client import CollectorRegistry

    host = _config.validate_host("bind", bind)  # the coordinator's resolved bind address
    target = _config.format_target(host, port)
    problem = bind_problem(target)
    if problem is not None:
        raise CoordinatorUnavailable(f"the metrics port {target} cannot be bound: {problem}; set "
                                     "GRIDCOMM_METRICS_PORT (or --metrics-port) to a free port.")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        # As HTTP servers do: a port whose last connections are in TIME_WAIT can be bound again.
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host.strip("[]"), port))
        listener.listen(128)
    except OSError as exc:
        listener.close()
        raise CoordinatorUnavailable(f"the metrics port {target} cannot be bound: {exc.strerror or exc}.") from exc
    server = MetricsServer(listener, registry)
    log.info("coordinator: metrics on http://%s/metrics", _config.format_target(host, server.port))
    return server
