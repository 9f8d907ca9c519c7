"""deploy/linux: install.sh into a scratch root, the installed agent against the emulator, uninstall."""
from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path

import orjson
import pytest

from forwarder.emulator import Emulator
from tests.agent import ROOT, read_jsonl, wait_until

LINUX = ROOT / "deploy" / "linux"

pytestmark = pytest.mark.slow


def _env(**extra: str) -> dict[str, str]:
    # No SEFWD_*, PYTHONPATH or PREFIX from the caller: the installed venv alone must do.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SEFWD_") and k not in ("PYTHONPATH", "PREFIX", "VIRTUAL_ENV")}
    env.update(extra)
    return env


def _sh(*argv: str | Path, timeout: float = 60, env: dict[str, str] | None = None,
        cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout,
                          env=env or _env(), cwd=cwd)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def _files(root: Path) -> set[str]:
    """Every non-directory under ``root``, relative."""
    return {str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir() or p.is_symlink()}


def _verify_unit(unit: Path, sefwd: Path, tmp: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        return  # nothing to verify with; the unit's content is checked in tests/unit/test_deploy_files.py
    # verify checks that ExecStart exists: point it at the venv actually installed here.
    copy = tmp / "verify" / "sefwd.service"
    copy.parent.mkdir()
    copy.write_text(unit.read_text().replace("/opt/sefwd/venv/bin/sefwd", str(sefwd)))
    res = _sh("systemd-analyze", "verify", copy, cwd=tmp)
    complaints = [line for line in (res.stdout + res.stderr).splitlines() if "sefwd.service" in line]
    assert res.returncode == 0 and not complaints, res.stdout + res.stderr


def test_install_run_uninstall_in_a_scratch_root(tmp_path: Path) -> None:
    prefix = tmp_path / "root"
    had_build = (ROOT / "build").exists()
    install = _sh("bash", LINUX / "install.sh", "--prefix", prefix, "--source", ROOT, "--no-user", "--no-start",
                  timeout=300, cwd=tmp_path)
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    assert had_build or not (ROOT / "build").exists()  # built from a copy: the checkout is not written to

    venv = prefix / "opt" / "sefwd" / "venv"
    sefwd = venv / "bin" / "sefwd"
    config = prefix / "etc" / "sefwd" / "config.toml"
    unit = prefix / "etc" / "systemd" / "system" / "sefwd.service"
    assert os.access(sefwd, os.X_OK)
    # The agent imported is the venv's copy, not this checkout.
    where = _sh(venv / "bin" / "python", "-c", "import forwarder, sinks; print(forwarder.__file__, sinks.__file__)",
                cwd=tmp_path)
    assert where.returncode == 0 and where.stdout.count(str(venv)) == 2, where.stdout + where.stderr
    assert config.read_text() == (LINUX / "config.toml").read_text()
    assert unit.read_text() == (LINUX / "sefwd.service").read_text()
    assert _mode(config) == 0o640
    assert _mode(prefix / "etc" / "sefwd" / "env") == 0o600
    assert _mode(prefix / "var" / "lib" / "sefwd") == 0o750
    assert _mode(prefix / "var" / "log" / "sefwd") == 0o750
    assert _mode(unit) == 0o644
    assert (prefix / "usr" / "local" / "bin" / "sefwd").resolve() == sefwd.resolve()
    assert "SEFWD_CREATED_USER=no" in (prefix / "opt" / "sefwd" / "install.env").read_text().splitlines()
    _verify_unit(unit, sefwd, tmp_path)

    # A re-install (upgrade) keeps an edited config and puts its mode back.
    config.write_text(config.read_text() + "\n# edited by the operator\n")
    config.chmod(0o644)
    again = _sh("bash", LINUX / "install.sh", "--prefix", prefix, "--source", ROOT, "--extras", "",
                "--no-user", "--no-start", timeout=300, cwd=tmp_path)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert config.read_text().endswith("# edited by the operator\n") and _mode(config) == 0o640

    # The installed agent, with the installed config (its paths moved into tmp), against the emulator.
    state, logs = tmp_path / "state", tmp_path / "log"
    test_config = tmp_path / "config.toml"
    test_config.write_text(config.read_text().replace("/var/lib/sefwd", str(state)).replace("/var/log/sefwd", str(logs)))
    assert _sh(sefwd, "config", "check", "--config", test_config, cwd=tmp_path).returncode == 0
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        env = _env(SEFWD_IMDS_ENDPOINT=emu.url, SEFWD_AGENT_HEARTBEAT="0")
        event_id = emu.schedule(type="Reboot", resources=["myVM"], start_after=600)
        once = _sh(sefwd, "once", "--config", test_config, env=env, cwd=tmp_path)
        assert once.returncode == 0, once.stderr
        (record,) = [orjson.loads(line) for line in once.stdout.splitlines()]
        assert record["subject"] == event_id and record["type"] == "scheduledevent.scheduled"

        with open(tmp_path / "agent.log", "wb") as log:
            agent = subprocess.Popen([str(sefwd), "run", "--config", str(test_config)], env=env, cwd=tmp_path,
                                     stdout=subprocess.DEVNULL, stderr=log)
            try:
                out = logs / "events.jsonl"
                delivered = wait_until(
                    lambda: [r for r in read_jsonl(out) if r.get("subject") == event_id], 60, "the scheduled event in events.jsonl")
                assert delivered[0]["type"] == "scheduledevent.scheduled"
                assert delivered[0]["data"]["EventType"] == "Reboot"
                agent.send_signal(signal.SIGTERM)
                assert agent.wait(60) == 0, (tmp_path / "agent.log").read_text()[-3000:]
            finally:
                if agent.poll() is None:
                    agent.kill()
                    agent.wait(30)
        assert read_jsonl(out)[-1]["type"] == "forwarder.stopped"
        assert (state / "state.db").exists()

    # Uninstall with the copy install.sh left in /opt/sefwd (it deletes itself): config and state stay.
    (prefix / "var" / "lib" / "sefwd" / "journal-leftover").write_text("x")
    gone = _sh("bash", prefix / "opt" / "sefwd" / "uninstall.sh", "--prefix", prefix, cwd=tmp_path)
    assert gone.returncode == 0, gone.stdout + gone.stderr
    assert _files(prefix) == {"etc/sefwd/config.toml", "etc/sefwd/env", "var/lib/sefwd/journal-leftover"}
    assert not (prefix / "opt" / "sefwd").exists()

    purged = _sh("bash", LINUX / "uninstall.sh", "--prefix", prefix, "--purge", cwd=tmp_path)
    assert purged.returncode == 0, purged.stdout + purged.stderr
    assert _files(prefix) == set()
    assert [p for p in prefix.rglob("*") if "sefwd" in p.name] == []


def _installed_tree(prefix: Path) -> None:
    """What install.sh leaves under ``prefix`` (the venv reduced to its entry point: no pip install here)."""
    opt = prefix / "opt" / "sefwd"
    (opt / "venv" / "bin").mkdir(parents=True)
    (opt / "venv" / "bin" / "sefwd").write_text("#!/bin/sh\nexit 0\n")
    (opt / "install.env").write_text("SEFWD_CREATED_USER=no\n")
    shutil.copy(LINUX / "uninstall.sh", opt / "uninstall.sh")
    unit = prefix / "etc" / "systemd" / "system" / "sefwd.service"
    unit.parent.mkdir(parents=True)
    shutil.copy(LINUX / "sefwd.service", unit)
    link = prefix / "usr" / "local" / "bin" / "sefwd"
    link.parent.mkdir(parents=True)
    link.symlink_to("../../../opt/sefwd/venv/bin/sefwd")
    (prefix / "etc" / "sefwd").mkdir()
    (prefix / "etc" / "sefwd" / "config.toml").write_text("# config\n")
    (prefix / "var" / "lib" / "sefwd").mkdir(parents=True)
    (prefix / "var" / "lib" / "sefwd" / "state.db").write_bytes(b"undelivered records")


# A stand-in for systemctl (SEFWD_SYSTEMCTL): logs its arguments, then behaves as MODE says.
SYSTEMCTL_STUB = """#!/bin/sh
echo "$*" >> "{calls}"
case "{mode}:$1" in
  works:*) exit 0 ;;
  fails:*) echo "Failed to connect to bus: No such file or directory" >&2; exit 1 ;;
  hangs:daemon-reload) exec sleep 600 ;;
  hangs:*) exit 0 ;;
esac
"""


@pytest.mark.parametrize("mode", ["works", "fails", "missing", "hangs"])
def test_uninstall_goes_on_whatever_the_service_manager_does(tmp_path: Path, mode: str) -> None:
    """A failing, absent or hanging systemctl is a warning: the unit, the venv and the symlink go, exit 0,
    and a second run is harmless (the VM extension's uninstall relies on both)."""
    prefix = tmp_path / "root"
    _installed_tree(prefix)
    calls = tmp_path / "calls"
    stub = tmp_path / "systemctl"
    stub.write_text(SYSTEMCTL_STUB.format(calls=calls, mode=mode))
    stub.chmod(0o755)
    env = _env(SEFWD_SYSTEMCTL=str(tmp_path / "no-such-systemctl") if mode == "missing" else str(stub),
               SEFWD_SYSTEMCTL_LIMIT="2")  # the hanging daemon-reload is given up in 2 s, not 30
    started = time.monotonic()
    first = _sh("bash", prefix / "opt" / "sefwd" / "uninstall.sh", "--prefix", prefix, env=env, cwd=tmp_path, timeout=120)
    took = time.monotonic() - started
    assert first.returncode == 0, first.stdout + first.stderr
    assert _files(prefix) == {"etc/sefwd/config.toml", "var/lib/sefwd/state.db"}  # config and records kept
    assert "removed the unit and" in first.stdout
    made = calls.read_text().splitlines() if calls.exists() else []
    if mode == "missing":
        assert made == [] and "not found" in first.stderr
    else:
        assert made[:2] == ["disable --now sefwd.service", "daemon-reload"]
    if mode == "works":
        assert made == ["disable --now sefwd.service", "daemon-reload", "reset-failed sefwd.service"]
        assert "warning" not in first.stderr
    elif mode == "fails":
        assert first.stderr.count("warning:") == 2  # disable and daemon-reload; reset-failed is quiet
        assert "daemon-reload failed (exit 1): Failed to connect to bus" in first.stderr
    elif mode == "hangs":
        assert "daemon-reload failed (did not finish within 2 s)" in first.stderr
        assert took < 30
        assert "svc 30 loud daemon-reload" in (LINUX / "uninstall.sh").read_text()  # the real limit, shortened here
    again = _sh("bash", LINUX / "uninstall.sh", "--prefix", prefix, env=env, cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert (calls.read_text().splitlines() if calls.exists() else []) == made  # nothing left to stop or reload
    assert "warning" not in again.stderr
    purged = _sh("bash", LINUX / "uninstall.sh", "--prefix", prefix, "--purge", env=env, cwd=tmp_path)
    assert purged.returncode == 0 and _files(prefix) == set(), purged.stdout + purged.stderr
