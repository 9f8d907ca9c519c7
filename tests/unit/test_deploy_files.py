"""deploy/linux, deploy/windows, deploy/cloud-init: the files are complete and agree with each other.

Windows cannot run here (no PowerShell): its scripts are checked for their pieces, balanced
syntax, and the config and service XML they embed.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from forwarder.common.compat import tomllib
from forwarder.common.values import parse_duration

ROOT = Path(__file__).resolve().parents[2]
LINUX = ROOT / "deploy" / "linux"
WINDOWS = ROOT / "deploy" / "windows"
CLOUD_INIT = ROOT / "deploy" / "cloud-init"


def config_check(text: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    path = tmp / "config.toml"
    path.write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEFWD_")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "forwarder", "config", "check", "--config", str(path)],
                          capture_output=True, text=True, timeout=60, env=env, cwd=str(tmp))


def moved(text: str, tmp: Path) -> str:
    """The Linux paths of a config moved into ``tmp`` (a check must not touch the real /var)."""
    return text.replace("/var/lib/sefwd", str(tmp / "state")).replace("/var/log/sefwd", str(tmp / "log"))


# -- Linux -------------------------------------------------------------------------------------

def unit_sections(path: Path) -> dict[str, dict[str, list[str]]]:
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"{path.name}: a setting outside any section: {raw}"
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: not a key=value line: {raw}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def test_unit_is_hardened_and_runs_the_installed_agent() -> None:
    unit = unit_sections(LINUX / "sefwd.service")
    service = {key: values[-1] for key, values in unit["Service"].items()}
    assert service["ExecStart"] == "/opt/sefwd/venv/bin/sefwd run --config /etc/sefwd/config.toml"
    expected = {
        "User": "sefwd", "Group": "sefwd", "Restart": "on-failure", "RestartSec": "5s",
        "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes", "NoNewPrivileges": "yes",
        "StateDirectory": "sefwd", "ConfigurationDirectory": "sefwd", "LogsDirectory": "sefwd",
        "CapabilityBoundingSet": "", "RestrictAddressFamilies": "AF_INET AF_INET6 AF_UNIX",
        "SystemCallArchitectures": "native", "LockPersonality": "yes", "KillSignal": "SIGTERM",
        "ProtectKernelTunables": "yes", "ProtectKernelModules": "yes", "ProtectKernelLogs": "yes",
        "EnvironmentFile": "-/etc/sefwd/env",
    }
    assert {key: service.get(key) for key in expected} == expected
    # IMDS is link-local: an address filter would cut the agent off from it.
    assert "IPAddressDeny" not in service and "IPAddressAllow" not in service
    assert "MemoryDenyWriteExecute" not in service
    assert "multi-user.target" in unit["Install"]["WantedBy"]


def test_stop_timeout_covers_the_drain_timeout_of_the_shipped_config() -> None:
    service = unit_sections(LINUX / "sefwd.service")["Service"]
    config = tomllib.loads((LINUX / "config.toml").read_text())
    assert parse_duration(service["TimeoutStopSec"][-1]) >= parse_duration(config["agent"]["drain_timeout"]) + 10


def test_shipped_config_uses_the_directories_systemd_makes_writable(tmp_path: Path) -> None:
    text = (LINUX / "config.toml").read_text()
    config = tomllib.loads(text)
    assert config["state"]["dir"] == "/var/lib/sefwd"  # StateDirectory=sefwd
    for sink in config["sinks"]:
        if sink["type"] == "file":
            assert sink["path"].startswith("/var/log/sefwd/")  # LogsDirectory=sefwd
    assert config["imds"]["endpoint"] == "http://169.254.169.254"
    res = config_check(moved(text, tmp_path), tmp_path)
    assert res.returncode == 0, res.stderr


CASE_OPTION = r"^\s+(?:-h\|)?(--[a-z-]+)(?:=\*)?\)"  # an option of the scripts' argument loops


def test_shell_scripts_parse_and_document_their_options() -> None:
    for name in ("install.sh", "uninstall.sh"):
        script = LINUX / name
        assert script.read_text().startswith("#!/usr/bin/env bash\n")
        assert os.access(script, os.X_OK), f"{name} is not executable"
        res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
        assert res.returncode == 0, res.stderr
        if shutil.which("shellcheck"):
            lint = subprocess.run(["shellcheck", "-S", "warning", str(script)], capture_output=True, text=True, timeout=60)
            assert lint.returncode == 0, lint.stdout
        text = script.read_text()
        usage = text[text.index("usage()"):text.index("EOF\n}")]
        parsed = set(re.findall(CASE_OPTION, text, re.M))
        assert parsed and all(option in usage for option in parsed), f"{name}: undocumented options"
    # Every option the READMEs use exists.
    known = {o for n in ("install.sh", "uninstall.sh") for o in re.findall(CASE_OPTION, (LINUX / n).read_text(), re.M)}
    assert {"--source", "--extras", "--python", "--prefix", "--no-user", "--no-start", "--purge", "--help"} <= known
    for readme in (LINUX / "README.md", CLOUD_INIT / "README.md"):
        for line in readme.read_text().splitlines():
            if "install.sh" in line:
                used = set(re.findall(r"\s(--[a-z][a-z-]+)", line))
                assert used <= known, f"{readme}: {sorted(used - known)}"


def test_install_paths_match_the_unit_and_the_vm_extension() -> None:
    install = (LINUX / "install.sh").read_text()
    uninstall = (LINUX / "uninstall.sh").read_text()
    for fragment in ('OPT="$PREFIX/opt/sefwd"', 'VENV="$OPT/venv"', 'ETC="$PREFIX/etc/sefwd"',
                     '"$PREFIX/var/lib/sefwd"', '"$PREFIX/var/log/sefwd"', 'UNIT_DIR="$PREFIX/etc/systemd/system"'):
        assert fragment in install
    for fragment in ('"$prefix/opt/sefwd"', '"$prefix/etc/systemd/system/sefwd.service"', '"$prefix/etc/sefwd"',
                     '"$prefix/var/lib/sefwd"', '"$prefix/var/log/sefwd"'):
        assert fragment in uninstall
    # The symlink both scripts agree on.
    assert install.count("../../../opt/sefwd/venv/bin/sefwd") == 1 and uninstall.count("../../../opt/sefwd/venv/bin/sefwd") == 1


def test_the_vm_extension_heartbeat_is_where_the_hardened_unit_may_write() -> None:
    # The agent runs with ProtectSystem=strict: only its StateDirectory (/var/lib/sefwd) is writable,
    # so the file the extension's root timer copies to waagent's heartbeatFile must live there.
    unit = (LINUX / "sefwd.service").read_text()
    handler = (ROOT / "deploy" / "vm-extension" / "handler.py").read_text()
    assert "ProtectSystem=strict" in unit and "StateDirectory=sefwd" in unit
    assert 'AGENT_HEARTBEAT = "/var/lib/sefwd/' in handler
    assert "TimeoutStopSec=30s" in unit and "TimeoutStartSec=30s" in unit  # the 90 s systemctl budget covers both


# -- cloud-init --------------------------------------------------------------------------------

def block_scalar(text: str, anchor: str) -> str:
    """The ``|`` block that follows the line matching ``anchor`` (a minimal YAML reader)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if re.search(anchor, line))
    header = next(i for i in range(start, len(lines)) if lines[i].rstrip().endswith("|"))
    body = []
    indent: int | None = None
    for line in lines[header + 1:]:
        if line.strip():
            width = len(line) - len(line.lstrip())
            if indent is None:
                indent = width
            if width < indent:
                break
            body.append(line[indent:])
        else:
            body.append("")
    return "\n".join(body).rstrip("\n") + "\n"


