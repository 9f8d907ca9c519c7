"""deploy/bundle/project-wheel.sh: the wheel holds what git holds, never a stale build/, and a version per build."""
from __future__ import annotations

import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from tests.agent import ROOT
from tests.interpreters import clean_env


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", *args], cwd=repo,
                          capture_output=True, text=True, check=True, timeout=120).stdout


@pytest.mark.slow  # two wheel builds (pip sets up the build backend each time)
def test_stale_and_deleted_modules_never_reach_the_wheel_and_each_build_is_a_new_version(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file() and name.startswith(("forwarder/", "sinks/", "deploy/bundle/")) or name in (
                "pyproject.toml", "README.md", ".gitignore"):
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, repo / name)
    (repo / "forwarder/gone.py").write_text('"""Deleted after the commit."""\n')
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "one")
    (repo / "forwarder/gone.py").unlink()  # deleted since: not in the work tree
    stale = repo / "build/lib/forwarder/stale.py"  # what an earlier in-tree build left (git-ignored)
    stale.parent.mkdir(parents=True)
    stale.write_text('"""Left by an old build."""\n')
    (repo / "forwarder/new_module.py").write_text('"""Not committed yet, not ignored: part of this build."""\n')

    def build(out: str) -> Path:
        done = subprocess.run(["bash", str(repo / "deploy/bundle/project-wheel.sh"), str(tmp_path / out)],
                              capture_output=True, text=True, timeout=600, env=clean_env(), cwd=str(tmp_path))
        assert done.returncode == 0, done.stderr
        return Path(done.stdout.strip().splitlines()[-1])

    first = build("a")
    with zipfile.ZipFile(first) as zf:
        names = set(zf.namelist())
    assert "forwarder/new_module.py" in names and "forwarder/agent/cli.py" in names
    assert "forwarder/gone.py" not in names and "forwarder/stale.py" not in names
    commit = git(repo, "rev-parse", "--short=10", "HEAD").strip()
    # the work tree differs from the commit (gone.py deleted): the version says so
    assert first.name.startswith("scheduled_events_forwarder-0.1.0+") and f".g{commit}.dirty-py3-none-any.whl" in first.name
    assert not (repo / "build/lib/forwarder/agent").exists() and not list(repo.glob("*.egg-info"))  # nothing built in the checkout
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "two")
    second = build("b")
    commit = git(repo, "rev-parse", "--short=10", "HEAD").strip()
    assert second.name != first.name and second.name.endswith(f".g{commit}-py3-none-any.whl"), second.name
