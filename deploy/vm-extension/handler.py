#!/usr/bin/env python3
"""Azure VM extension handler for sefwd: ``handler.py install|enable|disable|uninstall|update``.

Also ``handler.py heartbeat``: run every 30 s by the root timer enable installs, it copies the
running agent's heartbeat, size- and shape-checked, to waagent's heartbeatFile.

Python 3 standard library only (3.7+): it runs before the agent and its dependencies exist.
The handler contract (HandlerEnvironment.json, ``<seq>.settings``, ``<seq>.status``) is described
in README.md next to this file, as are the switches tests use:

  SEFWD_EXT_ROOT          prefix for every host path (/etc/sefwd, /opt/sefwd, ...); default "/"
  SEFWD_EXT_WAAGENT_DIR   where <thumbprint>.crt/.prv live; default /var/lib/waagent
  SEFWD_EXT_SERVICE_CMD   command called instead of ``systemctl`` (same arguments)
  SEFWD_EXT_SEFWD_CMD     command used for ``sefwd config check`` instead of the installed agent
  SEFWD_EXT_SKIP_INSTALL  "1": install/uninstall do not run deploy/linux/install.sh/uninstall.sh
  SEFWD_EXT_TIME_SCALE    multiplies every step budget (tests run the budgets in miniature)
"""
from __future__ import annotations

import base64
import datetime
import glob
import hashlib
import json
import logging
import os
import re
import shlex
import signal
import stat
import subprocess
import sys
import tempfile
import time

EXT_DIR = os.path.dirname(os.path.abspath(__file__))
NAME = "sefwd"
UNIT = "sefwd.service"
CONFIG_PATH = "/etc/sefwd/config.toml"
ENV_PATH = "/etc/sefwd/env"
# Written by ``update``; the old version's ``uninstall`` (which waagent runs between the new
# version's update and install) then keeps the agent, its config and its state.
UPDATE_MARKER = "/etc/sefwd/.extension-update"
UPDATE_MARKER_MAX_AGE = 2 * 3600.0
# Left while a changed config/env has not been applied by a restart (the service manager failed):
# the next enable restarts even though the files no longer differ.
RESTART_MARKER = "/etc/sefwd/.extension-restart-pending"
# With reportHeartbeat on, the running agent rewrites this file every 30 s ([agent] heartbeat_file): the
# service may write only under its StateDirectory. The guest agent reads heartbeatFile as root, so
# that file is never linked here: the root side (``handler.py heartbeat``, run by the timer below)
# writes it from a size- and shape-checked copy of this one.
AGENT_HEARTBEAT = "/var/lib/sefwd/extension-heartbeat.json"
HEARTBEAT_ENV = "SEFWD_AGENT_HEARTBEAT_FILE"
HEARTBEAT_MAX_BYTES = 4096  # the agent writes ~300 bytes; anything larger is refused unread
HEARTBEAT_UNIT = "sefwd-extension-heartbeat.service"
HEARTBEAT_TIMER = "sefwd-extension-heartbeat.timer"
UNIT_DIR = "/etc/systemd/system"
SEFWD_CANDIDATES = ("/opt/sefwd/venv/bin/sefwd", "/opt/sefwd/bin/sefwd", "/usr/local/bin/sefwd", "/usr/bin/sefwd")
# What the extension wrote (paths and sha256) and whether it created the installation: it
# overwrites or removes only what is listed here (see Manifest).
MANIFEST_PATH = "/etc/sefwd/.extension-manifest.json"
# Renames still to do when a command was interrupted between its first and its last (see commit).
JOURNAL_PATH = "/etc/sefwd/.extension-journal.json"
# One handler command at a time, host-wide (two versions' handlers share /etc/sefwd during an update).
LOCK_PATH = "/run/lock/sefwd-extension.lock"
INSTALLATION_MARKERS = ("/opt/sefwd/venv/bin/python", "/opt/sefwd/install.env")
STAGED_SUFFIX = ".ext-new"
INSTALL_EXTRAS = "all"
# waagent keeps a status message whole but the portal shows about 1,000 characters: messages put
# the cause first, so a cut only loses detail.
MAX_MESSAGE = 1000
TRUNCATED = " ... [truncated]"

# What waagent allows each command before it SIGKILLs the command's process group (seconds).
GUEST_AGENT_LIMITS = {"install": 900, "enable": 300, "disable": 900, "uninstall": 300, "update": 900}
MARGIN = 60  # every command's worst case ends at least this long before waagent's limit
# The longest each step may take; a step past its budget has its processes killed and fails with
# its own message. The sum per command is its worst case (see COMMAND_STEPS).
BUDGETS = {
    "lock": 30,  # waiting for another handler command to finish (an enable takes seconds)
    "openssl": 30,  # decrypting protectedSettings: milliseconds normally
    "config check": 60,  # `sefwd config check`: a Python start, ~1 s normally
    "systemctl enable": 30,
    "systemctl start": 90,  # start/restart/stop/disable --now: the unit's TimeoutStopSec 30 s + TimeoutStartSec 30 s
    "install.sh": 750,  # a venv and pip install from the package index
    "rollback": 60,  # a failed install removes the installation it created (uninstall.sh, systemctl bounded to 15 s)
    "uninstall.sh": 120,  # stop (already stopped), daemon-reload, rm -rf the venv, userdel
}
COMMAND_STEPS = {
    "install": ("lock", "install.sh", "rollback"),
    "enable": ("lock", "openssl", "config check", "systemctl enable", "systemctl start"),
    "disable": ("lock", "systemctl start"),
    "uninstall": ("lock", "systemctl start", "uninstall.sh"),
    "update": ("lock",),
}

# Status codes (also the handler's exit status).
OK = 0
E_INTERNAL = 1
E_SETTINGS = 11  # settings file unreadable, malformed, or protectedSettings not decryptable
E_CONFIG = 12  # the agent rejected the config built from publicSettings
E_SERVICE = 13  # the service manager failed
E_INSTALL = 14  # install.sh / uninstall.sh failed
E_AGENT_MISSING = 15  # no sefwd to validate the config with
E_NOT_OURS = 16  # config or env written by someone else (install.sh, cloud-init, an operator): left in place
E_BUSY = 17  # another handler command held the lock for the whole "lock" budget: nothing changed

OPERATIONS = {"install": "Install", "enable": "Enable", "disable": "Disable", "uninstall": "Uninstall", "update": "Update"}
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")

log = logging.getLogger("sefwd-extension")


