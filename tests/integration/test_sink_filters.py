"""Per-sink filters through the shared sink contract: every sink type, against its real local peer, is sent
exactly the records its filter lets through, in order; held-back records advance its cursor (also across a
restart) and are counted by reason in the dispatcher's figures, ``sefwd status`` and the metrics."""
from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from forwarder.common.retry import Backoff
from forwarder.delivery.dispatcher import Dispatcher
from forwarder.delivery.filters import parse_filter
from forwarder.emulator import Emulator
from forwarder.sinkapi import Record, SinkContext, load_sink_factory
from forwarder.store.database import Store
from tests.agent import AgentProcess, wait_until, write_config
from tests.integration.test_cli import sefwd

pytestmark = pytest.mark.timeout(120)

FAST = Backoff(initial=0.01, maximum=0.05)
VM = {"VmId": "265801e3-a918-5509-ad1a-0e6728a3b28b", "Name": "vm-0", "ComputerName": "vm-0",
      "ResourceId": "/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/vm-0",
      "SubscriptionId": "s", "ResourceGroupName": "rg", "Location": "norwayeast", "Zone": "", "VmScaleSetName": ""}


def _record(tag: str, seq: int, rtype: str, data: dict[str, Any]) -> Record:
    return Record.from_dict({
        "specversion": "1.0", "id": f"{tag}-{seq}", "source": VM["ResourceId"], "type": rtype,
        "subject": str(data.get("EventId") or "forwarder"), "time": f"2026-11-22T07:58:{seq:02d}.000Z",
        "datacontenttype": "application/json", "sequence": str(seq).zfill(20), "data": {**data, "Vm": VM},
    })


def event(tag: str, seq: int, change: str, event_type: str, affects: bool | None) -> Record:
    event_id = f"EV-{tag}-{seq}"
    record = _record(tag, seq, f"scheduledevent.{change}", {
        "EventId": event_id, "EventType": event_type, "ResourceType": "VirtualMachine", "Resources": ["vm-0"],
        "EventStatus": "Started" if change == "started" else "Scheduled", "NotBefore": "2026-11-22T08:13:31.000Z",
        "NotBeforeRaw": "Sun, 22 Nov 2026 08:13:31 GMT", "Description": "Virtual machine is going to be restarted.",
        "EventSource": "Platform", "DurationInSeconds": -1, "Change": change, "PreviousStatus": None,
        "ChangedFields": [], "RemovalReason": None, "Initial": False, "DocumentIncarnation": seq,
        "AffectsThisVm": affects, "ApiVersion": "2020-07-01", "Extra": {},
    })
    body = record.to_dict()
    body["eventkey"] = f"{event_id}:{change}"
    return Record.from_dict(body)


def mixed(tag: str) -> list[Record]:
    """One of each kind of record a filter can tell apart."""
    return [
        event(tag, 1, "scheduled", "Reboot", True),
        event(tag, 2, "started", "Freeze", False),
        event(tag, 3, "completed", "Reboot", True),
        _record(tag, 4, "approval.approved", {"EventId": f"EV-{tag}-1", "Outcome": "approved", "Actor": "policy",
                                              "Reason": "approved", "ApiVersion": "2020-07-01"}),
        _record(tag, 5, "forwarder.heartbeat", {"Version": "0.1.0", "ApiVersion": "2020-07-01", "Polls": 40}),
        event(tag, 6, "scheduled", "Preempt", None),  # this VM does not know its name: kept by affects_this_vm
    ]


# filter kind -> (the filter table, sequence numbers sent, held back by reason)
FILTERS: dict[str, tuple[dict[str, Any], list[int], dict[str, int]]] = {
    "record_types": ({"record_types": ["scheduledevent"]}, [1, 2, 3, 6], {"record_type": 2}),
    "changes": ({"changes": ["scheduled"]}, [1, 4, 5, 6], {"change": 2}),
    "event_types": ({"event_types": ["Reboot"]}, [1, 3, 4, 5], {"event_type": 2}),
    "affects_this_vm": ({"affects_this_vm": True}, [1, 3, 4, 5, 6], {"affects_this_vm": 1}),
}

