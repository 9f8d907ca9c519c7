"""One human line per record on a terminal: what `sefwd check --pretty` and the stdout sink's
``pretty`` option print. It lives in the core so the CLI never imports a sink."""
from __future__ import annotations

import os
import re
from typing import Any

_FRACTION = re.compile(r"\.\d+(?=Z$|[+-]\d\d:\d\d$)")
_CONTROL = {c: " " for c in range(32)}
# Fields of approval.* / forwarder.* data that are context, not news, on a one-line summary.
_SKIPPED_FIELDS = frozenset({"Vm", "ApiVersion", "Extra"})


def _time(value: Any) -> str:
    """RFC 3339 without the fraction: second precision is plenty for a human line."""
    if not isinstance(value, str) or not value:
        return "-"
    return _FRACTION.sub("", value)


# Colour per record family on a terminal; https://no-color.org/ turns it off.
_COLOURS = {
    "scheduledevent.scheduled": "33", "scheduledevent.updated": "33", "scheduledevent.started": "1;31",
    "scheduledevent.completed": "32", "scheduledevent.canceled": "36", "approval.": "34", "forwarder.": "2",
}


def use_colour(stream: Any) -> bool:
    """Colour only on a terminal, and never when ``NO_COLOR`` is set (to anything) or TERM is dumb."""
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (OSError, ValueError):
        return False


def colourize(line: str, rtype: str) -> str:
    """``line`` in the colour of its record type (ANSI SGR)."""
    for prefix, code in _COLOURS.items():
        if rtype == prefix or (prefix.endswith(".") and rtype.startswith(prefix)):
            return f"\x1b[{code}m{line}\x1b[0m"
    return line


def as_text(value: Any) -> str:
    """A value as one line of text."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(as_text(v) for v in value) or "-"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}={as_text(v)}" for k, v in value.items()) + "}"
    return str(value).translate(_CONTROL)


def _scheduled_event(event: dict[str, Any], data: dict[str, Any]) -> list[str]:
    parts = [
        as_text(data.get("EventType")),
        as_text(data.get("EventId", event.get("subject"))),
        as_text(data.get("EventStatus")),
    ]
    if data.get("NotBefore"):
        parts.append(f"NotBefore {_time(data['NotBefore'])}")
    if data.get("Resources"):
        parts.append(f"Resources {as_text(data['Resources'])}")
    duration = data.get("DurationInSeconds")
    if isinstance(duration, (int, float)) and not isinstance(duration, bool) and duration > 0:
        parts.append(f"Duration {duration:g}s")
    if data.get("ChangedFields"):
        parts.append(f"Changed {as_text(data['ChangedFields'])}")
    if data.get("RemovalReason"):
        parts.append(f"Reason {as_text(data['RemovalReason'])}")
    evidence = data.get("Evidence")
    if data.get("Outcome") and isinstance(evidence, dict):
        used = evidence.get("Used")
        parts.append(f"Outcome {as_text(data['Outcome'])}" + (f" ({as_text(used)})" if used else ""))
    if data.get("Initial") is True:
        parts.append("(initial)")
    if data.get("AffectsThisVm") is True:
        parts.append("(this VM)")
    return parts


def _key_fields(data: dict[str, Any]) -> list[str]:
    parts = []
    for key, value in data.items():
        # Nulls, and an EventIds list that only repeats EventId, are noise on a human line.
        if key in _SKIPPED_FIELDS or isinstance(value, dict) or value is None:
            continue
        if key == "EventIds" and value == [data.get("EventId")]:
            continue
        # Ids in full: a person copies them into `sefwd approve`.
        parts.append(f"{key} {as_text(value)}")
    return parts


def render_pretty(event: dict[str, Any]) -> str:
    """One human-readable line for a CloudEvents record dict (never raises on odd input)."""
    if not isinstance(event, dict):
        return as_text(event)
    rtype = as_text(event.get("type"))
    data = event.get("data")
    parts = [_time(event.get("time")), rtype]
    if not isinstance(data, dict):
        if data is not None:
            parts.append(as_text(data))
    elif rtype.startswith("scheduledevent."):
        parts += _scheduled_event(event, data)
    else:
        # approval.* and forwarder.* (and any future family): its own scalar data fields, in order.
        parts += _key_fields(data) + _action(data)
    return "  ".join(parts)


def _action(data: dict[str, Any]) -> list[str]:
    """For an action's audit record: which hook, when it is due, and what it said (first line)."""
    parts = []
    action, hook = data.get("Action"), data.get("Hook")
    if isinstance(action, dict):
        if action.get("HookName"):
            parts.append(f"Hook {as_text(action['HookName'])}")
        if action.get("Due") and data.get("Outcome") == "planned":
            parts.append(f"Due {_time(action['Due'])}")
    if isinstance(hook, dict):
        if isinstance(hook.get("ExitCode"), int):
            parts.append(f"ExitCode {hook['ExitCode']}")
        output = next((line for line in str(hook.get("Output") or "").splitlines() if line.strip()), "")
        if output:
            parts.append(f"Output {as_text(output[:120])!r}")
    return parts