class HandlerError(Exception):
    """A failure to report in the status file, with its status code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


# -- environment and paths --------------------------------------------------------------------------

def host_path(path: str) -> str:
    """``path`` under SEFWD_EXT_ROOT (tests run in a temporary root)."""
    root = os.environ.get("SEFWD_EXT_ROOT", "")
    return os.path.join(root, path.lstrip("/")) if root else path


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


class HandlerEnvironment:
    """The folders waagent gives the extension in HandlerEnvironment.json."""

    def __init__(self, log_folder: str | None, config_folder: str | None, status_folder: str | None,
                 heartbeat_file: str | None) -> None:
        self.log_folder = log_folder
        self.config_folder = config_folder
        self.status_folder = status_folder
        self.heartbeat_file = heartbeat_file

    @classmethod
    def load(cls, ext_dir: str = EXT_DIR) -> "HandlerEnvironment":
        path = os.path.join(ext_dir, "HandlerEnvironment.json")
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError) as exc:
            raise HandlerError("cannot read {}: {}".format(path, exc), E_INTERNAL)
        if isinstance(data, list):
            data = data[0] if data else {}
        env = data.get("handlerEnvironment", data) if isinstance(data, dict) else {}
        missing = [k for k in ("logFolder", "configFolder", "statusFolder") if not env.get(k)]
        if missing:
            raise HandlerError("{} lacks {}".format(path, ", ".join(missing)), E_INTERNAL)
        return cls(env["logFolder"], env["configFolder"], env["statusFolder"], env.get("heartbeatFile"))


def setup_logging(log_folder: str | None) -> str | None:
    """Log to <logFolder>/handler.log (its path), else stderr.

    Not both: waagent reports only the first ~3,200 characters of a command's output, so stdout
    carries just the one-line outcome (see main) and nothing pushes it out of that window.
    """
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(message)s")
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    if log_folder:
        path = os.path.join(log_folder, "handler.log")
        try:
            os.makedirs(log_folder, exist_ok=True)
            fh = logging.FileHandler(path, encoding="utf-8")
            fh.setFormatter(fmt)
            root.addHandler(fh)
            return path
        except OSError as exc:
            print("cannot log to {}: {}".format(path, exc), file=sys.stderr)
    stream = logging.StreamHandler(sys.stderr)
    stream.setFormatter(fmt)
    root.addHandler(stream)
    return None


# -- sequence number, settings, protected settings ---------------------------------------------------

def current_seq(config_folder: str | None) -> int | None:
    """ConfigSequenceNumber, else the newest ``<n>.settings`` (waagent picks the last modified), else None."""
    value = os.environ.get("ConfigSequenceNumber", "").strip()
    if value.isdigit():
        return int(value)
    newest = None
    for path in glob.glob(os.path.join(config_folder, "*.settings")) if config_folder else ():
        stem = os.path.basename(path)[: -len(".settings")]
        if not stem.isdigit():
            continue
        key = (os.path.getmtime(path), int(stem))
        if newest is None or key > newest:
            newest = key
    return None if newest is None else newest[1]


def read_settings(config_folder: str | None, seq: int | None) -> tuple[dict, dict]:
    """(publicSettings, decrypted protectedSettings) of ``<seq>.settings``; both {} when there is none."""
    if seq is None or not config_folder:
        return {}, {}
    path = os.path.join(config_folder, "{}.settings".format(seq))
    if not os.path.exists(path):
        log.info("no settings file %s: using empty settings", path)
        return {}, {}
    try:
        with open(path, encoding="utf-8-sig") as f:
            text = f.read()
    except (OSError, ValueError) as exc:
        raise HandlerError("cannot read settings file {}: {}".format(path, exc), E_SETTINGS)
    if not text.strip():
        # waagent writes an empty <seq>.settings when the extension has no settings at all.
        log.info("settings file %s is empty: using empty settings", path)
        return {}, {}
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise HandlerError("settings file {} is not JSON: {}".format(path, exc), E_SETTINGS)
    try:
        runtime = data.get("runtimeSettings") or [{}]
        handler = runtime[0].get("handlerSettings") or {}
        if not isinstance(handler, dict):
            raise TypeError(type(handler).__name__)
    except (AttributeError, IndexError, TypeError):
        raise HandlerError("{}: expected runtimeSettings[0].handlerSettings".format(path), E_SETTINGS)
    public = handler.get("publicSettings") or {}
    if isinstance(public, str):  # some tools pass the JSON as a string
        try:
            public = json.loads(public)
        except ValueError as exc:
            raise HandlerError("publicSettings is a string but not JSON: {}".format(exc), E_SETTINGS)
    if not isinstance(public, dict):
        raise HandlerError("publicSettings must be a JSON object, got {}".format(type(public).__name__), E_SETTINGS)
    protected = {}
    if handler.get("protectedSettings"):
        protected = decrypt_protected(handler["protectedSettings"], handler.get("protectedSettingsCertThumbprint"))
    return public, protected


def waagent_dir() -> str:
    return os.environ.get("SEFWD_EXT_WAAGENT_DIR") or "/var/lib/waagent"


def decrypt_protected(blob: str, thumbprint: str | None) -> dict:
    """Decrypt base64 PKCS#7 protectedSettings with the waagent certificate named by ``thumbprint``."""
    if not thumbprint:
        raise HandlerError("protectedSettings is set but protectedSettingsCertThumbprint is not", E_SETTINGS)
    directory = waagent_dir()
    cert = key = None
    for name in (thumbprint, thumbprint.upper(), thumbprint.lower()):
        crt, prv = os.path.join(directory, name + ".crt"), os.path.join(directory, name + ".prv")
        if os.path.isfile(crt) and os.path.isfile(prv):
            cert, key = crt, prv
            break
    if cert is None:
        raise HandlerError("certificate {0}.crt/.prv for protectedSettings not found in {1}".format(thumbprint, directory), E_SETTINGS)
    try:
        der = base64.b64decode(blob, validate=False)
    except (ValueError, TypeError) as exc:
        raise HandlerError("protectedSettings is not base64: {}".format(exc), E_SETTINGS)
    argv = ["openssl", "smime", "-decrypt", "-inform", "DER", "-recip", cert, "-inkey", key]
    try:
        code, plain, err = run_bounded(argv, "openssl", input=der, merge=False)
    except (OSError, StepTimeout) as exc:
        raise HandlerError("cannot decrypt protectedSettings: openssl: {}".format(exc), E_SETTINGS)
    if code != 0:
        detail = err.decode("utf-8", "replace").strip().splitlines()
        raise HandlerError("decrypting protectedSettings with certificate {} failed: {}".format(
            thumbprint, detail[0] if detail else "exit {}".format(code)), E_SETTINGS)
    try:
        value = json.loads(plain.decode("utf-8"))
    except ValueError:
        # never echo the plaintext: it holds secrets
        raise HandlerError("decrypted protectedSettings is not JSON", E_SETTINGS)
    if not isinstance(value, dict):
        raise HandlerError("protectedSettings must be a JSON object", E_SETTINGS)
    return value


# -- publicSettings -> TOML, protectedSettings -> environment file ------------------------------------

