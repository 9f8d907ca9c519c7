#!/usr/bin/env python3
"""Azure VM extension handler for sefwd: ``handler.py install|enable|disable|uninstall|update``.

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
import json
import logging
import os
import re
import shlex
import signal
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
# With reportHeartbeat on, waagent's heartbeatFile is a symlink to this file, which the running
# agent rewrites ([agent] heartbeat_file): the service may write only under its StateDirectory.
AGENT_HEARTBEAT = "/var/lib/sefwd/extension-heartbeat.json"
HEARTBEAT_ENV = "SEFWD_AGENT_HEARTBEAT_FILE"
SEFWD_CANDIDATES = ("/opt/sefwd/venv/bin/sefwd", "/opt/sefwd/bin/sefwd", "/usr/local/bin/sefwd", "/usr/bin/sefwd")
STAGED_SUFFIX = ".ext-new"
INSTALL_EXTRAS = "all"
# waagent keeps a status message whole but the portal shows about 1,000 characters: messages put
# the cause first, so a cut only loses detail.
MAX_MESSAGE = 1000
TRUNCATED = " ... [truncated]"

# What waagent allows each command before it SIGKILLs the command's process group (seconds).
GUEST_AGENT_LIMITS = {"install": 900, "enable": 300, "disable": 900, "uninstall": 300, "update": 900}
MARGIN = 60  # every command's worst case ends at least this long before waagent's limit
# The longest each step may take; a step past its budget has its process group killed and
# fails with its own message. The sum per command is its worst case (see COMMAND_STEPS).
BUDGETS = {
    "openssl": 30,  # decrypting protectedSettings: milliseconds normally
    "config check": 90,  # `sefwd config check`: a Python start, ~1 s normally
    "systemctl enable": 30,
    "systemctl start": 90,  # start/restart/stop/disable --now: the unit's TimeoutStopSec 30 s + TimeoutStartSec 30 s
    "install.sh": 780,  # a venv and pip install from the package index
    "uninstall.sh": 150,  # stop (already stopped), daemon-reload, rm -rf the venv, userdel
}
COMMAND_STEPS = {
    "install": ("install.sh",),
    "enable": ("openssl", "config check", "systemctl enable", "systemctl start"),
    "disable": ("systemctl start",),
    "uninstall": ("systemctl start", "uninstall.sh"),
    "update": (),
}

# Status codes (also the handler's exit status).
OK = 0
E_INTERNAL = 1
E_SETTINGS = 11  # settings file unreadable, malformed, or protectedSettings not decryptable
E_CONFIG = 12  # the agent rejected the config built from publicSettings
E_SERVICE = 13  # the service manager failed
E_INSTALL = 14  # install.sh / uninstall.sh failed
E_AGENT_MISSING = 15  # no sefwd to validate the config with

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

    def __init__(self, log_folder: str, config_folder: str, status_folder: str, heartbeat_file: str | None) -> None:
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

def current_seq(config_folder: str) -> int | None:
    """ConfigSequenceNumber, else the newest ``<n>.settings`` (waagent picks the last modified), else None."""
    value = os.environ.get("ConfigSequenceNumber", "").strip()
    if value.isdigit():
        return int(value)
    newest = None
    for path in glob.glob(os.path.join(config_folder, "*.settings")):
        stem = os.path.basename(path)[: -len(".settings")]
        if not stem.isdigit():
            continue
        key = (os.path.getmtime(path), int(stem))
        if newest is None or key > newest:
            newest = key
    return None if newest is None else newest[1]


def read_settings(config_folder: str, seq: int | None) -> tuple[dict, dict]:
    """(publicSettings, decrypted protectedSettings) of ``<seq>.settings``; both {} when there is none."""
    if seq is None:
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


def _write_file(path: str, data: bytes, mode: int) -> None:
    """Write ``path`` atomically with ``mode`` from the first byte (secrets never sit world-readable)."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
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


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def write_status(status_folder: str, seq: int, operation: str, status: str, code: int, message: str) -> None:
    """Write ``<seq>.status`` (atomically: waagent may read it at any moment)."""
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
    _write_file(os.path.join(status_folder, "{}.status".format(seq)), json.dumps(doc, indent=1).encode("utf-8"), 0o644)


