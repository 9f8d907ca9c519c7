"""The HTTP-server base of the callback, telemetry, probe and emulator servers, on real sockets."""
from __future__ import annotations

import http.client
import logging
import select
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme

from forwarder.common.http_server import ConnectionLimits, HttpServer, QuietHandler, address_family
from forwarder.common.listen import tls_server_context
from tests.agent import wait_until


class _Hello(QuietHandler):
    protocol_version = "HTTP/1.1"
    logger = logging.getLogger("tests.http_server")
    log_label = "hello"

    def do_GET(self) -> None:  # noqa: N802 - http.server naming
        body = b"hello\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.fixture
def served(request: pytest.FixtureRequest) -> Iterator[HttpServer]:
    server = HttpServer((request.param, 0), _Hello)
    server.start("test-http")
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("served", ["127.0.0.1", pytest.param("::1", marks=pytest.mark.skipif(
    not _ipv6(), reason="no IPv6 loopback on this machine")), pytest.param("[::1]", marks=pytest.mark.skipif(
    not _ipv6(), reason="no IPv6 loopback on this machine"))], indirect=True)
def test_binds_the_family_of_its_host_and_answers(served: HttpServer, caplog: pytest.LogCaptureFixture) -> None:
    host = served.host
    assert served.socket.family == (socket.AF_INET6 if ":" in host else socket.AF_INET)
    assert served.loopback and served.port > 0
    assert served.url() == (f"http://[{host}]:{served.port}" if ":" in host else f"http://{host}:{served.port}")
    caplog.set_level(logging.DEBUG, logger="tests.http_server")
    conn = http.client.HTTPConnection(host, served.port, timeout=10)
    try:
        conn.request("GET", "/")
        response = conn.getresponse()
        assert (response.status, response.read()) == (200, b"hello\n")
    finally:
        conn.close()
    # The access log went to the handler's logger at debug, naming the server.
    assert any(r.levelno == logging.DEBUG and r.getMessage().startswith("hello ") and '"GET / HTTP/1.1" 200' in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_the_access_log_never_reaches_stderr(capfd: pytest.CaptureFixture[str]) -> None:
    server = HttpServer(("127.0.0.1", 0), _Hello)
    server.start("test-http")
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request("GET", "/")
        conn.getresponse().read()
        conn.close()
    finally:
        server.stop()
    assert "GET /" not in capfd.readouterr().err


def test_stop_closes_the_port_and_is_safe_twice() -> None:
    server = HttpServer(("127.0.0.1", 0), _Hello)
    server.start("test-http")
    port = server.port
    server.stop()
    server.stop()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_stop_without_start_does_not_hang() -> None:
    server = HttpServer(("127.0.0.1", 0), _Hello)
    server.stop()


def test_every_interface_is_not_loopback() -> None:
    server = HttpServer(("0.0.0.0", 0), _Hello)
    try:
        assert not server.loopback
    finally:
        server.stop()


def test_a_busy_port_is_an_oserror() -> None:
    server = HttpServer(("127.0.0.1", 0), _Hello)
    try:
        with pytest.raises(OSError):
            HttpServer(("127.0.0.1", server.port), _Hello)
    finally:
        server.stop()


@pytest.mark.parametrize("host, family", [
    ("127.0.0.1", socket.AF_INET), ("0.0.0.0", socket.AF_INET), ("::1", socket.AF_INET6), ("[::]", socket.AF_INET6),
    ("fe80::1%lo", socket.AF_INET6), ("localhost", socket.AF_INET), ("no-such-host.invalid", socket.AF_INET),
])
def test_address_family(host: str, family: socket.AddressFamily) -> None:
    assert address_family(host) == family


def test_tls_context_needs_tls_1_2_and_serves(tmp_path: Path) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "tls.crt"))
    cert.private_key_pem.write_to_path(str(tmp_path / "tls.key"))
    context = tls_server_context(tmp_path / "tls.crt", tmp_path / "tls.key")
    assert context.minimum_version == ssl.TLSVersion.TLSv1_2
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client_ctx = ssl.create_default_context()
        ca.configure_trust(client_ctx)
        with socket.create_connection(listener.getsockname()[:2], timeout=10) as raw:
            accepted, _ = listener.accept()
            accepted.settimeout(10)
            with context.wrap_socket(accepted, server_side=True, do_handshake_on_connect=False) as server_side:
                client = client_ctx.wrap_socket(raw, server_hostname="127.0.0.1", do_handshake_on_connect=False)
                client.setblocking(False)
                server_side.setblocking(False)
                # Drive both handshakes in this thread (no sleeps): each step either advances or wants I/O.
                done = {"client": False, "server": False}
                while not all(done.values()):
                    for name, sock in (("client", client), ("server", server_side)):
                        if done[name]:
                            continue
                        try:
                            sock.do_handshake()
                            done[name] = True
                        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                            pass
                    if not all(done.values()):
                        select.select([client, server_side], [], [], 5)
                assert client.version() in ("TLSv1.2", "TLSv1.3")
                client.close()


