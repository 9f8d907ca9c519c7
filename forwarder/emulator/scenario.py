"""Scenario files (TOML): a timeline of schedule/approve/start/update/cancel/complete/fault/end steps."""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from typing import Any

from forwarder.common.compat import tomllib
from forwarder.emulator.faults import FAULT_KEYS, Fault
from forwarder.emulator.model import (
    SPEC_KEYS, UPDATE_KEYS, SpecError, VmProfile, normalize_spec, parse_not_before,
)
from forwarder.errors import ConfigError
from forwarder.common.values import parse_duration

ACTIONS = ("schedule", "approve", "start", "update", "cancel", "complete", "fault", "end")
TOP_KEYS = frozenset({"name", "description", "vms", "first_call_delay", "terminate_notice", "steps"})


class ScenarioError(ConfigError):
    """A scenario file is invalid; lists every problem found."""


@dataclass(frozen=True)
class Step:
    """One timeline step: ``action`` at ``at`` real seconds after the scenario starts."""

    at: float
    action: str
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Scenario:
    """A parsed scenario; steps sorted by time (stable for equal times)."""

    name: str
    description: str = ""
    vms: tuple[VmProfile, ...] = ()
    first_call_delay: float | None = None
    terminate_notice: float | None = None
    steps: tuple[Step, ...] = ()

    @property
    def event_ids(self) -> list[str]:
        return [s.args["id"] for s in self.steps if s.action == "schedule" and "id" in s.args]


def _step(index: int, raw: object, problems: list[str]) -> Step | None:
    where = f"steps[{index}]"
    if not isinstance(raw, dict):
        problems.append(f"{where}: must be a table")
        return None
    raw = dict(raw)
    action = raw.pop("action", None)
    at_raw = raw.pop("at", None)
    if action not in ACTIONS:
        problems.append(f"{where}: action must be one of {', '.join(ACTIONS)}, got {action!r}")
        return None
    try:
        at = parse_duration(at_raw if at_raw is not None else 0)
    except ValueError as exc:
        problems.append(f"{where}: at: {exc}")
        return None
    try:
        if action == "schedule":
            args = normalize_spec(raw, allowed=SPEC_KEYS)
        elif action == "update":
            event_id = raw.pop("id", None)
            args = normalize_spec(raw, allowed=UPDATE_KEYS)
            if not isinstance(event_id, str):
                raise SpecError("update needs the id of the event")
            if not args:
                raise SpecError("update needs at least one field to change")
            args["id"] = event_id
        elif action in ("start", "cancel", "complete"):
            if set(raw) != {"id"} or not isinstance(raw["id"], str):
                raise SpecError(f"{action} takes exactly one key, id (the EventId)")
            args = raw
        elif action == "approve":
            if not isinstance(raw.get("id"), str) or not set(raw) <= {"id", "vm"} or not isinstance(
                    raw.get("vm", ""), str):
                raise SpecError("approve takes id (the EventId) and optionally vm (who POSTs StartRequests)")
            args = raw
        elif action == "fault":
            Fault.from_spec(raw)  # validate now, build a fresh one each run
            args = {k: v for k, v in raw.items() if k in FAULT_KEYS}
        else:
            if raw:
                raise SpecError("end takes no keys")
            args = {}
        if "not_before" in args and "start_after" in args:
            raise SpecError("give not_before or start_after (NotBefore = now + start_after), not both")
        if "not_before" in args:
            parse_not_before(args["not_before"], datetime.now(timezone.utc))
    except SpecError as exc:
        problems.append(f"{where} ({action}): {exc}")
        return None
    return Step(at=at, action=action, args=args)


def parse_scenario(data: dict[str, Any], *, default_name: str = "scenario") -> Scenario:
    """Validate a scenario table (already decoded from TOML)."""
    problems: list[str] = []
    unknown = set(data) - TOP_KEYS
    if unknown:
        problems.append(f"unknown top-level keys {sorted(unknown)} (allowed: {', '.join(sorted(TOP_KEYS))})")
    name = data.get("name", default_name)
    if not isinstance(name, str) or not name:
        problems.append("name must be a non-empty string")
        name = default_name
    description = data.get("description", "")
    if not isinstance(description, str):
        problems.append("description must be a string")
        description = ""
    vms: list[VmProfile] = []
    raw_vms = data.get("vms", [])
    if not isinstance(raw_vms, list):
        problems.append("vms must be a list of names or tables")
        raw_vms = []
    for i, raw in enumerate(raw_vms):
        try:
            vms.append(VmProfile.from_spec(raw))
        except (SpecError, TypeError) as exc:
            problems.append(f"vms[{i}]: {exc}")
    timings: dict[str, float | None] = {}
    for key in ("first_call_delay", "terminate_notice"):
        try:
            timings[key] = parse_duration(data[key]) if key in data else None
        except ValueError as exc:
            problems.append(f"{key}: {exc}")
    raw_steps = data.get("steps", [])
    if not isinstance(raw_steps, list):
        problems.append("steps must be an array of tables ([[steps]])")
        raw_steps = []
    steps = [s for i, raw in enumerate(raw_steps) if (s := _step(i, raw, problems)) is not None]
    steps.sort(key=lambda s: s.at)
    scheduled: set[str] = set()
    for s in steps:
        if s.action == "schedule" and "id" in s.args:
            if s.args["id"] in scheduled:
                problems.append(f"event {s.args['id']} is scheduled twice")
            scheduled.add(s.args["id"])
        elif s.action in ("approve", "start", "update", "cancel", "complete") and s.args["id"] not in scheduled:
            problems.append(f"{s.action} at {s.at:g}s names event {s.args['id']!r} that no earlier step schedules")
    if problems:
        raise ScenarioError([f"scenario {name}: {p}" for p in problems])
    return Scenario(name=name, description=description, vms=tuple(vms),
                    first_call_delay=timings.get("first_call_delay"),
                    terminate_notice=timings.get("terminate_notice"), steps=tuple(steps))


def _builtin_dir() -> Any:
    return resources.files("forwarder.emulator").joinpath("scenarios")


def builtin_scenarios() -> list[str]:
    """Names of the scenarios shipped with the package."""
    return sorted(p.name[:-5] for p in _builtin_dir().iterdir() if p.name.endswith(".toml"))


def load_scenario(name_or_path: str | Path | Scenario) -> Scenario:
    """A built-in scenario by name, or a scenario TOML file by path."""
    if isinstance(name_or_path, Scenario):
        return name_or_path
    text: str | None = None
    default_name = str(name_or_path)
    path = Path(name_or_path)
    if isinstance(name_or_path, str) and name_or_path in builtin_scenarios():
        text = _builtin_dir().joinpath(f"{name_or_path}.toml").read_text(encoding="utf-8")
    elif path.is_file():
        text = path.read_text(encoding="utf-8")
        default_name = path.stem
    else:
        raise ScenarioError([f"no scenario {name_or_path!r}: not a file, and the built-in scenarios are "
                             + ", ".join(builtin_scenarios())])
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError([f"scenario {default_name}: invalid TOML: {exc}"]) from None
    return parse_scenario(data, default_name=default_name)
