"""Issue 32 item 3: what can fail at start is named before ``forwarder.started``, each for what it is.

The probe's state file and the extension heartbeat file (a directory, a missing or non-directory
parent) stop ``sefwd run`` with exit 1 and one line per file; a configured sink whose extra is not
installed stops it with exit 2 naming the extra. Each against the real agent process.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from forwarder.emulator import Emulator
from tests.agent import ROOT, AgentProcess, read_jsonl, wait_until
from tests.integration.test_operator_scenarios import sefwd

pytestmark = pytest.mark.timeout(120)


def _config(tmp_path: Path, endpoint: str, extra: str) -> tuple[Path, Path]:
    out = tmp_path / "out.jsonl"
    config = tmp_path / "config.toml"
    config.write_text(f'[imds]\nendpoint = "{endpoint}"\n[state]\ndir = "{tmp_path / "state"}"\n{extra}\n'
                      f'[[sinks]]\ntype = "file"\npath = "{out}"\n')
    return config, out


def test_a_state_file_that_is_a_directory_and_a_heartbeat_without_its_directory_fail_before_started(tmp_path):
    state_file = tmp_path / "maintenance.json"
    state_file.mkdir()
    heartbeat = tmp_path / "no-such-dir" / "heartbeat.json"
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        config, out = _config(tmp_path, emu.url, f'[agent]\nheartbeat_file = "{heartbeat}"\n'
                                                 f'[probe]\nstate_file = "{state_file}"\n')
        res = sefwd("run", "--config", str(config))
        requests = emu.stats()["requests"]
    assert res.returncode == 1, res.stderr  # like a busy port: not a config error
    lines = res.stderr.splitlines()
    assert f"  - probe.state_file {state_file}: cannot write: it is a directory" in lines, res.stderr
    assert f"  - agent.heartbeat_file {heartbeat}: cannot write: directory {heartbeat.parent} does not exist" \
        in lines, res.stderr
    assert "started" not in res.stderr and "invalid configuration" not in res.stderr
    assert not out.exists() and not heartbeat.parent.exists() and list(state_file.iterdir()) == []
    assert requests == {}  # stopped before asking IMDS anything


def test_a_state_file_under_a_regular_file_fails_before_started(tmp_path):
    blocker = tmp_path / "run"
    blocker.write_text("not a directory\n")
    state_file = blocker / "sefwd" / "maintenance.json"
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        config, out = _config(tmp_path, emu.url, f'[probe]\nstate_file = "{state_file}"\n')
        res = sefwd("run", "--config", str(config))
    assert res.returncode == 1, res.stderr
    assert f"probe.state_file {state_file}: cannot write: {blocker} is not a directory" in res.stderr
    assert "started" not in res.stderr
    assert not out.exists() and blocker.read_text() == "not a directory\n"


def test_files_in_directories_the_agent_can_write_or_create_pass(tmp_path):
    """The check refuses nothing the writers can do: the state file's missing directories are made."""
    state_file = tmp_path / "new" / "dirs" / "maintenance.json"
    heartbeat = tmp_path / "heartbeat.json"
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        config, out = _config(tmp_path, emu.url, f'[agent]\nheartbeat_file = "{heartbeat}"\n'
                                                 f'[probe]\nstate_file = "{state_file}"\n')
        agent = AgentProcess(config, tmp_path / "agent.log")
        try:
            wait_until(lambda: any(r["type"] == "forwarder.started" for r in read_jsonl(out)), 60, "started")
            wait_until(lambda: state_file.exists() and heartbeat.exists(), 30, "both files written")
        finally:
            assert agent.terminate() == 0
    assert "cannot write" not in agent.logs()


def test_a_configured_sink_without_its_extra_is_named_before_started(tmp_path):
    """`sefwd run` itself, with azure-identity missing as if the [appinsights] extra were not installed."""
    out = tmp_path / "out.jsonl"
    config = tmp_path / "config.toml"
    config.write_text(f'[imds]\nendpoint = "http://127.0.0.1:9"\n[state]\ndir = "{tmp_path / "state"}"\n'
                      f'[[sinks]]\ntype = "file"\npath = "{out}"\n'
                      '[[sinks]]\ntype = "appinsights"\nname = "ai"\nconnection_string_env = "TEST_AI_CONN"\n'
                      'credential = "managed_identity"\n')
    code = ("import sys; sys.modules['azure.identity'] = None\n"
            "from forwarder.agent.cli import main\n"
            f"sys.exit(main(['run', '--config', {str(config)!r}]))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEFWD_")}
    env.update(PYTHONPATH=str(ROOT), TEST_AI_CONN="InstrumentationKey=00000000-0000-0000-0000-000000000000")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(ROOT), env=env,
                         timeout=60)
    assert res.returncode == 2, res.stderr
    assert "sinks[1] (ai)" in res.stderr and "pip install 'scheduled-events-forwarder[appinsights]'" in res.stderr
    assert "started" not in res.stderr and not out.exists()
