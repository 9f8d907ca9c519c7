"""What the ``notify`` sink says: a short title and body per record, in words people read.

Default messages are built-in templates; a config's ``templates`` table overrides the title and/or body
per kind of record (``scheduled``, ``started``, ``updated``, ``completed``, ``canceled``, ``ended``,
``approval``, ``forwarder``) or for all of them (``default``). Every template, built-in or configured,
renders in jinja2's ``SandboxedEnvironment``: record fields are data, never template code (a
Description holding ``{{ ... }}`` prints as written), templates cannot reach Python internals, and in
``html`` format every value is HTML-escaped (in ``markdown`` format, ``<``, ``>`` and ``&`` are).

Imported only when a notify sink is configured (jinja2 comes with the ``[notify]`` extra).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import SandboxedEnvironment
from markupsafe import escape

FORMATS = ("text", "markdown", "html")
TEMPLATE_KINDS = ("default", "scheduled", "started", "updated", "completed", "canceled", "ended",
                  "approval", "protect", "forwarder")
TEMPLATE_PARTS = ("title", "body")
MAX_TITLE = 250
MAX_BODY = 4000

# What each EventType means for the VM, in words.
EVENT_WORDS: dict[str, tuple[str, str]] = {
    "Reboot": ("Reboot", "the VM restarts: memory is lost, disks are kept"),
    "Redeploy": ("Redeploy", "the VM moves to another host: it restarts and its temporary disk is lost"),
    "Freeze": ("Freeze", "the VM pauses for a few seconds; memory and connections are kept"),
    "Preempt": ("Spot eviction", "Azure takes the Spot VM back: it is deallocated or deleted"),
    "Terminate": ("Deletion", "the VM is deleted (scale-in or a delete request)"),
    "SpotRebalanceRecommendation": ("Spot eviction risk", "Azure warns that this Spot VM is at elevated risk of "
                                    "eviction: nothing happens yet (advisory, approving it has no effect)"),
}
EVIDENCE_WORDS = {
    "seen_started": "seen Started",
    "approval_accepted": "approved",
    "incarnation_jump": "the document moved past states not seen",
    "rebooted": "the VM rebooted",
    "paused": "the VM was paused",
    "gone_before_notbefore": "gone well before NotBefore",
    "no_approval": "not approved",
    "no_unseen_states": "no state missed",
    "no_reboot": "no reboot",
}
# Apprise notify types: how urgent each kind of record looks (colour, icon).
NOTIFY_TYPES = {"scheduled": "warning", "started": "warning", "updated": "info", "completed": "success",
                "canceled": "info", "ended": "warning"}

_EVENT_TITLE = "{{ what }} of {{ subject }}"
DEFAULTS: dict[str, dict[str, str]] = {
    "scheduled": {
        "title": _EVENT_TITLE + " scheduled {{ when_relative }}",
        "body": (
            "{{ what }} of {{ subject }} is scheduled{% if when_utc %} for {{ when_utc }} ({{ when_relative }}){% endif %}"
            ": {{ meaning }}."
            "{% if duration %} Expected impact: about {{ duration }}.{% endif %}\n"
            "{{ scope }}\n"
            "What to do: {{ action }}\n"
            "Event {{ event_id }} ({{ event_source }})."
        ),
    },
    "started": {
        "title": _EVENT_TITLE + " started",
        "body": (
            "{{ what }} of {{ subject }} started{% if when_utc %} (NotBefore was {{ when_utc }}){% endif %}: {{ meaning }}."
            "{% if duration %} Expected impact: about {{ duration }}.{% endif %}\n"
            "{{ scope }}\n"
            "The agent reports how it ends. Event {{ event_id }}."
        ),
    },
    "updated": {
        "title": _EVENT_TITLE + " changed",
        "body": (
            "{{ what }} of {{ subject }} changed: {{ changed }}."
            "{% if when_utc %} It is now due {{ when_utc }} ({{ when_relative }}).{% endif %}\n"
            "{{ scope }}\n"
            "Event {{ event_id }}."
        ),
    },
    "completed": {
        "title": _EVENT_TITLE + " completed",
        "body": (
            "{{ what }} of {{ subject }} completed.\n"
            "Evidence: {{ evidence }}.\n"
            "Nothing to do unless the workload did not come back. Event {{ event_id }}."
        ),
    },
    "canceled": {
        "title": _EVENT_TITLE + " canceled",
        "body": (
            "{{ what }} of {{ subject }} was canceled before it ran.\n"
            "Evidence: {{ evidence }}.\n"
            "Nothing to do; put the VM back in rotation if you took it out. Event {{ event_id }}."
        ),
    },
    "ended": {
        "title": _EVENT_TITLE + " ended (outcome unknown)",
        "body": (
            "{{ what }} of {{ subject }} left the Scheduled Events document; the agent cannot tell whether it ran"
            "{% if evidence != 'none' %} (evidence: {{ evidence }}){% endif %}.\n"
            "Check the VM and its workload. Event {{ event_id }}."
        ),
    },
    "approval": {
        "title": "Approval {{ data.Outcome }}{% if event_id %} for {{ event_id }}{% endif %} on {{ vm }}",
        "body": (
            "{{ data.Actor or 'the agent' }}: {{ data.Outcome }}"
            "{% if data.Reason %} ({{ data.Reason }}){% endif %}"
            "{% if data.Rule %}, rule {{ data.Rule }}{% endif %}."
            "{% if data.Detail %}\n{{ data.Detail }}{% endif %}"
        ),
    },
    "protect": {
        # This VM's hold ([protect]): out of service (entered), back (left), or protection that failed (missed).
        "title": "{% if kind_detail == 'missed' %}Protection FAILED{% elif kind_detail == 'entered' %}Out of service"
                 "{% else %}Back in service{% endif %}: {{ vm }}{% if data.EventIds %} "
                 "({{ data.EventIds | join(', ') }}){% endif %}",
        "body": (
            "{% if kind_detail == 'missed' %}{{ vm }} was not fully protected ({{ data.Reason }})."
            "{% elif kind_detail == 'entered' %}{{ vm }} left service for {{ data.EventIds | join(', ') }}"
            "{% if data.DrainSlackSeconds is not none %}, {{ data.DrainSlackSeconds | round | int }} s before NotBefore"
            "{% endif %}.{% else %}{{ vm }} is back in service after {{ data.EventIds | join(', ') }}.{% endif %}"
            "{% if data.DryRun %} (dry run: nothing was run){% endif %}"
            "{% if data.Detail %}\n{{ data.Detail }}{% endif %}"
            "{% if kind_detail == 'missed' %}\nCheck the workload on {{ vm }} now.{% endif %}"
        ),
    },
    "forwarder": {
        "title": "sefwd on {{ vm }}: {{ kind_detail | replace('_', ' ') }}",
        "body": (
            "The scheduled-events forwarder on {{ vm }} reports {{ kind_detail | replace('_', ' ') }} at {{ time_utc }}."
            "{% if data.Reason %}\nReason: {{ data.Reason }}{% endif %}"
            "{% if data.Detail %}\n{{ data.Detail }}{% endif %}"
        ),
    },
}
_ACTIONS = {
    "Freeze": "usually nothing; latency-sensitive work may want to pause. To let it start now: `sefwd approve {id}` on the VM.",
    "SpotRebalanceRecommendation": ("checkpoint work and move what you can to other capacity while there is time; "
                                    "approving this event has no effect (the eviction, if it comes, is a Preempt)."),
}
_DEFAULT_ACTION = ("take the VM out of rotation and finish or checkpoint work before then. When it is ready, "
                   "`sefwd approve {id}` on the VM lets it start at once.")


def relative(moment: datetime | None, now: datetime) -> str:
    """``in 4 min``, ``2 h 5 min ago``, ``now``; empty for None."""
    if moment is None:
        return ""
    seconds = round((moment - now).total_seconds())
    ahead, left = seconds > 0, abs(seconds)
    if left < 5:
        return "now"
    if left < 60:
        text = f"{left} s"
    elif left < 3600:
        text = f"{round(left / 60)} min"
    else:
        hours, minutes = divmod(round(left / 60), 60)
        text = f"{hours} h" + (f" {minutes} min" if minutes else "")
    return f"in {text}" if ahead else f"{text} ago"


def _parse_time(value: Any) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
        moment = (moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)).astimezone(timezone.utc)
    except (ValueError, OverflowError):
        return None
    return moment if 1970 <= moment.year <= 9998 else None  # a damaged time is no time, not an overflow


def _utc(moment: datetime | None) -> str:
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC") if moment else ""


def _duration(seconds: Any) -> str:
    if not isinstance(seconds, int) or isinstance(seconds, bool) or seconds <= 0:
        return ""
    return f"{seconds} s" if seconds < 120 else f"{round(seconds / 60)} min"


def record_kind(record_type: str) -> str:
    """The template kind of a record type: its change for scheduled events, else its family."""
    family, _, rest = record_type.partition(".")
    return rest if family == "scheduledevent" else family


def notify_type(record_type: str, data: Mapping[str, Any]) -> str:
    """Apprise's notify type (info / success / warning / failure) for a record."""
    family, _, rest = record_type.partition(".")
    if family == "scheduledevent":
        return NOTIFY_TYPES.get(rest, "info")
    if family == "approval":
        return "success" if rest == "approved" else "failure" if rest in ("refused", "failed") else "info"
    if family == "protect":
        return "failure" if rest == "missed" else "success" if rest == "left" else "warning"
    return "failure" if rest == "data_lost" else "warning" if rest == "stopped" else "info"


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _texts(value: Any) -> list[str]:
    """The strings of a list (a stored record may hold anything where a list of strings belongs)."""
    return [str(v) for v in value if isinstance(v, str | int) and not isinstance(v, bool)] if isinstance(value, list) else []


