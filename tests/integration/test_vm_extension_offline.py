"""The VM extension built with --offline installs under the guest agent with no package index, and an
update to the next build runs the new code."""
from __future__ import annotations

import platform
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.agent import ROOT
from tests.interpreters import MARKER_CHECK, marked_build, offline_env, shared_build
from tests.peers.guest_agent import GuestAgent, Settings

EXT_SRC = ROOT / "deploy" / "vm-extension"


def offline_package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """build.sh --offline, narrowed to this machine's architecture and the Python the handler will pick here."""
    machine = platform.machine()
    if machine not in ("x86_64", "aarch64"):
        pytest.skip(f"the bundle has manylinux wheels for x86_64 and aarch64, not {machine}")
    minor = "%d.%d" % sys.version_info[:2]
    return shared_build(tmp_path_factory, "sefwd-ext-offline",
                        ["bash", str(EXT_SRC / "build.sh"), "--offline", "--pythons", minor, "--archs", machine, "--out"])


def next_build(package: Path, tmp: Path) -> Path:
    """The same extension with the next build of the agent: a marker in its code, and the same version number."""
    with zipfile.ZipFile(package) as zf:
        (old,) = [n for n in zf.namelist() if n.startswith("wheels/")]
    wheel = marked_build(tmp, old.split("+", 1)[1].split("-", 1)[0])
    assert "wheels/" + wheel.name == old  # pip alone would call it "already installed"
    newer = tmp / "newer.zip"
    replaced = {old, "wheelhouse/" + wheel.name}
    with zipfile.ZipFile(package) as zin, zipfile.ZipFile(newer, "w", zipfile.ZIP_DEFLATED) as zout:
        for item in zin.infolist():
            zout.writestr(item, wheel.read_bytes() if item.filename in replaced else zin.read(item))
    return newer


@pytest.mark.slow  # installs the agent with every extra, twice
@pytest.mark.timeout(1800)
def test_offline_install_and_an_update_to_the_next_build(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    package = offline_package(tmp_path_factory)
    with zipfile.ZipFile(package) as zf:
        names = zf.namelist()
    assert "handler.sh" in names and any(n.startswith("wheelhouse/orjson-") for n in names)
    root = tmp_path / "root"
    root.mkdir()
    env = offline_env()
    # The interpreter running this suite first, then the system's: no version manager's shims.
    env["PATH"] = f"{Path(getattr(sys, '_base_executable', sys.executable)).parent}:/usr/bin:/bin"
    env.update({"SEFWD_EXT_ROOT": str(root), "SEFWD_EXT_SERVICE_CMD": "/bin/true", "SEFWD_EXT_SKIP_INSTALL": "0"})
    ga = GuestAgent(tmp_path / "lib", env=env)
    public = {"state": {"dir": str(tmp_path / "state")}}
    assert ga.enable(package, "1.0.0", Settings(0, public)), ga.report()
    report = ga.report()
    assert report is not None and report.settings_status is not None
    message = report.settings_status["message"]
    assert report.settings_status["status"] == "success" and "[Python %d.%d." % sys.version_info[:2] in message, message
    python = root / "opt/sefwd/venv/bin/python"
    log = (ga.instances["1.0.0"].log_dir / "handler.log").read_text()
    assert "(no package index)" in log, log[-3000:]
    marker = [str(python), "-I", "-c", MARKER_CHECK]
    assert subprocess.run(marker, capture_output=True, text=True, timeout=60).stdout.strip() == "none"

    assert ga.enable(next_build(package, tmp_path), "1.1.0", Settings(0, public)), ga.report()
    assert [(r.version, r.command, r.exit_code) for r in ga.runs][-4:] == [
        ("1.1.0", "update", 0), ("1.0.0", "uninstall", 0), ("1.1.0", "install", 0), ("1.1.0", "enable", 0)]
    assert subprocess.run(marker, capture_output=True, text=True, timeout=60).stdout.strip() == "next build"