def test_tls_context_refuses_a_mismatched_pair(tmp_path: Path) -> None:
    ca = trustme.CA()
    one, other = ca.issue_cert("127.0.0.1"), ca.issue_cert("127.0.0.1")
    one.cert_chain_pems[0].write_to_path(str(tmp_path / "tls.crt"))
    other.private_key_pem.write_to_path(str(tmp_path / "tls.key"))
    with pytest.raises(ssl.SSLError):
        tls_server_context(tmp_path / "tls.crt", tmp_path / "tls.key")


# -- the connection limits' two opt-ins: cut the oldest waiting connection; answer on the accept loop --

def _closed(s: socket.socket, timeout: float = 10.0) -> bool:
    """Whether the server closed ``s`` (EOF or reset) within ``timeout``."""
    ready, _, _ = select.select([s], [], [], timeout)
    if not ready:
        return False
    try:
        return s.recv(1) == b""
    except OSError:
        return True


def test_when_full_the_connection_waiting_longest_is_cut_and_the_newcomer_served() -> None:
    limits = ConnectionLimits(max_connections=3, max_per_client=3, request_timeout=60.0, cut_oldest_when_full=True)
    server = HttpServer(("127.0.0.1", 0), _Hello, limits)
    server.start("cut-oldest")
    idle: list[socket.socket] = []
    try:
        for source in ("127.0.0.11", "127.0.0.12", "127.0.0.13"):
            s = socket.socket()
            s.bind((source, 0))
            s.connect(("127.0.0.1", server.port))
            idle.append(s)
            wait_until(lambda: server.open_connections() == len(idle), 10, "the server to hold it")  # in order
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        conn.request("GET", "/")
        assert conn.getresponse().read() == b"hello\n"  # served: a slot was made, not refused
        conn.close()
        assert _closed(idle[0]) and server.cut_connections == 1 and server.refused_connections == 0
        assert not _closed(idle[1], 0.2) and not _closed(idle[2], 0.2)  # the younger ones are kept
    finally:
        for s in idle:
            s.close()
        server.stop()


def test_without_the_opt_in_a_full_server_refuses_the_newcomer() -> None:
    limits = ConnectionLimits(max_connections=1, max_per_client=1, request_timeout=60.0)
    server = HttpServer(("127.0.0.1", 0), _Hello, limits)
    server.start("refuse")
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as held:
            wait_until(lambda: server.open_connections() == 1, 10, "the server to hold it")
            with socket.socket() as late:
                late.bind(("127.0.0.2", 0))
                late.connect(("127.0.0.1", server.port))
                assert _closed(late)
            assert not _closed(held, 0.2) and server.refused_connections == 1 and server.cut_connections == 0
    finally:
        server.stop()


class _AtOnce(HttpServer):
    """Answers a request that is already there on the accept loop; the rest go to a handler thread."""

    def serve_at_once(self, request: socket.socket, client_address: object) -> bool:
        request.setblocking(False)
        try:
            head = request.recv(4096, socket.MSG_PEEK)
        except BlockingIOError:
            return False
        finally:
            request.setblocking(True)
        if not head.endswith(b"\r\n\r\n"):
            return False
        request.recv(len(head))
        request.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\nConnection: close\r\n\r\nat once")
        return True


def test_serve_at_once_answers_without_a_thread_and_frees_the_slot() -> None:
    server = _AtOnce(("127.0.0.1", 0), _Hello, ConnectionLimits(max_connections=2, max_per_client=2))
    clients = []
    try:
        for _ in range(5):  # more than the caps, all waiting in the backlog with their whole request sent
            s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            clients.append(s)
        server.start("at-once")
        for s in clients:
            answer = b""
            while chunk := s.recv(100):
                answer += chunk
            assert answer.endswith(b"at once")  # each answered on the accept loop, its slot freed at once
        assert server.refused_connections == 0 and server.open_connections() == 0
    finally:
        for s in clients:
            s.close()
        server.stop()
