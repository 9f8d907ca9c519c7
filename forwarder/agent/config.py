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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forwarder.approval.config import parse_approval
from forwarder.approval.settings import ApprovalConfig
from forwarder.common.compat import tomllib
from forwarder.protect.settings import ProtectConfig, parse_protect
from forwarder.common.connection_strings import appinsights_problems
from forwarder.delivery.filters import RecordFilter, filter_for
from forwarder.errors import ConfigError
from forwarder.common.listen import parse_listen
from forwarder.common.logs import redact
from forwarder.common.signing import load_secret
from forwarder.common.values import (
    boolean, choice, control_characters, duration, format_duration, parse_duration, parse_labelled, size,
    suggest, url_text,
)
from forwarder.imds.event_types import EVENT_TYPES
from forwarder.imds.client import MAX_BODY, MAX_BODY_LIMIT, MIN_BODY_LIMIT, check_max_body, validate_endpoint

SYSTEM_CONFIG_PATH = Path("/etc/sefwd/config.toml")
DEFAULTS_SOURCE = "built-in defaults"
ENV_PREFIX = "SEFWD_"

# "auto" (the default): 2024-07-09 where IMDS serves it, else 2020-07-01 (forwarder.imds.versions).
SUPPORTED_API_VERSIONS: tuple[str, ...] = (
    "auto", "2017-03-01", "2017-08-01", "2017-11-01", "2019-01-01", "2019-04-01", "2019-08-01", "2020-07-01",
    "2024-07-09",
)
LOG_LEVELS: tuple[str, ...] = ("debug", "info", "warning", "error")
# Sink types whose SDK ships as a pip extra of the same name.
SINK_EXTRAS: dict[str, str] = {"eventhubs": "eventhubs", "loganalytics": "loganalytics", "appinsights": "appinsights",
                               "eventgrid": "eventgrid", "notify": "notify"}
# IMDS throttles above 5 requests per second per VM; polls take at most 2 of them, leaving room
# for approvals, instance metadata and managed-identity tokens.
MIN_POLL_INTERVAL = 0.5
MAX_POLL_INTERVAL = 3600.0
# The sink name becomes a directory under the state dir, so it must stay one plain path part.
_SINK_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_API_VERSION = re.compile(r"^\d{4}-\d{2}-\d{2}(-preview)?$")
_SECRET_WORDS = ("secret", "key", "password", "connection_string", "token", "authorization", "credential",
                 "urls")  # notify: Apprise URLs embed tokens

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
    max_body: int = MAX_BODY  # answers above this are refused unread (forwarder.imds.client)


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
    heartbeat_file: Path | None = None  # the Azure VM extension's liveness file (forwarder.agent.extension_heartbeat)
    # This VM's record key (whsec_, derived from the fleet master: `sefwd keys derive`): records get sefwdauth.
    record_key_env: str | None = None
    record_key_file: str | None = None
    record_key: bytes | None = field(default=None, repr=False)
    status_interval: float = 5.0  # a changed status report is written within this many seconds
    degraded_after: float = 30.0  # a sink failing longer (or dead-lettering) makes the agent degraded


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
class ProbeConfig:
    """The maintenance probe (forwarder.agent.probe) and state file: off unless listen or state_file is set."""

    listen: tuple[str, int] | None = None
    path: str = "/maintenance"
    event_types: tuple[str, ...] | None = ("Reboot", "Redeploy", "Preempt", "Terminate")  # None: every type
    lead: float | None = None  # None: 503 from the moment an event is Scheduled; else from NotBefore - lead
    settle: float = 30.0
    state_file: Path | None = None  # None: the default path when the probe listens (forwarder.agent.maintenance)

    @property
    def enabled(self) -> bool:
        return self.listen is not None or self.state_file is not None


@dataclass(frozen=True)
class SinkConfig:
    """One configured sink; ``options`` holds every key but the common ones (type, name, max_age)."""

    type: str
    name: str
    options: Mapping[str, Any]
    max_age: float | None = None  # older undelivered records go to dead letters; None = never
    filter: RecordFilter | None = None  # which records this sink is sent (forwarder.delivery.filters); None = all


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
    probe: ProbeConfig = ProbeConfig()
    protect: ProtectConfig | None = None  # [protect]: this VM's hold (forwarder.protect); None: not configured


# -- value parsers: raw TOML value or env string -> parsed value, or ValueError ------------------
# Bounds and units come from the one toolkit (forwarder.common.values); these add the config's own kinds.

