"""The signed approval callback: ``POST /approvals`` over HTTP(S), verified with Standard Webhooks.

Every request is either refused here (answered with ``{"status": "refused", "reason": ...}`` and
passed to ``audit`` exactly once) or, when it is correctly signed, fresh, not replayed and
well-formed, handed to ``decide`` exactly once (which answers and audits it itself).
Checks run cheapest-and-safest first: rate limit, size, slow clients, signature, replay, shape.
"""
from __future__ import annotations

import email.utils
import io
import json
import logging
import math
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlsplit

from forwarder.approval.seen_ids import ReplayCache
from forwarder.approval.settings import CallbackSettings
from forwarder.errors import ConfigError, ForwarderError, StateError
from forwarder.common.http_server import HttpServer, QuietHandler, client_key
from forwarder.common.listen import host_port_text, tls_server_context
from forwarder.common.logs import RateLimitedLog
from forwarder.common.signing import SignatureError, verify

if TYPE_CHECKING:  # typing.Self is 3.11+; annotations are never evaluated at run time
    from typing_extensions import Self

log = logging.getLogger(__name__)

PATH = "/approvals"
# Connections served at once, in all and per client address: one client (a slowloris holding idle
# connections) can take at most a few slots, so a signed request from anyone else is still answered.
MAX_CONNECTIONS = 32
MAX_CONNECTIONS_PER_CLIENT = 8
MAX_REQUEST_LINE = 8 * 1024
MAX_HEADER_BYTES = 32 * 1024
MAX_START_REQUESTS = 20
MAX_EVENT_ID = 100
MAX_TEXT = 200
ALLOWED_FIELDS = frozenset({"StartRequests", "approver", "reason", "DocumentIncarnation", "ResourceId"})
# After an early answer (413, 429, ...) the unread body is drained a little so the client sees
# the answer instead of a connection reset; never more than this, never longer than LINGER_SECONDS.
LINGER_BYTES = 256 * 1024
LINGER_SECONDS = 1.0


@dataclass(frozen=True)
class ApprovalRequest:
    """A verified, well-formed approval request: what ``decide`` gets."""

    event_ids: tuple[str, ...]
    approver: str | None
    reason: str | None
    client: str
    message_id: str


@dataclass(frozen=True)
class Verdict:
    """The answer ``decide`` wants sent: HTTP status and a JSON object."""

    status: int
    body: dict[str, Any]


class _Refusal(Exception):
    """Answer with a refusal: status, snake_case reason, human detail, extra headers."""

    def __init__(self, status: int, reason: str, detail: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.reason = reason
        self.detail = detail
        self.headers = headers or {}


class _TokenBuckets:
    """Per-client token buckets: ``rate`` requests per minute, bursts up to ``rate``."""

    MAX_CLIENTS = 4096

    def __init__(self, rate_per_minute: float, clock: Callable[[], float]) -> None:
        self._capacity = max(1.0, float(rate_per_minute))
        self._refill = max(float(rate_per_minute), 1e-9) / 60.0
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, at)

    def take(self, client: str) -> float | None:
        """Spend a token: None when admitted, else the seconds until the next token."""
        with self._lock:
            now = self._clock()
            tokens, at = self._buckets.get(client, (self._capacity, now))
            # A clock stepping back must not mint or burn tokens.
            tokens = min(self._capacity, tokens + max(0.0, now - at) * self._refill)
            if tokens >= 1.0:
                self._buckets[client] = (tokens - 1.0, now)
                self._prune(now)
                return None
            self._buckets[client] = (tokens, now)
            return (1.0 - tokens) / self._refill

    def _prune(self, now: float) -> None:
        if len(self._buckets) <= self.MAX_CLIENTS:
            return
        # A bucket that has refilled completely is the same as no bucket.
        full = [c for c, (t, at) in self._buckets.items() if t + max(0.0, now - at) * self._refill >= self._capacity]
        for client in full:
            del self._buckets[client]


