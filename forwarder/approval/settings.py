"""The validated ``[approval]`` configuration (parsed by forwarder.approval.config)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

# The outcome of an approval (approval.<outcome> records); here, not in the approver, so that reading a
# config does not import the approver and what it needs (the store, the IMDS client).
APPROVED = "approved"
REFUSED = "refused"
FAILED = "failed"
HELD = "held"
OUTCOMES = (APPROVED, REFUSED, FAILED, HELD)

SCOPES = ("self", "leader", "any", "self_or_leader")
ACTIONS = ("approve", "hold", "ignore")
CHANGE_KINDS = ("scheduled", "started", "updated", "completed", "canceled", "ended")
UNDO_KINDS = ("completed", "canceled", "ended")  # their hooks are undo actions: run once per event, to completion
# What a hook inherits from the agent's environment besides its SEFWD_* event variables; the
# operator adds names with hook_env (never the agent's secrets by default).
HOOK_ENV_DEFAULT = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR",
                    # Windows programs need these to start at all
                    "SYSTEMROOT", "WINDIR", "COMSPEC", "PATHEXT", "TEMP", "TMP")


@dataclass(frozen=True)
class HookSpec:
    """One ``[approval.hooks]`` entry: a command, and optionally when and for which event types."""

    command: tuple[str, ...] | str  # argv (run directly) or a shell string (/bin/sh -c)
    at: float | None = None  # seconds before NotBefore: not earlier than NotBefore - at
    event_types: tuple[str, ...] | None = None
    # Only for events whose Resources name this VM (or name none): another VM's reboot is not ours to act on.
    affects_this_vm: bool = True


@dataclass(frozen=True)
class Rule:
    """One ``[[approval.rules]]`` entry; every match field left as None matches anything."""

    name: str
    action: str
    event_type: tuple[str, ...] | None = None
    event_source: tuple[str, ...] | None = None
    event_status: tuple[str, ...] | None = None
    duration_min: int | None = None
    duration_max: int | None = None
    affects_this_vm: bool | None = None
    resources_min: int | None = None
    resources_max: int | None = None
    description: re.Pattern[str] | None = None
    delay: float = 0.0
    after_hooks: bool = False
    at: float | None = None  # approve not earlier than NotBefore - at


@dataclass(frozen=True)
class CallbackSettings:
    """``[approval.callback]``: the signed remote-approval endpoint."""

    host: str
    port: int
    keys: tuple[bytes, ...] = field(repr=False)
    tls_cert: Path | None = None
    tls_key: Path | None = None
    max_body: int = 16 * 1024
    rate_limit: int = 30  # requests per minute per client IP
    client_timeout: float = 5.0
    tolerance: float = 300.0


@dataclass(frozen=True)
class ApprovalConfig:
    """Everything about approvals; the default approves nothing and listens nowhere."""

    scope: str = "self_or_leader"
    rules: tuple[Rule, ...] = ()
    hooks: dict[str, HookSpec] = field(default_factory=dict)  # change kind -> hook
    hook_timeout: float = 300.0
    hook_output_limit: int = 4096
    callback: CallbackSettings | None = None
    dry_run: bool = False  # plan and audit every action, perform none
    deadline_margin: float = 5.0  # a hook before NotBefore must end this long before it
    hook_env: tuple[str, ...] = ()  # more variable names hooks inherit (beside HOOK_ENV_DEFAULT)
    workers: int = 8  # actions running at once