def _toml_string(text: str) -> str:
    out = ['"']
    escapes = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r", "\b": "\\b", "\f": "\\f"}
    for ch in text:
        if ch in escapes:
            out.append(escapes[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append("\\u{:04x}".format(ord(ch)))
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else _toml_string(key)


def _toml_value(value: object, where: str) -> str:
    if value is None:
        raise HandlerError("publicSettings.{} is null: TOML has no null, leave the key out".format(where), E_SETTINGS)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value != value:
            return "nan"
        if value in (float("inf"), float("-inf")):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v, "{}[{}]".format(where, i)) for i, v in enumerate(value)) + "]"
    if isinstance(value, dict):
        items = ("{} = {}".format(_toml_key(k), _toml_value(v, "{}.{}".format(where, k))) for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    raise HandlerError("publicSettings.{}: unsupported value {!r}".format(where, value), E_SETTINGS)


def _is_table_array(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _emit_table(lines: list, path: list, table: dict) -> None:
    where = ".".join(path)
    # Plain values must precede any [sub.table] header, or they would land in that table.
    for key, value in table.items():
        if not isinstance(value, dict) and not _is_table_array(value):
            lines.append("{} = {}".format(_toml_key(key), _toml_value(value, "{}.{}".format(where, key) if where else key)))
    for key, value in table.items():
        if isinstance(value, dict):
            header = ".".join(_toml_key(p) for p in path + [key])
            lines.extend(["", "[{}]".format(header)])
            _emit_table(lines, path + [key], value)
    for key, value in table.items():
        if _is_table_array(value):
            header = ".".join(_toml_key(p) for p in path + [key])
            for item in value:
                lines.extend(["", "[[{}]]".format(header)])
                _emit_table(lines, path + [key], item)


CONFIG_HEADER = (
    "# Written by the sefwd Azure VM extension from its publicSettings.\n"
    "# Edits are overwritten by the next enable: change the extension's settings instead.\n"
)


def render_config(public: dict) -> str:
    """TOML text whose structure mirrors ``public`` 1:1 (tables, arrays of tables, values)."""
    lines: list = []
    _emit_table(lines, [], public)
    body = "\n".join(lines).lstrip("\n")
    return CONFIG_HEADER + ("\n" + body + "\n" if body else "")


ENV_HEADER = (
    "# Written by the sefwd Azure VM extension from protectedSettings.env, plus its heartbeat file (mode 0600).\n"
    "# Read by sefwd.service (EnvironmentFile=); edits are overwritten by the next enable.\n"
)


def parse_protected(protected: dict) -> dict:
    """The ``env`` map of protectedSettings, validated: {NAME: value}."""
    unknown = sorted(set(protected) - {"env"})
    if unknown:
        raise HandlerError("protectedSettings: unknown key(s) {} (expected only \"env\")".format(", ".join(unknown)), E_SETTINGS)
    env = protected.get("env") or {}
    if not isinstance(env, dict):
        raise HandlerError("protectedSettings.env must be an object of NAME: value", E_SETTINGS)
    result = {}
    for name, value in env.items():
        if not _ENV_NAME.fullmatch(name):
            raise HandlerError("protectedSettings.env: {!r} is not a valid environment variable name".format(name), E_SETTINGS)
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise HandlerError("protectedSettings.env.{}: the value must be a string".format(name), E_SETTINGS)
        text = str(value)
        if "\n" in text or "\r" in text or "\0" in text:
            # the value itself is never echoed: it is a secret
            raise HandlerError("protectedSettings.env.{}: the value must be one line".format(name), E_SETTINGS)
        result[name] = text
    return result


def _env_quote(value: str) -> str:
    # systemd EnvironmentFile double quotes: backslash escapes " \ ` $ as in a POSIX shell, no expansion.
    return '"' + re.sub(r'(["\\`$])', r"\\\1", value) + '"'


def render_env(env: dict) -> str:
    return ENV_HEADER + "".join("{}={}\n".format(name, _env_quote(env[name])) for name in sorted(env))


# -- files ---------------------------------------------------------------------------------------------

def _read_bytes(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _stage(path: str, data: bytes, mode: int) -> str:
    """Write ``data`` to a new, uniquely named file beside ``path`` (``mode`` from the first byte); its name.

    Unique: two handlers at once never write into each other's candidate; the name ends in
    STAGED_SUFFIX so a leftover of a killed command is recognised and removed by the next one.
    """
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".", suffix=STAGED_SUFFIX)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        _remove(tmp)
        raise
    return tmp


def _write_file(path: str, data: bytes, mode: int) -> None:
    """Write ``path`` atomically with ``mode`` from the first byte (secrets never sit world-readable)."""
    tmp = _stage(path, data, mode)
    try:
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


def _config_group_gid() -> int | None:
    # The service user reads the config through its group (deploy/linux makes it 0640 root:sefwd).
    if os.environ.get("SEFWD_EXT_ROOT") or not hasattr(os, "geteuid") or os.geteuid() != 0:
        return None
    try:
        import grp

        return grp.getgrnam("sefwd").gr_gid
    except (ImportError, KeyError):
        return None


def _remove(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def _remove_quietly(path: str) -> bool:
    """_remove, but a failure (read-only disk) is only logged: removal that merely tidies must not stop a command."""
    try:
        return _remove(path)
    except OSError as exc:
        log.warning("cannot remove %s: %s", path, exc)
        return False


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# -- what the extension owns -----------------------------------------------------------------------------

OWNED_FILES = (CONFIG_PATH, ENV_PATH)  # the files enable writes; anything else in /etc/sefwd is someone else's
HEARTBEAT_UNIT_FILES = (UNIT_DIR + "/" + HEARTBEAT_UNIT, UNIT_DIR + "/" + HEARTBEAT_TIMER)


class Manifest:
    """/etc/sefwd/.extension-manifest.json: the files the extension wrote (path -> sha256) and whether
    its install created the installation (/opt/sefwd) or found one there."""

    def __init__(self, files: dict | None = None, installation: str | None = None) -> None:
        self.files = dict(files or {})  # host paths without SEFWD_EXT_ROOT
        self.installation = installation  # "extension", "preexisting" or None (install never ran)

    @classmethod
    def load(cls) -> "Manifest":
        data = None
        try:
            raw = _read_bytes(host_path(MANIFEST_PATH))
            data = json.loads(raw.decode("utf-8")) if raw is not None else None
        except (OSError, ValueError) as exc:
            log.warning("cannot read %s (%s): treating the extension as owning nothing", MANIFEST_PATH, exc)
        if isinstance(data, dict):
            files = data.get("files")
            files = files if isinstance(files, dict) else {}
            installation = data.get("installation") if data.get("installation") in ("extension", "preexisting") else None
            return cls({k: v for k, v in files.items() if isinstance(k, str) and isinstance(v, str)}, installation)
        # No manifest: files an earlier version of the extension wrote carry its header.
        legacy = cls()
        for path, header in ((CONFIG_PATH, CONFIG_HEADER), (ENV_PATH, ENV_HEADER)):
            current = _read_bytes_quietly(host_path(path))
            if current is not None and current.startswith(header.encode("utf-8")):
                legacy.files[path] = _sha256(current)
                legacy.installation = "extension"
        return legacy

    def owns(self, path: str) -> bool:
        return path in self.files

    def manages_service(self) -> bool:
        """Whether sefwd.service runs because of the extension (its config, or an installation it made)."""
        return CONFIG_PATH in self.files or self.installation == "extension"

    def foreign(self) -> list:
        """The files enable would write that exist and were not written by the extension."""
        return [path for path in OWNED_FILES if not self.owns(path) and os.path.lexists(host_path(path))]

    def render(self) -> bytes:
        return (json.dumps({"version": 1, "installation": self.installation, "files": dict(sorted(self.files.items()))},
                           indent=1) + "\n").encode("utf-8")


def _read_bytes_quietly(path: str) -> bytes | None:
    try:
        return _read_bytes(path)
    except OSError:
        return None


def handover_message(paths: list) -> str:
    """Why enable changed nothing on a VM set up by someone else, and how to hand the files over."""
    names = " and ".join(paths)
    moves = "; ".join("mv {0} {0}.before-extension".format(p) for p in paths)
    return ("{} were not written by this extension (install.sh, cloud-init or an operator wrote them): left in place and "
            "the extension's settings NOT applied; the service was not touched. To hand them over, carry what you need "
            "into the extension's settings (secrets into protectedSettings.env), then as root: {}; and run enable again "
            "(re-apply the extension's settings or reboot)").format(names, moves)


def commit(pairs: list, restart: bool) -> None:
    """Rename each staged file over its target so that an interruption leaves the old files or the new ones.

    The renames are journaled first; a command interrupted between them is completed by the next
    command (``recover``), which also restarts the service (the restart marker is written first).
    """
    if not pairs:
        return
    if restart:
        _write_file(host_path(RESTART_MARKER), b"", 0o644)
    journal = json.dumps({"renames": pairs}).encode("utf-8")
    _write_file(host_path(JOURNAL_PATH), journal, 0o600)
    _fsync_dir(os.path.dirname(host_path(JOURNAL_PATH)))
    for staged, target in pairs:
        os.replace(staged, target)
        _fsync_dir(os.path.dirname(target))
    _remove(host_path(JOURNAL_PATH))


def recover() -> list:
    """Finish the renames of an interrupted command and drop stray staged files; what was done."""
    done = []
    journal_path = host_path(JOURNAL_PATH)
    pending = set()
    try:
        raw = _read_bytes(journal_path)
    except OSError as exc:
        log.warning("cannot read %s: %s", journal_path, exc)
        raw = None
    if raw is not None:
        try:
            pairs = json.loads(raw.decode("utf-8")).get("renames") or []
        except (ValueError, AttributeError):
            pairs = []
        for pair in pairs:
            if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) for p in pair)):
                continue
            staged, target = pair
            pending.add(staged)
            if os.path.exists(staged):
                os.replace(staged, target)
                done.append("completed {}".format(target))
        _remove(journal_path)
        log.warning("an interrupted command left %s: %s", JOURNAL_PATH, ", ".join(done) or "nothing left to do")
    for directory in {os.path.dirname(host_path(p)) for p in OWNED_FILES + HEARTBEAT_UNIT_FILES + (MANIFEST_PATH,)}:
        for stray in glob.glob(os.path.join(directory, ".*" + STAGED_SUFFIX)) + glob.glob(os.path.join(directory, "*" + STAGED_SUFFIX)):
            if stray not in pending and _remove_quietly(stray):
                done.append("removed {}".format(stray))
    return done


