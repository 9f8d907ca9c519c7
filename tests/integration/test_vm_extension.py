"""The Azure VM extension handler (deploy/vm-extension) against a fake waagent layout."""
from __future__ import annotations

import base64
import importlib.util
import json
import os
import shutil
import stat
import subprocess
import sys
import time
import tomllib
import zipfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forwarder.emulator import Emulator
from tests.agent import AgentProcess, wait_until, write_config
from tests.conftest import examples
from tests.peers.guest_agent import LIMITS, OUTPUT_MAX, GuestAgent, Report, Settings, format_output

REPO = Path(__file__).resolve().parents[2]
EXT_SRC = REPO / "deploy" / "vm-extension"
HANDLER = EXT_SRC / "handler.py"
WEBHOOK_SECRET = "whsec_" + base64.b64encode(bytes(range(32))).decode()
# What enable and disable hand the service manager: the agent and the root timer that copies its heartbeat.
UNITS = "sefwd.service sefwd-extension-heartbeat.timer"
TRICKY = 'a "quoted" $HOME `cmd` back\\slash  two  spaces;Endpoint=sb://x/;Key=abc='

PUBLIC = {
    "imds": {"poll_interval": "2s"},
    "agent": {"heartbeat": "1m", "log_level": "debug"},
    "sinks": [
        {"type": "file", "name": "events", "path": "/var/log/sefwd/events.jsonl", "max_size": "16MiB", "backups": 3},
        {"type": "webhook", "name": "hook", "url": "https://hooks.example.com/sefwd",
         "secret_env": "SEFWD_WEBHOOK_SECRET", "headers": {"X-Team": "ops"}},
    ],
    "approval": {
        "scope": "self",
        "rules": [
            {"name": "short-freeze", "event_type": "Freeze", "duration_max": 8, "action": "approve"},
            {"name": "rest", "action": "hold"},
        ],
    },
}
PROTECTED = {"env": {"SEFWD_WEBHOOK_SECRET": WEBHOOK_SECRET, "EXTRA_TOKEN": TRICKY}}

STUB = """#!/bin/sh
echo "$*" >> "$STUB_CALLS"
# What the status file said while the service manager was called (the operation is still running).
cp "$STUB_STATUS_DIR/$ConfigSequenceNumber.status" "$STUB_SNAPSHOT" 2>/dev/null || true
exit "${STUB_EXIT:-0}"
"""


def _openssl(*args: str, input: bytes | None = None) -> bytes:
    return subprocess.run(["openssl", *args], input=input, check=True, capture_output=True, timeout=60).stdout


@pytest.fixture(scope="session")  # one per xdist worker: its tests may be spread over workers
def waagent(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A waagent dir holding a self-signed certificate and key named by thumbprint, as waagent stores them."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not installed")
    d = tmp_path_factory.mktemp("waagent")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem"),
             "-subj", "/CN=Windows Azure CRP Certificate Generator", "-days", "2")
    fingerprint = _openssl("x509", "-in", str(d / "cert.pem"), "-noout", "-fingerprint", "-sha1").decode()
    thumbprint = fingerprint.strip().split("=", 1)[1].replace(":", "").upper()
    (d / "cert.pem").rename(d / f"{thumbprint}.crt")
    (d / "key.pem").rename(d / f"{thumbprint}.prv")
    return d, thumbprint


def encrypt(waagent_dir: Path, thumbprint: str, value: object) -> str:
    der = _openssl("smime", "-encrypt", "-binary", "-outform", "DER", "-aes256", str(waagent_dir / f"{thumbprint}.crt"),
                   input=json.dumps(value).encode())
    return base64.b64encode(der).decode()


