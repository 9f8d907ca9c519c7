"""The one small HTTP-server base of the agent's servers: approval callback, telemetry, maintenance probe, emulator.

What they share lives here, once (the ``host:port`` listen parser and the TLS context, which a config
check needs without a server, are in forwarder.common.listen): the address family taken from
the parsed host, binding without a reverse-DNS lookup, the loopback decision (forwarder.common.loopback,
on resolved addresses), one quiet
``log_message`` (the module's logger, at debug), daemon threads, and start/stop in a background
thread, and the connection limits every listener has (``ConnectionLimits``: total and
per-client connection caps, a deadline for each request's headers, an idle timeout per read,
and optionally cutting the connection that has waited longest for its request when all slots
are taken). A server may answer a connection on the accept loop itself (``serve_at_once``, the
maintenance probe's sub-millisecond path) before a thread is spent on it.
What each server does with a connection (the emulator's raw-socket faults, telemetry's /metrics,
the probe's one-request answers) stays in its own module; the approval callback keeps its own,
stricter connection handling (docs/design-notes.md says why).
"""
from __future__ import annotations

import ipaddress
import logging
import socket
import socketserver
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from forwarder.common.listen import host_port_text
from forwarder.common.logs import RateLimitedLog
from forwarder.common.loopback import is_loopback

if TYPE_CHECKING:
    import ssl

__all__ = ["DEFAULT_LIMITS", "ConnectionLimits", "HttpServer", "QuietHandler", "address_family", "client_key"]

log = logging.getLogger(__name__)


def address_family(host: str) -> socket.AddressFamily:
    """The family to bind ``host`` with: an address's own; for a name, IPv4 if it has an IPv4 address."""
    text = host.strip("[]").split("%", 1)[0]
    try:
        return socket.AF_INET6 if ipaddress.ip_address(text).version == 6 else socket.AF_INET
    except ValueError:
        pass
    try:
        families = {info[0] for info in socket.getaddrinfo(text, None, proto=socket.IPPROTO_TCP)}
    except (OSError, UnicodeError):
        return socket.AF_INET  # binding then fails with the resolver's own message
    return socket.AF_INET6 if families == {socket.AF_INET6} else socket.AF_INET


@dataclass(frozen=True)
class ConnectionLimits:
    """What one listener lets clients hold: connections in all and per client (``client_key``), and
    ``request_timeout`` seconds for a request's line and headers (from the connection, or from the
    previous answer on a kept-alive one) and for any single read. A connection over a cap is closed
    at once, before a thread is spent on it — or, with ``cut_oldest_when_full``, when only the total
    is reached, the connection that has waited longest for its request is cut to make room (idle
    connections from many addresses then cannot lock a load balancer's probe out)."""

    max_connections: int = 64
    max_per_client: int = 16
    request_timeout: float = 10.0
    cut_oldest_when_full: bool = False

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.max_per_client < 1 or not self.request_timeout > 0:
            raise ValueError(f"connection limits must be positive: {self}")


DEFAULT_LIMITS = ConnectionLimits()


def client_key(address: Any) -> str:
    """The unit of a per-client cap: the IPv4 address, or the IPv6 /64 (one host's share)."""
    host = str(address[0]) if isinstance(address, tuple) and address else str(address)
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        # One machine usually holds a whole /64: counting single addresses would let it take every slot.
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


def _shut_read(sock: socket.socket) -> None:
    try:
        socket.socket.shutdown(sock, socket.SHUT_RD)  # the plain socket's, even under TLS
    except OSError:
        pass


