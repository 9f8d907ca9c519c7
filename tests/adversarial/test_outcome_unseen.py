"""Cancel only on proof, against the real agent (issue 20, item 2).

IMDS raises ``DocumentIncarnation`` once per document change, and one change may touch several
events. Here IMDS (a scripted server, as real IMDS behaves; the emulator raises the counter once
per operation and cannot batch) shows A and B ``Scheduled`` at 2; at 3, unseen by the agent,
another VM approves A and it starts; at 4 A is gone and B's ``NotBefore`` moved. The agent sees
2 -> 4 with two visible changes: counting them used to explain the jump away and report A
``canceled``, although A ran.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime
from typing import Any

import pytest

from tests.adversarial.hostile import HostileServer, Reply, Request
from tests.agent import AgentProcess, read_jsonl, wait_until, write_config

A = "A0000000-0000-0000-0000-00000000000A"
B = "B0000000-0000-0000-0000-00000000000B"
COMPUTE = {"vmId": "0f4b1f6c-aaaa-4bbb-8ccc-000000000002", "name": "vm-b", "resourceId": "/x/vm-b"}


def event(event_id: str, resource: str, not_before: datetime) -> dict[str, Any]:
    return {"EventId": event_id, "EventType": "Reboot", "ResourceType": "VirtualMachine", "Resources": [resource],
            "EventStatus": "Scheduled", "NotBefore": format_datetime(not_before, usegmt=True), "Description": "",
            "EventSource": "Platform", "DurationInSeconds": -1}


class Imds:
    def __init__(self) -> None:
        soon = datetime.now(timezone.utc).replace(microsecond=0) + timedelta(hours=1)
        self.first = Reply.json({"DocumentIncarnation": 2, "Events": [event(A, "vm-a", soon), event(B, "vm-b", soon)]})
        self.last = Reply.json({"DocumentIncarnation": 4, "Events": [event(B, "vm-b", soon + timedelta(hours=1))]})
        self.step = threading.Event()

    def __call__(self, req: Request) -> Reply:
        if "/metadata/instance" in req.target:
            return Reply.json(COMPUTE)
        return self.last if self.step.is_set() else self.first


@pytest.fixture()
def imds() -> Iterator[tuple[Imds, HostileServer]]:
    handler = Imds()
    with HostileServer(handler) as server:
        yield handler, server


def test_one_step_removing_an_event_and_updating_another_after_a_hidden_start_is_no_cancel(tmp_path, imds) -> None:
    handler, server = imds
    out = tmp_path / "out.jsonl"
    agent = AgentProcess(write_config(tmp_path / "c.toml", server.url, tmp_path / "state"), tmp_path / "a.log")
    try:
        wait_until(lambda: len([r for r in read_jsonl(out) if r["type"] == "scheduledevent.scheduled"]) == 2, 60,
                   "both events seen at incarnation 2")
        handler.step.set()
        terminal = wait_until(lambda: [r for r in read_jsonl(out) if r.get("subject") == A
                                       and r["type"] != "scheduledevent.scheduled"], 60, "A's terminal record")
        updated = [r for r in read_jsonl(out) if r.get("subject") == B and r["type"] == "scheduledevent.updated"]
    finally:
        assert agent.terminate() == 0
    (record,) = terminal
    print(f"A, gone in a step of 2 with 2 visible changes: {record['type']} (UnseenStates "
          f"{record['data']['Evidence']['UnseenStates']})")
    assert len(updated) == 1
    assert record["type"] == "scheduledevent.ended" and record["data"]["Outcome"] == "unknown"
    assert record["data"]["Evidence"]["UnseenStates"] == 1
    assert record["data"]["RemovalReason"] == "gone_before_notbefore"
