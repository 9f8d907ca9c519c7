"""ImdsClient against a real scriptable HTTP peer on loopback."""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from forwarder.errors import ConfigError, ImdsError
from forwarder.imds.client import BUDGET_WINDOW, Fetch, ImdsClient, RequestBudget, validate_endpoint
from forwarder.common.retry import Backoff
from tests.peers.http_peer import HttpPeer, Response

pytestmark = pytest.mark.timeout(60)

VERSION = "2020-07-01"
EVENTS = "/metadata/scheduledevents"
COMPUTE = "/metadata/instance/compute"
DOC = b'{"DocumentIncarnation":1,"Events":[]}'
FAST = Backoff(initial=0.01, maximum=0.02)


@pytest.fixture()
def peer() -> Iterator[HttpPeer]:
    with HttpPeer(default=Response(200, body=DOC)) as p:
        yield p


@pytest.fixture()
def client(peer: HttpPeer) -> Iterator[ImdsClient]:
    c = ImdsClient(peer.url, VERSION, timeout=2.0, first_call_timeout=5.0, backoff=FAST, retry_deadline=10.0)
    yield c
    c.close()


def dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- request shape -------------------------------------------------------------------------
def test_poll_sends_metadata_header_single_api_version_and_no_forwarding_headers(
    peer: HttpPeer, client: ImdsClient
) -> None:
    fetch = client.scheduled_events()
    assert fetch == Fetch(200, DOC, None, fetch.elapsed)
    assert fetch.elapsed >= 0
    (req,) = peer.requests
    assert req.method == "GET"
    assert req.path == EVENTS
    assert req.raw_query == f"api-version={VERSION}"
    assert req.query == {"api-version": [VERSION]}
    assert req.header("Metadata") == "true"
    names = {name.lower() for name, _ in req.raw_headers}
    assert "x-forwarded-for" not in names
    assert not any(n.startswith("proxy-") for n in names)
    assert "if-none-match" not in names


def test_proxy_environment_is_ignored(peer: HttpPeer, monkeypatch: pytest.MonkeyPatch) -> None:
    proxy = f"http://127.0.0.1:{dead_port()}"
    for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, proxy)
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    peer.queue(Response(200, body={"vmId": "v"}), path=COMPUTE)
    with ImdsClient(peer.url, VERSION, backoff=FAST, retry_deadline=1.0) as c:
        assert c.scheduled_events().body == DOC  # would be "connection refused" through the proxy
        c.start_requests(["E1"])
        assert c.compute() == {"vmId": "v"}
    reqs = peer.requests
    assert [r.path for r in reqs] == [EVENTS, EVENTS, COMPUTE]  # origin-form: nothing went via a proxy
    assert all(r.header("Metadata") == "true" and r.header("X-Forwarded-For") is None for r in reqs)


@pytest.mark.parametrize("suffix", ["/vm/WestNO_1", "/vm/WestNO_1/", "/vm/WestNO_1/metadata"])
def test_endpoint_path_prefix_is_kept(peer: HttpPeer, suffix: str) -> None:
    with ImdsClient(peer.url + suffix, VERSION, compute_api_version="2023-07-01", backoff=FAST) as c:
        c.scheduled_events()
        c.compute()
    events, compute = peer.requests
    assert events.path == "/vm/WestNO_1/metadata/scheduledevents"
    assert compute.path == "/vm/WestNO_1/metadata/instance/compute"
    assert compute.raw_query == "api-version=2023-07-01"


def test_bare_metadata_base_url_is_accepted(peer: HttpPeer) -> None:
    with ImdsClient(peer.url + "/metadata", VERSION) as c:
        c.scheduled_events()
    assert peer.requests[0].path == EVENTS


@pytest.mark.parametrize("endpoint", ["169.254.169.254", "ftp://host/", "http:///nohost", "http://h/?x=1",
                                      "http://user:pw@h", "http://h/#frag", "http://h/a b", "http://h/\r\nX: y",
                                      "http://h:99999"])