class _WatchedConnection:
    """One accepted connection as the watchdog sees it."""

    __slots__ = ("deadline", "reading", "sock", "timed_out")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.deadline = deadline
        self.reading = True
        self.timed_out = False


def _shut(sock: socket.socket, how: int) -> None:
    # The plain-socket shutdown, even on an SSLSocket: its own shutdown() drops the TLS state
    # under the feet of the thread still using it.
    try:
        socket.socket.shutdown(sock, how)
    except OSError:
        pass


class _Watchdog:
    """Cuts the read side of connections that have not delivered a whole request by their deadline.

    A per-recv socket timeout alone lets a client trickle one byte per timeout forever; this
    bounds the whole TLS handshake + headers + body to ``client_timeout``.
    """

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self._conns: set[_WatchedConnection] = set()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="approval-callback-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def register(self, sock: socket.socket, timeout: float) -> _WatchedConnection:
        conn = _WatchedConnection(sock, time.monotonic() + timeout)
        with self.cond:
            self._conns.add(conn)
            self.cond.notify()
        return conn

    def done_reading(self, conn: _WatchedConnection) -> None:
        with self.cond:
            conn.reading = False

    def unregister(self, conn: _WatchedConnection) -> None:
        with self.cond:
            self._conns.discard(conn)

    def stop(self) -> None:
        with self.cond:
            self._stopped = True
            for conn in self._conns:
                _shut(conn.sock, socket.SHUT_RDWR)
            self.cond.notify()
        if self._thread.is_alive():
            self._thread.join(5.0)

    def _run(self) -> None:
        with self.cond:
            while not self._stopped:
                now = time.monotonic()
                nearest: float | None = None
                for conn in self._conns:
                    if not conn.reading:
                        continue
                    if conn.deadline <= now:
                        conn.reading = False
                        conn.timed_out = True
                        # Read side only: the handler can still write a 408.
                        _shut(conn.sock, socket.SHUT_RD)
                    elif nearest is None or conn.deadline < nearest:
                        nearest = conn.deadline
                self.cond.wait(None if nearest is None else max(0.0, nearest - now) + 0.005)


class _HeaderBudget:
    """A readline-only view of the request stream that stops after ``limit`` bytes of headers."""

    def __init__(self, raw: io.BufferedIOBase, limit: int) -> None:
        self._raw = raw
        self._left = limit
        self.exceeded = False
        self.last = b""

    def readline(self, size: int = -1) -> bytes:
        if self._left <= 0:
            self.exceeded = True
            self.last = b""
            return b""
        want = self._left if size < 0 else min(size, self._left)
        line = self._raw.readline(want)
        self._left -= len(line)
        if self._left <= 0 and not line.endswith(b"\n"):
            self.exceeded = True
        self.last = line
        return line


class _HTTPServer(HttpServer):
    request_queue_size = 64
    owner: CallbackServer

    def process_request(self, request: Any, client_address: Any) -> None:
        self.owner._spawn(request, client_address)


def _client_text(address: Any) -> str:
    try:
        host, port = address[0], address[1]
    except (TypeError, IndexError):
        return str(address)
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


_client_host = client_key  # the unit of the per-client connection cap, as for every listener


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Two parsers may disagree on which duplicate wins; signed content must mean one thing.
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key[:40]!r}")
        result[key] = value
    return result


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _short(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "…")


def _optional_text(doc: dict[str, Any], key: str) -> str | None:
    value = doc.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise _Refusal(400, "invalid_body", f"{key} must be a string")
    if len(value) > MAX_TEXT:
        raise _Refusal(400, "invalid_body", f"{key} is longer than {MAX_TEXT} characters")
    if not value.isprintable():
        raise _Refusal(400, "invalid_body", f"{key} contains control characters")
    return value


