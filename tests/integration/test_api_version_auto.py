"""``api_version = "auto"``: 2024-07-09 where the emulator serves it, 2020-07-01 where it answers 404; SpotRebalanceRecommendation."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from forwarder.agent.config import load_config
from forwarder.delivery.filters import parse_filter
from forwarder.emulator import Emulator
from forwarder.emulator.model import GA_SE_VERSION
from forwarder.imds.client import ImdsClient
from forwarder.imds.differ import diff
from forwarder.imds.document import parse_document
from forwarder.imds.identity import VmIdentity
from forwarder.imds.versions import FALLBACK, NEWEST
from forwarder.records import RecordFactory, utcnow
from forwarder.sinkapi import Record
from sinks.notify_messages import MessageRenderer
from tests.peers.http_peer import HttpPeer, Response
from tests.agent import AgentProcess, read_jsonl, wait_until, write_config

pytestmark = pytest.mark.timeout(60)


class Clock:
    """A monotonic clock the test moves (only the version choice and retry budgets read it)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def se_requests(emu: Emulator) -> dict[str, int]:
    by_status = emu.stats()["requests"][emu.default_vm]["by_status"]
    return {k: v for k, v in by_status.items()}


def test_auto_uses_2024_07_09_where_it_is_served(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "forwarder.imds.versions")
    with Emulator() as emu, ImdsClient(emu.url, "auto") as client:
        event_id = emu.schedule(type="SpotRebalanceRecommendation")
        fetch = client.scheduled_events()
        assert fetch.status == 200 and client.api_version == NEWEST
        assert f"api-version={NEWEST}" in client.events_url
        (event,) = parse_document(fetch.body or b"").events
        assert (event.event_id, event.event_type) == (event_id, "SpotRebalanceRecommendation")
        client.scheduled_events()
        assert se_requests(emu) == {"200": 2}  # no probing once settled
    assert [r.getMessage() for r in caplog.records] == [f"IMDS api-version auto: using {NEWEST}"]


def test_auto_falls_back_on_404_and_reprobes_now_and_then(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "forwarder.imds.versions")
    clock = Clock()
    with Emulator(max_api_version=GA_SE_VERSION) as emu, \
            ImdsClient(emu.url, "auto", clock=clock, reprobe=3600.0) as client:
        emu.schedule(type="SpotRebalanceRecommendation")  # not visible at 2020-07-01
        reboot = emu.schedule(type="Reboot")
        fetch = client.scheduled_events()
        assert fetch.status == 200 and client.api_version == FALLBACK
        assert [e.event_id for e in parse_document(fetch.body or b"").events] == [reboot]
        assert se_requests(emu) == {"404": 1, "200": 1}
        for _ in range(3):  # settled: no 404 on every poll
            client.scheduled_events()
        assert se_requests(emu) == {"404": 1, "200": 4}
        clock.now += 3601  # the re-probe is due: one more 404, still 2020-07-01
        assert client.scheduled_events().status == 200 and client.api_version == FALLBACK
        assert se_requests(emu) == {"404": 2, "200": 5}
        emu.max_api_version = NEWEST  # the VM now gets the preview: the next re-probe moves up
        clock.now += 3601
        fetch = client.scheduled_events()
        assert client.api_version == NEWEST and len(parse_document(fetch.body or b"").events) == 2
        assert se_requests(emu) == {"404": 2, "200": 6}
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0].startswith(f"IMDS api-version auto: {NEWEST} answered 404 (not available here); using {FALLBACK}")
    assert f"IMDS api-version auto: using {FALLBACK}" in messages
    assert messages[-1] == f"IMDS api-version auto: using {NEWEST}"
    assert sum("answered 404" in m for m in messages) == 1  # the re-probes' fallbacks are debug, not noise


def test_auto_falls_back_on_400_too() -> None:
    """An IMDS that does not know 2024-07-09 at all answers 400 ("api-version is invalid")."""
    doc = b'{"DocumentIncarnation":1,"Events":[]}'
    with HttpPeer(default=Response(200, body=doc)) as peer, ImdsClient(peer.url, "auto") as client:
        peer.queue(Response(400, body={"error": "Bad request. api-version is invalid."}))
        assert client.scheduled_events().status == 200 and client.api_version == FALLBACK
        assert [r.query["api-version"] for r in peer.requests] == [[NEWEST], [FALLBACK]]


def test_pinned_version_never_falls_back() -> None:
    with Emulator(max_api_version=GA_SE_VERSION) as emu, ImdsClient(emu.url, NEWEST) as client:
        from forwarder.errors import ImdsError

        with pytest.raises(ImdsError) as err:
            client.scheduled_events()
        assert err.value.status == 404 and client.api_version == NEWEST


def test_auto_approval_before_any_poll_falls_back() -> None:
    with Emulator(max_api_version=GA_SE_VERSION) as emu, ImdsClient(emu.url, "auto") as client:
        event_id = emu.schedule(type="Reboot")
        client.start_requests([event_id])
        assert client.api_version == FALLBACK
        assert emu.document(GA_SE_VERSION)["Events"][0]["EventStatus"] == "Started"


