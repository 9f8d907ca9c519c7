"""The eventhubs sink with the real azure-eventhub client against an AMQP 1.0 peer (rhea) on 127.0.0.1."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from forwarder.emulator import Emulator
from forwarder.sinkapi import Ok, Record, Reject, Retry, SinkContext
from tests.agent import ROOT, AgentProcess, read_jsonl, wait_until, write_config
from tests.peers.eventhubs_peer import RESOURCE_LIMIT, SERVER_BUSY, EventHubsPeer

_UNAVAILABLE = EventHubsPeer.available()
if _UNAVAILABLE is not None and os.environ.get("SEFWD_REQUIRE_PEERS"):
    raise RuntimeError(f"the Event Hubs test peer is required here (SEFWD_REQUIRE_PEERS) but {_UNAVAILABLE}")
pytestmark = pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"eventhubs peer unavailable: {_UNAVAILABLE}")

eventhubs = pytest.importorskip("sinks.eventhubs")
EventHubsSink = eventhubs.EventHubsSink

SOURCE = "/subscriptions/8d10da13-8125-4ba9-a717-bf7490507b3d/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/vm-0"
STRUCTURED = "application/cloudevents+json; charset=utf-8"


def scheduled(event_id: str, seq: int, *, change: str = "scheduled", pad: int = 0) -> Record:
    return Record.from_dict({
        "specversion": "1.0", "id": str(uuid.uuid4()), "source": SOURCE, "type": f"scheduledevent.{change}",
        "subject": event_id, "time": "2026-11-22T08:00:43.657Z", "datacontenttype": "application/json",
        "sequence": str(seq).zfill(20),
        "data": {"EventId": event_id, "EventType": "Reboot", "EventStatus": "Scheduled", "Change": change,
                 "Description": "x" * pad},
        "eventkey": f"{event_id}:{change}",
    })


def lifecycle(seq: int) -> Record:
    return Record.from_dict({
        "specversion": "1.0", "id": str(uuid.uuid4()), "source": SOURCE, "type": "forwarder.started",
        "subject": "forwarder", "time": "2026-11-22T08:00:42.647Z", "datacontenttype": "application/json",
        "sequence": str(seq).zfill(20), "data": {"Version": "0.1.0", "Resumed": False},
    })


@pytest.fixture
def peer(tmp_path: Path) -> Iterator[EventHubsPeer]:
    with EventHubsPeer(log=tmp_path / "peer.log") as p:
        yield p


def make_sink(tmp_path: Path, peer: EventHubsPeer, monkeypatch: pytest.MonkeyPatch, **options: Any) -> Any:
    monkeypatch.setenv("EH_CONN", peer.connection_string())
    opts = {"connection_string_env": "EH_CONN", "timeout": "2s", **options}
    return EventHubsSink(opts, SinkContext(name="eh", state_dir=tmp_path))


def test_structured_mode_body_content_type_and_partition_key(tmp_path, peer, monkeypatch):
    sink = make_sink(tmp_path, peer, monkeypatch)
    eid = "A1F0E5A7-0001-4C5D-9E8F-000000000001"
    batch = [lifecycle(1), scheduled(eid, 2), scheduled(eid, 3, change="started")]
    try:
        assert sink.send(batch) == Ok()
    finally:
        sink.close()
    got = peer.events()
    assert [e["body"].encode() for e in got] == [r.body for r in batch]
    assert {e["content_type"] for e in got} == {STRUCTURED}
    assert [e["partition_key"] for e in got] == [SOURCE, eid, eid]
    assert [e["message_id"] for e in got] == [r.id for r in batch]
    assert peer.stats()["transfers"] == 2  # one batch per partition key


def test_binary_mode_data_body_and_cloudevents_properties(tmp_path, peer, monkeypatch):
    sink = make_sink(tmp_path, peer, monkeypatch, mode="binary")
    record = scheduled("E-1", 7)
    try:
        assert sink.send([record]) == Ok()
    finally:
        sink.close()
    (got,) = peer.events()
    event = record.to_dict()
    assert orjson.loads(got["body"]) == event["data"]
    assert got["content_type"] == "application/json"
    assert got["application_properties"] == {
        "cloudEvents_specversion": "1.0", "cloudEvents_id": event["id"], "cloudEvents_source": SOURCE,
        "cloudEvents_type": "scheduledevent.scheduled", "cloudEvents_subject": "E-1",
        "cloudEvents_time": event["time"], "cloudEvents_sequence": "00000000000000000007",
        "cloudEvents_eventkey": "E-1:scheduled",
    }
    assert got["partition_key"] == "E-1"


def test_batches_fill_up_to_the_hubs_message_size(tmp_path, monkeypatch):
    with EventHubsPeer(max_message_size=8192, log=tmp_path / "peer.log") as peer:
        sink = make_sink(tmp_path, peer, monkeypatch)
        batch = [scheduled("E-1", i, pad=400) for i in range(60)]
        started = time.monotonic()
        try:
            assert sink.send(batch) == Ok()
        finally:
            sink.close()
        elapsed = time.monotonic() - started
        got = peer.events()
        stats = peer.stats()
    assert [e["message_id"] for e in got] == [r.id for r in batch]  # all, in order
    total = sum(len(r.body) for r in batch)
    assert total // 8192 + 1 <= stats["transfers"] < 20  # few transfers, not one per record
    assert max(stats["transfer_sizes"]) <= 8192
    print(f"60 records ({total} bytes) in {stats['transfers']} transfers, {elapsed * 1000:.0f} ms incl. connect")


def test_a_record_larger_than_the_limit_is_rejected_and_nothing_is_sent(tmp_path, monkeypatch):
    with EventHubsPeer(max_message_size=4096, log=tmp_path / "peer.log") as peer:
        sink = make_sink(tmp_path, peer, monkeypatch)
        big = scheduled("E-2", 2, pad=10_000)
        try:
            result = sink.send([scheduled("E-1", 1), big])
            assert isinstance(result, Reject) and result.reason == "event_too_large"
            assert big.id in result.detail and "4096" in result.detail
            assert peer.events() == []  # the batch is built before anything is sent
            assert sink.send([scheduled("E-1", 1)]) == Ok()  # the producer is still good
        finally:
            sink.close()


def test_one_producer_connection_serves_many_sends(tmp_path, peer, monkeypatch):
    sink = make_sink(tmp_path, peer, monkeypatch)
    timings = []
    try:
        for i in range(5):
            started = time.monotonic()
            assert sink.send([scheduled(f"E-{i}", i)]) == Ok()
            timings.append(time.monotonic() - started)
    finally:
        sink.close()
    stats = peer.stats()
    assert stats["tcp_connections"] == 1 and stats["connections"] == 1
    assert stats["cbs_requests"] == 1
    assert len(peer.events()) == 5
    print(f"first send {timings[0] * 1000:.0f} ms (connect + CBS), then {min(timings[1:]) * 1000:.1f}-"
          f"{max(timings[1:]) * 1000:.1f} ms per send")


def test_peer_down_is_retried_and_the_sink_recovers(tmp_path, peer, monkeypatch):
    sink = make_sink(tmp_path, peer, monkeypatch)
    try:
        assert sink.send([scheduled("E-1", 1)]) == Ok()
        peer.down()
        started = time.monotonic()
        result = sink.send([scheduled("E-1", 2)])
        assert isinstance(result, Retry) and result.reason in ("connection_error", "send_failed")
        assert time.monotonic() - started < 10
        peer.up()
        record = scheduled("E-1", 3)
        assert sink.send([record]) == Ok()
    finally:
        sink.close()
    assert peer.events()[-1]["message_id"] == record.id


def test_server_busy_and_resource_limit_are_retried(tmp_path, peer, monkeypatch):
    sink = make_sink(tmp_path, peer, monkeypatch)
    try:
        peer.faults(reject={"condition": SERVER_BUSY, "description": "The request was terminated because the namespace is being throttled."})
        assert sink.send([scheduled("E-1", 1)]) == Retry(reason="throttled")
        peer.clear_faults()
        # A refused link: the SDK reports the condition only when it reaches the open, else a send failure.
        peer.faults(link_error={"condition": RESOURCE_LIMIT, "description": "too many links"})
        assert isinstance(sink.send([scheduled("E-1", 1)]), Retry)
        peer.clear_faults()
        assert sink.send([scheduled("E-1", 1)]) == Ok()
    finally:
        sink.close()
    assert peer.stats()["rejected"] >= 1 and peer.stats()["link_errors"] >= 1
    assert len(peer.events()) == 1


def test_cbs_401_is_retried_as_auth_failed_with_a_clear_log(tmp_path, peer, monkeypatch, caplog):
    sink = make_sink(tmp_path, peer, monkeypatch)
    peer.faults(cbs_status=401)
    try:
        with caplog.at_level(logging.ERROR, logger="sinks.eventhubs"):
            assert sink.send([scheduled("E-1", 1)]) == Retry(reason="auth_failed")
        assert "Azure Event Hubs Data Sender" in caplog.text
        assert "SAS_KEY_VALUE" not in caplog.text
        peer.clear_faults()
        assert sink.send([scheduled("E-1", 1)]) == Ok()  # the producer was rebuilt
    finally:
        sink.close()
    assert peer.stats()["cbs_failures"] >= 1


def test_slow_peer_times_out_and_a_hung_peer_is_abandoned(tmp_path, peer, monkeypatch):
    sink = make_sink(tmp_path, peer, monkeypatch, timeout="1s")
    try:
        assert sink.send([scheduled("E-1", 1)]) == Ok()
        peer.faults(delay_ms=4000)
        started = time.monotonic()
        assert sink.send([scheduled("E-1", 2)]) == Retry(reason="timeout")
        slow = time.monotonic() - started
        peer.clear_faults()
        # A peer that accepts TCP and never answers: the SDK's SASL handshake has no timeout.
        peer.faults(silent=True)
        sink.stall_limit = 1.5
        started = time.monotonic()
        assert sink.send([scheduled("E-1", 3)]) == Retry(reason="timeout")
        hung = time.monotonic() - started
        assert sink.send([scheduled("E-1", 3)]) == Retry(reason="peer_not_answering")  # no second stuck thread
        peer.clear_faults()
        peer.down()  # drops the hung socket, so the stuck attempt ends
        peer.up()
        record = scheduled("E-1", 4)
        assert wait_until(lambda: sink.send([record]) == Ok(), 15, "a send after the peer recovered")
    finally:
        sink.close()
    assert slow < 8 and hung < 4
    assert peer.events()[-1]["message_id"] == record.id


def test_managed_identity_token_from_the_imds_emulator(tmp_path, peer, monkeypatch):
    # The fully_qualified_namespace form always uses TLS on the real service; the test injects
    # use_tls=False (client_options, a constructor seam, not a config option) to reach the plain peer.
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        monkeypatch.setenv("AZURE_POD_IDENTITY_AUTHORITY_HOST", emu.url)
        sink = EventHubsSink(
            {"fully_qualified_namespace": f"127.0.0.1:{peer.port}", "eventhub": peer.hub,
             "credential": "managed_identity", "timeout": "5s"},
            SinkContext(name="eh", state_dir=tmp_path), client_options={"use_tls": False},
        )
        try:
            assert sink.send([scheduled("E-1", 1)]) == Ok()
        finally:
            sink.close()
        assert emu.stats()["token_requests"] >= 1
    (token,) = peer.stats()["cbs_tokens"]
    assert token["type"] == "jwt" and token["token"].startswith("emulator-token.myVM.")
    assert token["name"].endswith(f"/{peer.hub}")
    assert len(peer.events()) == 1


def test_management_read_answers_hub_and_partition_properties(peer):
    from azure.eventhub import EventHubProducerClient

    client = EventHubProducerClient.from_connection_string(peer.connection_string(), retry_total=0)
    try:
        props = client.get_eventhub_properties()
        part = client.get_partition_properties("1")
    finally:
        client.close()
    assert props["eventhub_name"] == peer.hub and props["partition_ids"] == ["0", "1", "2", "3"]
    assert part["id"] == "1" and part["is_empty"] is True


# -- options ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("options", "expected"), [
    ({}, "set connection_string_env or connection_string_file"),
    ({"connection_string_env": "EH_CONN", "fully_qualified_namespace": "x.servicebus.windows.net",
      "credential": "managed_identity", "eventhub": "h"}, "not both"),
    ({"fully_qualified_namespace": "x.servicebus.windows.net", "credential": "managed_identity"},
     "option 'eventhub' is required"),
    ({"fully_qualified_namespace": "x.servicebus.windows.net", "eventhub": "h"}, "option 'credential' is required"),
    ({"fully_qualified_namespace": "sb://x.servicebus.windows.net/", "eventhub": "h",
      "credential": "managed_identity"}, "bare host name"),
    ({"fully_qualified_namespace": "x.servicebus.windows.net", "eventhub": "h", "credential": "password"},
     "credential must be one of managed_identity"),
    ({"connection_string": "Endpoint=sb://x/;SharedAccessKeyName=a;SharedAccessKey=b"}, "not allowed inline"),
    ({"connection_string_env": "EH_CONN", "mode": "json"}, "option 'mode' must be one of structured, binary"),
    ({"connection_string_env": "EH_CONN", "max_batch": 0}, "option 'max_batch' must be an integer"),
    ({"connection_string_env": "EH_CONN", "timeout": "soon"}, "option 'timeout'"),
    ({"connection_string_env": "EH_CONN", "batch_size": 5}, "unknown option 'batch_size'"),
    ({"connection_string_env": "EH_UNSET_VARIABLE"}, "EH_UNSET_VARIABLE"),
    ({"connection_string_env": "EH_NO_ENTITY"}, "has no EntityPath"),
    ({"connection_string_env": "EH_CONN", "eventhub": "other"}, "differs from the connection string's EntityPath"),
    ({"connection_string_env": "EH_BAD"}, "the connection string is not valid"),
])
def test_check_reports_each_problem(options, expected, monkeypatch):
    monkeypatch.setenv("EH_CONN", "Endpoint=sb://x.servicebus.windows.net/;SharedAccessKeyName=a;"
                                  "SharedAccessKey=topsecret;EntityPath=hub1")
    monkeypatch.setenv("EH_NO_ENTITY", "Endpoint=sb://x.servicebus.windows.net/;SharedAccessKeyName=a;SharedAccessKey=topsecret")
    monkeypatch.setenv("EH_BAD", "Endpoint=sb://x.servicebus.windows.net/;SharedAccessKeyName=a")
    monkeypatch.delenv("EH_UNSET_VARIABLE", raising=False)
    problems = EventHubsSink.check(options)
    assert any(expected in p for p in problems), problems
    assert not any("topsecret" in p for p in problems)
    with pytest.raises(ValueError):
        EventHubsSink(options, SinkContext(name="eh", state_dir=Path("/nonexistent")))


def test_check_accepts_both_valid_forms(monkeypatch, tmp_path):
    conn = tmp_path / "conn"
    conn.write_text("Endpoint=sb://x.servicebus.windows.net/;SharedAccessKeyName=a;SharedAccessKey=k\n")
    assert EventHubsSink.check({"connection_string_file": str(conn), "eventhub": "h", "mode": "binary",
                                "max_batch": 100, "timeout": "5s"}) == []
    assert EventHubsSink.check({"fully_qualified_namespace": "x.servicebus.windows.net", "eventhub": "h",
                                "credential": "managed_identity", "client_id": "11111111-2222-3333-4444-555555555555"}) == []


def test_partition_key_rules():
    assert eventhubs.partition_key({"source": SOURCE, "data": {"EventId": "E-9"}}) == "E-9"
    assert eventhubs.partition_key({"source": SOURCE, "subject": "approval", "data": {"EventId": None}}) == SOURCE
    long_source = "/subscriptions/x/" + "r" * 200
    key = eventhubs.partition_key({"source": long_source, "data": {}})
    assert len(key) <= 128 and key == eventhubs.partition_key({"source": long_source})


def test_missing_sdk_is_a_config_error_naming_the_extra(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text('[[sinks]]\ntype = "eventhubs"\nconnection_string_env = "EH_CONN"\n')
    code = (
        "import sys; sys.modules['azure.eventhub'] = None\n"
        "from forwarder.config import load_config\n"
        "from forwarder.errors import ConfigError\n"
        f"try:\n    load_config({str(config)!r})\n"
        "except ConfigError as exc:\n    print('\\n'.join(exc.problems))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(ROOT), check=False,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert "pip install 'scheduled-events-forwarder[eventhubs]'" in out.stdout, out.stdout + out.stderr


# -- the real agent -----------------------------------------------------------------------------

def test_agent_keeps_records_while_the_hub_is_down_and_delivers_each_once_in_order(tmp_path):
    state = tmp_path / "state"
    with Emulator(vms=["myVM"], rate_limit=None) as emu, EventHubsPeer(down=True, log=tmp_path / "peer.log") as peer:
        sinks = (
            f'[[sinks]]\ntype = "file"\nname = "file"\npath = "{tmp_path / "out.jsonl"}"\n'
            f'[[sinks]]\ntype = "eventhubs"\nname = "hub"\nconnection_string_env = "EH_CONN"\ntimeout = "2s"\n'
        )
        config = write_config(tmp_path / "config.toml", emu.url, state, sinks=sinks)
        agent = AgentProcess(config, tmp_path / "agent.log", env={"EH_CONN": peer.connection_string()})
        try:
            ids = [emu.schedule(type="Reboot", start_after=600) for _ in range(3)]
            wait_until(lambda: sum(1 for r in read_jsonl(tmp_path / "out.jsonl")
                                   if r["type"] == "scheduledevent.scheduled") >= 3, 30, "three scheduled records")
            emu.start_event(ids[0])
            wait_until(lambda: any(r["type"] == "scheduledevent.started" for r in read_jsonl(tmp_path / "out.jsonl")),
                       30, "a started record")
            wait_until(lambda: "connection_error" in agent.logs() or "send_failed" in agent.logs(), 30,
                       "the eventhubs sink retrying while the hub is down")
            assert peer.events() == []
            peer.up()
            wait_until(lambda: {e["message_id"] for e in peer.events()}
                       >= {r["id"] for r in read_jsonl(tmp_path / "out.jsonl")}, 30, "every record at the hub")
            assert agent.terminate() == 0  # drains forwarder.stopped to both sinks
        finally:
            if agent.alive():
                agent.kill()
        delivered = read_jsonl(tmp_path / "out.jsonl")  # includes forwarder.stopped
        got = peer.events()
    ids_got = [e["message_id"] for e in got]
    assert len(ids_got) == len(set(ids_got))  # once each
    assert sorted(ids_got) == sorted(r["id"] for r in delivered)
    by_id = {r["id"]: r for r in delivered}
    for e in got:
        assert orjson.loads(e["body"]) == by_id[e["message_id"]]
        assert e["partition_key"] == eventhubs.partition_key(by_id[e["message_id"]])
    for key in {e["partition_key"] for e in got}:  # in order per partition key
        assert [e["message_id"] for e in got if e["partition_key"] == key] == \
            [r["id"] for r in delivered if eventhubs.partition_key(r) == key]
    # Lifecycle records are keyed by the VM (its source, hashed when over 128 characters as here).
    assert {e["partition_key"] for e in got} == set(ids) | {eventhubs.partition_key(delivered[0])}