def test_bad_endpoint_is_a_config_error(endpoint: str) -> None:
    with pytest.raises(ConfigError, match="imds endpoint"):
        ImdsClient(endpoint, VERSION)


def test_keep_alive_connection_is_reused(peer: HttpPeer, client: ImdsClient) -> None:
    for _ in range(4):
        client.scheduled_events()
    client.start_requests(["E1"])
    assert len({r.client for r in peer.requests}) == 1


# -- ETag / 304 ----------------------------------------------------------------------------
def test_etag_is_sent_back_and_304_has_no_body(peer: HttpPeer, client: ImdsClient) -> None:
    peer.queue(
        Response(200, {"ETag": '"v1"'}, DOC),
        Response(304, {"ETag": '"v1"'}),
        Response(304),  # an ETag-less 304 still means "what you have"
        Response(200, {"ETag": '"v2"'}, b'{"DocumentIncarnation":2,"Events":[]}'),
        Response(200, {}, DOC),  # no ETag any more: stop sending a stale one
        Response(200, {}, DOC),
    )
    first = client.scheduled_events()
    assert (first.status, first.body, first.etag) == (200, DOC, '"v1"')
    second = client.scheduled_events()
    assert (second.status, second.body, second.etag) == (304, None, '"v1"')
    third = client.scheduled_events()
    assert (third.status, third.body, third.etag) == (304, None, '"v1"')
    fourth = client.scheduled_events()
    assert (fourth.status, fourth.etag) == (200, '"v2"') and fourth.body.startswith(b'{"DocumentIncarnation":2')
    fifth = client.scheduled_events()
    assert (fifth.status, fifth.etag) == (200, None)
    client.scheduled_events()
    sent = [r.header("If-None-Match") for r in peer.requests]
    assert sent == [None, '"v1"', '"v1"', '"v1"', '"v2"', None]


def test_without_etags_no_conditional_requests_and_stray_304_is_an_error(peer: HttpPeer, client: ImdsClient) -> None:
    peer.queue(Response(200, body=DOC), Response(200, body=DOC), Response(304))
    assert client.scheduled_events().etag is None
    assert client.scheduled_events().body == DOC
    with pytest.raises(ImdsError, match="304") as info:
        client.scheduled_events()
    assert info.value.status == 304 and info.value.retryable
    assert all(r.header("If-None-Match") is None for r in peer.requests)


def test_forget_etag_drops_if_none_match(peer: HttpPeer, client: ImdsClient) -> None:
    peer.queue(Response(200, {"ETag": "W/\"x\""}, DOC))
    client.scheduled_events()
    client.forget_etag()
    client.scheduled_events()
    assert [r.header("If-None-Match") for r in peer.requests] == [None, None]