def _parse_json(body: bytes) -> Any:
    try:
        return json.loads(body.decode("utf-8"), object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise _Refusal(400, "malformed_json", "body is not UTF-8") from None
    except RecursionError:
        raise _Refusal(400, "malformed_json", "body is nested too deeply") from None
    except ValueError as exc:
        raise _Refusal(400, "malformed_json", f"body is not valid JSON: {str(exc)[:120]}") from None


def _parse_event_ids(doc: Any) -> tuple[str, ...]:
    if not isinstance(doc, dict):
        raise _Refusal(400, "invalid_body", "body must be a JSON object")
    unknown = sorted(set(doc) - ALLOWED_FIELDS)
    if unknown:
        names = ", ".join(_short(k) for k in unknown[:5])
        raise _Refusal(400, "invalid_body", f"unknown field(s): {names}")
    requests = doc.get("StartRequests")
    if not isinstance(requests, list) or not 1 <= len(requests) <= MAX_START_REQUESTS:
        raise _Refusal(400, "invalid_body", f"StartRequests must be a list of 1 to {MAX_START_REQUESTS} objects")
    ids: list[str] = []
    for item in requests:
        if not isinstance(item, dict) or set(item) != {"EventId"}:
            raise _Refusal(400, "invalid_body", 'each StartRequests entry must be {"EventId": "..."}')
        event_id = item["EventId"]
        if not isinstance(event_id, str) or not event_id.strip() or len(event_id) > MAX_EVENT_ID:
            raise _Refusal(400, "invalid_body", f"EventId must be a non-empty string of at most {MAX_EVENT_ID} characters")
        if not event_id.isprintable():
            raise _Refusal(400, "invalid_body", "EventId contains control characters")
        if event_id not in ids:
            ids.append(event_id)
    incarnation = doc.get("DocumentIncarnation")
    if incarnation is not None and (not isinstance(incarnation, int) or isinstance(incarnation, bool) or incarnation < 0):
        raise _Refusal(400, "invalid_body", "DocumentIncarnation must be a non-negative integer")
    return tuple(ids)


def _check_target(named: Any, mine: str) -> None:
    """A validly signed approval for another VM (captured and replayed here) is refused."""
    if not isinstance(named, str) or not named.strip():
        raise _Refusal(422, "no_target_vm", "the approval must name its VM in ResourceId")
    if not mine or mine.startswith("/host/"):
        raise _Refusal(503, "identity_unknown", "this VM does not know its resourceId yet")
    if named.strip().lower() != mine.strip().lower():
        raise _Refusal(403, "wrong_vm", f"the approval is for another VM: {_short(named, 200)}")


class _Handler(QuietHandler):
    """Serves exactly one request per connection, then closes it."""

    server: _HTTPServer
    protocol_version = "HTTP/1.1"
    server_version = "sefwd-callback"
    logger = log
    log_label = "approval callback"

    def __init__(self, request: Any, client_address: Any, server: _HTTPServer, conn: _WatchedConnection) -> None:
        self.conn = conn
        self.owner = server.owner
        self.client = _client_text(client_address)
        self.admitted: bool | None = None
        self.responded = False
        self.received_anything = False
        self.body_read = False
        self.expect_continue = False
        self.event_ids: list[str] | None = None
        self.approver: str | None = None
        self.incarnation: int | None = None
        self.command = ""
        super().__init__(request, client_address, server)

    # -- BaseHTTPRequestHandler hooks --------------------------------------------------------------
    def handle(self) -> None:
        self.close_connection = True
        try:
            self._serve()
        except _Refusal as refusal:
            self._refuse(refusal)
        except TimeoutError:
            self._refuse(_Refusal(408, "client_timeout", "the request was not received in time"))
        except OSError as exc:  # ssl.SSLError included
            if self.conn.timed_out:
                self._refuse(_Refusal(408, "client_timeout", "the request was not received in time"))
            elif self.received_anything and not self.responded:
                self._refuse(_Refusal(400, "incomplete_request", f"connection failed mid-request: {type(exc).__name__}"))
            else:
                log.debug("approval callback: connection from %s failed: %s", self.client, type(exc).__name__)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # parse_request reports protocol errors here: answer them like every other refusal.
        reason = "headers_too_large" if code == 431 else "bad_request"
        raise _Refusal(int(code), reason, (message or HTTPStatus(code).phrase)[:200])

    def handle_expect_100(self) -> bool:
        # "100 Continue" only once the size and rate checks have passed.
        self.expect_continue = True
        return True

    # -- the checks, in order ------------------------------------------------------------------------
    def _serve(self) -> None:
        raw = self.rfile.readline(MAX_REQUEST_LINE + 1)
        if not raw:
            if self.conn.timed_out:
                raise _Refusal(408, "client_timeout", "no request received in time")
            return  # connected and left without a word: not a request
        self.received_anything = True
        if len(raw) > MAX_REQUEST_LINE:
            raise _Refusal(414, "bad_request", "request line too long")
        if not raw.endswith(b"\n"):
            self._incomplete()
        self.raw_requestline = raw
        stream = self.rfile
        budget = _HeaderBudget(stream, MAX_HEADER_BYTES)
        self.rfile = budget  # type: ignore[assignment]
        try:
            parsed = self.parse_request()
        finally:
            self.rfile = stream
        if not parsed:
            raise _Refusal(400, "bad_request", "empty request line")
        if budget.exceeded:
            raise _Refusal(431, "headers_too_large", f"request headers exceed {MAX_HEADER_BYTES} bytes")
        if budget.last not in (b"\r\n", b"\n"):
            self._incomplete()
        self._admit()
        if self.request_version == "HTTP/0.9":
            raise _Refusal(400, "bad_request", "HTTP/1.0 or HTTP/1.1 required")
        try:
            path = urlsplit(self.path).path
        except ValueError:
            path = ""
        if path != PATH:
            raise _Refusal(404, "not_found", f"no such endpoint; use POST {PATH}")
        if self.command != "POST":
            raise _Refusal(405, "method_not_allowed", f"use POST {PATH}", {"Allow": "POST"})
        length = self._content_length()
        if self.expect_continue:
            self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self.wfile.flush()
        body = self.rfile.read(length) if length else b""
        if len(body) < length:
            self._incomplete()
        self.body_read = True
        self.owner._watchdog.done_reading(self.conn)
        self.owner._handle_body(self, body)

    def _incomplete(self) -> None:
        if self.conn.timed_out:
            raise _Refusal(408, "client_timeout", "the request was not received in time")
        raise _Refusal(400, "incomplete_request", "the connection ended before the request was complete")

    def _admit(self) -> None:
        if self.admitted is not None:
            return
        retry_after = self.owner._buckets.take(_client_host(self.client_address))  # (IPv6: the /64)
        self.admitted = retry_after is None
        if retry_after is not None:
            seconds = max(1, math.ceil(retry_after))
            raise _Refusal(429, "rate_limited", f"too many requests; retry in {seconds}s", {"Retry-After": str(seconds)})

    def _content_length(self) -> int:
        if self.headers.get_all("Transfer-Encoding"):
            raise _Refusal(411, "length_required", "Transfer-Encoding is not supported: send a Content-Length")
        values = {v.strip() for v in self.headers.get_all("Content-Length") or []}
        if not values:
            raise _Refusal(411, "length_required", "Content-Length is required")
        if len(values) != 1:
            raise _Refusal(400, "bad_request", "conflicting Content-Length headers")
        text = values.pop()
        if not text.isdigit() or not text.isascii() or len(text) > 18:
            raise _Refusal(400, "bad_request", "invalid Content-Length")
        length = int(text)
        if length > self.owner.settings.max_body:
            raise _Refusal(413, "body_too_large", f"body exceeds {self.owner.settings.max_body} bytes")
        return length

    # -- answers --------------------------------------------------------------------------------------
    def _refuse(self, refusal: _Refusal) -> None:
        if self.admitted is None:
            # Every request spends a token, malformed and timed-out ones too: that bounds the audit
            # records one client can cause.
            try:
                self._admit()
            except _Refusal as limited:
                refusal = limited
        self.owner._refused(self, refusal)
        self._respond(refusal.status, {"status": "refused", "reason": refusal.reason, "detail": refusal.detail}, refusal.headers)

    def _respond(self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        if self.responded:
            return
        payload = json.dumps(body, ensure_ascii=False).encode("utf-8")
        self.responded = True
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = ""
        lines = [
            f"HTTP/1.1 {status} {phrase}",
            f"Date: {email.utils.formatdate(usegmt=True)}",
            f"Server: {self.server_version}",
            "Content-Type: application/json",
            f"Content-Length: {len(payload)}",
            "Cache-Control: no-store",
            "Connection: close",
        ]
        lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        try:
            self.wfile.write(head + (b"" if self.command == "HEAD" else payload))
            self.wfile.flush()
        except OSError as exc:
            log.debug("approval callback: could not answer %s: %s", self.client, type(exc).__name__)


class CallbackServer:
    """The ``POST /approvals`` endpoint; ``decide`` is called only for verified, well-formed requests."""

    def __init__(
        self,
        settings: CallbackSettings,
        decide: Callable[[ApprovalRequest], Verdict],
        audit: Callable[[dict[str, Any]], None],
        replay_path: Path,
        *,
        clock: Callable[[], float] = time.time,
        max_connections: int = MAX_CONNECTIONS,
        max_per_client: int = MAX_CONNECTIONS_PER_CLIENT,
        identity: Callable[[], str] | None = None,
    ) -> None:
        if not settings.keys:
            raise ConfigError(["approval.callback: at least one secret is required"])
        if (settings.tls_cert is None) != (settings.tls_key is None):
            raise ConfigError(["approval.callback: set both tls_cert and tls_key, or neither"])
        self.settings = settings
        self._decide = decide
        self._audit = audit
        # This VM's identity (its records' source, the resourceId): the agent always passes it, and
        # then a signed request must name this VM in "ResourceId" (docs/security-model.md).
        self._identity = identity
        self._replay_path = Path(replay_path)
        self._clock = clock
        self._max_connections = max_connections
        self._max_per_client = max(1, min(max_per_client, max_connections - 1))
        self._open: dict[str, int] = {}  # client address -> connections being served
        self._open_lock = threading.Lock()
        self._buckets = _TokenBuckets(settings.rate_limit, clock)
        self._watchdog: _Watchdog = _Watchdog()
        self._tls = self._tls_context() if settings.tls_cert is not None else None
        self._log_lock = threading.Lock()
        self._warnings = RateLimitedLog(log, 60.0)
        self._threads: set[threading.Thread] = set()
        self._threads_lock = threading.Lock()
        self._replay: ReplayCache | None = None
        self._server: _HTTPServer | None = None
        self.url = ""

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> Self:
        """Open the replay cache, bind and serve in background threads; returns self."""
        if self._server is not None:
            return self
        # Entries older than twice the tolerance would be refused as stale anyway.
        self._replay = ReplayCache(self._replay_path, 2 * self.settings.tolerance, self._clock)
        host = self.settings.host
        try:
            # The handler class is never used by socketserver: process_request hands connections to _spawn.
            server = _HTTPServer((host, self.settings.port), _Handler)
        except OSError as exc:
            self._replay.close()
            raise ForwarderError(
                f"approval callback cannot listen on {host_port_text(host, self.settings.port)}: "
                f"{exc.strerror or exc}"
            ) from None
        server.owner = self
        self._server = server
        self._watchdog = _Watchdog()
        self._watchdog.start()
        server.start("approval-callback", poll_interval=0.05)
        self.url = server.url("https" if self._tls is not None else "http")
        log.info("approval callback listening on %s%s%s", self.url, PATH,
                 "" if server.loopback else " (not loopback: reachable from the network)")
        return self

    def stop(self) -> None:
        """Stop accepting, cut open connections, wait briefly for handlers, close the cache."""
        server, self._server = self._server, None
        if server is None:
            return
        server.stop()
        self._watchdog.stop()
        deadline = time.monotonic() + self.settings.client_timeout + LINGER_SECONDS + 1.0
        with self._threads_lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if self._replay is not None:
            self._replay.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- connections --------------------------------------------------------------------------------
    def _tls_context(self) -> ssl.SSLContext:
        assert self.settings.tls_cert is not None and self.settings.tls_key is not None
        try:
            return tls_server_context(self.settings.tls_cert, self.settings.tls_key)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError([f"approval.callback: cannot load tls_cert/tls_key: {exc}"]) from None

    def _take_slot(self, host: str) -> str | None:
        """Reserve a connection slot for ``host``: None if taken, else why not."""
        with self._open_lock:
            if self._open.get(host, 0) >= self._max_per_client:
                return "client"
            if sum(self._open.values()) >= self._max_connections:
                return "busy"
            self._open[host] = self._open.get(host, 0) + 1
            return None

    def _release_slot(self, host: str) -> None:
        with self._open_lock:
            left = self._open.get(host, 0) - 1
            if left > 0:
                self._open[host] = left
            else:
                self._open.pop(host, None)

    def _spawn(self, sock: socket.socket, address: Any) -> None:
        """Runs on the accept loop: must never block."""
        host = _client_host(address)
        refused = self._take_slot(host)
        if refused == "client":
            self._warn("busy_client", "approval callback: %s already has %d connections open, dropping another",
                       host, self._max_per_client)
            sock.close()
            return
        if refused == "busy":
            self._warn("busy", "approval callback: %d connections open, dropping one from %s",
                       self._max_connections, _client_text(address))
            sock.close()
            return
        thread = threading.Thread(target=self._connection, args=(sock, address), name="approval-callback-conn", daemon=True)
        with self._threads_lock:
            self._threads.add(thread)
        try:
            thread.start()
        except RuntimeError:
            with self._threads_lock:
                self._threads.discard(thread)
            self._release_slot(host)
            sock.close()

    def _connection(self, sock: socket.socket, address: Any) -> None:
        conn = self._watchdog.register(sock, self.settings.client_timeout)
        handler: _Handler | None = None
        try:
            sock.settimeout(self.settings.client_timeout)
            if self._tls is not None:
                with self._watchdog.cond:
                    conn.sock = self._tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
                assert isinstance(conn.sock, ssl.SSLSocket)
                try:
                    # In this thread, under the deadline: a silent client cannot stall the accept loop.
                    conn.sock.do_handshake()
                except (OSError, ValueError) as exc:
                    self._handshake_failed(conn, address, exc)
                    return
            server = self._server
            if server is not None:
                handler = _Handler(conn.sock, address, server, conn)
        except Exception:
            log.exception("approval callback: unexpected error serving %s", _client_text(address))
        finally:
            self._watchdog.unregister(conn)
            self._close(conn.sock, drain=handler is not None and not handler.body_read)
            self._release_slot(_client_host(address))
            with self._threads_lock:
                self._threads.discard(threading.current_thread())

    def _handshake_failed(self, conn: _WatchedConnection, address: Any, exc: BaseException) -> None:
        client = _client_text(address)
        if conn.timed_out or isinstance(exc, TimeoutError):
            refusal = _Refusal(408, "client_timeout", "TLS handshake not completed in time")
            if self._buckets.take(str(address[0])) is None:
                self._audit_refusal(refusal, client, None, None, None)
            self._warn("client_timeout", "approval callback refused %s: %s", client, refusal.detail)
        else:
            self._warn("tls", "approval callback: TLS handshake with %s failed: %s", client, type(exc).__name__)

    def _close(self, sock: socket.socket, *, drain: bool) -> None:
        _shut(sock, socket.SHUT_WR)
        if drain:
            deadline = time.monotonic() + LINGER_SECONDS
            left = LINGER_BYTES
            try:
                while left > 0:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    sock.settimeout(remaining)
                    chunk = socket.socket.recv(sock, min(65536, left))  # raw bytes: nothing to decrypt
                    if not chunk:
                        break
                    left -= len(chunk)
            except OSError:
                pass
        try:
            sock.close()
        except OSError:
            pass

    # -- verification and decision -------------------------------------------------------------------
    def _handle_body(self, handler: _Handler, body: bytes) -> None:
        """Signature, replay, shape, then ``decide``; raises _Refusal."""
        try:
            headers = cast(Mapping[str, str], handler.headers)  # verify only needs items(), repeats included
            msg_id = verify(self.settings.keys, headers, body, now=self._clock(), tolerance=self.settings.tolerance)
        except SignatureError as exc:
            raise _Refusal(401, exc.reason, str(exc)) from None
        assert self._replay is not None
        if self._replay.signed_before_loss(float(handler.headers.get("webhook-timestamp") or 0)):
            raise _Refusal(409, "replay_cache_lost", "signed before the replay cache was lost; sign it again")
        try:
            fresh = self._replay.add_if_new(msg_id)
        except StateError as exc:
            log.error("approval callback: %s", exc)
            raise _Refusal(500, "internal_error", "replay cache unavailable") from None
        if not fresh:
            raise _Refusal(409, "replayed_id", "this webhook-id was already used")
        doc = _parse_json(body)
        handler.event_ids = list(_parse_event_ids(doc))
        handler.incarnation = doc.get("DocumentIncarnation")
        handler.approver = _optional_text(doc, "approver")
        reason = _optional_text(doc, "reason")
        if self._identity is not None:
            _check_target(doc.get("ResourceId"), self._identity())
        request = ApprovalRequest(tuple(handler.event_ids), handler.approver, reason, handler.client, msg_id)
        try:
            verdict = self._decide(request)
            if not isinstance(verdict, Verdict) or not isinstance(verdict.status, int) or not 200 <= verdict.status <= 599:
                raise TypeError(f"decide returned {type(verdict).__name__}, not a Verdict with a 2xx-5xx status")
            handler._respond(verdict.status, dict(verdict.body))
        except Exception as exc:
            if handler.responded:
                raise
            log.exception("approval callback: decide failed for %s: %s", handler.client, type(exc).__name__)
            raise _Refusal(500, "internal_error", "internal error") from exc

    def _refused(self, handler: _Handler, refusal: _Refusal) -> None:
        self._audit_refusal(refusal, handler.client, handler.event_ids, handler.approver, handler.incarnation)
        self._warn(refusal.reason, "approval callback refused %s: %d %s (%s)",
                   handler.client, refusal.status, refusal.reason, refusal.detail)

    def _audit_refusal(
        self, refusal: _Refusal, client: str, event_ids: list[str] | None, approver: str | None, incarnation: int | None,
    ) -> None:
        detail = refusal.detail
        if refusal.reason == "internal_error" and refusal.__cause__ is not None:
            detail = f"{type(refusal.__cause__).__name__}: {refusal.__cause__}"[:500]
        record: dict[str, Any] = {
            "EventId": event_ids[0] if event_ids and len(event_ids) == 1 else None,
            "EventIds": list(event_ids) if event_ids else None,
            "Outcome": "refused",
            "Actor": "callback",
            "Approver": approver,
            "Rule": None,
            "Reason": refusal.reason,
            "Detail": detail,
            "Client": client,
            "HttpStatus": refusal.status,
            "ImdsStatus": None,
            "Hook": None,
            "DocumentIncarnation": incarnation,
        }
        try:
            self._audit(record)
        except Exception:
            log.exception("approval callback: audit failed")

    def _warn(self, key: str, msg: str, *args: object) -> None:
        with self._log_lock:
            self._warnings.log(logging.WARNING, key, msg, *args)
