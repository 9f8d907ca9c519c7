"""A real HTTP(S) webhook receiver on loopback that records every request and answers from a policy.

Usage::

    with WebhookReceiver([503, 200]) as rx:           # 503 once, then 200 forever
        ... POST to rx.url ...
        first, second = rx.wait_for(2, timeout=5)

A policy is an int status, a ``Reply``, a sequence of those (consumed in order, then
``default``), or a callable ``(ReceivedRequest) -> int | Reply``. ``Reply(delay=...)`` holds
the answer back (to outlast a client's timeout); ``stop()`` releases every held answer at once.
HTTP/1.1 keep-alive, Content-Length on every answer, TCP_NODELAY: cheap enough for benchmarks
(pass ``store=False`` to keep only counts).
"""
from __future__ import annotations

import json
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Union

from benchmarks.peers.lifecycle import ServerPeer


@dataclass(frozen=True)
class Reply:
    """What the receiver answers: status, extra headers, body, and how long to hold it back."""

    status: int = 200
    headers: Mapping[str, str] = field(default_factory=dict)
    body: bytes = b""
    delay: float = 0.0


@dataclass(frozen=True)
class ReceivedRequest:
    """One request as received: method, path, headers (lower-case names), raw body."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    received_at: float
    raw_headers: tuple[tuple[str, str], ...] = ()
    client: tuple[str, int] = ("", 0)  # the client's address: one port per keep-alive connection

    def header(self, name: str) -> str | None:
        """A header value by case-insensitive name (repeats joined with ", ")."""
        return self.headers.get(name.lower())

    def json(self) -> Any:
        """The body parsed as JSON."""
        return json.loads(self.body)


Answer = Union[int, Reply]
Policy = Union[Answer, Iterable[Answer], Callable[[ReceivedRequest], Answer], None]


def _as_reply(answer: Answer) -> Reply:
    return answer if isinstance(answer, Reply) else Reply(status=int(answer))


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.owner._track(self.connection, True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.owner._track(self.connection, False)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass  # keep test output clean

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _handle(self) -> None:
        owner = self.server.owner
        body = self._read_body()
        headers: dict[str, str] = {}
        for name, value in self.headers.items():
            key = name.lower()
            headers[key] = f"{headers[key]}, {value}" if key in headers else value
        request = ReceivedRequest(
            method=self.command,
            path=self.path,
            headers=headers,
            body=body,
            received_at=time.time(),
            raw_headers=tuple(self.headers.items()),
            client=(self.client_address[0], self.client_address[1]),
        )
        owner._record(request)
        reply = owner._decide(request)
        if reply.delay > 0 and owner._released.wait(reply.delay):
            self.close_connection = True
            return  # stopping: drop the held answer
        try:
            self.send_response(reply.status)
            for name, value in reply.headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(reply.body)))
            self.end_headers()
            if reply.body:
                self.wfile.write(reply.body)
        except OSError:
            self.close_connection = True  # the client gave up (timeout): nothing to tell it

    do_POST = do_PUT = do_GET = do_PATCH = do_DELETE = do_OPTIONS = _handle


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, owner: WebhookReceiver, address: tuple[str, int], ssl_context: ssl.SSLContext | None):
        self.owner = owner
        self.ssl_context = ssl_context
        super().__init__(address, _Handler)

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, addr = self.socket.accept()
        if self.ssl_context is not None:
            # Handshake in the handler thread, so a slow or failing client never blocks accept().
            sock = self.ssl_context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, addr

    def handle_error(self, request: Any, client_address: Any) -> None:
        self.owner._count_error()  # TLS handshake refusals and resets are expected in tests


class WebhookReceiver(ServerPeer):
    """A threaded HTTP(S) server on 127.0.0.1 (port 0) that stores requests and follows a policy."""

    def __init__(
        self,
        policy: Policy = None,
        *,
        default: Answer = 200,
        host: str = "127.0.0.1",
        ssl_context: ssl.SSLContext | None = None,
        store: bool = True,
    ) -> None:
        self._cond = threading.Condition()
        self._requests: list[ReceivedRequest] = []
        self._count = 0
        self._body_bytes = 0
        self._errors = 0
        self._store = store
        self._default = _as_reply(default)
        self._policy_lock = threading.Lock()
        self._script: deque[Reply] = deque()
        self._callable: Callable[[ReceivedRequest], Answer] | None = None
        self._released = threading.Event()
        self._connections: set[socket.socket] = set()
        self.set_policy(policy)
        self._server = _Server(self, (host, 0), ssl_context)
        self._thread: threading.Thread | None = None
        self.scheme = "https" if ssl_context is not None else "http"

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> WebhookReceiver:
        """Start serving in a daemon thread."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                name="webhook-receiver", daemon=True,
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, release held answers and close open keep-alive connections."""
        self._released.set()
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(5)
            self._thread = None
        self._server.server_close()
        with self._cond:
            connections = list(self._connections)
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # -- addresses ---------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """Base URL with path ``/hook``."""
        return self.url_for("/hook")

    def url_for(self, path: str, host: str = "127.0.0.1") -> str:
        return f"{self.scheme}://{host}:{self.port}{path}"

    # -- policy ------------------------------------------------------------------------------
    def set_policy(self, policy: Policy, *, default: Answer | None = None) -> None:
        """Replace the policy (and optionally the answer used once a sequence runs out)."""
        with self._policy_lock:
            if default is not None:
                self._default = _as_reply(default)
            self._script.clear()
            self._callable = None
            if policy is None:
                return
            if callable(policy):
                self._callable = policy
            elif isinstance(policy, (int, Reply)):
                self._default = _as_reply(policy)
            else:
                self._script.extend(_as_reply(a) for a in policy)

    def _decide(self, request: ReceivedRequest) -> Reply:
        with self._policy_lock:
            if self._callable is not None:
                func = self._callable
            elif self._script:
                return self._script.popleft()
            else:
                return self._default
        try:
            return _as_reply(func(request))
        except Exception:  # a broken test policy shows up as a 500, not a hung client
            return Reply(500, body=b"policy raised")

    # -- observations ------------------------------------------------------------------------
    def _record(self, request: ReceivedRequest) -> None:
        with self._cond:
            self._count += 1
            self._body_bytes += len(request.body)
            if self._store:
                self._requests.append(request)
            self._cond.notify_all()

    def _count_error(self) -> None:
        with self._cond:
            self._errors += 1
            self._cond.notify_all()

    def _track(self, conn: socket.socket, opened: bool) -> None:
        with self._cond:
            if opened:
                self._connections.add(conn)
            else:
                self._connections.discard(conn)

    @property
    def count(self) -> int:
        """Requests received so far (counted before the answer, even a held one)."""
        with self._cond:
            return self._count

    @property
    def body_bytes(self) -> int:
        with self._cond:
            return self._body_bytes

    @property
    def errors(self) -> int:
        """Connections that failed in the server (TLS handshake refused, reset)."""
        with self._cond:
            return self._errors

    @property
    def requests(self) -> list[ReceivedRequest]:
        """A copy of the stored requests, oldest first."""
        with self._cond:
            return list(self._requests)

    def clear(self) -> None:
        """Forget stored requests and counts."""
        with self._cond:
            self._requests.clear()
            self._count = self._body_bytes = self._errors = 0

    def wait_for(self, n: int, timeout: float = 5.0) -> list[ReceivedRequest]:
        """Block until at least ``n`` requests were received; raises TimeoutError otherwise."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._count >= n, timeout):
                raise TimeoutError(f"expected {n} requests within {timeout}s, got {self._count}")
            return list(self._requests)

    def wait_for_errors(self, n: int, timeout: float = 5.0) -> int:
        """Block until at least ``n`` server-side connection errors; raises TimeoutError otherwise."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._errors >= n, timeout):
                raise TimeoutError(f"expected {n} connection errors within {timeout}s, got {self._errors}")
            return self._errors
