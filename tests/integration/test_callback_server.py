"""The signed approval callback server over real HTTP(S) on loopback; requests signed by `standardwebhooks`."""
from __future__ import annotations

import json
import logging
import select
import socket
import ssl
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import requests
import trustme
from standardwebhooks.webhooks import Webhook

from forwarder.approval.callback import MAX_CONNECTIONS_PER_CLIENT, ApprovalRequest, CallbackServer, Verdict
from forwarder.approval.seen_ids import ReplayCache
from forwarder.approval.settings import CallbackSettings
from forwarder.common.compat import UTC
from forwarder.common.signing import generate_secret, parse_secret, sign_headers

pytestmark = pytest.mark.timeout(60)

SECRET_A = generate_secret()
SECRET_B = generate_secret()
SECRET_C = generate_secret()  # a key the server does not know
KEY_A, KEY_B = parse_secret(SECRET_A), parse_secret(SECRET_B)
EVENT = "C7061BAC-AFDC-4513-B24B-AA5F13A16123"
AUDIT_FIELDS = {
    "EventId", "EventIds", "Outcome", "Actor", "Approver", "Rule", "Reason", "Detail", "Client",
    "HttpStatus", "ImdsStatus", "Hook", "DocumentIncarnation",
}


class Recorder:
    """The decide and audit callbacks: records every call, answers with ``verdict``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.decided: list[ApprovalRequest] = []
        self.audits: list[dict[str, Any]] = []
        self.verdict = Verdict(200, {"status": "approved"})
        self.fail: Exception | None = None

    def decide(self, request: ApprovalRequest) -> Verdict:
        with self.lock:
            self.decided.append(request)
        if self.fail is not None:
            raise self.fail
        return self.verdict

    def audit(self, record: dict[str, Any]) -> None:
        with self.lock:
            self.audits.append(record)


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def make_settings(**overrides: Any) -> CallbackSettings:
    options: dict[str, Any] = {
        "host": "127.0.0.1", "port": 0, "keys": (KEY_A,), "max_body": 4096, "rate_limit": 1000,
        "client_timeout": 1.0, "tolerance": 300.0,
    }
    options.update(overrides)
    return CallbackSettings(**options)


@pytest.fixture
def rec() -> Recorder:
    return Recorder()


@pytest.fixture
def make_server(tmp_path: Path, rec: Recorder) -> Iterator[Callable[..., CallbackServer]]:
    started: list[CallbackServer] = []

    def make(clock: Callable[[], float] = time.time, max_connections: int = 32,
             max_per_client: int = MAX_CONNECTIONS_PER_CLIENT, **overrides: Any) -> CallbackServer:
        server = CallbackServer(
            make_settings(**overrides), rec.decide, rec.audit, tmp_path / "state.db",
            clock=clock, max_connections=max_connections, max_per_client=max_per_client,
        )
        started.append(server.start())
        return server

    yield make
    for server in started:
        server.stop()


@pytest.fixture
def server(make_server: Callable[..., CallbackServer]) -> CallbackServer:
    return make_server()


def body_of(*event_ids: str, **extra: Any) -> bytes:
    return json.dumps({"StartRequests": [{"EventId": e} for e in event_ids or (EVENT,)], **extra}).encode()


def signed(body: bytes, secret: str = SECRET_A, msg_id: str | None = None, ts: float | None = None) -> dict[str, str]:
    """Standard Webhooks headers computed by the independent reference package."""
    msg_id = msg_id or f"msg_{uuid.uuid4().hex}"
    when = datetime.fromtimestamp(time.time() if ts is None else ts, tz=UTC)
    signature = Webhook(secret).sign(msg_id, when, body.decode())
    return {"webhook-id": msg_id, "webhook-timestamp": str(int(when.timestamp())), "webhook-signature": signature,
            "Content-Type": "application/json"}


def post(server: CallbackServer, body: bytes, headers: dict[str, str], path: str = "/approvals",
         method: str = "POST", **kw: Any) -> requests.Response:
    return requests.request(method, server.url + path, data=body, headers=headers, timeout=10, **kw)


def assert_refused(resp: requests.Response, rec: Recorder, status: int, reason: str) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    answer = resp.json()
    assert answer["status"] == "refused" and answer["reason"] == reason, answer
    assert resp.headers["Content-Type"] == "application/json"
    assert rec.decided == []
    assert len(rec.audits) == 1, rec.audits
    (audit,) = rec.audits
    assert set(audit) == AUDIT_FIELDS
    assert audit["Outcome"] == "refused" and audit["Actor"] == "callback"
    assert audit["Reason"] == reason and audit["HttpStatus"] == status
    assert audit["Client"].startswith("127.0.0.1:")
    return audit


def raw_exchange(server: CallbackServer, data: bytes, timeout: float = 10.0) -> tuple[int, dict[str, Any], bytes]:
    """Send raw bytes, read until the server closes; (status, JSON body, raw head)."""
    with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=timeout) as sock:
        sock.sendall(data)
        return parse_answer(read_all(sock))


def read_all(sock: socket.socket) -> bytes:
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def parse_answer(raw: bytes) -> tuple[int, dict[str, Any], bytes]:
    head, _, payload = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head else 0
    return status, (json.loads(payload) if payload else {}), head


# -- accepted requests ------------------------------------------------------------------------------
def test_valid_request_signed_by_reference_package_reaches_decide_once(server, rec):
    rec.verdict = Verdict(200, {"status": "approved", "EventIds": [EVENT]})
    payload = body_of(EVENT, "other-event", approver="alice@example.com", reason="drained", DocumentIncarnation=7)
    headers = signed(payload, msg_id="msg_one")
    resp = post(server, payload, headers)
    assert resp.status_code == 200
    assert resp.json() == {"status": "approved", "EventIds": [EVENT]}
    assert resp.headers["Connection"] == "close"
    assert rec.audits == []  # decide audits accepted requests itself
    (request,) = rec.decided
    assert request == ApprovalRequest(
        event_ids=(EVENT, "other-event"), approver="alice@example.com", reason="drained",
        client=request.client, message_id="msg_one",
    )
    assert request.client.startswith("127.0.0.1:")


def test_decide_verdict_status_and_body_are_answered_as_is(server, rec):
    rec.verdict = Verdict(422, {"status": "refused", "reason": "out_of_scope"})
    payload = body_of()
    resp = post(server, payload, signed(payload))
    assert resp.status_code == 422 and resp.json() == {"status": "refused", "reason": "out_of_scope"}
    assert len(rec.decided) == 1 and rec.audits == []


def test_own_signing_and_key_rotation(make_server, rec):
    server = make_server(keys=(KEY_A, KEY_B))
    for n, secret in enumerate((SECRET_A, SECRET_B)):
        payload = body_of(f"event-{n}")
        assert post(server, payload, signed(payload, secret=secret)).status_code == 200
    payload = body_of("event-own")
    assert post(server, payload, sign_headers(KEY_B, "msg_own", payload)).status_code == 200
    assert [r.event_ids for r in rec.decided] == [("event-0",), ("event-1",), ("event-own",)]
    rec.decided.clear()
    payload = body_of("event-unknown-key")
    assert_refused(post(server, payload, signed(payload, secret=SECRET_C)), rec, 401, "bad_signature")


def test_duplicate_event_ids_are_collapsed_in_order(server, rec):
    payload = body_of("b", "a", "b")
    assert post(server, payload, signed(payload)).status_code == 200
    assert rec.decided[0].event_ids == ("b", "a")


# -- signature refusals -----------------------------------------------------------------------------
def test_tampered_body_is_bad_signature(server, rec):
    payload = body_of("event-1")
    headers = signed(payload)
    assert_refused(post(server, body_of("event-2"), headers), rec, 401, "bad_signature")


def test_wrong_key_is_bad_signature(server, rec):
    payload = body_of()
    assert_refused(post(server, payload, signed(payload, secret=SECRET_C)), rec, 401, "bad_signature")


def test_garbage_signature_is_bad_signature(server, rec):
    payload = body_of()
    headers = signed(payload) | {"webhook-signature": "v1,bm90IGEgc2lnbmF0dXJl v2,xyz"}
    assert_refused(post(server, payload, headers), rec, 401, "bad_signature")


@pytest.mark.parametrize("missing", ["webhook-id", "webhook-timestamp", "webhook-signature"])
def test_missing_header(server, rec, missing):
    payload = body_of()
    headers = {k: v for k, v in signed(payload).items() if k != missing}
    audit = assert_refused(post(server, payload, headers), rec, 401, "missing_headers")
    assert missing in audit["Detail"]


# 30 s past the ±5 min tolerance in the future: the header is whole seconds (up to 1 s lost) and a loaded
# machine may take seconds between signing and the server's check, both of which bring a future stamp nearer.
@pytest.mark.parametrize(("offset", "reason"), [(-301, "stale_timestamp"), (330, "future_timestamp")])
def test_timestamp_outside_tolerance(server, rec, offset, reason):
    payload = body_of()
    assert_refused(post(server, payload, signed(payload, ts=time.time() + offset)), rec, 401, reason)


def test_unparseable_timestamp(server, rec):
    payload = body_of()
    headers = signed(payload) | {"webhook-timestamp": "1e9"}
    assert_refused(post(server, payload, headers), rec, 401, "bad_timestamp")


def test_logs_carry_neither_secret_nor_signature(server, rec, caplog):
    caplog.set_level(logging.DEBUG, logger="forwarder.approval")
    payload = body_of()
    headers = signed(payload, secret=SECRET_C)
    assert_refused(post(server, payload, headers), rec, 401, "bad_signature")
    assert "bad_signature" in caplog.text
    assert any(r.levelno == logging.WARNING for r in caplog.records)
    for secret in (SECRET_A, SECRET_C, headers["webhook-signature"], headers["webhook-signature"][3:]):
        assert secret not in caplog.text


# -- replay -------------------------------------------------------------------------------------------
def test_replayed_id_is_refused(server, rec):
    payload = body_of()
    headers = signed(payload, msg_id="msg_replay")
    assert post(server, payload, headers).status_code == 200
    rec.decided.clear()
    # Same id, fresh timestamp and a valid signature: still a replay.
    assert_refused(post(server, payload, signed(payload, msg_id="msg_replay")), rec, 409, "replayed_id")


def test_replayed_id_is_refused_after_restart(make_server, rec):
    first = make_server()
    payload = body_of()
    assert post(first, payload, signed(payload, msg_id="msg_restart")).status_code == 200
    first.stop()
    rec.decided.clear()
    second = make_server()
    assert_refused(post(second, payload, signed(payload, msg_id="msg_restart")), rec, 409, "replayed_id")


def test_bad_signature_does_not_poison_the_replay_cache(server, rec):
    payload = body_of()
    assert_refused(post(server, payload, signed(payload, secret=SECRET_C, msg_id="msg_poison")), rec, 401, "bad_signature")
    rec.audits.clear()
    assert post(server, payload, signed(payload, msg_id="msg_poison")).status_code == 200
    assert len(rec.decided) == 1


def test_concurrent_copies_of_one_request_reach_decide_once(server, rec):
    payload = body_of()
    headers = signed(payload, msg_id="msg_race")
    statuses: list[int] = []
    barrier = threading.Barrier(6)

    def send() -> None:
        barrier.wait(5)
        statuses.append(post(server, payload, headers).status_code)

    threads = [threading.Thread(target=send) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert sorted(statuses) == [200] + [409] * 5
    assert len(rec.decided) == 1 and len(rec.audits) == 5


# -- size and framing ---------------------------------------------------------------------------------
def test_oversize_body_is_refused(server, rec):
    payload = body_of(reason="x" * 5000)
    assert_refused(post(server, payload, signed(payload)), rec, 413, "body_too_large")


def test_oversize_content_length_is_answered_without_reading_the_body(server, rec):
    head = b"POST /approvals HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000\r\n\r\n"
    status, answer, _ = raw_exchange(server, head)
    assert status == 413 and answer["reason"] == "body_too_large"  # a server waiting for the body would 408
    assert rec.decided == [] and [a["Reason"] for a in rec.audits] == ["body_too_large"]


def test_missing_content_length(server, rec):
    status, answer, _ = raw_exchange(server, b"POST /approvals HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (status, answer["reason"]) == (411, "length_required")
    assert rec.decided == [] and [a["Reason"] for a in rec.audits] == ["length_required"]


def test_expect_continue_comes_after_the_checks(server, rec):
    payload = body_of()
    head = "POST /approvals HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: {}\r\n{}\r\n"
    signature = "".join(f"{k}: {v}\r\n" for k, v in signed(payload).items())
    with socket.create_connection(("127.0.0.1", port_of(server)), timeout=10) as sock:
        sock.sendall(head.format(len(payload), signature).encode())
        interim = b""
        while not interim.endswith(b"\r\n\r\n"):
            interim += sock.recv(1)
        assert interim.startswith(b"HTTP/1.1 100 ")
        sock.sendall(payload)
        status, answer, _ = parse_answer(read_all(sock))
    assert status == 200 and answer == {"status": "approved"} and len(rec.decided) == 1
    # Too big: the final answer comes at once, with no invitation to send the body.
    status, answer, head_bytes = raw_exchange(server, head.format(10**6, signature).encode())
    assert status == 413 and b"100 Continue" not in head_bytes


def test_chunked_body_is_refused(server, rec):
    payload = body_of()
    resp = post(server, iter([payload]), signed(payload))  # type: ignore[arg-type]
    assert_refused(resp, rec, 411, "length_required")


def test_oversize_headers(server, rec):
    payload = body_of()
    headers = signed(payload) | {f"X-Pad-{i}": "p" * 1000 for i in range(40)}
    assert_refused(post(server, payload, headers), rec, 431, "headers_too_large")


def test_garbage_request_line(server, rec):
    status, answer, _ = raw_exchange(server, b"\x16\x03\x01 garbage\r\n\r\n")
    assert (status, answer["reason"]) == (400, "bad_request")
    assert rec.decided == [] and len(rec.audits) == 1


# -- body shape ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("payload", [
    b"{", b"\xff\xfe", b'{"StartRequests": NaN}', b"", b"[" * 4000,
    b'{"StartRequests": [{"EventId": "a"}], "StartRequests": [{"EventId": "b"}]}',
], ids=["truncated", "not-utf8", "nan", "empty", "deep", "duplicate-key"])
def test_malformed_json(server, rec, payload):
    headers = sign_headers(KEY_A, f"msg_{uuid.uuid4().hex}", payload)
    assert_refused(post(server, payload, headers), rec, 400, "malformed_json")


@pytest.mark.parametrize("doc", [
    [], "x", {}, {"StartRequests": []}, {"StartRequests": "E1"},
    {"StartRequests": [{"EventId": f"E{i}"} for i in range(21)]},
    {"StartRequests": [{"EventId": ""}]}, {"StartRequests": [{"EventId": "   "}]},
    {"StartRequests": [{"EventId": "E" * 101}]}, {"StartRequests": [{"EventId": 5}]},
    {"StartRequests": [{"EventId": "E\n1"}]}, {"StartRequests": [{"EventId": "E1", "Extra": 1}]},
    {"StartRequests": ["E1"]}, {"StartRequests": [{"EventId": "E1"}], "Approve": True},
    {"StartRequests": [{"EventId": "E1"}], "approver": 5},
    {"StartRequests": [{"EventId": "E1"}], "approver": "a" * 201},
    {"StartRequests": [{"EventId": "E1"}], "reason": "line\nbreak"},
    {"StartRequests": [{"EventId": "E1"}], "DocumentIncarnation": "3"},
    {"StartRequests": [{"EventId": "E1"}], "DocumentIncarnation": True},
])
def test_invalid_body_shape(server, rec, doc):
    payload = json.dumps(doc).encode()
    assert_refused(post(server, payload, signed(payload)), rec, 400, "invalid_body")


def test_invalid_body_audit_names_what_was_parsed(server, rec):
    payload = body_of("E1", "E2", approver="bob", reason="r" * 201)
    audit = assert_refused(post(server, payload, signed(payload)), rec, 400, "invalid_body")
    assert audit["EventIds"] == ["E1", "E2"] and audit["EventId"] is None and audit["Approver"] == "bob"


def test_valid_signature_on_bad_body_spends_the_id(server, rec):
    payload = b"{"
    headers = sign_headers(KEY_A, "msg_spent", payload)
    assert_refused(post(server, payload, headers), rec, 400, "malformed_json")
    rec.audits.clear()
    assert_refused(post(server, payload, headers), rec, 409, "replayed_id")


# -- routing ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("method", "path", "status", "reason"), [
    ("POST", "/", 404, "not_found"), ("POST", "/approvals/", 404, "not_found"),
    ("GET", "/metrics", 404, "not_found"), ("GET", "/approvals", 405, "method_not_allowed"),
    ("PUT", "/approvals", 405, "method_not_allowed"), ("DELETE", "/approvals", 405, "method_not_allowed"),
])
def test_routing(server, rec, method, path, status, reason):
    payload = body_of()
    resp = post(server, payload, signed(payload), path=path, method=method)
    assert_refused(resp, rec, status, reason)
    if status == 405:
        assert resp.headers["Allow"] == "POST"


def test_decide_failure_is_internal_error(server, rec):
    rec.fail = RuntimeError("imds exploded")
    payload = body_of()
    resp = post(server, payload, signed(payload))
    assert resp.status_code == 500 and resp.json()["reason"] == "internal_error"
    assert "imds" not in resp.text  # internals stay in the audit record
    assert len(rec.decided) == 1
    (audit,) = rec.audits
    assert audit["Reason"] == "internal_error" and audit["EventId"] == EVENT and "imds exploded" in audit["Detail"]


# -- rate limit ---------------------------------------------------------------------------------------
def test_rate_limit_per_client(make_server, rec):
    clock = Clock()
    server = make_server(clock=clock, rate_limit=3)
    # Refused requests spend tokens too: a 404 and a bad signature, then one valid request.
    payload = body_of()
    assert post(server, payload, signed(payload, ts=clock.now), path="/nope").status_code == 404
    assert post(server, payload, signed(payload, secret=SECRET_C, ts=clock.now)).status_code == 401
    assert post(server, payload, signed(payload, ts=clock.now)).status_code == 200
    rec.audits.clear()
    rec.decided.clear()
    resp = post(server, payload, signed(payload, ts=clock.now))
    audit = assert_refused(resp, rec, 429, "rate_limited")
    assert audit["EventIds"] is None
    assert 1 <= int(resp.headers["Retry-After"]) <= 20
    # One token comes back every 20 s at 3/minute.
    clock.now += 20.5
    rec.audits.clear()
    assert post(server, payload, signed(payload, ts=clock.now)).status_code == 200
    assert len(rec.decided) == 1
    assert post(server, payload, signed(payload, ts=clock.now)).status_code == 429


# -- slow and excess clients ---------------------------------------------------------------------------
def port_of(server: CallbackServer) -> int:
    return int(server.url.rsplit(":", 1)[1])


def test_stalled_client_is_dropped_while_others_are_served(make_server, rec):
    server = make_server(client_timeout=1.5)
    slow = socket.create_connection(("127.0.0.1", port_of(server)), timeout=10)
    try:
        started = time.monotonic()
        slow.sendall(b"POST /approvals HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{\"Start")
        payload = body_of()
        assert post(server, payload, signed(payload)).status_code == 200
        assert len(rec.decided) == 1
        status, answer, _ = parse_answer(read_all(slow))
        elapsed = time.monotonic() - started
    finally:
        slow.close()
    assert (status, answer["reason"]) == (408, "client_timeout")
    assert 1.2 <= elapsed <= 1.5 + 3.0
    assert len(rec.decided) == 1 and [a["Reason"] for a in rec.audits] == ["client_timeout"]


def test_trickling_client_is_dropped_at_the_deadline(server, rec):
    # One byte every 0.1 s never trips a per-recv timeout: only the whole-request deadline stops it.
    payload = body_of()
    request = b"POST /approvals HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload
    with socket.create_connection(("127.0.0.1", port_of(server)), timeout=10) as sock:
        started = time.monotonic()
        for byte in request:
            readable, _, _ = select.select([sock], [], [], 0.1)
            if readable:
                break
            sock.sendall(bytes([byte]))
        status, answer, _ = parse_answer(read_all(sock))
        elapsed = time.monotonic() - started
    assert (status, answer["reason"]) == (408, "client_timeout")
    assert elapsed < 1.0 + 3.0 < len(request) * 0.1
    assert rec.decided == [] and [a["Reason"] for a in rec.audits] == ["client_timeout"]


def test_silent_client_is_dropped(server, rec):
    with socket.create_connection(("127.0.0.1", port_of(server)), timeout=10) as sock:
        status, answer, _ = parse_answer(read_all(sock))
    assert (status, answer["reason"]) == (408, "client_timeout")
    assert [a["Reason"] for a in rec.audits] == ["client_timeout"]


def connect_from(server: CallbackServer, source: str) -> socket.socket:
    """A TCP connection from ``source`` (any 127.x address is loopback on Linux): another client."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port_of(server)))
    return sock