def _text(value: Any, default: str = "") -> str:
    return value if isinstance(value, str) and value else default


def context(event: Mapping[str, Any], now: datetime) -> dict[str, Any]:
    """Everything a template may use, worked out from the record (``record``, ``data`` and the words)."""
    data = _mapping(event.get("data"))
    vm_data = _mapping(data.get("Vm"))
    vm = _text(vm_data.get("Name")) or _text(vm_data.get("ComputerName")) or _text(event.get("source"), "this VM")
    event_type = _text(data.get("EventType"))
    what, meaning = EVENT_WORDS.get(event_type, (event_type or "Event", "see the event's Description"))
    not_before = _parse_time(data.get("NotBefore"))
    event_id = _text(data.get("EventId"))
    resources = _texts(data.get("Resources"))
    affects = data.get("AffectsThisVm") if isinstance(data.get("AffectsThisVm"), bool) else None
    shown = ", ".join(resources[:3]) + (f" and {len(resources) - 3} more" if len(resources) > 3 else "")
    if affects is False:
        subject = shown or "other VMs"
        scope = f"Reported by {vm}, which it does not affect."
    elif len(resources) > 1:
        subject = vm
        scope = f"It affects {len(resources)} VMs: {', '.join(resources)}."
    else:
        subject = vm
        scope = f"It affects {vm}."
    used = [EVIDENCE_WORDS.get(u, u) for u in _texts(_mapping(data.get("Evidence")).get("Used"))]
    record_type = _text(event.get("type"))
    return {
        "record": event,
        "data": data,
        "kind": record_kind(record_type),
        "kind_detail": record_type.partition(".")[2] or record_type,
        "vm": vm,
        "subject": subject,
        "event_id": event_id,
        "event_type": event_type,
        "event_source": _text(data.get("EventSource"), "Platform"),
        "what": what,
        "meaning": meaning,
        "when_utc": _utc(not_before),
        "when_relative": relative(not_before, now),
        "time_utc": _utc(_parse_time(event.get("time"))),
        "duration": _duration(data.get("DurationInSeconds")),
        "scope": scope,
        "action": _ACTIONS.get(event_type, _DEFAULT_ACTION).format(id=event_id),
        "changed": ", ".join(_texts(data.get("ChangedFields"))) or "details",
        "outcome": _text(data.get("Outcome")),
        "evidence": ", ".join(used) or "none",
        "affects_this_vm": affects,
    }


