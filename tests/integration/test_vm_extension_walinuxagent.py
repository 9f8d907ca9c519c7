"""The VM extension handler under the real Azure Linux guest agent's code (tests/peers/walinuxagent.py).

Skipped unless ``SEFWD_WALINUXAGENT_SRC`` names a checkout of github.com/Azure/WALinuxAgent (the
directory holding ``azurelinuxagent``) and the ``distro`` package is installed: neither is on PyPI
for this project's test run, so CI skips these and the simulated guest agent
(tests/peers/guest_agent.py, written from that same code) carries the behaviour there.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.agent import wait_until
from tests.integration.test_vm_extension import (  # noqa: F401  (fixtures)
    GA_STUB, PARTIAL_INSTALL, PUBLIC, REPO, UNITS, Ext, _alive, ext, package, repackage, waagent,
)

SRC = os.environ.get("SEFWD_WALINUXAGENT_SRC", "")
pytestmark = pytest.mark.skipif(
    not (SRC and (Path(SRC) / "azurelinuxagent" / "ga" / "exthandlers.py").is_file()
         and importlib.util.find_spec("distro") is not None),
    reason="needs SEFWD_WALINUXAGENT_SRC (a WALinuxAgent checkout) and the distro package")


def walinuxagent(scenario: str, args: dict, env: dict[str, str]) -> dict:
    """One scenario of tests/peers/walinuxagent.py in a process of its own, with ``env`` as waagent's environment."""
    full = {**env, "PYTHONPATH": os.pathsep.join([SRC, str(REPO)])}
    proc = subprocess.run([sys.executable, "-m", "tests.peers.walinuxagent", scenario, json.dumps(args)], cwd=REPO,
                          env=full, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def handler_env(ext: Ext, stub: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SEFWD_", "ConfigSequence", "STUB_"))}
    env.update({"SEFWD_EXT_ROOT": str(ext.root), "SEFWD_EXT_WAAGENT_DIR": str(ext.waagent_dir),
                "SEFWD_EXT_SERVICE_CMD": str(stub), "SEFWD_EXT_SEFWD_CMD": f"{sys.executable} -m forwarder",
                "SEFWD_EXT_SKIP_INSTALL": "1", "STUB_CALLS": str(ext.calls_file), "ConfigSequenceNumber": "0"})
    return env


def test_the_guest_agents_kill_at_its_limit_reaches_the_handlers_children(ext: Ext, tmp_path: Path) -> None:
    """waagent SIGKILLs the command's process group at its limit: a hung systemctl (and what it
    started) must die with the handler, and the next enable finish what the killed one began."""
    stub = tmp_path / "hanging-systemctl"
    stub.write_text(GA_STUB)
    stub.chmod(0o755)
    ext.settings(0, PUBLIC)
    env = {**handler_env(ext, stub), "STUB_HANG": "enable*"}
    result = walinuxagent("timeout", {
        "lib": str(tmp_path / "lib"), "log": str(tmp_path / "log"), "cwd": str(ext.dir), "name": "enable",
        "timeout": 3, "command": f"{sys.executable} {ext.dir / 'handler.py'} enable"}, env)
    assert result["code"] == 1011 and result["message"].startswith("[ExtensionError] Timeout(3): ")
    child = int(Path(f"{ext.calls_file}.child").read_text())
    wait_until(lambda: not _alive(child), 10, "the hung systemctl's child killed with the handler's process group")

    env.pop("STUB_HANG")
    result = walinuxagent("timeout", {
        "lib": str(tmp_path / "lib"), "log": str(tmp_path / "log"), "cwd": str(ext.dir), "name": "enable",
        "timeout": 120, "command": f"{sys.executable} {ext.dir / 'handler.py'} enable"}, env)
    assert result["code"] == 0, result
    assert ext.calls()[-1] == f"restart {UNITS}"  # the killed enable's change is applied


def test_removing_the_extension_after_a_failed_install_leaves_nothing(ext: Ext, package: Path, tmp_path: Path) -> None:
    """waagent runs no uninstall for a handler whose install failed (its state is still NotInstalled)
    and deletes the handler's directory: the failed install must have undone its own work."""
    pkg = repackage(package, tmp_path / "partial.zip", {
        "wheels/scheduled_events_forwarder-0.1.0-py3-none-any.whl": "", "linux/install.sh": PARTIAL_INSTALL})
    env = {**handler_env(ext, ext.stub), "SEFWD_EXT_SKIP_INSTALL": "0"}
    result = walinuxagent("failed-install-removed", {
        "lib": str(tmp_path / "lib"), "log": str(tmp_path / "log"), "package": str(pkg),
        "name": "Contoso.Sefwd.ScheduledEventsForwarder", "version": "1.0.0"}, env)
    assert result["install"] == 1007 and result["state_at_removal"] == "NotInstalled"
    assert result["base_dir_left"] is False
    log = (tmp_path / "log" / "Contoso.Sefwd.ScheduledEventsForwarder" / "handler.log").read_text()
    assert "Install (sequence number" in log and "Uninstall (sequence number" not in log  # waagent ran none
    assert "the partial installation was removed" in log
    assert not (ext.root / "opt/sefwd").exists() and not (ext.root / "etc/sefwd").exists()
