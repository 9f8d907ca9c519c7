"""The maintenance probe: ``GET``/``HEAD <path>`` → 200 while serving, 503 while in maintenance.

For load-balancer health probes (Azure Load Balancer, Application Gateway) and readiness checks.
The answer comes from :class:`forwarder.agent.maintenance.MaintenanceTracker` (the committed
document and the clock; no IMDS request) as whole response bytes, rendered at most once a second
or when the state changes, so a probe costs one read and one write.

Each connection carries one request and is closed after the answer. A request that is there within
half a millisecond of the accept (a load balancer's always is) is answered on the accept loop, with
no thread; a slower one gets a thread of its own. Abuse is bounded the way the
approval callback bounds it: a whole request head must arrive within ``client_timeout`` (a client
trickling bytes is cut off), at most ``max_per_client`` connections per client address (more are
closed at once, without a thread), and at most ``max_connections`` in all — when full, the
connection that has waited longest without finishing its request is cut to make room, so idle
connections from many addresses cannot lock the load balancer's probe out.
"""
from __future__ import annotations

import email.utils
import logging
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from forwarder.agent.maintenance import MaintenancePolicy, MaintenanceTracker, StateFile, default_state_file
from forwarder.common.http_server import HttpServer, QuietHandler, client_key, host_port_text
from forwarder.common.logs import RateLimitedLog
from forwarder.errors import ConfigError
from forwarder.records import utcnow

if TYPE_CHECKING:
    from forwarder.agent.config import ProbeConfig
    from forwarder.imds.document import Document
    from forwarder.imds.identity import VmIdentity

log = logging.getLogger(__name__)

MAX_HEAD = 4096  # a probe's request line and headers; more is refused with 431
CLIENT_TIMEOUT = 3.0
MAX_CONNECTIONS = 64
MAX_CONNECTIONS_PER_CLIENT = 8
FIRST_BYTES_WAIT = 0.0005  # seconds the accept loop waits for a request before handing the connection to a thread


@dataclass(frozen=True)
class Answer:
    """One rendered answer: the whole response for GET and for HEAD, and until when it holds."""

    status: int
    body: bytes
    get: bytes
    head: bytes
    generation: object
    rendered_at: datetime
    valid_until: datetime