# -- error statuses ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "status, retryable, headers, retry_after",
    [
        (400, False, {}, None),
        (404, False, {}, None),
        (405, False, {"Allow": "GET, POST"}, None),
        (410, True, {}, None),
        (429, True, {"Retry-After": "7"}, 7.0),
        (500, True, {}, None),
        (503, True, {"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}, 0.0),
    ],
)
def test_error_status_mapping(
    peer: HttpPeer, client: ImdsClient, status: int, retryable: bool, headers: dict[str, str], retry_after: float | None
) -> None:
    peer.queue(Response(status, headers, b'{"error": "something specific"}'))
    with pytest.raises(ImdsError) as info:
        client.scheduled_events()
    err = info.value
    assert (err.status, err.retryable, err.retry_after) == (status, retryable, retry_after)
    message = str(err)
    assert client.events_url in message
    assert str(status) in message
    assert "something specific" in message
    assert len(peer.requests) == 1  # no retry loop inside the poll


def test_error_message_body_is_truncated(peer: HttpPeer, client: ImdsClient) -> None:
    peer.queue(Response(500, body=b"x" * 5000))
    with pytest.raises(ImdsError) as info:
        client.scheduled_events()
    message = str(info.value)
    assert "x" * 200 in message and "x" * 201 not in message
    assert len(message) < 400


# -- timeouts and connection errors ---------------------------------------------------------
def test_first_call_gets_the_long_timeout_then_the_short_one(peer: HttpPeer) -> None:
    peer.queue(Response(200, body=DOC, delay=0.8), Response(200, body=DOC, delay=3.0))
    with ImdsClient(peer.url, VERSION, timeout=0.3, first_call_timeout=4.0) as c:
        assert c.scheduled_events().body == DOC  # 0.8 s > timeout, but the first call may be slow
        started = time.monotonic()
        with pytest.raises(ImdsError, match=r"timed out after 0\.3s") as info:
            c.scheduled_events()
        assert time.monotonic() - started < 2.5
    assert info.value.status is None and info.value.retryable
    peer.release()


def test_first_call_timeout_applies_until_a_first_success(peer: HttpPeer) -> None:
    peer.queue(Response(hang=True), Response(500), Response(200, body=DOC, delay=1.0))
    with ImdsClient(peer.url, VERSION, timeout=0.2, first_call_timeout=0.4) as c:
        started = time.monotonic()
        with pytest.raises(ImdsError, match=r"timed out after 0\.4s") as info:
            c.scheduled_events()
        assert 0.35 <= time.monotonic() - started < 3.0
        assert info.value.status is None and info.value.retryable
        with pytest.raises(ImdsError):
            c.scheduled_events()  # the 500
        with pytest.raises(ImdsError, match=r"timed out after 0\.4s"):
            c.scheduled_events()  # still "first call": 1.0 s outlasts 0.4 s
    peer.release()


def test_connection_refused_is_retryable_and_names_the_url() -> None:
    port = dead_port()
    with ImdsClient(f"http://127.0.0.1:{port}", VERSION, backoff=FAST, retry_deadline=0.3) as c:
        with pytest.raises(ImdsError) as info:
            c.scheduled_events()
        assert info.value.status is None and info.value.retryable
        assert f"127.0.0.1:{port}/metadata/scheduledevents" in str(info.value)
        assert "refused" in str(info.value).lower()
        started = time.monotonic()
        with pytest.raises(ImdsError, match="giving up"):
            c.compute()
        assert time.monotonic() - started < 3.0


# -- start_requests ------------------------------------------------------------------------
def test_start_requests_body_and_headers(peer: HttpPeer, client: ImdsClient) -> None:
    client.start_requests(["A-1", "B-2"], incarnation=3)
    client.start_requests(("C-3",))
    first, second = peer.requests
    assert first.method == "POST" and first.path == EVENTS and first.raw_query == f"api-version={VERSION}"
    assert first.header("Metadata") == "true" and first.header("X-Forwarded-For") is None
    assert first.header("Content-Type") == "application/json"
    assert first.json() == {"StartRequests": [{"EventId": "A-1"}, {"EventId": "B-2"}], "DocumentIncarnation": 3}
    assert second.json() == {"StartRequests": [{"EventId": "C-3"}]}


def test_start_requests_with_no_ids_sends_nothing(peer: HttpPeer, client: ImdsClient) -> None:
    client.start_requests([])
    with pytest.raises(TypeError):
        client.start_requests("A-1")  # a bare string would approve "A", "-", "1"
    assert peer.requests == []


def test_start_requests_retries_500_then_429_honouring_retry_after(peer: HttpPeer, client: ImdsClient) -> None:
    peer.queue(Response(500, body=b"boom"), Response(429, {"Retry-After": "1"}), Response(200))
    client.start_requests(["E1"])
    reqs = peer.requests
    assert [r.method for r in reqs] == ["POST"] * 3
    assert all(r.json() == {"StartRequests": [{"EventId": "E1"}]} for r in reqs)
    assert reqs[1].received_at - reqs[0].received_at < 0.9  # jittered tiny backoff after the 500
    assert reqs[2].received_at - reqs[1].received_at >= 0.95  # Retry-After: 1 honoured


def test_retry_after_is_capped_by_the_backoff_policy(peer: HttpPeer) -> None:
    peer.queue(Response(503, {"Retry-After": "3600"}), Response(200))
    policy = Backoff(initial=0.01, maximum=0.02, retry_after_cap=0.1)
    with ImdsClient(peer.url, VERSION, backoff=policy) as c:
        started = time.monotonic()
        c.start_requests(["E1"])
        assert time.monotonic() - started < 3.0
    assert len(peer.requests) == 2


def test_start_requests_400_is_not_retried(peer: HttpPeer, client: ImdsClient) -> None:
    peer.queue(Response(400, body=b'{"error":"Bad Request","message":"Invalid EventId"}'))
    with pytest.raises(ImdsError) as info:
        client.start_requests(["nope"])
    assert info.value.status == 400 and not info.value.retryable
    assert "Invalid EventId" in str(info.value) and "POST" in str(info.value)
    assert len(peer.requests) == 1


def test_410_is_retried_within_its_window_then_succeeds(peer: HttpPeer, client: ImdsClient) -> None:
    peer.queue(Response(410), Response(410), Response(200))
    client.start_requests(["E1"])
    assert len(peer.requests) == 3


def test_410_gives_up_after_its_window(peer: HttpPeer) -> None:
    peer.default = Response(410, body=b"gone")
    with ImdsClient(peer.url, VERSION, backoff=Backoff(initial=0.05, maximum=0.1), gone_window=0.5,
                    retry_deadline=30) as c:
        started = time.monotonic()
        with pytest.raises(ImdsError, match="giving up") as info:
            c.start_requests(["E1"])
        assert time.monotonic() - started < 3.0
    assert info.value.status == 410
    assert len(peer.requests) >= 2


def test_overall_deadline_bounds_the_retry_loop(peer: HttpPeer, client: ImdsClient) -> None:
    peer.default = Response(500, body=b"down")
    started = time.monotonic()
    with pytest.raises(ImdsError, match="giving up") as info:
        client.start_requests(["E1"], deadline=0.4)
    assert time.monotonic() - started < 3.0
    assert info.value.status == 500 and "down" in str(info.value)
    assert len(peer.requests) >= 2


def test_stop_event_aborts_a_retry_loop_promptly(peer: HttpPeer) -> None:
    peer.default = Response(503, {"Retry-After": "30"})
    stop = threading.Event()
    with ImdsClient(peer.url, VERSION, backoff=FAST, stop=stop) as c:
        errors: list[BaseException] = []
        done = threading.Event()

        def approve() -> None:
            try:
                c.start_requests(["E1"])
            except BaseException as exc:  # noqa: BLE001 - handed to the test thread
                errors.append(exc)
            done.set()

        worker = threading.Thread(target=approve, daemon=True)
        worker.start()
        peer.wait_for(1)
        stop.set()
        started = time.monotonic()
        assert done.wait(5.0), "retry loop ignored the stop event"
        assert time.monotonic() - started < 2.0
    (err,) = errors
    assert isinstance(err, ImdsError) and "stopped" in str(err)
    assert len(peer.requests) == 1


# -- compute -------------------------------------------------------------------------------
COMPUTE_DOC = {
    "vmId": "02aab8a4-74ef-476e-8182-f6d2ba4166a6",
    "name": "web_3",
    "location": "norwayeast",
    "zone": "",
    "vmScaleSetName": "web",
    "osProfile": {"computerName": "web000003", "adminUsername": "azureuser"},
    "tagsList": [{"name": "env", "value": "prod"}],
}


def test_compute_is_parsed_and_retried(peer: HttpPeer, client: ImdsClient) -> None:
    peer.queue(Response(500), Response(429), Response(200, body=COMPUTE_DOC), path=COMPUTE)
    assert client.compute() == COMPUTE_DOC
    reqs = peer.requests
    assert [r.path for r in reqs] == [COMPUTE] * 3
    assert all(r.method == "GET" and r.raw_query == "api-version=2021-02-01" for r in reqs)
    assert all(r.header("Metadata") == "true" for r in reqs)


@pytest.mark.parametrize("body", [b"<html>not json</html>", b'["a list"]'])
def test_compute_rejects_what_is_not_a_json_object(peer: HttpPeer, client: ImdsClient, body: bytes) -> None:
    peer.queue(Response(200, body=body), path=COMPUTE)
    with pytest.raises(ImdsError, match="compute") as info:
        client.compute()
    assert not info.value.retryable
    assert len(peer.requests) == 1


def test_compute_404_is_not_retried(peer: HttpPeer, client: ImdsClient) -> None:
    peer.queue(Response(404, body=b"no such path"), path=COMPUTE)
    with pytest.raises(ImdsError, match="404") as info:
        client.compute()
    assert not info.value.retryable
    assert len(peer.requests) == 1


# -- HTTP framing: the client parses answers itself (httptools), so every framing IMDS or a proxy
# could use is exercised against a raw socket peer that writes exactly the bytes given.
class RawPeer:
    """Accepts connections; for each request read, writes the next scripted bytes (then maybe closes)."""

    def __init__(self, answers: list[tuple[bytes | Callable[[socket.socket], None], bool]]) -> None:
        self.answers = list(answers)
        self.connections = 0
        self.requests: list[bytes] = []
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while self.answers:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                buf = b""
                while self.answers:
                    while b"\r\n\r\n" not in buf:
                        try:
                            data = conn.recv(65536)
                        except OSError:  # the client dropped the connection (reset): next one
                            data = b""
                        if not data:
                            break
                        buf += data
                    if b"\r\n\r\n" not in buf:
                        break  # the client went away
                    head, _, buf = buf.partition(b"\r\n\r\n")
                    self.requests.append(head)
                    answer, close = self.answers.pop(0)
                    if callable(answer):
                        answer(conn)  # writes its own bytes, pieces and pauses
                    else:
                        conn.sendall(answer)
                    if close:
                        break

    def close(self) -> None:
        self.server.close()


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\r\n" + DOC[:16] + b"\r\n"
    + f"{len(DOC) - 16:x}".encode() + b"\r\n" + DOC[16:] + b"\r\n0\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: " + str(len(DOC)).encode() + b"\r\n\r\n" + DOC,
], ids=["chunked", "content-length"])
def test_framings_are_parsed_and_the_connection_kept(answer: bytes) -> None:
    peer = RawPeer([(answer, False), (answer, False)])
    try:
        with ImdsClient(peer.url, VERSION) as c:
            assert c.scheduled_events().body == DOC
            assert c.scheduled_events().body == DOC
        assert peer.connections == 1
    finally:
        peer.close()


