"""/healthz names a stuck sink (dead worker, or failing for long) and is healthy again without it."""
from __future__ import annotations

from forwarder.agent.telemetry import Health


def test_a_stuck_sink_makes_the_agent_unhealthy_and_is_named():
    health = Health(unhealthy_after=300, clock=lambda: 100.0)
    stuck: list[str] = []
    health.stuck_sinks = lambda: list(stuck)
    assert health.report()[0] is True
    stuck.append("hook")
    ok, body = health.report()
    assert not ok and body["stuck_sinks"] == ["hook"] and "hook" in body["problems"][0]
    stuck.clear()
    assert health.report()[0] is True