class _Deadlines:
    """Cuts the read side of connections whose request has not arrived by its deadline: a per-read
    timeout alone lets a client trickle one byte per timeout forever."""

    def __init__(self, name: str) -> None:
        self._cond = threading.Condition()
        self._due: dict[socket.socket, float | None] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=f"{name}-deadlines", daemon=True)
        self._thread.start()

    def arm(self, sock: socket.socket, seconds: float) -> None:
        with self._cond:
            if not self._stopped:
                self._due[sock] = time.monotonic() + seconds
                self._cond.notify()

    def disarm(self, sock: socket.socket) -> None:
        with self._cond:
            if sock in self._due:
                self._due[sock] = None

    def forget(self, sock: socket.socket) -> None:
        with self._cond:
            self._due.pop(sock, None)

    def cut_oldest(self) -> socket.socket | None:
        """Cut (both ways) the armed connection whose deadline comes first, i.e. the one waiting longest
        for its request; None when every connection has its request."""
        with self._cond:
            armed = [(due, sock) for sock, due in self._due.items() if due is not None]
            if not armed:
                return None
            victim = min(armed, key=lambda pair: pair[0])[1]
            self._due[victim] = None
        try:
            victim.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        return victim

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            for sock in self._due:
                _shut_read(sock)
            self._cond.notify()
        self._thread.join(5.0)

    def _run(self) -> None:
        with self._cond:
            while not self._stopped:
                now = time.monotonic()
                nearest: float | None = None
                for sock, due in self._due.items():
                    if due is None:
                        continue
                    if due <= now:
                        self._due[sock] = None
                        _shut_read(sock)
                    elif nearest is None or due < nearest:
                        nearest = due
                self._cond.wait(None if nearest is None else max(0.0, nearest - now) + 0.005)


class QuietHandler(BaseHTTPRequestHandler):
    """A request handler whose access log goes to ``logger`` at debug, never to stderr.

    Under a server with ``ConnectionLimits`` each request's line and headers must arrive within
    the deadline; the handler's own work and its answer are not bounded by it.
    """

    logger: logging.Logger = logging.getLogger(__name__)
    log_label = "http"
    sys_version = ""

    def handle_one_request(self) -> None:
        deadlines = getattr(self.server, "_deadlines", None)
        if deadlines is not None:
            deadlines.arm(self.connection, self.server.limits.request_timeout)  # type: ignore[attr-defined]
        super().handle_one_request()

    def parse_request(self) -> bool:
        ok = super().parse_request()
        head_received = getattr(self.server, "head_received", None)
        if head_received is not None:
            head_received(self.connection)
        return ok

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        if self.logger.isEnabledFor(logging.DEBUG):
            client = self.client_address[0] if isinstance(self.client_address, tuple) else self.client_address
            self.logger.debug("%s %s: %s", self.log_label, client, format % args)