@dataclass(frozen=True)
class Message:
    title: str
    body: str
    notify_type: str


class MessageRenderer:
    """Compiles the templates once (``TemplateError`` on a bad one) and renders records with them."""

    def __init__(self, templates: Mapping[str, Mapping[str, str]] | None, fmt: str = "text",
                 clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc)) -> None:
        self.format = fmt
        self._clock = clock
        env = SandboxedEnvironment(autoescape=fmt == "html", finalize=_markdown_safe if fmt == "markdown" else None,
                                   keep_trailing_newline=False)
        self._builtin = {kind: {part: env.from_string(text) for part, text in parts.items()}
                         for kind, parts in DEFAULTS.items()}
        self._custom = {kind: {part: env.from_string(str(text)) for part, text in parts.items()}
                        for kind, parts in (templates or {}).items()}

    def _template(self, kind: str, part: str) -> Any:
        for table in (self._custom.get(kind), self._custom.get("default"), self._builtin.get(kind)):
            if table and part in table:
                return table[part]
        return self._builtin["forwarder"][part]

    def render(self, event: Mapping[str, Any]) -> Message:
        """Title and body for one record; a failing configured template falls back to the built-in one."""
        values = context(event, self._clock())
        kind = values["kind"]
        out = {}
        for part, limit in (("title", MAX_TITLE), ("body", MAX_BODY)):
            try:
                text = self._template(kind, part).render(values)
            except TemplateError:
                builtin = self._builtin.get(kind) or self._builtin["forwarder"]
                text = builtin[part].render(values)
            text = text.strip()
            out[part] = text if len(text) <= limit else text[: limit - 1] + "…"
        return Message(out["title"], out["body"], notify_type(str(event.get("type") or ""), values["data"]))


