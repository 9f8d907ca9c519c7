"""[probe]: parsing, every problem at once, environment overrides, the summary line."""
from __future__ import annotations

from pathlib import Path

import pytest

from forwarder.agent.config import ProbeConfig, describe, parse_config
from forwarder.errors import ConfigError


def test_off_by_default_with_the_documented_defaults():
    probe = parse_config({}, {}, "x").probe
    assert probe == ProbeConfig() and not probe.enabled
    assert probe.event_types == ("Reboot", "Redeploy", "Preempt", "Terminate")
    assert probe.lead is None and probe.settle == 30.0 and probe.path == "/maintenance"


def test_values_from_file_and_environment():
    config = parse_config({"probe": {"listen": "[::]:8080", "event_types": ["Freeze", "Reboot", "Freeze"],
                                     "lead": "15m", "settle": "0", "path": "/lb"}},
                          {"SEFWD_PROBE_STATE_FILE": "/tmp/m.json"}, "x")
    probe = config.probe
    assert probe.listen == ("::", 8080) and probe.event_types == ("Freeze", "Reboot") and probe.lead == 900.0
    assert probe.settle == 0.0 and probe.path == "/lb" and probe.state_file == Path("/tmp/m.json") and probe.enabled
    assert "probe: :::8080/lb, types Freeze, Reboot, 503 from NotBefore - 15m" in describe(config)
    env = parse_config({}, {"SEFWD_PROBE_EVENT_TYPES": "Preempt, Terminate", "SEFWD_PROBE_LEAD": "scheduled"}, "x")
    assert env.probe.event_types == ("Preempt", "Terminate") and env.probe.lead is None
    assert parse_config({"probe": {"event_types": ["*"]}}, {}, "x").probe.event_types is None
    only_file = parse_config({"probe": {"state_file": "/run/x.json"}}, {}, "x").probe
    assert only_file.enabled and only_file.listen is None


def test_every_problem_at_once():
    with pytest.raises(ConfigError) as info:
        parse_config({"probe": {"listen": "8080", "path": "maintenance", "event_types": ["reboot"], "lead": "-5m",
                                "settle": "2d", "colour": "red"}}, {"SEFWD_PROBE_SETTLE": "soon"}, "x")
    text = "\n".join(info.value.problems)
    for fragment in ("probe.listen", "probe.path", "'reboot' (did you mean 'Reboot'?)", "probe.lead",
                     "SEFWD_PROBE_SETTLE", "unknown key probe.colour"):
        assert fragment in text, fragment
    with pytest.raises(ConfigError, match="event_types"):
        parse_config({"probe": {"event_types": []}}, {}, "x")
    with pytest.raises(ConfigError, match="path"):
        parse_config({"probe": {"path": "/a b"}}, {}, "x")
