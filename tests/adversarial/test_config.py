"""Hostile config values: every key of every kind refuses nan, inf, negatives, exponents, absurd
sizes and control characters with a problem naming the key, and ``config check`` refuses first
what ``run`` would refuse, listing every problem, without a traceback."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from forwarder.agent.config import parse_config
from forwarder.errors import ConfigError
from tests.agent import ROOT

UUID = "0f3e1c52-5a5b-4f39-9c43-7d2b3a1f2e10"
WEBHOOK = {"type": "webhook", "name": "hook", "url": "http://127.0.0.1:1/h"}
CALLBACK = {"listen": "127.0.0.1:0", "secret_env": "CB_SECRET"}
ENV = {"CB_SECRET": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"}


def problems_of(data: dict[str, Any], env: dict[str, str] | None = None, tmp: Path | None = None) -> list[str]:
    source = str((tmp or Path("/nonexistent")) / "c.toml")
    try:
        parse_config(data, {**ENV, **(env or {})}, source)
    except ConfigError as exc:
        return exc.problems
    return []


def nest(path: str, value: Any) -> tuple[dict[str, Any], str]:
    """``"imds.timeout"`` -> ({"imds": {"timeout": value}}, label); sink and rule keys get a whole table."""
    head, _, key = path.rpartition(".")
    if head == "sinks":
        return {"sinks": [{**WEBHOOK, key: value}]}, "sinks[0]"
    if head == "approval.rules":
        return {"approval": {"rules": [{"action": "approve", key: value}]}}, f"approval.rules[0].{key}"
    if head == "approval.callback":
        return {"approval": {"callback": {**CALLBACK, key: value}}}, f"approval.callback.{key}"
    data: dict[str, Any] = {}
    table = data
    for part in head.split("."):
        table = table.setdefault(part, {})
    table[key] = value
    return data, path


DURATION_KEYS = [
    "imds.poll_interval", "imds.timeout", "imds.first_call_timeout", "imds.compute_refresh",
    "agent.heartbeat", "agent.drain_timeout", "agent.status_interval", "delivery.retry_initial", "delivery.retry_max",
    "delivery.retry_after_cap", "telemetry.unhealthy_after", "telemetry.export_interval",
    "approval.hook_timeout", "approval.callback.client_timeout", "approval.callback.tolerance",
    "approval.rules.delay", "sinks.timeout",
]
HOSTILE_DURATIONS = [
    math.nan, math.inf, -math.inf, "nan", "NaN", "inf", "-inf", "infinity", -1, -0.5, "-1s", "1e12s", 1e12,
    "1e3", "1.5e3ms", True, False, "", "   ", "1 s s", "99999999999999999999d", "0x10", "1_000s", "\u0661s",
    "5\r\ns", [], {}, "10y",
]
SIZE_KEYS = ["journal.max_size", "approval.hook_output_limit", "approval.callback.max_body"]
HOSTILE_SIZES = [math.nan, math.inf, -1, "-1MiB", "1e9", 1.5, True, "", "1TiB", "999999999999999GiB", "nan", [], "12 parsecs"]
INT_KEYS = ["approval.rules.duration_min", "approval.rules.resources_max", "approval.callback.rate_limit", "sinks.batch_size"]
HOSTILE_INTS = [math.nan, math.inf, 1.5, True, "5", -2, 10**30, None, [], "1e3"]
BOOL_KEYS = ["journal.fsync", "approval.rules.affects_this_vm", "sinks.insecure_http"]
HOSTILE_BOOLS = ["maybe", 2, 1.0, [], {}, "", "t r u e"]
ENUM_KEYS = ["agent.log_level", "imds.api_version", "approval.scope", "approval.rules.action"]
HOSTILE_ENUMS = [5, "", "verbose", "\x00", "debug\r\ninjected", ["debug"], math.nan]
URL_KEYS = ["imds.endpoint", "sinks.url"]
HOSTILE_URLS = [
    "http://h/\r\nX-Injected: 1", "http://h\n/x", "http://h\x00", "http://h/\tx", "http://h/a b", "http://h/\x7f",
    "ftp://h", "http://", "", 5, "http://h:99999", "http://h\u0085/",
]


def cases(keys: list[str], values: list[Any]) -> list[tuple[str, Any]]:
    return [(key, value) for key in keys for value in values]


@pytest.mark.parametrize("key, value", cases(DURATION_KEYS, HOSTILE_DURATIONS) + cases(SIZE_KEYS, HOSTILE_SIZES)
                         + cases(INT_KEYS, HOSTILE_INTS) + cases(BOOL_KEYS, HOSTILE_BOOLS)
                         + cases(ENUM_KEYS, HOSTILE_ENUMS) + cases(URL_KEYS, HOSTILE_URLS))
def test_hostile_value_is_refused_and_named(key, value):
    data, label = nest(key, value)
    found = problems_of(data)
    assert found, f"{key} = {value!r} was accepted"
    assert any(p.startswith(label) for p in found), found
    # The message never echoes a control character into the terminal or the log.
    assert not any(c in p for p in found for c in "\r\n\x00\x85"), found


@pytest.mark.parametrize("key, value", [
    ("imds.timeout", "61s"), ("imds.first_call_timeout", "11m"), ("imds.poll_interval", "2h"),
    ("imds.poll_interval", "499ms"), ("agent.heartbeat", "2d"), ("delivery.retry_max", "2d"),
    ("journal.max_size", "65GiB"), ("approval.callback.tolerance", "2h"),
    ("approval.rules.duration_max", 8 * 86400), ("agent.heartbeat", "1ms"), ("delivery.retry_initial", "1ms"),
    ("delivery.retry_max", "10ms"), ("sinks.timeout", "11m"), ("approval.callback.max_body", "2MiB"),
    ("agent.status_interval", "0s"), ("agent.status_interval", "10ms"), ("agent.status_interval", "6m"),
])
def test_values_beyond_the_documented_maximum(key, value):
    data, label = nest(key, value)
    assert any(p.startswith(label) and ("at most" in p or "between" in p or "from" in p or "at least" in p)
               for p in problems_of(data)), problems_of(data)


def test_poll_interval_floor_says_why():
    (problem,) = problems_of({"imds": {"poll_interval": "200ms"}})
    assert "at least 500ms" in problem and "5 requests per second" in problem


@pytest.mark.parametrize("data, needle", [
    ({"delivery": {"retry_initial": "2m", "retry_max": "1m"}}, "delivery.retry_initial (2m) must not exceed delivery.retry_max (1m)"),
    ({"approval": {"rules": [{"action": "hold", "duration_min": 10, "duration_max": 5}]}}, "never matches"),
])
def test_cross_field_checks(data, needle):
    assert any(needle in p for p in problems_of(data)), problems_of(data)


@pytest.mark.parametrize("text, needle", [
    ("InstrumentationKey=not-a-uuid", "lower-case UUID"),
    (f"InstrumentationKey={UUID.upper()}", "lower-case UUID"),
    ("IngestionEndpoint=https://x/", "no InstrumentationKey"),
    (f"InstrumentationKey={UUID};IngestionEndpoint=http://x/", "https:// URL"),
    (f"InstrumentationKey={UUID};IngestionEndpoint=https://u:p@x/", "credentials"),
    (f"InstrumentationKey={UUID};IngestionEndpoint=https://x/\r\nX", "control characters"),
    (f"InstrumentationKey={UUID};", "malformed"),
    (f"InstrumentationKey={UUID};Authorization=AAD", "Authorization"),
    (f"InstrumentationKey={UUID};InstrumentationKey={UUID}", "twice"),
    ("", "not set"),
])
def test_telemetry_connection_string_checked_as_the_exporter_reads_it(text, needle):
    found = problems_of({"telemetry": {"connection_string_env": "TELEMETRY_CS"}}, {"TELEMETRY_CS": text})
    assert any(needle in p for p in found), found
    assert all("p@x" not in p for p in found)  # a connection string's content is never echoed


def test_valid_telemetry_connection_string_passes():
    good = f"InstrumentationKey={UUID};IngestionEndpoint=https://westeurope-5.in.applicationinsights.azure.com/"
    assert problems_of({"telemetry": {"connection_string_env": "TELEMETRY_CS"}}, {"TELEMETRY_CS": good}) == []


def test_our_appinsights_rules_agree_with_the_exporter():
    """The exporter's own parser is the oracle: what it refuses, we refuse (and say why)."""
    from azure.monitor.opentelemetry.exporter._connection_string_parser import ConnectionStringParser

    from forwarder.common.connection_strings import appinsights_problems

    for text in (f"InstrumentationKey={UUID}", "InstrumentationKey=nope", f"InstrumentationKey={UUID.upper()}",
                 f"InstrumentationKey={UUID};", f"InstrumentationKey={UUID};Authorization=aad", "x", "a=b=c"):
        try:
            ConnectionStringParser(text)
            sdk_ok = True
        except ValueError:
            sdk_ok = False
        assert (appinsights_problems(text) == []) == sdk_ok, text


