"""A hostile or broken IMDS against the real agent: every failure class of the transport, and an
exception inside the poll cycle. Each test serves a good document, then the bad answer, then a good
document again, and asserts: the agent is alive, the records of the good documents are exactly the
expected ones (none invented, none lost), and the log says what was wrong.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from forwarder.agent.status import read_status
from tests.adversarial.hostile import HostileServer, Reply, Request
from tests.agent import AgentProcess, read_jsonl, wait_until, write_config

pytestmark = pytest.mark.timeout(180)

EVENT = "5DD55B64-45AD-49D3-BBC9-F57D4EA97BD7"
COMPUTE = {"vmId": "0f4b1f6c-aaaa-4bbb-8ccc-000000000001", "name": "hostile-vm", "resourceId": "/x/hostile-vm"}


def document(incarnation: int, status: str) -> dict[str, Any]:
    return {"DocumentIncarnation": incarnation, "Events": [{
        "EventId": EVENT, "EventType": "Reboot", "ResourceType": "VirtualMachine", "Resources": ["hostile-vm"],
        "EventStatus": status, "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT" if status == "Scheduled" else "",
        "Description": "", "EventSource": "Platform", "DurationInSeconds": -1}]}


GOOD_1 = Reply.json(document(1, "Scheduled"))
GOOD_2 = Reply.json(document(2, "Started"))


class Imds:
    """The hostile server's handler: good document 1, then ``bad`` for a while, then good document 2."""

    def __init__(self) -> None:
        self.phase = "good1"
        self.bad: Reply = GOOD_1
        self.bad_served = threading.Event()
        self.bad_count = 0

    def __call__(self, req: Request) -> Reply:
        if "/metadata/instance" in req.target:
            return Reply.json(COMPUTE)
        if self.phase == "good1":
            return GOOD_1
        if self.phase == "bad":
            self.bad_count += 1
            self.bad_served.set()
            return self.bad
        return GOOD_2


@pytest.fixture()
def imds() -> Iterator[tuple[Imds, HostileServer]]:
    handler = Imds()
    with HostileServer(handler) as server:
        yield handler, server


def scheduled_records(out: Path) -> list[tuple[str, str]]:
    return [(r["type"], r["subject"]) for r in read_jsonl(out) if r["type"].startswith("scheduledevent.")]


def start_agent(tmp_path: Path, server: HostileServer, env: dict[str, str] | None = None) -> AgentProcess:
    config = write_config(tmp_path / "sefwd.toml", server.url, tmp_path / "state")
    # The status report is written within 100 ms of a change (not 5 s): tests wait for its counts.
    return AgentProcess(config, tmp_path / "agent.log",
                        env={"SEFWD_IMDS_TIMEOUT": "1s", "SEFWD_AGENT_STATUS_INTERVAL": "100ms", **(env or {})})


def status_of(tmp_path: Path) -> dict[str, Any]:
    """The ``imds`` part of the agent's status report in the store (empty until written)."""
    return dict((read_status(tmp_path / "state").get("agent") or {}).get("imds") or {})


def rss_peak_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def run_through(tmp_path: Path, handler: Imds, server: HostileServer, bad: Reply, *, log_says: tuple[str, ...],
                min_bad: int = 1, env: dict[str, str] | None = None) -> float:
    """good 1 → ``bad`` (at least ``min_bad`` times) → good 2; the common assertions; returns the peak RSS in MiB."""
    out = tmp_path / "out.jsonl"
    agent = start_agent(tmp_path, server, env)
    try:
        wait_until(lambda: scheduled_records(out), 60, "the record of the first good document")
        handler.bad = bad
        handler.phase = "bad"
        assert handler.bad_served.wait(60), "the agent never asked again"
        wait_until(lambda: handler.bad_count >= min_bad, 60, f"{min_bad} bad answers")
        wait_until(lambda: any(w in agent.logs() for w in log_says), 60, f"a log line with one of {log_says}")
        assert agent.alive(), agent.logs()[-3000:]
        peak = rss_peak_mib(agent.proc.pid)
        handler.phase = "good2"
        wait_until(lambda: len(scheduled_records(out)) >= 2, 60, "the record of the second good document")
        assert agent.alive(), agent.logs()[-3000:]
        # Exactly the changes of the good documents: nothing invented (no canceled/completed from the bad
        # answer read as "no events"), nothing lost.
        assert scheduled_records(out) == [("scheduledevent.scheduled", EVENT), ("scheduledevent.started", EVENT)]
        assert "Traceback" not in agent.logs() or "unexpected error in the poll cycle" in agent.logs()
        return peak
    finally:
        if agent.alive():
            rc = agent.terminate()
            assert rc == 0, agent.logs()[-3000:]
        else:
            raise AssertionError(f"the agent died: {agent.logs()[-3000:]}")


