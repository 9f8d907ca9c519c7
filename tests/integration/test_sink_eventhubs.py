"""The eventhubs sink with the real azure-eventhub client against an AMQP 1.0 peer (rhea) on 127.0.0.1."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from forwarder.delivery.dispatcher import Dispatcher
from forwarder.emulator import Emulator
from forwarder.store.database import Store
from forwarder.common.retry import Backoff
from forwarder.sinkapi import Ok, Record, Reject, Retry, SinkContext
from tests.agent import ROOT, AgentProcess, read_jsonl, wait_until, write_config
from tests.peers.connect_proxy import ConnectProxy
from benchmarks.peers.eventhubs_peer import NAMESPACE_HOST, RESOURCE_LIMIT, SERVER_BUSY, WS_PATH, EventHubsPeer

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


@pytest.fixture(scope="session")  # one per xdist worker: its tests may be spread over workers
def tls_peer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EventHubsPeer]:
    """A peer that listens as the service does: AMQPS and AMQP over secure WebSocket, test CA."""
    with EventHubsPeer(tls=True, log=tmp_path_factory.mktemp("tls-peer") / "peer.log") as p:
        yield p


@pytest.fixture
def own_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EventHubsPeer]:
    """A peer of the test's own, for a test that looks at the peer's connections as a whole."""
    with EventHubsPeer(tls=True, log=tmp_path_factory.mktemp("own-peer") / "peer.log") as p:
        yield p


@pytest.fixture
def service(tls_peer: EventHubsPeer) -> EventHubsPeer:
    tls_peer.reset()
    return tls_peer


def service_sink(tmp_path: Path, peer: EventHubsPeer, monkeypatch: pytest.MonkeyPatch, transport: str = "amqp",
                 **options: Any) -> Any:
    """A sink configured as for Azure (portal connection string, TLS verified), reaching the peer's port."""
    monkeypatch.setenv("EH_SERVICE", peer.service_connection_string())
    port = peer.amqps_port if transport == "amqp" else peer.wss_port
    opts = {"connection_string_env": "EH_SERVICE", "transport": transport, "ca_file": peer.ca_file,
            "custom_endpoint_address": f"sb://127.0.0.1:{port}", "timeout": "5s", **options}
    return EventHubsSink(opts, SinkContext(name="eh", state_dir=tmp_path))


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
    # A 5 s send timeout: the SDK's own reconnect attempts against the refused port must end as a
    # connection error, not as our timeout (under load they took over the 2 s default of make_sink).
    sink = make_sink(tmp_path, peer, monkeypatch, timeout="5s")
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
    # (the attempt abandoned while the peer hung may still land once the socket drops: not necessarily last)
    assert record.id in [e["message_id"] for e in peer.events()]


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
    # (the attempt abandoned while the peer hung may still land once the socket drops: not necessarily last)
    assert record.id in [e["message_id"] for e in peer.events()]


def test_managed_identity_token_from_the_imds_emulator(tmp_path, service, monkeypatch):
    # As on Azure: the namespace host, TLS verified; custom_endpoint_address reaches the peer's port.
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        monkeypatch.setenv("AZURE_POD_IDENTITY_AUTHORITY_HOST", emu.url)
        sink = EventHubsSink(
            {"fully_qualified_namespace": NAMESPACE_HOST, "eventhub": service.hub, "credential": "managed_identity",
             "timeout": "5s", "ca_file": service.ca_file, "custom_endpoint_address": f"127.0.0.1:{service.amqps_port}"},
            SinkContext(name="eh", state_dir=tmp_path),
        )
        try:
            assert sink.send([scheduled("E-1", 1)]) == Ok()
        finally:
            sink.close()
        assert emu.stats()["token_requests"] >= 1
    (token,) = service.stats()["cbs_tokens"]
    assert token["type"] == "jwt" and token["token"].startswith("emulator-token.myVM.")
    assert token["name"] == f"sb://{NAMESPACE_HOST}/{service.hub}"
    assert len(service.events()) == 1 and service.stats()["tls_connections"] == 1


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


# -- like the service: TLS, WebSocket, proxies, disconnects ----------------------------------------

