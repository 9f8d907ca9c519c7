"""The ``loganalytics`` sink with the real azure-monitor-ingestion and azure-identity clients against a
local HTTPS Logs Ingestion peer, with managed-identity tokens from the IMDS emulator."""
from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from forwarder.emulator import Emulator
from forwarder.sinkapi import Ok, Record, Reject, Retry, SinkContext
from sinks.la_schema import to_row
from sinks.loganalytics import LogAnalyticsSink
from collections import Counter

from tests.agent import AgentProcess, dead_letters, read_jsonl, wait_until, write_config
from benchmarks.peers.logs_ingestion import PASS, LogsIngestionPeer, Reply, emulator_tokens, error_body

pytestmark = pytest.mark.timeout(60)

VM = {
    "VmId": "265801e3-a918-5509-ad1a-0e6728a3b28b", "Name": "vm-0", "ComputerName": "vm-0",
    "ResourceId": "/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/vm-0",
    "SubscriptionId": "s", "ResourceGroupName": "rg", "Location": "norwayeast", "Zone": "", "VmScaleSetName": "",
}


def _envelope(seq: int, rtype: str, subject: str, data: dict[str, Any]) -> dict[str, Any]:
    return {
        "specversion": "1.0", "id": str(uuid.uuid4()), "source": VM["ResourceId"], "type": rtype,
        "subject": subject, "time": f"2026-11-22T07:58:{seq % 60:02d}.000Z", "datacontenttype": "application/json",
        "sequence": str(seq).zfill(20), "data": data,
    }


def scheduled(seq: int, description: str = "Virtual machine is going to be restarted.") -> Record:
    event_id = f"EV-{seq:06d}"
    event = _envelope(seq, "scheduledevent.scheduled", event_id, {
        "EventId": event_id, "EventType": "Reboot", "ResourceType": "VirtualMachine", "Resources": ["vm-0", "vm-1"],
        "EventStatus": "Scheduled", "NotBefore": "2026-11-22T08:13:31.000Z", "NotBeforeRaw": "Sun, 22 Nov 2026 08:13:31 GMT",
        "Description": description, "EventSource": "User", "DurationInSeconds": -1, "Change": "scheduled",
        "PreviousStatus": None, "ChangedFields": [], "RemovalReason": None, "Initial": False, "DocumentIncarnation": seq,
        "AffectsThisVm": True, "ApiVersion": "2020-07-01", "Vm": VM, "Extra": {"Custom": "x"},
    })
    event["eventkey"] = f"{event_id}:scheduled"
    return Record.from_dict(event)


def approval(seq: int) -> Record:
    return Record.from_dict(_envelope(seq, "approval.approved", "EV-000001", {
        "EventId": "EV-000001", "EventIds": ["EV-000001"], "Outcome": "approved", "Actor": "policy", "Approver": None,
        "Rule": "short-freeze", "Reason": "approved", "Detail": None, "Client": None, "HttpStatus": None,
        "ImdsStatus": 200, "Hook": None, "DocumentIncarnation": "opaque-incarnation", "ApiVersion": "2020-07-01", "Vm": VM,
    }))


def heartbeat(seq: int) -> Record:
    return Record.from_dict(_envelope(seq, "forwarder.heartbeat", "forwarder", {
        "Version": "0.1.0", "ApiVersion": "2020-07-01", "Vm": VM, "UptimeSeconds": 12.5, "Polls": 40,
        "ImdsErrors": 0, "CurrentEvents": 1, "DocumentIncarnation": 3,
    }))


