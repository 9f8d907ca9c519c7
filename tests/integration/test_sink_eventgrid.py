"""The ``eventgrid`` sink against a local HTTPS Event Grid peer (custom topic and namespace topic),
with keys and with managed-identity tokens from the IMDS emulator."""
from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from forwarder.sinkapi import Ok, Reject, Retry, SinkContext
from sinks.eventgrid import EventGridSink
from tests.agent import AgentProcess, dead_letters, read_jsonl, wait_until, write_config
from tests.integration.test_sink_loganalytics import emu, incompressible, scheduled  # noqa: F401 - emu is a fixture
from benchmarks.peers.eventgrid_peer import KEY, MAX_BYTES, EventGridPeer
from benchmarks.peers.logs_ingestion import PASS, Reply, emulator_tokens, error_body

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def peer():
    with EventGridPeer() as p:
        yield p


@pytest.fixture
def make_sink(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    made: list[EventGridSink] = []

    def make(peer: EventGridPeer, max_request_bytes: int = MAX_BYTES, **options: Any) -> EventGridSink:
        monkeypatch.setenv("TEST_EG_KEY", KEY)
        opts: dict[str, Any] = {"endpoint": peer.topic_endpoint, "ca_file": peer.ca_file, "timeout": "5s"}
        if peer.namespace_topic:
            opts["topic"] = peer.namespace_topic
        if "credential" not in options:
            opts["key_env"] = "TEST_EG_KEY"
        sink = EventGridSink({**opts, **options}, SinkContext(name="eg", state_dir=tmp_path),
                             max_request_bytes=max_request_bytes)
        made.append(sink)
        return sink

    yield make
    for sink in made:
        sink.close()


# -- the happy paths ------------------------------------------------------------------------------

def test_a_custom_topic_gets_the_records_byte_for_byte_with_the_key_header(peer, make_sink):
    sink = make_sink(peer)
    batch = [scheduled(1), scheduled(2)]
    assert sink.send(batch) == Ok()
    (upload,) = peer.uploads
    assert upload.path == "/api/events" and upload.query["api-version"] == ["2018-01-01"]
    assert upload.header("aeg-sas-key") == KEY and upload.header("authorization") is None
    assert upload.header("content-type") == "application/cloudevents-batch+json; charset=utf-8"
    assert upload.body == b"[" + b",".join(r.body for r in batch) + b"]"  # the records as stored
    assert peer.events == [r.to_dict() for r in batch]


def test_a_namespace_topic_gets_them_through_publish_with_a_shared_access_key(make_sink):
    with EventGridPeer(namespace_topic="sched-events") as peer:
        sink = make_sink(peer)
        record = scheduled(1)
        assert sink.send([record]) == Ok()
        (upload,) = peer.uploads
        assert upload.path == "/topics/sched-events:publish" and upload.query["api-version"] == ["2024-06-01"]
        assert upload.header("authorization") == f"SharedAccessKey {KEY}" and upload.header("aeg-sas-key") is None
        assert peer.event_ids() == [record.id]


def test_managed_identity_token_is_fetched_once_and_a_missing_role_is_retried(emu, make_sink):
    with EventGridPeer(key=None, namespace_topic="t", token_validator=emulator_tokens(emu)) as peer:
        sink = make_sink(peer, credential="managed_identity")
        peer.authorized = False
        assert sink.send([scheduled(1)]) == Retry(reason="forbidden")
        peer.authorized = True
        for seq in (1, 2, 3):
            assert sink.send([scheduled(seq)]) == Ok()
        assert emu.stats()["token_requests"] == 1
        assert all(t.startswith("emulator-token.vm-0.") for t in peer.tokens)
        assert len(peer.events) == 3


def test_a_wrong_key_is_retried_loudly_and_never_logged(peer, make_sink, monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("TEST_EG_WRONG", "not-the-key-4711")
    sink = make_sink(peer, key_env="TEST_EG_WRONG")
    with caplog.at_level(logging.WARNING, logger="sinks.eventgrid"):
        assert sink.send([scheduled(1)]) == Retry(reason="auth_failed")
    assert peer.events == [] and peer.uploads[-1].status == 401
    assert "access key" in caplog.text and "not-the-key-4711" not in caplog.text


# -- limits ---------------------------------------------------------------------------------------

def test_a_batch_over_1_mb_goes_in_requests_within_1_mb_all_once_in_order(peer, make_sink):
    sink = make_sink(peer)
    batch = [incompressible(seq, 60_000) for seq in range(1, 41)]  # ~2.5 MB of events
    assert sink.send(batch) == Ok()
    uploads = peer.uploads
    assert len(uploads) >= 3 and all(u.status == 200 and u.wire_bytes <= MAX_BYTES for u in uploads)
    assert peer.event_ids() == [r.id for r in batch]


def test_an_event_over_1_mb_is_rejected_alone_and_never_sent(peer, make_sink):
    sink = make_sink(peer)
    small1, huge, small3 = scheduled(1), incompressible(2, 1_100_000), scheduled(3)
    result = sink.send([small1, huge, small3])
    assert isinstance(result, Reject) and result.reason == "items_refused"
    first, second, third = (sink.send([r]) for r in (small1, huge, small3))
    assert first == Ok() and third == Ok()
    assert isinstance(second, Reject) and second.reason == "event_too_large"
    assert peer.event_ids() == [small1.id, small3.id]
    assert huge.id not in peer.sent_ids()


def test_a_413_from_the_service_splits_the_request(peer, make_sink):
    peer.max_body = 25_000  # a stricter gateway in front: the sink learns from 413
    sink = make_sink(peer)
    batch = [incompressible(seq, 8_000) for seq in range(1, 9)]
    assert sink.send(batch) == Ok()
    assert 413 in {u.status for u in peer.uploads}
    assert peer.event_ids() == [r.id for r in batch]


# -- failures -------------------------------------------------------------------------------------

def test_429_honours_retry_after_and_5xx_slow_and_down_are_retried(peer, make_sink):
    sink = make_sink(peer, timeout="1s")
    peer.queue(Reply(429, {"Retry-After": "9"}, error_body("TooManyRequests", "slow down")), Reply(503))
    assert sink.send([scheduled(1)]) == Retry(reason="throttled", delay=9.0)
    assert sink.send([scheduled(1)]) == Retry(reason="http_503")
    peer.queue(Reply(503, delay=3))
    assert sink.send([scheduled(1)]) == Retry(reason="timeout")
    assert sink.send([scheduled(1)]) == Ok()
    peer.stop()
    assert sink.send([scheduled(2)]) == Retry(reason="connection_error")


def test_after_a_later_request_fails_only_the_rest_is_sent_again(peer, make_sink):
    sink = make_sink(peer, max_request_bytes=30_000)
    batch = [incompressible(seq, 10_000) for seq in range(1, 7)]  # two or three requests
    peer.queue(PASS, Reply(500))
    assert sink.send(batch) == Retry(reason="http_500")
    got_in = peer.event_ids()
    assert 0 < len(got_in) < len(batch)
    assert sink.send(batch) == Ok()
    assert peer.event_ids() == [r.id for r in batch]  # once each, in order


def test_a_refused_event_is_rejected_alone(peer, make_sink):
    sink = make_sink(peer)
    batch = [scheduled(1), scheduled(2), scheduled(3)]
    bad = batch[1]
    peer.event_rule = lambda event: "subject is reserved" if event["id"] == bad.id else None
    result = sink.send(batch)
    assert isinstance(result, Reject) and result.reason == "items_refused"
    results = [sink.send([r]) for r in batch]
    assert results[0] == Ok() and results[2] == Ok()
    assert isinstance(results[1], Reject) and results[1].reason == "http_400" and "subject is reserved" in results[1].detail
    assert peer.event_ids() == [batch[0].id, batch[2].id]
    assert Counter(peer.sent_ids())[bad.id] == 2  # in its request, then alone: never again


def test_bad_options_are_all_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("TEST_EG_KEY", KEY)
    problems = EventGridSink.check({"endpoint": "http://x.example/api/events", "topic": "a/b", "credential": "password",
                                    "key_env": "TEST_EG_KEY", "max_batch": 0, "surprise": 1,
                                    "ca_file": str(tmp_path / "missing.pem")})
    text = "\n".join(problems)
    for word in ("https://", "topic", "credential", "not both", "max_batch", "surprise", "ca_file"):
        assert word in text
    assert any("key_env or key_file" in p for p in EventGridSink.check({"endpoint": "https://x.example/api/events"}))
    assert EventGridSink.check({"endpoint": "https://t.westeurope-1.eventgrid.azure.net/api/events",
                                "credential": "managed_identity", "client_id": "abc"}) == []
    with pytest.raises(ValueError):
        EventGridSink({"endpoint": "https://x.example"}, SinkContext(name="eg", state_dir=tmp_path))


# -- the real agent -------------------------------------------------------------------------------

def test_agent_publishes_to_a_namespace_topic_with_a_managed_identity(emu, tmp_path):
    """Throttled, then one event the topic refuses: the others arrive once, in order; that one is dead-lettered."""
    with EventGridPeer(key=None, namespace_topic="sched", token_validator=emulator_tokens(emu)) as peer:
        refused_subject = emu.schedule(type="Freeze")
        emu.schedule(type="Reboot")
        peer.event_rule = lambda event: "Freeze is not routed here" if event.get("subject") == refused_subject else None
        peer.queue(Reply(429, {"Retry-After": "1"}, error_body("TooManyRequests", "slow down")))
        sinks = (f'[[sinks]]\ntype = "file"\nname = "file"\npath = "{tmp_path / "out.jsonl"}"\n'
                 f'[[sinks]]\ntype = "eventgrid"\nname = "eg"\nendpoint = "{peer.url}"\ntopic = "sched"\n'
                 f'credential = "managed_identity"\nca_file = "{peer.ca_file}"\n')
        config = write_config(tmp_path / "config.toml", emu.url, tmp_path / "state", sinks=sinks,
                              extra='[delivery]\nretry_initial = "100ms"\nretry_max = "300ms"\n')
        env = {"AZURE_POD_IDENTITY_AUTHORITY_HOST": emu.url}
        agent = AgentProcess(config, tmp_path / "agent.log", env=env)
        try:
            wait_until(lambda: sum(r["type"] == "scheduledevent.scheduled" for r in read_jsonl(tmp_path / "out.jsonl")) >= 2,
                       30, "two scheduled records in the file sink")
            records = read_jsonl(tmp_path / "out.jsonl")
            refused = {r["id"] for r in records if r.get("subject") == refused_subject}
            wait_until(lambda: set(peer.event_ids()) >= {r["id"] for r in records} - refused, 30, "the other records")
            wait_until(lambda: {d["record"]["id"] for d in dead_letters(config, "eg", env)} >= refused, 30,
                       "the refused record in dead letters")
            assert agent.terminate() == 0
        finally:
            if agent.alive():
                agent.kill()
    assert 429 in {u.status for u in peer.uploads} and "retry after 1s" in agent.logs()
    delivered = [r for r in read_jsonl(tmp_path / "out.jsonl") if r["id"] not in refused]
    assert peer.events == delivered, "once each, in order, exactly as the file sink wrote them"
    dead = dead_letters(config, "eg", env)
    assert [d["reason"] for d in dead] == ["http_400"] and "Freeze is not routed here" in dead[0]["detail"]
    assert Counter(peer.sent_ids())[next(iter(refused))] <= 2


def test_a_managed_identity_without_azure_identity_names_the_extra():
    import subprocess
    import sys

    from tests.agent import ROOT

    script = ("import sys; sys.modules['azure.identity'] = None\n"
              "from sinks.eventgrid import EventGridSink\n"
              "print(*EventGridSink.check({'endpoint': 'https://t.example/api/events', 'credential': 'managed_identity'}))")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    assert "pip install 'scheduled-events-forwarder[eventgrid]'" in out.stdout