class Ext:
    """One extension directory with its waagent-made folders, a temporary root and a systemctl stub."""

    def __init__(self, tmp: Path, waagent: tuple[Path, str]) -> None:
        self.waagent_dir, self.thumbprint = waagent
        self.dir = tmp / "Sefwd.Linux-1.0.0"
        self.dir.mkdir()
        shutil.copy2(HANDLER, self.dir / "handler.py")
        shutil.copy2(EXT_SRC / "HandlerManifest.json", self.dir / "HandlerManifest.json")
        (self.dir / "wheels").mkdir()  # as build.sh lays it out; never installed here (SEFWD_EXT_SKIP_INSTALL)
        self.wheel = self.dir / "wheels" / "scheduled_events_forwarder-0.1.0-py3-none-any.whl"
        self.wheel.write_bytes(b"")
        self.log_dir, self.config_dir, self.status_dir = tmp / "log", tmp / "config", tmp / "status"
        self.config_dir.mkdir()
        self.status_dir.mkdir()
        self.heartbeat = self.dir / "heartbeat.log"
        (self.dir / "HandlerEnvironment.json").write_text(json.dumps([{
            "version": 1.0, "name": "Sefwd.Linux",
            "handlerEnvironment": {"logFolder": str(self.log_dir), "configFolder": str(self.config_dir),
                                   "statusFolder": str(self.status_dir), "heartbeatFile": str(self.heartbeat)},
        }]))
        self.root = tmp / "root"
        self.root.mkdir()
        self.calls_file, self.snapshot = tmp / "calls.txt", tmp / "snapshot.status"
        self.stub = tmp / "systemctl-stub"
        self.stub.write_text(STUB)
        self.stub.chmod(0o755)
        self.config = self.root / "etc/sefwd/config.toml"
        self.env_file = self.root / "etc/sefwd/env"

    def settings(self, seq: int, public: dict, protected: dict | None = PROTECTED) -> Path:
        handler: dict = {"publicSettings": public}
        if protected is not None:
            handler["protectedSettingsCertThumbprint"] = self.thumbprint
            handler["protectedSettings"] = encrypt(self.waagent_dir, self.thumbprint, protected)
        path = self.config_dir / f"{seq}.settings"
        path.write_text(json.dumps({"runtimeSettings": [{"handlerSettings": handler}]}))
        return path

    def run(self, command: str, seq: int | None = 0, wrap: tuple[str, ...] = (), **extra: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SEFWD_", "ConfigSequence"))}
        env.update({
            "SEFWD_EXT_ROOT": str(self.root),
            "SEFWD_EXT_WAAGENT_DIR": str(self.waagent_dir),
            "SEFWD_EXT_SERVICE_CMD": str(self.stub),
            "SEFWD_EXT_SEFWD_CMD": f"{sys.executable} -m forwarder",
            "SEFWD_EXT_SKIP_INSTALL": "1",
            "STUB_CALLS": str(self.calls_file), "STUB_STATUS_DIR": str(self.status_dir), "STUB_SNAPSHOT": str(self.snapshot),
        })
        if seq is not None:
            env["ConfigSequenceNumber"] = str(seq)
        env.update(extra)
        # waagent runs the command by its path from the manifest, in the extension dir
        return subprocess.run([*wrap, sys.executable, str(self.dir / "handler.py"), command], cwd=self.dir, env=env,
                              capture_output=True, text=True, timeout=120)

    def status(self, seq: int) -> dict:
        doc = json.loads((self.status_dir / f"{seq}.status").read_text())
        assert isinstance(doc, list) and doc[0]["version"] == 1.0 and doc[0]["timestampUTC"].endswith("Z")
        assert doc[0]["status"]["formattedMessage"]["lang"] == "en-US"
        return doc[0]["status"]

    def calls(self) -> list[str]:
        return self.calls_file.read_text().splitlines() if self.calls_file.exists() else []


@pytest.fixture
def ext(tmp_path: Path, waagent: tuple[Path, str]) -> Ext:
    return Ext(tmp_path, waagent)


def _ok(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr}"


def source_env_file(path: Path) -> dict[str, str]:
    """The variables a POSIX shell reads from the file (systemd's double-quote rules are the shell's)."""
    out = subprocess.run(["sh", "-c", 'set -a; . "$1"; env -0', "sh", str(path)], capture_output=True, check=True,
                         env={"PATH": os.environ["PATH"]}, timeout=30).stdout.decode()
    return dict(item.split("=", 1) for item in out.split("\0") if "=" in item)


def load_handler_module():
    spec = importlib.util.spec_from_file_location("sefwd_vm_extension_handler", HANDLER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_manifest_names_the_handler_for_every_command() -> None:
    manifest = json.loads((EXT_SRC / "HandlerManifest.json").read_text())
    body = manifest[0]["handlerManifest"]
    for op in ("install", "uninstall", "update", "enable", "disable"):
        assert body[f"{op}Command"] == f"handler.sh {op}"  # the launcher picks the Python (test_vm_extension_python.py)
    assert body["rebootAfterInstall"] is False and body["reportHeartbeat"] is True
    assert body["updateMode"] == "UpdateWithInstall"
    assert HANDLER.read_text().startswith("#!/usr/bin/env python3\n")
    assert os.access(HANDLER, os.X_OK)


def test_enable_writes_a_checked_config_and_secret_env_then_restarts(ext: Ext) -> None:
    ext.settings(0, PUBLIC)
    _ok(ext.run("install"))
    install = ext.status(0)
    assert (install["operation"], install["status"], install["code"]) == ("Install", "success", 0)
    would_run = install["formattedMessage"]["message"]
    assert f"linux/install.sh --source {ext.wheel} --extras all --no-start --prefix {ext.root} --no-user" in would_run

    proc = ext.run("enable")
    _ok(proc)
    status = ext.status(0)
    assert (status["name"], status["operation"], status["status"], status["code"]) == ("sefwd", "Enable", "success", 0)
    assert "restarted" in status["formattedMessage"]["message"]
    during = json.loads(ext.snapshot.read_text())[0]["status"]
    assert (during["operation"], during["status"]) == ("Enable", "transitioning")
    assert ext.calls() == [f"enable {UNITS}", f"restart {UNITS}"]

    assert tomllib.loads(ext.config.read_text()) == PUBLIC
    assert stat.S_IMODE(ext.env_file.stat().st_mode) == 0o600
    env = source_env_file(ext.env_file)
    assert env["SEFWD_WEBHOOK_SECRET"] == WEBHOOK_SECRET and env["EXTRA_TOKEN"] == TRICKY
    # The agent itself accepts the file with the service's environment.
    check = subprocess.run([sys.executable, "-m", "forwarder", "config", "check", "--config", str(ext.config)],
                           env={"PATH": os.environ["PATH"], **env}, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr
    assert "hook (type webhook)" in check.stdout
    heartbeat = json.loads(ext.heartbeat.read_text())[0]["heartbeat"]
    assert heartbeat["status"] == "Ready"

    leaked = [p for p in [*ext.log_dir.iterdir(), *ext.status_dir.iterdir(), ext.heartbeat]
              if WEBHOOK_SECRET in p.read_text() or "back\\slash" in p.read_text()]
    assert not leaked and WEBHOOK_SECRET not in proc.stdout + proc.stderr
    assert not list(ext.config.parent.glob("*.ext-new")) and not list(ext.config.parent.glob(".config*"))


def test_enable_is_idempotent_and_restarts_once_per_change(ext: Ext) -> None:
    ext.settings(0, PUBLIC)
    _ok(ext.run("enable"))
    _ok(ext.run("enable"))  # a reboot: same settings
    assert ext.calls() == [f"enable {UNITS}", f"restart {UNITS}", f"enable {UNITS}", f"start {UNITS}"]
    assert "unchanged" in ext.status(0)["formattedMessage"]["message"]

    ext.settings(1, PUBLIC)  # a new sequence number with the same content: nothing to restart
    _ok(ext.run("enable", seq=1))
    assert ext.calls()[-1] == f"start {UNITS}"
    assert ext.status(1)["status"] == "success"

    changed = json.loads(json.dumps(PUBLIC))
    changed["imds"]["poll_interval"] = "500ms"
    ext.settings(2, changed)
    before = len(ext.calls())
    _ok(ext.run("enable", seq=2))
    assert ext.calls()[before:] == [f"enable {UNITS}", f"restart {UNITS}"]
    assert tomllib.loads(ext.config.read_text())["imds"]["poll_interval"] == "500ms"

    rotated = {"env": {**PROTECTED["env"], "SEFWD_WEBHOOK_SECRET": "whsec_" + base64.b64encode(b"k" * 32).decode()}}
    ext.settings(3, changed, rotated)  # only a secret changes: the service must re-read its environment
    _ok(ext.run("enable", seq=3))
    assert ext.calls()[-1] == f"restart {UNITS}"
    assert "env changed" in ext.status(3)["formattedMessage"]["message"]


def test_rejected_config_reports_every_problem_and_keeps_the_previous_one(ext: Ext) -> None:
    ext.settings(0, PUBLIC)
    _ok(ext.run("enable"))
    good = ext.config.read_bytes()
    calls = ext.calls()

    bad = {"imds": {"poll_interval": "1ms"}, "sinks": [{"type": "nosuch"}]}
    ext.settings(1, bad)
    proc = ext.run("enable", seq=1)
    assert proc.returncode == 12
    status = ext.status(1)
    assert (status["operation"], status["status"], status["code"]) == ("Enable", "error", 12)
    message = status["formattedMessage"]["message"]
    assert "previous config kept" in message and "poll_interval" in message and "nosuch" in message
    assert ext.config.read_bytes() == good
    assert ext.calls() == calls  # the running agent is left alone
    assert not list(ext.config.parent.glob("*.ext-new"))
    heartbeat = json.loads(ext.heartbeat.read_text())[0]["heartbeat"]
    assert heartbeat["status"] == "NotReady" and heartbeat["code"] == 12


def test_a_secret_the_config_needs_must_be_in_protected_settings(ext: Ext) -> None:
    ext.settings(0, PUBLIC, protected=None)
    proc = ext.run("enable")
    assert proc.returncode == 12
    message = ext.status(0)["formattedMessage"]["message"]
    assert "SEFWD_WEBHOOK_SECRET" in message
    assert not ext.config.exists() and not ext.env_file.exists() and ext.calls() == []


def test_undecryptable_protected_settings_are_an_error(ext: Ext) -> None:
    path = ext.settings(0, PUBLIC)
    doc = json.loads(path.read_text())
    doc["runtimeSettings"][0]["handlerSettings"]["protectedSettingsCertThumbprint"] = "00" * 20
    path.write_text(json.dumps(doc))
    proc = ext.run("enable")
    assert proc.returncode == 11
    status = ext.status(0)
    assert status["status"] == "error" and "0000000000" in status["formattedMessage"]["message"]

    doc["runtimeSettings"][0]["handlerSettings"]["protectedSettingsCertThumbprint"] = ext.thumbprint
    doc["runtimeSettings"][0]["handlerSettings"]["protectedSettings"] = base64.b64encode(b"not pkcs7").decode()
    path.write_text(json.dumps(doc))
    assert ext.run("enable").returncode == 11
    assert "decrypting protectedSettings" in ext.status(0)["formattedMessage"]["message"]
    assert ext.calls() == [] and not ext.config.exists()


def test_without_config_sequence_number_the_newest_settings_file_wins(ext: Ext) -> None:
    older = ext.settings(7, {"sinks": [{"type": "stdout"}]}, protected=None)
    ext.settings(3, PUBLIC)
    os.utime(older, (1_000_000_000, 1_000_000_000))  # 7 is the larger number but 3 was written last
    _ok(ext.run("enable", seq=None))
    assert ext.status(3)["status"] == "success" and not (ext.status_dir / "7.status").exists()
    assert tomllib.loads(ext.config.read_text()) == PUBLIC


def test_disable_stops_the_service_and_enable_brings_it_back(ext: Ext) -> None:
    ext.settings(0, PUBLIC)
    _ok(ext.run("enable"))
    _ok(ext.run("disable"))
    status = ext.status(0)
    assert (status["operation"], status["status"]) == ("Disable", "success")
    assert ext.calls()[-1] == f"disable --now {UNITS}"
    # The secrets go with the service (waagent may run no uninstall after a disable); enable writes them again.
    assert not ext.env_file.exists() and ext.config.exists()
    assert "secrets removed until the next enable" in status["formattedMessage"]["message"]
    _ok(ext.run("enable"))
    assert ext.calls()[-2:] == [f"enable {UNITS}", f"restart {UNITS}"]
    assert source_env_file(ext.env_file)["SEFWD_WEBHOOK_SECRET"] == WEBHOOK_SECRET
    _ok(ext.run("enable"))
    assert ext.calls()[-1] == f"start {UNITS}"


def test_uninstall_removes_config_and_secrets(ext: Ext) -> None:
    ext.settings(0, PUBLIC)
    _ok(ext.run("enable"))
    _ok(ext.run("uninstall"))
    assert ext.status(0)["operation"] == "Uninstall" and ext.status(0)["status"] == "success"
    assert ext.calls()[-1] == f"disable --now {UNITS}"
    assert not ext.config.exists() and not ext.env_file.exists() and not ext.config.parent.exists()


def test_update_keeps_the_installation_through_the_old_versions_uninstall(ext: Ext) -> None:
    ext.settings(0, PUBLIC)
    _ok(ext.run("enable"))
    # waagent's order: old disable, new update, old uninstall, new install (UpdateWithInstall), new enable.
    _ok(ext.run("disable"))
    _ok(ext.run("update", AZURE_GUEST_AGENT_UPDATING_FROM_VERSION="1.0.0"))
    assert "1.0.0" in ext.status(0)["formattedMessage"]["message"]
    _ok(ext.run("uninstall"))
    assert "update in progress" in ext.status(0)["formattedMessage"]["message"]
    assert ext.config.exists() and (ext.root / "etc/sefwd/.extension-manifest.json").exists()
    _ok(ext.run("install"))
    assert not (ext.root / "etc/sefwd/.extension-update").exists()
    _ok(ext.run("enable"))
    assert ext.calls()[-2:] == [f"enable {UNITS}", f"restart {UNITS}"]  # the secrets written again
    _ok(ext.run("uninstall"))  # without an update under way it removes everything
    assert not ext.config.exists()


def test_service_manager_failure_is_reported_and_the_restart_retried(ext: Ext) -> None:
    ext.settings(0, PUBLIC)
    proc = ext.run("enable", STUB_EXIT="5")
    assert proc.returncode == 13
    status = ext.status(0)
    assert status["status"] == "error" and status["code"] == 13 and "(exit 5)" in status["formattedMessage"]["message"]
    # The files were swapped in but never applied: the next enable must restart although they match.
    _ok(ext.run("enable"))
    assert ext.calls()[-1] == f"restart {UNITS}"
    _ok(ext.run("enable"))
    assert ext.calls()[-1] == f"start {UNITS}"


def test_no_settings_means_agent_defaults(ext: Ext) -> None:
    _ok(ext.run("enable", seq=None))
    status = ext.status(0)
    assert status["status"] == "success" and "stdout" in status["formattedMessage"]["message"]
    assert tomllib.loads(ext.config.read_text()) == {}
    assert source_env_file(ext.env_file).keys().isdisjoint({"SEFWD_WEBHOOK_SECRET"})


def test_protected_settings_shape_is_checked(ext: Ext) -> None:
    ext.settings(0, PUBLIC, {"env": {"BAD-NAME": "x"}})
    assert ext.run("enable").returncode == 11
    assert "BAD-NAME" in ext.status(0)["formattedMessage"]["message"]
    ext.settings(0, PUBLIC, {"env": {"NAME\nINJECTED": "x"}})  # would add a line to the env file
    assert ext.run("enable").returncode == 11
    ext.settings(0, PUBLIC, {"env": {"MULTI": "secret-line-1\nsecret-line-2"}})
    assert ext.run("enable").returncode == 11
    message = ext.status(0)["formattedMessage"]["message"]
    assert "MULTI" in message and "secret-line" not in message


_scalars = st.one_of(
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=12,
)


@settings(max_examples=examples(200), deadline=None)
@given(st.dictionaries(st.text(max_size=8), _values, max_size=5))
def test_toml_writer_round_trips_any_json_settings(public: dict) -> None:
    handler = load_handler_module()
    assert tomllib.loads(handler.render_config(public)) == public


def test_build_zip_has_the_handler_at_its_root(tmp_path: Path) -> None:
    if not (REPO / "deploy/linux/install.sh").exists():
        pytest.fail("deploy/linux/install.sh is missing: the extension package bundles it")
    proc = subprocess.run(["bash", str(EXT_SRC / "build.sh"), "--no-wheel", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stderr
    zip_path = Path(proc.stdout.strip().splitlines()[-1])
    assert zip_path.parent == tmp_path and zip_path.name.startswith("sefwd-vm-extension-")
    with zipfile.ZipFile(zip_path) as zf:
        names = zf.namelist()
        assert {"HandlerManifest.json", "handler.py", "README.md", "linux/install.sh", "linux/uninstall.sh"} <= set(names)
        assert zf.getinfo("handler.py").external_attr >> 16 & 0o111
        assert json.loads(zf.read("HandlerManifest.json")) == json.loads((EXT_SRC / "HandlerManifest.json").read_text())
        assert not any("__pycache__" in n or n.startswith("wheels/") for n in names)


def test_the_readme_example_settings_enable(ext: Ext) -> None:
    readme = (EXT_SRC / "README.md").read_text()
    example = json.loads(readme.split("```json\n", 1)[1].split("```", 1)[0])
    ext.settings(0, example["settings"], example["protectedSettings"])
    _ok(ext.run("enable"))
    assert "hub, ops" in ext.status(0)["formattedMessage"]["message"]
    assert tomllib.loads(ext.config.read_text()) == example["settings"]


def test_the_readme_probe_settings_enable_and_name_the_probe(ext: Ext) -> None:
    readme = (EXT_SRC / "README.md").read_text()
    section = readme.split("### The maintenance probe and alert metrics", 1)[1]
    example = json.loads(section.split("```json\n", 1)[1].split("```", 1)[0])
    ext.settings(0, example["settings"], None)
    _ok(ext.run("enable"))
    message = ext.status(0)["formattedMessage"]["message"]
    assert message.endswith("; maintenance probe: http://0.0.0.0:8080/maintenance")
    config = tomllib.loads(ext.config.read_text())
    assert config["probe"] == {"listen": "0.0.0.0:8080", "lead": "15m", "settle": "60s"}
    bad = {"probe": {"listen": "8080", "event_types": ["Reboto"]}}  # checked like any other setting
    ext.settings(1, bad, None)
    proc = ext.run("enable", seq=1)
    assert proc.returncode == 12
    message = ext.status(1)["formattedMessage"]["message"]
    assert "probe.listen" in message and "Reboot" in message
    assert tomllib.loads(ext.config.read_text())["probe"]["listen"] == "0.0.0.0:8080"  # previous kept


# -- under a simulated guest agent (tests/peers/guest_agent.py) ---------------------------------------

SCALE = 0.05  # hang tests: every limit and budget in miniature (enable's 300 s become 15 s, its steps' 240 s 12 s)
GA_STUB = """#!/bin/sh
echo "$*" >> "$STUB_CALLS"
case "$*" in
    ${STUB_HANG:-__never__}) sleep 600 & echo $! > "$STUB_CALLS.child"; wait; exit 0 ;;
esac
case "$*" in
    ${STUB_FAIL:-__never__}) echo "Failed to $1 sefwd.service: Unit sefwd.service not loaded." >&2; exit 5 ;;
esac
exit 0
"""
NOISE = "".join(f"Collecting package-{i} (from scheduled-events-forwarder) ... downloading 1.2 MB\n" for i in range(300))
FAILING_INSTALL = f"""#!/bin/sh
cat <<'NOISE'
{NOISE}NOISE
cat >&2 <<'NOISE'
{NOISE}NOISE
echo "ERROR: Could not find a version that satisfies the requirement orjson>=3.9 (from versions: none)" >&2
echo "ERROR: No matching distribution found for orjson>=3.9" >&2
echo "install.sh: error: pip install failed (the VM needs access to the package index, or pass a wheel with --source)" >&2
exit 1
"""


@pytest.fixture(scope="session")  # one per xdist worker: its tests may be spread over workers
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The extension zip as build.sh makes it (no wheel: install is skipped or replaced)."""
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(["bash", str(EXT_SRC / "build.sh"), "--no-wheel", "--out", str(out)],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stderr
    return Path(proc.stdout.strip().splitlines()[-1])


def repackage(src: Path, dest: Path, files: dict[str, str]) -> Path:
    """``src`` with ``files`` added or replaced (a zip keeps no modes here: waagent adds u+x)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dest, "w") as zout:
        for item in zin.infolist():
            if item.filename not in files:
                zout.writestr(item.filename, zin.read(item))
        for name, text in files.items():
            zout.writestr(name, text)
    return dest


class Vm:
    """A VM under the simulated guest agent: a temporary root, a service-manager stub, waagent's certificate."""

    def __init__(self, tmp: Path, waagent: tuple[Path, str], scale: float = 1.0, **switches: str) -> None:
        self.tmp, (self.waagent_dir, self.thumbprint) = tmp, waagent
        self.root = tmp / "root"
        (self.root / "var/lib/sefwd").mkdir(parents=True)  # the agent's state dir, as install.sh makes it
        self.calls_file = tmp / "calls.txt"
        stub = tmp / "systemctl-stub"
        stub.write_text(GA_STUB)
        stub.chmod(0o755)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SEFWD_", "ConfigSequence", "STUB_"))}
        # The handler's `#!/usr/bin/env python3` finds the interpreter itself (the one under the venv: no
        # package of ours), not a version manager's shim (pyenv's starts ~20 processes per command).
        env["PATH"] = os.pathsep.join([str(Path(getattr(sys, "_base_executable", sys.executable)).parent),
                                       env.get("PATH", os.defpath)])
        env.update({
            "SEFWD_EXT_ROOT": str(self.root), "SEFWD_EXT_WAAGENT_DIR": str(self.waagent_dir),
            "SEFWD_EXT_SERVICE_CMD": str(stub), "SEFWD_EXT_SEFWD_CMD": f"{sys.executable} -m forwarder",
            "SEFWD_EXT_SKIP_INSTALL": "1", "SEFWD_EXT_TIME_SCALE": str(scale), "STUB_CALLS": str(self.calls_file),
            "PYTHONPATH": str(REPO),
        })
        env.update(switches)
        self.ga = GuestAgent(tmp / "lib", env=env, scale=scale)
        self.config = self.root / "etc/sefwd/config.toml"
        self.env_file = self.root / "etc/sefwd/env"
        self.agent_heartbeat = self.root / "var/lib/sefwd/extension-heartbeat.json"

    def settings(self, seq: int, public: dict, protected: dict | None = PROTECTED) -> Settings:
        if protected is None:
            return Settings(seq, public)
        return Settings(seq, public, encrypt(self.waagent_dir, self.thumbprint, protected), self.thumbprint)

    def calls(self) -> list[str]:
        return self.calls_file.read_text().splitlines() if self.calls_file.exists() else []

    def report(self) -> Report:
        report = self.ga.report()
        assert report is not None
        return report

    def ran(self) -> list[tuple[str, str, int | None]]:
        return [(r.version, r.command, r.exit_code) for r in self.ga.runs]

    def timer(self) -> str:
        """One run of the root timer enable installed: its unit's ExecStart, as systemd would run it."""
        unit = (self.root / "etc/systemd/system/sefwd-extension-heartbeat.service").read_text()
        exec_start = next(line.split("=", 1)[1] for line in unit.splitlines() if line.startswith("ExecStart="))
        proc = subprocess.run(exec_start.split(), env=self.ga.env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and proc.stderr == "", proc
        return proc.stdout.strip()


@pytest.fixture
def vm(tmp_path: Path, waagent: tuple[Path, str]) -> Vm:
    return Vm(tmp_path, waagent)


def test_every_command_fits_the_guest_agents_limit_with_margin() -> None:
    handler = load_handler_module()
    assert handler.GUEST_AGENT_LIMITS == LIMITS  # the handler plans with what the guest agent enforces
    for command, limit in LIMITS.items():
        worst = sum(handler.BUDGETS[step] for step in handler.COMMAND_STEPS[command])
        assert worst + handler.MARGIN <= limit, (command, worst, limit)


def test_lifecycle_under_the_guest_agent(vm: Vm, package: Path) -> None:
    assert vm.ga.enable(package, "1.0.0", vm.settings(0, PUBLIC))
    assert vm.ran() == [("1.0.0", "install", 0), ("1.0.0", "enable", 0)]
    report = vm.report()
    assert report.status == "Ready" and report.message.startswith("sefwd enabled: service restarted")
    assert report.settings_status is not None
    assert (report.settings_status["status"], report.settings_status["code"]) == ("success", 0)
    assert report.settings_status["operation"] == "Enable"
    # The guest agent's heartbeatFile is root's own file, refreshed by a root timer from the agent's.
    assert not vm.ga.heartbeat_file("1.0.0").is_symlink() and vm.ga.heartbeat_file("1.0.0").is_file()
    assert f"handler.py heartbeat" in (vm.root / "etc/systemd/system/sefwd-extension-heartbeat.service").read_text()
    assert vm.timer() == "heartbeat: no agent heartbeat yet"
    assert source_env_file(vm.env_file)["SEFWD_AGENT_HEARTBEAT_FILE"] == str(vm.agent_heartbeat)
    assert tomllib.loads(vm.config.read_text()) == PUBLIC
    # Each command's stdout is one line; nothing on stderr: logs are in handler.log.
    assert all(r.output.startswith("[stdout]\n") and r.output.endswith("[stderr]\n") for r in vm.ga.runs)
    assert "service manager" in (vm.ga.instances["1.0.0"].log_dir / "handler.log").read_text()

    changed = {**PUBLIC, "imds": {"poll_interval": "3s"}}
    assert vm.ga.enable(package, "1.0.0", vm.settings(1, changed))
    assert vm.report().settings_status["status"] == "success"  # type: ignore[index]
    assert tomllib.loads(vm.config.read_text())["imds"]["poll_interval"] == "3s"

    assert vm.ga.uninstall()
    assert vm.ran()[-2:] == [("1.0.0", "disable", 0), ("1.0.0", "uninstall", 0)]
    assert not vm.ga.instances["1.0.0"].dir.exists() and not vm.config.exists() and not vm.env_file.exists()
    assert not vm.agent_heartbeat.exists()


def test_a_goal_state_without_settings_enables_the_defaults(vm: Vm, package: Path) -> None:
    assert vm.ga.enable(package, "1.0.0", None)
    settings_file = vm.ga.instances["1.0.0"].dir / "config" / "0.settings"
    assert settings_file.read_text() == ""  # what the guest agent writes
    assert vm.ran() == [("1.0.0", "install", 0), ("1.0.0", "enable", 0)]
    report = vm.report()
    assert report.status == "Ready" and "stdout (default" in report.message
    assert report.settings_status is None  # without settings the guest agent reads no status file
    assert tomllib.loads(vm.config.read_text()) == {}


def test_a_rejected_config_reaches_azure_cause_first(vm: Vm, package: Path) -> None:
    assert vm.ga.enable(package, "1.0.0", vm.settings(0, PUBLIC))
    bad = {"imds": {"poll_interval": "1ms"}, "sinks": [{"type": "nosuch", "name": "x" * 2000}]}
    assert not vm.ga.enable(package, "1.0.0", vm.settings(1, bad))
    run = vm.ga.runs[-1]
    assert (run.command, run.exit_code) == ("enable", 12)
    assert run.output.startswith("[stdout]\nEnable failed (code 12): publicSettings rejected by sefwd config check")
    handler_status = vm.ga.instances["1.0.0"].handler_status
    assert handler_status is not None and handler_status["code"] == 1009  # the exit code 12 is only text
    assert handler_status["message"].startswith("[ExtensionOperationError] Non-zero exit code: 12, ")
    report = vm.report()
    assert report.code == 1009 and report.status == "NotReady"  # the handler's heartbeat says why
    assert report.message.startswith("publicSettings rejected by sefwd config check (previous config kept): ")
    status = report.settings_status
    assert status is not None and (status["status"], status["code"]) == ("error", 12)
    assert status["message"].startswith("publicSettings rejected") and len(status["message"]) <= 1000
    assert "poll_interval" in status["message"][:300]
    assert tomllib.loads(vm.config.read_text()) == PUBLIC  # the previous config stays


def test_an_install_failure_reaches_azure_cause_first(vm: Vm, package: Path, tmp_path: Path) -> None:
    pkg = repackage(package, tmp_path / "failing.zip", {
        "wheels/scheduled_events_forwarder-0.1.0-py3-none-any.whl": "", "linux/install.sh": FAILING_INSTALL})
    vm.ga.env["SEFWD_EXT_SKIP_INSTALL"] = "0"
    assert not vm.ga.enable(pkg, "1.0.0", vm.settings(0, PUBLIC))
    assert vm.ran() == [("1.0.0", "install", 14)]
    report = vm.report()
    # Not installed: no heartbeat, no status file; only the exit code and the output's head.
    assert report.settings_status is None and report.code == 1007 and report.status == "NotReady"
    first_lines = report.message[:600]
    assert "Install failed (code 14): install.sh failed (exit 1): install.sh: error: pip install failed" in first_lines
    assert "No matching distribution found for orjson" in first_lines
    assert "Collecting package-" not in report.message  # the noise stays in handler.log
    log = (vm.ga.instances["1.0.0"].log_dir / "handler.log").read_text()
    assert "Collecting package-299" in log


PARTIAL_INSTALL = """#!/bin/sh
# install.sh that gets as far as the venv and the first config, then fails (pip could not reach the index)
while [ $# -gt 0 ]; do if [ "$1" = --prefix ]; then prefix="$2"; fi; shift; done
mkdir -p "$prefix/opt/sefwd/venv/bin" "$prefix/etc/sefwd"
: > "$prefix/opt/sefwd/venv/bin/python"
[ -e "$prefix/opt/sefwd/install.env" ] || echo SEFWD_CREATED_USER=no > "$prefix/opt/sefwd/install.env"
[ -e "$prefix/etc/sefwd/config.toml" ] || echo "# install.sh's first config" > "$prefix/etc/sefwd/config.toml"
[ -e "$prefix/etc/sefwd/env" ] || echo "# secrets" > "$prefix/etc/sefwd/env"
echo "install.sh: error: pip install failed" >&2
exit 1
"""


def test_a_failed_install_undoes_itself_since_removal_runs_no_uninstall(vm: Vm, package: Path, tmp_path: Path) -> None:
    pkg = repackage(package, tmp_path / "partial.zip", {
        "wheels/scheduled_events_forwarder-0.1.0-py3-none-any.whl": "", "linux/install.sh": PARTIAL_INSTALL})
    vm.ga.env["SEFWD_EXT_SKIP_INSTALL"] = "0"
    assert not vm.ga.enable(pkg, "1.0.0", vm.settings(0, PUBLIC))
    assert "the partial installation was removed (the guest agent runs no uninstall after a failed install)" in (
        vm.report().message)
    assert not (vm.root / "opt/sefwd").exists() and not (vm.root / "etc/sefwd").exists()
    assert vm.ga.uninstall()
    assert vm.ran() == [("1.0.0", "install", 14)]  # removing it ran nothing
    assert not vm.ga.instances["1.0.0"].dir.exists()


def test_a_failed_install_over_an_existing_installation_leaves_it(vm: Vm, package: Path, tmp_path: Path) -> None:
    _set_up_by_the_operator(vm.root)
    pkg = repackage(package, tmp_path / "partial.zip", {
        "wheels/scheduled_events_forwarder-0.1.0-py3-none-any.whl": "", "linux/install.sh": PARTIAL_INSTALL})
    vm.ga.env["SEFWD_EXT_SKIP_INSTALL"] = "0"
    assert not vm.ga.enable(pkg, "1.0.0", vm.settings(0, PUBLIC))
    assert "the installation that was there before is left as it was" in vm.report().message
    assert (vm.root / "opt/sefwd/install.env").exists() and vm.config.read_text() == OPERATOR_CONFIG


@pytest.mark.slow  # waits out real step limits
def test_steps_past_their_budget_are_killed_before_the_guest_agent_would(
        tmp_path: Path, waagent: tuple[Path, str], package: Path) -> None:
    vm = Vm(tmp_path, waagent, scale=SCALE)
    assert vm.ga.enable(package, "1.0.0", vm.settings(0, PUBLIC))
    vm.ga.env["STUB_HANG"] = "restart*"
    assert not vm.ga.enable(package, "1.0.0", vm.settings(1, {**PUBLIC, "imds": {"poll_interval": "4s"}}))
    run = vm.ga.runs[-1]
    assert run.exit_code == 13 and run.seconds < LIMITS["enable"] * SCALE  # the handler's own error, in time
    message = vm.report().settings_status["message"]  # type: ignore[index]
    assert f"restart {UNITS}: systemctl start did not finish within its" in message
    child = int(Path(f"{vm.calls_file}.child").read_text())
    wait_until(lambda: not _alive(child), 10, "the stub's child killed with its process group")

    vm.ga.env.pop("STUB_HANG")
    vm.ga.env["SEFWD_EXT_SEFWD_CMD"] = "sh -c 'sleep 600'"
    assert not vm.ga.enable(package, "1.0.0", vm.settings(2, PUBLIC))
    run = vm.ga.runs[-1]
    assert run.exit_code == 12 and run.seconds < LIMITS["enable"] * SCALE
    assert "config check did not finish" in vm.report().settings_status["message"]  # type: ignore[index]


@pytest.mark.slow  # waits out real step limits
def test_uninstall_fits_its_limit_when_everything_hangs(tmp_path: Path, waagent: tuple[Path, str], package: Path) -> None:
    vm = Vm(tmp_path, waagent, scale=SCALE)
    pkg = repackage(package, tmp_path / "hanging.zip", {
        "wheels/scheduled_events_forwarder-0.1.0-py3-none-any.whl": "",
        "linux/install.sh": "#!/bin/sh\necho installed\n", "linux/uninstall.sh": "#!/bin/sh\nsleep 600\n"})
    vm.ga.env["SEFWD_EXT_SKIP_INSTALL"] = "0"
    assert vm.ga.enable(pkg, "1.0.0", vm.settings(0, PUBLIC))
    vm.ga.env["STUB_HANG"] = "*"
    assert vm.ga.uninstall()
    disable, uninstall = vm.ga.runs[-2:]
    assert (disable.command, disable.exit_code) == ("disable", 0)  # a hanging service manager is tolerated
    assert (uninstall.command, uninstall.exit_code) == ("uninstall", 14) and uninstall.seconds < LIMITS["uninstall"] * SCALE
    assert not vm.config.exists() and not vm.env_file.exists()  # secrets go even when uninstall.sh fails


def test_the_guest_agent_kills_a_command_past_its_limit(tmp_path: Path, waagent: tuple[Path, str], package: Path) -> None:
    vm = Vm(tmp_path, waagent, scale=0.01)
    manifest = json.loads((EXT_SRC / "HandlerManifest.json").read_text())
    manifest[0]["handlerManifest"]["enableCommand"] = "hang.sh"
    pkg = repackage(package, tmp_path / "hang.zip", {
        "HandlerManifest.json": json.dumps(manifest),
        "hang.sh": f"#!/bin/sh\necho started\nsleep 600 &\necho $! > {tmp_path}/child\nwait\n"})
    assert not vm.ga.enable(pkg, "1.0.0", vm.settings(0, PUBLIC))
    run = vm.ga.runs[-1]
    assert (run.command, run.exit_code) == ("enable", None)
    handler_status = vm.ga.instances["1.0.0"].handler_status
    assert handler_status is not None and handler_status["code"] == 1011
    assert handler_status["message"].startswith("[ExtensionError] Timeout(3): ") and "started" in handler_status["message"]
    wait_until(lambda: not _alive(int((tmp_path / "child").read_text())), 10, "the whole process group killed")


def test_disable_never_blocks_uninstall_or_an_update(vm: Vm, package: Path, tmp_path: Path) -> None:
    assert vm.ga.enable(package, "1.0.0", vm.settings(0, PUBLIC))
    vm.ga.env["STUB_FAIL"] = "disable*"
    newer = repackage(package, tmp_path / "newer.zip", {})
    assert vm.ga.enable(newer, "1.1.0", vm.settings(0, PUBLIC))
    assert vm.ran()[2:] == [("1.0.0", "disable", 0), ("1.1.0", "update", 0), ("1.0.0", "uninstall", 0),
                            ("1.1.0", "install", 0), ("1.1.0", "enable", 0)]
    assert vm.ga.installed == "1.1.0" and vm.report().settings_status["status"] == "success"  # type: ignore[index]
    assert vm.config.exists()  # the old version's uninstall kept the installation for the new one

    vm.ga.env["STUB_FAIL"] = "*"
    assert vm.ga.uninstall()
    assert [r.exit_code for r in vm.ga.runs[-2:]] == [0, 0]
    assert not vm.config.exists() and not vm.ga.instances["1.1.0"].dir.exists()


def test_disable_and_uninstall_are_idempotent_without_a_service_manager(ext: Ext) -> None:
    ext.settings(0, PUBLIC)
    _ok(ext.run("enable"))
    messages = []
    for command in ("disable", "disable", "uninstall", "uninstall"):
        proc = ext.run(command, SEFWD_EXT_SERVICE_CMD=str(ext.dir / "no-such-systemctl"))
        _ok(proc)
        assert proc.stderr == "" and len(proc.stdout.splitlines()) == 1
        messages.append(ext.status(0)["formattedMessage"]["message"])
    assert "the service manager failed (ignored)" in messages[2] and "no service manager" in messages[2]
    assert not ext.config.exists()
    # Once uninstalled nothing is the extension's any more: the second uninstall touches nothing.
    assert messages[3].endswith("removed: nothing")


def test_the_running_agent_keeps_the_heartbeat_fresh(vm: Vm, package: Path, tmp_path: Path) -> None:
    assert vm.ga.enable(package, "1.0.0", vm.settings(0, {}, protected=None))
    assert vm.report().message.startswith("sefwd enabled")
    env = source_env_file(vm.env_file)
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        config = write_config(tmp_path / "c.toml", emu.url, tmp_path / "state")
        agent = AgentProcess(config, tmp_path / "a.log", env=env)
        try:
            report = wait_until(lambda: vm.timer() and (r := vm.report()).message.startswith("sefwd ")
                                and "enabled" not in r.message and r, 60, "the agent's own heartbeat, copied")
            assert report.status == "Ready" and report.message.startswith(("sefwd starting", "sefwd running"))
        finally:
            assert agent.terminate() == 0
    assert vm.timer() == "heartbeat: copied"
    report = vm.report()
    assert (report.status, report.message.split(" (")[0]) == ("NotReady", "sefwd stopped")
    assert vm.ga.heartbeat_file("1.0.0").stat().st_mtime == vm.agent_heartbeat.stat().st_mtime  # it ages with the agent's
    stale = time.time() - 601  # ten minutes later: the agent wrote nothing since
    for path in (vm.agent_heartbeat, vm.ga.heartbeat_file("1.0.0")):
        os.utime(path, (stale, stale))
    assert vm.timer() == "heartbeat: heartbeatFile is current"  # the timer never makes an old heartbeat look new
    assert vm.report().status == "Unresponsive"  # what the guest agent says once the agent is gone


def test_guest_agent_output_window() -> None:
    small = format_output("a\n", "b\n")
    assert small == "[stdout]\na\n\n\n[stderr]\nb\n"
    big = format_output("o" * 5000 + "END-OUT", "e" * 5000 + "END-ERR")
    assert len(big) <= OUTPUT_MAX and big.count("o") > 1000 and "END-OUT" in big and "END-ERR" in big


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie still answers kill(0): count it as gone
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def test_the_readme_notify_example_enables_with_its_urls_only_in_protected_settings(ext: Ext) -> None:
    readme = (EXT_SRC / "README.md").read_text()
    example = json.loads(readme.split("### Telling people", 1)[1].split("```json\n", 1)[1].split("```", 1)[0])
    ext.settings(0, example["settings"], example["protectedSettings"])
    _ok(ext.run("enable"))
    assert "events, oncall" in ext.status(0)["formattedMessage"]["message"]
    config = tomllib.loads(ext.config.read_text())
    assert config == example["settings"] and config["sinks"][1]["filter"]["affects_this_vm"] is True
    urls = example["protectedSettings"]["env"]["SEFWD_NOTIFY_URLS"]
    assert source_env_file(ext.env_file)["SEFWD_NOTIFY_URLS"] == urls
    assert "TIiajkdnlazkcOXrIdevi7FQ" not in ext.config.read_text()


def test_notify_urls_in_public_settings_are_refused_without_echoing_them(ext: Ext) -> None:
    ext.settings(0, PUBLIC)
    _ok(ext.run("enable"))
    good = ext.config.read_bytes()
    leaky = {"sinks": [{"type": "file", "name": "events", "path": "/var/log/sefwd/events.jsonl"},
                       {"type": "notify", "urls": ["discord://123456789012345678/T0KENthatShouldStayPrivate"]}]}
    ext.settings(1, leaky)
    proc = ext.run("enable", seq=1)
    assert proc.returncode == 11
    message = ext.status(1)["formattedMessage"]["message"]
    assert "publicSettings.sinks[1].urls" in message and "protectedSettings.env" in message and "urls_env" in message
    assert ext.config.read_bytes() == good
    texts = [proc.stdout, proc.stderr, message, *(p.read_text() for p in ext.log_dir.iterdir())]
    assert not any("T0KENthatShouldStayPrivate" in t for t in texts)


# -- safe to fail, overlap, repeat and remove ---------------------------------------------------------

def _mount_namespace_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            'd=$(mktemp -d) && mount -t tmpfs -o size=4k tmpfs "$d" && umount "$d"; rmdir "$d"'],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


FULL_DISK = """set -e
for dir in "$STATUS_DIR" "$LOG_DIR"; do
    mkdir -p "$dir"
    mount -t tmpfs -o size=8k,nr_inodes=8 tmpfs "$dir"
    dd if=/dev/zero of="$dir/filler" bs=1k count=64 2>/dev/null || true
    i=0; while touch "$dir/f$i" 2>/dev/null; do i=$((i + 1)); done
done
exec "$@"
"""


def test_disable_and_uninstall_act_on_a_full_disk(ext: Ext) -> None:
    """The status and log folders full (tiny tmpfs mounts in a private mount namespace): disable still
    stops the service and exits 0, uninstall still removes the config and the secrets."""
    if not _mount_namespace_works():
        pytest.skip("cannot mount a tmpfs in a private mount namespace here (not root?)")
    ext.settings(0, PUBLIC)
    _ok(ext.run("enable"))

    def full(command: str) -> subprocess.CompletedProcess[str]:
        wrapper = ext.dir / "full-disk.sh"
        wrapper.write_text(FULL_DISK)
        return ext.run(command, wrap=("unshare", "-m", "--propagation", "private", "sh", str(wrapper)),
                       STATUS_DIR=str(ext.status_dir), LOG_DIR=str(ext.log_dir))

    proc = full("disable")
    assert proc.returncode == 0, proc
    assert proc.stdout.startswith("Disable succeeded: sefwd stopped and disabled") and "Traceback" not in proc.stderr
    assert ext.calls()[-1] == f"disable --now {UNITS}"
    proc = full("uninstall")
    assert proc.returncode == 0, proc
    assert ext.calls()[-1] == f"disable --now {UNITS}"
    assert not ext.config.exists() and not ext.env_file.exists() and not ext.config.parent.exists()


def test_disable_and_uninstall_act_when_the_status_file_cannot_be_written(ext: Ext) -> None:
    """``<seq>.status`` is a directory (as unwritable as a read-only disk, even for root)."""
    ext.settings(0, PUBLIC)
    _ok(ext.run("enable"))
    (ext.status_dir / "0.status").unlink()
    (ext.status_dir / "0.status").mkdir()
    proc = ext.run("disable")
    assert proc.returncode == 0 and proc.stdout.startswith("Disable succeeded"), proc
    assert ext.calls()[-1] == f"disable --now {UNITS}"
    assert "cannot write status file" in (ext.log_dir / "handler.log").read_text()
    proc = ext.run("uninstall")
    assert proc.returncode == 0 and proc.stdout.startswith("Uninstall succeeded"), proc
    assert not ext.config.exists() and not ext.env_file.exists()
    # enable reports through its exit code and stdout when it cannot write its status
    ext.settings(0, {"sinks": [{"type": "nosuch"}]})
    proc = ext.run("enable")
    assert proc.returncode == 12 and "nosuch" in proc.stdout and proc.stderr == ""


CHECK_GATE = """#!/bin/sh
# `sefwd config check` held at a gate: HOLD_AFTER holds after the real check, HOLD_BEFORE before it.
if [ -n "$HOLD_BEFORE" ]; then touch "$HOLD_BEFORE.reached"; while [ ! -e "$HOLD_BEFORE" ]; do sleep 0.05; done; fi
"$REAL_PYTHON" -m forwarder "$@"; rc=$?
if [ -n "$HOLD_AFTER" ]; then touch "$HOLD_AFTER.reached"; while [ ! -e "$HOLD_AFTER" ]; do sleep 0.05; done; fi
exit $rc
"""


def test_two_enables_at_once_never_install_a_rejected_config(ext: Ext, tmp_path: Path) -> None:
    """An enable whose config passed its check is held before swapping it in while a second enable
    with a rejected config runs: the rejected config must never become the config."""
    ext.settings(0, PUBLIC)
    _ok(ext.run("enable"))
    gate = tmp_path / "check-gate.sh"
    gate.write_text(CHECK_GATE)
    gate.chmod(0o755)
    good = {**PUBLIC, "imds": {"poll_interval": "3s"}}
    bad = {"imds": {"poll_interval": "1ms"}, "sinks": [{"type": "nosuch"}]}
    ext.settings(1, good)
    ext.settings(2, bad)
    hold_a, hold_b = tmp_path / "release-a", tmp_path / "release-b"

    def start(seq: int, **hold: str) -> subprocess.Popen[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SEFWD_", "ConfigSequence"))}
        env.update({"SEFWD_EXT_ROOT": str(ext.root), "SEFWD_EXT_WAAGENT_DIR": str(ext.waagent_dir),
                    "SEFWD_EXT_SERVICE_CMD": str(ext.stub), "SEFWD_EXT_SEFWD_CMD": str(gate),
                    "SEFWD_EXT_SKIP_INSTALL": "1", "REAL_PYTHON": sys.executable, "PYTHONPATH": str(REPO),
                    "STUB_CALLS": str(ext.calls_file), "STUB_STATUS_DIR": str(ext.status_dir),
                    "STUB_SNAPSHOT": str(ext.snapshot), "ConfigSequenceNumber": str(seq), **hold})
        return subprocess.Popen([sys.executable, str(ext.dir / "handler.py"), "enable"], cwd=ext.dir, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    first = start(1, HOLD_AFTER=str(hold_a))
    second = None
    try:
        wait_until(lambda: Path(f"{hold_a}.reached").exists() or first.poll() is not None, 60, "the first check passed")
        second = start(2, HOLD_BEFORE=str(hold_b))
        log = ext.log_dir / "handler.log"
        wait_until(lambda: Path(f"{hold_b}.reached").exists() or "waiting up to" in log.read_text(), 60,
                   "the second enable at its check or at the lock")
        hold_a.touch()
        hold_b.touch()
        out_a, _ = first.communicate(timeout=120)
        out_b, _ = second.communicate(timeout=120)
    finally:
        hold_a.touch()
        hold_b.touch()
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
    assert first.returncode == 0, out_a
    assert second.returncode == 12 and "previous config kept" in out_b, out_b
    assert tomllib.loads(ext.config.read_text()) == good  # the config that passed its check, nothing else
    assert ext.status(1)["status"] == "success" and ext.status(2)["code"] == 12
    assert not list(ext.config.parent.glob("*ext-new*")) and not (ext.root / "etc/sefwd/.extension-journal.json").exists()


def test_an_interrupted_swap_is_completed_by_the_next_command(ext: Ext, monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed between its renames, an enable leaves a journal: the next command finishes the swap,
    so config and secrets are both old or both new, and the next enable restarts the service."""
    ext.settings(0, PUBLIC)
    _ok(ext.run("enable"))
    handler = load_handler_module()
    monkeypatch.setenv("SEFWD_EXT_ROOT", str(ext.root))
    config_path, env_path = str(ext.config), str(ext.env_file)
    new_config, new_env = b"# new config\n", b"# new env\n"
    pairs = [[handler._stage(config_path, new_config, 0o640), config_path],
             [handler._stage(env_path, new_env, 0o600), env_path]]
    (ext.root / "etc/sefwd/.extension-restart-pending").write_bytes(b"")
    (ext.root / "etc/sefwd/.extension-journal.json").write_text(json.dumps({"renames": pairs}))
    os.replace(*pairs[0])  # the command was killed here: new config, old secrets
    _ok(ext.run("disable"))
    assert ext.config.read_bytes() == new_config and ext.env_file.exists() is False  # disable then removes the secrets
    assert "an interrupted command was completed" in ext.status(0)["formattedMessage"]["message"]
    assert not list(ext.config.parent.glob("*ext-new*"))
    _ok(ext.run("enable"))
    assert ext.calls()[-1] == f"restart {UNITS}" and tomllib.loads(ext.config.read_text()) == PUBLIC


def test_a_stray_staged_file_of_a_killed_command_is_removed(ext: Ext) -> None:
    ext.settings(0, PUBLIC)
    _ok(ext.run("enable"))
    stray = [ext.config.parent / "config.toml.ext-new", ext.config.parent / ".env.x1y2z3.ext-new"]
    for path in stray:
        path.write_text("half-written")
    _ok(ext.run("enable"))
    assert not any(path.exists() for path in stray)


OPERATOR_CONFIG = """# written by cloud-init for this VM
[[sinks]]
type = "webhook"
name = "ops"
url = "https://hooks.example.com/ops"
secret_env = "OPS_WEBHOOK_SECRET"
"""
OPERATOR_ENV = 'OPS_WEBHOOK_SECRET="whsec_b3BlcmF0b3Itc2VjcmV0LW9mLXRoaXMtdm0hISE="\n'


def _set_up_by_the_operator(root: Path) -> None:
    """/etc/sefwd and /opt/sefwd as install.sh leaves them, with the operator's own sink and secret."""
    etc = root / "etc/sefwd"
    etc.mkdir(parents=True)
    (etc / "config.toml").write_text(OPERATOR_CONFIG)
    (etc / "config.toml").chmod(0o640)
    (etc / "env").write_text(OPERATOR_ENV)
    (etc / "env").chmod(0o600)
    (root / "opt/sefwd").mkdir(parents=True)
    (root / "opt/sefwd/install.env").write_text("# Written by install.sh\nSEFWD_VERSION=0.1.0\nSEFWD_CREATED_USER=no\n")


def test_a_vm_set_up_before_the_extension_keeps_its_files_until_handed_over(vm: Vm, package: Path) -> None:
    _set_up_by_the_operator(vm.root)
    etc = vm.root / "etc/sefwd"
    assert not vm.ga.enable(package, "1.0.0", vm.settings(0, PUBLIC))
    assert vm.ran() == [("1.0.0", "install", 0), ("1.0.0", "enable", 16)]
    status = vm.report().settings_status
    assert status is not None and (status["status"], status["code"]) == ("error", 16)
    message = status["message"]
    assert "/etc/sefwd/config.toml and /etc/sefwd/env were not written by this extension" in message
    assert "mv /etc/sefwd/config.toml /etc/sefwd/config.toml.before-extension" in message
    assert (etc / "config.toml").read_text() == OPERATOR_CONFIG and (etc / "env").read_text() == OPERATOR_ENV
    assert vm.calls() == []  # the operator's service was not touched

    # Removing the extension leaves the operator's installation and files as they were.
    assert vm.ga.uninstall()
    assert (etc / "config.toml").read_text() == OPERATOR_CONFIG and (etc / "env").read_text() == OPERATOR_ENV
    assert (vm.root / "opt/sefwd/install.env").exists() and vm.calls() == []
    assert not (etc / ".extension-manifest.json").exists()

    # Handed over as the status says: the extension writes and later removes only its own files.
    for name in ("config.toml", "env"):
        (etc / name).rename(etc / f"{name}.before-extension")
    assert vm.ga.enable(package, "1.0.0", vm.settings(0, PUBLIC))
    assert tomllib.loads(vm.config.read_text()) == PUBLIC and vm.calls()[-1] == f"restart {UNITS}"
    assert vm.ga.uninstall()
    assert not vm.config.exists() and not vm.env_file.exists()
    assert (etc / "config.toml.before-extension").read_text() == OPERATOR_CONFIG
    assert (vm.root / "opt/sefwd/install.env").exists()  # there before the extension: left in place
    assert "the installation (/opt/sefwd, the unit, the user) was there before the extension" in (
        vm.ga.instances["1.0.0"].log_dir / "handler.log").read_text()


def test_files_an_earlier_extension_version_wrote_are_still_its_own(ext: Ext) -> None:
    """No manifest (written by a version before it existed): the header says whose the files are."""
    ext.settings(0, PUBLIC)
    _ok(ext.run("enable"))
    (ext.root / "etc/sefwd/.extension-manifest.json").unlink()
    changed = {**PUBLIC, "imds": {"poll_interval": "3s"}}
    ext.settings(1, changed)
    _ok(ext.run("enable", seq=1))
    assert tomllib.loads(ext.config.read_text()) == changed


def _plant(vm: Vm, data: bytes | None = None, size: int | None = None) -> None:
    """What a compromised service user can do to its own heartbeat file."""
    path = vm.agent_heartbeat
    if path.exists() or path.is_symlink():
        path.unlink()
    if data is not None:
        path.write_bytes(data)
    if size is not None:
        with open(path, "ab") as f:
            f.truncate(size)  # sparse: no block written


@pytest.mark.parametrize("planted", [
    pytest.param(b'[{"version": 1.0, "heartbeat": {"status": "Ready", "code": "0", "formattedMessage": "up"}}]', id="wrong-shape"),
    pytest.param(b'{"heartbeat": []}', id="not-a-list"),
    pytest.param(None, id="sparse-64MiB"),
])
def test_a_planted_heartbeat_never_reaches_the_guest_agent(vm: Vm, package: Path, planted: bytes | None) -> None:
    assert vm.ga.enable(package, "1.0.0", vm.settings(0, {}, protected=None))
    _plant(vm, planted, size=64 * 2**20 if planted is None else None)
    heartbeat = vm.ga.heartbeat_file("1.0.0")
    future = time.time() + 5  # the agent's file is newer than the handler's last word
    os.utime(vm.agent_heartbeat, (future, future))
    assert vm.timer().startswith("heartbeat: refused: ")
    assert not heartbeat.is_symlink() and heartbeat.stat().st_size < 4096  # never a link to the service user's file
    doc = json.loads(heartbeat.read_text())
    assert doc[0]["heartbeat"]["status"] == "NotReady" and doc[0]["heartbeat"]["formattedMessage"]["lang"] == "en-US"
    report = vm.report()  # the guest agent reads a well-formed heartbeat that says what is wrong
    assert report.status == "NotReady" and "sefwd's heartbeat file /var/lib/sefwd/extension-heartbeat.json refused" in report.message


def test_a_fifo_or_a_link_as_the_agents_heartbeat_is_refused_unread(vm: Vm, package: Path, tmp_path: Path) -> None:
    assert vm.ga.enable(package, "1.0.0", vm.settings(0, {}, protected=None))
    root_only = tmp_path / "root-only"
    root_only.write_text(json.dumps([{"version": 1.0, "heartbeat": {
        "status": "Ready", "code": 0, "formattedMessage": {"lang": "en-US", "message": "root's secret"}}}]))
    vm.agent_heartbeat.unlink(missing_ok=True)
    vm.agent_heartbeat.symlink_to(root_only)
    os.utime(vm.agent_heartbeat, (time.time() + 5, time.time() + 5), follow_symlinks=False)
    assert "refused: cannot open" in vm.timer()
    assert "root's secret" not in vm.ga.heartbeat_file("1.0.0").read_text()
    vm.agent_heartbeat.unlink()
    os.mkfifo(vm.agent_heartbeat)  # a reader would block forever
    os.utime(vm.agent_heartbeat, (time.time() + 10, time.time() + 10))
    assert vm.timer() == "heartbeat: refused: not a regular file"


def test_a_held_lock_stops_enable_but_never_disable(ext: Ext) -> None:
    """Another command holding the lock past the wait: enable changes nothing (exit 17), disable acts anyway."""
    import fcntl

    ext.settings(0, PUBLIC)
    _ok(ext.run("enable"))
    good, calls = ext.config.read_bytes(), ext.calls()
    lock_path = ext.root / "run/lock/sefwd-extension.lock"
    ext.settings(1, {**PUBLIC, "imds": {"poll_interval": "3s"}})
    with open(lock_path, "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        proc = ext.run("enable", seq=1, SEFWD_EXT_TIME_SCALE="0.01")  # waits 0.3 s for the lock
        assert proc.returncode == 17 and "nothing changed" in proc.stdout, proc
        assert ext.config.read_bytes() == good and ext.calls() == calls and not (ext.status_dir / "1.status").exists()
        proc = ext.run("disable", SEFWD_EXT_TIME_SCALE="0.01")
        assert proc.returncode == 0 and "went on without it" in proc.stdout, proc
        assert ext.calls()[-1] == f"disable --now {UNITS}"
    _ok(ext.run("enable", seq=1))  # the lock free again
    assert tomllib.loads(ext.config.read_text())["imds"]["poll_interval"] == "3s"


def test_disable_and_uninstall_act_without_a_handler_environment(ext: Ext) -> None:
    ext.settings(0, PUBLIC)
    _ok(ext.run("enable"))
    (ext.dir / "HandlerEnvironment.json").unlink()
    assert ext.run("enable").returncode == 1  # nothing to go on
    proc = ext.run("disable")
    assert proc.returncode == 0 and "HandlerEnvironment.json" in proc.stdout, proc
    assert ext.calls()[-1] == f"disable --now {UNITS}"
    _ok(ext.run("uninstall"))
    assert not ext.config.exists()
