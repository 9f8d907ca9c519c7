"""The offline bundle (deploy/bundle/build.sh) installs with no package index, on the oldest and newest CPython."""
from __future__ import annotations

import platform
import shutil
import subprocess
import tarfile
from pathlib import Path

import orjson
import pytest

from forwarder.emulator import Emulator
from tests.agent import write_config
from tests.interpreters import BUNDLE, MARKER_CHECK, clean_env, marked_build, offline_env, python_or_skip, shared_build

# The interpreters and the one architecture the tests install on (a full build has 3.10-3.13 and two).
PYTHONS = ("3.10", "3.13")


def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    machine = platform.machine()
    if machine not in ("x86_64", "aarch64"):
        pytest.skip(f"the bundle has manylinux wheels for x86_64 and aarch64, not {machine}")
    return shared_build(tmp_path_factory, "sefwd-bundle",
                        ["bash", str(BUNDLE / "build.sh"), "--pythons", " ".join(PYTHONS), "--archs", machine])


def unpack(archive: Path, where: Path) -> Path:
    with tarfile.open(archive) as tar:
        tar.extractall(where)  # our own archive
    (top,) = where.iterdir()
    return top


def install(top: Path, root: Path, python: Path, *more: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(top / "linux/install.sh"), "--prefix", str(root), "--no-user", "--no-start",
                           "--extras", "", "--python", str(python), *more],
                          capture_output=True, text=True, timeout=900, env=offline_env(), cwd=str(root.parent))


@pytest.mark.slow  # builds the bundle (about a minute, downloads from the package index or pip's cache)
def test_the_bundle_holds_what_it_says(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    archive = bundle(tmp_path_factory)
    assert archive.name.startswith("sefwd-bundle-0.") and "+" in archive.name
    digest = (archive.parent / (archive.name + ".sha256")).read_text().split()
    assert digest[1] == archive.name
    assert subprocess.run(["sha256sum", "--check", "--quiet", archive.name + ".sha256"], cwd=archive.parent).returncode == 0
    top = unpack(archive, tmp_path)
    assert subprocess.run(["sha256sum", "--check", "--quiet", "--strict", "SHA256SUMS"], cwd=top).returncode == 0
    wheels = sorted(p.name for p in (top / "wheelhouse").iterdir())
    assert all(w.endswith(".whl") for w in wheels)  # nothing to build on the VM
    assert [w for w in wheels if w.startswith("scheduled_events_forwarder-")] == [f"scheduled_events_forwarder-{archive.name[len('sefwd-bundle-'):-len('.tar.gz')]}-py3-none-any.whl"]
    for needed in ("orjson-", "requests-", "httptools-", "tomli-"):  # tomli: 3.10 only, still in
        assert any(w.startswith(needed) for w in wheels), needed
    assert any("cp310" in w and w.startswith("orjson-") for w in wheels) and any("cp313" in w and w.startswith("orjson-") for w in wheels)
    assert not any(w.startswith(("azure_", "opentelemetry")) for w in wheels)  # the default bundle has no extra


@pytest.mark.slow  # a venv per interpreter
@pytest.mark.parametrize("minor", PYTHONS)
def test_install_with_no_index_then_once_against_the_emulator(minor: str, tmp_path: Path,
                                                              tmp_path_factory: pytest.TempPathFactory) -> None:
    python = python_or_skip(minor)
    top = unpack(bundle(tmp_path_factory), tmp_path / "unpacked")
    root = tmp_path / "root"
    done = install(top, root, python)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "(no package index)" in done.stdout
    sefwd = root / "opt/sefwd/venv/bin/sefwd"
    version = subprocess.run([str(sefwd), "--version"], capture_output=True, text=True, timeout=60, env=clean_env())
    assert version.stdout.startswith("sefwd " + top.name[len("sefwd-bundle-"):] + "\nPython " + minor + "."), version.stdout
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        event_id = emu.schedule(type="Freeze", resources=["myVM"], duration=5, start_after=600)
        config = write_config(tmp_path / "c.toml", emu.url, tmp_path / "state")
        once = subprocess.run([str(sefwd), "once", "--config", str(config)], capture_output=True, text=True,
                              timeout=120, env=clean_env(), cwd=str(tmp_path))
    assert once.returncode == 0, once.stderr
    (record,) = [orjson.loads(line) for line in once.stdout.splitlines()]
    assert record["subject"] == event_id and record["type"] == "scheduledevent.scheduled"


@pytest.mark.slow  # builds the bundle, if no other test did
def test_an_altered_bundle_is_refused_before_anything_is_installed(tmp_path: Path,
                                                                   tmp_path_factory: pytest.TempPathFactory) -> None:
    top = unpack(bundle(tmp_path_factory), tmp_path / "unpacked")
    wheel = next((top / "wheelhouse").glob("requests-*.whl"))
    wheel.write_bytes(wheel.read_bytes() + b"\0")
    root = tmp_path / "root"
    done = install(top, root, Path(shutil.which("python3") or "python3"))
    assert done.returncode == 1 and "does not match its SHA256SUMS" in done.stderr, done.stderr
    assert not (root / "opt/sefwd/venv").exists()


@pytest.mark.slow  # two installs
def test_the_next_build_replaces_the_code_even_with_the_same_version(tmp_path: Path,
                                                                     tmp_path_factory: pytest.TempPathFactory) -> None:
    python = python_or_skip(PYTHONS[-1])
    archive = bundle(tmp_path_factory)
    top = unpack(archive, tmp_path / "unpacked")
    root = tmp_path / "root"
    assert install(top, root, python).returncode == 0
    # The next build, given the very same version number (as a build from an unchanged pyproject.toml
    # had before): pip alone would call it "already installed" and keep the old code.
    local = archive.name[len("sefwd-bundle-"):-len(".tar.gz")].split("+", 1)[1]
    wheel = marked_build(tmp_path, local)
    assert wheel.name == next((top / "wheelhouse").glob("scheduled_events_forwarder-*.whl")).name  # same version
    done = install(top, root, python, "--source", str(wheel))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    marker = subprocess.run([str(root / "opt/sefwd/venv/bin/python"), "-I", "-c", MARKER_CHECK],
                            capture_output=True, text=True, timeout=60)
    assert marker.stdout.strip() == "next build", marker.stderr