# -- the lock -------------------------------------------------------------------------------------------

class Busy(Exception):
    """Another handler command kept the lock for the whole lock budget."""


class CommandLock:
    """An exclusive flock on LOCK_PATH for the whole command (released when the process ends, even killed)."""

    def __init__(self, command: str) -> None:
        self.command = command
        self.fd: int | None = None
        self.path = host_path(LOCK_PATH)

    def acquire(self, wait: float) -> None:
        import fcntl

        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
        deadline = time.monotonic() + wait
        waiting = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if not waiting and wait > 0:
                    waiting = True
                    log.info("waiting up to %g s for another handler command (%s) to finish", wait,
                             os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "unknown")
                if time.monotonic() >= deadline:
                    holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "unknown"
                    os.close(fd)
                    raise Busy("another handler command ({}) held {} for {:g} s".format(holder, self.path, wait))
                time.sleep(0.1)  # polling a lock: flock has no timeout of its own
        self.fd = fd
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, "{} pid {} since {}\n".format(self.command, os.getpid(), utc_now()).encode("utf-8"), 0)
        except OSError:
            pass  # who holds it is only for the busy message

    def try_acquire(self) -> bool:
        try:
            self.acquire(0)
            return True
        except (Busy, OSError):
            return False


# -- status and heartbeat ------------------------------------------------------------------------------

def write_status(status_folder: str | None, seq: int, operation: str, status: str, code: int, message: str) -> bool:
    """Write ``<seq>.status`` atomically (waagent may read it at any moment); best effort.

    A full or read-only disk must not stop a command: disable and uninstall have to act whether
    or not they can report, so a failed write is logged and the command goes on.
    """
    if not status_folder:
        return False
    if len(message) > MAX_MESSAGE:  # the start holds the cause
        message = message[: MAX_MESSAGE - len(TRUNCATED)] + TRUNCATED
    doc = [{
        "version": 1.0,
        "timestampUTC": utc_now(),
        "status": {
            "name": NAME,
            "operation": operation,
            "status": status,
            "code": code,
            "formattedMessage": {"lang": "en-US", "message": message},
        },
    }]
    path = os.path.join(status_folder, "{}.status".format(seq))
    try:
        _write_file(path, json.dumps(doc, indent=1).encode("utf-8"), 0o644)
        return True
    except OSError as exc:
        log.warning("cannot write status file %s (going on without it): %s", path, exc)
        return False


def report_heartbeat() -> bool:
    """The package's HandlerManifest.json says reportHeartbeat (true, or "true" as waagent also accepts)."""
    try:
        with open(bundled("HandlerManifest.json"), encoding="utf-8-sig") as f:
            value = json.load(f)[0]["handlerManifest"].get("reportHeartbeat", False)
    except (OSError, ValueError, LookupError, TypeError, AttributeError):
        return False
    return value is True or str(value).strip().lower() == "true"


def heartbeat_doc(ready: bool, code: int, message: str) -> bytes:
    """A heartbeat in waagent's format (status Ready/NotReady, as waagent spells them)."""
    return json.dumps([{"version": 1.0, "heartbeat": {
        "status": "Ready" if ready else "NotReady", "code": code,
        "formattedMessage": {"lang": "en-US", "message": message[:MAX_MESSAGE]}}}]).encode("utf-8")


def write_heartbeat(heartbeat_file: str | None, ready: bool, code: int, message: str, mtime: float | None = None) -> None:
    """Best effort: write waagent's heartbeatFile as root, replacing whatever is there (an old symlink too)."""
    if not heartbeat_file:
        return
    try:
        _write_file(heartbeat_file, heartbeat_doc(ready, code, message), 0o644)
        if mtime is not None:  # the copy ages with the agent's file: waagent's Unresponsive still works
            os.utime(heartbeat_file, (mtime, mtime))
    except OSError as exc:
        log.warning("cannot write heartbeat file %s: %s", heartbeat_file, exc)


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def read_agent_heartbeat(path: str) -> tuple:
    """(ready, code, message, mtime) from the agent's heartbeat file, checked; HandlerError names what is wrong.

    The file is the service user's: it is opened without following a link or blocking on a FIFO,
    must be a regular file of at most HEARTBEAT_MAX_BYTES (a sparse 1 TB file is refused by its
    size, never read) and of waagent's exact shape. Only the checked fields are copied.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise HandlerError("cannot open: {}".format(exc.strerror or exc), E_INTERNAL)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise HandlerError("not a regular file", E_INTERNAL)
        if st.st_size > HEARTBEAT_MAX_BYTES:
            raise HandlerError("{} bytes, more than {}".format(st.st_size, HEARTBEAT_MAX_BYTES), E_INTERNAL)
        raw = os.read(fd, HEARTBEAT_MAX_BYTES + 1)
    finally:
        os.close(fd)
    if len(raw) > HEARTBEAT_MAX_BYTES:
        raise HandlerError("more than {} bytes".format(HEARTBEAT_MAX_BYTES), E_INTERNAL)
    try:
        doc = json.loads(raw.decode("utf-8"))
        beat = doc[0]["heartbeat"]
        if not (isinstance(doc, list) and len(doc) == 1 and isinstance(doc[0], dict) and isinstance(beat, dict)):
            raise TypeError("not [{\"heartbeat\": {...}}]")
        status, code, formatted = beat["status"], beat["code"], beat["formattedMessage"]
        message = formatted["message"]
        if status not in ("Ready", "NotReady"):
            raise ValueError("status {!r}".format(str(status)[:20]))
        if isinstance(code, bool) or not isinstance(code, int) or not -(2**31) <= code < 2**31:
            raise TypeError("code is not an integer")
        if not isinstance(formatted, dict) or not isinstance(message, str) or not isinstance(formatted.get("lang"), str):
            raise TypeError("formattedMessage is not {lang, message}")
    except (ValueError, LookupError, TypeError, AttributeError) as exc:
        raise HandlerError("not a heartbeat of waagent's shape ({}: {})".format(type(exc).__name__, str(exc)[:80]), E_INTERNAL)
    return status == "Ready", code, _CONTROL.sub(" ", message)[:MAX_MESSAGE], st.st_mtime


def copy_agent_heartbeat(heartbeat_file: str | None) -> str:
    """Copy the agent's heartbeat to waagent's heartbeatFile when it is newer; what happened."""
    if not heartbeat_file:
        return "no heartbeatFile in HandlerEnvironment.json"
    source = host_path(AGENT_HEARTBEAT)
    try:
        source_mtime = os.lstat(source).st_mtime
    except OSError:
        return "no agent heartbeat yet"
    try:
        if not os.path.islink(heartbeat_file) and os.lstat(heartbeat_file).st_mtime >= source_mtime:
            return "heartbeatFile is current"
    except FileNotFoundError:
        pass
    except OSError as exc:
        return "cannot stat {}: {}".format(heartbeat_file, exc)
    try:
        ready, code, message, mtime = read_agent_heartbeat(source)
    except HandlerError as exc:
        # The file's age still counts: a refused heartbeat turns Unresponsive like a missing one.
        write_heartbeat(heartbeat_file, False, E_INTERNAL, "sefwd's heartbeat file {} refused: {}".format(
            AGENT_HEARTBEAT, exc.message), mtime=source_mtime)
        return "refused: " + exc.message
    write_heartbeat(heartbeat_file, ready, code, message, mtime=mtime)
    return "copied"


def heartbeat_units(python: str, handler: str) -> dict:
    """The root timer that copies the agent's heartbeat for waagent (host path -> text)."""
    service_text = (
        "# Written by the sefwd Azure VM extension: copies sefwd's heartbeat, checked, to the guest agent's\n"
        "# heartbeatFile every 30 s. Removed with the extension.\n"
        "[Unit]\nDescription=sefwd VM extension heartbeat copy\n\n"
        "[Service]\nType=oneshot\nExecStart={} {} heartbeat\nNoNewPrivileges=yes\nPrivateNetwork=yes\nPrivateTmp=yes\n"
    ).format(python, handler)
    timer_text = (
        "# Written by the sefwd Azure VM extension. Removed with the extension.\n"
        "[Unit]\nDescription=sefwd VM extension heartbeat copy every 30 s\n\n"
        "[Timer]\nOnActiveSec=0\nOnUnitActiveSec=30s\nAccuracySec=5s\n\n[Install]\nWantedBy=timers.target\n"
    )
    return {HEARTBEAT_UNIT_FILES[0]: service_text, HEARTBEAT_UNIT_FILES[1]: timer_text}


