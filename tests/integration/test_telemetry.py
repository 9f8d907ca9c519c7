"""Agent telemetry: /metrics and /healthz of a real `sefwd run`, export to Azure Monitor, config."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

pytest.importorskip("opentelemetry.exporter.prometheus")

from forwarder.agent.config import describe, parse_config  # noqa: E402
from forwarder.emulator import Emulator  # noqa: E402
from forwarder.errors import ConfigError  # noqa: E402
from forwarder.agent.telemetry import NO_TELEMETRY, Health, create_telemetry  # noqa: E402
from tests.agent import ROOT, AgentProcess, read_jsonl, wait_until, write_config  # noqa: E402
from benchmarks.peers.appinsights_peer import IKEY, AppInsightsPeer  # noqa: E402

QUIET_SDK_ENV = {
    "APPLICATIONINSIGHTS_STATSBEAT_DISABLED_ALL": "true",
    "APPLICATIONINSIGHTS_CONTROLPLANE_DISABLED": "true",
    "APPLICATIONINSIGHTS_SDKSTATS_DISABLED": "true",
}
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def scrape(base: str) -> dict[str, float]:
    """Prometheus text → {"name{labels}": value}."""
    status, body = get(base + "/metrics")
    assert status == 200
    samples = {}
    for line in body.decode().splitlines():
        match = _SAMPLE.match(line)
        if match and not line.startswith("#"):
            samples[match[1] + (match[2] or "")] = float(match[3])
    return samples


def endpoint(agent: AgentProcess) -> str:
    found = wait_until(lambda: re.search(r"/metrics and /healthz on (http://\S+)", agent.logs()), 30,
                       "the telemetry endpoint to be logged")
    return found[1]


def health(base: str) -> tuple[int, dict]:
    status, body = get(base + "/healthz")
    return status, json.loads(body)


def test_metrics_move_during_a_real_run(tmp_path):
    with Emulator(vms=["web-0"]) as emu:
        config = write_config(tmp_path / "c.toml", emu.url, tmp_path / "state",
                              extra='[telemetry]\nlisten = "127.0.0.1:0"\n')
        agent = AgentProcess(config, tmp_path / "agent.log")
        try:
            base = endpoint(agent)
            first = wait_until(lambda: (s := scrape(base)).get("sefwd_imds_polls_total", 0) >= 1 and s, 30,
                               "a first poll in the metrics")
            event_id = emu.schedule(type="Reboot", resources=["web-0"], start_after=600)
            wait_until(lambda: any(r.get("subject") == event_id for r in read_jsonl(tmp_path / "out.jsonl")),
                       30, "the scheduled record")
            second = wait_until(lambda: (s := scrape(base)).get('sefwd_sink_delivered_total{sink="file"}', 0)
                                >= first.get('sefwd_sink_delivered_total{sink="file"}', 0) + 1 and s, 30,
                                "the delivery in the metrics")
            status, report = health(base)
        finally:
            assert agent.terminate() == 0
    assert second["sefwd_imds_polls_total"] > first["sefwd_imds_polls_total"]
    assert second["sefwd_imds_poll_duration_seconds_count"] > first["sefwd_imds_poll_duration_seconds_count"]
    assert second['sefwd_records_total{type="scheduledevent.scheduled"}'] == 1
    assert second['sefwd_sink_delivery_latency_seconds_count{sink="file"}'] >= 2  # started + scheduled
    assert second['sefwd_sink_backlog{sink="file"}'] >= 0
    assert 'sefwd_sink_oldest_undelivered_age_seconds{sink="file"}' in second
    assert second["sefwd_healthy"] == 1 and second["process_resident_memory_bytes"] > 0
    assert status == 200 and report["status"] == "ok" and report["journal"]["ok"] is True


def test_healthz_turns_503_while_imds_fails_and_recovers(tmp_path):
    with Emulator(vms=["web-0"], rate_limit=None) as emu:
        config = write_config(tmp_path / "c.toml", emu.url, tmp_path / "state",
                              extra='[telemetry]\nlisten = "127.0.0.1:0"\nunhealthy_after = "1s"\n')
        agent = AgentProcess(config, tmp_path / "agent.log")
        try:
            base = endpoint(agent)
            wait_until(lambda: health(base)[1]["imds"]["last_ok_age_s"] is not None, 30, "a good poll")
            assert health(base)[0] == 200
            emu.inject_fault("status", status=500, count=10_000)
            wait_until(lambda: health(base)[1]["imds"]["consecutive_failures"] >= 1, 30, "a failed poll")
            assert health(base)[0] == 200  # failing, but not yet for longer than 1s
            status, report = wait_until(lambda: (h := health(base))[0] == 503 and h, 30, "/healthz 503")
            assert report["status"] == "unhealthy" and "IMDS has failed" in report["problems"][0]
            errors = scrape(base)
            assert errors['sefwd_imds_errors_total{status="500"}'] >= 2 and errors["sefwd_healthy"] == 0
            emu.faults.clear()
            status, report = wait_until(lambda: (h := health(base))[0] == 200 and h, 30, "/healthz 200 again")
            assert report["status"] == "ok" and report["imds"]["consecutive_failures"] == 0
        finally:
            assert agent.terminate() == 0


def test_bad_documents_and_cycle_errors_are_counted_in_the_metrics(tmp_path):
    with Emulator(vms=["web-0"], rate_limit=None) as emu:
        config = write_config(tmp_path / "c.toml", emu.url, tmp_path / "state",
                              extra='[telemetry]\nlisten = "127.0.0.1:0"\n')
        agent = AgentProcess(config, tmp_path / "agent.log", env={"SEFWD_IMDS_COMPUTE_REFRESH": "1s"})
        try:
            base = endpoint(agent)
            first = wait_until(lambda: (s := scrape(base)).get("sefwd_imds_polls_total", 0) >= 1 and s, 30,
                               "a first poll in the metrics")
            assert first["sefwd_poller_bad_documents_total"] == 0 and first["sefwd_poller_cycle_errors_total"] == 0
            emu.inject_fault("malformed", count=2)  # a 200 with truncated JSON: refused as a bad document
            wait_until(lambda: scrape(base).get("sefwd_poller_bad_documents_total", 0) >= 1, 30,
                       "the bad document counted")
            # Instance metadata nested beyond Python's recursion limit raises inside the cycle (not an
            # ImdsError): the cycle guard logs it, counts it and polls on.
            emu.inject_fault("nested", path="instance", depth=50_000, count=2)
            wait_until(lambda: scrape(base).get("sefwd_poller_cycle_errors_total", 0) >= 1, 30,
                       "the cycle error counted")
            assert agent.alive(), agent.logs()[-3000:]
            # The counters move a moment before the log lines are written: wait for those too.
            wait_until(lambda: "skipping a bad IMDS document" in agent.logs(), 30, "the bad document logged")
            wait_until(lambda: "unexpected error in the poll cycle" in agent.logs(), 30, "the cycle error logged")
        finally:
            assert agent.terminate() == 0


def test_metrics_exported_to_azure_monitor(tmp_path):
    temp_dir = tmp_path / "tmp"
    temp_dir.mkdir()
    with AppInsightsPeer(tmp_path) as peer, Emulator(vms=["web-0"]) as emu:
        env = {**QUIET_SDK_ENV, "REQUESTS_CA_BUNDLE": str(peer.ca_file), "TMPDIR": str(temp_dir),
               "TEST_TELEMETRY_CONN": f"InstrumentationKey={IKEY};IngestionEndpoint=https://127.0.0.1:{peer.port}/"}
        config = write_config(tmp_path / "c.toml", emu.url, tmp_path / "state",
                              extra='[telemetry]\nconnection_string_env = "TEST_TELEMETRY_CONN"\n'
                                    'export_interval = "1s"\n')
        agent = AgentProcess(config, tmp_path / "agent.log", env=env)
        try:
            def metric_names():
                return {m["name"] for e in list(peer.envelopes) if e["data"]["baseType"] == "MetricData"
                        for m in e["data"]["baseData"]["metrics"]}
            names = wait_until(lambda: {"sefwd.imds.polls", "sefwd.sink.backlog"} <= metric_names() and metric_names(),
                               30, "agent metrics in Azure Monitor")
        finally:
            assert agent.terminate() == 0
    assert "sefwd.imds.poll.duration" in names
    polls = [e for e in peer.envelopes if e["data"]["baseType"] == "MetricData"
             and e["data"]["baseData"]["metrics"][0]["name"] == "sefwd.imds.polls"]
    assert polls[0]["iKey"] == IKEY and polls[0]["tags"]["ai.cloud.role"] == "scheduled-events-forwarder"
    assert list(temp_dir.iterdir()) == []  # the SDK's offline storage stays out of the temp dir


def test_metrics_exported_with_a_managed_identity_token(tmp_path):
    """credential = "managed_identity": the exporter gets Entra ID tokens from IMDS (the emulator here)."""
    with AppInsightsPeer(tmp_path, require_bearer=True) as peer, Emulator(vms=["web-0"]) as emu:
        env = {**QUIET_SDK_ENV, "REQUESTS_CA_BUNDLE": str(peer.ca_file), "AZURE_POD_IDENTITY_AUTHORITY_HOST": emu.url,
               "TEST_TELEMETRY_CONN": f"InstrumentationKey={IKEY};IngestionEndpoint=https://127.0.0.1:{peer.port}/"}
        config = write_config(tmp_path / "c.toml", emu.url, tmp_path / "state",
                              extra='[telemetry]\nconnection_string_env = "TEST_TELEMETRY_CONN"\n'
                                    'credential = "managed_identity"\nexport_interval = "1s"\n')
        agent = AgentProcess(config, tmp_path / "agent.log", env=env)
        try:
            requests = wait_until(lambda: [r for r in peer.wait_for_requests(1, timeout=30) if r.status == 200], 30,
                                  "a metrics export the peer accepted")
        finally:
            assert agent.terminate() == 0
        assert emu.stats()["token_requests"] >= 1
    assert requests[0].headers["authorization"].startswith("Bearer emulator-token.web-0.")
    assert any(e["data"]["baseType"] == "MetricData" for r in requests for e in r.envelopes)
    assert all(r.status != 401 for r in peer.requests), "no export went without a token"


def test_health_report_journal_and_window():
    now = [100.0]
    h = Health(unhealthy_after=5.0, clock=lambda: now[0])
    assert h.report()[0] is True
    h.poll(False, "500")
    now[0] += 5.0
    assert h.report()[0] is True  # exactly the window: not yet
    now[0] += 0.5
    ok, body = h.report()
    assert not ok and body["imds"]["consecutive_failures"] == 1 and "500" in body["problems"][0]
    h.poll(True)
    assert h.report()[0] is True
    h.append(OSError(28, "No space left on device"))
    ok, body = h.report()
    assert not ok and body["journal"]["ok"] is False and "No space left" in body["problems"][0]
    h.append(None)
    assert h.report()[0] is True


def test_not_configured_is_a_no_op(tmp_path):
    config = parse_config({}, {}, "x")
    telemetry = create_telemetry(config.telemetry, tmp_path)
    assert telemetry is NO_TELEMETRY and not telemetry.enabled
    sinks: dict = {"a": object()}
    assert telemetry.instrument_sinks(sinks) is sinks
    assert "telemetry" not in describe(config)


@pytest.mark.parametrize("listen, expected", [
    (9464, ("127.0.0.1", 9464)),
    ("9464", ("127.0.0.1", 9464)),
    ("0.0.0.0:9464", ("0.0.0.0", 9464)),
    ("[::1]:9464", ("::1", 9464)),
])
def test_listen_defaults_to_loopback(listen, expected):
    config = parse_config({"telemetry": {"listen": listen}}, {}, "x")
    assert config.telemetry.listen == expected and config.telemetry.enabled
    assert "telemetry: /metrics and /healthz on" in describe(config)


@pytest.mark.parametrize("section, env, fragment", [
    ({"listen": ":9464"}, {}, "host must be explicit"),
    ({"listen": "127.0.0.1:x"}, {}, "port must be a number"),
    ({"unhealthy_after": "0s"}, {}, "telemetry.unhealthy_after"),
    ({}, {"SEFWD_TELEMETRY_EXPORT_INTERVAL": "100ms"}, "SEFWD_TELEMETRY_EXPORT_INTERVAL"),
    ({"connection_string_env": "A", "connection_string_file": "/x"}, {}, "only one of"),
    ({"lisen": "9464"}, {}, "did you mean 'listen'"),
    ({"connection_string_env": "A", "credential": "password"}, {"A": "x"}, 'must be "managed_identity"'),
    ({"credential": "managed_identity"}, {}, "credential is for the Azure Monitor export"),
    ({"connection_string_env": "A", "client_id": "abc"}, {"A": "x"}, "client_id needs credential"),
])
def test_config_problems(section, env, fragment):
    with pytest.raises(ConfigError) as caught:
        parse_config({"telemetry": section}, env, "x")
    assert any(fragment in p for p in caught.value.problems), caught.value.problems


def test_missing_extra_is_a_config_error_naming_it(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text(f'[state]\ndir = "{tmp_path / "s"}"\n[telemetry]\nlisten = "127.0.0.1:0"\n')
    script = (
        "import sys\n"
        "sys.modules['opentelemetry.exporter.prometheus'] = None\n"
        "from forwarder.agent.config import load_config\n"
        "from forwarder.errors import ConfigError\n"
        f"try:\n    load_config({str(config)!r}, env={{}})\nexcept ConfigError as exc:\n    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "pip install 'scheduled-events-forwarder[telemetry]'" in out.stdout, out.stdout + out.stderr


def test_connection_string_source_is_checked_at_config_time(tmp_path):
    with pytest.raises(ConfigError) as caught:
        parse_config({"telemetry": {"connection_string_env": "TEST_NOT_SET_CONN"}}, {}, "x")
    assert any("TEST_NOT_SET_CONN is not set" in p for p in caught.value.problems)
    with pytest.raises(ConfigError) as caught:
        parse_config({"telemetry": {"connection_string_file": str(tmp_path / "nope")}}, {}, "x")
    assert any("is not a file" in p for p in caught.value.problems)
    config = parse_config({"telemetry": {"connection_string_env": "C"}}, {"C": f"InstrumentationKey={IKEY}"}, "x")
    assert config.telemetry.azure_monitor and config.telemetry.listen is None