def test_auto_approval_read_falls_back_and_settles() -> None:
    """The approval's retried read: a 404 is no transient answer, it means the older version at once."""
    with Emulator(max_api_version=GA_SE_VERSION) as emu, ImdsClient(emu.url, "auto") as client:
        event_id = emu.schedule(type="Reboot")
        fetch = client.read_scheduled_events()
        assert fetch.status == 200 and [e.event_id for e in parse_document(fetch.body or b"").events] == [event_id]
        assert client.api_version == FALLBACK and se_requests(emu) == {"404": 1, "200": 1}


def test_config_accepts_auto_and_2024_07_09_and_names_the_choices(tmp_path: Path) -> None:
    from forwarder.errors import ConfigError

    for value in ("auto", NEWEST, FALLBACK):
        path = tmp_path / "c.toml"
        path.write_text(f'[imds]\napi_version = "{value}"\n')
        assert load_config(path).imds.api_version == value
    path.write_text('[imds]\napi_version = "2024-07-10"\n')
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "auto" in str(err.value) and NEWEST in str(err.value)


def _record(document: bytes) -> list[Record]:
    doc = parse_document(document)
    return RecordFactory(VmIdentity(name="vm-1"), NEWEST).for_changes(diff(None, doc, utcnow()), doc)


def test_spot_rebalance_is_a_known_type_and_future_types_pass_through() -> None:
    body = (b'{"DocumentIncarnation":2,"Events":['
            b'{"EventId":"A","EventStatus":"Scheduled","EventType":"SpotRebalanceRecommendation","ResourceType":'
            b'"VirtualMachine","Resources":["vm-1"],"NotBefore":"","Description":"","EventSource":"Platform",'
            b'"DurationInSeconds":-1},'
            b'{"EventId":"B","EventStatus":"Scheduled","EventType":"HostUpgrade2030","ResourceType":"VirtualMachine",'
            b'"Resources":["vm-1"],"NotBefore":"","Description":"x","EventSource":"Platform","DurationInSeconds":-1}]}')
    spot, future = _record(body)
    import orjson

    assert orjson.loads(spot.body)["data"]["EventType"] == "SpotRebalanceRecommendation"
    assert orjson.loads(future.body)["data"]["EventType"] == "HostUpgrade2030"  # unharmed
    only_spot, problems = parse_filter({"event_types": ["SpotRebalanceRecommendation"]}, "sinks[0].filter")
    assert problems == [] and only_spot is not None
    assert only_spot.reason(spot) is None and only_spot.reason(future) == "event_type"
    anything, problems = parse_filter({"changes": ["scheduled"]}, "sinks[0].filter")
    assert problems == [] and anything is not None and anything.reason(future) is None
    renderer = MessageRenderer(None)
    message = renderer.render(orjson.loads(spot.body))
    assert "Spot eviction risk" in message.title and "advisory" in message.body and "no effect" in message.body
    assert "HostUpgrade2030" in renderer.render(orjson.loads(future.body)).title


def test_probe_and_rules_accept_spot_rebalance(tmp_path: Path) -> None:
    from forwarder.agent.maintenance import pending_counts

    path = tmp_path / "c.toml"
    path.write_text('[probe]\nlisten = "127.0.0.1:0"\nevent_types = ["Preempt", "SpotRebalanceRecommendation"]\n'
                    '[[approval.rules]]\nname = "spot"\nevent_type = "SpotRebalanceRecommendation"\naction = "approve"\n')
    config = load_config(path)
    assert config.probe.event_types == ("Preempt", "SpotRebalanceRecommendation")
    doc = parse_document(b'{"DocumentIncarnation":1,"Events":[{"EventId":"A","EventStatus":"Scheduled",'
                         b'"EventType":"SpotRebalanceRecommendation","ResourceType":"VirtualMachine","Resources":["vm-1"],'
                         b'"NotBefore":""},{"EventId":"B","EventStatus":"Scheduled","EventType":"Future",'
                         b'"ResourceType":"VirtualMachine","Resources":["vm-1"],"NotBefore":""}]}')
    counts = pending_counts(doc, VmIdentity(name="vm-1"))
    assert counts[("SpotRebalanceRecommendation", "Scheduled", "true")] == 1
    assert counts[("other", "Scheduled", "true")] == 1  # bounded labels: a future type is "other"


def test_agent_with_auto_says_which_version_in_its_records(tmp_path: Path) -> None:
    """The real agent against an emulator that answers 404 to 2024-07-09: records say 2020-07-01."""
    with Emulator(max_api_version=GA_SE_VERSION) as emu:
        emu.schedule(type="Reboot")
        config = write_config(tmp_path / "c.toml", emu.url, tmp_path / "state")
        agent = AgentProcess(config, tmp_path / "agent.log")
        try:
            out = tmp_path / "out.jsonl"
            records = wait_until(lambda: [r for r in read_jsonl(out) if r["type"] == "scheduledevent.scheduled"],
                                 30, "the scheduled record")
            assert records[0]["data"]["ApiVersion"] == FALLBACK
            assert f"using {FALLBACK}" in agent.logs()
        finally:
            assert agent.terminate() == 0