# -- commands the handler runs ------------------------------------------------------------------------

def _tail(text: str, lines: int = 8) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:] if line.strip())


_ERROR_LINE = re.compile(r"\berror\b|\bfailed\b|\bnot found\b|\bdenied\b", re.IGNORECASE)


def cause_first(text: str, limit: int = 300) -> str:
    """The likely cause of a failed script's output, then earlier error lines: ``last | earlier; ...``."""
    lines = [line.strip()[:limit] for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if _ERROR_LINE.search(line)]
    if not errors:
        return " | ".join(reversed(lines[-4:])) or "no output"
    # A script reports its own verdict last ("install.sh: error: pip install failed"); the tool's
    # reason (pip's "ERROR: No matching distribution ...") comes just before it.
    head, earlier = errors[-1], errors[-4:-1]
    return head + ("; because: " + " / ".join(reversed(earlier)) if earlier else "")


def time_scale() -> float:
    try:
        scale = float(os.environ.get("SEFWD_EXT_TIME_SCALE") or 1)
    except ValueError:
        return 1.0
    return scale if scale > 0 else 1.0


def budget(step: str) -> float:
    """BUDGETS[step] in seconds (times SEFWD_EXT_TIME_SCALE: tests shrink every budget alike)."""
    return BUDGETS[step] * time_scale()


class StepTimeout(Exception):
    """A step ran past its budget; it and every process it started were killed."""

    def __init__(self, step: str, seconds: float, output: bytes) -> None:
        super().__init__("{} did not finish within its {:g} s budget and was killed".format(step, seconds))
        self.output = output


def _proc_table() -> dict:
    """pid -> (ppid, pgid) of every process, from /proc ({} where there is none)."""
    table = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open("/proc/{}/stat".format(entry), "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            table[int(entry)] = (int(fields[1]), int(fields[2]))
        except (OSError, IndexError, ValueError):
            continue
    return table


def kill_step(pid: int) -> None:
    """SIGKILL ``pid``, its descendants and, when the handler leads its process group, every other member.

    Children stay in the handler's process group so that waagent's kill of that group at its limit
    reaches them too (a child in a session of its own would survive it, with the lock released). A
    step past its own budget is ended here instead: the process tree, plus the group's other members
    (orphans reparented away from the tree) when the group is the handler's own.
    """
    me = os.getpid()
    for _ in range(3):  # a process may fork while its tree is being killed
        table = _proc_table()
        doomed = {pid}
        grew = True
        while grew:
            grew = False
            for child, (parent, _pgid) in table.items():
                if parent in doomed and child not in doomed:
                    doomed.add(child)
                    grew = True
        if os.getpgrp() == me:
            doomed |= {p for p, (_parent, pgid) in table.items() if pgid == me}
        doomed.discard(me)
        alive = [p for p in doomed if p in table or p == pid]
        if not alive:
            return
        for victim in alive:
            try:
                os.kill(victim, signal.SIGKILL)
            except OSError:
                pass


def run_bounded(argv: list, step: str, input: bytes | None = None, merge: bool = True, **kwargs: object) -> tuple:
    """Run ``argv`` for at most budget(step) s: (exit status, stdout, stderr).

    Past the budget the step's processes are killed (pip's children with install.sh), so the
    handler always ends before waagent kills it, and with its own message.
    """
    limit = budget(step)
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merge else subprocess.PIPE,
                            **kwargs)  # type: ignore[call-overload]
    try:
        out, err = proc.communicate(input, timeout=limit)
    except subprocess.TimeoutExpired:
        kill_step(proc.pid)
        try:
            out, err = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:  # something escaped the tree and holds the pipe open
            proc.kill()
            out = b""
        raise StepTimeout(step, limit, out or b"")
    return proc.returncode, out or b"", err or b""


def service(*args: str, step: str = "systemctl start") -> None:
    """``systemctl ARGS`` (or SEFWD_EXT_SERVICE_CMD ARGS) within budget(step); raises HandlerError on failure."""
    cmd = shlex.split(os.environ.get("SEFWD_EXT_SERVICE_CMD") or "systemctl") + list(args)
    shown = " ".join(cmd)
    log.info("service manager: %s", " ".join(shlex.quote(c) for c in cmd))
    try:
        code, out, _ = run_bounded(cmd, step)
    except OSError as exc:
        raise HandlerError("{}: no service manager: {}".format(shown, exc), E_SERVICE)
    except StepTimeout as exc:
        raise HandlerError("{}: {}".format(shown, exc), E_SERVICE)
    if code != 0:
        text = out.decode("utf-8", "replace")
        log.info("%s output: %s", shown, text.strip())
        raise HandlerError("{} failed (exit {}): {}".format(shown, code, cause_first(text)), E_SERVICE)


def service_tolerant(*args: str) -> str | None:
    """``service(ARGS)``, returning the failure instead of raising (disable and uninstall go on)."""
    try:
        service(*args)
    except HandlerError as exc:
        log.warning("ignored: %s", exc.message)
        return exc.message
    return None


def sefwd_command() -> list:
    """How to run the agent's CLI: SEFWD_EXT_SEFWD_CMD, else the installed ``sefwd``."""
    configured = os.environ.get("SEFWD_EXT_SEFWD_CMD")
    if configured:
        return shlex.split(configured)
    for candidate in SEFWD_CANDIDATES:
        path = host_path(candidate)
        if os.access(path, os.X_OK):
            return [path]
    raise HandlerError("the agent is not installed (none of {} exists); run the install command".format(
        ", ".join(SEFWD_CANDIDATES)), E_AGENT_MISSING)