Received = Callable[[], list[str]]


# -- one harness per sink type: options for the real sink, and what its real peer received ----------------

@contextlib.contextmanager
def stdout_sink(tmp_path: Path, mp: pytest.MonkeyPatch) -> Iterator[tuple[dict[str, Any], Received]]:
    out = tmp_path / "stdout.jsonl"
    with open(out, "w", encoding="utf-8") as stream:
        # The sink writes to whatever sys.stdout is at send time (as the CLI swaps it): here a real file.
        mp.setattr("sys.stdout", stream)
        yield {}, lambda: [orjson.loads(line)["id"] for line in out.read_bytes().splitlines() if line.strip()]


@contextlib.contextmanager
def file_sink(tmp_path: Path, mp: pytest.MonkeyPatch) -> Iterator[tuple[dict[str, Any], Received]]:
    out = tmp_path / "records.jsonl"
    yield {"path": str(out)}, lambda: [orjson.loads(line)["id"] for line in out.read_bytes().splitlines()] if out.exists() else []


@contextlib.contextmanager
def webhook_sink(tmp_path: Path, mp: pytest.MonkeyPatch) -> Iterator[tuple[dict[str, Any], Received]]:
    from tests.peers.http_peer import HttpPeer

    with HttpPeer() as peer:
        yield {"url": peer.url}, lambda: [r.json()["id"] for r in peer.requests]


@contextlib.contextmanager
def notify_sink(tmp_path: Path, mp: pytest.MonkeyPatch) -> Iterator[tuple[dict[str, Any], Received]]:
    from tests.peers.http_peer import HttpPeer

    with HttpPeer() as peer:
        url = f"json://{peer.url.split('://', 1)[1].rstrip('/')}/chat"
        yield ({"urls": [url], "templates": {"default": {"body": "{{ record.id }}"}}},
               lambda: [r.json()["message"] for r in peer.requests])


@contextlib.contextmanager
def eventhubs_sink(tmp_path: Path, mp: pytest.MonkeyPatch) -> Iterator[tuple[dict[str, Any], Received]]:
    from benchmarks.peers.eventhubs_peer import EventHubsPeer

    if (why := EventHubsPeer.available()) is not None:
        if os.environ.get("SEFWD_REQUIRE_PEERS"):  # CI: a missing peer is a failure, not a skip
            raise RuntimeError(f"the Event Hubs test peer is required here (SEFWD_REQUIRE_PEERS) but {why}")
        pytest.skip(f"Event Hubs peer unavailable: {why}")
    with EventHubsPeer(log=tmp_path / "peer.log") as peer:
        mp.setenv("SEFWD_TEST_EH_CONN", peer.connection_string())
        yield {"connection_string_env": "SEFWD_TEST_EH_CONN", "timeout": "5s"}, lambda: [e["message_id"] for e in peer.events()]


@contextlib.contextmanager
def loganalytics_sink(tmp_path: Path, mp: pytest.MonkeyPatch) -> Iterator[tuple[dict[str, Any], Received]]:
    from benchmarks.peers.logs_ingestion import LogsIngestionPeer, emulator_tokens

    with Emulator(vms=["vm-0"]) as emu, LogsIngestionPeer(token_validator=emulator_tokens(emu)) as peer:
        mp.setenv("AZURE_POD_IDENTITY_AUTHORITY_HOST", emu.url)  # the managed identity asks the emulator
        yield ({"endpoint": peer.url, "rule_id": peer.rule_id, "ca_file": peer.ca_file, "timeout": "5s"},
               lambda: [row["RecordId"] for row in peer.rows])


@contextlib.contextmanager
def appinsights_sink(tmp_path: Path, mp: pytest.MonkeyPatch) -> Iterator[tuple[dict[str, Any], Received]]:
    from benchmarks.peers.appinsights_peer import AppInsightsPeer
    from tests.integration.test_sink_appinsights import QUIET_SDK_ENV

    for name, value in QUIET_SDK_ENV.items():
        mp.setenv(name, value)
    with AppInsightsPeer(tmp_path) as peer:
        mp.setenv("SEFWD_TEST_AI_CONN", peer.connection_string)
        yield ({"connection_string_env": "SEFWD_TEST_AI_CONN", "ca_file": str(peer.ca_file), "timeout": "5s"},
               peer.event_ids)


