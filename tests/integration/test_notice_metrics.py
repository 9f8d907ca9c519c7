"""Metrics against the notice window: notice lead and approval lead per type, on /metrics and in Azure Monitor."""
from __future__ import annotations

import re
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import orjson
import pytest

pytest.importorskip("opentelemetry.exporter.prometheus")

from forwarder.agent.config import TelemetryConfig  # noqa: E402
from forwarder.agent.notice_metrics import LEAD_BUCKETS, TYPE_LABELS  # noqa: E402
from forwarder.agent.telemetry import Telemetry  # noqa: E402
from forwarder.records import rfc3339  # noqa: E402
from forwarder.sinkapi import Record  # noqa: E402
from benchmarks.peers.appinsights_peer import IKEY, AppInsightsPeer  # noqa: E402
from tests.agent import wait_until  # noqa: E402
from tests.integration.test_alert_metrics import scrape  # noqa: E402

pytestmark = pytest.mark.timeout(120)

TYPES = ("Reboot", "Redeploy", "Freeze", "Preempt", "Terminate", "SpotRebalanceRecommendation", "HostUpgrade2031")
T0 = datetime(2026, 11, 27, 12, 0, tzinfo=timezone.utc)
NOTICE = {"Reboot": 900, "Redeploy": 600, "Freeze": 900, "Preempt": 30, "Terminate": 300,
          "SpotRebalanceRecommendation": 45, "HostUpgrade2031": 3600}


def family(samples: dict[str, float], name: str) -> dict[str, float]:
    """Every sample of a histogram: its _bucket, _count and _sum series."""
    return {k: v for k, v in samples.items() if k.startswith(name)}


def record(kind: str, data: dict, when: datetime) -> Record:
    body = {"id": str(uuid.uuid4()), "type": kind, "time": rfc3339(when), "data": data}
    return Record(id=body["id"], type=kind, body=orjson.dumps(body))


def batch(n: int, start: int) -> list[Record]:
    """``n`` events of every type (a future one included), each scheduled, then approved half-way through its notice."""
    out = []
    for i in range(start, start + n):
        etype = TYPES[i % len(TYPES)]
        seen = T0 + timedelta(seconds=i)
        not_before = seen + timedelta(seconds=NOTICE[etype])
        event_id = f"E-{i}"
        out.append(record("scheduledevent.scheduled", {"EventId": event_id, "EventType": etype,
                                                       "NotBefore": rfc3339(not_before), "Change": "scheduled"}, seen))
        if i % 2 == 0:
            approved = seen + timedelta(seconds=NOTICE[etype] / 2)
            out.append(record("approval.approved", {"EventIds": [event_id], "Outcome": "approved"}, approved))
    return out