def config_check(config_path: str, env: dict) -> None:
    """Run ``sefwd config check`` on ``config_path`` as the service would see it; HandlerError lists the problems."""
    # The service's only SEFWD_* variables come from the env file: drop the handler's own.
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("SEFWD_")}
    child_env.update(env)
    cmd = sefwd_command() + ["config", "check", "--config", config_path]
    log.info("validating: %s", " ".join(shlex.quote(c) for c in cmd))
    try:
        code, _, err = run_bounded(cmd, "config check", merge=False, env=child_env, cwd=os.path.dirname(config_path))
    except OSError as exc:
        raise HandlerError("cannot run {}: {}".format(cmd[0], exc), E_AGENT_MISSING)
    except StepTimeout as exc:
        raise HandlerError("sefwd config check (previous config kept): {}".format(exc), E_CONFIG)
    if code == 0:
        return
    stderr = err.decode("utf-8", "replace")
    problems = [line.strip()[2:] for line in stderr.splitlines() if line.strip().startswith("- ")]
    detail = "; ".join(problems) if problems else _tail(stderr)
    raise HandlerError("publicSettings rejected by sefwd config check (previous config kept): " + detail, E_CONFIG)


def bundled(*parts: str) -> str:
    return os.path.join(EXT_DIR, *parts)


def run_script(argv: list, what: str, step: str | None = None, env: dict | None = None) -> str:
    """Run install.sh/uninstall.sh within its budget; its output goes to handler.log only."""
    log.info("running %s: %s", what, " ".join(shlex.quote(a) for a in argv))
    child_env = None if env is None else {**os.environ, **env}
    try:
        code, out, _ = run_bounded(argv, step or what, cwd=EXT_DIR, env=child_env)
    except OSError as exc:
        raise HandlerError("{} could not run: {}".format(what, exc), E_INSTALL)
    except StepTimeout as exc:
        _log_output(what, exc.output)
        raise HandlerError("{}; last output: {}".format(exc, cause_first(exc.output.decode("utf-8", "replace"))), E_INSTALL)
    _log_output(what, out)
    text = out.decode("utf-8", "replace")
    if code != 0:
        raise HandlerError("{} failed (exit {}): {}".format(what, code, cause_first(text)), E_INSTALL)
    return text


def _log_output(what: str, out: bytes) -> None:
    for line in out.decode("utf-8", "replace").splitlines():
        log.info("%s: %s", what, line)


def install_argv() -> list:
    wheels = sorted(glob.glob(bundled("wheels", "*.whl")))
    if not wheels:
        raise HandlerError("the extension package holds no wheel under wheels/ (built with build.sh --no-wheel?)", E_INSTALL)
    # Every extra: publicSettings may name any sink type or [telemetry], and install runs before
    # enable has read them. enable starts the service, hence --no-start.
    argv = ["bash", bundled("linux", "install.sh"), "--source", wheels[-1], "--extras", INSTALL_EXTRAS, "--no-start"]
    if os.environ.get("SEFWD_EXT_ROOT"):
        argv += ["--prefix", os.environ["SEFWD_EXT_ROOT"], "--no-user"]
    return argv


def uninstall_argv() -> list:
    argv = ["bash", bundled("linux", "uninstall.sh")]
    if os.environ.get("SEFWD_EXT_ROOT"):
        argv += ["--prefix", os.environ["SEFWD_EXT_ROOT"]]
    return argv


# -- operations ---------------------------------------------------------------------------------------

def _installation_exists() -> bool:
    return any(os.path.lexists(host_path(p)) for p in INSTALLATION_MARKERS)


def _rollback_install(created: list) -> str:
    """Undo a failed install that created the installation: waagent runs no uninstall for a handler
    whose install failed, so what this install left behind would outlive the extension."""
    notes = []
    if _flag("SEFWD_EXT_SKIP_INSTALL"):
        notes.append("uninstall.sh skipped")
    else:
        try:  # bounded: the service was never started (--no-start), so systemctl has little to do
            run_script(uninstall_argv(), "uninstall.sh", step="rollback", env={"SEFWD_SYSTEMCTL_LIMIT": "15"})
            notes.append("the partial installation was removed")
        except HandlerError as exc:
            notes.append("removing the partial installation failed too: " + exc.message)
    for path in created:
        _remove_quietly(host_path(path))
    for directory in (os.path.dirname(CONFIG_PATH), "/var/lib/sefwd", "/var/log/sefwd"):
        try:  # only when empty: uninstall.sh keeps these, and a non-empty one is not this install's alone
            os.rmdir(host_path(directory))
        except OSError:
            pass
    return "; ".join(notes)


def op_install(henv: HandlerEnvironment, seq: int | None) -> str:
    manifest = Manifest.load()
    had_installation = _installation_exists()
    existed = {path: os.path.lexists(host_path(path)) for path in OWNED_FILES}
    if _flag("SEFWD_EXT_SKIP_INSTALL"):
        try:
            what = " ".join(install_argv())
        except HandlerError as exc:
            what = "(nothing: {})".format(exc.message)
        message = "install skipped (SEFWD_EXT_SKIP_INSTALL=1); would run: " + what
    else:
        try:
            run_script(install_argv(), "install.sh")
        except HandlerError as exc:
            if had_installation:
                raise HandlerError(exc.message + "; the installation that was there before is left as it was", exc.code)
            created = [p for p in OWNED_FILES if not existed[p] and os.path.lexists(host_path(p))]
            raise HandlerError("{}; {} (the guest agent runs no uninstall after a failed install)".format(
                exc.message, _rollback_install(created)), exc.code)
        message = "sefwd installed (dependencies from PyPI); enable starts it"
    if manifest.installation is None:
        manifest.installation = "preexisting" if had_installation else "extension"
    for path in OWNED_FILES:  # install.sh's first config and env template: written for the extension, so its own
        current = _read_bytes(host_path(path))
        if not existed[path] and current is not None:
            manifest.files[path] = _sha256(current)
    _write_file(host_path(MANIFEST_PATH), manifest.render(), 0o644)
    _remove(host_path(UPDATE_MARKER))
    write_heartbeat(henv.heartbeat_file, False, OK, "sefwd installed, not started yet (enable starts it)")
    if manifest.installation == "preexisting":
        message += "; the installation was there before the extension: uninstall will leave it"
    foreign = manifest.foreign()
    if foreign:
        message += "; {} not the extension's: enable will leave them and say how to hand them over".format(
            " and ".join(foreign))
    return message


# Sink options whose value is itself a secret (a token inside a URL): anyone who can read the VM model
# reads publicSettings, so these may only name a variable of protectedSettings.env (or a file).
PUBLIC_SECRET_OPTIONS = {"notify": ("urls", "urls_env")}


def check_public_secrets(public: dict) -> None:
    """Refuse a secret-bearing sink option written into publicSettings, naming where it belongs."""
    sinks = public.get("sinks")
    for index, sink in enumerate(sinks if isinstance(sinks, list) else ()):
        if not isinstance(sink, dict) or sink.get("type") not in PUBLIC_SECRET_OPTIONS:
            continue
        key, instead = PUBLIC_SECRET_OPTIONS[sink["type"]]
        if key in sink:
            raise HandlerError(
                "publicSettings.sinks[{0}].{1}: {2} sink URLs hold tokens and publicSettings can be read from the VM "
                "model; put them in protectedSettings.env (e.g. \"SEFWD_NOTIFY_URLS\": \"slack://... workflows://...\") "
                "and set \"{3}\": \"SEFWD_NOTIFY_URLS\" instead (nothing was changed)".format(
                    index, key, sink["type"], instead), E_SETTINGS)