def test_slow_drip_is_cut_by_the_request_deadline(tmp_path: Path, imds: tuple[Imds, HostileServer]) -> None:
    handler, server = imds
    # One byte per second: with per-recv timeouts this held the poller forever.
    run_through(tmp_path, handler, server, Reply.json(document(2, "Started"), drip=1.0),
                log_says=("deadline for the whole answer",), min_bad=2,
                env={"SEFWD_IMDS_TIMEOUT": "500ms"})  # each answer to a loopback poll takes milliseconds


@pytest.mark.slow  # real-time backoff
def test_retry_after_3600_does_not_park_detection(tmp_path: Path, imds: tuple[Imds, HostileServer]) -> None:
    handler, server = imds
    run_through(tmp_path, handler, server,
                Reply.json({"error": "Too many requests"}, status=429, headers={"Retry-After": "3600"}),
                log_says=("429",), min_bad=2)  # a second 429 came: the poller did not sleep for an hour
    times = [r.at for r in server.requests if "scheduledevents" in r.target]
    assert max(b - a for a, b in zip(times, times[1:])) < 15.0  # the cap is 5 s; generous for a loaded machine


def test_oversized_body_is_refused_unread(tmp_path: Path, imds: tuple[Imds, HostileServer]) -> None:
    handler, server = imds
    size = 300 * 1024 * 1024

    def huge() -> Iterator[bytes]:
        block = b" " * 65536
        for _ in range(size // len(block)):
            yield block

    peak = run_through(tmp_path, handler, server,
                       Reply(body=huge, headers={"Content-Length": str(size), "Content-Type": "application/json"}),
                       log_says=("over the 1048576-byte cap",), min_bad=2)
    assert peak < 64, f"peak RSS {peak:.1f} MiB"


def test_chunked_oversized_body_is_refused_as_it_streams(tmp_path: Path, imds: tuple[Imds, HostileServer]) -> None:
    handler, server = imds
    peak: list[float] = []

    def huge() -> Iterator[bytes]:
        yield b'{"DocumentIncarnation": 3, "Events": [], "Padding": "'
        for _ in range(5000):  # ~320 MB if read to the end
            yield b"x" * 65536

    out = tmp_path / "out.jsonl"
    agent = start_agent(tmp_path, server)
    try:
        wait_until(lambda: scheduled_records(out), 60, "the record of the first good document")
        handler.bad, handler.phase = Reply(body=huge), "bad"
        wait_until(lambda: handler.bad_count >= 2, 60, "two oversized answers")
        wait_until(lambda: "byte cap" in agent.logs(), 60, "the cap in the log")
        peak.append(rss_peak_mib(agent.proc.pid))
        handler.phase = "good2"
        wait_until(lambda: len(scheduled_records(out)) >= 2, 60, "the second good document")
        assert agent.alive()
        assert scheduled_records(out) == [("scheduledevent.scheduled", EVENT), ("scheduledevent.started", EVENT)]
    finally:
        assert agent.terminate() == 0, agent.logs()[-3000:]
    assert peak[0] < 64, f"peak RSS {peak[0]:.1f} MiB"


def test_interim_answers_including_103_in_its_own_segment(tmp_path: Path, imds: tuple[Imds, HostileServer]) -> None:
    handler, server = imds
    interim = [b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n"]
    agent_log = tmp_path / "agent.log"
    # The interim answers precede good document 2 itself: its record must come, exactly once, and no
    # later poll may read a previous request's answer.
    run_through(tmp_path, handler, server, Reply.json(document(2, "Started"), interim=interim),
                log_says=("interim (1xx)",), min_bad=3)
    text = agent_log.read_text()
    assert "answered 103" not in text and "answered 100" not in text


def test_stalled_accept_and_silent_server(tmp_path: Path, imds: tuple[Imds, HostileServer]) -> None:
    handler, server = imds
    out = tmp_path / "out.jsonl"
    agent = start_agent(tmp_path, server, {"SEFWD_IMDS_TIMEOUT": "500ms"})  # a loopback answer takes milliseconds
    try:
        wait_until(lambda: scheduled_records(out), 60, "the record of the first good document")
        # Held connections never answer, and new ones are never accepted (they sit in the backlog).
        handler.bad, handler.phase = Reply.json(document(2, "Started"), hold=120), "bad"
        wait_until(lambda: handler.bad_count >= 1, 60, "a held request")
        server.accepting.clear()
        wait_until(lambda: "deadline for the whole answer" in agent.logs(), 60, "the timeout in the log")
        # More polls fail while nothing is accepted (their connections wait in the backlog, then their
        # SYNs are dropped): each is cut by its deadline, and the poller goes on.
        wait_until(lambda: status_of(tmp_path).get("consecutive_failures", 0) >= 3, 90, "three failed polls in a row")
        assert agent.alive()
        handler.phase = "good2"
        server.accepting.set()
        wait_until(lambda: len(scheduled_records(out)) >= 2, 90, "the second good document")
        assert scheduled_records(out) == [("scheduledevent.scheduled", EVENT), ("scheduledevent.started", EVENT)]
    finally:
        assert agent.terminate() == 0, agent.logs()[-3000:]


def test_garbage_status_line(tmp_path: Path, imds: tuple[Imds, HostileServer]) -> None:
    handler, server = imds
    run_through(tmp_path, handler, server, Reply(raw=b"SSH-2.0-OpenSSH_9.6\r\nHTTP/9 OK\r\n\r\n", close=True),
                log_says=("malformed HTTP answer",), min_bad=2)


def test_bytes_after_the_answer_are_not_read_as_the_next_answer(tmp_path: Path, imds: tuple[Imds, HostileServer]) -> None:
    handler, server = imds
    stale = orjson.dumps({"DocumentIncarnation": 9, "Events": []})
    extra = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(stale), stale)
    body = orjson.dumps(document(1, "Scheduled"))
    # Document 1 again, followed by an unrequested answer saying "no events": if a later poll read it,
    # the agent would invent a canceled record.
    raw = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s%s" % (len(body), body, extra)
    run_through(tmp_path, handler, server, Reply(raw=raw), log_says=("not reused",), min_bad=2)


def test_an_exception_inside_the_cycle_is_logged_counted_and_survived(
        tmp_path: Path, imds: tuple[Imds, HostileServer]) -> None:
    handler, server = imds
    # Documents can no longer raise (they are bounded or refused), but the instance metadata read in
    # the same cycle can: JSON nested beyond Python's recursion limit raises RecursionError in the
    # parser, which no stage expects. The cycle guard must log it, count it and poll on.
    nested = b"[" * 200_000 + b"]" * 200_000
    serve = handler.__call__

    def hostile_compute(req: Request) -> Reply:
        if "/metadata/instance" in req.target and handler.phase == "bad":
            handler.bad_count += 1
            return Reply(body=nested, headers={"Content-Type": "application/json"})
        return serve(req) if handler.phase != "bad" else GOOD_1

    server.handler = hostile_compute
    # Every other poll cycle (0.5 s apart): a good cycle between two failed ones keeps the poller from
    # backing off (failed cycles in a row lengthen its wait).
    agent = start_agent(tmp_path, server, env={"SEFWD_IMDS_COMPUTE_REFRESH": "900ms"})
    out = tmp_path / "out.jsonl"
    try:
        wait_until(lambda: scheduled_records(out), 60, "the first good document")
        handler.phase = "bad"
        wait_until(lambda: handler.bad_count >= 3, 60, "three hostile compute answers")
        wait_until(lambda: "unexpected error in the poll cycle" in agent.logs(), 60, "the problem in the log")
        wait_until(lambda: status_of(tmp_path).get("cycle_errors"), 60, "the failure counted in the status report")
        assert "RecursionError" in agent.logs()
        handler.phase = "good2"
        wait_until(lambda: len(scheduled_records(out)) >= 2, 60, "the second good document")
        assert agent.alive()
        assert scheduled_records(out) == [("scheduledevent.scheduled", EVENT), ("scheduledevent.started", EVENT)]
        # Logged once per minute per kind and place, not once per cycle.
        assert agent.logs().count("unexpected error in the poll cycle") <= 2
    finally:
        assert agent.terminate() == 0, agent.logs()[-3000:]


def test_failing_instance_metadata_does_not_hold_up_polling(tmp_path: Path, imds: tuple[Imds, HostileServer]) -> None:
    handler, server = imds
    serve = handler.__call__
    compute_failures = []

    def failing_compute(req: Request) -> Reply:
        if "/metadata/instance" in req.target and handler.phase != "good1":
            compute_failures.append(req.at)
            return Reply.json({"error": "internal"}, status=500)
        return serve(req)

    server.handler = failing_compute
    # The identity refresh runs inside the poll cycle; it used to retry a failing compute for up to
    # 90 s, with no Scheduled Events poll meanwhile (a Spot eviction gives 30 s of notice).
    agent = start_agent(tmp_path, server, env={"SEFWD_IMDS_COMPUTE_REFRESH": "100ms"})  # every poll cycle
    out = tmp_path / "out.jsonl"
    try:
        wait_until(lambda: scheduled_records(out), 60, "the first good document")
        handler.phase = "bad"  # Scheduled Events still serves good document 1; compute fails
        wait_until(lambda: len(compute_failures) >= 3, 60, "three failed instance metadata reads")
        handler.phase = "good2"
        wait_until(lambda: len(scheduled_records(out)) >= 2, 20,
                   "the next document detected while instance metadata keeps failing")
        assert scheduled_records(out) == [("scheduledevent.scheduled", EVENT), ("scheduledevent.started", EVENT)]
        assert "could not refresh instance metadata" in agent.logs() and "500" in agent.logs()
        assert agent.alive()
    finally:
        assert agent.terminate() == 0, agent.logs()[-3000:]
