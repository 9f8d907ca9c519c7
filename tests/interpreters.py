"""The CPythons of this machine (pyenv), fresh venvs of them, and this project's wheel built once per run."""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.agent import ROOT, closed_port

BUNDLE = ROOT / "deploy" / "bundle"


def find_python(minor: str) -> Path | None:
    """A CPython ``minor`` ("3.10"): pythonX.Y on PATH if it runs, else pyenv's; None when absent."""
    candidates: list[Path] = []
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    candidates += sorted((root / "versions").glob(f"{minor}.*/bin/python{minor}"), reverse=True)
    on_path = shutil.which(f"python{minor}")
    if on_path:
        candidates.append(Path(on_path))
    for exe in candidates:
        done = subprocess.run([str(exe), "-c", "import sys, venv, ensurepip; print('%d.%d' % sys.version_info[:2])"],
                              capture_output=True, text=True, timeout=60)
        if done.returncode == 0 and done.stdout.strip() == minor:
            return exe
    return None


def python_or_skip(minor: str) -> Path:
    exe = find_python(minor)
    if exe is None:
        pytest.skip(f"CPython {minor} (with venv and ensurepip) is not installed on this machine (tried pyenv and python{minor} on PATH)")
    return exe


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without this run's Python settings: the venv alone decides what is imported."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SEFWD_", "PYTEST_", "PYENV_VERSION")) and k not in ("PYTHONPATH", "VIRTUAL_ENV", "PREFIX")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env.update(extra)
    return env


def offline_env() -> dict[str, str]:
    """pip with every way to a package index closed: only the bundle's wheelhouse can serve it."""
    dead = f"http://127.0.0.1:{closed_port()}"
    env = clean_env(PIP_INDEX_URL=dead + "/simple", PIP_CONFIG_FILE="/dev/null", http_proxy=dead, https_proxy=dead,
                    HTTP_PROXY=dead, HTTPS_PROXY=dead, PIP_NO_CACHE_DIR="1")
    env.pop("PIP_FIND_LINKS", None)
    env.pop("PIP_EXTRA_INDEX_URL", None)
    return env


def make_venv(python: Path, where: Path) -> Path:
    """A fresh venv (its bin/ returned)."""
    subprocess.run([str(python), "-m", "venv", str(where)], check=True, timeout=300, env=clean_env())
    return where / "bin"


def pip(bin_dir: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 900) -> None:
    done = subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "--quiet", *args], capture_output=True,
                          text=True, timeout=timeout, env=env or clean_env(), cwd=str(bin_dir.parent))
    assert done.returncode == 0, f"pip install {' '.join(args)}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"


def shared_build(tmp_path_factory: pytest.TempPathFactory, name: str, argv: list[str]) -> Path:
    """Run a build script once for the whole run (xdist workers share the result); its last output line is the path."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # popen-gwN/..: common to every worker of this run, and to no other run
    out = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        result = out / "path.txt"
        if not result.exists():
            out.mkdir(exist_ok=True)
            done = subprocess.run(argv + [str(out / "build")], capture_output=True, text=True, timeout=1200,
                                  env=clean_env(), cwd=str(ROOT))
            assert done.returncode == 0, done.stderr[-4000:]
            result.write_text(done.stdout.strip().splitlines()[-1])
        return Path(result.read_text())


def project_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This checkout's wheel, as deploy/bundle/project-wheel.sh builds it (a clean copy, a per-build version)."""
    return shared_build(tmp_path_factory, "sefwd-wheel", ["bash", str(BUNDLE / "project-wheel.sh")])


def marked_build(tmp: Path, local: str) -> Path:
    """The next build of this checkout: a copy with ``BUILD_MARKER = "next build"`` in forwarder/__init__.py,
    built by project-wheel.sh with the local version ``local`` (a build given the same version as the last one)."""
    copy = tmp / "next"
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, copy / name)
    init = copy / "forwarder/__init__.py"
    init.write_text(init.read_text() + 'BUILD_MARKER = "next build"\n')
    built = subprocess.run(["bash", str(copy / "deploy/bundle/project-wheel.sh"), str(tmp / "wheel")], capture_output=True,
                           text=True, timeout=600, env=clean_env(SEFWD_BUILD_LOCAL=local), cwd=str(tmp))
    assert built.returncode == 0, built.stderr
    return Path(built.stdout.strip().splitlines()[-1])


# What the venv's code says about that marker: "none" before the next build is installed.
MARKER_CHECK = "import forwarder; print(getattr(forwarder, 'BUILD_MARKER', 'none'))"