def report_heartbeat() -> bool:
    """The package's HandlerManifest.json says reportHeartbeat (true, or "true" as waagent also accepts)."""
    try:
        with open(bundled("HandlerManifest.json"), encoding="utf-8-sig") as f:
            value = json.load(f)[0]["handlerManifest"].get("reportHeartbeat", False)
    except (OSError, ValueError, LookupError, TypeError, AttributeError):
        return False
    return value is True or str(value).strip().lower() == "true"


def heartbeat_target(heartbeat_file: str | None) -> str | None:
    """Where heartbeats go. With reportHeartbeat, waagent's heartbeatFile is made a symlink to the
    file the running agent refreshes (AGENT_HEARTBEAT), so waagent reads the agent's own liveness."""
    if not heartbeat_file or not report_heartbeat():
        return heartbeat_file
    target = host_path(AGENT_HEARTBEAT)
    try:
        if not (os.path.islink(heartbeat_file) and os.readlink(heartbeat_file) == target):
            link = heartbeat_file + ".new-link"
            _remove(link)
            os.symlink(target, link)
            os.replace(link, heartbeat_file)
    except OSError as exc:
        log.warning("cannot link %s to %s: %s", heartbeat_file, target, exc)
        return heartbeat_file
    return target


def write_heartbeat(heartbeat_file: str | None, ready: bool, code: int, message: str) -> None:
    """Best effort: a heartbeat in waagent's format (status Ready/NotReady, as waagent spells them)."""
    target = heartbeat_target(heartbeat_file)
    if not target:
        return
    doc = [{"version": 1.0, "heartbeat": {"status": "Ready" if ready else "NotReady", "code": code,
                                          "formattedMessage": {"lang": "en-US", "message": message[:MAX_MESSAGE]}}}]
    try:
        _write_file(target, json.dumps(doc).encode("utf-8"), 0o644)
    except OSError as exc:
        log.warning("cannot write heartbeat file %s: %s", target, exc)


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
    """A step ran past its budget; its process group was killed."""

    def __init__(self, step: str, seconds: float, output: bytes) -> None:
        super().__init__("{} did not finish within its {:g} s budget and was killed".format(step, seconds))
        self.output = output


def run_bounded(argv: list, step: str, input: bytes | None = None, merge: bool = True, **kwargs: object) -> tuple:
    """Run ``argv`` in a new process group for at most budget(step) s: (exit status, stdout, stderr).

    Past the budget the whole group is killed (pip's children with install.sh), so the handler
    always ends before waagent kills it, and with its own message.
    """
    limit = budget(step)
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT if merge else subprocess.PIPE,
                            start_new_session=True, **kwargs)  # type: ignore[call-overload]
    try:
        out, err = proc.communicate(input, timeout=limit)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        try:
            out, err = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:  # something left the group and holds the pipe open
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


def run_script(argv: list, what: str) -> str:
    """Run install.sh/uninstall.sh within its budget; its output goes to handler.log only."""
    log.info("running %s: %s", what, " ".join(shlex.quote(a) for a in argv))
    try:
        code, out, _ = run_bounded(argv, what, cwd=EXT_DIR)
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

def op_install(henv: HandlerEnvironment, seq: int | None) -> str:
    if _flag("SEFWD_EXT_SKIP_INSTALL"):
        try:
            what = " ".join(install_argv())
        except HandlerError as exc:
            what = "(nothing: {})".format(exc.message)
        message = "install skipped (SEFWD_EXT_SKIP_INSTALL=1); would run: " + what
    else:
        run_script(install_argv(), "install.sh")
        message = "sefwd installed (dependencies from PyPI); enable starts it"
    _remove(host_path(UPDATE_MARKER))
    write_heartbeat(henv.heartbeat_file, False, OK, "sefwd installed, not started yet (enable starts it)")
    return message


