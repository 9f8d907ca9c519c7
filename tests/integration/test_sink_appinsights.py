"""The appinsights sink (track envelopes posted with requests) against an HTTPS /v2.1/track peer."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest

from forwarder.emulator import Emulator
from forwarder.sinkapi import Ok, Record, Reject, Retry, SinkContext
from sinks.appinsights import AppInsightsSink, event_properties
from tests.agent import ROOT, AgentProcess, dead_letters, read_jsonl, wait_until, write_config
from benchmarks.peers.appinsights_peer import IKEY, AppInsightsPeer, Answer

# Keep the SDK's own phone-home features off the network in tests (they are documented env switches).
QUIET_SDK_ENV = {
    "APPLICATIONINSIGHTS_STATSBEAT_DISABLED_ALL": "true",
    "APPLICATIONINSIGHTS_CONTROLPLANE_DISABLED": "true",
    "APPLICATIONINSIGHTS_SDKSTATS_DISABLED": "true",
}


def _record(n: int, type_: str = "scheduledevent.scheduled") -> Record:
    return Record.from_dict({
        "specversion": "1.0", "id": f"id-{n}", "source": "/subscriptions/s/vm/web-0", "type": type_,
        "subject": f"EVT-{n}", "time": "2026-01-02T03:04:05.678Z", "datacontenttype": "application/json",
        "sequence": f"{n:020d}", "eventkey": f"EVT-{n}:scheduled",
        "data": {"EventId": f"EVT-{n}", "EventType": "Reboot", "Resources": ["web-0", "web-1"],
                 "DurationInSeconds": -1, "AffectsThisVm": True, "PreviousStatus": None,
                 "Vm": {"Name": "web-0", "VmId": "abc"}},
    })


def _noisy(n: int) -> Record:
    """A record whose envelope does not compress (random text in the data)."""
    event = _record(n).to_dict()
    event["data"]["Description"] = os.urandom(1000).hex()
    return Record.from_dict(event)


@pytest.fixture(autouse=True)
def quiet_sdk(monkeypatch):
    for name, value in QUIET_SDK_ENV.items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def peer(tmp_path):
    with AppInsightsPeer(tmp_path) as p:
        yield p


@pytest.fixture
def make_sink(tmp_path, peer, monkeypatch):
    made = []

    def make(**options):
        monkeypatch.setenv("TEST_AI_CONN", peer.connection_string)
        opts = {"connection_string_env": "TEST_AI_CONN", "ca_file": str(peer.ca_file), "timeout": "2s", **options}
        sink = AppInsightsSink(opts, SinkContext(name="ai", state_dir=tmp_path / "state" / "sinks" / "ai"))
        made.append(sink)
        return sink

    yield make
    for sink in made:
        sink.close()


def test_each_record_becomes_one_custom_event(peer, make_sink):
    sink = make_sink()
    assert sink.send([_record(1), _record(2, "approval.approved")]) == Ok()
    events = peer.wait_for_events(2)
    assert len(events) == 2
    first, second = events
    assert first["name"] == "Microsoft.ApplicationInsights.Event" and first["iKey"] == IKEY
    assert first["data"]["baseData"]["name"] == "scheduledevent.scheduled"
    assert second["data"]["baseData"]["name"] == "approval.approved"
    props = first["data"]["baseData"]["properties"]
    assert props["id"] == "id-1" and props["subject"] == "EVT-1" and props["sequence"] == f"{1:020d}"
    assert props["source"] == "/subscriptions/s/vm/web-0" and props["eventkey"] == "EVT-1:scheduled"
    assert props["EventId"] == "EVT-1" and props["EventType"] == "Reboot"
    assert props["Resources"] == '["web-0","web-1"]' and props["Vm"] == '{"Name":"web-0","VmId":"abc"}'
    assert props["DurationInSeconds"] == "-1" and props["AffectsThisVm"] == "true"
    assert "PreviousStatus" not in props and "specversion" not in props
    # The event time is the record's time (when the agent saw the change).
    assert first["time"].startswith("2026-01-02T03:04:05.678")
    assert first["tags"]["ai.cloud.role"] == "scheduled-events-forwarder"


def test_role_name_and_batching(peer, make_sink):
    sink = make_sink(role_name="fleet-a", batch_size=2)
    assert sink.max_batch == 2
    assert sink.send([_record(1), _record(2)]) == Ok()
    (request,) = peer.wait_for_requests(1)
    assert len(request.envelopes) == 2
    assert request.envelopes[0]["tags"]["ai.cloud.role"] == "fleet-a"


@pytest.mark.parametrize("status", [500, 503, 429, 401, 403])
def test_failure_is_retry_then_recovery_delivers_once(peer, make_sink, status):
    sink = make_sink()
    peer.queue(Answer(status, retry_after=1 if status == 429 else None))
    batch = [_record(1), _record(2)]
    result = sink.send(batch)
    assert isinstance(result, Retry)
    assert peer.events() == []
    assert sink.send(batch) == Ok()
    ids = [e["data"]["baseData"]["properties"]["id"] for e in peer.wait_for_events(2)]
    assert ids == ["id-1", "id-2"]


def test_partial_success_retries_only_the_failed_items(peer, make_sink):
    sink = make_sink()
    peer.queue(Answer(206, reject=[1], retry_after=3))
    batch = [_record(1), _record(2), _record(3)]
    assert sink.send(batch) == Retry(reason="partial_success", delay=3.0)
    assert sink.send(batch) == Ok()
    assert peer.event_ids() == ["id-1", "id-3", "id-2"]  # each once
    assert [len(r.envelopes) for r in peer.requests] == [3, 1]  # the retry carried only the failed item


def test_items_refused_for_good_are_rejected_one_by_one_and_never_sent_again(peer, make_sink):
    sink = make_sink()
    peer.queue(Answer(206, refuse=[1]))
    batch = [_record(1), _record(2), _record(3)]
    result = sink.send(batch)
    assert isinstance(result, Reject) and result.reason == "items_refused"
    # What the dispatcher does with a Reject of several records: each one alone.
    first, second, third = (sink.send([r]) for r in batch)
    assert first == Ok() and third == Ok()
    assert isinstance(second, Reject) and second.reason == "item_400" and "scripted item refusal" in second.detail
    assert peer.event_ids() == ["id-1", "id-3"]
    assert peer.sent_ids() == ["id-1", "id-2", "id-3"]  # nothing went twice


def test_an_invalid_event_is_a_permanent_400_not_a_retry(peer, make_sink):
    sink = make_sink()
    peer.item_rule = lambda envelope: 400 if envelope["data"]["baseData"]["properties"]["id"] == "id-2" else None
    result = sink.send([_record(2)])
    assert isinstance(result, Reject) and result.reason == "item_400"
    assert peer.requests[-1].status == 400
    assert sink.send([_record(1)]) == Ok()


def test_a_request_refused_as_a_whole_is_split_to_find_the_bad_event(peer, make_sink):
    sink = make_sink()
    # No per-item answer (e.g. a proxy in front of the service): the sink tries each event alone.
    peer.queue(Answer(404), Answer(200), Answer(404))
    result = sink.send([_record(1), _record(2)])
    assert isinstance(result, Reject) and result.reason == "items_refused"
    first, second = (sink.send([r]) for r in (_record(1), _record(2)))
    assert first == Ok() and isinstance(second, Reject) and second.reason == "http_404"
    assert peer.event_ids() == ["id-1"]
    assert [len(r.envelopes) for r in peer.requests] == [2, 1, 1]


def test_429_honours_retry_after_and_a_quota_is_kept_not_dropped(peer, make_sink):
    sink = make_sink()
    peer.queue(Answer(429, retry_after=7), Answer(439, retry_after=60))
    assert sink.send([_record(1)]) == Retry(reason="throttled", delay=7.0)
    assert sink.send([_record(1)]) == Retry(reason="quota_exceeded", delay=60.0)
    assert sink.send([_record(1)]) == Ok()
    assert peer.event_ids() == ["id-1"]


def test_413_splits_the_request_until_it_fits(peer, make_sink):
    sink = make_sink()
    peer.max_body = 3_000  # one gzip'd event is ~1.5 KB: four together are too big
    batch = [_noisy(n) for n in range(1, 5)]
    assert sink.send(batch) == Ok()
    assert 413 in {r.status for r in peer.requests}
    assert sorted(peer.event_ids()) == ["id-1", "id-2", "id-3", "id-4"]
    peer.max_body = 10
    result = sink.send([_noisy(5)])
    assert isinstance(result, Reject) and result.reason == "item_too_large"


def test_slow_peer_times_out_as_retry(peer, make_sink):
    sink = make_sink(timeout="300ms")
    peer.queue(Answer(200, delay=3))
    assert isinstance(sink.send([_record(1)]), Retry)


def test_peer_down_is_retry(tmp_path, make_sink, peer):
    sink = make_sink()
    peer.stop()
    assert isinstance(sink.send([_record(1)]), Retry)


def test_untrusted_certificate_is_retried_not_sent(peer, tmp_path, monkeypatch):
    monkeypatch.setenv("TEST_AI_CONN", peer.connection_string)
    monkeypatch.delenv("REQUESTS_CA_BUNDLE", raising=False)
    sink = AppInsightsSink({"connection_string_env": "TEST_AI_CONN"}, SinkContext("ai", tmp_path / "s"))
    try:
        assert isinstance(sink.send([_record(1)]), Retry)
    finally:
        sink.close()
    assert peer.requests == []


def test_nothing_written_to_the_temp_dir(peer, tmp_path, monkeypatch):
    """The SDK's offline storage defaults to the temp dir; the sink keeps it out of there."""
    fake_tmp = tmp_path / "tmp"
    fake_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(fake_tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    assert tempfile.gettempdir() == str(fake_tmp)
    monkeypatch.delenv("APPLICATIONINSIGHTS_SDKSTATS_DISABLED")  # with every SDK feature on
    monkeypatch.setenv("TEST_AI_CONN", peer.connection_string)
    state = tmp_path / "state" / "sinks" / "ai"
    sink = AppInsightsSink({"connection_string_env": "TEST_AI_CONN", "ca_file": str(peer.ca_file)},
                           SinkContext("ai", state))
    try:
        peer.queue(500, 503, 429)
        for _ in range(3):
            assert isinstance(sink.send([_record(1)]), Retry)
        assert sink.send([_record(1)]) == Ok()
    finally:
        sink.close()
    assert list(fake_tmp.iterdir()) == []
    assert not state.exists()  # the store is the only offline buffer


def test_the_sink_imports_no_opentelemetry_and_no_azure_sdk():
    script = ("import sys, sinks.appinsights; "
              "print([m for m in sys.modules if m.startswith(('opentelemetry', 'azure'))])")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_managed_identity_token_from_imds(tmp_path, monkeypatch):
    with Emulator(vms=["web-0"]) as emu, AppInsightsPeer(tmp_path, require_bearer=True) as peer:
        monkeypatch.setenv("AZURE_POD_IDENTITY_AUTHORITY_HOST", emu.url)
        monkeypatch.setenv("TEST_AI_CONN", peer.connection_string)
        sink = AppInsightsSink({"connection_string_env": "TEST_AI_CONN", "ca_file": str(peer.ca_file),
                                "credential": "managed_identity"}, SinkContext("ai", tmp_path / "s"))
        try:
            assert sink.send([_record(1)]) == Ok()
        finally:
            sink.close()
        assert emu.stats()["token_requests"] >= 1
        (request,) = peer.wait_for_requests(1)
        assert request.headers["authorization"].startswith("Bearer emulator-token.")
        assert len(peer.events()) == 1


def test_without_credential_an_entra_only_resource_is_retried(tmp_path, monkeypatch):
    with AppInsightsPeer(tmp_path, require_bearer=True) as strict:
        monkeypatch.setenv("TEST_AI_STRICT", strict.connection_string)
        sink = AppInsightsSink({"connection_string_env": "TEST_AI_STRICT", "ca_file": str(strict.ca_file)},
                               SinkContext("ai", tmp_path / "s"))
        try:
            assert isinstance(sink.send([_record(1)]), Retry)
        finally:
            sink.close()
        assert strict.events() == [] and strict.requests[0].status == 401


@pytest.mark.parametrize("options, fragment", [
    ({}, "connection_string_env or connection_string_file"),
    ({"connection_string_env": "NOPE_NOT_SET_XYZ"}, "NOPE_NOT_SET_XYZ"),
    ({"connection_string_env": "TEST_AI_CONN", "credential": "password"}, "credential must be one of"),
    ({"connection_string_env": "TEST_AI_CONN", "batch_size": 0}, "batch_size"),
    ({"connection_string_env": "TEST_AI_CONN", "timeout": "0s"}, "timeout"),
    ({"connection_string_env": "TEST_AI_CONN", "connection_string": "InstrumentationKey=x"}, "unknown option"),
    ({"connection_string_env": "TEST_AI_CONN", "ca_file": "/nonexistent/ca.pem"}, "ca_file"),
    ({"connection_string_env": "TEST_AI_BAD"}, "InstrumentationKey"),
    ({"connection_string_env": "TEST_AI_HTTP"}, "https://"),
])
def test_check_reports_problem(options, fragment, monkeypatch):
    monkeypatch.setenv("TEST_AI_CONN", "InstrumentationKey=00000000-0000-0000-0000-000000000000")
    monkeypatch.setenv("TEST_AI_BAD", "IngestionEndpoint=https://example.invalid/")
    monkeypatch.setenv("TEST_AI_HTTP", f"InstrumentationKey={IKEY};IngestionEndpoint=http://example.invalid/")
    problems = AppInsightsSink.check(options)
    assert any(fragment in p for p in problems), problems
    with pytest.raises(ValueError):
        AppInsightsSink(options, SinkContext("ai", Path("/nonexistent")))


def test_check_never_echoes_the_connection_string(tmp_path):
    path = tmp_path / "conn"
    path.write_text("IngestionEndpoint=https://secret-host.example/;Foo=bar\n")
    problems = AppInsightsSink.check({"connection_string_file": str(path)})
    assert problems and not any("secret-host" in p for p in problems)


def test_properties_do_not_clobber_attributes():
    props = event_properties({"id": "a", "type": "t", "data": {"id": "inner", "X": 1.5}})
    assert props == {"id": "a", "data.id": "inner", "X": "1.5"}


# -- the real agent ------------------------------------------------------------------------------

def test_agent_keeps_records_while_peer_is_down_then_delivers_once_in_order(tmp_path):
    peer = AppInsightsPeer(tmp_path).start()
    port = peer.port
    peer.stop()  # down from the start; comes back on the same port
    env = {**QUIET_SDK_ENV, "TEST_AI_CONN": f"InstrumentationKey={IKEY};IngestionEndpoint=https://127.0.0.1:{port}/"}
    sinks = (f'[[sinks]]\ntype = "appinsights"\nname = "ai"\nconnection_string_env = "TEST_AI_CONN"\n'
             f'ca_file = "{peer.ca_file}"\ntimeout = "2s"\n'
             f'[[sinks]]\ntype = "file"\nname = "file"\npath = "{tmp_path / "out.jsonl"}"\n')
    with Emulator(vms=["web-0"]) as emu:
        config = write_config(tmp_path / "c.toml", emu.url, tmp_path / "state", sinks=sinks,
                              extra='[delivery]\nretry_initial = "100ms"\nretry_max = "300ms"\n')
        agent = AgentProcess(config, tmp_path / "agent.log", env=env)
        try:
            first = emu.schedule(type="Reboot", resources=["web-0"], start_after=600)
            wait_until(lambda: any(r.get("subject") == first for r in read_jsonl(tmp_path / "out.jsonl")),
                       60, "the scheduled record in the file sink")
            emu.start_event(first)
            wait_until(lambda: sum(r.get("subject") == first for r in read_jsonl(tmp_path / "out.jsonl")) >= 2,
                       30, "the started record in the file sink")
            wait_until(lambda: "connection_error" in agent.logs(), 30, "a failed send")
            peer.start(port)
            # A bumpy recovery: an answer that comes after the sink gave up waiting (the service
            # took those events all the same), an outage answer, throttling with Retry-After.
            peer.queue(Answer(200, delay=4), 503, Answer(429, retry_after=0.2))
            expected = [r["id"] for r in read_jsonl(tmp_path / "out.jsonl")]
            wait_until(lambda: set(peer.event_ids()) >= set(expected) and any(r.delayed for r in peer.requests),
                       60, "every record in Application Insights")
        finally:
            assert agent.terminate() == 0
            peer.stop()
    late = {e["data"]["baseData"]["properties"]["id"] for r in peer.requests if r.delayed for e in r.envelopes}
    twice = {i for i, n in Counter(peer.event_ids()).items() if n > 1}
    assert twice <= late, "only the events of the answer that came too late arrive twice (at least once)"
    assert all(n <= 2 for n in Counter(peer.event_ids()).values())
    names = [e["data"]["baseData"]["name"] for e in peer.events()]
    assert "scheduledevent.scheduled" in names and "scheduledevent.started" in names
    assert {r.status for r in peer.requests} >= {503, 429, 200}
    assert "did not answer within 2s" in agent.logs()


def test_agent_retries_partial_failures_alone_and_dead_letters_a_refused_event(tmp_path):
    """206: the accepted events once, the retryable failures again alone, the refused one to dead letters."""
    failed_once: set[str] = set()

    def item_rule(envelope):
        props = envelope["data"]["baseData"]["properties"]
        if props.get("EventType") == "Freeze":
            return 400  # e.g. a field the service will never take: refused for good
        if props.get("EventType") == "Redeploy" and props["id"] not in failed_once:
            failed_once.add(props["id"])
            return 500  # a transient failure of this item only
        return None

    with Emulator(vms=["web-0"]) as emu, AppInsightsPeer(tmp_path) as peer:
        peer.item_rule = item_rule
        env = {**QUIET_SDK_ENV, "TEST_AI_CONN": peer.connection_string}
        sinks = (f'[[sinks]]\ntype = "appinsights"\nname = "ai"\nconnection_string_env = "TEST_AI_CONN"\n'
                 f'ca_file = "{peer.ca_file}"\ntimeout = "5s"\n'
                 f'[[sinks]]\ntype = "file"\nname = "file"\npath = "{tmp_path / "out.jsonl"}"\n')
        config = write_config(tmp_path / "c.toml", emu.url, tmp_path / "state", sinks=sinks,
                              extra='[delivery]\nretry_initial = "100ms"\nretry_max = "300ms"\n')
        agent = AgentProcess(config, tmp_path / "agent.log", env=env)
        try:
            kinds = {"Reboot": emu.schedule(type="Reboot", resources=["web-0"], start_after=600),
                     "Freeze": emu.schedule(type="Freeze", resources=["web-0"], start_after=600),
                     "Redeploy": emu.schedule(type="Redeploy", resources=["web-0"], start_after=600)}
            wait_until(lambda: {r.get("subject") for r in read_jsonl(tmp_path / "out.jsonl")} >= set(kinds.values()),
                       60, "the three scheduled records in the file sink")
            records = {r["id"]: r for r in read_jsonl(tmp_path / "out.jsonl")}
            refused = {i for i, r in records.items() if r.get("subject") == kinds["Freeze"]}
            wait_until(lambda: set(peer.event_ids()) >= set(records) - refused, 60, "every other record accepted")
            wait_until(lambda: {d["record"]["id"] for d in dead_letters(config, "ai", env)} >= refused, 30,
                       "the refused record in dead letters")
        finally:
            assert agent.terminate() == 0
    dead = dead_letters(config, "ai", env)
    assert {d["record"]["id"] for d in dead} == refused
    assert all(d["reason"] == "item_400" for d in dead)
    accepted = Counter(peer.event_ids())
    assert all(n == 1 for n in accepted.values()), "accepted events never go again"
    assert not refused & set(accepted)
    sent = Counter(peer.sent_ids())
    assert all(sent[i] == 1 for i in refused), "a refused event is not retried"
    assert failed_once and all(sent[i] == 2 for i in failed_once), "a failed item goes once more"


def _ai_agent(tmp_path: Path, emu: Emulator, peer: AppInsightsPeer, *, max_age: str = "1h") -> tuple[AgentProcess, Path, dict[str, str]]:
    """The real agent with the appinsights sink (``max_age`` long: only the sink's answer may dead-letter) and a file sink."""
    env = {**QUIET_SDK_ENV, "TEST_AI_CONN": peer.connection_string}
    sinks = (f'[[sinks]]\ntype = "appinsights"\nname = "ai"\nconnection_string_env = "TEST_AI_CONN"\n'
             f'ca_file = "{peer.ca_file}"\ntimeout = "5s"\nmax_age = "{max_age}"\n'
             f'[[sinks]]\ntype = "file"\nname = "file"\npath = "{tmp_path / "out.jsonl"}"\n')
    config = write_config(tmp_path / "c.toml", emu.url, tmp_path / "state", sinks=sinks,
                          extra='[delivery]\nretry_initial = "100ms"\nretry_max = "300ms"\n')
    return AgentProcess(config, tmp_path / "agent.log", env=env), config, env


def test_agent_splits_a_request_the_service_finds_too_large_and_delivers_every_record(tmp_path):
    """413 at agent level: a batch over the peer's size limit is split until each part fits; all arrive, once."""
    with Emulator(vms=["web-0"]) as emu, AppInsightsPeer(tmp_path) as peer:
        peer.max_body = 3_000  # one gzip'd event with a 2,000-character random description is ~1.5 KB
        # Four events in the first document: their records are committed together, so the
        # dispatcher hands them to the sink as one batch.
        ids = [emu.schedule(type="Reboot", resources=["web-0"], start_after=600, description=os.urandom(1000).hex())
               for _ in range(4)]
        agent, config, env = _ai_agent(tmp_path, emu, peer)
        try:
            wait_until(lambda: {r.get("subject") for r in read_jsonl(tmp_path / "out.jsonl")} >= set(ids), 60,
                       "the four scheduled records in the file sink")
            expected = {r["id"] for r in read_jsonl(tmp_path / "out.jsonl")}
            wait_until(lambda: set(peer.event_ids()) >= expected, 60, "every record in Application Insights")
            later = emu.schedule(type="Freeze", resources=["web-0"], start_after=600)  # and the sink goes on
            wait_until(lambda: any(r.get("subject") == later for r in read_jsonl(tmp_path / "out.jsonl")), 60,
                       "the later record in the file sink")
            expected = {r["id"] for r in read_jsonl(tmp_path / "out.jsonl")}
            wait_until(lambda: set(peer.event_ids()) >= expected, 60, "the later record in Application Insights")
        finally:
            assert agent.terminate() == 0
    too_large = [r for r in peer.requests if r.status == 413]
    assert too_large and all(len(r.envelopes) > 1 for r in too_large), "only multi-event requests were too large"
    big = {e["data"]["baseData"]["properties"]["id"] for r in too_large for e in r.envelopes}
    assert {e["data"]["baseData"]["properties"]["subject"] for r in too_large for e in r.envelopes} & set(ids)
    assert all(n == 1 for n in Counter(peer.event_ids()).values()), "each event accepted once"
    assert big <= set(peer.event_ids())
    assert dead_letters(config, "ai", env) == []
    assert "413 for" in agent.logs() and "sending them in two halves" in agent.logs()


@pytest.mark.parametrize("itemized", [True, False], ids=["400_with_item_errors", "400_without_item_errors"])
def test_agent_dead_letters_a_request_refused_for_good_and_the_rest_keeps_flowing(tmp_path, itemized):
    """A whole-request 400 at agent level: the refused record goes to dead letters at once (not retried until
    max_age), visible in `sefwd deadletter list`; records before and after it are delivered."""
    def is_bad(envelope):
        return envelope["data"]["baseData"]["properties"].get("EventType") == "Freeze"

    def request_rule(envelopes):
        # Without item errors (a gateway in front, or a body refused as a whole), whenever the bad
        # event is in the request: the sink must find it by sending the request's events alone.
        return Answer(400, itemized=False) if any(is_bad(e) for e in envelopes) else None

    with Emulator(vms=["web-0"]) as emu, AppInsightsPeer(tmp_path) as peer:
        # The service's own check: an invalid item is refused with 400; a request whose every item
        # is refused is answered 400 as a whole, each item listed with its error.
        peer.item_rule = lambda envelope: 400 if is_bad(envelope) else None
        if not itemized:
            peer.request_rule = request_rule
        agent, config, env = _ai_agent(tmp_path, emu, peer, max_age="1h")
        out = tmp_path / "out.jsonl"
        try:
            before = emu.schedule(type="Reboot", resources=["web-0"], start_after=600)
            wait_until(lambda: {r["id"] for r in read_jsonl(out) if r.get("subject") == before} & set(peer.event_ids()),
                       60, "the first record in Application Insights")
            if itemized:  # alone in its request: the service answers 400 to the whole request
                bad = emu.schedule(type="Freeze", resources=["web-0"], start_after=600)
            else:  # with a good one in the same document (the emulator's lock held), so in one request
                with emu.platform.lock:
                    bad = emu.schedule(type="Freeze", resources=["web-0"], start_after=600)
                    emu.schedule(type="Redeploy", resources=["web-0"], start_after=600)
            wait_until(lambda: any(r.get("subject") == bad for r in read_jsonl(out)), 60, "the bad record in the file sink")
            refused = {r["id"] for r in read_jsonl(out) if r.get("subject") == bad}
            wait_until(lambda: {d["record"]["id"] for d in dead_letters(config, "ai", env)} >= refused, 30,
                       "the refused record in dead letters")
            after = emu.schedule(type="Reboot", resources=["web-0"], start_after=600)  # the sink goes on
            wait_until(lambda: any(r.get("subject") == after for r in read_jsonl(out)), 60, "the last record in the file sink")
            expected = {r["id"] for r in read_jsonl(out)} - refused
            wait_until(lambda: set(peer.event_ids()) >= expected, 60, "every other record in Application Insights")
            sent_when_dead = Counter(peer.sent_ids())
        finally:
            assert agent.terminate() == 0
    dead = dead_letters(config, "ai", env)
    assert {d["record"]["id"] for d in dead} == refused
    assert all(d["reason"] == ("item_400" if itemized else "http_400") for d in dead), dead
    refusals = [r for r in peer.requests if r.status == 400]
    ids_in = lambda r: {e["data"]["baseData"]["properties"]["id"] for e in r.envelopes}  # noqa: E731
    if itemized:
        assert [ids_in(r) for r in refusals] == [refused]  # the whole request refused, once
    else:
        assert [len(r.envelopes) for r in refusals] == [2, 1]  # the request, then the bad event alone
        assert all(refused <= ids_in(r) for r in refusals)
    sent = Counter(peer.sent_ids())
    # Not retried until max_age: sent once (twice when the answer named no item), never after.
    assert all(sent[i] == (1 if itemized else 2) for i in refused), sent
    assert all(sent[i] == sent_when_dead[i] for i in refused)
    accepted = Counter(peer.event_ids())
    assert not refused & set(accepted)
    assert all(n == 1 for n in accepted.values()), "accepted events never go again"
    assert "refused" in agent.logs() and "max_age_exceeded" not in agent.logs()