@pytest.mark.parametrize("text, needle", [
    ("Endpoint=sb://ns.servicebus.windows.net/\r\n;SharedAccessKeyName=k;SharedAccessKey=v;EntityPath=h", "control characters"),
    ("Endpoint=https://ns.servicebus.windows.net/;SharedAccessKeyName=k;SharedAccessKey=v;EntityPath=h", "sb://"),
    ("Endpoint=sb://ns.servicebus.windows.net/;SharedAccessKeyName=k;SharedAccessKey=v;EntityPath=a/b", "EntityPath"),
])
def test_eventhubs_connection_string(text, needle, monkeypatch):
    monkeypatch.setenv("EH_CS", text)
    found = problems_of({"sinks": [{"type": "eventhubs", "connection_string_env": "EH_CS"}]})
    assert any(needle in p for p in found), found


def test_appinsights_sink_connection_string(monkeypatch):
    monkeypatch.setenv("AI_CS", "InstrumentationKey=12345")
    found = problems_of({"sinks": [{"type": "appinsights", "connection_string_env": "AI_CS"}]})
    assert any("sinks[0] (appinsights)" in p and "UUID" in p for p in found), found


def test_loganalytics_endpoint_with_control_characters():
    found = problems_of({"sinks": [{"type": "loganalytics", "endpoint": "https://x.ingest.monitor.azure.com\r\n/x",
                                    "rule_id": "dcr-" + "0" * 32}]})
    assert any("control characters" in p for p in found), found


