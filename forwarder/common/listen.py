"""Listen addresses (``host:port``) and server TLS contexts, parsed and checked without importing an
HTTP server: reading a config (every ``sefwd`` command) needs these, not the servers
(forwarder.common.http_server, which uses them)."""
from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import ssl

__all__ = ["host_port_text", "parse_listen", "tls_server_context"]

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
