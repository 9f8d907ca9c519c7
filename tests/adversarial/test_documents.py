"""Hostile IMDS documents against the real agent, served by the minimal hostile server.

Refused documents (Events null or not a list, an EventId with control characters, ...) must leave
the state as it was: good document 1, the bad one, good document 2 give exactly the records of the
two good ones. Documents with out-of-range values (64-bit overflow, NotBefore at the edge of time,
fields nested hundreds of levels deep) are accepted with the values bounded: the agent records the
change and goes on; before the fix these crash-looped the agent at serialization.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.adversarial.hostile import HostileServer, Reply
from tests.adversarial.test_transport import (  # noqa: F401 - the imds fixture
    EVENT, Imds, document, imds, read_jsonl, run_through, scheduled_records, start_agent, wait_until,
)
from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(180)


def raw_reply(body: bytes) -> Reply:
    return Reply(body=body, headers={"Content-Type": "application/json"})


def with_event(**fields: Any) -> dict[str, Any]:
    doc = document(1, "Scheduled")
    doc["Events"][0].update(fields)
    return doc


REFUSED = {
    "events_null": b'{"DocumentIncarnation": 2, "Events": null}',
    "events_object": b'{"DocumentIncarnation": 2, "Events": {"EventId": "x"}}',
    "event_id_crlf": b'{"DocumentIncarnation": 2, "Events": [{"EventId": "A\\r\\nX-Injected: 1"}]}',
    "lone_surrogate": b'{"DocumentIncarnation": 2, "Events": [{"EventId": "\\ud800"}]}',
    "nested_beyond_json": b'{"DocumentIncarnation": 2, "Events": [{"EventId": "E", "X": ' + b"[" * 5000 + b"]" * 5000 + b"}]}",
    "incarnation_huge_text": b'{"DocumentIncarnation": "' + b"9" * 5000 + b'", "Events": []}',
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_document_changes_nothing(tmp_path: Path, imds: tuple[Imds, HostileServer], name: str) -> None:
    handler, server = imds
    run_through(tmp_path, handler, server, raw_reply(REFUSED[name]),
                log_says=("skipping a bad IMDS document",), min_bad=2)


BIG = b"123456789012345678901234567890"
# name: (fragment of the hostile event, the field that keeps it, what the log must say, DocumentIncarnation)
BOUNDED = {
    "duration_overflow": (b'"DurationInSeconds": ' + BIG, "DurationInSecondsRaw",
                          "DurationInSeconds 1.2345678901234568e+29 is beyond what IMDS sends", b"2"),
    "duration_u64": (b'"DurationInSeconds": 18446744073709551615', "DurationInSecondsRaw",
                     "DurationInSeconds 18446744073709551615 is beyond what IMDS sends", b"2"),
    "not_before_year_1": (b'"NotBefore": "0001-01-01T00:00:00+01:00"', "NotBeforeRaw",
                          "NotBefore '0001-01-01T00:00:00+01:00' leaves the representable date range", b"2"),
    "not_before_year_9999": (b'"NotBefore": "9999-12-31T23:59:59-01:00"', "NotBeforeRaw",
                             "NotBefore '9999-12-31T23:59:59-01:00' leaves the representable date range", b"2"),
    "nested_unknown_field": (b'"Future": ' + b"[" * 300 + b"]" * 300, "Future",
                             "unknown field(s) Future kept truncated", b"2"),
    # Wider than 64 bits: orjson refused it at serialization (records and every later heartbeat).
    "incarnation_u64_plus_1": (b'"Description": "wide incarnation"', "DocumentIncarnation",
                               "DocumentIncarnation 1.8446744073709552e+19 is wider than 64 bits", b"18446744073709551617"),
}


def heartbeats(out: Path) -> list[dict[str, Any]]:
    return [r for r in read_jsonl(out) if r["type"] == "forwarder.heartbeat"]


@pytest.mark.parametrize("name", sorted(BOUNDED))
def test_out_of_range_values_are_bounded_and_the_watch_goes_on(tmp_path: Path, imds: tuple[Imds, HostileServer],
                                                                name: str) -> None:
    handler, server = imds
    fragment, field, says, incarnation = BOUNDED[name]
    body = (b'{"DocumentIncarnation": %s, "Events": [{"EventId": "%s", "EventType": "Reboot", "ResourceType": '
            b'"VirtualMachine", "Resources": ["hostile-vm"], "EventStatus": "Scheduled", '
            b'"NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT", %s}]}') % (incarnation, EVENT.encode(), fragment)
    if fragment.startswith(b'"NotBefore"'):
        body = body.replace(b'"NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT", ', b"")
    out = tmp_path / "out.jsonl"
    agent = start_agent(tmp_path, server, env={"SEFWD_AGENT_HEARTBEAT": "1s"})
    try:
        wait_until(lambda: scheduled_records(out), 60, "the record of the first good document")
        handler.bad, handler.phase = raw_reply(body), "bad"
        updated = wait_until(lambda: [r for r in read_jsonl(out) if r["type"] == "scheduledevent.updated"], 60,
                             "the bounded change recorded")
        data = updated[0]["data"]
        assert field in data or field in data["Extra"], data
        # Heartbeats carry the incarnation and keep coming: the serialization that used to fail goes on.
        beats = len(heartbeats(out))
        wait_until(lambda: len(heartbeats(out)) > beats + 1, 60, "heartbeats after the hostile document")
        assert heartbeats(out)[-1]["data"]["DocumentIncarnation"] == data["DocumentIncarnation"]
        # The log says what was wrong, once, not at every poll of the same document.
        wait_until(lambda: says in agent.logs(), 30, f"the log to say {says!r}")
        assert handler.bad_count >= 3 and agent.logs().count(says) == 1, agent.logs()[-3000:]
        handler.phase = "good2"
        wait_until(lambda: ("scheduledevent.started", EVENT) in scheduled_records(out), 60, "the next good document")
        assert agent.alive(), agent.logs()[-3000:]
        kinds = [k for k, _ in scheduled_records(out)]
        assert kinds[0] == "scheduledevent.scheduled" and kinds[-1] == "scheduledevent.started"
        assert "canceled" not in " ".join(kinds) and "Traceback" not in agent.logs()
        if name.startswith("incarnation"):
            assert data["DocumentIncarnation"] == "1.8446744073709552e+19"  # kept as an opaque text
            wait_until(lambda: heartbeats(out)[-1]["data"]["DocumentIncarnation"] == 2, 30,
                       "heartbeats with the next good document's incarnation")
    finally:
        assert agent.terminate() == 0, agent.logs()[-3000:]


def test_once_exits_with_its_bad_document_code(tmp_path: Path) -> None:
    with HostileServer(lambda req: raw_reply(REFUSED["events_null"])) as server:
        config = tmp_path / "sefwd.toml"
        config.write_text(f'[imds]\nendpoint = "{server.url}"\n[state]\ndir = "{tmp_path / "state"}"\n')
        proc = subprocess.run([sys.executable, "-m", "forwarder", "once", "--config", str(config)], cwd=ROOT,
                              capture_output=True, timeout=120)
    err = proc.stderr.decode()
    assert proc.returncode == 3, err
    assert "bad document" in err and "got null" in err and "Traceback" not in err