# publicSettings are readable by anyone with Reader on the VM (and land in the VM model): a value
# that is a credential must come from protectedSettings.env, named by headers_env / url_env.
SECRET_HEADERS = frozenset({"authorization", "proxy-authorization", "x-functions-key", "api-key", "x-api-key",
                            "ocp-apim-subscription-key", "aeg-sas-key", "aeg-sas-token", "cookie"})
SECRET_QUERY = frozenset({"code", "sig", "signature", "key", "token", "access_token", "api-key", "apikey", "api_key",
                          "subscription-key", "password", "secret"})


def public_secret_problems(public: dict) -> list:
    """Where publicSettings carry a credential inline (names only: a value is never echoed)."""
    from urllib.parse import parse_qsl, urlsplit

    problems = []
    sinks = public.get("sinks")
    for i, sink in enumerate(sinks if isinstance(sinks, list) else ()):
        if not isinstance(sink, dict):
            continue
        where = "publicSettings.sinks[{}]{}".format(i, " ({})".format(sink["name"]) if isinstance(sink.get("name"), str) else "")
        headers = sink.get("headers")
        if isinstance(headers, dict):
            for name in headers:
                if str(name).lower() in SECRET_HEADERS:
                    problems.append("{}: header {!r} is a credential: put its value in protectedSettings.env and "
                                    "name the variable in headers_env".format(where, str(name)))
        url = sink.get("url")
        if isinstance(url, str):
            try:
                parts = urlsplit(url.strip())
                names = sorted({k for k, _ in parse_qsl(parts.query, keep_blank_values=True) if k.lower() in SECRET_QUERY})
                userinfo = parts.username is not None or parts.password is not None
            except ValueError:
                continue  # the agent's own check words that
            if names or userinfo:
                what = "query parameter(s) {}".format(", ".join(names)) if names else "user:password@"
                problems.append("{}: url carries a credential ({}): put the URL in protectedSettings.env and "
                                "name the variable in url_env".format(where, what))
    return problems


def _timer_units(heartbeat: bool) -> list:
    """sefwd.service, and the heartbeat timer when it is on (or its unit file is still there)."""
    if heartbeat or os.path.lexists(host_path(HEARTBEAT_UNIT_FILES[1])):
        return [UNIT, HEARTBEAT_TIMER]
    return [UNIT]


def op_enable(henv: HandlerEnvironment, seq: int | None) -> str:
    public, protected = read_settings(henv.config_folder, seq)
    check_public_secrets(public)
    leaks = public_secret_problems(public)
    if leaks:
        raise HandlerError("publicSettings are readable by anyone with Reader on the VM, and carry secrets "
                           "(previous config kept): " + "; ".join(leaks), E_CONFIG)
    env = parse_protected(protected)
    manifest = Manifest.load()
    foreign = manifest.foreign()
    if foreign:
        raise HandlerError(handover_message(foreign), E_NOT_OURS)
    heartbeat = report_heartbeat() and bool(henv.heartbeat_file)
    service_env = dict(env)
    if heartbeat:  # the running agent refreshes its file; the timer copies it, checked, for waagent
        service_env[HEARTBEAT_ENV] = host_path(AGENT_HEARTBEAT)
    config_text = render_config(public).encode("utf-8")
    env_text = render_env(service_env).encode("utf-8")
    config_path, env_path = host_path(CONFIG_PATH), host_path(ENV_PATH)
    old_config = _read_bytes(config_path)
    mode = 0o640
    try:
        mode = os.stat(config_path).st_mode & 0o777
    except FileNotFoundError:
        pass
    # Validate in place (same directory: a relative state.dir resolves the same) under a name of its
    # own, then swap in.
    staged_config = _stage(config_path, config_text, mode)
    pairs: list = []
    changed = []
    try:
        config_check(staged_config, service_env)
        if old_config != config_text:
            gid = _config_group_gid()
            if gid is not None:
                os.chown(staged_config, 0, gid)
            pairs.append([staged_config, config_path])
            changed.append("config")
        else:
            _remove(staged_config)
        if _read_bytes(env_path) != env_text:
            pairs.append([_stage(env_path, env_text, 0o600), env_path])
            changed.append("env")
        else:
            os.chmod(env_path, 0o600)
        updated = Manifest(manifest.files, manifest.installation)
        updated.files[CONFIG_PATH], updated.files[ENV_PATH] = _sha256(config_text), _sha256(env_text)
        if heartbeat:
            for path, text in heartbeat_units(sys.executable, bundled("handler.py")).items():
                data = text.encode("utf-8")
                updated.files[path] = _sha256(data)
                if _read_bytes(host_path(path)) != data:
                    pairs.append([_stage(host_path(path), data, 0o644), host_path(path)])
        rendered = updated.render()
        if _read_bytes(host_path(MANIFEST_PATH)) != rendered:
            pairs.append([_stage(host_path(MANIFEST_PATH), rendered, 0o644), host_path(MANIFEST_PATH)])
    except BaseException:
        for staged in [staged_config] + [pair[0] for pair in pairs]:
            if os.path.lexists(staged):
                _remove_quietly(staged)
        raise
    commit(pairs, restart=bool(changed))
    restart_marker = host_path(RESTART_MARKER)
    if not changed and os.path.exists(restart_marker):
        changed.append("an earlier, unapplied change")
    units = _timer_units(heartbeat)
    service("enable", *units, step="systemctl enable")
    if changed:
        service("restart", *units)
        _remove(restart_marker)
        action = "service restarted ({} changed)".format(" and ".join(changed))
    else:
        service("start", *units)  # no-op when running; brings it back after a disable
        action = "settings unchanged, service left running"
    sinks = public.get("sinks")
    sink_names = ", ".join(str(s.get("name", s.get("type"))) for s in sinks if isinstance(s, dict)) if isinstance(sinks, list) else ""
    return "sefwd enabled: {}; sinks: {}; secrets: {}{}".format(
        action, sink_names or "stdout (default: records go to the journal)",
        ", ".join(sorted(env)) or "none", probe_summary(public))


def probe_summary(public: dict) -> str:
    """Where the maintenance probe answers, for the status message ("" when [probe] has no listen)."""
    probe = public.get("probe")
    if not isinstance(probe, dict) or not probe.get("listen"):
        return ""
    return "; maintenance probe: http://{}{}".format(probe["listen"], probe.get("path") or "/maintenance")


def _not_managed(manifest: Manifest) -> str:
    foreign = manifest.foreign()
    return "sefwd.service left as it is: neither its installation nor its config is the extension's{}".format(
        " ({} belong to whoever set the VM up)".format(", ".join(foreign)) if foreign else "")


def op_disable(henv: HandlerEnvironment, seq: int | None) -> str:
    # Never fails: waagent runs disable outside its error handling, so a failing disable would
    # block uninstall and abort an update (the old version would stay).
    manifest = Manifest.load()
    notes = []
    if manifest.manages_service():
        problem = service_tolerant("disable", "--now", *_timer_units(False))
        notes.append("sefwd may still be running: {} (ignored: disable must not block uninstall or update)".format(problem)
                     if problem else "sefwd stopped and disabled")
        # The secrets go too (enable writes them again from protectedSettings): waagent may never run an
        # uninstall after this disable (a failed update, an uninstall killed at its limit).
        if manifest.owns(ENV_PATH) and _remove_quietly(host_path(ENV_PATH)):
            notes.append("secrets removed until the next enable ({})".format(ENV_PATH))
    else:
        notes.append(_not_managed(manifest))
    write_heartbeat(henv.heartbeat_file, False, OK, "sefwd disabled")
    return "; ".join(notes)


def _update_in_progress() -> bool:
    path = host_path(UPDATE_MARKER)
    try:
        return time.time() - os.path.getmtime(path) < UPDATE_MARKER_MAX_AGE
    except OSError:
        return False


