"""A small fault-scriptable HTTP/1.1 peer on loopback: tests queue answers, the peer records requests.

Usage::

    with HttpPeer() as peer:
        peer.queue(Response(500), Response(429, {"Retry-After": "0"}), Response(200, body=b"{}"))
        ... talk to peer.url ...
        first, second, third = peer.wait_for(3)

Answers are consumed in order (per path when queued with ``path=``, else from the shared queue),
then ``default`` forever. ``Response(delay=s)`` holds an answer back; ``Response(hang=True)``
never answers: the connection is dropped on ``release()`` or ``stop()``, which also cut every
delay short.
"""
from __future__ import annotations

import json
import socket
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from benchmarks.peers.lifecycle import ServerPeer
from urllib.parse import parse_qs, urlsplit


@dataclass(frozen=True)
class Response:
    """One scripted answer: status, headers, body (bytes, str or JSON-able), delay, or hang for good."""

    status: int = 200
    headers: Mapping[str, str] = field(default_factory=dict)
    body: Any = b""
    delay: float = 0.0
    hang: bool = False

    def payload(self) -> bytes:
        if isinstance(self.body, bytes):
            return self.body
        if isinstance(self.body, str):
            return self.body.encode()
        return json.dumps(self.body).encode()


@dataclass(frozen=True)
class Request:
    """One request as received; header names are lower-cased (repeats joined with ", ")."""

    method: str
    path: str
    query: dict[str, list[str]]
    raw_query: str
    headers: dict[str, str]
    raw_headers: tuple[tuple[str, str], ...]
    body: bytes
    client: tuple[str, int]
    received_at: float

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())

    def json(self) -> Any:
        return json.loads(self.body)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.peer._track(self.connection, add=True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.peer._track(self.connection, add=False)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - keep test output clean
        pass

    def _handle(self) -> None:
        peer = self.server.peer
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        parts = urlsplit(self.path)
        headers: dict[str, str] = {}
        for name, value in self.headers.items():
            key = name.lower()
            headers[key] = f"{headers[key]}, {value}" if key in headers else value
        request = Request(
            method=self.command,
            path=parts.path,
            query=parse_qs(parts.query, keep_blank_values=True),
            raw_query=parts.query,
            headers=headers,
            raw_headers=tuple(self.headers.items()),
            body=body,
            client=self.client_address[:2],
            received_at=time.monotonic(),
        )
        answer = peer._record(request)
        if answer.hang:
            peer._released.wait()
            self.close_connection = True
            return
        if answer.delay > 0 and peer._released.wait(answer.delay):
            self.close_connection = True
            return
        payload = answer.payload()
        self.send_response(answer.status)
        names = {k.lower() for k in answer.headers}
        for name, value in answer.headers.items():
            self.send_header(name, value)
        if "content-type" not in names and payload:
            self.send_header("Content-Type", "application/json; charset=utf-8")
        if "content-length" not in names:
            self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if payload and self.command != "HEAD" and answer.status not in (204, 304):
            self.wfile.write(payload)
        self.wfile.flush()

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _handle


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    peer: HttpPeer


class HttpPeer(ServerPeer):
    """The scriptable peer; use as a context manager or call start()/stop()."""

    def __init__(self, default: Response | None = None) -> None:
        self.default = default or Response(200)
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._queue: deque[Response] = deque()
        self._by_path: dict[str, deque[Response]] = {}
        self._requests: list[Request] = []
        self._sockets: set[socket.socket] = set()
        self._released = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> HttpPeer:
        server = _Server(("127.0.0.1", 0), _Handler)
        server.peer = self
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="http-peer", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._released.set()
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            sockets = list(self._sockets)
        for sock in sockets:  # idle keep-alive connections would otherwise pin handler threads
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._server = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- scripting ---------------------------------------------------------------------------
    def queue(self, *answers: Response | int, path: str | None = None) -> None:
        """Answer the next requests (to ``path`` only, if given) with these, in order."""
        items = [a if isinstance(a, Response) else Response(int(a)) for a in answers]
        with self._lock:
            target = self._queue if path is None else self._by_path.setdefault(path, deque())
            target.extend(items)

    def release(self) -> None:
        """Drop every hung connection and cut every pending delay short (the peer stays up)."""
        self._released.set()

    # -- observation -------------------------------------------------------------------------
    @property
    def requests(self) -> list[Request]:
        with self._lock:
            return list(self._requests)

    def wait_for(self, count: int, timeout: float = 5.0) -> list[Request]:
        """Block until at least ``count`` requests arrived; raise AssertionError on timeout."""
        deadline = time.monotonic() + timeout
        with self._arrived:
            while len(self._requests) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"expected {count} request(s), got {len(self._requests)}")
                self._arrived.wait(left)
            return list(self._requests)

    # -- internals ---------------------------------------------------------------------------
    def _record(self, request: Request) -> Response:
        with self._arrived:
            self._requests.append(request)
            self._arrived.notify_all()
            specific = self._by_path.get(request.path)
            if specific:
                return specific.popleft()
            if self._queue:
                return self._queue.popleft()
            return self.default

    def _track(self, sock: socket.socket, *, add: bool) -> None:
        with self._lock:
            if add:
                self._sockets.add(sock)
            else:
                self._sockets.discard(sock)