@pytest.mark.parametrize("var, value", [
    ("SEFWD_IMDS_POLL_INTERVAL", "nan"), ("SEFWD_IMDS_TIMEOUT", "inf"), ("SEFWD_DELIVERY_RETRY_MAX", "1e12s"),
    ("SEFWD_JOURNAL_FSYNC", "maybe"), ("SEFWD_AGENT_LOG_LEVEL", "debugg"), ("SEFWD_IMDS_ENDPOINT", "http://h/\r\nx"),
    ("SEFWD_APPROVAL_HOOK_TIMEOUT", "-5s"),
])
def test_environment_overrides_are_parsed_by_the_same_toolkit(var, value):
    found = problems_of({}, {var: value})
    assert any(p.startswith(f"environment {var}") for p in found), found


@pytest.mark.parametrize("data", [
    {"imds": {"poll_interval": " 5s \n", "endpoint": "http://169.254.169.254\r\n"}},
    {"sinks": [{**WEBHOOK, "url": " http://127.0.0.1:1/h\n", "timeout": "\t3s"}]},
])
def test_surrounding_whitespace_is_harmless(data):
    # Values are stripped before use (a trailing newline from an env file is common); inside, it is refused.
    assert problems_of(data) == []


def test_did_you_mean_survives():
    found = problems_of({"agent": {"log_level": "debugg"}, "imds": {"pol_interval": "1s"}})
    assert any("did you mean 'debug'" in p for p in found) and any("did you mean 'poll_interval'" in p for p in found)


BAD_FILE = f"""
[imds]
poll_interval = "nan"
timeout = inf
endpoint = "http://169.254.169.254/\\r\\nX-Injected: 1"
[agent]
log_level = "verbose"
[journal]
max_size = "1KiB"
[delivery]
retry_max = 1e12
[telemetry]
connection_string_env = "TELEMETRY_CS"
[[sinks]]
type = "webhook"
url = "http://127.0.0.1:1/hook?code=SECRETCODE\\r\\nX-Injected: 1"
timeout = nan
"""
EXPECTED = ["imds.poll_interval", "imds.timeout", "imds.endpoint", "agent.log_level", "journal.max_size",
            "delivery.retry_max", "InstrumentationKey", "sinks[0] (webhook): option 'url'", "option 'timeout'"]


@pytest.mark.parametrize("command", [["config", "check"], ["run"], ["once"]])
def test_check_and_run_refuse_the_same_file_listing_every_problem(tmp_path, command):
    config = tmp_path / "c.toml"
    config.write_text(BAD_FILE + f'[state]\ndir = "{tmp_path / "state"}"\n')
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "TELEMETRY_CS": "InstrumentationKey=abc"}
    done = subprocess.run([sys.executable, "-m", "forwarder", *command, "--config", str(config)],
                          capture_output=True, cwd=str(ROOT), env=env, timeout=120)
    err = done.stderr.decode()
    assert done.returncode == 2, err
    assert "Traceback" not in err
    missing = [needle for needle in EXPECTED if needle not in err]
    assert not missing, err
    assert "SECRETCODE" not in err
    assert not (tmp_path / "state").exists()  # refused before anything was created


def test_broken_toml_names_line_and_column(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text('[imds]\npoll_interval = "1s"\ntimeout = 5s\n')
    done = subprocess.run([sys.executable, "-m", "forwarder", "config", "check", "--config", str(config)],
                          capture_output=True, cwd=str(ROOT), env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
                          timeout=60)
    err = done.stderr.decode()
    assert done.returncode == 2 and "line 3" in err and "column" in err and "Traceback" not in err, err
