"""The VM extension's launcher (deploy/vm-extension/handler.sh) finds a Python >= 3.10, or says what to install."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT

EXT_SRC = ROOT / "deploy" / "vm-extension"
COMMANDS = ("install", "enable", "disable", "uninstall", "update")
# The few tools the launcher uses; a PATH of only these (plus the test's pythons) keeps the
# machine's own python3 out of sight.
TOOLS = ("sh", "sed", "tr", "date", "mkdir", "mv", "ls", "head", "dirname", "cat", "rm", "env", "printf")
# What a CPython 3.6 does with a handler using `from __future__ import annotations`.
FAKE_OLD_PYTHON = """#!/bin/sh
if [ "$1" = "-c" ]; then echo 3.6.8; exit 1; fi
echo '  File "handler.py", line 15' >&2
echo 'SyntaxError: future feature annotations is not defined' >&2
exit 1
"""
RHEL8 = 'NAME="Red Hat Enterprise Linux"\nVERSION_ID="8.10"\nID="rhel"\nID_LIKE="fedora"\nPRETTY_NAME="Red Hat Enterprise Linux 8.10 (Ootpa)"\n'
SLES15 = 'NAME="SLES"\nVERSION_ID="15.6"\nID="sles"\nID_LIKE="suse"\nPRETTY_NAME="SUSE Linux Enterprise Server 15 SP6"\n'
UBUNTU20 = 'NAME="Ubuntu"\nVERSION_ID="20.04"\nID=ubuntu\nID_LIKE=debian\nPRETTY_NAME="Ubuntu 20.04.6 LTS"\n'


def pyenv_python(version: str) -> Path | None:
    """A pyenv CPython of that minor version on this machine, if any."""
    for d in sorted(Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"), "versions").glob(version + ".*")):
        exe = d / "bin" / ("python" + version)
        if exe.exists():
            return exe
    return None


class Ext:
    """An extension dir with handler.sh, handler.py and the waagent-made folders; a PATH of our choosing."""

    def __init__(self, tmp: Path, os_release: str = RHEL8) -> None:
        self.dir = tmp / "ext"
        self.dir.mkdir()
        for name in ("handler.sh", "handler.py", "HandlerManifest.json"):
            shutil.copy2(EXT_SRC / name, self.dir / name)
        self.status_dir, self.config_dir, self.log_dir = tmp / "status", tmp / "config", tmp / "log"
        self.config_dir.mkdir()
        (self.dir / "HandlerEnvironment.json").write_text(json.dumps([{
            "version": 1.0, "name": "Sefwd.Linux",
            "handlerEnvironment": {"logFolder": str(self.log_dir), "configFolder": str(self.config_dir),
                                   "statusFolder": str(self.status_dir), "heartbeatFile": str(tmp / "heartbeat.log")},
        }], indent=1))
        self.root = tmp / "root"
        (self.root / "etc").mkdir(parents=True)
        (self.root / "etc/os-release").write_text(os_release)
        self.bin = tmp / "bin"
        self.bin.mkdir()
        for tool in TOOLS:
            found = shutil.which(tool)
            assert found, tool
            (self.bin / tool).symlink_to(found)

    def python(self, name: str, target: Path | None = None) -> None:
        """Put a python on PATH: a link to a real one, or the fake 3.6."""
        if target is None:
            (self.bin / name).write_text(FAKE_OLD_PYTHON)
            (self.bin / name).chmod(0o755)
        else:
            (self.bin / name).symlink_to(target)

    def run(self, command: str, seq: str | None = "3") -> subprocess.CompletedProcess[str]:
        env = {"PATH": str(self.bin), "SEFWD_EXT_ROOT": str(self.root), "SEFWD_EXT_SKIP_INSTALL": "1",
               "SEFWD_EXT_SERVICE_CMD": "true", "HOME": str(self.root)}
        if seq is not None:
            env["ConfigSequenceNumber"] = seq
        # as waagent runs it: through a shell, from the extension dir
        return subprocess.run(f"{self.dir}/handler.sh {command}", shell=True, executable="/bin/sh", cwd=self.dir,
                              env=env, capture_output=True, text=True, timeout=60)

    def status(self, seq: str = "3") -> dict:
        return json.loads((self.status_dir / f"{seq}.status").read_text())[0]["status"]


def test_every_command_without_a_suitable_python_writes_a_status_naming_what_to_install(tmp_path: Path) -> None:
    ext = Ext(tmp_path)
    ext.python("python3")  # RHEL 8's python3 is 3.6
    for command in COMMANDS:
        done = ext.run(command)
        status = ext.status()
        message = status["formattedMessage"]["message"]
        assert status["operation"] == command.capitalize() and "Traceback" not in done.stdout + done.stderr
        assert "no Python 3.10 or newer" in message and "python3 3.6.8 at " in message, message
        assert "Red Hat Enterprise Linux 8.10" in message and "dnf install python3.12" in message, message
        if command in ("disable", "uninstall"):  # must not block an uninstall or an update
            assert done.returncode == 0 and status["status"] == "warning" and status["code"] == 0, done.stdout
        else:
            assert done.returncode == 21 and status["status"] == "error" and status["code"] == 21, done.stdout
        # the one line waagent reports while the handler is not installed
        assert done.stdout.startswith(command.capitalize()) and "dnf install python3.12" in done.stdout


@pytest.mark.parametrize("os_release, remedy", [(SLES15, "zypper install python311"),
                                                (UBUNTU20, "apt-get install python3 python3-venv")])
def test_the_remedy_follows_the_distribution_family(tmp_path: Path, os_release: str, remedy: str) -> None:
    ext = Ext(tmp_path, os_release)
    ext.python("python3")
    ext.run("install", seq=None)
    (ext.config_dir / "7.settings").write_text("")
    ext.run("enable", seq=None)  # no ConfigSequenceNumber: the newest settings file names the status
    assert remedy in ext.status("0")["formattedMessage"]["message"]
    assert remedy in ext.status("7")["formattedMessage"]["message"]


def test_no_python_at_all_is_reported_too(tmp_path: Path) -> None:
    ext = Ext(tmp_path)
    done = ext.run("install")
    assert done.returncode == 21 and "is on PATH" in ext.status()["formattedMessage"]["message"], done.stdout


def test_a_real_python_3_6_fails_on_the_handler_but_not_on_the_launcher(tmp_path: Path) -> None:
    old = pyenv_python("3.6")
    if old is None:
        pytest.skip("no CPython 3.6 on this machine (pyenv); the fake 3.6 test covers the launcher")
    # before: the handler itself under 3.6 dies with a SyntaxError and writes nothing
    direct = subprocess.run([str(old), str(EXT_SRC / "handler.py"), "install"], capture_output=True, text=True, timeout=60)
    assert direct.returncode != 0 and "SyntaxError" in direct.stderr
    ext = Ext(tmp_path)
    ext.python("python3", old)
    done = ext.run("install")
    assert done.returncode == 21 and "Traceback" not in done.stderr
    assert "python3 3.6." in ext.status()["formattedMessage"]["message"]


def test_a_versioned_python_beside_an_old_python3_is_chosen_and_named(tmp_path: Path) -> None:
    new = pyenv_python("3.10") or pyenv_python("3.13") or pyenv_python("3.12")
    if new is None:
        pytest.skip("no CPython 3.10, 3.12 or 3.13 in pyenv on this machine")
    ext = Ext(tmp_path)
    ext.python("python3")  # 3.6: skipped
    minor = new.name.removeprefix("python")
    ext.python(new.name, new)
    done = ext.run("install")
    status = ext.status()
    assert done.returncode == 0 and status["status"] == "success", done.stdout + done.stderr
    message = status["formattedMessage"]["message"]
    assert message.startswith("install skipped") and f"[Python {minor}." in message and f"{new.name}]" in message, message