def cloud_config() -> str:
    return (CLOUD_INIT / "cloud-config.yaml").read_text()


def test_cloud_config_header_and_structure() -> None:
    text = cloud_config()
    assert text.startswith("#cloud-config\n")
    assert "\t" not in text
    top = set(re.findall(r"^([a-z_]+):", text, re.M))
    assert {"packages", "write_files", "runcmd"} <= top
    assert re.search(r"^  - python3-venv$", text, re.M)


def test_cloud_config_parses_as_yaml_when_pyyaml_is_there() -> None:
    yaml = pytest.importorskip("yaml")
    data = yaml.safe_load(cloud_config())
    assert "python3-venv" in data["packages"]
    (entry,) = [f for f in data["write_files"] if f["path"] == "/etc/sefwd/config.toml"]
    assert entry["permissions"] == "0640"
    assert entry["content"] == block_scalar(cloud_config(), r"path: /etc/sefwd/config\.toml")
    (script,) = [c for c in data["runcmd"] if isinstance(c, list)]
    assert script[:2] == ["bash", "-c"] and script[2] == block_scalar(cloud_config(), r"^runcmd:")


def test_cloud_config_embedded_config_passes_config_check(tmp_path: Path) -> None:
    embedded = block_scalar(cloud_config(), r"path: /etc/sefwd/config\.toml")
    config = tomllib.loads(embedded)
    assert config["state"]["dir"] == "/var/lib/sefwd" and config["sinks"]
    res = config_check(moved(embedded, tmp_path), tmp_path)
    assert res.returncode == 0, res.stderr


