"""A faithful Azure IMDS emulator (Scheduled Events, instance compute, managed identity) for tests and demos.

The names below are loaded on first use (PEP 562), so that ``sefwd`` commands that only register the
``emulator`` subcommand do not import the server and the scenarios.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from forwarder.emulator.faults import FAULT_KINDS, Fault
    from forwarder.emulator.model import SE_VERSIONS, Event, SpecError, VmProfile
    from forwarder.emulator.scenario import (Scenario, ScenarioError, Step, builtin_scenarios, load_scenario,
                                             parse_scenario)
    from forwarder.emulator.server import Emulator

_WHERE = {
    "FAULT_KINDS": "faults", "Fault": "faults",
    "SE_VERSIONS": "model", "Event": "model", "SpecError": "model", "VmProfile": "model",
    "Scenario": "scenario", "ScenarioError": "scenario", "Step": "scenario", "builtin_scenarios": "scenario",
    "load_scenario": "scenario", "parse_scenario": "scenario",
    "Emulator": "server",
}

__all__ = [
    "FAULT_KINDS", "SE_VERSIONS", "Emulator", "Event", "Fault", "Scenario", "ScenarioError", "SpecError", "Step",
    "VmProfile", "builtin_scenarios", "load_scenario", "parse_scenario",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