class HttpServer(ThreadingHTTPServer):
    """A threading HTTP server bound to ``(host, port)`` with the family the host asks for.

    Handler threads are daemons and ``server_close`` does not wait for them (each server bounds
    its own connections). ``start()`` serves in a background daemon thread; ``stop()`` stops
    accepting, lets a subclass cut open connections (``close_connections``), closes the socket
    and joins the thread.
    """

    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    request_queue_size = 64  # a burst of connects waits in the backlog, not in 1 s SYN retries

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 limits: ConnectionLimits | None = DEFAULT_LIMITS) -> None:
        host, port = address
        host = host.strip("[]")
        self.address_family = address_family(host)
        self.host = host
        self._thread: threading.Thread | None = None
        self.limits = limits
        self._open: dict[str, int] = {}  # client_key -> connections being served
        self._slots: dict[Any, str] = {}  # connection -> its client_key, while it holds a slot
        self._open_lock = threading.Lock()
        self._deadlines: _Deadlines | None = None
        self._refusals = RateLimitedLog(log, 60.0)
        self.refused_connections = 0  # closed at once: over a cap
        self.cut_connections = 0  # cut to make room (``cut_oldest_when_full``)
        super().__init__((host, port), handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        """Runs on the accept loop, never blocks: a connection over a cap is closed (or the oldest
        waiting one cut to make room), one ``serve_at_once`` answers is closed, else a thread serves it."""
        if self.limits is None:
            super().process_request(request, client_address)
            return
        limits = self.limits
        key = client_key(client_address)
        victim = None
        with self._open_lock:
            if self._deadlines is None:
                self._deadlines = _Deadlines(type(self).__name__)
            full = ("client" if self._open.get(key, 0) >= limits.max_per_client
                    else "busy" if len(self._slots) >= limits.max_connections else None)
            if full == "busy" and limits.cut_oldest_when_full:
                victim = self._deadlines.cut_oldest()
                if victim is not None:
                    self._take_slot(victim)  # its thread ends on the cut; the slot is free now
                    self.cut_connections += 1
                    full = None
            if full is None:
                self._slots[request] = key
                self._open[key] = self._open.get(key, 0) + 1
            else:
                self.refused_connections += 1
        if victim is not None:
            self._refusals.log(logging.WARNING, "cut", "%s %s: %d connections open, cutting the one waiting "
                               "longest for its request", type(self).__name__, self.url(), limits.max_connections)
        if full is not None:
            self._refusals.log(logging.WARNING, full, "%s %s: %s, closing a connection from %s",
                               type(self).__name__, self.url(),
                               f"that client already has {limits.max_per_client} connections open"
                               if full == "client" else f"{limits.max_connections} connections open", key)
            self.shutdown_request(request)
            return
        try:
            answered = self.serve_at_once(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
            answered = True
        if answered:
            self._release(request)  # (on the accept loop: no one is admitted in between)
            self.shutdown_request(request)
            return
        self._deadlines.arm(request, limits.request_timeout)  # from the accept: e.g. a TLS handshake in the handler
        thread = threading.Thread(target=self._serve_limited, args=(request, client_address),
                                  name=f"{type(self).__name__}-conn", daemon=True)
        try:
            thread.start()
        except RuntimeError:
            self._deadlines.forget(request)
            self._release(request)
            self.shutdown_request(request)

    def serve_at_once(self, request: Any, client_address: Any) -> bool:
        """On the accept loop, before a thread is spent: True when the connection is fully answered (the
        base then closes it), False to hand it to a handler thread. Must never block. Default: False."""
        return False

    def head_received(self, request: Any) -> None:
        """The connection's request head is in: its deadline no longer runs and it is no longer a
        candidate to be cut. (``QuietHandler`` calls this; a handler reading the socket itself must.)"""
        deadlines = self._deadlines
        if deadlines is not None:
            deadlines.disarm(request)

    def open_connections(self) -> int:
        """Connections holding a slot (being read, answered, or waiting for a thread)."""
        with self._open_lock:
            return len(self._slots)

    def _serve_limited(self, request: Any, client_address: Any) -> None:
        assert self.limits is not None and self._deadlines is not None
        deadlines = self._deadlines
        try:
            request.settimeout(self.limits.request_timeout)  # each read; a handler's own `timeout` wins
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            deadlines.forget(request)
            self.shutdown_request(request)
            self._release(request)

    def _release(self, request: Any) -> None:
        with self._open_lock:
            self._take_slot(request)

    def _take_slot(self, request: Any) -> None:
        """Free ``request``'s slot (once: a connection cut to make room is not counted again). Holds the lock."""
        key = self._slots.pop(request, None)
        if key is None:
            return
        left = self._open.get(key, 0) - 1
        if left > 0:
            self._open[key] = left
        else:
            self._open.pop(key, None)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # socketserver prints a traceback to stderr; a client dropping its connection is no news.
        log.debug("%s: error serving %s", type(self).__name__, client_address, exc_info=True)

    def server_bind(self) -> None:
        # HTTPServer.server_bind does a reverse DNS lookup (getfqdn) that can hang for seconds.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)

    @property
    def port(self) -> int:
        """The bound port (the OS's choice when asked for port 0)."""
        return int(self.server_address[1])

    @property
    def loopback(self) -> bool:
        """Whether the server is private to this machine (decided on addresses: forwarder.common.loopback)."""
        return is_loopback(self.host)

    def url(self, scheme: str = "http") -> str:
        return f"{scheme}://{host_port_text(self.host, self.port)}"

    def start(self, name: str, poll_interval: float = 0.1) -> None:
        """Serve in a background daemon thread named ``name``."""
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": poll_interval},
                                        name=name, daemon=True)
        self._thread.start()

    def close_connections(self) -> None:
        """Called by ``stop`` once no connection is accepted any more; cut what is still open."""

    def stop(self, join_timeout: float = 5.0) -> None:
        """Stop accepting, cut open connections, close the socket and join the serving thread."""
        if self._thread is not None:
            self.shutdown()
        self.close_connections()
        with self._open_lock:
            deadlines, self._deadlines = self._deadlines, None
        if deadlines is not None:
            deadlines.stop()  # cuts what is still reading a request
        self.server_close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(join_timeout)
        self._thread = None