def test_series_stay_fixed_over_10000_events_and_leads_land_in_their_buckets(tmp_path: Path) -> None:
    telemetry = Telemetry(TelemetryConfig(listen=("127.0.0.1", 0)), tmp_path)
    telemetry.start()
    try:
        telemetry.observe_append(batch(1000, 0))
        base = telemetry.url or ""
        first = scrape(base)
        for start in range(1000, 10_000, 1000):  # (the outbox's commits: a batch at a time)
            telemetry.observe_append(batch(1000, start))
        last = scrape(base)
        # A record set aside before it became one (bad body) costs nothing and breaks nothing.
        telemetry.observe_append([Record("x", "scheduledevent.scheduled", b"not json")])
        assert scrape(base).keys() == last.keys()
    finally:
        telemetry.stop()
    lead = family(last, "sefwd_event_notice_lead_seconds")
    approval = family(last, "sefwd_approval_lead_seconds")
    assert family(first, "sefwd_event_notice_lead_seconds").keys() == lead.keys()  # fixed series
    assert family(first, "sefwd_approval_lead_seconds").keys() == approval.keys()
    per_type = len(LEAD_BUCKETS) + 1 + 2  # buckets, +Inf, _count, _sum
    assert len(lead) == len(approval) == (len(TYPE_LABELS)) * per_type
    types = {re.search(r'type="([^"]*)"', k)[1] for k in lead}
    assert types == set(TYPE_LABELS)  # the future type is "other", never its own series
    assert not any("E-" in k for k in lead)
    assert sum(v for k, v in lead.items() if "_count{" in k) == 10_000
    assert lead['sefwd_event_notice_lead_seconds_count{type="Preempt"}'] == 10_000 // 7 + (1 if 10_000 % 7 > 3 else 0)
    # A Preempt's 30 s lands in le=30 and not in le=10; its approval, 15 s before NotBefore, in le=30 too.
    assert lead['sefwd_event_notice_lead_seconds_bucket{le="30.0",type="Preempt"}'] == \
        lead['sefwd_event_notice_lead_seconds_count{type="Preempt"}']
    assert lead['sefwd_event_notice_lead_seconds_bucket{le="10.0",type="Preempt"}'] == 0
    assert approval['sefwd_approval_lead_seconds_bucket{le="10.0",type="Preempt"}'] == 0
    assert approval['sefwd_approval_lead_seconds_bucket{le="30.0",type="Preempt"}'] == \
        approval['sefwd_approval_lead_seconds_count{type="Preempt"}'] > 0
    assert lead['sefwd_event_notice_lead_seconds_sum{type="SpotRebalanceRecommendation"}'] == \
        45 * lead['sefwd_event_notice_lead_seconds_count{type="SpotRebalanceRecommendation"}']
    assert lead['sefwd_event_notice_lead_seconds_sum{type="other"}'] == \
        3600 * lead['sefwd_event_notice_lead_seconds_count{type="other"}']


def test_the_leads_reach_azure_monitor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with AppInsightsPeer(tmp_path) as peer:
        monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(peer.ca_file))
        for name in ("APPLICATIONINSIGHTS_STATSBEAT_DISABLED_ALL", "APPLICATIONINSIGHTS_SDKSTATS_DISABLED"):
            monkeypatch.setenv(name, "true")
        monkeypatch.setenv("TEST_NOTICE_CONN", f"InstrumentationKey={IKEY};IngestionEndpoint=https://127.0.0.1:{peer.port}/")
        telemetry = Telemetry(TelemetryConfig(connection_string_env="TEST_NOTICE_CONN", export_interval=1.0), tmp_path)
        telemetry.start()
        try:
            telemetry.observe_append(batch(14, 0))

            def leads() -> dict[str, dict]:
                return {m["name"]: m for e in list(peer.envelopes) if e["data"]["baseType"] == "MetricData"
                        for m in e["data"]["baseData"]["metrics"] if m["name"].endswith(".lead")
                        or m["name"] == "sefwd.event.notice_lead"}
            found = wait_until(lambda: {"sefwd.event.notice_lead", "sefwd.approval.lead"} <= leads().keys() and leads(),
                               60, "the lead histograms in Azure Monitor")
        finally:
            telemetry.stop()
    assert found["sefwd.event.notice_lead"]["count"] >= 1
    assert 0 < found["sefwd.approval.lead"]["value"]


def test_an_event_is_remembered_only_while_it_lasts() -> None:
    """A long-running agent holds the NotBefore of the events in the document now, not of every event it saw."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from forwarder.agent.notice_metrics import NoticeWindow

    reader = InMemoryMetricReader()
    window = NoticeWindow(MeterProvider(metric_readers=[reader]).get_meter("test"))
    ends = ("scheduledevent.completed", "scheduledevent.canceled", "scheduledevent.ended")
    for start in range(0, 3000, 300):
        window.observe(batch(300, start))
        assert window.remembered == 300  # the batch's events, each still Scheduled
        window.observe([record(ends[i % 3], {"EventId": f"E-{i}", "Change": ends[i % 3].split(".")[1]},
                               T0 + timedelta(seconds=i + 1)) for i in range(start, start + 300)])
        assert window.remembered == 0
    # An approval after its event ended has no NotBefore left: no lead is made up for it.
    window.observe([record("approval.approved", {"EventIds": ["E-2"], "Outcome": "approved"}, T0)])
    points = {m.name: sum(p.count for p in m.data.data_points)
              for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    assert points == {"sefwd.event.notice_lead": 3000, "sefwd.approval.lead": 1500}
