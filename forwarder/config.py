"""Load and validate the TOML config, with ``SEFWD_<SECTION>_<KEY>`` environment overrides.

Every problem is collected and raised at once as a ConfigError, each naming where the value
came from (``imds.poll_interval`` for the file, ``SEFWD_IMDS_POLL_INTERVAL`` for the
environment). A relative ``state.dir`` resolves against the config file's directory (against
the working directory when it comes from the environment or there is no file); relative paths
in sink options are passed to the sink unchanged.
"""
from __future__ import annotations

import os
import re
import sys
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from forwarder.approval.config import parse_approval, parse_listen
from forwarder.approval.settings import ApprovalConfig
from forwarder.connection_strings import appinsights_problems
from forwarder.errors import ConfigError
from forwarder.logutil import redact
from forwarder.units import (
    boolean, choice, control_characters, duration, format_duration, parse_duration, size, suggest,
    url_text,
)
from forwarder.imds import MAX_BODY, MAX_BODY_LIMIT, MIN_BODY_LIMIT, check_max_body, validate_endpoint

SYSTEM_CONFIG_PATH = Path("/etc/sefwd/config.toml")
DEFAULTS_SOURCE = "built-in defaults"
ENV_PREFIX = "SEFWD_"

SUPPORTED_API_VERSIONS: tuple[str, ...] = (
    "2017-03-01", "2017-08-01", "2017-11-01", "2019-01-01", "2019-04-01", "2019-08-01", "2020-07-01",
)
LOG_LEVELS: tuple[str, ...] = ("debug", "info", "warning", "error")
# Sink types whose SDK ships as a pip extra of the same name.
SINK_EXTRAS: dict[str, str] = {"eventhubs": "eventhubs", "loganalytics": "loganalytics", "appinsights": "appinsights",
                               "eventgrid": "eventgrid"}
# IMDS throttles above 5 requests per second per VM; polls take at most 2 of them, leaving room
# for approvals, instance metadata and managed-identity tokens.
MIN_POLL_INTERVAL = 0.5
MAX_POLL_INTERVAL = 3600.0
# The sink name becomes a directory under the state dir, so it must stay one plain path part.
_SINK_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_API_VERSION = re.compile(r"^\d{4}-\d{2}-\d{2}(-preview)?$")
_SECRET_WORDS = ("secret", "key", "password", "connection_string", "token", "authorization", "credential")

_USE_SYSTEM_PATH: Any = object()


@dataclass(frozen=True)
class ImdsConfig:
    """Where and how often to ask IMDS."""

    endpoint: str
    api_version: str
    poll_interval: float
    timeout: float
    first_call_timeout: float
    compute_api_version: str
    compute_refresh: float
    max_body: int = MAX_BODY  # answers above this are refused unread (forwarder.imds)


@dataclass(frozen=True)
class StateConfig:
    """Where state.db (records, cursors, dead letters, state) lives."""

    dir: Path


@dataclass(frozen=True)
class AgentConfig:
    """Agent-wide behaviour."""

    heartbeat: float
    log_level: str
    drain_timeout: float
    heartbeat_file: Path | None = None  # the Azure VM extension's liveness file (forwarder.extension_heartbeat)


@dataclass(frozen=True)
class JournalConfig:
    """The cap and fsync of the store between the poller and the sinks."""

    max_size: int
    fsync: bool


@dataclass(frozen=True)
class DeliveryConfig:
    """The one retry policy every sink's delivery uses."""

    retry_initial: float
    retry_max: float
    retry_after_cap: float


@dataclass(frozen=True)
class TelemetryConfig:
    """The agent's own metrics: a Prometheus endpoint and/or export to Azure Monitor (both off by default)."""

    listen: tuple[str, int] | None = None  # /metrics and /healthz
    connection_string_env: str | None = None  # Azure Monitor export of the metrics
    connection_string_file: str | None = None
    unhealthy_after: float = 300.0  # /healthz is 503 once IMDS has failed for longer
    export_interval: float = 60.0
    credential: str | None = None  # "managed_identity": Entra ID tokens for the Azure Monitor export
    client_id: str | None = None  # a user-assigned managed identity

    @property
    def enabled(self) -> bool:
        return self.listen is not None or self.azure_monitor

    @property
    def azure_monitor(self) -> bool:
        return bool(self.connection_string_env or self.connection_string_file)


@dataclass(frozen=True)
class SinkConfig:
    """One configured sink; ``options`` holds every key but the common ones (type, name, max_age)."""

    type: str
    name: str
    options: Mapping[str, Any]
    max_age: float | None = None  # older undelivered records go to dead letters; None = never