@pytest.mark.parametrize("transport", ["amqp", "websocket"])
def test_tls_transports_verify_the_service_certificate_against_ca_file(tmp_path, service, monkeypatch, transport):
    sink = service_sink(tmp_path, service, monkeypatch, transport)
    records = [scheduled("E-1", 1), scheduled("E-2", 2)]
    try:
        assert sink.send(records) == Ok()
    finally:
        sink.close()
    assert [e["message_id"] for e in service.events()] == [r.id for r in records]
    stats = service.stats()
    if transport == "amqp":
        assert stats["tls_connections"] == 1 and stats["ws_connections"] == 0
    else:
        assert stats["ws_connections"] == 1 and stats["ws_paths"] == [WS_PATH]
    # No UseDevelopmentEmulator: the SDK authenticated with a SAS token for the namespace, over TLS.
    (token,) = stats["cbs_tokens"]
    assert token["name"] == f"sb://{NAMESPACE_HOST}/{service.hub}" and token["token"].startswith("SharedAccessSignature ")


@pytest.mark.parametrize("transport", ["amqp", "websocket"])
def test_a_certificate_from_another_ca_is_refused_and_retried(tmp_path, service, monkeypatch, caplog, transport):
    import trustme

    other = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other))
    for ca_file in (str(other), None):  # another CA, and the default bundle (certifi): both refuse the test CA
        sink = service_sink(tmp_path, service, monkeypatch, transport, ca_file=ca_file)
        if ca_file is None:
            sink = EventHubsSink({k: v for k, v in sink._options.items() if k != "ca_file"},
                                 SinkContext(name="eh", state_dir=tmp_path))
        try:
            with caplog.at_level(logging.ERROR, logger="sinks.eventhubs"):
                assert sink.send([scheduled("E-1", 1)]) == Retry(reason="certificate_error")
        finally:
            sink.close()
    assert "ca_file" in caplog.text and "SAS_KEY_VALUE" not in caplog.text
    assert service.events() == []


def test_websocket_through_an_http_proxy_with_credentials_from_a_file(tmp_path, service, monkeypatch, caplog):
    creds = tmp_path / "proxy-credentials"
    creds.write_text("svc-sefwd:s3cret pass\n")
    # The proxy resolves the namespace name (.test never resolves here) and requires Basic credentials.
    with ConnectProxy({f"{NAMESPACE_HOST}:443": ("127.0.0.1", service.wss_port)},
                      credentials=("svc-sefwd", "s3cret pass")) as proxy:
        monkeypatch.setenv("EH_SERVICE", service.service_connection_string())
        options = {"connection_string_env": "EH_SERVICE", "ca_file": service.ca_file, "timeout": "5s",
                   "http_proxy": {"host": "127.0.0.1", "port": proxy.port, "credentials_file": str(creds)}}
        assert EventHubsSink.check(options) == []
        sink = EventHubsSink(options, SinkContext(name="eh", state_dir=tmp_path))
        record = scheduled("E-1", 1)
        try:
            with caplog.at_level(logging.DEBUG):
                assert sink.send([record]) == Ok()
        finally:
            sink.close()
        tunnels = proxy.tunnels
    # The SDK's defaults, unchanged: port 443 and the service's WebSocket path, through the tunnel.
    assert [(t.target, t.status) for t in tunnels] == [(f"{NAMESPACE_HOST}:443", 200)]
    assert service.stats()["ws_paths"] == [WS_PATH]
    assert [e["message_id"] for e in service.events()] == [record.id]
    assert "s3cret" not in caplog.text