# Sink options whose value is itself a secret (a token inside a URL): anyone who can read the VM model
# reads publicSettings, so these may only name a variable of protectedSettings.env (or a file).
PUBLIC_SECRET_OPTIONS = {"notify": ("urls", "urls_env")}


def check_public_secrets(public: dict) -> None:
    """Refuse a secret-bearing sink option written into publicSettings, naming where it belongs."""
    sinks = public.get("sinks")
    for index, sink in enumerate(sinks if isinstance(sinks, list) else []):
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
    sinks = public.get("sinks") if isinstance(public.get("sinks"), list) else []
    for i, sink in enumerate(sinks):
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


def op_enable(henv: HandlerEnvironment, seq: int | None) -> str:
    public, protected = read_settings(henv.config_folder, seq)
    check_public_secrets(public)
    leaks = public_secret_problems(public)
    if leaks:
        raise HandlerError("publicSettings are readable by anyone with Reader on the VM, and carry secrets "
                           "(previous config kept): " + "; ".join(leaks), E_CONFIG)
    env = parse_protected(protected)
    service_env = dict(env)
    if report_heartbeat():  # the running agent refreshes the file waagent reads
        service_env[HEARTBEAT_ENV] = host_path(AGENT_HEARTBEAT)
    config_text = render_config(public).encode("utf-8")
    env_text = render_env(service_env).encode("utf-8")
    config_path, env_path = host_path(CONFIG_PATH), host_path(ENV_PATH)
    staged_config, staged_env = config_path + STAGED_SUFFIX, env_path + STAGED_SUFFIX
    old_config = _read_bytes(config_path)
    mode = 0o640
    try:
        mode = os.stat(config_path).st_mode & 0o777
    except FileNotFoundError:
        pass
    # Validate in place (same directory: a relative state.dir resolves the same), then swap in.
    _write_file(staged_config, config_text, mode)
    try:
        config_check(staged_config, service_env)
    except HandlerError:
        _remove(staged_config)
        raise
    changed = []
    if old_config != config_text:
        gid = _config_group_gid()
        if gid is not None:
            os.chown(staged_config, 0, gid)
        os.replace(staged_config, config_path)
        changed.append("config")
    else:
        _remove(staged_config)
    if _read_bytes(env_path) != env_text:
        _write_file(staged_env, env_text, 0o600)
        os.replace(staged_env, env_path)
        changed.append("env")
    else:
        os.chmod(env_path, 0o600)
    restart_marker = host_path(RESTART_MARKER)
    if changed:
        _write_file(restart_marker, b"", 0o644)
    elif os.path.exists(restart_marker):
        changed.append("an earlier, unapplied change")
    service("enable", UNIT, step="systemctl enable")
    if changed:
        service("restart", UNIT)
        _remove(restart_marker)
        action = "service restarted ({} changed)".format(" and ".join(changed))
    else:
        service("start", UNIT)  # no-op when running; brings it back after a disable
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


def op_disable(henv: HandlerEnvironment, seq: int | None) -> str:
    # Never fails: waagent runs disable outside its error handling, so a failing disable would
    # block uninstall and abort an update (the old version would stay).
    problem = service_tolerant("disable", "--now", UNIT)
    write_heartbeat(henv.heartbeat_file, False, OK, "sefwd disabled")
    if problem:
        return "sefwd may still be running: {} (ignored: disable must not block uninstall or update)".format(problem)
    return "sefwd stopped and disabled"


def _update_in_progress() -> bool:
    path = host_path(UPDATE_MARKER)
    try:
        return time.time() - os.path.getmtime(path) < UPDATE_MARKER_MAX_AGE
    except OSError:
        return False