def op_uninstall(henv: HandlerEnvironment, seq: int | None) -> str:
    manifest = Manifest.load()
    if _update_in_progress():
        # waagent runs the old version's uninstall between the new one's update and install:
        # keep the agent, its config and its journal; the new install upgrades in place.
        problem = service_tolerant("stop", UNIT) if manifest.manages_service() else None
        kept = "update in progress: installation kept for the new version"
        return "{}; sefwd may still be running: {}".format(kept, problem) if problem else kept + "; sefwd stopped"
    problem = None
    notes = []
    if manifest.manages_service():  # a half-installed agent must still be removable
        problem = service_tolerant("disable", "--now", *_timer_units(False))
    removed = []
    for path in HEARTBEAT_UNIT_FILES:  # before uninstall.sh, whose daemon-reload then forgets them
        if manifest.owns(path) and _remove_quietly(host_path(path)):
            removed.append(path)
    failure = None
    if manifest.installation == "extension":
        if _flag("SEFWD_EXT_SKIP_INSTALL"):
            notes.append("uninstall.sh skipped (SEFWD_EXT_SKIP_INSTALL=1)")
        else:
            try:
                run_script(uninstall_argv(), "uninstall.sh")
                notes.append("sefwd uninstalled")
            except HandlerError as exc:
                failure = exc  # the config and the secrets go anyway
    elif manifest.installation == "preexisting":
        notes.append("the installation (/opt/sefwd, the unit, the user) was there before the extension: left in place")
    owned = [path for path in OWNED_FILES if manifest.owns(path)]
    transient = [RESTART_MARKER, UPDATE_MARKER, JOURNAL_PATH]
    if manifest.manages_service():
        transient.append(AGENT_HEARTBEAT)  # written by the agent because enable told it to
    for path in owned + transient + [MANIFEST_PATH]:
        if _remove_quietly(host_path(path)):
            removed.append(path)
    recover()  # staged leftovers of a killed command
    try:
        os.rmdir(host_path(os.path.dirname(CONFIG_PATH)))
    except OSError:
        pass
    left = manifest.foreign()
    if left:
        notes.append("left in place (not the extension's): " + ", ".join(left))
    if failure is not None:
        raise HandlerError("{}; config and secrets removed anyway".format(failure.message), failure.code)
    notes.append("removed: " + (", ".join(removed) or "nothing"))
    message = "; ".join(notes)
    return message + ("; the service manager failed (ignored): " + problem if problem else "")


def op_update(henv: HandlerEnvironment, seq: int | None) -> str:
    previous = os.environ.get("AZURE_GUEST_AGENT_UPDATING_FROM_VERSION", "unknown")
    _write_file(host_path(UPDATE_MARKER), "updating from {} at {}\n".format(previous, utc_now()).encode("utf-8"), 0o644)
    return "update from version {} prepared; install upgrades the agent in place".format(previous)


HANDLERS = {"install": op_install, "enable": op_enable, "disable": op_disable, "uninstall": op_uninstall, "update": op_update}
# These must act even when nothing can be reported or another command holds the lock.
ALWAYS_ACT = ("disable", "uninstall")


def outcome(operation: str, code: int, message: str) -> str:
    """The one line printed to stdout: all waagent reports of a handler that is not installed yet."""
    line = "{} {}: {}".format(operation, "succeeded" if code == OK else "failed (code {})".format(code), message)
    return line[:MAX_MESSAGE]


def python_note() -> str:
    """Which Python handler.sh chose (it exports SEFWD_EXT_PYTHON), for the status message."""
    chosen = os.environ.get("SEFWD_EXT_PYTHON")
    return " [Python {} at {}]".format(os.environ.get("SEFWD_EXT_PYTHON_VERSION", "?"), chosen) if chosen else ""


def run_heartbeat() -> int:
    """``handler.py heartbeat`` (the root timer): copy the agent's heartbeat, checked, for waagent; exits 0."""
    logging.raiseExceptions = False
    try:
        henv = HandlerEnvironment.load()
    except HandlerError as exc:
        print("heartbeat: " + exc.message)
        return 0
    lock = CommandLock("heartbeat")
    if not lock.try_acquire():  # a handler command is writing the heartbeat itself
        print("heartbeat: a handler command is running; next time")
        return 0
    print("heartbeat: " + copy_agent_heartbeat(henv.heartbeat_file))
    return 0


def main(argv: list | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    command = args[0].lstrip("-").lower() if args else ""
    if command == "heartbeat":
        return run_heartbeat()
    if command not in HANDLERS:
        print("usage: handler.py install|enable|disable|uninstall|update", file=sys.stderr)
        return 2
    try:
        return run_command(command)
    except Exception as exc:  # past every guard: still one line, and disable still exits 0
        print(outcome(OPERATIONS[command], E_INTERNAL, "{}: {}".format(type(exc).__name__, exc)))
        return OK if command == "disable" else E_INTERNAL


def run_command(command: str) -> int:
    """One handler command under the lock: status, the operation, status again; its exit code."""
    operation = OPERATIONS[command]
    logging.raiseExceptions = False  # a log write on a full disk must not print tracebacks into waagent's output
    notes = []
    try:
        henv = HandlerEnvironment.load()
    except HandlerError as exc:
        if command not in ALWAYS_ACT:
            print(outcome(operation, exc.code, exc.message))
            return exc.code
        henv, notes = HandlerEnvironment(None, None, None, None), [exc.message]
    log_path = setup_logging(henv.log_folder)
    seq = current_seq(henv.config_folder) if henv.config_folder else None
    seq_no = 0 if seq is None else seq
    log.info("%s (sequence number %s)", operation, seq_no)
    lock = CommandLock(command)
    try:
        lock.acquire(budget("lock"))
    except (Busy, OSError) as exc:
        reason = str(exc) if isinstance(exc, Busy) else "cannot lock {}: {}".format(lock.path, exc)
        if command not in ALWAYS_ACT:
            # Nothing changed, and the status file is the other command's to write.
            log.error("%s not run: %s", operation, reason)
            print(outcome(operation, E_BUSY, reason + "; nothing changed, run it again"))
            return E_BUSY
        log.warning("%s goes on without the lock: %s", operation, reason)
        notes.append(reason + ": went on without it")
    try:
        done = recover()
        if done:
            notes.append("an interrupted command was completed: " + ", ".join(done))
    except OSError as exc:
        log.warning("cannot complete an interrupted command: %s", exc)
    write_status(henv.status_folder, seq_no, operation, "transitioning", OK, "{} in progress".format(operation))
    try:
        message = HANDLERS[command](henv, seq)
        code = OK
    except HandlerError as exc:
        code, message = exc.code, exc.message
    except Exception as exc:  # the status file must say what went wrong, whatever it was
        log.exception("%s failed", operation)
        code, message = E_INTERNAL, "{}: {}".format(type(exc).__name__, exc)
    if notes:
        message += " (" + "; ".join(notes) + ")"
    if code != OK:
        log.error("%s failed: %s", operation, message)
        if log_path:
            message += " (details: {})".format(log_path)
    else:
        log.info("%s succeeded: %s", operation, message)
    status = "success" if code == OK else "error"
    exit_code = code
    if command == "disable" and code != OK:
        # waagent runs disable outside its error handling: a non-zero exit would block uninstall and abort an update.
        status, exit_code = "warning", OK
    message += python_note()
    write_status(henv.status_folder, seq_no, operation, status, code, message)
    if command == "enable":
        write_heartbeat(henv.heartbeat_file, code == OK, code, message)
    print(outcome(operation, exit_code, message))
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
