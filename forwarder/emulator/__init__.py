"""A faithful Azure IMDS emulator (Scheduled Events, instance compute, managed identity) for tests and demos."""
from __future__ import annotations

from forwarder.emulator.faults import FAULT_KINDS, Fault
from forwarder.emulator.model import SE_VERSIONS, Event, SpecError, VmProfile
from forwarder.emulator.scenario import Scenario, ScenarioError, Step, builtin_scenarios, load_scenario, parse_scenario
from forwarder.emulator.server import Emulator

__all__ = [
    "FAULT_KINDS", "SE_VERSIONS", "Emulator", "Event", "Fault", "Scenario", "ScenarioError", "SpecError", "Step",
    "VmProfile", "builtin_scenarios", "load_scenario", "parse_scenario",
]