def op_uninstall(henv: HandlerEnvironment, seq: int | None) -> str:
    if _update_in_progress():
        # waagent runs the old version's uninstall between the new one's update and install:
        # keep the agent, its config and its journal; the new install upgrades in place.
        problem = service_tolerant("stop", UNIT)
        kept = "update in progress: installation kept for the new version"
        return "{}; sefwd may still be running: {}".format(kept, problem) if problem else kept + "; sefwd stopped"
    problem = service_tolerant("disable", "--now", UNIT)  # a half-installed agent must still be removable
    failure = None
    if _flag("SEFWD_EXT_SKIP_INSTALL"):
        message = "uninstall.sh skipped (SEFWD_EXT_SKIP_INSTALL=1); "
    else:
        try:
            run_script(uninstall_argv(), "uninstall.sh")
            message = "sefwd uninstalled; "
        except HandlerError as exc:
            failure = exc  # the config and the secrets go anyway
            message = ""
    removed = []
    for path in (CONFIG_PATH, ENV_PATH, CONFIG_PATH + STAGED_SUFFIX, ENV_PATH + STAGED_SUFFIX, RESTART_MARKER,
                 UPDATE_MARKER, AGENT_HEARTBEAT):
        if _remove(host_path(path)):
            removed.append(path)
    try:
        os.rmdir(host_path(os.path.dirname(CONFIG_PATH)))
    except OSError:
        pass
    if failure is not None:
        raise HandlerError("{}; config and secrets removed anyway".format(failure.message), failure.code)
    message += "removed: " + (", ".join(removed) or "nothing")
    return message + ("; the service manager failed (ignored): " + problem if problem else "")


def op_update(henv: HandlerEnvironment, seq: int | None) -> str:
    previous = os.environ.get("AZURE_GUEST_AGENT_UPDATING_FROM_VERSION", "unknown")
    _write_file(host_path(UPDATE_MARKER), "updating from {} at {}\n".format(previous, utc_now()).encode("utf-8"), 0o644)
    return "update from version {} prepared; install upgrades the agent in place".format(previous)


HANDLERS = {"install": op_install, "enable": op_enable, "disable": op_disable, "uninstall": op_uninstall, "update": op_update}


def outcome(operation: str, code: int, message: str) -> str:
    """The one line printed to stdout: all waagent reports of a handler that is not installed yet."""
    line = "{} {}: {}".format(operation, "succeeded" if code == OK else "failed (code {})".format(code), message)
    return line[:MAX_MESSAGE]


def python_note() -> str:
    """Which Python handler.sh chose (it exports SEFWD_EXT_PYTHON), for the status message."""
    chosen = os.environ.get("SEFWD_EXT_PYTHON")
    return " [Python {} at {}]".format(os.environ.get("SEFWD_EXT_PYTHON_VERSION", "?"), chosen) if chosen else ""


def main(argv: list | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    command = args[0].lstrip("-").lower() if args else ""
    if command not in HANDLERS:
        print("usage: handler.py install|enable|disable|uninstall|update", file=sys.stderr)
        return 2
    operation = OPERATIONS[command]
    try:
        henv = HandlerEnvironment.load()
    except HandlerError as exc:
        print(outcome(operation, exc.code, exc.message))
        return exc.code
    log_path = setup_logging(henv.log_folder)
    seq = current_seq(henv.config_folder)
    seq_no = 0 if seq is None else seq
    log.info("%s (sequence number %s)", operation, seq_no)
    write_status(henv.status_folder, seq_no, operation, "transitioning", OK, "{} in progress".format(operation))
    try:
        message = HANDLERS[command](henv, seq)
        code = OK
    except HandlerError as exc:
        code, message = exc.code, exc.message
    except Exception as exc:  # the status file must say what went wrong, whatever it was
        log.exception("%s failed", operation)
        code, message = E_INTERNAL, "{}: {}".format(type(exc).__name__, exc)
    if code != OK:
        log.error("%s failed: %s", operation, message)
        if log_path:
            message += " (details: {})".format(log_path)
    else:
        log.info("%s succeeded: %s", operation, message)
    message += python_note()
    write_status(henv.status_folder, seq_no, operation, "success" if code == OK else "error", code, message)
    if command == "enable":
        write_heartbeat(henv.heartbeat_file, code == OK, code, message)
    print(outcome(operation, code, message))
    return code


if __name__ == "__main__":
    sys.exit(main())