def _response(status: int, body: bytes, content_type: str, now: datetime, extra: str = "") -> tuple[bytes, bytes]:
    phrase = {200: "OK", 503: "Service Unavailable", 404: "Not Found", 405: "Method Not Allowed",
              400: "Bad Request", 408: "Request Timeout", 431: "Request Header Fields Too Large"}[status]
    head = (f"HTTP/1.1 {status} {phrase}\r\nDate: {email.utils.format_datetime(now, usegmt=True)}\r\n"
            f"Server: sefwd-probe\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            f"Cache-Control: no-store\r\nConnection: close\r\n{extra}\r\n").encode("latin-1")
    return head + body, head


class _Conn:
    __slots__ = ("host", "reading", "sock", "started")

    def __init__(self, sock: socket.socket, host: str) -> None:
        self.sock = sock
        self.host = host
        self.started = time.monotonic()
        self.reading = True


class _Server(HttpServer):
    request_queue_size = 128
    owner: ProbeServer

    def process_request(self, request: Any, client_address: Any) -> None:
        self.owner._admit(request, client_address)

    def close_connections(self) -> None:
        self.owner._cut_all()


class _Handler(QuietHandler):
    """Reads one request head within the deadline, answers from the rendered bytes, closes."""

    server: _Server
    logger = log
    log_label = "probe"

    def setup(self) -> None:  # no buffered files: the socket is read directly
        pass

    def finish(self) -> None:
        pass

    def handle(self) -> None:
        owner = self.server.owner
        sock: socket.socket = self.request
        head = _read_head(sock, time.monotonic() + owner.client_timeout, owner._prefixes.get(sock, b""))
        owner._done_reading(sock)
        if head is None:
            return
        status, data = owner.route(head)
        try:
            sock.settimeout(owner.client_timeout)
            sock.sendall(data)
        except OSError as exc:
            log.debug("probe: could not answer %s: %s", self.client_address, type(exc).__name__)
        else:
            self.log_request(status)

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        if self.logger.isEnabledFor(logging.DEBUG):
            self.log_message("%s", code)


def _read_head(sock: socket.socket, deadline: float, buf: bytes = b"") -> bytes | None:
    """The request head (up to the blank line), b"" if too large, None if none came in time or the peer left."""
    while b"\r\n\r\n" not in buf and b"\n\n" not in buf:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        try:
            sock.settimeout(remaining)
            chunk = sock.recv(MAX_HEAD + 1 - len(buf))
        except OSError:
            return None
        if not chunk:
            return None
        buf += chunk
        if len(buf) > MAX_HEAD:
            return b""
    return buf


class ProbeServer:
    """The probe endpoint over one :class:`MaintenanceTracker`."""

    def __init__(self, tracker: MaintenanceTracker, host: str, port: int, path: str = "/maintenance", *,
                 clock: Callable[[], datetime] = utcnow, client_timeout: float = CLIENT_TIMEOUT,
                 max_connections: int = MAX_CONNECTIONS, max_per_client: int = MAX_CONNECTIONS_PER_CLIENT) -> None:
        self.tracker = tracker
        self.host, self.port, self.path = host, port, path
        self.clock = clock
        self.client_timeout = client_timeout
        self.max_connections = max(1, max_connections)
        self.max_per_client = max(1, min(max_per_client, self.max_connections))
        self._answer: Answer | None = None
        self._render_lock = threading.Lock()
        self._conns: dict[socket.socket, _Conn] = {}
        self._prefixes: dict[socket.socket, bytes] = {}  # bytes read on the accept loop, for the handler
        self._conns_lock = threading.Lock()
        self._server: _Server | None = None
        self._warnings = RateLimitedLog(log, 60.0)
        self.evicted = 0  # connections cut to make room (counted for tests and status)
        self.refused = 0  # connections closed at once: their client had max_per_client open
        now = clock()
        self._errors = {code: _response(code, text, "text/plain; charset=utf-8", now, extra)
                        for code, text, extra in (
                            (404, f"not found: the probe is GET {path}\n".encode(), ""),
                            (405, f"use GET or HEAD {path}\n".encode(), "Allow: GET, HEAD\r\n"),
                            (400, b"bad request\n", ""),
                            (431, b"request head too large\n", ""))}

    # -- answers ------------------------------------------------------------------------------------
    def answer(self, now: datetime | None = None) -> Answer:
        """The current answer, re-rendered only when the state or the second changed."""
        now = now or self.clock()
        answer = self._answer
        tracker = self.tracker
        if (answer is not None and answer.generation is tracker.generation
                and answer.rendered_at <= now < answer.valid_until):
            return answer
        with self._render_lock:
            generation = tracker.generation
            view = tracker.view(now)
            status = 200 if view.serving else 503
            body = orjson.dumps(view.as_dict(), option=orjson.OPT_APPEND_NEWLINE)
            get, head = _response(status, body, "application/json", now)
            valid = now.replace(microsecond=0) + timedelta(seconds=1)
            if view.changes_at is not None:
                valid = min(valid, view.changes_at)
            self._answer = answer = Answer(status, body, get, head, generation, now, valid)
        return answer

    def route(self, head: bytes) -> tuple[int, bytes]:
        """(status, response bytes) for one request head."""
        if not head:
            return 431, self._errors[431][0]
        line = head.split(b"\n", 1)[0].rstrip(b"\r")
        parts = line.split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            return 400, self._errors[400][0]
        method, target = parts[0], parts[1].split(b"?", 1)[0]
        if target != self.path.encode():
            return 404, self._errors[404][1 if method == b"HEAD" else 0]
        if method == b"GET":
            answer = self.answer()
            return answer.status, answer.get
        if method == b"HEAD":
            answer = self.answer()
            return answer.status, answer.head
        return 405, self._errors[405][0]

    # -- connections --------------------------------------------------------------------------------
    def _admit(self, sock: socket.socket, address: Any) -> None:
        """On the accept loop: never blocks."""
        host = client_key(address)
        victim: _Conn | None = None
        with self._conns_lock:
            mine = sum(1 for c in self._conns.values() if c.host == host)
            if mine >= self.max_per_client:
                self.refused += 1
                refuse = True
            else:
                refuse = False
                if len(self._conns) >= self.max_connections:
                    waiting = [c for c in self._conns.values() if c.reading]
                    if waiting:
                        victim = min(waiting, key=lambda c: c.started)
                        victim.reading = False
                        self.evicted += 1
                self._conns[sock] = _Conn(sock, host)
        if refuse:
            self._warnings.log(logging.WARNING, "client", "probe: %s already has %d connections open, closing another",
                               host, self.max_per_client)
            _close(sock)
            return
        if victim is not None:
            self._warnings.log(logging.WARNING, "full", "probe: %d connections open, cutting the one waiting longest "
                               "(from %s)", self.max_connections, victim.host)
            _shut(victim.sock, socket.SHUT_RDWR)
        prefix = self._answer_at_once(sock, address)
        if prefix is None:
            return
        thread = threading.Thread(target=self._serve, args=(sock, address, prefix), name="probe-conn", daemon=True)
        try:
            thread.start()
        except RuntimeError:
            self._forget(sock)
            _close(sock)

    def _answer_at_once(self, sock: socket.socket, address: Any) -> bytes | None:
        """The common case without a thread: the whole request is already here and the answer fits the
        socket's buffer. None when answered (and closed); else what was read, for the handler thread."""
        try:
            sock.setblocking(False)
            try:
                head = sock.recv(MAX_HEAD + 1)
            except (BlockingIOError, InterruptedError):
                # The request usually follows the handshake within microseconds: a short look saves a thread.
                select.select([sock], [], [], FIRST_BYTES_WAIT)
                head = sock.recv(MAX_HEAD + 1)
        except (BlockingIOError, InterruptedError):
            head = b""
        except OSError:
            self._forget(sock)
            _close(sock)
            return None
        finally:
            sock.setblocking(True)
        if not (head and (b"\r\n\r\n" in head or b"\n\n" in head or len(head) > MAX_HEAD)):
            return head  # nothing yet, or a part: the handler thread waits for the rest under the deadline
        status, data = self.route(head if len(head) <= MAX_HEAD else b"")
        try:
            sock.setblocking(False)
            sent = sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            sent = len(data)  # the client left: nothing more to say
        finally:
            sock.setblocking(True)
        if sent < len(data):  # a full send buffer on a fresh socket: let a thread finish, under the deadline
            threading.Thread(target=self._finish_send, args=(sock, data[sent:]), name="probe-send", daemon=True).start()
            return None
        log.debug("probe %s: %s", address, status)
        self._forget(sock)
        _close(sock)
        return None

    def _finish_send(self, sock: socket.socket, rest: bytes) -> None:
        try:
            sock.settimeout(self.client_timeout)
            sock.sendall(rest)
        except OSError:
            pass
        finally:
            self._forget(sock)
            _close(sock)

    def _serve(self, sock: socket.socket, address: Any, prefix: bytes = b"") -> None:
        try:
            server = self._server
            if server is not None:
                self._prefixes[sock] = prefix
                _Handler(sock, address, server)
        except Exception:
            log.exception("probe: unexpected error serving %s", address)
        finally:
            self._prefixes.pop(sock, None)
            self._forget(sock)
            _close(sock)

    def _done_reading(self, sock: socket.socket) -> None:
        with self._conns_lock:
            conn = self._conns.get(sock)
            if conn is not None:
                conn.reading = False

    def _forget(self, sock: socket.socket) -> None:
        with self._conns_lock:
            self._conns.pop(sock, None)

    def open_connections(self) -> int:
        with self._conns_lock:
            return len(self._conns)

    # -- lifecycle ----------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        server = self._server
        return (server.url() if server is not None else f"http://{host_port_text(self.host, self.port)}") + self.path

    def start(self) -> ProbeServer:
        if self._server is not None:
            return self
        try:
            server = _Server((self.host, self.port), _Handler)
        except OSError as exc:
            raise ConfigError([f"probe.listen {host_port_text(self.host, self.port)}: cannot listen: "
                               f"{exc.strerror or exc}"]) from None
        server.owner = self
        self._server = server
        self.port = server.port
        self.answer()
        server.start("maintenance-probe", poll_interval=0.2)
        log.info("maintenance probe on %s (200 while serving, 503 in maintenance)", self.url)
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.stop()

    def _cut_all(self) -> None:
        with self._conns_lock:
            open_socks = list(self._conns)
        for sock in open_socks:
            _shut(sock, socket.SHUT_RDWR)


def _shut(sock: socket.socket, how: int) -> None:
    try:
        sock.shutdown(how)
    except OSError:
        pass


def _close(sock: socket.socket) -> None:
    _shut(sock, socket.SHUT_WR)
    sock.close()  # socket.close() does not raise for a socket already closed


class Maintenance:
    """The maintenance state of a running agent: tracker, state file and probe, as [probe] asks."""

    def __init__(self, tracker: MaintenanceTracker, state_file: StateFile | None, probe: ProbeServer | None) -> None:
        self.tracker = tracker
        self.state_file = state_file
        self.probe = probe

    @classmethod
    def from_config(cls, config: ProbeConfig, vm: Callable[[], VmIdentity], state_dir: Path, *,
                    refresh: float) -> Maintenance:
        policy = MaintenancePolicy(
            event_types=frozenset(config.event_types) if config.event_types is not None else None,
            lead=config.lead, settle=config.settle)
        tracker = MaintenanceTracker(policy, vm)
        state_file = None
        if config.enabled:
            state_file = StateFile(config.state_file or default_state_file(state_dir), refresh)
            tracker.add_listener(state_file)
        probe = None
        if config.listen is not None:
            probe = ProbeServer(tracker, config.listen[0], config.listen[1], config.path)
        return cls(tracker, state_file, probe)

    def start(self, document: Document | None) -> Maintenance:
        """Seed with the saved document (the state is right before the first poll), then listen."""
        self.tracker.observe(document)
        if self.probe is not None:
            try:
                self.probe.start()
            except BaseException:
                if self.state_file is not None:
                    self.state_file.remove()
                raise
        return self

    def stop(self) -> None:
        """Stop answering; remove the state file (no file, like no answer, says no agent)."""
        if self.probe is not None:
            self.probe.stop()
        if self.state_file is not None:
            self.state_file.remove()
