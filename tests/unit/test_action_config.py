"""The [approval] keys of actions: dry_run, deadline_margin, workers, hook_env, hooks as tables with
``at`` and ``event_types``, rules with ``at``; every problem reported at once."""
from __future__ import annotations

from typing import Any

import pytest

from forwarder.approval.config import parse_approval, parse_at
from forwarder.approval.hooks import base_env, redact_output
from forwarder.approval.settings import HookSpec


def ok(raw: dict[str, Any], env: dict[str, str] | None = None) -> Any:
    config, problems = parse_approval(raw, env or {}, None)
    assert problems == []
    return config


@pytest.mark.parametrize(("text", "seconds"), [
    ("notbefore - 2m", 120.0), ("NotBefore-90s", 90.0), ("notbefore", 0.0), ("  notbefore -  1h ", 3600.0),
])
def test_at_parses(text: str, seconds: float) -> None:
    assert parse_at(text) == seconds


@pytest.mark.parametrize("text", ["notbefore + 2m", "2m", "notbefore - soon", "", 120, "notafter - 1m"])
def test_at_refuses_what_it_cannot_read(text: Any) -> None:
    with pytest.raises(ValueError):
        parse_at(text)


def test_the_new_keys_parse() -> None:
    config = ok({
        "dry_run": True, "deadline_margin": "10s", "workers": 50, "hook_env": ["KUBECONFIG", "NODE_NAME"],
        "hooks": {"scheduled": {"command": ["drain.sh", "-g"], "at": "notbefore - 2m", "event_types": ["Reboot"]},
                  "canceled": "undrain.sh"},
        "rules": [{"action": "approve", "event_types": ["Freeze"], "at": "notbefore - 30s"}],
    })
    assert (config.dry_run, config.deadline_margin, config.workers) == (True, 10.0, 50)
    assert config.hook_env == ("KUBECONFIG", "NODE_NAME")
    assert config.hooks == {"scheduled": HookSpec(("drain.sh", "-g"), 120.0, ("Reboot",)), "canceled": HookSpec("undrain.sh")}
    (rule,) = config.rules
    assert rule.event_type == ("Freeze",) and rule.at == 30.0
    assert ok({"dry_run": False}, {"SEFWD_APPROVAL_DRY_RUN": "true"}).dry_run is True


def test_every_problem_is_reported_at_once() -> None:
    _, problems = parse_approval({
        "workers": 0, "hook_env": ["OK", "not ok"], "deadline_margin": "-1s",
        "hooks": {"scheduled": {"command": "x", "at": "soon", "event_types": ["reboot"], "when": 1},
                  "completed": {"command": "y", "at": "notbefore - 1m"}, "started": {"at": "notbefore"}},
        "rules": [{"action": "hold", "at": "notbefore - 1m"},
                  {"action": "approve", "event_type": "Reboot", "event_types": ["Reboot"]}],
    }, {}, None)
    text = "\n".join(problems)
    for expected in ("approval.workers", "approval.hook_env", "approval.deadline_margin",
                     "approval.hooks.scheduled.at", "approval.hooks.scheduled.event_types", "case-sensitive",
                     "unknown key approval.hooks.scheduled.when", "approval.hooks.completed.at: an undo hook",
                     "approval.hooks.started: missing 'command'", "approval.rules[0].at: only allowed with action",
                     "approval.rules[1]: event_type and event_types"):
        assert expected in text, (expected, problems)


def test_hooks_inherit_only_the_defaults_and_the_allow_list() -> None:
    environ = {"PATH": "/bin", "HOME": "/root", "SEFWD_CALLBACK_SECRET": "whsec_x", "AZURE_CLIENT_SECRET": "s",
               "KUBECONFIG": "/k"}
    assert base_env((), environ) == {"PATH": "/bin", "HOME": "/root"}
    assert base_env(("KUBECONFIG", "MISSING"), environ) == {"PATH": "/bin", "HOME": "/root", "KUBECONFIG": "/k"}
    assert base_env((), {})["PATH"].startswith("/usr/local/sbin")  # a PATH even when the agent has none


def test_hook_output_is_redacted_like_a_log_line() -> None:
    text = ("token https://user:pw@host/x?sig=abc&api-version=1 Endpoint=sb://n/;SharedAccessKey=k= "
            "whsec_c2VjcmV0+/= done")
    assert redact_output(text) == ("token https://***@host/x?sig=***&api-version=1 Endpoint=sb://n/;SharedAccessKey=*** "
                                   "*** done")
