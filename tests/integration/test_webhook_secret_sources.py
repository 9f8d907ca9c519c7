"""Webhook secrets come from secret places only: header values from environment variables
(``headers_env``) or files (``headers_file``), a key-bearing URL from ``url_env`` / ``url_file``;
through the real VM extension handler (run as the guest agent runs it) they travel in
protectedSettings, never in publicSettings, which anyone with Reader on the VM can read.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from benchmarks.peers.webhook_receiver import WebhookReceiver
from forwarder.common.compat import tomllib
from forwarder.emulator import Emulator
from forwarder.sinkapi import Ok, Record, SinkContext
from sinks.webhook import WebhookSink
from tests.agent import AgentProcess, wait_until
from tests.integration.test_vm_extension import Vm, package, source_env_file, waagent  # noqa: F401 - fixtures

FUNCTION_KEY = "FnKey-0123456789abcdef-SECRET"
SIG = "sigSECRET0123456789"


def _record() -> Record:
    return Record.from_dict({"specversion": "1.0", "id": "id-1", "source": "/vm/web-0", "type": "scheduledevent.scheduled",
                             "subject": "E-1", "time": "2026-01-02T03:04:05Z", "data": {"EventId": "E-1"}})


@pytest.fixture
def vm(tmp_path: Path, waagent: tuple[Path, str]) -> Vm:  # noqa: F811
    return Vm(tmp_path, waagent)


def test_header_and_url_secrets_from_protected_settings_reach_the_receiver(vm: Vm, package: Path, tmp_path: Path) -> None:  # noqa: F811
    with Emulator(vms=["web-0"]) as emu, WebhookReceiver() as receiver:
        public = {
            "imds": {"endpoint": emu.url, "poll_interval": "500ms"},
            "state": {"dir": str(tmp_path / "state")},
            "agent": {"heartbeat": "0"},
            "sinks": [{"type": "webhook", "name": "logic-app", "url_env": "LOGIC_APP_URL",
                       "headers_env": {"x-functions-key": "FUNCTION_KEY"}, "headers": {"X-Team": "ops"}}],
        }
        protected = {"env": {"LOGIC_APP_URL": f"{receiver.url}?api-version=2016-10-01&sig={SIG}",
                             "FUNCTION_KEY": FUNCTION_KEY}}
        assert vm.ga.enable(package, "1.0.0", vm.settings(0, public, protected)), vm.ga.runs[-1].output
        config_text = vm.config.read_text()
        assert tomllib.loads(config_text)["sinks"][0]["headers_env"] == {"x-functions-key": "FUNCTION_KEY"}
        assert FUNCTION_KEY not in config_text and SIG not in config_text
        assert stat.S_IMODE(vm.env_file.stat().st_mode) == 0o600
        env = source_env_file(vm.env_file)
        assert env["FUNCTION_KEY"] == FUNCTION_KEY
        handler_log = (vm.ga.instances["1.0.0"].log_dir / "handler.log").read_text()
        assert FUNCTION_KEY not in handler_log + "".join(r.output for r in vm.ga.runs) and SIG not in handler_log

        # The agent the unit would start (its EnvironmentFile is that env file) delivers with them.
        agent = AgentProcess(vm.config, tmp_path / "agent.log", env=env)
        try:
            event_id = emu.schedule(type="Freeze", resources=["web-0"], start_after=600)
            got = wait_until(lambda: [r for r in receiver.requests if event_id.encode() in r.body], 60,
                             "the record at the receiver")
        finally:
            assert agent.terminate() == 0
        assert got[0].header("x-functions-key") == FUNCTION_KEY and got[0].header("x-team") == "ops"
        assert got[0].path == f"/hook?api-version=2016-10-01&sig={SIG}"
        assert FUNCTION_KEY not in agent.logs() and SIG not in agent.logs()


@pytest.mark.parametrize("sink, says, hides", [
    ({"type": "webhook", "name": "fn", "url": "https://fn.example.net/api/hook",
      "headers": {"x-functions-key": FUNCTION_KEY}}, "header 'x-functions-key' is a credential", FUNCTION_KEY),
    ({"type": "webhook", "name": "la", "url": f"https://prod.logic.azure.com/workflows/1/triggers/x?sv=1.0&sig={SIG}"},
     "query parameter(s) sig", SIG),
    ({"type": "webhook", "name": "auth", "url": "https://h.example/hook", "headers": {"Authorization": f"Bearer {SIG}"}},
     "header 'Authorization' is a credential", SIG),
])
def test_a_credential_in_public_settings_is_refused_without_echoing_it(vm: Vm, package: Path, sink, says, hides) -> None:  # noqa: F811
    assert not vm.ga.enable(package, "1.0.0", vm.settings(0, {"sinks": [sink]}))
    run = vm.ga.runs[-1]
    assert (run.command, run.exit_code) == ("enable", 12)
    report = vm.report()
    assert says in report.message and "protectedSettings.env" in report.message, report.message
    assert hides not in run.output + report.message
    assert not vm.config.exists()


def test_header_values_from_a_file_and_the_environment(tmp_path: Path, monkeypatch) -> None:
    key_file = tmp_path / "function-key"
    key_file.write_text(FUNCTION_KEY + "\n")
    monkeypatch.setenv("TEST_HOOK_AUTH", f"Bearer {SIG}")
    with WebhookReceiver() as receiver:
        monkeypatch.setenv("TEST_HOOK_URL", receiver.url + "?code=" + SIG)
        options = {"url_env": "TEST_HOOK_URL", "headers_file": {"x-functions-key": str(key_file)},
                   "headers_env": {"Authorization": "TEST_HOOK_AUTH"}}
        assert WebhookSink.check(options) == []
        sink = WebhookSink(options, SinkContext("hook", tmp_path / "s"))
        try:
            assert sink.send([_record()]) == Ok()
        finally:
            sink.close()
        (request,) = receiver.wait_for(1)
    assert request.header("x-functions-key") == FUNCTION_KEY and request.header("authorization") == f"Bearer {SIG}"
    assert request.path == f"/hook?code={SIG}"


@pytest.mark.parametrize("options, says", [
    ({"url": "https://h.example/", "url_env": "X"}, "set only one of url, url_env and url_file"),
    ({"url_env": "SEFWD_TEST_UNSET_VAR"}, "SEFWD_TEST_UNSET_VAR"),
    ({"url_file": "/nonexistent/url"}, "cannot read url_file"),
    ({"url": "https://h.example/", "headers_env": {"Authorization": "SEFWD_TEST_UNSET_VAR"}}, "SEFWD_TEST_UNSET_VAR"),
    ({"url": "https://h.example/", "headers_file": {"x-functions-key": "/nonexistent/key"}}, "cannot read /nonexistent/key"),
    ({"url": "https://h.example/", "headers_env": ["Authorization"]}, "must be a table"),
    ({"url": "https://h.example/", "headers": {"X-A": "1"}, "headers_env": {"x-a": "HOME"}}, "set twice"),
    ({"url": "https://h.example/", "headers_env": {"Content-Type": "HOME"}}, "set by the sink"),
])
def test_secret_sources_are_checked_with_clear_errors(options, says) -> None:
    problems = WebhookSink.check(options)
    assert any(says in p for p in problems), problems


def test_a_multiline_secret_header_is_refused_without_echoing_it(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(f"{SIG}\nX-Injected: 1\n")
    problems = WebhookSink.check({"url": "https://h.example/", "headers_file": {"x-functions-key": str(key_file)}})
    assert any("line breaks" in p for p in problems) and not any(SIG in p for p in problems)


def test_the_environment_variable_for_a_header_is_read_from_the_agents_environment(monkeypatch) -> None:
    monkeypatch.delenv("SEFWD_TEST_HDR", raising=False)
    assert WebhookSink.check({"url": "https://h.example/", "headers_env": {"X-K": "SEFWD_TEST_HDR"}})
    monkeypatch.setenv("SEFWD_TEST_HDR", "v")
    assert WebhookSink.check({"url": "https://h.example/", "headers_env": {"X-K": "SEFWD_TEST_HDR"}}) == []
    assert os.environ["SEFWD_TEST_HDR"] == "v"