def _markdown_safe(value: Any) -> Any:
    """Markdown targets turn HTML into HTML: values are escaped so a field cannot add markup."""
    return str(escape(value)) if isinstance(value, str) else value


def template_problems(templates: Any) -> list[str]:
    """Every problem with a ``templates`` table (unknown kinds or parts, syntax errors); never raises."""
    if templates is None:
        return []
    if not isinstance(templates, Mapping):
        return [f"option 'templates' must be a table of kinds ({', '.join(TEMPLATE_KINDS)}), got {type(templates).__name__}"]
    problems = []
    env = SandboxedEnvironment()
    for kind, parts in templates.items():
        if kind not in TEMPLATE_KINDS:
            problems.append(f"option 'templates': unknown kind {kind!r} (known: {', '.join(TEMPLATE_KINDS)})")
            continue
        if not isinstance(parts, Mapping):
            problems.append(f"option 'templates.{kind}' must be a table with title and/or body")
            continue
        for part, text in parts.items():
            if part not in TEMPLATE_PARTS:
                problems.append(f"option 'templates.{kind}': unknown key {part!r} (known: title, body)")
            elif not isinstance(text, str):
                problems.append(f"option 'templates.{kind}.{part}' must be a string")
            else:
                try:
                    env.parse(text)
                except TemplateError as exc:
                    line = getattr(exc, "lineno", None)
                    problems.append(f"option 'templates.{kind}.{part}': template error"
                                    f"{f' on line {line}' if line else ''}: {exc.message or exc}")
    return problems
