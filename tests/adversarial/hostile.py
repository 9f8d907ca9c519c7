"""A minimal hostile HTTP/1.1 server for the adversarial suite (deliberately not the emulator).

Each request is answered by a ``handler(request) -> Reply`` the test supplies. A ``Reply`` can do
what a broken or malicious server does: drip its bytes slowly, send ``1xx`` interim answers first,
send an oversized body, hold the connection open without answering, or close it mid-answer.
"""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import orjson


@dataclass
class Request:
    method: str
    target: str
    headers: dict[str, str]
    body: bytes
    at: float = field(default_factory=time.monotonic)


@dataclass
class Reply:
    status: int = 200
    body: bytes | Callable[[], Iterator[bytes]] = b""
    headers: dict[str, str] = field(default_factory=dict)
    interim: list[bytes] = field(default_factory=list)  # raw 1xx heads, each sent as its own segment
    interim_gap: float = 0.1  # pause after each interim head, so it arrives in a segment of its own
    drip: float = 0.0  # seconds between single bytes of the head+body (0 = one write)
    hold: float = 0.0  # seconds to wait before answering at all
    close: bool = False  # close the connection after this answer
    truncate: int | None = None  # close after this many bytes of the answer
    raw: bytes | None = None  # send exactly these bytes instead of a well-formed answer (garbage)

    @staticmethod
    def json(doc: object, status: int = 200, **kw: object) -> Reply:
        headers = {"Content-Type": "application/json", **kw.pop("headers", {})}  # type: ignore[dict-item]
        return Reply(status=status, body=orjson.dumps(doc), headers=headers, **kw)  # type: ignore[arg-type]


Handler = Callable[[Request], Reply]


class HostileServer:
    """Threaded raw-socket server on 127.0.0.1; ``requests`` records every request it read."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.requests: list[Request] = []
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(8)
        self._sock.settimeout(0.2)
        self._conns: list[socket.socket] = []
        # Cleared: connections stay in the kernel's backlog, never accepted (a stalled server).
        self.accepting = threading.Event()
        self.accepting.set()
        self._thread = threading.Thread(target=self._accept, daemon=True)

    @property
    def port(self) -> int:
        return int(self._sock.getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> HostileServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        for c in list(self._conns):
            try:
                c.close()
            except OSError:
                pass
        self._sock.close()

    def wait_requests(self, n: int, timeout: float) -> list[Request]:
        """Block until at least ``n`` requests were read (or fail after ``timeout``)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self.requests) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"hostile server saw {len(self.requests)} of {n} requests in {timeout}s")
                self._cond.wait(left)
            return list(self.requests)

    def _accept(self) -> None:
        while not self._stop.is_set():
            if not self.accepting.is_set():
                self._stop.wait(0.05)
                continue
            try:
                conn, _ = self._sock.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _read_request(self, conn: socket.socket, buf: bytearray) -> Request | None:
        while b"\r\n\r\n" not in buf:
            chunk = conn.recv(65536)
            if not chunk:
                return None
            buf += chunk
        head, _, rest = bytes(buf).partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, target, _version = lines[0].split(" ", 2)
        headers = {}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        length = int(headers.get("content-length", "0") or 0)
        body = bytearray(rest)
        while len(body) < length:
            chunk = conn.recv(65536)
            if not chunk:
                return None
            body += chunk
        buf[:] = body[length:]
        return Request(method, target, headers, bytes(body[:length]))

    def _serve(self, conn: socket.socket) -> None:
        buf = bytearray()
        conn.settimeout(None)
        try:
            while not self._stop.is_set():
                req = self._read_request(conn, buf)
                if req is None:
                    return
                with self._cond:
                    self.requests.append(req)
                    self._cond.notify_all()
                reply = self.handler(req)
                if reply.hold and self._stop.wait(reply.hold):
                    return
                for head in reply.interim:
                    conn.sendall(head)
                    if self._stop.wait(reply.interim_gap):
                        return
                if reply.raw is not None:
                    conn.sendall(reply.raw)
                elif callable(reply.body):
                    self._send_streamed(conn, reply)
                else:
                    self._send(conn, reply, reply.body)
                if reply.close or reply.truncate is not None:
                    return
        except OSError:
            return
        finally:
            try:
                conn.close()
            except OSError:
                pass

    @staticmethod
    def _head(reply: Reply, length: int | None) -> bytes:
        lines = [f"HTTP/1.1 {reply.status} X"]
        headers = dict(reply.headers)
        if length is not None:
            headers.setdefault("Content-Length", str(length))
        if reply.close:
            headers.setdefault("Connection", "close")
        lines += [f"{k}: {v}" for k, v in headers.items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def _send(self, conn: socket.socket, reply: Reply, body: bytes) -> None:
        data = self._head(reply, len(body)) + body
        if reply.truncate is not None:
            data = data[: reply.truncate]
        if not reply.drip:
            conn.sendall(data)
            return
        for i in range(len(data)):
            if self._stop.wait(reply.drip):
                return
            conn.sendall(data[i:i + 1])

    def _send_streamed(self, conn: socket.socket, reply: Reply) -> None:
        """A body produced by a generator, sent chunked (or raw, when the reply sets its own
        Content-Length): a huge answer without building it."""
        assert callable(reply.body)
        if "Content-Length" in reply.headers:
            conn.sendall(self._head(reply, None))
            for piece in reply.body():
                if self._stop.is_set():
                    return
                conn.sendall(piece)
            return
        headers = dict(reply.headers)
        headers["Transfer-Encoding"] = "chunked"
        conn.sendall(self._head(Reply(reply.status, headers=headers, close=reply.close), None))
        for piece in reply.body():
            if self._stop.is_set():
                return
            conn.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        conn.sendall(b"0\r\n\r\n")
