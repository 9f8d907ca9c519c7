"""A simulated Azure Linux guest agent (waagent) running one single-config extension handler.

Written here from how WALinuxAgent 2.15 runs handlers (azurelinuxagent/ga/exthandlers.py and
extensionprocessutil.py; no code of it): only the parts a handler can observe or that decide
what reaches Azure.

* A package is unzipped into ``<lib>/<Name>-<version>/`` (zip modes are lost; waagent adds u+x to
  every file), then ``HandlerEnvironment.json``, ``config/`` and ``status/`` are created.
* Settings: ``config/<seq>.settings`` holds ``{"runtimeSettings": [{"handlerSettings": ...}]}``;
  a goal state without settings gets an **empty** ``config/0.settings``.
* Commands run through a shell from the extension dir, in a new session, with
  ``ConfigSequenceNumber`` (0 without settings) and the ``AZURE_GUEST_AGENT_*`` variables.
  Limits: install 900 s, enable 300 s, disable 900 s, update 900 s, uninstall 300 s (times
  ``scale``); past it the whole process group gets SIGKILL.
* Output: the first 3,200 bytes of stdout and of stderr, as ``[stdout]\\n…\\n\\n[stderr]\\n…``; when
  both together reach 3,200 characters only the tail of each (about 1,590) is kept.
* A failed command sets the handler status NotReady with code 1007 install, 1008 update, 1009
  enable, 1010 disable, 1011 timeout, and the message ``Non-zero exit code: N, <cmd>`` (or
  ``Timeout(T): <cmd>``) followed by the output. The extension's own exit code is only text.
* Removing the extension runs disable (if enabled) and uninstall, then deletes the directory; for a
  handler whose install failed (still NotInstalled) it runs nothing and only deletes the directory.
* Disable runs outside the error handling of uninstall and update: a failing disable leaves the
  handler installed (uninstall) or aborts the update (the old version stays) unless the manifest
  says ``continueOnUpdateFailure``. A failing uninstall is ignored (the directory goes anyway).
* Status for Azure: the handler status; once the handler is installed also the heartbeat (with
  ``reportHeartbeat``: status and message from the file, ``Unresponsive`` when it is older than
  600 s, an error when missing or malformed) and, if the extension has settings,
  ``status/<seq>.status`` parsed as waagent does (unknown status values become ``error``).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LIMITS = {"install": 900, "enable": 300, "disable": 900, "update": 900, "uninstall": 300}
ERROR_CODES = {"install": 1007, "update": 1008, "enable": 1009, "disable": 1010, "uninstall": 1000}
TIMEOUT_CODE = 1011
STATUS_INVALID = 1012
OUTPUT_MAX = 3200
UNRESPONSIVE_AFTER = 600
STATUS_VALUES = ("transitioning", "warning", "error", "success")
_TEMPLATE = "[stdout]\n{}\n\n[stderr]\n{}"


class CommandFailed(Exception):
    """A handler command exited non-zero or timed out (waagent's ExtensionError)."""

    def __init__(self, code: int, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.exit_code = exit_code


def format_output(stdout: str, stderr: str) -> str:
    """The two streams as waagent puts them in a message: at most OUTPUT_MAX characters."""
    each = (OUTPUT_MAX - len(_TEMPLATE.format("", ""))) // 2
    if len(stdout) + len(stderr) < OUTPUT_MAX:
        return _TEMPLATE.format(stdout, stderr)
    if len(stdout) < each:
        return _TEMPLATE.format(stdout, stderr[-min(2 * each - len(stdout), len(stderr)):])
    if len(stderr) < each:
        return _TEMPLATE.format(stdout[-min(2 * each - len(stderr), len(stdout)):], stderr)
    return _TEMPLATE.format(stdout[-each:], stderr[-each:])


def _read_head(f: Any) -> str:
    f.seek(0)
    return f.read(OUTPUT_MAX).decode("utf-8", "backslashreplace")


@dataclass
class Settings:
    """One extension's settings in a goal state."""

    seq: int
    public: dict[str, Any] | None = None
    protected: str | None = None  # base64 PKCS#7, as Azure sends it
    thumbprint: str | None = None


@dataclass
class Instance:
    """One handler version on disk."""

    name: str
    version: str
    dir: Path
    log_dir: Path
    state: str = "NotInstalled"  # NotInstalled, Installed, Enabled, FailedUpgrade
    handler_status: dict[str, Any] | None = None
    settings: Settings | None = None

    @property
    def manifest(self) -> dict[str, Any]:
        return json.loads((self.dir / "HandlerManifest.json").read_text(encoding="utf-8-sig"))[0]["handlerManifest"]

    def flag(self, key: str) -> bool:
        value = self.manifest.get(key, False)
        return value is True or str(value).lower() == "true"


@dataclass
class Report:
    """What waagent sends to Azure for the handler."""

    status: str
    code: int
    message: str
    settings_status: dict[str, Any] | None = None  # runtimeSettingsStatus.settingsStatus.status


@dataclass
class Run:
    """One command waagent ran, for tests to inspect."""

    version: str
    command: str
    exit_code: int | None  # None: killed at the limit
    seconds: float
    output: str = ""


@dataclass
class GuestAgent:
    """waagent's extension handling for one handler name, driven by goal states the test hands in."""

    lib: Path
    name: str = "Contoso.Sefwd.ScheduledEventsForwarder"
    env: dict[str, str] = field(default_factory=dict)
    scale: float = 1.0
    instances: dict[str, Instance] = field(default_factory=dict)
    installed: str | None = None  # the version on disk in a state other than NotInstalled
    current: str | None = None  # the version the last goal state asked for
    runs: list[Run] = field(default_factory=list)

    # -- goal states ------------------------------------------------------------------------------

    def enable(self, package: Path, version: str, settings: Settings | None = None) -> bool:
        """A goal state with the extension enabled at ``version`` (waagent's handle_enable)."""
        inst = self._instance(version)
        self.current = version
        try:
            old = self.instances.get(self.installed) if self.installed else None
            if inst.state in ("NotInstalled", "FailedUpgrade"):
                self._setup(inst, package, settings)
                if old is None:
                    self._install(inst)
                elif old.version != inst.version:
                    self._update(old, inst)
            else:
                self._write_settings(inst, settings)
            self._run(inst, "enable")
            inst.state = "Enabled"
            self._set_status(inst, "Ready", 0, "Plugin enabled")
            return True
        except CommandFailed as exc:
            self._set_status(inst, "NotReady", exc.code, exc.message)
            return False

    def uninstall(self) -> bool:
        """A goal state without the extension (waagent's handle_uninstall)."""
        if self.installed is None:
            # A handler whose install failed is still NotInstalled: waagent runs no command at all and
            # deletes its directory.
            failed = self.instances.get(self.current or "")
            if failed is not None and failed.dir.exists():
                self._remove(failed)
            return True
        inst = self.instances[self.installed]
        self.current = inst.version
        try:
            if inst.state == "Enabled":
                self._disable(inst)  # not caught here: a failing disable stops the uninstall
            try:
                self._run(inst, "uninstall")
            except CommandFailed:
                pass  # reported as an event only; the handler is removed anyway
        except CommandFailed as exc:
            self._set_status(inst, "NotReady", exc.code, exc.message)
            return False
        self._remove(inst)
        return True

    # -- what Azure sees --------------------------------------------------------------------------

    def report(self) -> Report | None:
        """The handler's status as waagent would report it now (None: nothing reported)."""
        inst = self.instances.get(self.current or "")
        if inst is None or inst.handler_status is None or not inst.dir.exists():
            return None
        hs = dict(inst.handler_status)
        settings_status = None
        if inst.state != "NotInstalled":
            if inst.flag("reportHeartbeat"):
                try:
                    beat = self._heartbeat(inst)
                    hs["status"] = beat.get("status")
                    if "formattedMessage" in beat:
                        hs["message"] = self._formatted(beat["formattedMessage"])
                except CommandFailed as exc:
                    hs = {"status": "NotReady", "code": exc.code, "message": exc.message}
            if inst.settings is not None:
                settings_status = self._settings_status(inst, inst.settings.seq)
        return Report(hs["status"], hs["code"], hs["message"], settings_status)

    def heartbeat_file(self, version: str) -> Path:
        return self.instances[version].dir / "heartbeat.log"

    def status_dir(self, version: str) -> Path:
        return self.instances[version].dir / "status"

    # -- waagent's steps --------------------------------------------------------------------------

    def _instance(self, version: str) -> Instance:
        if version not in self.instances:
            self.instances[version] = Instance(self.name, version, self.lib / f"{self.name}-{version}",
                                               self.lib / "log" / self.name)
        return self.instances[version]

    def _setup(self, inst: Instance, package: Path, settings: Settings | None) -> None:
        inst.state = "NotInstalled"
        if inst.dir.exists():
            shutil.rmtree(inst.dir)
        with zipfile.ZipFile(package) as zf:
            zf.extractall(inst.dir)
        for path in inst.dir.rglob("*"):
            if path.is_file():
                path.chmod(path.stat().st_mode | stat.S_IXUSR)
        (inst.dir / "status").mkdir(mode=0o700)
        (inst.dir / "config").mkdir(mode=0o700)
        inst.log_dir.mkdir(parents=True, exist_ok=True)
        (inst.dir / "HandlerEnvironment.json").write_text(json.dumps([{
            "name": inst.name, "version": 1.0,
            "handlerEnvironment": {"logFolder": str(inst.log_dir), "configFolder": str(inst.dir / "config"),
                                   "statusFolder": str(inst.dir / "status"),
                                   "heartbeatFile": str(inst.dir / "heartbeat.log")},
        }]))
        self._write_settings(inst, settings)

    def _write_settings(self, inst: Instance, settings: Settings | None) -> None:
        inst.settings = settings
        if settings is None:
            (inst.dir / "config" / "0.settings").write_text("")
            return
        handler = {"publicSettings": settings.public, "protectedSettings": settings.protected,
                   "protectedSettingsCertThumbprint": settings.thumbprint}
        (inst.dir / "config" / f"{settings.seq}.settings").write_text(
            json.dumps({"runtimeSettings": [{"handlerSettings": handler}]}))

    def _install(self, inst: Instance, uninstall_exit_code: str = "NOT_RUN") -> None:
        self._run(inst, "install", {"AZURE_GUEST_AGENT_UNINSTALL_CMD_EXIT_CODE": uninstall_exit_code})
        inst.state = "Installed"
        self.installed = inst.version
        self._set_status(inst, "NotReady", 0, "Plugin installed but not enabled")

    def _disable(self, inst: Instance) -> None:
        self._run(inst, "disable")
        inst.state = "Installed"
        self._set_status(inst, "NotReady", 0, "Plugin disabled")

    def _update(self, old: Instance, new: Instance) -> None:
        """UpdateWithInstall: old disable, new update, old uninstall, new install."""
        disable_code = "NOT_RUN"
        if old.state == "Enabled":
            disable_code = self._old_command(old, new, self._disable)
        for status in (old.dir / "status").glob("*.status"):
            shutil.copy2(status, new.dir / "status" / status.name)
        try:
            self._run(new, "update", {"VERSION": new.version, "AZURE_GUEST_AGENT_UPDATING_FROM_VERSION": old.version,
                                      "AZURE_GUEST_AGENT_DISABLE_CMD_EXIT_CODE": disable_code})
        except CommandFailed:
            new.state = "FailedUpgrade"
            raise
        uninstall_code = self._old_command(old, new, lambda inst: self._run(inst, "uninstall"))
        self._remove(old)
        if str(new.manifest.get("updateMode") or "UpdateWithInstall").lower() == "updatewithinstall":
            self._install(new, uninstall_code)
        new.state = "Installed"
        self.installed = new.version

    def _old_command(self, old: Instance, new: Instance, call: Any) -> str:
        try:
            call(old)
        except CommandFailed as exc:
            if not new.flag("continueOnUpdateFailure"):
                raise CommandFailed(ERROR_CODES["update"], f"{exc.message}; ContinueOnUpdate: False") from exc
            return str(exc.exit_code if exc.exit_code is not None else exc.code)
        return "0"

    def _remove(self, inst: Instance) -> None:
        shutil.rmtree(inst.dir, ignore_errors=True)
        inst.state = "NotInstalled"
        if self.installed == inst.version:
            self.installed = None

    def _set_status(self, inst: Instance, status: str, code: int, message: str) -> None:
        inst.handler_status = {"status": status, "code": code, "message": message}

    def _run(self, inst: Instance, command: str, extra: dict[str, str] | None = None) -> str:
        cmd = inst.manifest[f"{command}Command"]
        full = os.path.join(str(inst.dir), cmd.lstrip(os.path.sep))
        env = {
            **(extra or {}),
            "AZURE_GUEST_AGENT_EXTENSION_PATH": str(inst.dir),
            "AZURE_GUEST_AGENT_EXTENSION_VERSION": inst.version,
            "ConfigSequenceNumber": str(inst.settings.seq) if inst.settings is not None else "0",
            **self.env,
        }
        limit = LIMITS[command] * self.scale
        started = time.monotonic()
        with tempfile.TemporaryFile(dir=inst.dir) as out, tempfile.TemporaryFile(dir=inst.dir) as err:
            proc = subprocess.Popen(full, shell=True, cwd=inst.dir, env=env, stdout=out, stderr=err,
                                    start_new_session=True)
            try:
                code: int | None = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                code = None
            output = format_output(_read_head(out), _read_head(err))
        self.runs.append(Run(inst.version, command, code, time.monotonic() - started, output))
        if code is None:
            raise CommandFailed(TIMEOUT_CODE, f"[ExtensionError] Timeout({limit:g}): {full}\n{output}")
        if code != 0:
            raise CommandFailed(ERROR_CODES[command],
                                f"[ExtensionOperationError] Non-zero exit code: {code}, {full}\n{output}", code)
        return output

    # -- status files -----------------------------------------------------------------------------

    @staticmethod
    def _formatted(value: Any) -> str:
        if not isinstance(value, dict) or "lang" not in value or "message" not in value:
            raise CommandFailed(-1, "Invalid status format by extension: Missing formattedMessage/lang or message key")
        return str(value["message"])

    def _heartbeat(self, inst: Instance) -> dict[str, Any]:
        path = inst.dir / "heartbeat.log"
        if not path.is_file():
            raise CommandFailed(-1, "[ExtensionError] Failed to get heart beat file")
        if time.time() - path.stat().st_mtime > UNRESPONSIVE_AFTER:
            return {"status": "Unresponsive", "code": -1, "message": "Extension heartbeat is not responsive"}
        try:
            beat = json.loads(path.read_text())[0]["heartbeat"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise CommandFailed(-1, f"[ExtensionError] Malformed heartbeat file: {exc}") from exc
        return dict(beat)

    def _settings_status(self, inst: Instance, seq: int) -> dict[str, Any]:
        path = inst.dir / "status" / f"{seq}.status"
        if not path.exists():
            return {"status": "transitioning", "code": 0,
                    "message": "This status is being reported by the Guest Agent since no status file was reported"}
        try:
            data = json.loads(path.read_text())
        except ValueError as exc:
            return {"status": "error", "code": STATUS_INVALID, "message": f"status file is not JSON: {exc}"}
        try:
            if not isinstance(data, list):
                raise CommandFailed(STATUS_INVALID, "The extension status must be an array")
            status = data[0]["status"]
            value = status["status"] if status["status"] in STATUS_VALUES else "error"
            message = self._formatted(status["formattedMessage"]) if status.get("formattedMessage") else None
        except (CommandFailed, KeyError, IndexError, TypeError) as exc:
            return {"status": "error", "code": STATUS_INVALID, "message": f"Could not get a valid status: {exc}"}
        return {"status": value, "code": status.get("code", 0), "operation": status.get("operation"), "message": message}
