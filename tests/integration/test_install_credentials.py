"""deploy/linux/install.sh passes package credentials without showing them: not on any command line
(what `ps` shows every local user), not in its or pip's output, not in /opt/sefwd/install.env nor
any other file it leaves.

A real local package index (HTTP on 127.0.0.1, which pip counts as a secure origin) requires a
token, as a private feed or a SAS-signed blob does; it serves a small wheel named like the project
with a ``sefwd`` command. The index holds the wheel's download until the test has read every
process's command line, so pip (and anything it starts) is caught while it works.
"""
from __future__ import annotations

import base64
import hashlib
import io
import os
import stat
import subprocess
import sys
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.agent import ROOT, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

INSTALL = ROOT / "deploy" / "linux" / "install.sh"
TOKEN = "tok3n-SECRET-7d1f0c"
WHEEL = "scheduled_events_forwarder-0.0.1-py3-none-any.whl"


HELPER = "sefwd_build_helper-1.0-py3-none-any.whl"


def dummy_wheel(name: str = "scheduled-events-forwarder", version: str = "0.0.1") -> bytes:
    """A wheel named like the project whose ``sefwd --help`` runs (what install.sh checks)."""
    dist = f"{name.replace('-', '_')}-{version}.dist-info"
    files = {
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    if name == "scheduled-events-forwarder":
        files["sefwd_dummy.py"] = "def main():\n    print('sefwd dummy')\n"
        files[f"{dist}/entry_points.txt"] = "[console_scripts]\nsefwd = sefwd_dummy:main\n"
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = "\n".join(record) + "\n"
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return out.getvalue()


class Index:
    """/simple/ (PEP 503) and /files/ on 127.0.0.1; every request must carry the token (Basic auth
    password or ``sig=`` query). The wheel's download waits until ``release`` is set."""

    def __init__(self) -> None:
        self.files = {WHEEL: dummy_wheel(), HELPER: dummy_wheel("sefwd-build-helper", "1.0")}
        self.release = threading.Event()
        self.downloading = threading.Event()
        self.unauthorized = 0
        index = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                auth = self.headers.get("Authorization", "")
                # user:token, or the token alone as the user with an empty password (what pip sends for
                # https://TOKEN@host/: private feeds take either)
                accepted = {"Basic " + base64.b64encode(pair.encode()).decode() for pair in (f"build:{TOKEN}", f"{TOKEN}:")}
                if auth not in accepted and f"sig={TOKEN}" not in self.path:
                    index.unauthorized += 1
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", 'Basic realm="feed"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                path = self.path.split("?", 1)[0]
                project = path.rstrip("/").removeprefix("/simple/")
                wheel = {"scheduled-events-forwarder": WHEEL, "sefwd-build-helper": HELPER}.get(project)
                if wheel is not None:
                    body = f'<a href="/files/{wheel}">{wheel}</a>'.encode()
                    ctype = "text/html"
                elif path.removeprefix("/files/") in index.files:
                    index.downloading.set()  # the first download waits for the test's look at `ps`
                    index.release.wait(60)
                    body, ctype = index.files[path.removeprefix("/files/")], "application/octet-stream"
                else:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.base = f"127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def command_lines() -> list[str]:
    """Every process's command line, as `ps -ef` shows it to any user."""
    lines = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                lines.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                pass
    return lines


def secret_file(path: Path, text: str) -> Path:
    path.write_text(text + "\n")
    path.chmod(0o600)
    return path


def run_install(tmp_path: Path, index: Index, *args: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SEFWD_", "PIP_")) and k not in ("PYTHONPATH", "PREFIX", "VIRTUAL_ENV")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_CACHE_DIR="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    proc = subprocess.Popen(["bash", str(INSTALL), *args, "--extras", "", "--prefix", str(tmp_path / "root"),
                             "--no-user", "--no-start", "--python", sys.executable],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    seen: list[str] = []
    try:
        wait_until(lambda: index.downloading.is_set() or proc.poll() is not None, 180, "the wheel's download")
        seen = [line for line in command_lines() if TOKEN in line]  # while pip (or its helper) works
        index.release.set()
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), seen


def leaked_files(root: Path) -> list[str]:
    found = []
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            try:
                if TOKEN.encode() in path.read_bytes():
                    found.append(str(path.relative_to(root)))
            except OSError:
                pass
    return found


@pytest.fixture
def index():
    idx = Index()
    try:
        yield idx
    finally:
        idx.close()


def test_an_index_url_with_a_token_stays_out_of_argv_output_and_files(tmp_path, index):
    url_file = secret_file(tmp_path / "index-url", f"http://build:{TOKEN}@{index.base}/simple/")
    res, seen = run_install(tmp_path, index, "--source", "scheduled-events-forwarder==0.0.1",
                            "--index-url-file", str(url_file))
    assert res.returncode == 0, res.stdout + res.stderr
    assert index.downloading.is_set()  # pip got through the token-protected index
    assert seen == [], seen  # no command line held the token (ps shows them to every user)
    assert TOKEN not in res.stdout + res.stderr
    install_env = tmp_path / "root/opt/sefwd/install.env"
    assert stat.S_IMODE(install_env.stat().st_mode) == 0o644 and TOKEN not in install_env.read_text()
    assert leaked_files(tmp_path / "root") == []


BACKEND = f"""
import base64, os
WHEEL = {WHEEL!r}
DATA = {{data!r}}
def get_requires_for_build_wheel(config_settings=None):
    return []
def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    with open(os.path.join(wheel_directory, WHEEL), "wb") as f:
        f.write(base64.b64decode(DATA))
    return WHEEL
"""


def _source_that_builds(tmp_path: Path, index: Index) -> Path:
    """A checkout whose build needs a dependency from the private index (what cloud-init installs)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "pyproject.toml").write_text('[build-system]\nrequires = ["sefwd-build-helper"]\n'
                                        'build-backend = "backend"\nbackend-path = ["."]\n')
    (src / "backend.py").write_text(BACKEND.format(data=base64.b64encode(index.files[WHEEL]).decode()))
    return src


@pytest.mark.parametrize("userinfo", [f"build:{TOKEN}", TOKEN], ids=["user-and-token", "token-only"])
def test_build_dependencies_from_a_private_index_keep_the_token_off_the_child_pips_command_line(tmp_path, index, userinfo):
    """pip installs build dependencies with a pip of its own, handing it the index URL as an
    argument: the token must not be in that URL, whether with a user or alone (https://TOKEN@host/):
    both go to netrc, so no command line holds it while `ps` is sampled."""
    url_file = secret_file(tmp_path / "index-url", f"http://{userinfo}@{index.base}/simple/")
    res, seen = run_install(tmp_path, index, "--source", str(_source_that_builds(tmp_path, index)),
                            "--index-url-file", str(url_file))
    assert res.returncode == 0, res.stdout + res.stderr
    assert index.downloading.is_set() and seen == [], seen
    assert TOKEN not in res.stdout + res.stderr
    assert leaked_files(tmp_path / "root") == []


def test_a_token_in_the_index_urls_query_is_refused_with_the_reason(tmp_path):
    url_file = secret_file(tmp_path / "index-url", f"https://pkgs.example.com/simple/?token={TOKEN}")
    res = subprocess.run(["bash", str(INSTALL), "--index-url-file", str(url_file), "--prefix", str(tmp_path / "root"),
                          "--no-user", "--no-start", "--python", sys.executable], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1
    assert "query string" in res.stderr and "command line" in res.stderr and "TOKEN@host" in res.stderr
    assert TOKEN not in res.stdout + res.stderr
    assert not (tmp_path / "root/opt/sefwd/venv").exists()


def test_a_sas_signed_wheel_url_stays_out_of_argv_output_and_files(tmp_path, index):
    source_file = secret_file(tmp_path / "source-url",
                              f"http://{index.base}/files/{WHEEL}?sv=2024-01-01&sig={TOKEN}")
    res, seen = run_install(tmp_path, index, "--source-file", str(source_file))
    assert res.returncode == 0, res.stdout + res.stderr
    assert seen == [], seen
    assert TOKEN not in res.stdout + res.stderr
    assert "sig=" not in (tmp_path / "root/opt/sefwd/install.env").read_text()
    assert leaked_files(tmp_path / "root") == []


def test_a_credential_on_install_shs_own_command_line_is_refused(tmp_path):
    res = subprocess.run(["bash", str(INSTALL), "--source", f"https://acct.blob.core.windows.net/c/{WHEEL}?sig={TOKEN}",
                          "--prefix", str(tmp_path / "root"), "--no-user", "--no-start"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "--source-file" in res.stderr
    assert TOKEN not in res.stdout + res.stderr
    assert not (tmp_path / "root/opt/sefwd/venv").exists()
