"""A small HTTP CONNECT proxy on 127.0.0.1, as corporate networks put in front of port 443.

It resolves names itself (``routes`` maps ``host:port`` to a local address), so a client that reaches
an unresolvable name like ``sefwd.servicebus.test:443`` can only have come through it. With
``credentials`` it answers 407 to a CONNECT without the matching ``Proxy-Authorization: Basic``.
Every CONNECT is recorded in ``tunnels``.
"""
from __future__ import annotations

import base64
import selectors
import socket
import socketserver
import threading
from dataclasses import dataclass
from typing import Any


@dataclass
class Tunnel:
    target: str
    status: int
    authorization: str | None


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(10)
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(4096)
            if not chunk or len(head) > 65536:
                return
            head += chunk
        header, _, early = head.partition(b"\r\n\r\n")
        lines = header.decode("latin-1").split("\r\n")
        method, target, _ = (lines[0].split(" ") + ["", "", ""])[:3]
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        auth = headers.get("proxy-authorization")
        status = self.server.decide(method, target, auth)
        self.server.record(Tunnel(target, status, auth))
        if status != 200:
            extra = 'Proxy-Authenticate: Basic realm="test"\r\n' if status == 407 else ""
            sock.sendall(f"HTTP/1.1 {status} Refused\r\n{extra}Content-Length: 0\r\nConnection: close\r\n\r\n".encode())
            return
        try:
            upstream = socket.create_connection(self.server.routes[target], timeout=10)
        except OSError:
            sock.sendall(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            return
        sock.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
        if early:
            upstream.sendall(early)
        self.server.relay(sock, upstream)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, routes: dict[str, tuple[str, int]], credentials: tuple[str, str] | None) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.routes = routes
        self.expected = None if credentials is None else "Basic " + base64.b64encode(":".join(credentials).encode()).decode()
        self.tunnels: list[Tunnel] = []
        self.open: set[socket.socket] = set()
        self.lock = threading.Lock()

    def decide(self, method: str, target: str, auth: str | None) -> int:
        if method != "CONNECT":
            return 405
        if self.expected is not None and auth != self.expected:
            return 407
        return 200 if target in self.routes else 403

    def record(self, tunnel: Tunnel) -> None:
        with self.lock:
            self.tunnels.append(tunnel)

    def relay(self, a: socket.socket, b: socket.socket) -> None:
        with self.lock:
            self.open.update((a, b))
        a.settimeout(None)
        b.settimeout(None)
        sel = selectors.DefaultSelector()
        sel.register(a, selectors.EVENT_READ, b)
        sel.register(b, selectors.EVENT_READ, a)
        try:
            while True:
                for key, _ in sel.select():
                    src: Any = key.fileobj
                    data = src.recv(65536)
                    if not data:
                        return
                    key.data.sendall(data)
        except OSError:
            return
        finally:
            sel.close()
            with self.lock:
                self.open.difference_update((a, b))
            b.close()


class ConnectProxy:
    """``with ConnectProxy({"host:443": ("127.0.0.1", port)}) as proxy:``; ``proxy.port``, ``proxy.tunnels``."""

    def __init__(self, routes: dict[str, tuple[str, int]], *, credentials: tuple[str, str] | None = None) -> None:
        self._server = _Server(routes, credentials)
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="connect-proxy", daemon=True)
        self._thread.start()

    @property
    def tunnels(self) -> list[Tunnel]:
        with self._server.lock:
            return list(self._server.tunnels)

    def drop_all(self) -> int:
        """Reset every open tunnel (a proxy restart, an idle timeout in the proxy)."""
        with self._server.lock:
            socks = list(self._server.open)
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        return len(socks) // 2

    def close(self) -> None:
        self.drop_all()
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> ConnectProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