@dataclass(frozen=True)
class Config:
    """The whole validated configuration; ``source`` is the file path or "built-in defaults"."""

    imds: ImdsConfig
    state: StateConfig
    agent: AgentConfig
    sinks: tuple[SinkConfig, ...]
    source: str
    journal: JournalConfig = JournalConfig(max_size=256 * 1024 * 1024, fsync=True)
    delivery: DeliveryConfig = DeliveryConfig(retry_initial=1.0, retry_max=60.0, retry_after_cap=300.0)
    approval: ApprovalConfig = ApprovalConfig()
    telemetry: TelemetryConfig = TelemetryConfig()


# -- value parsers: raw TOML value or env string -> parsed value, or ValueError ------------------
# Bounds and units come from the one toolkit (forwarder.units); these add the config's own kinds.

def _string(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


def _endpoint(value: Any) -> str:
    text = url_text(value)
    validate_endpoint(text)  # the IMDS client's own rules: no userinfo, query, fragment, control characters
    parts = urlsplit(text)
    # The client appends /metadata/...; a trailing slash would double it.
    return urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/"), "", ""))


def _api_version(value: Any) -> str:
    text = _string(value).strip()
    if text not in SUPPORTED_API_VERSIONS:
        raise ValueError(f"unsupported api-version {value!r} (supported: {', '.join(SUPPORTED_API_VERSIONS)})"
                         f"{suggest(text, SUPPORTED_API_VERSIONS)}")
    return text


def _compute_api_version(value: Any) -> str:
    text = _string(value).strip()
    if not _API_VERSION.match(text):
        raise ValueError(f"expected an api-version like '2021-02-01', got {value!r}")
    return text


def _poll_interval(value: Any) -> float:
    seconds = parse_duration(value)
    if seconds < MIN_POLL_INTERVAL:
        raise ValueError(
            f"must be at least {format_duration(MIN_POLL_INTERVAL)}, got {value!r}: IMDS allows 5 requests "
            "per second per VM, and approvals, instance metadata and managed-identity tokens need room beside the polls")
    if seconds > MAX_POLL_INTERVAL:
        raise ValueError(f"must be at most {format_duration(MAX_POLL_INTERVAL)}, got {value!r}: "
                         "a Spot eviction gives 30 seconds of notice")
    return seconds


def _heartbeat(value: Any) -> float:
    # 0 turns heartbeats off; anything else is an interval, and a heartbeat every millisecond is a flood.
    seconds = parse_duration(value)
    return 0.0 if seconds == 0 else duration(1.0, 86400.0)(value)


def _directory(value: Any) -> Path:
    text = _string(value).strip()
    if not text:
        raise ValueError("must not be empty")
    if "\0" in text:
        raise ValueError("must not contain NUL")
    return Path(text).expanduser()


def _telemetry_listen(value: Any) -> tuple[str, int]:
    # A bare port means loopback: exposing metrics beyond the host must be written out.
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    text = _string(value).strip()
    return parse_listen(f"127.0.0.1:{text}" if text.isdigit() else text)


def _optional_file(value: Any) -> Path | None:
    text = _string(value).strip()
    return Path(text).expanduser() if text else None


def _telemetry_credential(value: Any) -> str:
    text = _string(value).strip()
    if text != "managed_identity":
        raise ValueError(f'must be "managed_identity", got {value!r}')
    return text


def _nonempty(value: Any) -> str:
    text = _string(value).strip()
    if not text:
        raise ValueError("must not be empty")
    if control_characters(text):
        raise ValueError("must not contain spaces or control characters")
    return text


@dataclass(frozen=True)
class _Key:
    default: Any  # raw value, run through ``parse`` like any other; None = computed
    parse: Callable[[Any], Any]


# The one place that says which flat sections and keys exist, with each key's limits (documented
# in docs/config-and-secrets.md); [approval] is nested (forwarder.approval.config).
DAY = 86400.0
SECTIONS: dict[str, dict[str, _Key]] = {
    "imds": {
        "endpoint": _Key("http://169.254.169.254", _endpoint),
        "api_version": _Key("2020-07-01", _api_version),
        "poll_interval": _Key("1s", _poll_interval),
        "timeout": _Key("5s", duration(0.0, 60.0, low_inclusive=False)),
        "first_call_timeout": _Key("150s", duration(0.0, 600.0, low_inclusive=False)),
        "compute_api_version": _Key("2021-02-01", _compute_api_version),
        "compute_refresh": _Key("1h", duration(0.0, 7 * DAY, low_inclusive=False)),
        "max_body": _Key("1MiB", lambda v: check_max_body(size(MIN_BODY_LIMIT, MAX_BODY_LIMIT)(v))),
    },
    "state": {
        "dir": _Key(None, _directory),
    },
    "agent": {
        "heartbeat": _Key("5m", _heartbeat),
        "log_level": _Key("info", choice(LOG_LEVELS, aliases={"warn": "warning"})),
        "drain_timeout": _Key("10s", duration(0.0, 3600.0)),
        "heartbeat_file": _Key("", _optional_file),
    },
    "journal": {
        "max_size": _Key("256MiB", size(1024 * 1024, 64 * 1024**3)),
        "fsync": _Key(True, boolean),
    },
    "delivery": {
        # Floors keep a failing sink from being retried in a busy loop.
        "retry_initial": _Key("1s", duration(0.01, 3600.0)),
        "retry_max": _Key("60s", duration(0.1, DAY)),
        "retry_after_cap": _Key("5m", duration(0.0, DAY)),
    },
    "telemetry": {
        "listen": _Key(None, _telemetry_listen),
        "connection_string_env": _Key(None, _nonempty),
        "connection_string_file": _Key(None, _nonempty),
        "unhealthy_after": _Key("5m", duration(0.0, 7 * DAY, low_inclusive=False)),
        "export_interval": _Key("60s", duration(1.0, DAY)),
        "credential": _Key(None, _telemetry_credential),
        "client_id": _Key(None, _nonempty),
    },
}
# Pairs of keys (section, low key, high key) whose values must be ordered: low <= high.
ORDERED_KEYS: tuple[tuple[str, str, str, Callable[[Any], str]], ...] = (
    ("delivery", "retry_initial", "retry_max", format_duration),
)
MAX_SINK_AGE = 365 * DAY
# Nested tables with their own parsers, beside the flat SECTIONS.
_NESTED = ("sinks", "approval")
_TOP_LEVEL = (*SECTIONS, *_NESTED)


def _env_name(section: str, key: str) -> str:
    return f"{ENV_PREFIX}{section.upper()}_{key.upper()}"


def default_state_dir(
    env: Mapping[str, str], *, is_root: bool | None = None, windows: bool | None = None
) -> Path:
    """The state directory when none is configured (``is_root``/``windows`` default to this host)."""
    if windows is None:
        windows = sys.platform == "win32"
    if windows:
        return Path(env.get("ProgramData") or env.get("PROGRAMDATA") or r"C:\ProgramData") / "sefwd"
    if is_root is None:
        is_root = hasattr(os, "geteuid") and os.geteuid() == 0
    if is_root:
        return Path("/var/lib/sefwd")
    xdg = env.get("XDG_STATE_HOME", "")
    # The XDG spec says relative values are invalid and must be ignored.
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "sefwd"
    home = env.get("HOME") or str(Path.home())
    return Path(home) / ".local" / "state" / "sefwd"


def _parse_sections(
    data: Mapping[str, Any], env: Mapping[str, str], base_dir: Path | None, problems: list[str]
) -> dict[str, dict[str, Any]]:
    # (raw value, label) per key: file first, then environment on top.
    raw: dict[str, dict[str, tuple[Any, str]]] = {s: {} for s in SECTIONS}
    for section, table in data.items():
        if section in _NESTED:
            continue
        if section not in SECTIONS:
            if isinstance(table, Mapping):
                problems.append(f"unknown section [{section}]{suggest(section, _TOP_LEVEL)}")
            else:
                owners = [f"{s}.{section}" for s, keys in SECTIONS.items() if section in keys]
                hint = f" (did you mean {owners[0]!r}?)" if owners else suggest(section, _TOP_LEVEL)
                problems.append(f"unknown top-level key {section!r}{hint}")
            continue
        if not isinstance(table, Mapping):
            problems.append(f"{section} must be a table ([{section}]), got {table!r}")
            continue
        for key, value in table.items():
            if key not in SECTIONS[section]:
                problems.append(f"unknown key {section}.{key}{suggest(key, SECTIONS[section])}")
                continue
            raw[section][key] = (value, f"{section}.{key}")
    for var in sorted(env):
        for section, keys in SECTIONS.items():
            prefix = f"{ENV_PREFIX}{section.upper()}_"
            if not var.startswith(prefix):
                continue
            value = env[var]
            key = var[len(prefix):].lower()
            if key not in keys:
                names = [_env_name(section, k) for k in keys]
                problems.append(
                    f"unknown environment variable {var}: [{section}] has no key {key!r}{suggest(var, names)}"
                )
            elif value != "":  # an empty value means "not set", as systemd and Docker env files write it
                raw[section][key] = (value, f"environment {var}")
    parsed: dict[str, dict[str, Any]] = {}
    for section, keys in SECTIONS.items():
        parsed[section] = {}
        for key, spec in keys.items():
            value, label = raw[section].get(key, (spec.default, "default"))
            if value is None:
                continue
            try:
                parsed[section][key] = spec.parse(value)
            except ValueError as exc:
                problems.append(f"{label}: {exc}")
    for section, low, high, show in ORDERED_KEYS:
        values = parsed[section]
        if low in values and high in values and values[low] > values[high]:
            label = raw[section].get(low, (None, f"{section}.{low}"))[1]
            problems.append(f"{label}: {section}.{low} ({show(values[low])}) must not exceed "
                            f"{section}.{high} ({show(values[high])})")
    state_dir = parsed["state"].get("dir")
    if state_dir is None:
        if "dir" not in raw["state"]:
            parsed["state"]["dir"] = default_state_dir(env)
    elif not state_dir.is_absolute():
        from_file = raw["state"]["dir"][1] == "state.dir"
        anchor = base_dir if from_file and base_dir is not None else Path.cwd()
        parsed["state"]["dir"] = anchor / state_dir
    return parsed


def _missing_extra_hint(type_name: str) -> str:
    from forwarder.sinkapi import available_sinks

    target = available_sinks().get(type_name, "")
    module_tail = target.partition(":")[0].rsplit(".", 1)[-1]
    extra = SINK_EXTRAS.get(type_name) or SINK_EXTRAS.get(module_tail)
    return f"; install it with: pip install 'scheduled-events-forwarder[{extra}]'" if extra else ""


# What each telemetry feature imports, and the extra that brings it.
_TELEMETRY_MODULES = {
    "listen": ("opentelemetry.sdk.metrics", "opentelemetry.exporter.prometheus", "prometheus_client"),
    "connection_string": ("opentelemetry.sdk.metrics", "azure.monitor.opentelemetry.exporter"),
    "credential": ("azure.identity",),
}


def _module_missing(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):  # a parent package missing, or blocked in sys.modules
        return True


def _telemetry_problems(values: Mapping[str, Any], env: Mapping[str, str]) -> list[str]:
    """[telemetry] problems; looks for its modules only when it is configured (no import otherwise)."""
    problems = []
    var, path = values.get("connection_string_env"), values.get("connection_string_file")
    if var and path:
        problems.append("telemetry: set only one of connection_string_env and connection_string_file")
    elif var and not env.get(var, "").strip():
        problems.append(f"telemetry.connection_string_env: environment variable {var} is not set")
    elif path and not os.path.isfile(os.path.expanduser(path)):
        problems.append(f"telemetry.connection_string_file: {path} is not a file")
    elif var or path:
        try:
            text = env[var].strip() if var else Path(str(path)).expanduser().read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            problems.append(f"telemetry.connection_string_file: cannot read {path}: {exc}")
        else:
            where = f"environment variable {var}" if var else f"file {path}"
            problems.extend(f"telemetry ({where}): {p}" for p in appinsights_problems(text))
    exporting = bool(values.get("connection_string_env") or values.get("connection_string_file"))
    if values.get("credential") and not exporting:
        problems.append("telemetry.credential is for the Azure Monitor export: set connection_string_env or connection_string_file")
    if values.get("client_id") and not values.get("credential"):
        problems.append('telemetry.client_id needs credential = "managed_identity"')
    wanted = []
    if values.get("credential"):
        wanted.append("credential")
    if values.get("listen") is not None:
        wanted.append("listen")
    if values.get("connection_string_env") or values.get("connection_string_file"):
        wanted.append("connection_string")
    missing = sorted({m for w in wanted for m in _TELEMETRY_MODULES[w] if _module_missing(m)})
    if missing:
        problems.append(f"telemetry needs {', '.join(missing)}; install it with: "
                        "pip install 'scheduled-events-forwarder[telemetry]'")
    return problems


def _url_option_problems(options: Mapping[str, Any], prefix: str = "") -> list[str]:
    """CR/LF or other control characters in any URL-like option (a sink's own check may not look)."""
    problems = []
    for key, value in options.items():
        if isinstance(value, Mapping):
            problems += _url_option_problems(value, f"{prefix}{key}.")
        elif isinstance(value, str) and "://" in value:
            try:
                url_text(value)
            except ValueError as exc:
                problems.append(f"option '{prefix}{key}': {exc}")
    return problems


def _check_sink_options(index: int, sink: SinkConfig, problems: list[str]) -> None:
    from forwarder.sinkapi import load_sink_factory

    where = f"sinks[{index}] ({sink.name})"
    try:
        factory = load_sink_factory(sink.type)
    except LookupError as exc:
        problems.append(f"{where}: {exc.args[0] if exc.args else exc}")
        return
    except ImportError as exc:
        problems.append(f"{where}: sink type {sink.type!r} cannot be loaded: {exc}{_missing_extra_hint(sink.type)}")
        return
    problems.extend(f"{where}: {p}" for p in _url_option_problems(sink.options))
    check = getattr(factory, "check", None)
    if not callable(check):
        problems.append(f"{where}: sink type {sink.type!r} has no check(options) classmethod")
        return
    try:
        found = check(sink.options)
    except Exception as exc:  # a third-party check() must not hide the other problems
        problems.append(f"{where}: checking the options failed: {type(exc).__name__}: {exc}")
        return
    problems.extend(f"{where}: {p}" for p in found or ())


SINK_COMMON_KEYS = ("type", "name", "max_age")


def _parse_sinks(data: Mapping[str, Any], check_sinks: bool, problems: list[str]) -> tuple[SinkConfig, ...]:
    if "sinks" not in data:
        raw_sinks: Any = [{"type": "stdout"}]
    else:
        raw_sinks = data["sinks"]
    if isinstance(raw_sinks, Mapping) or not isinstance(raw_sinks, list):
        problems.append("sinks must be an array of tables: write each sink as [[sinks]]")
        return ()
    if not raw_sinks:
        problems.append("sinks is empty: configure at least one [[sinks]] (or remove the key for stdout)")
        return ()
    sinks: list[SinkConfig] = []
    seen: dict[str, int] = {}
    for index, entry in enumerate(raw_sinks):
        if not isinstance(entry, Mapping):
            problems.append(f"sinks[{index}] must be a table, got {entry!r}")
            continue
        type_name = entry.get("type")
        if type_name is None:
            problems.append(f"sinks[{index}]: missing 'type' (for example type = \"stdout\")")
            continue
        if not isinstance(type_name, str) or not type_name.strip():
            problems.append(f"sinks[{index}]: 'type' must be a non-empty string, got {type_name!r}")
            continue
        name = entry.get("name", type_name)
        if not isinstance(name, str) or not _SINK_NAME.match(name):
            problems.append(
                f"sinks[{index}]: 'name' must be 1-64 letters, digits, '_', '-' or '.', "
                f"starting with a letter or digit, got {name!r}"
            )
            continue
        if name in seen:
            problems.append(
                f"sinks[{index}]: duplicate sink name {name!r} (also sinks[{seen[name]}]); "
                "give each sink a distinct name"
            )
            continue
        seen[name] = index
        options = {k: v for k, v in entry.items() if k not in SINK_COMMON_KEYS}
        max_age = None
        if "max_age" in entry:
            try:
                max_age = duration(0.0, MAX_SINK_AGE, low_inclusive=False)(entry["max_age"])
            except ValueError as exc:
                problems.append(f"sinks[{index}] ({name}): max_age {exc}")
        sink = SinkConfig(type=type_name, name=name, options=options, max_age=max_age)
        if check_sinks:
            _check_sink_options(index, sink, problems)
        sinks.append(sink)
    return tuple(sinks)


def parse_config(
    data: Mapping[str, Any], env: Mapping[str, str], source: str, *, check_sinks: bool = True
) -> Config:
    """Validate parsed TOML plus environment overrides; raises ConfigError listing every problem."""
    problems: list[str] = []
    base_dir = Path(source).absolute().parent if source != DEFAULTS_SOURCE else None
    parsed = _parse_sections(data, env, base_dir, problems)
    sinks = _parse_sinks(data, check_sinks, problems)
    approval, approval_problems = parse_approval(data.get("approval", {}), env, base_dir)
    problems.extend(approval_problems)
    problems.extend(_telemetry_problems(parsed["telemetry"], env))
    if problems:
        raise ConfigError(problems)
    return Config(
        imds=ImdsConfig(**parsed["imds"]),
        state=StateConfig(**parsed["state"]),
        agent=AgentConfig(**parsed["agent"]),
        sinks=sinks,
        source=source,
        journal=JournalConfig(**parsed["journal"]),
        delivery=DeliveryConfig(**parsed["delivery"]),
        approval=approval,
        telemetry=TelemetryConfig(**parsed["telemetry"]),
    )


def _read_toml(path: Path, named_by: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError([f"config file {str(path)!r} ({named_by}) does not exist"]) from None
    except IsADirectoryError:
        raise ConfigError([f"config file {str(path)!r} ({named_by}) is a directory"]) from None
    except OSError as exc:
        raise ConfigError([f"config file {str(path)!r} ({named_by}) cannot be read: {exc.strerror or exc}"]) from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError([f"config file {str(path)!r} is not valid TOML: {exc}"]) from None


def load_config(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    *,
    check_sinks: bool = True,
    system_path: str | os.PathLike[str] | None = _USE_SYSTEM_PATH,
) -> Config:
    """Load ``path``, else ``$SEFWD_CONFIG``, else ``system_path`` if it exists, else defaults.

    ``system_path`` defaults to SYSTEM_CONFIG_PATH; None skips the system file.
    """
    if env is None:
        env = os.environ
    if system_path is _USE_SYSTEM_PATH:
        system_path = SYSTEM_CONFIG_PATH
    if path is not None:
        chosen: Path | None = Path(path)
        named_by = "given with --config"
    elif env.get("SEFWD_CONFIG"):
        chosen = Path(env["SEFWD_CONFIG"])
        named_by = "named by SEFWD_CONFIG"
    elif system_path is not None and Path(system_path).is_file():
        chosen = Path(system_path)
        named_by = "system config"
    else:
        chosen = None
        named_by = ""
    if chosen is None:
        return parse_config({}, env, DEFAULTS_SOURCE, check_sinks=check_sinks)
    chosen = chosen.expanduser()
    data = _read_toml(chosen, named_by)
    return parse_config(data, env, str(chosen), check_sinks=check_sinks)


def default_config() -> Config:
    """The configuration used when there is no file and no environment override."""
    return parse_config({}, {}, DEFAULTS_SOURCE)


# -- describe -------------------------------------------------------------------------------------

def _is_secret(key: str) -> bool:
    lowered = key.lower()
    return any(word in lowered for word in _SECRET_WORDS)


def _show(key: str, value: Any) -> str:
    if _is_secret(key):
        return "***"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}={_show(str(k), v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_show(key, v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(redact(value))
    return repr(value)


def describe(config: Config) -> str:
    """A short human summary of ``config`` for ``sefwd config check`` (secrets redacted)."""
    imds, agent = config.imds, config.agent
    heartbeat = format_duration(agent.heartbeat) if agent.heartbeat else "off"
    lines = [
        f"source: {config.source}",
        f"imds: {redact(imds.endpoint)} api-version {imds.api_version}, poll every "
        f"{format_duration(imds.poll_interval)} (timeout {format_duration(imds.timeout)}, first call "
        f"{format_duration(imds.first_call_timeout)}); compute api-version {imds.compute_api_version}, "
        f"re-read every {format_duration(imds.compute_refresh)}",
        f"state: {config.state.dir}",
        f"agent: heartbeat {heartbeat}, log level {agent.log_level}, drain timeout "
        f"{format_duration(agent.drain_timeout)}",
        f"sinks ({len(config.sinks)}):",
    ]
    for sink in config.sinks:
        options = ", ".join(f"{k}={_show(k, v)}" for k, v in sink.options.items())
        lines.append(f"  {sink.name} (type {sink.type})" + (f": {options}" if options else ""))
    approval = config.approval
    callback = approval.callback
    listen = "off" if callback is None else (
        f"{'https' if callback.tls_cert else 'http'} on {callback.host}:{callback.port} "
        f"({len(callback.keys)} key{'s' if len(callback.keys) != 1 else ''})"
    )
    lines.append(
        f"approval: scope {approval.scope}, {len(approval.rules)} rule(s)"
        f"{' (' + ', '.join(r.name for r in approval.rules) + ')' if approval.rules else ''}, "
        f"hooks: {', '.join(approval.hooks) or 'none'}, callback: {listen}"
    )
    telemetry = config.telemetry
    if telemetry.enabled:
        where = f"{telemetry.listen[0]}:{telemetry.listen[1]}" if telemetry.listen else "off"
        source = (f"env {telemetry.connection_string_env}" if telemetry.connection_string_env
                  else f"file {telemetry.connection_string_file}" if telemetry.connection_string_file else "off")
        lines.append(f"telemetry: /metrics and /healthz on {where}, Azure Monitor export {source} "
                     f"(every {format_duration(telemetry.export_interval)}), unhealthy after "
                     f"{format_duration(telemetry.unhealthy_after)} of IMDS failures")
    return "\n".join(lines)


EXAMPLE_CONFIG = '''\
# scheduled-events-forwarder (sefwd) configuration.
#
# Found at: --config FILE, else $SEFWD_CONFIG, else /etc/sefwd/config.toml, else built-in
# defaults (the values below, with one stdout sink). Every key of [imds], [state] and [agent]
# can also be set by an environment variable SEFWD_<SECTION>_<KEY>, which wins over this file:
# SEFWD_IMDS_ENDPOINT=http://127.0.0.1:8080/vm/web-0 points the agent at an emulator.
# An empty variable counts as unset. Durations: "500ms", "1s", "5m", "1h", "1d" or a number of
# seconds. Sizes: "64MiB", "10MB", "4096". Check a file with: sefwd config check --config FILE

[imds]
# Base URL of the Instance Metadata Service; may carry a path prefix (the emulator serves
# each VM under /vm/<name>).
endpoint = "http://169.254.169.254"
# Scheduled Events api-version: 2017-03-01 2017-08-01 2017-11-01 2019-01-01 2019-04-01
# 2019-08-01 2020-07-01. Newer versions add fields (Description, EventSource, DurationInSeconds).
api_version = "2020-07-01"
# How often to poll. Events give as little as 30 s notice (Preempt), so keep it short;
# IMDS allows 5 requests per second; the agent keeps all its requests to 4 in any 1.1 s (the
# fifth is for `sefwd approve` / `sefwd once`), and approvals and instance metadata need room
# beside the polls, hence the 500ms floor (at most 1h). See docs/imds-transport.md.
poll_interval = "1s"
# Deadline of one request: connect, send and the whole answer (a server that drips its answer
# byte by byte is cut off here).
timeout = "5s"
# The very first call enables Scheduled Events for the VM and can take up to 2 minutes.
first_call_timeout = "150s"
# api-version of /metadata/instance/compute, read for the VM's identity (vmId, name, ...).
compute_api_version = "2021-02-01"
# Instance metadata rarely changes: re-read it this rarely.
compute_refresh = "1h"
# Larger answers are refused without being read (IMDS answers are a few KiB); 64KiB to 16MiB.
max_body = "1MiB"

[state]
# state.db (records, cursors, dead letters, state; see docs/storage.md). Default: /var/lib/sefwd as root, else
# $XDG_STATE_HOME/sefwd or ~/.local/state/sefwd (%ProgramData%\\sefwd on Windows).
# A relative path resolves against this file's directory.
dir = "/var/lib/sefwd"

[agent]
# Interval of forwarder.heartbeat records, so a silent agent can be told from a dead one;
# "0" turns them off.
heartbeat = "5m"
# debug, info, warning or error (logs go to stderr; stdout carries records only).
log_level = "info"
# On shutdown, how long sinks may keep delivering the backlog before the agent exits
# (undelivered records stay in state.db and are sent on the next start).
drain_timeout = "10s"
# A file rewritten every 30 s in the Azure guest agent's heartbeat format (Ready/NotReady and a
# one-line summary); the VM extension sets it. "" (the default) writes none.
heartbeat_file = ""

[journal]
# The cap on undelivered records in state.db. Past max_size heartbeats and audits are evicted
# first, scheduledevent.* records last, and every record a sink thereby loses is counted
# (sefwd status, "evicted_size_cap").
max_size = "256MiB"
# fsync every commit (SQLite synchronous=FULL; false = NORMAL). Turn off only for tests.
fsync = true

[delivery]
# Retry policy of every sink: capped exponential backoff with full jitter.
retry_initial = "1s"
retry_max = "60s"
# A peer's Retry-After is honoured up to this long.
retry_after_cap = "5m"

# The agent's own metrics (off unless a key below is set): polls and their latency, IMDS errors by
# status, detection-to-delivery latency, backlog and oldest-undelivered age, dead letters and
# approvals per sink/outcome. Needs: pip install 'scheduled-events-forwarder[telemetry]'.
# [telemetry]
# # Prometheus text on http://HOST:PORT/metrics, and /healthz (503 once IMDS has failed for
# # longer than unhealthy_after). A bare port listens on loopback; other hosts must be explicit.
# listen = "127.0.0.1:9464"
# # Also export the metrics to Azure Monitor (Application Insights, AppMetrics) every export_interval.
# connection_string_env = "SEFWD_TELEMETRY_CONNECTION_STRING"
# # ... or read it from a file instead:
# connection_string_file = "/etc/sefwd/telemetry-connection-string"
# # Entra ID for the export (resources with local auth off): the VM's managed identity, which needs
# # "Monitoring Metrics Publisher" on the Application Insights resource; client_id picks a user-assigned one.
# credential = "managed_identity"
# client_id = "00000000-0000-0000-0000-000000000000"
# unhealthy_after = "5m"
# export_interval = "60s"

# Sinks: one [[sinks]] table each. "type" picks the sink; "name" (default: the type) must be
# unique and names the sink's dead-letter and state directories. "max_age" (optional, e.g.
# "24h") moves records that could not be delivered for that long to dead letters. Every other key is an option
# of that sink type. Without any [[sinks]] the agent writes to stdout; relative paths in sink
# options are resolved by the sink, not by this file's location.

[[sinks]]
type = "stdout"
name = "stdout"
# One human-readable line per record instead of one JSON object per line.
pretty = false

[[sinks]]
type = "file"
name = "events-file"
# JSON lines appended here (parent directories are created).
path = "/var/log/sefwd/events.jsonl"
# Rotate before the file would grow past this size ...
max_size = "64MiB"
# ... keeping path.1 ... path.5, the oldest deleted.
backups = 5
# fsync after every batch: an acknowledged batch then survives power loss, at some cost.
fsync = false

[approval]
# Approving an event (POST StartRequests to IMDS) lets Azure start it early for EVERY VM in its
# Resources. Nothing is approved unless rules, `sefwd approve` or the callback say so; every
# attempt becomes an approval.* record. Env overrides: SEFWD_APPROVAL_SCOPE, _HOOK_TIMEOUT, ...
# Which events this VM may approve: "self" (Resources is this VM alone), "leader" (this VM is
# the first of the sorted Resources), "any", or "self_or_leader" (either of the first two).
scope = "self_or_leader"
# Hooks are killed (with their process group) after this long.
hook_timeout = "5m"
# Bytes of a hook's stdout+stderr kept in the audit record.
hook_output_limit = "4KiB"

# A command per change kind (scheduled, started, updated, completed, canceled, ended = gone with
# an unknown outcome; see data.Outcome and data.Evidence): a list runs
# without a shell, a string runs with /bin/sh -c. The record is on stdin as JSON; the event is in
# SEFWD_EVENT_ID, SEFWD_EVENT_TYPE, SEFWD_EVENT_STATUS, SEFWD_EVENT_SOURCE, SEFWD_EVENT_RESOURCES,
# SEFWD_EVENT_NOT_BEFORE, SEFWD_EVENT_DURATION, SEFWD_EVENT_DESCRIPTION, SEFWD_CHANGE,
# SEFWD_AFFECTS_THIS_VM, SEFWD_RECORD_ID and SEFWD_RECORD_TYPE.
# [approval.hooks]
# scheduled = ["/usr/local/bin/drain.sh", "--graceful"]
# completed = "/usr/local/bin/undrain.sh"

# Rules: the first that matches an event decides; without rules nothing is approved
# automatically (events start at NotBefore). Every match key is optional (left out = any):
# event_type, event_source, event_status (a string or a list; case-sensitive IMDS values),
# duration_min / duration_max (DurationInSeconds, inclusive; an event without it never matches
# a duration bound), affects_this_vm (true/false), resources_min / resources_max (how many
# Resources), description (a Python regex, searched). action: approve, hold or ignore; approve
# may add delay ("30s": wait, re-check the event, then approve) and after_hooks (true: approve
# only if this change's hook exits 0). name (default "rules[<i>]") appears in the audit records.
# These four reproduce the advanced sample of Microsoft's Scheduled Events documentation:
# [[approval.rules]]
# name = "log-started"
# event_status = "Started"
# action = "ignore"
# [[approval.rules]]
# name = "user-initiated"
# event_source = "User"
# action = "approve"
# [[approval.rules]]
# name = "short-freeze"
# event_type = "Freeze"
# duration_min = 0
# duration_max = 8
# action = "approve"
# [[approval.rules]]
# name = "everything-else"
# action = "hold"
# Other match keys look like: resources_max = 1, affects_this_vm = true, event_type =
# ["Reboot", "Redeploy"], description = "Live Migration"; approve rules may add delay = "30s"
# or after_hooks = true.

# The signed remote-approval endpoint (off unless this table exists): POST /approvals with
# {"StartRequests":[{"EventId":"..."}]}, signed the Standard Webhooks way.
# [approval.callback]
# # host:port ("[::1]:8787" for IPv6); any address may be used, the signature protects it.
# listen = "127.0.0.1:8787"
# # An environment variable (or secret_file) holding whsec_... secrets; several, space-separated,
# # are all accepted (key rotation).
# secret_env = "SEFWD_CALLBACK_SECRET"
# # HTTPS: both or neither.
# tls_cert = "/etc/sefwd/tls.crt"
# tls_key = "/etc/sefwd/tls.key"
# # Larger request bodies are refused (413).
# max_body = "16KiB"
# # Requests per minute per client address (429 beyond).
# rate_limit = 30
# # Slow clients are dropped after this long.
# client_timeout = "5s"
# # Accepted clock difference of webhook-timestamp, both ways.
# tolerance = "5m"
'''
