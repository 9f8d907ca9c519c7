"""The stdout sink: JSON lines equal to the bodies, the pretty rendering, closed stdout, check()."""
from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from forwarder.sinkapi import Ok, Record, Reject, Retry, SinkContext
from sinks.stdout import StdoutSink, render_pretty
from tests.conftest import ROOT

EVENT_ID = "C7061BAC-AFDC-4513-B24B-AA5F13A16123"
VM = {
    "VmId": "02aab8a4-74ef-476e-8182-f6d2ba4166a6", "Name": "WestNO_0", "ComputerName": "westno0",
    "ResourceId": "/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/WestNO_0",
    "SubscriptionId": "s", "ResourceGroupName": "rg", "Location": "norwaywest", "Zone": "",
    "VmScaleSetName": "",
}


def envelope(rtype: str, data: dict, seq: int = 1, subject: str = EVENT_ID, rid: str | None = None) -> dict:
    return {
        "specversion": "1.0",
        "id": rid or f"6b7c1f0e-0000-5000-8000-{seq:012d}",
        "source": VM["ResourceId"],
        "type": rtype,
        "subject": subject,
        "time": "2026-11-22T06:41:01.123Z",
        "datacontenttype": "application/json",
        "sequence": str(seq).zfill(20),
        "eventkey": f"{subject}:{rtype.rsplit('.', 1)[-1]}",
        "data": data,
    }


def scheduled_event(kind: str = "scheduled", seq: int = 1, **overrides) -> dict:
    data = {
        "EventId": EVENT_ID, "EventType": "Freeze", "ResourceType": "VirtualMachine",
        "Resources": ["WestNO_0", "WestNO_1"], "EventStatus": "Scheduled",
        "NotBefore": "2022-04-11T22:26:58.000Z", "NotBeforeRaw": "Mon, 11 Apr 2022 22:26:58 GMT",
        "Description": "Virtual machine is being paused because of a memory-preserving Live Migration operation.",
        "EventSource": "Platform", "DurationInSeconds": 5, "Change": kind, "PreviousStatus": None,
        "ChangedFields": [], "RemovalReason": None, "Initial": False, "DocumentIncarnation": 2,
        "AffectsThisVm": True, "ApiVersion": "2020-07-01", "Vm": VM, "Extra": {},
    }
    data.update(overrides)
    return envelope(f"scheduledevent.{kind}", data, seq)


def records(n: int) -> list[Record]:
    return [Record.from_dict(scheduled_event(seq=i)) for i in range(1, n + 1)]


def ctx(pretty: bool = False) -> SinkContext:
    return SinkContext(name="out", state_dir=Path("/nonexistent"), pretty=pretty)


# -- JSON lines ----------------------------------------------------------------------------------
def test_lines_are_the_bodies_exactly():
    stream = io.BytesIO()
    batch = records(3)
    assert StdoutSink({}, ctx(), stream=stream).send(batch) == Ok()
    assert stream.getvalue().split(b"\n") == [r.body for r in batch] + [b""]


def test_batch_is_flushed_through_a_buffered_pipe():
    r, w = os.pipe()
    os.set_blocking(r, False)  # unflushed data must fail the test, not hang it
    with open(w, "wb", buffering=1 << 20) as stream, open(r, "rb", buffering=0) as reader:
        batch = records(2)
        assert StdoutSink({}, ctx(), stream=stream).send(batch) == Ok()
        expected = b"".join(rec.body + b"\n" for rec in batch)
        assert reader.read(1 << 16) == expected


def test_writes_to_sys_stdout_resolved_at_send_time(capsysbinary):
    sink = StdoutSink({}, ctx())
    batch = records(2)
    assert sink.send(batch) == Ok()
    assert capsysbinary.readouterr().out == b"".join(rec.body + b"\n" for rec in batch)


def test_empty_batch_is_ok_and_writes_nothing():
    stream = io.BytesIO()
    assert StdoutSink({}, ctx(), stream=stream).send([]) == Ok()
    assert stream.getvalue() == b""


def test_body_with_a_line_break_is_rejected():
    bad = Record(id="x", type="scheduledevent.scheduled", body=b'{"id":"x",\n"type":"t"}')
    stream = io.BytesIO()
    result = StdoutSink({}, ctx(), stream=stream).send([bad])
    assert isinstance(result, Reject) and result.reason == "record_contains_newline"
    assert stream.getvalue() == b""