def post_until_answered(server: CallbackServer, payload: bytes, timeout: float = 10.0) -> requests.Response:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return post(server, payload, signed(payload))
        except requests.ConnectionError:
            assert time.monotonic() < deadline, "the server never answered"


def test_connection_cap(make_server, rec):
    server = make_server(max_connections=2, client_timeout=5.0)
    idle = [connect_from(server, f"127.0.0.{n}") for n in (2, 3)]
    try:
        started = time.monotonic()
        with connect_from(server, "127.0.0.4") as extra:
            assert read_all(extra) == b""  # closed at once, without an answer
        assert time.monotonic() - started < 4.0
    finally:
        for sock in idle:
            sock.close()
    # The idle clients left without a word: nothing to audit; their slots come back.
    assert post_until_answered(server, body_of()).status_code == 200 and rec.audits == []


def test_one_client_cannot_take_every_slot(make_server, rec):
    # A slowloris from one address opens many idle connections; it gets only its own share.
    server = make_server(max_connections=8, max_per_client=3, client_timeout=30.0)
    # As many connections as the server has slots: without a per-client cap they would fill them all.
    idle = [connect_from(server, "127.0.0.2") for _ in range(8)]
    try:
        with connect_from(server, "127.0.0.2") as extra:
            assert read_all(extra) == b""  # over the per-client cap: closed at once
        # Another client's signed request is answered while the idle connections are still held.
        payload = body_of()
        started = time.monotonic()
        resp = post(server, payload, signed(payload))
        assert resp.status_code == 200 and len(rec.decided) == 1
        assert time.monotonic() - started < 10.0  # not after the idle clients' 30 s timeout
    finally:
        for sock in idle:
            sock.close()