def test_close_delimited_and_http_1_0_answers_are_read_to_the_end_and_not_reused() -> None:
    answers = [(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + DOC, True),
               (b"HTTP/1.0 200 OK\r\nContent-Length: " + str(len(DOC)).encode() + b"\r\n\r\n" + DOC, True),
               (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}", False)]
    peer = RawPeer(answers)
    try:
        with ImdsClient(peer.url, VERSION) as c:
            assert c.scheduled_events().body == DOC
            assert c.scheduled_events().body == DOC
            assert c.scheduled_events().body == b"{}"
        assert peer.connections == 3
    finally:
        peer.close()


def test_an_idle_connection_the_server_dropped_costs_no_failed_poll() -> None:
    # The server answers, then closes the kept-alive connection while the client is idle (as IMDS
    # does): the next poll is sent once more on a fresh connection and succeeds.
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: " + str(len(DOC)).encode() + b"\r\n\r\n" + DOC
    peer = RawPeer([(ok, True), (ok, False)])
    try:
        with ImdsClient(peer.url, VERSION) as c:
            assert c.scheduled_events().body == DOC
            assert c.scheduled_events().body == DOC
        assert peer.connections == 2 and len(peer.requests) == 2
    finally:
        peer.close()


@pytest.mark.parametrize("answer, reason", [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"DocumentIn", "middle of its answer"),
    (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", "malformed HTTP answer"),
    (b"", "without answering"),
], ids=["truncated", "not-http", "nothing"])
def test_broken_answers_are_retryable_errors_that_say_what_happened(answer: bytes, reason: str) -> None:
    peer = RawPeer([(answer, True), (answer, True)])
    try:
        with ImdsClient(peer.url, VERSION) as c, pytest.raises(ImdsError, match=reason) as info:
            c.scheduled_events()
        assert info.value.status is None and info.value.retryable
    finally:
        peer.close()


# -- hard bounds (docs/imds-transport.md): deadline, body cap, 1xx, connection hygiene, budget ---------
OK = b"HTTP/1.1 200 OK\r\nContent-Length: " + str(len(DOC)).encode() + b"\r\n\r\n" + DOC
DOC2 = b'{"DocumentIncarnation":2,"Events":[]}'
OK2 = b"HTTP/1.1 200 OK\r\nContent-Length: " + str(len(DOC2)).encode() + b"\r\n\r\n" + DOC2


def pieces(*parts: bytes, pause: float = 0.15) -> Callable[[socket.socket], None]:
    """An answer written in separate TCP segments, ``pause`` apart (Nagle off)."""
    def write(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for i, part in enumerate(parts):
            if i:
                time.sleep(pause)  # the peer's pacing, not test synchronisation
            conn.sendall(part)
    return write


@pytest.mark.parametrize("interim", [
    [b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"],
    [b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 102 Processing\r\n\r\n", b"HTTP/1.1 103 Early Hints\r\n\r\n"],
], ids=["103-own-segment", "several-1xx"])
def test_interim_answers_are_skipped_and_the_next_poll_reads_its_own_answer(interim: list[bytes]) -> None:
    peer = RawPeer([(pieces(*interim, OK), False), (OK2, False)])
    try:
        with ImdsClient(peer.url, VERSION) as c:
            first = c.scheduled_events()
            assert (first.status, first.body) == (200, DOC)
            assert c.scheduled_events().body == DOC2  # not the previous request's answer
        assert peer.connections == 1
    finally:
        peer.close()


def test_interim_and_final_answer_in_one_segment() -> None:
    peer = RawPeer([(b"HTTP/1.1 103 Early Hints\r\n\r\n" + OK, False), (OK2, False)])
    try:
        with ImdsClient(peer.url, VERSION) as c:
            assert c.scheduled_events().body == DOC
            assert c.scheduled_events().body == DOC2
    finally:
        peer.close()


def test_endless_interim_answers_are_a_framing_error() -> None:
    peer = RawPeer([(b"HTTP/1.1 100 Continue\r\n\r\n" * 50, True)])
    try:
        with ImdsClient(peer.url, VERSION) as c, pytest.raises(ImdsError, match="interim") as info:
            c.scheduled_events()
        assert info.value.retryable
    finally:
        peer.close()


def test_an_unrequested_protocol_switch_is_malformed() -> None:
    peer = RawPeer([(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\n", True)])
    try:
        with ImdsClient(peer.url, VERSION) as c, pytest.raises(ImdsError, match="malformed"):
            c.scheduled_events()
    finally:
        peer.close()


def test_a_slow_drip_is_cut_off_by_the_total_deadline() -> None:
    def drip(conn: socket.socket) -> None:
        for i in range(len(OK)):
            try:
                conn.sendall(OK[i:i + 1])
            except OSError:
                return  # the client gave up: what we want
            time.sleep(0.1)  # the peer's pacing: one byte every 100 ms

    peer = RawPeer([(drip, True)])
    try:
        with ImdsClient(peer.url, VERSION, timeout=0.6, first_call_timeout=0.6) as c:
            started = time.monotonic()
            with pytest.raises(ImdsError, match="timed out after 0.6s") as info:
                c.scheduled_events()
            assert time.monotonic() - started < 3.0  # per-recv timeouts would wait ~9 s here
        assert info.value.retryable and info.value.status is None
    finally:
        peer.close()


def test_a_content_length_over_the_cap_is_refused_without_reading_the_body() -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 300000000\r\n\r\n"
    sent: list[int] = []

    def huge(conn: socket.socket) -> None:
        conn.sendall(head)
        total = 0
        try:
            while total < 300_000_000:
                total += conn.send(b"x" * 65536)
        except OSError:
            pass
        sent.append(total)

    peer = RawPeer([(huge, True), (OK, False)])
    try:
        with ImdsClient(peer.url, VERSION, max_body=64 * 1024) as c:
            with pytest.raises(ImdsError, match="Content-Length 300000000 is over the 65536-byte cap"):
                c.scheduled_events()
            assert c.scheduled_events().body == DOC  # a fresh connection
        wait_for_list(sent)
        assert sent[0] < 50_000_000  # the client stopped reading (and closed) long before the end
        assert peer.connections == 2
    finally:
        peer.close()


def test_a_chunked_body_over_the_cap_is_refused_as_it_streams() -> None:
    chunk = b"x" * 32768
    sent: list[int] = []

    def stream(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        total = 0
        try:
            for _ in range(10_000):  # 320 MB if nobody stops it
                conn.sendall(b"8000\r\n" + chunk + b"\r\n")
                total += len(chunk)
        except OSError:
            pass
        sent.append(total)

    peer = RawPeer([(stream, True)])
    try:
        with ImdsClient(peer.url, VERSION, max_body=256 * 1024) as c, \
                pytest.raises(ImdsError, match="passed the 262144-byte cap"):
            c.scheduled_events()
        wait_for_list(sent)
        assert sent[0] < 50_000_000
    finally:
        peer.close()


def wait_for_list(values: list[int], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not values:
        assert time.monotonic() < deadline, "the peer never finished"
        time.sleep(0.02)


def test_bytes_after_a_complete_answer_drop_the_connection() -> None:
    # One segment carries the answer and a second, unrequested one: the first is the answer, and
    # the connection cannot be trusted any more, so the next poll gets a fresh one and its own answer.
    peer = RawPeer([(OK + OK2, False), (OK2, False)])
    try:
        with ImdsClient(peer.url, VERSION) as c:
            assert c.scheduled_events().body == DOC
            assert c.scheduled_events().body == DOC2
        assert peer.connections == 2
    finally:
        peer.close()


def test_a_late_stray_answer_on_an_idle_connection_is_never_read_as_the_next_answer() -> None:
    stray = b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n{\"old\":1}"
    peer = RawPeer([(pieces(OK, stray, pause=0.05), False), (OK2, False)])
    try:
        with ImdsClient(peer.url, VERSION) as c:
            assert c.scheduled_events().body == DOC
            time.sleep(0.3)  # let the stray bytes land on the idle connection (the scenario, not a sync)
            assert c.scheduled_events().body == DOC2
        assert peer.connections == 2
    finally:
        peer.close()


def test_a_stalled_connect_is_bounded() -> None:
    # A listener that never accepts, its backlog filled: the SYN of a further connect is dropped.
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    fillers = []
    try:
        for _ in range(8):
            f = socket.socket()
            f.setblocking(False)
            f.connect_ex(server.getsockname())
            fillers.append(f)
        with ImdsClient(f"http://127.0.0.1:{server.getsockname()[1]}", VERSION, timeout=1.0,
                        first_call_timeout=1.0, connect_timeout=0.5) as c:
            started = time.monotonic()
            with pytest.raises(ImdsError, match="timed out") as info:
                c.scheduled_events()
            assert time.monotonic() - started < 5.0
        assert info.value.retryable
    finally:
        for f in fillers:
            f.close()
        server.close()


class _WaitsTaken(threading.Event):
    """The client's stop event: every wait it takes is counted, not slept (nothing else sets it)."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.waits.append(float(timeout or 0.0))
        return self.is_set()


def test_poll_retry_after_is_capped_for_retried_requests(peer: HttpPeer) -> None:
    peer.queue(Response(429, {"Retry-After": "3600"}), Response(200))
    stop = _WaitsTaken()  # the 5 s the client waits between its two requests, counted instead of slept
    with ImdsClient(peer.url, VERSION, backoff=Backoff(initial=0.01, maximum=0.02), stop=stop) as c:
        c.start_requests(["E1"])
    took = sum(stop.waits)
    assert len(peer.requests) == 2, peer.requests
    assert 4.0 <= took < 20.0  # Retry-After honoured up to RETRY_AFTER_CAP (5 s), not for an hour


class _FakeStop:
    """A stop event on a fake clock: a wait moves the clock on."""

    def __init__(self, now: list[float], stop_after: int | None = None) -> None:
        self.now = now
        self.waits: list[float] = []
        self.stop_after = stop_after

    def wait(self, seconds: float) -> bool:
        self.waits.append(seconds)
        self.now[0] += seconds
        return self.stop_after is not None and len(self.waits) >= self.stop_after


def test_request_budget_allows_four_in_any_window() -> None:
    now = [100.0]
    budget = RequestBudget(clock=lambda: now[0])
    stop = _FakeStop(now)
    for _ in range(4):
        assert budget.acquire(stop)  # type: ignore[arg-type]
        budget.release()
    assert stop.waits == []
    assert budget.acquire(stop)  # type: ignore[arg-type]
    budget.release()
    assert stop.waits == [pytest.approx(BUDGET_WINDOW)] and budget.waited == 1
    stopped = threading.Event()
    stopped.set()
    for _ in range(3):
        assert budget.acquire(stop)  # type: ignore[arg-type]
        budget.release()
    assert not budget.acquire(stopped)  # full, and shutting down: no wait


def test_a_requests_window_runs_from_its_end_not_its_start() -> None:
    """IMDS received a request somewhere between its send and its answer: only the answer's moment is known
    to be no earlier, so a slow request keeps its slot for a window after it ended."""
    now = [100.0]
    budget = RequestBudget(limit=1, clock=lambda: now[0])
    stop = _FakeStop(now)
    assert budget.acquire(stop)  # type: ignore[arg-type]
    now[0] += 0.4  # the request took 0.4 s (a loaded VM, a slow answer)
    budget.release()
    assert budget.acquire(stop)  # type: ignore[arg-type]
    assert now[0] == pytest.approx(100.4 + BUDGET_WINDOW)  # not 100.0 + the window
    # A request still in flight holds its slot however long it takes: the next one waits a window at a
    # time (the earliest the slot can free) until it ends.
    waiting = _FakeStop(now, stop_after=3)
    assert not budget.acquire(waiting)  # type: ignore[arg-type]
    assert waiting.waits == [pytest.approx(BUDGET_WINDOW)] * 3
    budget.release()
    ended = now[0]
    assert budget.acquire(stop)  # type: ignore[arg-type]
    assert now[0] == pytest.approx(ended + BUDGET_WINDOW)


def test_every_client_of_one_endpoint_shares_one_budget(peer: HttpPeer) -> None:
    with ImdsClient(peer.url, VERSION) as a, ImdsClient(peer.url + "/", VERSION) as b:
        assert a.budget is b.budget
        started = time.monotonic()
        for _ in range(3):
            a.scheduled_events()
            b.scheduled_events()
        took = time.monotonic() - started
    assert took >= 0.9  # 6 requests at 4 per second
    times = sorted(r.received_at for r in peer.requests)
    assert all(later - earlier >= 0.95 for earlier, later in zip(times, times[4:]))


def test_validate_endpoint_normalizes_and_refuses_userinfo() -> None:
    assert validate_endpoint(" http://127.0.0.1:8080/vm/a/metadata/ ") == "http://127.0.0.1:8080/vm/a"
    with pytest.raises(ValueError, match="user:password"):
        validate_endpoint("http://admin:secret@169.254.169.254")
