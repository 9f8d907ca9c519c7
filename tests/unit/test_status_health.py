"""`sefwd status` exit codes come from one health rule: not running, degraded (with reasons), healthy."""
from __future__ import annotations

from forwarder.agent.status import health

RUNNING = {"running": True, "agent": {"imds": {"consecutive_failures": 0}, "sinks": {"hook": {"stuck": False}}}}


def test_not_running() -> None:
    assert health({"running": False, "agent": RUNNING["agent"]}) == ("not_running", ["the agent is not running"])


def test_healthy() -> None:
    assert health(RUNNING) == ("healthy", [])


def test_degraded_says_why() -> None:
    state, reasons = health({"running": True, "agent": {"imds": {"consecutive_failures": 3},
                                                        "sinks": {"hook": {"stuck": True}}, "data_lost": {"Reason": "x"}}})
    assert state == "degraded"
    assert reasons == ["the last 3 IMDS poll(s) failed", "sink hook is stuck", "data was lost at start"]
    assert health({"running": True, "agent": None}) == ("degraded", ["no status report yet"])