# -- TLS ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")  # one per xdist worker: its tests may be spread over workers
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    folder = tmp_path_factory.mktemp("tls")
    files = {"ca": folder / "ca.pem", "cert": folder / "cert.pem", "key": folder / "key.pem"}
    ca.cert_pem.write_to_path(str(files["ca"]))
    for n, pem in enumerate(cert.cert_chain_pems):
        pem.write_to_path(str(files["cert"]), append=n > 0)
    cert.private_key_pem.write_to_path(str(files["key"]))
    return files


def test_tls(make_server, rec, tls_files):
    server = make_server(tls_cert=tls_files["cert"], tls_key=tls_files["key"], client_timeout=1.0)
    assert server.url.startswith("https://127.0.0.1:")
    # A plain-HTTP client and a silent one must not disturb the others.
    status, _, _ = raw_exchange(server, b"POST /approvals HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
    assert status == 0
    silent = socket.create_connection(("127.0.0.1", port_of(server)), timeout=10)
    try:
        payload = body_of()
        resp = post(server, payload, signed(payload), verify=str(tls_files["ca"]))
        assert resp.status_code == 200 and len(rec.decided) == 1
        assert_refused_tls = post(server, payload, signed(payload, secret=SECRET_C), verify=str(tls_files["ca"]))
        assert assert_refused_tls.status_code == 401
        # The handshake never happened: dropped at the deadline (at most a TLS alert, never an answer).
        assert not read_all(silent).startswith(b"HTTP")
    finally:
        silent.close()
    assert [a["Reason"] for a in rec.audits] == ["bad_signature", "client_timeout"]
    context = ssl.create_default_context(cafile=str(tls_files["ca"]))
    with socket.create_connection(("127.0.0.1", port_of(server)), timeout=10) as sock, \
            context.wrap_socket(sock, server_hostname="127.0.0.1") as tls:
        assert tls.version() in ("TLSv1.2", "TLSv1.3")


# -- the replay cache alone ----------------------------------------------------------------------------
def test_replay_cache_persists_and_expires(tmp_path):
    clock = Clock()
    path = tmp_path / "state.db"
    cache = ReplayCache(path, window=600, clock=clock)
    assert not cache.seen("a")
    cache.add("a")
    clock.now += 300
    assert cache.add_if_new("b") and not cache.add_if_new("a")
    assert cache.add_if_new("msg_in_clear") and cache.seen("msg_in_clear")
    cache.close()
    db = sqlite3.connect(path)
    assert all(len(d) == 64 for (d,) in db.execute("SELECT digest FROM webhook_ids"))  # ids are stored hashed
    db.close()
    reopened = ReplayCache(path, window=600, clock=clock)
    assert reopened.seen("a") and reopened.seen("b") and not reopened.seen("c")
    clock.now += 301
    assert not reopened.seen("a") and reopened.seen("b")
    reopened.close()


def test_replay_cache_stays_bounded_by_its_window(tmp_path):
    clock = Clock()
    path = tmp_path / "state.db"
    cache = ReplayCache(path, window=10, clock=clock)
    for n in range(100):
        cache.add(f"id-{n}")
        clock.now += 1
    assert len(cache) <= 11
    db = sqlite3.connect(path)
    assert db.execute("SELECT count(*) FROM webhook_ids").fetchone()[0] <= 12  # expired rows are deleted
    db.close()
    assert cache.seen("id-99") and not cache.seen("id-0")
    cache.close()


def test_replay_cache_check_and_add_is_atomic(tmp_path):
    cache = ReplayCache(tmp_path / "state.db", window=600)
    results: list[bool] = []
    barrier = threading.Barrier(8)

    def add() -> None:
        barrier.wait(5)
        results.append(cache.add_if_new("same"))

    threads = [threading.Thread(target=add) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(results) == [False] * 7 + [True]
    cache.close()