def test_cloud_config_boot_script_runs_install_sh_and_refuses_placeholders(tmp_path: Path) -> None:
    script = block_scalar(cloud_config(), r"^runcmd:")
    assert "deploy/linux/install.sh" in script
    res = subprocess.run(["bash", "-n", "-c", script], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    # Left unreplaced, the placeholders stop the script before it fetches anything.
    refused = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30, cwd=tmp_path)
    assert refused.returncode == 1 and "replace @SEFWD_GIT_URL@" in refused.stderr
    placeholders = set(re.findall(r"@[A-Z_]+@", cloud_config()))
    assert placeholders == {"@SEFWD_GIT_URL@", "@SEFWD_GIT_REF@"}
    readme = (CLOUD_INIT / "README.md").read_text()
    assert all(p in readme for p in placeholders)


# -- Windows -----------------------------------------------------------------------------------

def here_string(text: str, variable: str) -> str:
    """The body of ``$variable = @' ... '@`` in a PowerShell script."""
    match = re.search(rf"^\${variable} = @'\n(.*?)\n'@$", text, re.M | re.S)
    assert match, f"no here-string ${variable}"
    return match.group(1) + "\n"


def powershell_code(text: str) -> str:
    """``text`` without comments, strings and here-strings: what is left must balance."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        two = text[i:i + 2]
        if two in ("@'", '@"') and text[i + 2:i + 3] == "\n":
            end = text.index("\n" + two[1] + "@", i + 3)
            i = end + 3
        elif two == "<#":
            i = text.index("#>", i + 2) + 2
        elif text[i] == "#":
            i = text.find("\n", i) if "\n" in text[i:] else n
        elif text[i] == "'":
            j = i + 1
            while True:
                j = text.index("'", j)
                if text[j + 1:j + 2] == "'":
                    j += 2
                    continue
                break
            i = j + 1
        elif text[i] == '"':
            j = i + 1
            while text[j] != '"':
                j += 2 if text[j] == "`" else 1
            i = j + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


@pytest.mark.parametrize("name", ["install.ps1", "uninstall.ps1"])
def test_powershell_scripts_are_balanced_and_strict(name: str) -> None:
    text = (WINDOWS / name).read_text()
    assert text.startswith("#Requires -Version 5.1\n#Requires -RunAsAdministrator\n")
    assert "Set-StrictMode -Version Latest" in text and "$ErrorActionPreference = 'Stop'" in text
    code = powershell_code(text)
    for open_, close in ("{}", "()", "[]"):
        depth = 0
        for ch in code:
            depth += (ch == open_) - (ch == close)
            assert depth >= 0, f"{name}: unbalanced {open_}{close}"
        assert depth == 0, f"{name}: unbalanced {open_}{close}"
    assert "\t" not in text and "\r" not in text


def _assignment(text: str, name: str) -> str:
    match = re.search(rf"^\${name} = (.+)$", text, re.M)
    assert match, f"${name} is not assigned"
    return match.group(1)


def test_windows_layout_matches_between_scripts_and_linux() -> None:
    install = (WINDOWS / "install.ps1").read_text()
    uninstall = (WINDOWS / "uninstall.ps1").read_text()
    assert _assignment(install, "InstallDir") == "Join-Path $env:ProgramFiles 'sefwd'"
    assert _assignment(install, "DataDir") == "Join-Path $env:ProgramData 'sefwd'"
    assert _assignment(install, "Venv") == "Join-Path $InstallDir 'venv'"
    assert _assignment(install, "ConfigPath") == "Join-Path $DataDir 'config.toml'"
    assert _assignment(install, "StateDir") == "Join-Path $DataDir 'state'"
    for name in ("ServiceId", "InstallDir", "DataDir", "ServiceExe"):
        assert _assignment(install, name) == _assignment(uninstall, name)
    # The same distribution, default extras and requirement forms as install.sh.
    linux = (LINUX / "install.sh").read_text()
    assert "$Extras = 'eventhubs,loganalytics'" in install and 'EXTRAS="eventhubs,loganalytics"' in linux
    assert "$Dist = 'scheduled-events-forwarder'" in install and "DIST=scheduled-events-forwarder" in linux
    # Only SYSTEM and Administrators, by SID (tests/unit/test_windows_acl_plan.py checks how).
    assert "$FinalSids = @('S-1-5-18', 'S-1-5-32-544')" in install and "SetAccessRuleProtection($true, $false)" in install


def test_winsw_download_is_pinned_and_verified() -> None:
    install = (WINDOWS / "install.ps1").read_text()
    version = _assignment(install, "WinSWVersion").strip("'")
    assert re.fullmatch(r"\d+\.\d+\.\d+", version)
    assert '"https://github.com/winsw/winsw/releases/download/v$WinSWVersion/WinSW-x64.exe"' in install
    pin = re.search(r"\[string\]\$WinSWSha256 = '([0-9A-F]{64})'", install)
    assert pin, "no SHA-256 pin"
    assert "Get-FileHash -Algorithm SHA256" in install and "-ne $WinSWSha256" in install
    readme = (WINDOWS / "README.md").read_text()
    assert pin.group(1) in readme and version in readme
    assert "Untested on Windows" in readme


def test_windows_config_template_passes_config_check(tmp_path: Path) -> None:
    install = (WINDOWS / "install.ps1").read_text()
    template = here_string(install, "ConfigTemplate")
    placeholders = set(re.findall(r"@[A-Z_]+@", template))
    assert placeholders == {"@STATE_DIR@", "@LOG_DIR@", "@SECRETS_DIR@"}
    expand = install[install.index("function Expand-Template"):]
    assert all(f"'{p}'" in expand for p in placeholders)
    text = (template.replace("@STATE_DIR@", str(tmp_path / "state")).replace("@LOG_DIR@", str(tmp_path / "log"))
            .replace("@SECRETS_DIR@", str(tmp_path / "secrets")).replace("\\events.jsonl", "/events.jsonl"))
    config = tomllib.loads(text)
    linux = tomllib.loads((LINUX / "config.toml").read_text())
    assert config["imds"] == linux["imds"] and config["agent"] == linux["agent"]
    assert [s["type"] for s in config["sinks"]] == [s["type"] for s in linux["sinks"]]
    res = config_check(text, tmp_path)
    assert res.returncode == 0, res.stderr


def test_windows_service_xml_is_well_formed_and_stops_gracefully() -> None:
    install = (WINDOWS / "install.ps1").read_text()
    template = here_string(install, "ServiceTemplate")
    placeholders = set(re.findall(r"@[A-Z_]+@", template))
    expand = install[install.index("function Expand-Template"):]
    assert placeholders and all(f"'{p}'" in expand for p in placeholders)
    xml = ET.fromstring(template.replace("@SEFWD_EXE@", r"C:\Program Files\sefwd\venv\Scripts\sefwd.exe")
                        .replace("@CONFIG@", r"C:\ProgramData\sefwd\config.toml")
                        .replace("@DATA_DIR@", r"C:\ProgramData\sefwd").replace("@LOG_DIR@", r"C:\ProgramData\sefwd\logs"))
    assert xml.tag == "service" and xml.findtext("id") == "sefwd"
    assert _assignment(install, "SefwdExe") == "Join-Path $Venv 'Scripts\\sefwd.exe'"
    assert xml.findtext("arguments") == r'run --config "C:\ProgramData\sefwd\config.toml"'
    assert xml.findtext("startmode") == "Automatic"
    failure = xml.find("onfailure")
    assert failure is not None and failure.get("action") == "restart"
    stop = xml.findtext("stoptimeout") or ""
    drain = tomllib.loads((LINUX / "config.toml").read_text())["agent"]["drain_timeout"]
    assert parse_duration(stop.replace(" sec", "s")) >= parse_duration(drain) + 10
