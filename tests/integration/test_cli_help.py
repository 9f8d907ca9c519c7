"""Help a person can read: a description and examples for every command, correct usage lines."""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

from forwarder.agent.cli import build_parser
from forwarder.emulator import Emulator
from tests.agent import ROOT, wait_until, write_config


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEFWD_")}
    env["PYTHONPATH"] = str(ROOT)
    return env


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=60, env=_env(), cwd=str(ROOT))


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name), sub
                yield from _commands(sub, (*path, name))


def test_every_subcommand_has_a_description_and_an_example():
    commands = dict(_commands(build_parser()))
    assert {("demo",), ("run",), ("once",), ("emulator",), ("emulator", "ctl"), ("approve",), ("status",),
            ("deadletter", "list"), ("deadletter", "replay"), ("config", "check"), ("config", "example")} <= set(commands)
    for path, sub in commands.items():
        if path[:2] == ("emulator", "ctl") and len(path) > 2:
            continue  # the ctl actions are one-liners under `ctl --help`
        assert sub.description, f"sefwd {' '.join(path)} has no description"
        assert sub.epilog and "examples:" in sub.epilog, f"sefwd {' '.join(path)} has no example"


def test_emulator_usage_does_not_make_ctl_look_required():
    res = _run("-m", "forwarder", "emulator", "--help")
    assert res.returncode == 0
    usage = res.stdout.split("\n\n")[0]
    assert usage == "usage: sefwd emulator [options]\n       sefwd emulator ctl URL ACTION [...]"


def test_python_m_forwarder_emulator_names_itself():
    res = _run("-m", "forwarder.emulator", "--help")
    assert res.returncode == 0
    assert res.stdout.startswith("usage: python -m forwarder.emulator [options]\n")
    assert "forwarder.emulator emulator" not in res.stdout
    ctl = _run("-m", "forwarder.emulator", "ctl", "--help")
    assert ctl.stdout.startswith("usage: python -m forwarder.emulator ctl ")


def test_emulator_prints_its_url_once():
    proc = subprocess.Popen([sys.executable, "-m", "forwarder", "emulator", "--listen", "127.0.0.1:0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=str(ROOT))
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()
        assert first.startswith("IMDS emulator at http://127.0.0.1:")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    url = first.split()[3]
    assert (first + err).count(url + " ") == 1, first + err
    assert err.strip() == "IMDS emulator stopped"


def test_approve_prints_its_result_on_stdout_only(tmp_path):
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        event_id = emu.schedule(type="Reboot", resources=["myVM"], start_after=600)
        config = write_config(tmp_path / "c.toml", emu.url, tmp_path / "state")
        config.write_text(config.read_text().replace('log_level = "debug"', 'log_level = "info"'))
        res = _run("-m", "forwarder", "approve", "--config", str(config), event_id)
        assert res.returncode == 0, res.stderr
        assert res.stdout == f"approved {event_id}\n"
        assert res.stderr == ""
        wait_until(lambda: emu.stats()["start_requests"], 10, "the StartRequests")
