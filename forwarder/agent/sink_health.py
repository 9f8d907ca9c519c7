"""One sink's health in words, the same in ``sefwd status`` and ``/healthz``.

A sink is ``ok``, ``failing`` (since when, with the latest error and how many errors since its last
delivery), ``dead_lettering`` (a record went to dead letters and none was delivered since) or
``worker_dead``; it is *degraded* once it has failed longer than ``[agent] degraded_after`` (30 s,
the Spot notice) or dead-letters. The dispatcher computes it (``SinkWorker.health``).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from forwarder.common.logs import redact


def describe_sink_health(health: Mapping[str, Any]) -> str:
    """``failing since T: http_400 (3 errors)`` or ``dead-lettering: http_400 ...``: one sink's health for people."""
    state = str(health.get("state") or "ok")
    if state == "ok":
        return "ok"
    words = {"failing": "failing", "dead_lettering": "dead-lettering", "worker_dead": "delivery thread died"}
    text = words.get(state, state)
    if health.get("failing_since"):
        text += f" since {health['failing_since']}"
    if health.get("last_error"):
        errors = health.get("errors") or 0
        text += f", latest error {redact(str(health['last_error']))}" + (f" ({errors} error{'s' if errors != 1 else ''})"
                                                             if errors else "")
    return text
