"""Latencies against the notice window, read from the agent's own histograms on ``/metrics``.

One `sefwd run` (file sink, ``[telemetry] listen``) polls the emulator at the default 1 s while the
benchmark schedules events of every type. Reported:

* detection latency: the record's ``time`` (when the agent first saw the event) minus the emulator's
  publish time (its history entry), per event — the platform's ``eventTime`` plays that part in
  production, on the fleet side. p50/p99 from the samples, and from a histogram with the agent's
  delivery buckets (what a histogram-based dashboard would say);
* delivery latency: ``sefwd.sink.delivery.latency`` {sink} (record time → the sink acknowledged),
  p50/p99 estimated from the histogram's buckets as Prometheus' ``histogram_quantile`` does;
* notice lead: ``sefwd.event.notice_lead`` {type}, its count per type and the p50 (a check that the
  lead is what the emulator gave).
"""
from __future__ import annotations

import random
import re
import statistics
import time
import urllib.request
from datetime import datetime
from typing import Any

import orjson

from benchmarks.agents import spawn_agent, stop_agents
from benchmarks.common import Sizes, goal, result, scratch_dir
from forwarder.emulator import Emulator

PLANS = {"full": 60, "quick": 20, "smoke": 4}
TYPES = ("Reboot", "Redeploy", "Freeze", "Preempt", "Terminate", "SpotRebalanceRecommendation")
START_TIMEOUT_S = 60.0
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")
# The agent's delivery buckets (forwarder.agent.telemetry.DELIVERY_BUCKETS), to bin detection the same way.
BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return {m[1] + (m[2] or ""): float(m[3]) for line in text.splitlines()
            if not line.startswith("#") and (m := _SAMPLE.match(line))}


def bucket_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """``histogram_quantile``: linear interpolation inside the bucket holding the q-th observation."""
    buckets = sorted(buckets)
    total = buckets[-1][1] if buckets else 0
    if not total:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * ((rank - below) / (count - below) if count > below else 0.0)
        lower, below = bound, count
    return lower


def _buckets(samples: dict[str, float], name: str, label: str) -> list[tuple[float, float]]:
    out = []
    for key, value in samples.items():
        if key.startswith(name + "_bucket{") and label in key:
            bound = re.search(r'le="([^"]+)"', key)
            if bound:
                out.append((float(bound[1]), value))
    return out


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 1)


def run(sizes: Sizes) -> dict[str, Any]:
    events = PLANS[sizes.name]
    detection: list[float] = []
    with scratch_dir("notice-") as work, Emulator(vms=["nw-0"], rate_limit=None) as emu:
        out = work / "out.jsonl"
        proc = spawn_agent(emu, work / "nw-0", "nw-0",
                           f'[telemetry]\nlisten = "127.0.0.1:0"\n[[sinks]]\ntype = "file"\nname = "file"\npath = "{out}"\n')
        try:
            log = work / "nw-0" / "agent.log"
            deadline = time.monotonic() + START_TIMEOUT_S
            url = None
            while url is None:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the agent did not start its telemetry endpoint: see {log}")
                found = re.search(r"/metrics and /healthz on (http://\S+)", log.read_text(errors="replace"))
                url = found[1] if found else None
                time.sleep(0.1)

            def records() -> dict[str, dict[str, Any]]:
                try:
                    lines = out.read_bytes().split(b"\n")[:-1]
                except FileNotFoundError:
                    return {}
                return {r["subject"]: r for r in map(orjson.loads, lines) if r["type"] == "scheduledevent.scheduled"}

            rng = random.Random()
            for n in range(events):
                time.sleep(rng.uniform(0.0, 1.0))  # a uniform poll phase for every event
                event_id = emu.schedule(type=TYPES[n % len(TYPES)], resources=["nw-0"], not_before="+20m",
                                        complete_after=3600)
                published = next(h["time"] for h in reversed(emu.platform.history) if h["event_id"] == event_id)
                deadline = time.monotonic() + 10
                while (seen := records().get(event_id)) is None:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise RuntimeError(f"event {event_id} was not forwarded: see {log}")
                    time.sleep(0.02)
                first_seen = datetime.fromisoformat(seen["time"].replace("Z", "+00:00"))
                detection.append((first_seen - datetime.fromisoformat(published)).total_seconds())
            time.sleep(0.5)  # the last delivery observed (the sink acknowledged before the file line is read)
            samples = scrape(url)
        finally:
            stop_agents([proc], timeout=15)
    cuts = statistics.quantiles(detection, n=100, method="inclusive") if len(detection) > 1 else [detection[0]] * 99
    binned = [(b, float(sum(1 for d in detection if d <= b))) for b in BUCKETS] + [(float("inf"), float(len(detection)))]
    delivery = _buckets(samples, "sefwd_sink_delivery_latency_seconds", 'sink="file"')
    lead_counts = {t: samples.get(f'sefwd_event_notice_lead_seconds_count{{type="{t}"}}', 0.0) for t in TYPES}
    lead_p50 = {t: bucket_quantile(0.5, _buckets(samples, "sefwd_event_notice_lead_seconds", f'type="{t}"'))
                for t in TYPES}
    detection_p99, delivered = _ms(cuts[98]), int(max((c for _, c in delivery), default=0))
    figures: dict[str, Any] = {
        "events": events,
        "detection_latency_ms": {"p50": _ms(cuts[49]), "p99": detection_p99,
                                 "histogram_p50": _ms(bucket_quantile(0.5, binned)),
                                 "histogram_p99": _ms(bucket_quantile(0.99, binned)), "poll_interval_ms": 1000},
        "delivery_latency_ms": {"histogram_p50": _ms(bucket_quantile(0.5, delivery)),
                                "histogram_p99": _ms(bucket_quantile(0.99, delivery)),
                                "count": delivered},
        "notice_lead_count": lead_counts,
        "notice_lead_p50_s": {t: round(v, 1) if v is not None else None for t, v in lead_p50.items()},
    }
    return result(figures, [
        goal("every event detected within 1.05 x poll interval + 20 ms (p99)",
             detection_p99 is not None and detection_p99 <= 1070),
        goal("every scheduled event counted in sefwd.event.notice_lead by its type",
             sum(lead_counts.values()) == events),
        goal("deliveries observed in sefwd.sink.delivery.latency", delivered >= events),
    ])
