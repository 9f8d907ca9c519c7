"""The fleet benchmark in smoke size: 3 agents, one Event Hubs peer, one availability-set event."""
from __future__ import annotations

import pytest

pytest.importorskip("psutil", reason="the bench extra is not installed: pip install -e '.[bench]'")
pytest.importorskip("azure.eventhub", reason="the eventhubs extra is not installed")

from benchmarks import fleet  # noqa: E402
from benchmarks.common import MODES  # noqa: E402
from benchmarks.peers.eventhubs_peer import EventHubsPeer  # noqa: E402


@pytest.mark.skipif(EventHubsPeer.available() is not None, reason=str(EventHubsPeer.available()))
@pytest.mark.slow  # a benchmark run
def test_fleet_smoke_fans_out_one_event_and_dedupes_by_eventkey() -> None:
    res = fleet.run(MODES["smoke"])
    figures = res["figures"]
    agents = fleet.PLANS["smoke"].agents
    assert {"agents", "cpu_percent", "rss_mib_each", "eventhubs_records", "unique_eventkeys"} <= set(figures)
    assert figures["agents"] == agents
    assert figures["cpu_percent"] > 0
    assert figures["rss_mib_each"]["median"] > 0
    assert figures["eventhubs_records"] >= agents * 3
    assert set(figures["records_by_kind"]) == {"scheduled", "started", "completed"}
    assert all(n >= agents for n in figures["records_by_kind"].values())  # at least once
    assert figures["unique_eventkeys"] == 3
    assert figures["eventhubs_connections"]["open"] == agents
    # The delivery and dedup goals hold on any machine; the CPU goal is the benchmark's business.
    assert all(g["pass"] for g in res["goals"][1:]), res["goals"]
    assert res["pass"] == all(g["pass"] for g in res["goals"])
