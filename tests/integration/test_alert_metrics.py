"""Alertable metrics: pending events, seconds to NotBefore, maintenance, actions — fixed series under churn."""
from __future__ import annotations

import json
import re
import socket
import urllib.request
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

pytest.importorskip("opentelemetry.exporter.prometheus")

from forwarder.agent.alert_metrics import MAX_LABEL_VALUES, BoundedLabel  # noqa: E402
from forwarder.agent.config import TelemetryConfig  # noqa: E402
from forwarder.agent.telemetry import NO_TELEMETRY, Telemetry  # noqa: E402
from tests.agent import AgentProcess, wait_until, write_config  # noqa: E402
from tests.peers.http_peer import HttpPeer, Response  # noqa: E402

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")
# (a future type too: it must pass through and count as "other", never as a series of its own)
TYPES = ("Reboot", "Redeploy", "Freeze", "Preempt", "Terminate", "SpotRebalanceRecommendation", "HostUpgrade2031")


def scrape(base: str) -> dict[str, float]:
    with urllib.request.urlopen(base + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return {m[1] + (m[2] or ""): float(m[3]) for line in text.splitlines()
            if not line.startswith("#") and (m := _SAMPLE.match(line))}


def family(samples: dict[str, float], name: str) -> dict[str, float]:
    return {k: v for k, v in samples.items() if k == name or k.startswith(name + "{")}


def document(incarnation: int, events: list[dict]) -> Response:
    return Response(200, {"Content-Type": "application/json"},
                    json.dumps({"DocumentIncarnation": incarnation, "Events": events}).encode())


def events(round_no: int, count: int, me: str) -> list[dict]:
    """``count`` fresh events: every type and status, on this VM and on another one, NotBefore 1 h on."""
    not_before = (datetime.now(timezone.utc) + timedelta(hours=1)).strftime("%a, %d %b %Y %H:%M:%S GMT")
    return [{"EventId": str(uuid.uuid4()).upper(), "EventType": TYPES[i % len(TYPES)], "ResourceType": "VirtualMachine",
             "Resources": [me] if i % 3 else ["other-vm"],
             "EventStatus": "Started" if i % 7 == 0 else "Scheduled",
             "NotBefore": "" if i % 7 == 0 else not_before, "Description": f"round {round_no}",
             "EventSource": "Platform", "DurationInSeconds": -1} for i in range(count)]


def incarnation_seen(state_file: Path) -> int | None:
    """The DocumentIncarnation the agent's maintenance state (and so its gauges) last took."""
    try:
        return json.loads(state_file.read_text())["DocumentIncarnation"]
    except (OSError, ValueError):
        return None


# Families whose label values come from a closed set but appear only when something happens
# (IMDS errors by HTTP status on a loaded machine): bounded, not necessarily in the first round.
_OCCASIONAL = ("sefwd_imds_errors_total{",)
NOTICE_COUNT = "sefwd_event_notice_lead_seconds_count"  # one series per event type (6 known + other)


def _with_notice_lead(samples: dict[str, float]) -> dict[str, float] | None:
    """The scrape, once the notice-lead histogram has its series for every type."""
    return samples if len(family(samples, NOTICE_COUNT)) == 7 else None


@pytest.mark.slow  # 10,000 events of churn
def test_series_stay_fixed_while_10000_events_come_and_go(tmp_path):
    """A real agent reads 20 documents of 500 fresh events each (every type and status, this VM and
    another; each document drops the previous one's events): 10,000 events come and go. Every scrape's
    series are among those seen while one warm-up document came and went, no label carries an EventId,
    and the pending gauge always has its 42 series."""
    me = socket.gethostname()
    state_file = tmp_path / "maintenance.json"
    with HttpPeer(default=document(1, [])) as peer:
        config = write_config(tmp_path / "c.toml", peer.url, tmp_path / "state", poll_interval="500ms",
                              sinks='[[sinks]]\ntype = "file"\nname = "file"\npath = "/dev/null"\n',
                              extra='[telemetry]\nlisten = "127.0.0.1:0"\n[journal]\nfsync = false\n'
                                    f'[probe]\nevent_types = ["*"]\nstate_file = "{state_file}"\n')
        config.write_text(config.read_text().replace('log_level = "debug"', 'log_level = "info"'))
        agent = AgentProcess(config, tmp_path / "agent.log")
        try:
            base = wait_until(lambda: re.search(r"/metrics and /healthz on (http://\S+)", agent.logs()), 30,
                              "the telemetry endpoint")[1]
            incarnation = 1
            # The empty document first: events on the agent's first poll are `Initial` (it was not there to
            # be notified) and give no notice lead, so round 0 must not be that poll (a race under load).
            wait_until(lambda: incarnation_seen(state_file) == incarnation, 60, "the first, empty document")
            seen_ids: set[str] = set()
            warm: set[str] = set()
            plan = [("warm", 500), ("warm", 0)] + [("churn", 500)] * 20 + [("churn", 0)]
            for round_no, (phase, count) in enumerate(plan):
                batch = events(round_no, count, me)
                seen_ids.update(e["EventId"] for e in batch)
                incarnation += 1
                peer.default = document(incarnation, batch)
                wait_until(lambda: incarnation_seen(state_file) == incarnation, 60, f"round {round_no}: document seen")
                # The probe's state file is written as the document commits; the records' histograms
                # (notice lead) are fed just after, on the append: scrape until they are there too.
                samples = wait_until(lambda: _with_notice_lead(scrape(base)), 30,
                                     f"round {round_no}: the notice-lead histograms")
                pending = family(samples, "sefwd_events_pending")
                assert sum(pending.values()) == count
                assert len(pending) == 42  # (7 types × 3 statuses × 2 scopes)
                if count:
                    assert pending['sefwd_events_pending{affects_this_vm="true",status="Started",type="Reboot"}'] > 0
                    assert pending['sefwd_events_pending{affects_this_vm="false",status="Scheduled",type="Freeze"}'] > 0
                    assert 3000 < samples["sefwd_events_seconds_to_notbefore"] <= 3600
                    assert samples["sefwd_maintenance_active"] == 1
                else:
                    assert "sefwd_events_seconds_to_notbefore" not in samples
                keys = set(samples)
                if phase == "warm":
                    warm |= keys
                else:
                    extra = {k for k in keys - warm if not k.startswith(_OCCASIONAL)}
                    assert not extra, extra
                # The notice-window histograms (docs/notice-window.md) are among the fixed series.
                assert len(family(samples, NOTICE_COUNT)) == 7  # 6 known types + other
                labels = " ".join(keys)
                assert not any(e["EventId"] in labels for e in batch)
            assert len(seen_ids) == 10_500
            assert samples["sefwd_maintenance_active"] == 1  # the last events settle (30 s by default)
            assert agent.alive()
        finally:
            assert agent.terminate() == 0


def test_actions_counted_by_kind_and_outcome_with_bounded_values(tmp_path):
    telemetry = Telemetry(TelemetryConfig(listen=("127.0.0.1", 0)), tmp_path)
    telemetry.start()
    try:
        telemetry.action_finished("hook", "done")
        telemetry.action_finished("hook", "done")
        telemetry.action_finished("approve", "superseded")
        for i in range(100):  # a caller passing unbounded values must not grow the series
            telemetry.action_finished(f"kind_{i}", f"EVENT-{i}-6E2F1C8A")
        telemetry.action_finished("Bad Value!", "failed")
        samples = scrape(telemetry.url or "")
    finally:
        telemetry.stop()
    actions = family(samples, "sefwd_actions_total")
    assert actions['sefwd_actions_total{kind="hook",outcome="done"}'] == 2
    assert actions['sefwd_actions_total{kind="approve",outcome="superseded"}'] == 1
    kinds = {re.search(r'kind="([^"]*)"', k)[1] for k in actions}
    outcomes = {re.search(r'outcome="([^"]*)"', k)[1] for k in actions}
    assert len(kinds) <= MAX_LABEL_VALUES + 1 and "other" in kinds
    assert len(outcomes) <= MAX_LABEL_VALUES + 1
    assert sum(actions.values()) == 104
    NO_TELEMETRY.action_finished("hook", "done")  # the no-op telemetry has the same method


def test_bounded_label():
    label = BoundedLabel(limit=2)
    assert [label(v) for v in ("a", "B", "c", "a", "-x", None, "x" * 40)] == ["a", "b", "other", "a", "other",
                                                                                  "other", "other"]