def test_websocket_honours_https_proxy_from_the_environment(tmp_path, service, monkeypatch):
    with ConnectProxy({f"{NAMESPACE_HOST}:443": ("127.0.0.1", service.wss_port)}, credentials=("u", "p")) as proxy:
        for name in ("no_proxy", "NO_PROXY", "http_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("https_proxy", f"http://u:p@127.0.0.1:{proxy.port}")
        monkeypatch.setenv("EH_SERVICE", service.service_connection_string())
        sink = EventHubsSink({"connection_string_env": "EH_SERVICE", "ca_file": service.ca_file, "timeout": "5s",
                              "transport": "websocket"}, SinkContext(name="eh", state_dir=tmp_path))
        try:
            assert sink.send([scheduled("E-1", 1)]) == Ok()
        finally:
            sink.close()
        assert [(t.target, t.status) for t in proxy.tunnels] == [(f"{NAMESPACE_HOST}:443", 200)]


def test_proxy_refusing_the_credentials_is_retried_with_a_clear_log(tmp_path, service, monkeypatch, caplog):
    with ConnectProxy({f"{NAMESPACE_HOST}:443": ("127.0.0.1", service.wss_port)}, credentials=("u", "right")) as proxy:
        monkeypatch.setenv("EH_SERVICE", service.service_connection_string())
        monkeypatch.setenv("PROXY_CREDS", "u:wrong")
        sink = EventHubsSink({"connection_string_env": "EH_SERVICE", "ca_file": service.ca_file, "timeout": "5s",
                              "transport": "websocket",
                              "http_proxy": {"host": "127.0.0.1", "port": proxy.port, "credentials_env": "PROXY_CREDS"}},
                             SinkContext(name="eh", state_dir=tmp_path))
        try:
            with caplog.at_level(logging.ERROR, logger="sinks.eventhubs"):
                assert sink.send([scheduled("E-1", 1)]) == Retry(reason="proxy_auth_failed")
        finally:
            sink.close()
        assert {t.status for t in proxy.tunnels} == {407}
    assert "credentials_env" in caplog.text and "wrong" not in caplog.text
    assert service.events() == []


@pytest.mark.parametrize("transport", ["amqp", "websocket"])
@pytest.mark.parametrize("how", ["close", "detach", "drop", "freeze"])
def test_the_service_closing_an_idle_connection_or_link_costs_nothing(tmp_path, own_service, monkeypatch, transport, how):
    # close / detach: what the service does to idle clients; drop: a TCP reset; freeze: a NAT or
    # load-balancer that forgot the flow (no FIN, no RST, nothing answered any more).
    service = own_service  # counts the peer's open connections: no other test's client may be connected
    sink = service_sink(tmp_path, service, monkeypatch, transport, timeout="2s")
    sent = [scheduled("E-1", i) for i in range(4)]
    try:
        assert sink.send(sent[:1]) == Ok()
        assert service.disconnect(how) == 1
        if how in ("close", "drop"):
            wait_until(lambda: service.stats()["open_connections"] == 0, 15, "the connection gone at the peer")
        for record in sent[1:]:  # a Retry is allowed right after the disconnect, never a loss
            wait_until(lambda r=record: sink.send([r]) == Ok(), 30, "a send after the disconnect")
    finally:
        sink.close()
    ids = [e["message_id"] for e in service.events()]
    assert ids == [r.id for r in sent]  # each once, in order


def _deliver_with_dispatcher(tmp_path: Path, sink: Any, records: list[Record]) -> Dispatcher:
    dispatcher = Dispatcher(Store.open(tmp_path / "state", fsync=False), {"eh": sink},
                            backoff=Backoff(initial=0.05, maximum=0.5))
    dispatcher.start()
    for i in range(0, len(records), 5):  # the agent commits a change's records together
        dispatcher.store.commit(records[i : i + 5])
    return dispatcher


@pytest.mark.parametrize("transport", ["amqp", "websocket"])
@pytest.mark.parametrize(("how", "stored"), [("close", False), ("detach", False), ("drop", False), ("freeze", False),
                                             ("close", True), ("drop", True), ("freeze", True)])
def test_a_disconnect_during_a_send_loses_nothing_and_duplicates_at_most_the_batch_in_flight(
        tmp_path, service, monkeypatch, transport, how, stored):
    sink = service_sink(tmp_path, service, monkeypatch, transport, max_batch=20, timeout="2s")
    records = [scheduled(f"E-{i % 7}", i) for i in range(60)]
    # The third transfer is hit: the peer disconnects before storing it (lost in flight) or after
    # storing it without settling (the sender cannot know it arrived, so it must send it again).
    service.faults(on_transfer={"how": how, "keep": stored}, on_transfer_count=1)
    dispatcher = _deliver_with_dispatcher(tmp_path, sink, records)
    try:
        wait_until(lambda: dispatcher.workers["eh"].stats.delivered >= len(records), 60, "every record delivered")
    finally:
        dispatcher.close(drain_timeout=5)
        sink.close()
    got = service.events()
    ids = [e["message_id"] for e in got]
    assert set(ids) == {r.id for r in records}  # nothing lost
    assert service.stats()["disconnects"] == 1
    duplicated = {i for i in ids if ids.count(i) > 1}
    unsettled = {e["message_id"] for e in got if e.get("unsettled")}
    if stored:
        assert unsettled and duplicated <= unsettled  # only the transfer in flight came twice
        assert len(duplicated) <= 20
    else:
        assert not duplicated and not unsettled
    by_key: dict[str, list[str]] = {}
    for e in got:  # in order per partition key, counting each record's first arrival
        if e["message_id"] not in by_key.setdefault(e["partition_key"], []):
            by_key[e["partition_key"]].append(e["message_id"])
    for key, got_ids in by_key.items():
        assert got_ids == [r.id for r in records if r.to_dict()["data"]["EventId"] == key]


def test_a_peer_hanging_in_the_tls_handshake_is_abandoned_without_a_thread_per_send(tmp_path, service, monkeypatch):
    sink = service_sink(tmp_path, service, monkeypatch, "amqp", timeout="1s")
    sink.stall_limit = 1.5
    try:
        service.faults(silent=True)  # accepts TCP, never answers the TLS ClientHello
        assert sink.send([scheduled("E-1", 1)]) == Retry(reason="timeout")
        assert sink.send([scheduled("E-1", 1)]) == Retry(reason="peer_not_answering")
        service.clear_faults()
        service.down()  # drops the hung socket: the abandoned sender returns and ends
        service.up()
        record = scheduled("E-1", 2)
        assert wait_until(lambda: sink.send([record]) == Ok(), 20, "a send after the peer recovered")
        threads_before = threading.active_count()
        for i in range(20):
            assert sink.send([scheduled("E-1", 3 + i)]) == Ok()
        assert threading.active_count() == threads_before  # the sends reuse one sender thread
    finally:
        sink.close()
    got = service.events()
    assert got[0]["message_id"] == record.id, [(e["message_id"], orjson.loads(e["body"])["sequence"]) for e in got[:3]]


@pytest.mark.slow  # a benchmark run
def test_the_cpu_benchmark_runs_both_implementations_side_by_side(tmp_path):
    out = tmp_path / "eventhubs.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.eventhubs_send", "--smoke", "--out", str(out)],
                          cwd=str(ROOT), capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    res = orjson.loads(out.read_bytes())["results"]["eventhubs_send"]
    cpu = res["figures"]["cpu_ms_per_record"]
    assert set(cpu) == {"before", "after"}
    assert all(set(cpu[impl]) == {"amqp", "websocket"} for impl in cpu)
    assert all(cpu[i][t][s] > 0 for i in cpu for t in cpu[i] for s in ("burst", "single", "single_sink"))
    assert "cpu_ms_per_record" in proc.stdout


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
    ({"connection_string_env": "EH_CONN", "transport": "amqps"}, "option 'transport' must be one of amqp, websocket"),
    ({"connection_string_env": "EH_CONN", "transport": "amqp", "http_proxy": {"host": "p", "port": 3128}},
     "needs transport = \"websocket\""),
    ({"connection_string_env": "EH_CONN", "http_proxy": "http://p:3128"}, "option 'http_proxy' must be a table"),
    ({"connection_string_env": "EH_CONN", "http_proxy": {"host": "p"}}, "option 'http_proxy.port' must be a port"),
    ({"connection_string_env": "EH_CONN", "http_proxy": {"host": "p", "port": 3128, "password": "x"}},
     "not allowed inline"),
    ({"connection_string_env": "EH_CONN", "http_proxy": {"host": "p", "port": 3128, "credentials_env": "EH_UNSET_VARIABLE"}},
     "EH_UNSET_VARIABLE"),
    ({"connection_string_env": "EH_CONN", "http_proxy": {"host": "p", "port": 3128, "credentials_env": "EH_NO_COLON"}},
     "must read user:password"),
    ({"connection_string_env": "EH_CONN", "http_proxy": {"host": "p", "port": 3128, "user": "x"}},
     "option 'http_proxy.user' is unknown"),
    ({"connection_string_env": "EH_CONN", "ca_file": "/nonexistent/ca.pem"}, "is not a readable file"),
    ({"connection_string_env": "EH_CONN", "custom_endpoint_address": "sb://gw:port"}, "invalid port"),
    ({"connection_string_env": "EH_CONN", "custom_endpoint_address": "sb://gw:5671/path"}, "must be host[:port]"),
])
def test_check_reports_each_problem(options, expected, monkeypatch):
    monkeypatch.setenv("EH_CONN", "Endpoint=sb://x.servicebus.windows.net/;SharedAccessKeyName=a;"
                                  "SharedAccessKey=topsecret;EntityPath=hub1")
    monkeypatch.setenv("EH_NO_ENTITY", "Endpoint=sb://x.servicebus.windows.net/;SharedAccessKeyName=a;SharedAccessKey=topsecret")
    monkeypatch.setenv("EH_BAD", "Endpoint=sb://x.servicebus.windows.net/;SharedAccessKeyName=a")
    monkeypatch.setenv("EH_NO_COLON", "topsecret")
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
    creds = tmp_path / "proxy"
    creds.write_text("user:pass word\n")
    assert EventHubsSink.check({"connection_string_file": str(conn), "eventhub": "h", "transport": "websocket",
                                "ca_file": str(conn), "custom_endpoint_address": "gw.example.com:8443",
                                "http_proxy": {"host": "proxy.corp", "port": 3128, "credentials_file": str(creds)}}) == []
    assert eventhubs.proxy_settings({"host": "proxy.corp", "port": 3128, "credentials_file": str(creds)}) == {
        "proxy_hostname": "proxy.corp", "proxy_port": 3128, "username": "user", "password": "pass word"}


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
        "from forwarder.agent.config import load_config\n"
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