def _string(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {value!r}")
    return value


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
    return parse_listen(value, bare_port_host="127.0.0.1")


def _optional_file(value: Any) -> Path | None:
    text = _string(value).strip()
    return Path(text).expanduser() if text else None


def _optional_text(value: Any) -> str | None:
    """A name or path, "" meaning unset."""
    text = _string(value).strip()
    return text or None


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


def _probe_listen(value: Any) -> tuple[str, int]:
    # The load balancer probes the VM's own address: the host is always written out.
    return parse_listen(value)


def _probe_path(value: Any) -> str:
    text = _string(value).strip()
    if not text.startswith("/") or len(text) > 256 or control_characters(text) or "?" in text or "#" in text:
        raise ValueError(f"expected a URL path such as \"/maintenance\" (at most 256 characters, no spaces, "
                         f"query or fragment), got {value!r}")
    return text


_EVENT_TYPES = EVENT_TYPES


def _probe_event_types(value: Any) -> tuple[str, ...] | None:
    items = [v.strip() for v in value.split(",")] if isinstance(value, str) else value
    if not isinstance(items, list | tuple) or not items or not all(isinstance(v, str) and v for v in items):
        raise ValueError(f"expected a list of event types such as [\"Reboot\", \"Preempt\"] (or [\"*\"] for all), "
                         f"got {value!r}")
    if "*" in items:
        return None
    wrong = [f"{v!r}{suggest(v, _EVENT_TYPES)}" for v in items if v not in _EVENT_TYPES]
    if wrong:
        raise ValueError(f"unknown event type(s) {', '.join(wrong)}: use {', '.join(_EVENT_TYPES)} or \"*\"")
    return tuple(dict.fromkeys(items))


def _probe_lead(value: Any) -> float | None:
    if isinstance(value, str) and value.strip().lower() in ("", "scheduled"):
        return None
    return duration(0.0, 30 * 86400.0)(value)


@dataclass(frozen=True)
class _Key:
    default: Any  # raw value, run through ``parse`` like any other; None = computed
    parse: Callable[[Any], Any]


# The one place that says which flat sections and keys exist, with each key's limits (documented
# in docs/config-and-secrets.md); [approval] is nested (forwarder.approval.config).
DAY = 86400.0
SECTIONS: dict[str, dict[str, _Key]] = {
    "imds": {
        "endpoint": _Key("http://169.254.169.254", validate_endpoint),  # the IMDS client's own rules
        "api_version": _Key("auto", _api_version),
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
        "record_key_env": _Key("", _optional_text),
        "record_key_file": _Key("", _optional_text),
        "status_interval": _Key("5s", duration(0.05, 300.0)),
        # A sink failing this long (or dead-lettering) makes the agent degraded: 30 s is the Spot notice.
        "degraded_after": _Key("30s", duration(0.0, DAY, low_inclusive=False)),
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
    "probe": {
        "listen": _Key(None, _probe_listen),
        "path": _Key("/maintenance", _probe_path),
        "event_types": _Key(["Reboot", "Redeploy", "Preempt", "Terminate"], _probe_event_types),
        "lead": _Key("scheduled", _probe_lead),
        "settle": _Key("30s", duration(0.0, 86400.0)),
        "state_file": _Key(None, _optional_file),
    },
}
# Pairs of keys (section, low key, high key) whose values must be ordered: low <= high.
ORDERED_KEYS: tuple[tuple[str, str, str, Callable[[Any], str]], ...] = (
    ("delivery", "retry_initial", "retry_max", format_duration),
)
MAX_SINK_AGE = 365 * DAY
# Nested tables with their own parsers, beside the flat SECTIONS.
_NESTED = ("sinks", "approval", "protect")
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
        given = {key: raw[section].get(key, (spec.default, "default")) for key, spec in keys.items()}
        parsed[section] = parse_labelled({key: spec.parse for key, spec in keys.items()},
                                         {key: pair for key, pair in given.items() if pair[0] is not None}, problems)
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


SINK_COMMON_KEYS = ("type", "name", "max_age", "filter")


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
        record_filter, filter_problems = filter_for(type_name, entry.get("filter"), f"sinks[{index}] ({name})")
        problems.extend(filter_problems)
        sink = SinkConfig(type=type_name, name=name, options=options, max_age=max_age, filter=record_filter)
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
    protect, protect_problems = parse_protect(data.get("protect"), env)
    problems.extend(protect_problems)
    approval, approval_problems = parse_approval(data.get("approval", {}), env, base_dir, protect="protect" in data)
    problems.extend(approval_problems)
    problems.extend(_telemetry_problems(parsed["telemetry"], env))
    try:
        parsed["agent"]["record_key"] = load_secret(parsed["agent"], env=env, prefix="record_key")
    except ConfigError as exc:
        problems.extend(f"[agent] {p}" for p in exc.problems)
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
        probe=ProbeConfig(**parsed["probe"]),
        protect=protect,
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
    chosen, data = read_config_file(path, env, system_path)
    if chosen is None:
        return parse_config({}, env, DEFAULTS_SOURCE, check_sinks=check_sinks)
    return parse_config(data, env, str(chosen), check_sinks=check_sinks)


def read_config_file(
    path: str | os.PathLike[str] | None, env: Mapping[str, str], system_path: Any = _USE_SYSTEM_PATH,
) -> tuple[Path | None, dict[str, Any]]:
    """The config file ``load_config`` would read and its TOML (None and {} for the built-in defaults)."""
    if system_path is _USE_SYSTEM_PATH:
        system_path = SYSTEM_CONFIG_PATH
    if path is not None:
        chosen = Path(path)
        named_by = "given with --config"
    elif env.get("SEFWD_CONFIG"):
        chosen = Path(env["SEFWD_CONFIG"])
        named_by = "named by SEFWD_CONFIG"
    elif system_path is not None and Path(system_path).is_file():
        chosen = Path(system_path)
        named_by = "system config"
    else:
        return None, {}
    chosen = chosen.expanduser()
    return chosen, _read_toml(chosen, named_by)


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
    if isinstance(value, str):  # as TOML writes it ("..."), not as Python's repr ('...')
        import json

        return json.dumps(redact(value), ensure_ascii=False)
    return str(value)


def _sink_option_texts(sink: SinkConfig, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Options shown by what they name, never their value: ``secret_env=SEFWD_X (set)``, a sink's own texts."""
    env = os.environ if env is None else env
    texts = {k: f"{v} ({'set' if env.get(v, '').strip() else 'not set'})"
             for k, v in sink.options.items() if k.endswith("_env") and isinstance(v, str)}
    texts.update({k: f"{v}" for k, v in sink.options.items() if k.endswith("_file") and isinstance(v, str)})
    try:
        from forwarder.sinkapi import load_sink_factory

        own = getattr(load_sink_factory(sink.type), "describe_options", None)
        if callable(own):
            texts.update(own(sink.options))
    except Exception:  # noqa: BLE001 - a description must not fail the check that already passed
        pass
    return texts


def _hook_scope_notes(config: Config) -> list[str]:
    """[protect] in one line, and which per-change hooks run only for this VM's events (the default)."""
    from forwarder.protect.settings import describe as describe_protect

    lines = []
    own = [kind for kind, spec in config.approval.hooks.items() if spec.affects_this_vm]
    if own:
        lines.append(f"  hooks {', '.join(own)} run only for events whose Resources name this VM (or name none): "
                     "affects_this_vm = true, the default; set affects_this_vm = false on a hook to run it for "
                     "every VM's events")
    return lines + ([describe_protect(config.protect)] if config.protect is not None else [])


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
        f"{format_duration(agent.drain_timeout)}, records "
        f"{'authenticated (sefwdauth)' if agent.record_key else 'not authenticated (no record key)'}",
        f"sinks ({len(config.sinks)}):",
    ]
    for sink in config.sinks:
        shown = _sink_option_texts(sink)
        options = ", ".join(f"{k}={shown.get(k) or _show(k, v)}" for k, v in sink.options.items())
        lines.append(f"  {sink.name} (type {sink.type})" + (f": {options}" if options else ""))
        if sink.filter is not None:
            lines.append(f"    filter: {sink.filter.describe()}")
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
        + (", DRY RUN (nothing is performed)" if approval.dry_run else "")
    )
    lines.extend(_hook_scope_notes(config))
    telemetry = config.telemetry
    if telemetry.enabled:
        where = f"{telemetry.listen[0]}:{telemetry.listen[1]}" if telemetry.listen else "off"
        source = (f"env {telemetry.connection_string_env}" if telemetry.connection_string_env
                  else f"file {telemetry.connection_string_file}" if telemetry.connection_string_file else "off")
        lines.append(f"telemetry: /metrics and /healthz on {where}, Azure Monitor export {source} "
                     f"(every {format_duration(telemetry.export_interval)}), unhealthy after "
                     f"{format_duration(telemetry.unhealthy_after)} of IMDS failures")
    probe = config.probe
    if probe.enabled:
        where = f"{probe.listen[0]}:{probe.listen[1]}{probe.path}" if probe.listen else "off"
        window = "from Scheduled" if probe.lead is None else f"from NotBefore - {format_duration(probe.lead)}"
        lines.append(f"probe: {where}, types {', '.join(probe.event_types or ['*'])}, 503 {window} until "
                     f"{format_duration(probe.settle)} after the end; state file {probe.state_file or 'default'}")
    return "\n".join(lines)
