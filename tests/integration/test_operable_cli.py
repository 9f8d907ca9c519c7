"""Issue 32, the smaller frictions: compound durations, usage errors labelled usage, notify's set-up
messages, the read-only config view, and the wait line naming a cause at once."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from forwarder.agent.config import parse_config
from forwarder.agent.read_view import load_for_reading
from forwarder.agent.status import format_status
from forwarder.agent.waiting import WaitNotice
from forwarder.common.values import duration, parse_duration
from forwarder.errors import ConfigError
from tests.agent import ROOT, wait_until


@pytest.mark.parametrize(("text", "seconds"), [("2m15s", 135.0), ("1h30m", 5400.0), ("1d12h", 129600.0),
                                               ("1s500ms", 1.5), ("1h 30m", 5400.0), ("2m15.5s", 135.5)])
def test_compound_durations(text, seconds):
    assert parse_duration(text) == seconds
    assert duration(0.0, 7 * 86400.0)(text) == seconds


@pytest.mark.parametrize("text", ["15s2m", "1m1m", "2m15", "1h-30m", "2m15sx", "m", "1h30"])
def test_a_compound_duration_out_of_order_or_incomplete_is_refused(text):
    with pytest.raises(ValueError, match="2m15s"):
        parse_duration(text)


def test_compound_durations_in_the_config_and_its_environment(tmp_path):
    config = parse_config({"approval": {"hook_timeout": "2m15s"}}, {"SEFWD_IMDS_COMPUTE_REFRESH": "1h30m"},
                          str(tmp_path / "c.toml"))
    assert config.imds.compute_refresh == 5400.0 and config.approval.hook_timeout == 135.0


def sefwd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "forwarder", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=60)


def test_usage_errors_say_usage_not_invalid_configuration():
    res = sefwd("approve", "E1", "--via", "arm")  # --resource-id missing
    assert res.returncode == 2
    assert res.stderr.startswith("sefwd: usage: --via arm needs --resource-id"), res.stderr
    assert "invalid configuration" not in res.stderr
    res = sefwd("emulator", "--listen", "nonsense:port:x")
    assert res.returncode == 2 and "sefwd: usage: --listen" in res.stderr


def test_notify_names_its_extra_when_jinja2_is_missing():
    script = ("import sys; sys.modules['jinja2'] = None  # as if the extra were not installed\n"
              "from sinks.notify import NotifySink\n"
              "print(NotifySink.check({'urls': ['json://127.0.0.1:9/x']}))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "the notify sink needs jinja2; install it with: pip install 'scheduled-events-forwarder[notify]'" in done.stdout
    assert "ModuleNotFoundError" not in done.stdout


def test_notify_url_hints_point_teams_at_workflows():
    from sinks.notify import NotifySink

    assert any("workflows://" in p and "msteams" not in p for p in NotifySink.check({"urls": ["not a url"]}))
    assert any("workflows://" in p for p in NotifySink.check({}))


def test_config_check_shows_the_notify_variable_by_name_and_its_targets_never_the_url(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text(f'[state]\ndir = "{tmp_path / "s"}"\n[[sinks]]\ntype = "notify"\nurls_env = "SEFWD_NOTIFY_URLS"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEFWD_")}
    env["SEFWD_NOTIFY_URLS"] = "json://127.0.0.1:9/SECRETPATH99"
    res = subprocess.run([sys.executable, "-m", "forwarder", "config", "check", "--config", str(config)],
                         capture_output=True, text=True, cwd=ROOT, timeout=60, env=env)
    assert res.returncode == 0, res.stderr
    assert "urls_env=SEFWD_NOTIFY_URLS (set, 1 target: json)" in res.stdout
    assert "SECRETPATH99" not in res.stdout + res.stderr and "***" not in res.stdout


def test_the_read_only_view_needs_only_state(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text(f'[state]\ndir = "{tmp_path / "s"}"\n[[sinks]]\ntype = "webhook"\nname = "pager"\n'
                      'url = "https://example.com/h"\nsecret_env = "NOT_SET_ANYWHERE_32"\n[imds]\nbogus = 1\n')
    view = load_for_reading(config, env={"HOME": str(tmp_path)})
    assert view.state_dir == tmp_path / "s" and view.sink_names == ("pager",) and view.config is None
    assert any("NOT_SET_ANYWHERE_32" in w for w in view.warnings) and any("imds.bogus" in w for w in view.warnings)
    env_view = load_for_reading(config, env={"SEFWD_STATE_DIR": str(tmp_path / "t"), "SEFWD_IMDS_TIMEOUT": "x"})
    assert env_view.state_dir == tmp_path / "t"  # [state] overrides count; other sections' are warnings
    config.write_text('[state]\ndir = ["not", "a", "path"]\n')
    with pytest.raises(ConfigError, match="state.dir"):
        load_for_reading(config, env={})


def test_status_page_has_no_python_reprs_and_dates_a_stopped_agents_events(tmp_path):
    report = {"running": False, "state_dir": str(tmp_path), "document_incarnation": None, "current_events": [],
              "dead_letters": {}, "backlog": {}, "lost": {}, "actions": {},
              "agent": {"updated": "2026-11-27T03:00:00Z", "stopped": True, "imds": {}, "sinks": {}}}
    page = format_status(report)
    assert "None" not in page
    assert "events as of 2026-11-27T03:00:00Z, when the agent stopped; not current (no document read yet): 0" in page


def test_a_new_cause_is_said_at_once_not_after_the_first_delay():
    lines: list[str] = []
    cause: list[str] = []
    said = threading.Event()

    def say(line: str) -> None:
        lines.append(line)
        said.set()

    notice = WaitNotice(say, lambda: "waiting" + (f": {cause[0]}" if cause else ""), first=60.0,
                        cause=lambda: cause[0] if cause else None)
    with notice:
        cause.append("connection refused")
        wait_until(said.is_set, 5, "the cause said")  # long before the first 60 s reminder
    assert lines == ["waiting: connection refused"]
