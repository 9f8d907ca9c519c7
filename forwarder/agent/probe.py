"""The maintenance probe: ``GET``/``HEAD <path>`` → 200 while serving, 503 while in maintenance.

For load-balancer health probes (Azure Load Balancer, Application Gateway) and readiness checks.
The answer comes from :class:`forwarder.agent.maintenance.MaintenanceTracker` (the committed
document and the clock; no IMDS request) as whole response bytes, rendered at most once a second
or when the state changes, so a probe costs one read and one write.

Each connection carries one request and is closed after the answer. A request that is there within
half a millisecond of the accept (a load balancer's always is) is answered on the accept loop, with
no thread (the server base's ``serve_at_once``); a slower one gets a thread of its own. Abuse is
bounded by the server base's ``ConnectionLimits``, as for every listener: a whole request head must
arrive within ``client_timeout`` of the accept (a client trickling bytes is cut off), at most
``max_per_client`` connections per client (more are closed at once, without a thread), and at most
``max_connections`` in all — when full, the connection that has waited longest without finishing
its request is cut to make room (``cut_oldest_when_full``), so idle connections from many
addresses cannot lock the load balancer's probe out.
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
from forwarder.common.http_server import ConnectionLimits, HttpServer, QuietHandler
from forwarder.common.listen import host_port_text
from forwarder.errors import StartError
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


class _Server(HttpServer):
    # A burst of connects (hundreds of idle ones, or many probers at once) waits in the kernel's
    # backlog, which holds no thread, while the accept loop cuts the oldest: with 128 the burst
    # overflowed it and a dropped SYN (a load balancer's probe too) was retried only after 1 s.
    request_queue_size = 1024
    owner: ProbeServer

    def serve_at_once(self, request: Any, client_address: Any) -> bool:
        return self.owner._answer_at_once(request, client_address)


class _Handler(QuietHandler):
    """Finishes what the accept loop began: reads the rest of the request head (the base's deadline
    cuts a slow one) or sends the rest of an answer, then the base closes the connection."""

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
        read, rest = owner._pending.pop(sock, (b"", b""))
        if rest:  # the request was read on the accept loop: not a connection waiting for its request
            self.server.head_received(sock)
            self._send(owner, sock, rest)
            return
        head = _read_head(sock, time.monotonic() + owner.client_timeout, read)
        self.server.head_received(sock)
        if head is None:
            return
        status, data = owner.route(head)
        if self._send(owner, sock, data):
            self.log_request(status)

    def _send(self, owner: ProbeServer, sock: socket.socket, data: bytes) -> bool:
        try:
            sock.settimeout(owner.client_timeout)
            sock.sendall(data)
        except OSError as exc:
            log.debug("probe: could not answer %s: %s", self.client_address, type(exc).__name__)
            return False
        return True

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
        self.limits = ConnectionLimits(max_connections=self.max_connections, max_per_client=self.max_per_client,
                                       request_timeout=client_timeout, cut_oldest_when_full=True)
        self._answer: Answer | None = None
        self._render_lock = threading.Lock()
        # (bytes read, bytes left to send) by the accept loop, for the handler thread that finishes the job
        self._pending: dict[socket.socket, tuple[bytes, bytes]] = {}
        self._server: _Server | None = None
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

    # -- connections (admission, deadlines and caps: the server base's ConnectionLimits) --------------
    def _answer_at_once(self, sock: socket.socket, address: Any) -> bool:
        """On the accept loop, never blocking: the common case without a thread, where the whole request
        is already here and the answer fits the socket's buffer. True when answered (or the client
        left); False hands the connection to a thread with what was read or what is left to send."""
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
            return True
        finally:
            sock.setblocking(True)
        if not (head and (b"\r\n\r\n" in head or b"\n\n" in head or len(head) > MAX_HEAD)):
            if head:
                self._pending[sock] = (head, b"")
            return False  # nothing yet, or a part: the handler thread waits for the rest under the deadline
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
        if sent < len(data):  # a full send buffer on a fresh socket: a thread finishes, under the deadline
            self._pending[sock] = (b"", data[sent:])
            return False
        log.debug("probe %s: %s", address, status)
        return True

    @property
    def refused(self) -> int:
        """Connections closed at once: their client had ``max_per_client`` open, or none could be cut."""
        server = self._server
        return server.refused_connections if server is not None else 0

    @property
    def evicted(self) -> int:
        """Connections cut to make room for a new one (the one waiting longest for its request)."""
        server = self._server
        return server.cut_connections if server is not None else 0

    def open_connections(self) -> int:
        server = self._server
        return server.open_connections() if server is not None else 0

    # -- lifecycle ----------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        server = self._server
        return (server.url() if server is not None else f"http://{host_port_text(self.host, self.port)}") + self.path

    def start(self) -> ProbeServer:
        from forwarder.agent.preflight import listen_problem

        if self._server is not None:
            return self
        try:
            server = _Server((self.host, self.port), _Handler, self.limits)
        except OSError as exc:
            raise StartError([f"probe.listen {host_port_text(self.host, self.port)}: cannot listen: "
                              f"{listen_problem(exc, self.port)}"]) from None
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