def test_agent_over_websocket_through_a_proxy_survives_the_service_dropping_it(tmp_path, service):
    """The real agent, configured as for Azure behind a corporate proxy (nested http_proxy table, TLS CA)."""
    state = tmp_path / "state"
    creds = tmp_path / "proxy-credentials"
    creds.write_text("agent:pr0xy\n")
    with Emulator(vms=["myVM"], rate_limit=None) as emu, \
            ConnectProxy({f"{NAMESPACE_HOST}:443": ("127.0.0.1", service.wss_port)}, credentials=("agent", "pr0xy")) as proxy:
        sinks = (
            f'[[sinks]]\ntype = "file"\nname = "file"\npath = "{tmp_path / "out.jsonl"}"\n'
            f'[[sinks]]\ntype = "eventhubs"\nname = "hub"\nconnection_string_env = "EH_CONN"\ntimeout = "3s"\n'
            f'transport = "websocket"\nca_file = "{service.ca_file}"\n'
            f'http_proxy = {{ host = "127.0.0.1", port = {proxy.port}, credentials_file = "{creds}" }}\n'
        )
        config = write_config(tmp_path / "config.toml", emu.url, state, sinks=sinks)
        agent = AgentProcess(config, tmp_path / "agent.log", env={"EH_CONN": service.service_connection_string()})
        try:
            def at_hub() -> set[str]:
                return {e["message_id"] for e in service.events()}

            def written() -> set[str]:
                return {r["id"] for r in read_jsonl(tmp_path / "out.jsonl")}

            first = emu.schedule(type="Reboot", start_after=600)
            wait_until(lambda: written() and written() <= at_hub(), 40, "the first records at the hub")
            service.disconnect("drop")  # idle: the next send finds the connection gone
            emu.schedule(type="Freeze", start_after=600)
            emu.start_event(first)
            wait_until(lambda: sum(1 for r in read_jsonl(tmp_path / "out.jsonl") if r["type"].startswith("scheduledevent."))
                       >= 3, 30, "three scheduled-event records")
            wait_until(lambda: written() <= at_hub(), 40, "every record at the hub after the drop")
            assert agent.terminate() == 0
        finally:
            if agent.alive():
                agent.kill()
        tunnels = proxy.tunnels
    ids = [e["message_id"] for e in service.events()]
    delivered = read_jsonl(tmp_path / "out.jsonl")
    assert sorted(set(ids)) == sorted(r["id"] for r in delivered)  # forwarder.stopped included
    assert len(ids) == len(set(ids))  # dropped while idle: nothing was in flight, nothing comes twice
    assert len(tunnels) >= 2 and {t.status for t in tunnels} == {200}  # reconnected through the proxy
    assert "pr0xy" not in agent.logs()
