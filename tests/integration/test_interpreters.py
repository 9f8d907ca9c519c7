"""The agent installs and runs on the oldest and newest supported CPython, not only the one running the suite.

Each test makes a fresh venv of that interpreter and pip-installs the project's wheel into it. On 3.10
and 3.13 (the ends of the supported range) the unit tests run there too, and the shipped example
configs are checked by that interpreter's `sefwd config check`.
"""
from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import orjson
import pytest

from benchmarks.peers.webhook_receiver import WebhookReceiver
from forwarder.emulator import Emulator
from tests.agent import ROOT, read_jsonl, wait_until, write_config
from tests.interpreters import clean_env, make_venv, pip, project_wheel, python_or_skip

CHANGES = ("scheduledevent.scheduled", "scheduledevent.started", "scheduledevent.completed")


def sefwd(bin_dir: Path, *args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(bin_dir / "sefwd"), *args], capture_output=True, text=True, timeout=timeout,
                          env=clean_env(), cwd=str(cwd))


def forwards_end_to_end(bin_dir: Path, tmp: Path) -> None:
    """`sefwd run` of that venv: an event's whole life reaches the file and the webhook sink."""
    out = tmp / "out.jsonl"
    with Emulator(vms=["myVM"], rate_limit=None) as emu, WebhookReceiver() as hook:
        sinks = (f'[[sinks]]\ntype = "file"\nname = "file"\npath = "{out}"\n'
                 f'[[sinks]]\ntype = "webhook"\nname = "hook"\nurl = "{hook.url}"\n')
        config = write_config(tmp / "c.toml", emu.url, tmp / "state", sinks=sinks)
        check = sefwd(bin_dir, "config", "check", "--config", str(config), cwd=tmp)
        assert check.returncode == 0, check.stderr
        with open(tmp / "agent.log", "wb") as log:
            agent = subprocess.Popen([str(bin_dir / "sefwd"), "run", "--config", str(config)], stdout=subprocess.DEVNULL,
                                     stderr=log, env=clean_env(), cwd=str(tmp))
        try:
            # after the agent's first poll: an event over before that would leave nothing to see
            wait_until(lambda: any(r["type"] == "forwarder.started" for r in read_jsonl(out)), 90, "the agent's start")
            event_id = emu.schedule(type="Reboot", resources=["myVM"], duration=2, start_after=2)

            def delivered(records: list[dict]) -> bool:
                return {r["type"] for r in records if r.get("subject") == event_id} >= set(CHANGES)

            wait_until(lambda: delivered(read_jsonl(out)), 90, "the event's scheduled/started/completed in the file sink")
            wait_until(lambda: delivered([orjson.loads(r.body) for r in hook.requests]), 60,
                       "the same records at the webhook")
        finally:
            agent.send_signal(signal.SIGTERM)
            code = agent.wait(60)
    assert code == 0, (tmp / "agent.log").read_text()[-3000:]


@pytest.mark.slow  # a venv and a pip install per interpreter
@pytest.mark.parametrize("minor", ["3.10", "3.12", "3.13"])
def test_pip_install_and_run_end_to_end(minor: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    python = python_or_skip(minor)
    wheel = project_wheel(tmp_path_factory)
    bin_dir = make_venv(python, tmp_path / "venv")
    pip(bin_dir, str(wheel))  # the default install: no extra (stdout, file and webhook sinks)
    version = sefwd(bin_dir, "--version", cwd=tmp_path)
    assert version.returncode == 0, version.stderr
    lines = version.stdout.splitlines()
    assert lines[0] == "sefwd " + wheel.name.split("-")[1] and "+" in lines[0]  # the build's own version
    assert lines[1].startswith(f"Python {minor}.") and str(tmp_path / "venv") in lines[1]
    assert lines[2].startswith("extras: none; not installed: ") and "eventhubs" in lines[2]
    forwards_end_to_end(bin_dir, tmp_path)


def shipped_examples(bin_dir: Path, tmp: Path) -> list[Path]:
    """`sefwd config example` and deploy/linux/config.toml, their Linux paths moved into ``tmp``."""
    example = sefwd(bin_dir, "config", "example", cwd=tmp)
    assert example.returncode == 0, example.stderr
    texts = {"example": example.stdout, "linux": (ROOT / "deploy/linux/config.toml").read_text()}
    paths = []
    for name, text in texts.items():
        path = tmp / f"{name}.toml"
        path.write_text(text.replace("/var/lib/sefwd", str(tmp / "state")).replace("/var/log/sefwd", str(tmp / "log")))
        paths.append(path)
    return paths


def unit_tests_and_shipped_configs(minor: str, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The unit tests, and `config check` of the shipped configs, in a venv of ``minor`` with every extra."""
    python = python_or_skip(minor)
    wheel = project_wheel(tmp_path_factory)
    bin_dir = make_venv(python, tmp_path / "venv")
    pip(bin_dir, f"{wheel}[test]")
    for config in shipped_examples(bin_dir, tmp_path):
        check = sefwd(bin_dir, "config", "check", "--config", str(config), cwd=tmp_path)
        assert check.returncode == 0, f"{config.name}: {check.stderr}"
    # The checkout's unit tests with this interpreter (the checkout's code first on sys.path, as in CI);
    # mypy is left to the main run (it checks the 3.10 target from any interpreter).
    env = clean_env(SEFWD_HYPOTHESIS="dev", PYTHONPATH=str(ROOT))
    done = subprocess.run([str(bin_dir / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                           "--deselect", "tests/unit/test_typecheck.py::test_mypy_clean", "tests/unit"],
                          capture_output=True, text=True, timeout=1200, env=env, cwd=str(ROOT))
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0 and " passed" in summary and "failed" not in summary, done.stdout[-6000:] + done.stderr[-2000:]
    print(f"CPython {minor}: unit tests: {summary}")


# Two tests, not one parametrized: the suite hands a test function to one worker whole, and these are
# the longest of the run (minutes each), so they start first and side by side (tests/durations.json).
@pytest.mark.slow  # a venv with every extra, then the unit tests on another interpreter
@pytest.mark.timeout(1800)
def test_unit_tests_and_shipped_configs_on_3_10(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    unit_tests_and_shipped_configs("3.10", tmp_path, tmp_path_factory)


@pytest.mark.slow  # a venv with every extra, then the unit tests on another interpreter
@pytest.mark.timeout(1800)
def test_unit_tests_and_shipped_configs_on_3_13(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    unit_tests_and_shipped_configs("3.13", tmp_path, tmp_path_factory)