def test_full_device_is_retried_as_disk_full():
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    with open("/dev/full", "wb", buffering=0) as stream:
        assert StdoutSink({}, ctx(), stream=stream).send(records(1)) == Retry(reason="disk_full")


# -- closed stdout -------------------------------------------------------------------------------
def test_closed_pipe_rejects_and_keeps_rejecting():
    r, w = os.pipe()
    os.close(r)
    with open(w, "wb", buffering=0) as stream:
        sink = StdoutSink({}, ctx(), stream=stream)
        first = sink.send(records(1))
        assert isinstance(first, Reject) and first.reason == "stdout_closed"
        assert isinstance(sink.send(records(1)), Reject)


def test_real_stdout_closed_by_reader_exits_quietly():
    script = textwrap.dedent(
        """
        import sys
        from pathlib import Path
        from forwarder.sinkapi import Record, SinkContext
        from sinks.stdout import StdoutSink
        sink = StdoutSink({}, SinkContext(name="out", state_dir=Path("/nonexistent")))
        sys.stdin.readline()  # the parent closes its read end of our stdout first
        rec = Record.from_dict({"id": "1", "type": "forwarder.heartbeat", "data": {}})
        print(repr(sink.send([rec])), repr(sink.send([rec])), file=sys.stderr)
        sink.close()
        print("later output from elsewhere in the process")  # must not blow up now
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    proc.stdout.close()
    _, err = proc.communicate(b"go\n", timeout=60)
    text = err.decode()
    assert proc.returncode == 0, text
    assert text.count("Reject(reason='stdout_closed'") == 2, text
    assert "Exception ignored" not in text and "Traceback" not in text, text


# -- pretty --------------------------------------------------------------------------------------
def test_pretty_scheduled_with_not_before():
    line = render_pretty(scheduled_event())
    assert line == (
        "2026-11-22T06:41:01Z  scheduledevent.scheduled  Freeze  C7061BAC-AFDC-4513-B24B-AA5F13A16123  Scheduled  "
        "NotBefore 2022-04-11T22:26:58Z  Resources WestNO_0,WestNO_1  Duration 5s  (this VM)"
    )


def test_pretty_started_without_not_before_and_not_this_vm():
    event = scheduled_event(
        "started", EventType="Reboot", EventStatus="Started", NotBefore=None, NotBeforeRaw="",
        DurationInSeconds=-1, AffectsThisVm=False, PreviousStatus="Scheduled",
    )
    line = render_pretty(event)
    assert line == (
        "2026-11-22T06:41:01Z  scheduledevent.started  Reboot  C7061BAC-AFDC-4513-B24B-AA5F13A16123  Started  "
        "Resources WestNO_0,WestNO_1"
    )


def test_pretty_updated_and_canceled_say_what_happened():
    updated = render_pretty(scheduled_event("updated", ChangedFields=["NotBefore", "Resources"]))
    assert "  Changed NotBefore,Resources" in updated
    canceled = render_pretty(scheduled_event("canceled", RemovalReason="disappeared_while_scheduled", Initial=True))
    assert "  Reason disappeared_while_scheduled" in canceled and "(initial)" in canceled


def test_pretty_approval_shows_type_and_key_fields():
    event = envelope(
        "approval.approved",
        {"EventId": EVENT_ID, "Outcome": "approved", "Rule": "freeze-auto", "Actor": "policy",
         "HttpStatus": 200, "Vm": VM, "ApiVersion": "2020-07-01"},
        subject=EVENT_ID,
    )
    line = render_pretty(event)
    assert line == (
        "2026-11-22T06:41:01Z  approval.approved  EventId C7061BAC-AFDC-4513-B24B-AA5F13A16123  Outcome approved  "
        "Rule freeze-auto  Actor policy  HttpStatus 200"
    )
    assert "WestNO_0" not in line  # the Vm object is context, not news


def test_pretty_colour_only_on_a_terminal_and_never_with_no_color(monkeypatch):
    import pty

    from sinks.stdout import colourize, use_colour

    master, slave = pty.openpty()
    try:
        with os.fdopen(slave, "wb", closefd=False) as tty:
            monkeypatch.delenv("NO_COLOR", raising=False)
            monkeypatch.setenv("TERM", "xterm")
            assert use_colour(tty)
            monkeypatch.setenv("NO_COLOR", "1")
            assert not use_colour(tty)
    finally:
        os.close(master)
        os.close(slave)
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert not use_colour(io.BytesIO())  # a pipe or file: plain text for scripts
    assert colourize("x", "scheduledevent.started") == "\x1b[1;31mx\x1b[0m"
    assert colourize("x", "approval.refused").startswith("\x1b[34m")
    assert colourize("x", "custom.type") == "x"


def test_pretty_forwarder_lifecycle():
    started = envelope(
        "forwarder.started",
        {"Version": "0.1.0", "ApiVersion": "2020-07-01", "Vm": VM, "Resumed": False, "Pid": 4242,
         "Sinks": ["stdout", "file"], "PollIntervalSeconds": 1.0},
        subject="forwarder",
    )
    assert render_pretty(started) == (
        "2026-11-22T06:41:01Z  forwarder.started  Version 0.1.0  Resumed false  Pid 4242  "
        "Sinks stdout,file  PollIntervalSeconds 1.0"
    )
    heartbeat = envelope(
        "forwarder.heartbeat",
        {"Version": "0.1.0", "UptimeSeconds": 60.2, "Polls": 60, "ImdsErrors": 0, "LastPollOk": None},
        subject="forwarder",
    )
    assert render_pretty(heartbeat).endswith("UptimeSeconds 60.2  Polls 60  ImdsErrors 0")


@pytest.mark.parametrize(
    "event",
    [{}, {"type": None, "data": None}, {"type": "x.y", "data": [1, 2]}, {"time": 5, "data": {"A": {"b": 1}}},
     {"type": "scheduledevent.scheduled", "data": {"Resources": None, "DurationInSeconds": True}},
     {"type": "approval.refused", "data": {"Reason": "line one\nline two", "EventIds": ["a", "b"]}}],
)
def test_pretty_is_always_one_line_and_never_raises(event):
    line = render_pretty(event)
    assert isinstance(line, str) and "\n" not in line


def test_pretty_option_and_context_flag_both_switch_rendering():
    batch = [Record.from_dict(scheduled_event(seq=1)), Record.from_dict(scheduled_event("started", seq=2))]
    for options, context in (({"pretty": True}, ctx()), ({}, ctx(pretty=True))):
        stream = io.BytesIO()
        assert StdoutSink(options, context, stream=stream).send(batch) == Ok()
        lines = stream.getvalue().decode().splitlines()
        assert lines == [render_pretty(rec.to_dict()) for rec in batch]


def test_pretty_rejects_a_body_that_is_not_json():
    bad = Record(id="x", type="scheduledevent.scheduled", body=b"{not json")
    result = StdoutSink({"pretty": True}, ctx(), stream=io.BytesIO()).send([bad])
    assert isinstance(result, Reject) and result.reason == "invalid_json"


# -- check ---------------------------------------------------------------------------------------
def test_check_accepts_known_options():
    assert StdoutSink.check({}) == []
    assert StdoutSink.check({"pretty": False}) == []


def test_check_reports_every_problem():
    problems = StdoutSink.check({"pretty": "yes", "colour": True})
    assert len(problems) == 2
    assert any("'colour'" in p and "unknown" in p for p in problems)
    assert any("'pretty'" in p for p in problems)


def test_constructor_refuses_bad_options():
    with pytest.raises(ValueError, match="pretty"):
        StdoutSink({"pretty": 1}, ctx())


def test_protocol_surface():
    sink = StdoutSink({}, ctx(), stream=io.BytesIO())
    assert sink.max_batch == 500
    assert set(StdoutSink.OPTIONS) == {"pretty"}
    sink.close()


def test_pretty_hook_action_says_which_hook_when_and_what_it_printed():
    action = {"Id": 3, "Kind": "hook", "State": "planned", "Change": "scheduled", "HookName": "scheduled",
              "Due": "2026-11-22T06:41:05.250Z", "Deadline": "2026-11-22T06:41:09Z", "Attempts": 0}
    planned = render_pretty({"type": "approval.planned", "time": "2026-11-22T06:41:01Z", "data": {
        "EventId": "E1", "Outcome": "planned", "Actor": "hook", "Action": action}})
    assert planned.endswith("Hook scheduled  Due 2026-11-22T06:41:05Z")
    ran = render_pretty({"type": "approval.ran", "time": "2026-11-22T06:41:06Z", "data": {
        "EventId": "E1", "Outcome": "ran", "Actor": "hook", "Action": {**action, "State": "done"},
        "Hook": {"ExitCode": 0, "Output": "\ndraining web-1\nmore\n", "TimedOut": False}}})
    assert ran.endswith("Hook scheduled  ExitCode 0  Output 'draining web-1'") and "Due" not in ran
