"""The offline bundle's lock files (deploy/bundle/lock/) pin every dependency pyproject.toml declares."""
from __future__ import annotations

import importlib.util
import re

import pytest
from packaging.requirements import Requirement

from forwarder.common.compat import tomllib
from tests.conftest import ROOT

LOCK = ROOT / "deploy" / "bundle" / "lock"
GROUPS = ("all", "test", "bench", "consumers")  # groups, development, and the fleet-side Function apps (their own requirements.txt): not in a VM bundle
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _select_lock():
    spec = importlib.util.spec_from_file_location("select_lock", ROOT / "deploy" / "bundle" / "select_lock.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


select_lock = _select_lock()


def pins(*files: str) -> dict[str, list[tuple[str, str]]]:
    """name -> [(version, marker)] over the lock files."""
    found: dict[str, list[tuple[str, str]]] = {}
    for name in files:
        for dist, version, marker, hashes in select_lock.entries((LOCK / name).read_text()):
            assert hashes and all(h.startswith("sha256:") for h in hashes), dist
            found.setdefault(dist, []).append((version, marker))
    return found


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def check(requirements: list[str], lock_file: str) -> None:
    locked = pins(lock_file)
    for text in requirements:
        req = Requirement(text)
        if req.name == PROJECT["name"]:
            continue
        assert normalized(req.name) in locked, f"{lock_file} lacks {req.name}: run deploy/bundle/lock.sh"
        for version, _ in locked[normalized(req.name)]:
            assert req.specifier.contains(version, prereleases=True), \
                f"{lock_file} pins {req.name}=={version}, pyproject.toml wants {req.specifier}: run deploy/bundle/lock.sh"


def test_core_lock_pins_every_dependency() -> None:
    check(PROJECT["dependencies"], "core.txt")


@pytest.mark.parametrize("extra", sorted(set(PROJECT["optional-dependencies"]) - set(GROUPS)))
def test_each_extra_has_a_lock_with_its_requirements(extra: str) -> None:
    check(PROJECT["optional-dependencies"][extra] + PROJECT["dependencies"], f"{extra}.txt")


@pytest.mark.parametrize("python", ["3.10", "3.11", "3.12", "3.13"])
def test_the_lock_files_agree_for_every_target(python: str) -> None:
    files = sorted(p.read_text() for p in LOCK.glob("*.txt"))
    for machine in ("x86_64", "aarch64"):
        chosen = select_lock.select(files, python, machine)  # raises where two files pin one package differently
        names = {line.split("==", 1)[0] for line in chosen}
        assert ("tomli" in names) == (python == "3.10") and "colorama" not in names  # markers evaluated for the target
