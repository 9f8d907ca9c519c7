"""The one small HTTP-server base of the agent's three servers: approval callback, telemetry, emulator.

What they share lives here, once: the ``host:port`` listen parser, the address family taken from
the parsed host, binding without a reverse-DNS lookup, the loopback decision (forwarder.common.loopback,
on resolved addresses), the TLS context (certificate and key, TLS 1.2 at least), one quiet
``log_message`` (the module's logger, at debug), daemon threads, and start/stop in a background
thread. What each server does with a connection (the callback's per-client caps and deadlines,
the emulator's raw-socket faults, telemetry's /metrics) stays in its own module.
"""
from __future__ import annotations

import ipaddress
import logging
import re
import socket
import socketserver
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forwarder.common.loopback import is_loopback

if TYPE_CHECKING:
    import ssl

__all__ = ["HttpServer", "QuietHandler", "address_family", "host_port_text", "parse_listen", "tls_server_context"]

_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,62})(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,62}))*\.?$")


def parse_listen(value: Any, *, bare_port_host: str | None = None) -> tuple[str, int]:
    """``"host:port"``, ``"[v6]:port"`` or a host name and port → (host, port); raises ValueError.

    With ``bare_port_host``, a bare port (``9464`` or ``"9464"``) listens on that host (loopback, for
    the telemetry endpoint and the emulator); without it the host must always be written out.
    Port 0 asks the OS for a free port (tests); the bound port is logged by the server.
    """
    if bare_port_host is not None and isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"expected \"host:port\" (for example \"127.0.0.1:8787\"), got {value!r}")
    text = value.strip()
    if bare_port_host is not None and text.isdigit():
        text = f"[{bare_port_host}]:{text}" if ":" in bare_port_host else f"{bare_port_host}:{text}"
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError(f"expected \"[ipv6]:port\", got {value!r}")
        port_text = rest[1:]
        try:
            if ipaddress.ip_address(host).version != 6:
                raise ValueError
        except ValueError:
            raise ValueError(f"{host!r} in brackets is not an IPv6 address") from None
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise ValueError(f"missing the port: expected \"host:port\", got {value!r}")
        if ":" in host:
            raise ValueError(f"write an IPv6 address in brackets, as \"[::1]:8787\", got {value!r}")
        if not host:
            # Listening on every interface must be a visible decision, not an empty string.
            raise ValueError(f"the host must be explicit (\"127.0.0.1:{port_text}\", or \"0.0.0.0:{port_text}\" "
                             f"for every interface), got {value!r}")
        try:
            ipaddress.ip_address(host)
        except ValueError:
            if not _HOSTNAME.match(host):
                raise ValueError(f"{host!r} is not an IP address or host name") from None
    if not port_text.isdigit() or not port_text.isascii():
        raise ValueError(f"the port must be a number, got {port_text!r}")
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise ValueError(f"the port must be 0-65535, got {port}")
    return host, port


def host_port_text(host: str, port: int) -> str:
    """``host:port``, with an IPv6 address in brackets (as in a URL)."""
    host = host.strip("[]")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


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


def tls_server_context(cert: Path | str, key: Path | str) -> ssl.SSLContext:
    """A server-side TLS context with ``cert``/``key`` loaded, TLS 1.2 at least.

    Raises OSError or ssl.SSLError as ``load_cert_chain`` does; callers word the message (never
    with the files' content).
    """
    import ssl  # only a TLS server pays for it

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(str(cert), str(key))
    return context


class QuietHandler(BaseHTTPRequestHandler):
    """A request handler whose access log goes to ``logger`` at debug, never to stderr."""

    logger: logging.Logger = logging.getLogger(__name__)
    log_label = "http"
    sys_version = ""

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

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        host, port = address
        host = host.strip("[]")
        self.address_family = address_family(host)
        self.host = host
        self._thread: threading.Thread | None = None
        super().__init__((host, port), handler)

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
        self.server_close()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(join_timeout)
        self._thread = None
