"""The ``[protect]`` table: the commands that take this VM out of service and bring it back, and when."""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from forwarder.approval.config import parse_at
from forwarder.common.values import duration, suggest

KNOWN_TYPES = ("Freeze", "Reboot", "Redeploy", "Preempt", "Terminate")
# A Freeze pauses the VM for seconds and keeps its memory: not worth a drain unless asked for.
DEFAULT_TYPES = ("Reboot", "Redeploy", "Preempt", "Terminate")
PROTECT_KEYS = ("enter", "leave", "at", "event_types", "settle", "deadline_margin", "timeout", "hook_env")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class ProtectConfig:
    """When this VM is held (events of ``event_types`` naming it) and what runs on the way out and back."""

    enter: tuple[str, ...] | str  # argv (run directly) or a shell string (/bin/sh -c)
    leave: tuple[str, ...] | str | None = None
    at: float | None = None  # enter not earlier than NotBefore - at; None: as soon as the event is seen
    event_types: tuple[str, ...] | None = DEFAULT_TYPES  # None: every type, future ones too
    settle: float = 30.0  # the hold is left this long after its last event ended
    deadline_margin: float = 5.0  # enter must be over this long before NotBefore
    timeout: float = 3600.0  # no transition runs longer (an event without NotBefore has no other bound)
    hook_env: tuple[str, ...] = ()  # variables the commands inherit beside [approval] hook_env

    def wants(self, event_type: str | None) -> bool:
        return self.event_types is None or (event_type or "") in self.event_types


def _command(value: Any) -> tuple[str, ...] | str:
    if isinstance(value, str) and value.strip():
        return value
    if isinstance(value, list) and value and all(isinstance(a, str) for a in value) and value[0].strip():
        return tuple(value)
    raise ValueError(f"expected a command string (run with /bin/sh -c) or a non-empty list of strings "
                     f"(run without a shell), got {value!r}")


def _event_types(value: Any) -> tuple[str, ...] | None:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f'expected a list of event types such as ["Reboot", "Preempt"] (or ["*"] for all), got {value!r}')
    if "*" in value:
        return None
    wrong = [f"{v!r}{suggest(v, KNOWN_TYPES)}" for v in value if v not in KNOWN_TYPES]
    if wrong:
        raise ValueError(f"unknown event type(s) {', '.join(wrong)}: use {', '.join(KNOWN_TYPES)} or \"*\"")
    return tuple(dict.fromkeys(value))


def _hook_env(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(n, str) and _ENV_NAME.match(n) for n in value):
        raise ValueError(f"expected a list of environment variable names, got {value!r}")
    return tuple(value)


_PARSERS: dict[str, Callable[[Any], Any]] = {
    "enter": _command,
    "leave": _command,
    "at": parse_at,  # the same "notbefore - 5m" as the hooks and rules
    "event_types": _event_types,
    "settle": duration(0.0, 86400.0),
    "deadline_margin": duration(0.0, 3600.0),
    "timeout": duration(0.0, 86400.0, low_inclusive=False),
    "hook_env": _hook_env,
}


ENV_PREFIX = "SEFWD_PROTECT_"
ENV_KEYS = ("at", "settle", "deadline_margin", "timeout")  # the commands and lists come from the file only


def parse_protect(raw: Any, env: Mapping[str, str] | None = None) -> tuple[ProtectConfig | None, list[str]]:
    """Validate ``[protect]`` plus ``SEFWD_PROTECT_<KEY>`` overrides; returns (config or None when absent
    or wrong, every problem)."""
    problems: list[str] = []
    overrides: dict[str, tuple[Any, str]] = {}
    for var in sorted(env or {}):
        if not var.startswith(ENV_PREFIX):
            continue
        key = var[len(ENV_PREFIX):].lower()
        if key not in ENV_KEYS:
            names = [f"{ENV_PREFIX}{k.upper()}" for k in ENV_KEYS]
            problems.append(f"unknown environment variable {var}: [protect] has no overridable key {key!r}"
                            f"{suggest(var, names)}")
        elif (env or {})[var] != "":  # empty means unset, as elsewhere
            overrides[key] = ((env or {})[var], f"environment {var}")
    if raw is None:
        if overrides:
            problems.append(f"{', '.join(v[1] for v in overrides.values())}: set, but there is no [protect] table")
        return None, problems
    if not isinstance(raw, Mapping):
        return None, problems + [f"protect must be a table ([protect]), got {raw!r}"]
    for key in raw:
        if key not in PROTECT_KEYS:
            problems.append(f"unknown key protect.{key}{suggest(str(key), PROTECT_KEYS)}")
    given: dict[str, tuple[Any, str]] = {k: (raw[k], f"protect.{k}") for k in _PARSERS if k in raw}
    given.update(overrides)
    values: dict[str, Any] = {}
    for key, parse in _PARSERS.items():
        if key in given:
            value, label = given[key]
            try:
                values[key] = parse(value)
            except ValueError as exc:
                problems.append(f"{label}: {exc}")
    if "enter" not in raw:
        # A leave alone would undo what nothing did.
        problems.append('protect: missing \'enter\' (the command taking this VM out of service, e.g. '
                        'enter = ["/usr/local/lib/sefwd/k8s-drain.sh"])')
    if problems:
        return None, problems
    return ProtectConfig(**values), problems


def describe(config: ProtectConfig) -> str:
    """One line for ``sefwd config check``."""
    from forwarder.approval.hooks import describe_command
    from forwarder.common.values import format_duration

    when = "as soon as an event is seen" if config.at is None else f"from NotBefore - {format_duration(config.at)}"
    leave = describe_command(config.leave) if config.leave is not None else "nothing"
    return (f"protect: this VM's hold for {', '.join(config.event_types or ['*'])} events naming it (or naming none): "
            f"enter {describe_command(config.enter)} {when}, over {format_duration(config.deadline_margin)} before "
            f"NotBefore; leave {leave} {format_duration(config.settle)} after the last event ended")