@contextlib.contextmanager
def eventgrid_sink(tmp_path: Path, mp: pytest.MonkeyPatch) -> Iterator[tuple[dict[str, Any], Received]]:
    from benchmarks.peers.eventgrid_peer import KEY, EventGridPeer

    with EventGridPeer() as peer:
        mp.setenv("SEFWD_TEST_EG_KEY", KEY)
        yield ({"endpoint": peer.topic_endpoint, "key_env": "SEFWD_TEST_EG_KEY", "ca_file": peer.ca_file,
                "timeout": "5s"}, peer.event_ids)


HARNESSES = {
    "stdout": stdout_sink, "file": file_sink, "webhook": webhook_sink, "notify": notify_sink,
    "eventhubs": eventhubs_sink, "loganalytics": loganalytics_sink, "appinsights": appinsights_sink,
    "eventgrid": eventgrid_sink,
}


def test_every_built_in_sink_type_has_a_contract_harness():
    from forwarder.sinkapi import BUILTIN_SINKS

    assert set(HARNESSES) == set(BUILTIN_SINKS)


def in_order(sink_type: str, ids: list[str]) -> list[str]:
    """Event Hubs orders per partition (the EventId), not across them: compare its ids sorted."""
    return sorted(ids) if sink_type == "eventhubs" else ids


def deliver(tmp_path: Path, sink_type: str, options: dict[str, Any], table: dict[str, Any] | None,
            records: list[Record]) -> dict[str, Any]:
    """Build the real sink, commit ``records``, run a dispatcher until the cursor passes them; its figures."""
    record_filter, problems = parse_filter(table, "test") if table is not None else (None, [])
    assert problems == []
    sink = load_sink_factory(sink_type)(options, SinkContext(name="s", state_dir=tmp_path / "state" / "sinks" / "s"))
    store = Store.open(tmp_path / "state", fsync=False)
    dispatcher = Dispatcher(store, {"s": sink}, backoff=FAST, filters={"s": record_filter})
    try:
        store.commit(records)
        dispatcher.start()
        wait_until(lambda: dispatcher.workers["s"].cursor >= store.next_index, 60, f"{sink_type}: the cursor past the records")
        figures = dispatcher.snapshot()["sinks"]["s"]
    finally:
        dispatcher.close(5)
        store.close()
    assert isinstance(figures, dict)
    return figures


@pytest.mark.parametrize("kind", sorted(FILTERS))
@pytest.mark.parametrize("sink_type", sorted(HARNESSES))
def test_each_filter_kind_on_every_sink_type(sink_type, kind, tmp_path, monkeypatch):
    table, sent, held = FILTERS[kind]
    tag = uuid.uuid4().hex[:8]
    with HARNESSES[sink_type](tmp_path, monkeypatch) as (options, received):
        figures = deliver(tmp_path, sink_type, options, table, mixed(tag))
        expected = [f"{tag}-{n}" for n in sent]
        wait_until(lambda: len(received()) >= len(expected), 30, f"{sink_type}: what the filter let through")
        assert in_order(sink_type, received()) == expected
        assert figures["filtered"] == sum(held.values()) and figures["filtered_by_reason"] == held
        assert figures["delivered"] == len(expected) and figures["dead_lettered"] == 0

        # Restart on the same store: neither the held-back records nor the sent ones come again.
        later = event(tag, 7, "scheduled", "Reboot", True)
        after = deliver(tmp_path, sink_type, options, table, [later])
        wait_until(lambda: len(received()) > len(expected), 30, f"{sink_type}: the record committed after the restart")
        assert in_order(sink_type, received()) == in_order(sink_type, [*expected, later.id])
        assert after["filtered"] == 0 and after["delivered"] == 1


