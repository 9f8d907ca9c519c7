"""Finished actions reach the metrics: a real agent with [telemetry] and a hook, against the emulator,
scraped until ``sefwd_actions_total`` counts them by kind and final state (the bounded values
docs/maintenance-probe.md lists: a failing hook is ``outcome="failed"``, which the example alert catches)."""
from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("opentelemetry.exporter.prometheus")

from forwarder.emulator import Emulator  # noqa: E402
from forwarder.store.actions import FINAL_STATES, KINDS  # noqa: E402
from tests.agent import AgentProcess, wait_until, write_config  # noqa: E402

_ACTIONS = re.compile(r'^sefwd_actions_total\{kind="([^"]*)",outcome="([^"]*)"\}\s+(\S+)$', re.MULTILINE)


def actions(base: str) -> dict[tuple[str, str], float]:
    with urllib.request.urlopen(base + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return {(m[1], m[2]): float(m[3]) for m in _ACTIONS.finditer(text)}


def test_finished_hooks_and_approvals_are_counted_by_kind_and_final_state(tmp_path: Path) -> None:
    hook = tmp_path / "drain.sh"
    hook.write_text('#!/bin/sh\ntest "$SEFWD_EVENT_TYPE" != Freeze\n')  # a Freeze makes the hook fail
    hook.chmod(0o755)
    extra = (f'[telemetry]\nlisten = "127.0.0.1:0"\n'
             f'[approval.hooks]\nscheduled = ["{hook}"]\n'
             f'[[approval.rules]]\nname = "reboots"\nevent_type = "Reboot"\naction = "approve"\nafter_hooks = true\n')
    with Emulator(vms=["myVM"], rate_limit=None) as emu:
        config = write_config(tmp_path / "c.toml", emu.vm_url("myVM"), tmp_path / "state", extra=extra)
        agent = AgentProcess(config, tmp_path / "agent.log")
        try:
            base = wait_until(lambda: re.search(r"/metrics and /healthz on (http://\S+)", agent.logs()), 30,
                              "the telemetry endpoint")[1]
            assert not any(key[0] == "hook" for key in actions(base))  # nothing finished yet
            emu.schedule(type="Reboot", resources=["myVM"], start_after=600)
            emu.schedule(type="Freeze", resources=["myVM"], start_after=600)
            wanted = {("hook", "done"), ("hook", "failed"), ("approve", "done")}
            seen = wait_until(lambda: (a := actions(base)).keys() >= wanted and a, 60,
                              "the finished actions in /metrics")
            assert seen[("hook", "done")] == 1 and seen[("hook", "failed")] == 1 and seen[("approve", "done")] == 1
            assert {kind for kind, _ in seen} <= set(KINDS) and {state for _, state in seen} <= set(FINAL_STATES)
            assert emu.stats()["start_requests"], "the approval reached IMDS"
        finally:
            assert agent.terminate() == 0