def incompressible(seq: int, size: int) -> Record:
    return scheduled(seq, os.urandom(size // 2).hex())


@pytest.fixture
def emu(monkeypatch: pytest.MonkeyPatch):
    with Emulator(vms=["vm-0"]) as emulator:
        # Configures the real azure-identity ManagedIdentityCredential to ask the emulator.
        monkeypatch.setenv("AZURE_POD_IDENTITY_AUTHORITY_HOST", emulator.url)
        yield emulator


@pytest.fixture
def peer(emu: Emulator):
    with LogsIngestionPeer(token_validator=emulator_tokens(emu)) as p:
        yield p


def make_sink(peer: LogsIngestionPeer, tmp_path: Path, **options: Any) -> LogAnalyticsSink:
    opts = {"endpoint": peer.url, "rule_id": peer.rule_id, "ca_file": peer.ca_file, "timeout": "5s", **options}
    return LogAnalyticsSink(opts, SinkContext(name="la", state_dir=tmp_path))


@pytest.fixture
def sink(peer: LogsIngestionPeer, tmp_path: Path):
    s = make_sink(peer, tmp_path)
    yield s
    s.close()


# -- the happy path -----------------------------------------------------------------------------

def test_rows_arrive_with_the_exact_row_shape_gzip_and_an_emulator_token(sink, peer, emu):
    batch = [scheduled(1), approval(2), heartbeat(3)]
    assert sink.send(batch) == Ok()
    assert peer.rows == [to_row(r.to_dict()) for r in batch]
    (upload,) = peer.uploads
    assert upload.status == 204 and upload.gzip
    assert upload.path == f"/dataCollectionRules/{peer.rule_id}/streams/Custom-SefwdEvents"
    assert upload.query["api-version"] == ["2023-01-01"]
    assert emu.stats()["token_requests"] >= 1
    assert peer.tokens[0].startswith("emulator-token.vm-0.")
    # What the typed columns and Data carry.
    first, second, third = peer.rows
    assert first["Sequence"] == 1 and first["Resources"] == ["vm-0", "vm-1"] and first["Data"] == {"Extra": {"Custom": "x"}}
    assert second["DocumentIncarnation"] is None and second["Data"]["DocumentIncarnation"] == "opaque-incarnation"
    assert third["RecordType"] == "forwarder.heartbeat" and third["Data"]["Polls"] == 40


def test_the_token_is_fetched_once_and_cached_across_sends(sink, peer, emu):
    for seq in range(1, 5):
        assert sink.send([scheduled(seq)]) == Ok()
    assert len(peer.rows) == 4
    assert emu.stats()["token_requests"] == 1
    assert len(set(peer.tokens)) == 1


def test_a_3_mb_batch_goes_in_several_chunks_under_1_mib_all_rows_once_in_order(sink, peer):
    batch = [incompressible(seq, 10_000) for seq in range(1, 301)]  # ~3 MB of rows
    assert sink.send(batch) == Ok()
    uploads = peer.uploads
    assert len(uploads) >= 3
    assert all(u.status == 204 and u.gzip and len(u.body) <= 1024 * 1024 + 4096 for u in uploads)
    assert [r["RecordId"] for r in peer.rows] == [r.id for r in batch]


def test_big_values_are_truncated_before_the_service_would(sink, peer):
    assert sink.send([scheduled(1, "é" * 100_000)]) == Ok()
    (row,) = peer.wait_rows(1)
    assert len(row["Description"].encode()) <= 32 * 1024
    assert "truncated" in row["Description"]


# -- failures -------------------------------------------------------------------------------------

def test_413_splits_the_batch_until_it_fits(peer, emu, tmp_path):
    peer.max_body = 6_000  # each row is ~2.5 KB gzip'd: the whole batch, and halves of 4, are too big
    sink = make_sink(peer, tmp_path)
    try:
        batch = [incompressible(seq, 4_000) for seq in range(1, 9)]
        assert sink.send(batch) == Ok()
    finally:
        sink.close()
    statuses = [u.status for u in peer.uploads]
    assert 413 in statuses and statuses[-1] == 204
    assert [r["RecordId"] for r in peer.rows] == [r.id for r in batch]


def test_one_row_too_large_is_rejected_alone(peer, emu, tmp_path):
    peer.max_body = 500
    sink = make_sink(peer, tmp_path)
    try:
        result = sink.send([incompressible(1, 4_000)])
    finally:
        sink.close()
    assert isinstance(result, Reject) and result.reason == "row_too_large"
    assert "ContentLengthLimitExceeded" in result.detail


def test_a_rejected_batch_resent_record_by_record_sends_each_accepted_row_once(peer, emu, tmp_path):
    peer.max_body = 1_500  # a small row fits, the big one never does
    sink = make_sink(peer, tmp_path)
    try:
        small1, huge, small3 = scheduled(1), incompressible(2, 4_000), scheduled(3)
        result = sink.send([small1, huge, small3])
        assert isinstance(result, Reject) and result.reason == "row_too_large"
        # What the dispatcher does with a Reject of several records: each one alone.
        first, second, third = (sink.send([r]) for r in (small1, huge, small3))
        assert first == Ok() and third == Ok()
        assert isinstance(second, Reject) and second.reason == "row_too_large"
    finally:
        sink.close()
    assert [r["RecordId"] for r in peer.rows] == [small1.id, small3.id]


def test_429_retries_after_the_services_retry_after(sink, peer):
    peer.queue(Reply(429, {"Retry-After": "7"}, {"error": {"code": "TooManyRequests", "message": "slow down"}}))
    batch = [scheduled(1), scheduled(2)]
    assert sink.send(batch) == Retry(reason="throttled", delay=7.0)
    assert peer.rows == []
    assert sink.send(batch) == Ok()
    assert [r["RecordId"] for r in peer.rows] == [r.id for r in batch]


def test_after_a_partial_failure_only_the_failed_rows_are_sent_again(sink, peer):
    peer.queue(PASS, Reply(503))
    batch = [incompressible(seq, 10_000) for seq in range(1, 301)]
    result = sink.send(batch)
    assert isinstance(result, Retry) and result.reason == "http_503"
    accepted = len(peer.rows)
    assert 0 < accepted < len(batch)
    assert sink.send(batch) == Ok()
    assert [r["RecordId"] for r in peer.rows] == [r.id for r in batch]  # once each, in order


def test_403_retries_and_names_the_missing_role(sink, peer, caplog):
    peer.authorized = False
    with caplog.at_level(logging.ERROR, logger="sinks.loganalytics"):
        assert sink.send([scheduled(1)]) == Retry(reason="forbidden")
    assert "Monitoring Metrics Publisher" in caplog.text and "30 minutes" in caplog.text
    assert peer.uploads[-1].status == 403
    peer.authorized = True
    assert sink.send([scheduled(1)]) == Ok()
    assert len(peer.rows) == 1


def test_a_token_the_service_does_not_accept_is_retried(peer, emu, tmp_path):
    peer.token_validator = lambda token: False
    sink = make_sink(peer, tmp_path)
    try:
        assert sink.send([scheduled(1)]) == Retry(reason="forbidden")
    finally:
        sink.close()


def test_401_is_retried_as_auth_failed(sink, peer):
    peer.queue(Reply(401, body={"error": {"code": "InvalidToken", "message": "expired"}}))
    assert sink.send([scheduled(1)]) == Retry(reason="auth_failed")


def test_500_and_a_slow_service_and_a_dead_service_are_retried(peer, emu, tmp_path):
    sink = make_sink(peer, tmp_path, timeout="1s")
    try:
        peer.queue(Reply(500))
        assert sink.send([scheduled(1)]) == Retry(reason="http_500")
        peer.queue(Reply(204, delay=3))
        assert sink.send([scheduled(1)]) == Retry(reason="timeout")
        peer.stop()
        result = sink.send([scheduled(1)])
        assert isinstance(result, Retry) and result.reason == "connection_error"
    finally:
        sink.close()


def test_a_missing_managed_identity_is_retried(sink, emu):
    emu.inject_fault("status", status=400, path="token")  # IMDS: no identity assigned to this VM
    result = sink.send([scheduled(1)])
    assert result == Retry(reason="credential_unavailable")


def test_an_undeclared_stream_is_rejected_with_the_services_message(peer, emu, tmp_path):
    sink = make_sink(peer, tmp_path, stream="Custom-Wrong")
    try:
        result = sink.send([scheduled(1)])
    finally:
        sink.close()
    assert isinstance(result, Reject) and result.reason == "http_404"
    assert "Custom-Wrong" in result.detail and "InvalidStream" in result.detail


def test_a_400_is_rejected_with_the_services_message(sink, peer):
    peer.queue(Reply(400, body={"error": {"code": "InvalidPayload", "message": "column TimeGenerated is bad"}}))
    result = sink.send([scheduled(1)])
    assert isinstance(result, Reject) and "column TimeGenerated is bad" in result.detail


def test_bad_options_are_all_reported(tmp_path):
    problems = LogAnalyticsSink.check({
        "endpoint": "http://127.0.0.1:1", "rule_id": "dcr-nothex", "stream": "a b", "max_batch": 0,
        "credential": "password", "surprise": 1, "audience": "monitor.azure.us", "ca_file": str(tmp_path / "missing.pem"),
    })
    text = "\n".join(problems)
    for word in ("https://", "rule_id", "stream", "max_batch", "credential", "surprise", "ca_file", "audience"):
        assert word in text
    with pytest.raises(ValueError):
        LogAnalyticsSink({"endpoint": "https://x.example"}, SinkContext(name="la", state_dir=tmp_path))
    assert LogAnalyticsSink.check({"endpoint": "https://x.ingest.monitor.azure.com",
                                   "rule_id": "dcr-" + "0a" * 16, "client_id": "abc",
                                   "audience": "https://monitor.azure.us"}) == []


# -- the real agent -------------------------------------------------------------------------------

def test_agent_keeps_records_through_a_403_and_delivers_them_once_in_order(peer, emu, tmp_path):
    peer.authorized = False  # role assignment not yet propagated
    state = tmp_path / "state"
    sinks = (
        f'[[sinks]]\ntype = "file"\nname = "file"\npath = "{tmp_path / "out.jsonl"}"\n'
        f'[[sinks]]\ntype = "loganalytics"\nname = "la"\nendpoint = "{peer.url}"\nrule_id = "{peer.rule_id}"\n'
        f'ca_file = "{peer.ca_file}"\ntimeout = "5s"\n'
    )
    config = write_config(tmp_path / "config.toml", emu.url, state, sinks=sinks)
    agent = AgentProcess(config, tmp_path / "agent.log", env={"AZURE_POD_IDENTITY_AUTHORITY_HOST": emu.url})
    try:
        for _ in range(3):
            emu.schedule(type="Reboot")
        wait_until(lambda: sum(1 for r in read_jsonl(tmp_path / "out.jsonl") if r["type"] == "scheduledevent.scheduled") >= 3,
                   20, "three scheduled records in the file sink")
        wait_until(lambda: sum(1 for u in peer.uploads if u.status == 403) >= 2, 20, "the sink retrying the 403")
        assert "Monitoring Metrics Publisher" in agent.logs()
        assert peer.rows == []
        peer.authorized = True
        expected = read_jsonl(tmp_path / "out.jsonl")
        wait_until(lambda: len(peer.rows) >= len(expected), 30, "every record in Log Analytics")
        assert agent.terminate() == 0
    finally:
        if agent.alive():
            agent.kill()
    delivered = read_jsonl(tmp_path / "out.jsonl")
    ids = [r["RecordId"] for r in peer.rows]
    assert len(ids) == len(set(ids))  # once each
    assert ids == [r["id"] for r in delivered]  # in order, the same records as the file sink
    assert peer.rows == [to_row(r) for r in delivered]
    assert emu.stats()["token_requests"] >= 1


def _agent(peer: LogsIngestionPeer, emu: Emulator, tmp_path: Path, url: str, timeout: str = "5s") -> tuple[Path, AgentProcess]:
    sinks = (
        f'[[sinks]]\ntype = "file"\nname = "file"\npath = "{tmp_path / "out.jsonl"}"\n'
        f'[[sinks]]\ntype = "loganalytics"\nname = "la"\nendpoint = "{url}"\nrule_id = "{peer.rule_id}"\n'
        f'ca_file = "{peer.ca_file}"\ntimeout = "{timeout}"\n'
    )
    config = write_config(tmp_path / "config.toml", emu.url, tmp_path / "state", sinks=sinks,
                          extra='[delivery]\nretry_initial = "100ms"\nretry_max = "300ms"\n')
    return config, AgentProcess(config, tmp_path / "agent.log", env={"AZURE_POD_IDENTITY_AUTHORITY_HOST": emu.url})


def test_agent_rides_out_a_dead_a_slow_and_a_throttling_service(emu, tmp_path):
    """Down at start, then an answer that comes too late, a 503 and a 429 with Retry-After: all arrive, in order."""
    peer = LogsIngestionPeer(token_validator=emulator_tokens(emu)).start()
    port, url = peer.port, peer.url
    peer.stop()
    config, agent = _agent(peer, emu, tmp_path, url, timeout="2s")
    try:
        for _ in range(3):
            emu.schedule(type="Reboot")
        wait_until(lambda: sum(r["type"] == "scheduledevent.scheduled" for r in read_jsonl(tmp_path / "out.jsonl")) >= 3,
                   30, "three scheduled records in the file sink")
        wait_until(lambda: "connection_error" in agent.logs(), 30, "the sink failing to connect")
        peer.start(port)
        peer.queue(Reply(status=0, delay=4), Reply(503), Reply(429, {"Retry-After": "1"}, error_body("TooManyRequests", "slow down")))
        expected = [r["id"] for r in read_jsonl(tmp_path / "out.jsonl")]
        wait_until(lambda: {r["RecordId"] for r in peer.rows} >= set(expected) and any(u.delayed for u in peer.uploads),
                   60, "every record in Log Analytics")
        assert agent.terminate() == 0
    finally:
        if agent.alive():
            agent.kill()
        peer.stop()
    statuses = [u.status for u in peer.uploads]
    assert 503 in statuses and 429 in statuses
    logs = agent.logs()
    assert "retry after 1s" in logs and "timeout" in logs
    late = {row["RecordId"] for u in peer.uploads if u.delayed for row in u.rows}
    counts = Counter(r["RecordId"] for r in peer.rows)
    assert {i for i, n in counts.items() if n > 1} <= late, "only the rows of the answer that came too late arrive twice"
    first_seen = list(dict.fromkeys(r["RecordId"] for r in peer.rows))
    assert first_seen == [r["id"] for r in read_jsonl(tmp_path / "out.jsonl")], "in order"


def test_agent_splits_on_413_resends_only_failed_rows_and_dead_letters_a_permanent_400(emu, tmp_path):
    """Several records in one batch: 413 halves it, a 503 after a chunk got in resends only the rest,
    and the row the service refuses (400) is dead-lettered once, not retried until max_age."""
    with LogsIngestionPeer(token_validator=emulator_tokens(emu)) as peer:
        peer.max_body = 720  # a gzip'd row is ~650 bytes, two ~700, four ~820: a batch of several gets 413
        peer.row_rule = lambda row: "column Description is not valid" if row.get("EventType") == "Freeze" else None
        refused_subject = emu.schedule(type="Freeze")
        for kind in ("Reboot", "Redeploy", "Reboot"):
            emu.schedule(type=kind)
        peer.queue(PASS, Reply(503))  # the first chunk in, the next one fails
        config, agent = _agent(peer, emu, tmp_path, peer.url)
        try:
            wait_until(lambda: sum(r["type"] == "scheduledevent.scheduled" for r in read_jsonl(tmp_path / "out.jsonl")) >= 4,
                       30, "four scheduled records in the file sink")
            records = read_jsonl(tmp_path / "out.jsonl")
            refused = {r["id"] for r in records if r.get("subject") == refused_subject}
            wait_until(lambda: {r["RecordId"] for r in peer.rows} >= {r["id"] for r in records} - refused,
                       60, "every other record in Log Analytics")
            wait_until(lambda: {d["record"]["id"] for d in dead_letters(config, "la")} >= refused, 30,
                       "the refused record in dead letters")
            assert agent.terminate() == 0
        finally:
            if agent.alive():
                agent.kill()
    statuses = [u.status for u in peer.uploads]
    assert 413 in statuses and 503 in statuses and 400 in statuses
    dead = dead_letters(config, "la")
    assert [d["record"]["id"] for d in dead] == sorted(refused) and dead[0]["reason"] == "http_400"
    assert "column Description is not valid" in dead[0]["detail"]
    ids = [r["RecordId"] for r in peer.rows]
    assert len(ids) == len(set(ids)), "once each: the rows that got in before the 503 were not sent again"
    assert ids == [r["id"] for r in read_jsonl(tmp_path / "out.jsonl") if r["id"] not in refused], "in order"
    tries = sum(1 for u in peer.uploads if u.status == 400)
    assert tries <= 2, "the refused row is sent in its batch and once alone, then dead-lettered"