@pytest.mark.parametrize("sink_type", ["file", "webhook"])
def test_without_a_filter_every_record_is_sent(sink_type, tmp_path, monkeypatch):
    tag = uuid.uuid4().hex[:8]
    with HARNESSES[sink_type](tmp_path, monkeypatch) as (options, received):
        figures = deliver(tmp_path, sink_type, options, None, mixed(tag))
        wait_until(lambda: len(received()) >= 6, 30, "every record")
        assert received() == [f"{tag}-{n}" for n in range(1, 7)] and figures["filtered"] == 0


def test_keys_combine_and_a_batch_all_held_back_still_moves_the_cursor(tmp_path, monkeypatch):
    tag = uuid.uuid4().hex[:8]
    table = {"record_types": ["scheduledevent", "approval.approved"], "changes": ["scheduled", "completed"],
             "event_types": ["Reboot"], "affects_this_vm": True}
    with file_sink(tmp_path, monkeypatch) as (options, received):
        figures = deliver(tmp_path, "file", options, table, mixed(tag))
        assert received() == [f"{tag}-1", f"{tag}-3", f"{tag}-4"]
        assert figures["filtered_by_reason"] == {"change": 1, "record_type": 1, "event_type": 1}
        only_held = deliver(tmp_path, "file", options, table, [event(tag, 8, "started", "Freeze", False)] * 1)
        assert only_held["filtered"] == 1 and received() == [f"{tag}-1", f"{tag}-3", f"{tag}-4"]


def test_agent_status_and_metrics_count_what_a_filter_held_back(tmp_path):
    from tests.integration.test_telemetry import endpoint, scrape  # the telemetry tests' own scraper

    with Emulator(vms=["vm-0"], rate_limit=None) as emu:
        sinks = (f'[[sinks]]\ntype = "file"\nname = "all"\npath = "{tmp_path / "all.jsonl"}"\n'
                 f'[[sinks]]\ntype = "file"\nname = "reboots"\npath = "{tmp_path / "reboots.jsonl"}"\n'
                 'filter = { record_types = ["scheduledevent"], event_types = ["Reboot"] }\n')
        config = write_config(tmp_path / "c.toml", emu.url, tmp_path / "state", sinks=sinks,
                              extra='[telemetry]\nlisten = "127.0.0.1:0"\n')
        # The status report within 100 ms of a change, not 5 s: the test reads its counts.
        agent = AgentProcess(config, tmp_path / "a.log", env={"SEFWD_AGENT_STATUS_INTERVAL": "100ms"})
        try:
            freeze = emu.schedule(type="Freeze", resources=["vm-0"], start_after=600)
            reboot = emu.schedule(type="Reboot", resources=["vm-0"], start_after=600)

            def counted() -> dict[str, Any] | None:
                done = sefwd("status", "--config", str(config), "--json")
                sinks = (orjson.loads(done.stdout).get("agent") or {}).get("sinks") or {} if done.stdout else {}
                reboots = sinks.get("reboots") or {}
                return reboots if reboots.get("filtered_by_reason", {}).get("event_type") == 1 else None

            figures = wait_until(counted, 60, "the held-back Freeze in sefwd status")
            assert figures["filtered_by_reason"]["record_type"] >= 1  # forwarder.started
            human = sefwd("status", "--config", str(config)).stdout
            assert "filtered" in human and "event_type 1" in human
            metrics = wait_until(lambda: (m := scrape(endpoint(agent))).get(
                'sefwd_sink_filtered_total{reason="event_type",sink="reboots"}') == 1 and m, 30, "the metric")
            assert metrics['sefwd_sink_filtered_total{reason="record_type",sink="reboots"}'] >= 1
            assert not any(k.startswith("sefwd_sink_filtered_total") and 'sink="all"' in k for k in metrics)
            assert agent.terminate() == 0
        finally:
            if agent.alive():
                agent.kill()
    reboots = [orjson.loads(line) for line in (tmp_path / "reboots.jsonl").read_bytes().splitlines()]
    assert [r["subject"] for r in reboots] == [reboot]
    everything = [orjson.loads(line) for line in (tmp_path / "all.jsonl").read_bytes().splitlines()]
    assert {freeze, reboot} <= {r["subject"] for r in everything}
