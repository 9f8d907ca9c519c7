"""Parse and validate the ``[approval]`` config table into an ApprovalConfig.

Every problem is returned (not raised) so forwarder.agent.config can report them together with the
rest of the file's; each message names the key (``approval.rules[2].duration_min: ...``).
"""
from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from forwarder.approval.settings import (ACTIONS, CHANGE_KINDS, SCOPES, UNDO_KINDS, ApprovalConfig, CallbackSettings,
                                        HookSpec, Rule)
from forwarder.common.listen import parse_listen, tls_server_context
from forwarder.common.signing import SignatureError, parse_secret
from forwarder.common.values import boolean, choice, duration, integer, parse_labelled, parse_table, size, suggest

ENV_PREFIX = "SEFWD_APPROVAL_"
# The keys of each table, in the order the example config shows them.
APPROVAL_KEYS = ("scope", "dry_run", "hook_timeout", "hook_output_limit", "deadline_margin", "workers", "hook_env",
                 "hooks", "rules", "callback")
APPROVAL_ENV_KEYS = ("scope", "dry_run", "hook_timeout", "hook_output_limit", "deadline_margin")
RULE_KEYS = (
    "name", "event_type", "event_types", "event_source", "event_status", "duration_min", "duration_max",
    "affects_this_vm", "resources_min", "resources_max", "description", "action", "delay", "after_hooks", "at",
)
HOOK_KEYS = ("command", "at", "event_types", "affects_this_vm")
MAX_WORKERS = 256
_AT = re.compile(r"^\s*notbefore\s*(?:-\s*(?P<before>\S.*?))?\s*$", re.IGNORECASE)
CALLBACK_KEYS = (
    "listen", "secret_env", "secret_file", "tls_cert", "tls_key", "max_body", "rate_limit",
    "client_timeout", "tolerance",
)
# IMDS values are case-sensitive; a differently-cased spelling of one of these never matches.
KNOWN_VALUES: dict[str, tuple[str, ...]] = {
    "event_type": ("Reboot", "Redeploy", "Freeze", "Preempt", "Terminate", "SpotRebalanceRecommendation"),
    "event_source": ("Platform", "User"),
    "event_status": ("Scheduled", "Started"),
}
MAX_HOOK_TIMEOUT = 86400.0
MAX_HOOK_OUTPUT = 1024 * 1024
MIN_MAX_BODY, MAX_MAX_BODY = 256, 1024 * 1024
MAX_RATE_LIMIT = 10_000
MAX_CLIENT_TIMEOUT = 300.0
MAX_EVENT_DURATION = 7 * 86400
MAX_RESOURCES = 10_000
MIN_TOLERANCE, MAX_TOLERANCE = 1.0, 3600.0


def _unknown_keys(table: Mapping[str, Any], known: tuple[str, ...], where: str, problems: list[str]) -> None:
    for key in table:
        if key not in known:
            problems.append(f"unknown key {where}.{key}{suggest(str(key), known)}")


def _strings(field: str) -> Callable[[Any], tuple[str, ...]]:
    known = KNOWN_VALUES[field]

    def parse(value: Any) -> tuple[str, ...]:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not items:
            raise ValueError(f"expected a string or a non-empty list of strings, got {value!r}")
        for item in items:
            if not isinstance(item, str) or not item.strip():
                raise ValueError(f"expected non-empty strings, got {item!r}")
            if item not in known:
                same = [k for k in known if k.lower() == item.strip().lower()]
                if same:
                    raise ValueError(f"IMDS values are case-sensitive: {item!r} never matches; write {same[0]!r}")
        return tuple(items)

    return parse


def parse_at(value: Any) -> float:
    """``"notbefore - 2m"`` → 120.0 (seconds before NotBefore); ``"notbefore"`` → 0."""
    match = _AT.match(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(f'expected "notbefore - DURATION" (e.g. "notbefore - 2m"), got {value!r}')
    before = match.group("before")
    return duration(0.0, MAX_EVENT_DURATION)(before) if before else 0.0


def _regex(value: Any) -> re.Pattern[str]:
    if not isinstance(value, str):
        raise ValueError(f"expected a regular expression string, got {value!r}")
    try:
        return re.compile(value)
    except re.error as exc:
        raise ValueError(f"invalid regular expression {value!r}: {exc}") from None


_RULE_PARSERS: dict[str, Callable[[Any], Any]] = {
    "event_type": _strings("event_type"),
    "event_source": _strings("event_source"),
    "event_status": _strings("event_status"),
    # DurationInSeconds: -1 means unknown, and Azure never announces more than a few days.
    "duration_min": integer(-1, MAX_EVENT_DURATION),
    "duration_max": integer(-1, MAX_EVENT_DURATION),
    "affects_this_vm": boolean,
    "resources_min": integer(0, MAX_RESOURCES),
    "resources_max": integer(0, MAX_RESOURCES),
    "description": _regex,
    "action": choice(ACTIONS, fold_case=False),
    "delay": duration(0.0, MAX_HOOK_TIMEOUT),
    "after_hooks": boolean,
    "at": parse_at,
}


def _parse_rule(index: int, entry: Any, have_hooks: bool, problems: list[str]) -> Rule | None:
    where = f"approval.rules[{index}]"
    if not isinstance(entry, Mapping):
        problems.append(f"{where} must be a table ([[approval.rules]]), got {entry!r}")
        return None
    before = len(problems)
    _unknown_keys(entry, RULE_KEYS, where, problems)
    if "event_types" in entry:  # the hooks' spelling, accepted here too
        if "event_type" in entry:
            problems.append(f"{where}: event_type and event_types are the same key: set only one")
        entry = {("event_type" if k == "event_types" else k): v for k, v in entry.items()}
    values = parse_table(_RULE_PARSERS, entry, where, problems)
    name = entry.get("name", f"rules[{index}]")
    if not isinstance(name, str) or not name.strip():
        problems.append(f"{where}.name: expected a non-empty string, got {name!r}")
    if "action" not in entry:
        problems.append(f"{where}: missing 'action' (one of {', '.join(ACTIONS)})")
    for low, high in (("duration_min", "duration_max"), ("resources_min", "resources_max")):
        if low in values and high in values and values[low] > values[high]:
            problems.append(f"{where}.{low}: {values[low]} is greater than {high} {values[high]}: the rule never matches")
    if values.get("action", "approve") != "approve":
        for key in ("delay", "after_hooks", "at"):
            if key in entry:
                problems.append(f"{where}.{key}: only allowed with action = \"approve\" (this rule says {values['action']!r})")
    if values.get("after_hooks") and not have_hooks:
        problems.append(f"{where}.after_hooks: true, but [approval.hooks] configures no command to wait for "
                        "(and there is no [protect] enter)")
    if len(problems) > before:
        return None
    return Rule(name=name.strip(), **values)


def _parse_rules(raw: Any, have_hooks: bool, problems: list[str]) -> tuple[Rule, ...]:
    if not isinstance(raw, list):
        problems.append("approval.rules must be an array of tables: write each rule as [[approval.rules]]")
        return ()
    rules: list[Rule] = []
    seen: dict[str, int] = {}
    for index, entry in enumerate(raw):
        rule = _parse_rule(index, entry, have_hooks, problems)
        if rule is None:
            continue
        # Audit records name the rule; two rules with one name would make them ambiguous.
        if rule.name in seen:
            problems.append(f"approval.rules[{index}].name: duplicate rule name {rule.name!r} (also rules[{seen[rule.name]}])")
            continue
        seen[rule.name] = index
        rules.append(rule)
    return tuple(rules)


def _parse_command(command: Any, where: str, problems: list[str]) -> tuple[str, ...] | str | None:
    if isinstance(command, str):
        if not command.strip():
            problems.append(f"{where}: the command must not be empty")
            return None
        return command
    if isinstance(command, list) and command and all(isinstance(a, str) for a in command):
        if not command[0].strip():
            problems.append(f"{where}: the program (first element) must not be empty")
            return None
        return tuple(command)
    problems.append(f"{where}: expected a command string (run with /bin/sh -c) or a non-empty "
                    f"list of strings (run without a shell), got {command!r}")
    return None


_HOOK_PARSERS: dict[str, Callable[[Any], Any]] = {"at": parse_at, "event_types": _strings("event_type"),
                                                  "affects_this_vm": boolean}


def _parse_hook(kind: str, raw: Any, problems: list[str]) -> HookSpec | None:
    """A command (string or list), or a table {command, at, event_types}."""
    where = f"approval.hooks.{kind}"
    if not isinstance(raw, Mapping):
        command = _parse_command(raw, where, problems)
        return HookSpec(command) if command is not None else None
    before = len(problems)
    _unknown_keys(raw, HOOK_KEYS, where, problems)
    if "command" not in raw:
        problems.append(f"{where}: missing 'command'")
        return None
    command = _parse_command(raw["command"], f"{where}.command", problems)
    values = parse_table(_HOOK_PARSERS, raw, where, problems)
    if "at" in raw and kind in UNDO_KINDS:
        problems.append(f"{where}.at: an undo hook runs once the event is over, never before NotBefore")
    if command is None or len(problems) > before:
        return None
    return HookSpec(command, **values)


def _parse_hooks(raw: Any, problems: list[str]) -> dict[str, HookSpec]:
    if not isinstance(raw, Mapping):
        problems.append(f"approval.hooks must be a table ([approval.hooks]), got {raw!r}")
        return {}
    hooks: dict[str, HookSpec] = {}
    for kind, entry in raw.items():
        if kind not in CHANGE_KINDS:
            problems.append(f"unknown change kind approval.hooks.{kind}{suggest(str(kind), CHANGE_KINDS)} "
                            f"(hooks are keyed by: {', '.join(CHANGE_KINDS)})")
            continue
        hook = _parse_hook(kind, entry, problems)
        if hook is not None:
            hooks[kind] = hook
    return hooks


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _parse_hook_env(raw: Any, problems: list[str]) -> tuple[str, ...]:
    if not isinstance(raw, list) or not all(isinstance(n, str) and _ENV_NAME.match(n) for n in raw):
        problems.append(f"approval.hook_env: expected a list of environment variable names, got {raw!r}")
        return ()
    return tuple(raw)


def _resolve(path_text: str, base_dir: Path | None) -> Path:
    path = Path(os.path.expanduser(path_text))
    if not path.is_absolute():
        path = (base_dir or Path.cwd()) / path
    return path


def _readable_file(value: Any, base_dir: Path | None) -> Path:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"expected a file path, got {value!r}")
    path = _resolve(value.strip(), base_dir)
    if path.is_dir():
        raise ValueError(f"{str(path)!r} is a directory")
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise ValueError(f"cannot read {str(path)!r}: {exc.strerror or exc}") from None
    return path


def _parse_keys(text: str, where: str) -> tuple[bytes, ...]:
    """Every ``whsec_`` secret in ``text`` (space-separated, for key rotation)."""
    secrets = text.split()
    if not secrets:
        raise ValueError(f"{where} is empty")
    keys: list[bytes] = []
    for position, secret in enumerate(secrets, 1):
        try:
            keys.append(parse_secret(secret))
        except SignatureError as exc:
            which = f" (secret {position} of {len(secrets)})" if len(secrets) > 1 else ""
            raise ValueError(f"{where}{which}: {exc}") from None
    return tuple(keys)


def _load_keys(table: Mapping[str, Any], env: Mapping[str, str], base_dir: Path | None,
               problems: list[str]) -> tuple[bytes, ...] | None:
    has_env, has_file = table.get("secret_env") is not None, table.get("secret_file") is not None
    if has_env and has_file:
        problems.append("approval.callback: secret_env and secret_file are exclusive: set only one")
        return None
    # Messages name the variable or file, never the secret: they end up in logs.
    try:
        if has_env:
            name = table["secret_env"]
            if not isinstance(name, str) or not name.strip():
                raise ValueError(f"must name an environment variable, got {name!r}")
            if name not in env:
                raise ValueError(f"environment variable {name!r} is not set")
            return _parse_keys(env[name], f"environment variable {name!r}")
        if has_file:
            path = _readable_file(table["secret_file"], base_dir)
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"{str(path)!r} is not UTF-8 text") from None
            return _parse_keys(text, f"file {str(path)!r}")
    except ValueError as exc:
        problems.append(f"approval.callback.{'secret_env' if has_env else 'secret_file'}: {exc}")
        return None
    problems.append("approval.callback: a secret is required: set secret_env (an environment variable "
                    "holding whsec_... secrets) or secret_file (make one with: echo whsec_$(openssl rand -base64 32))")
    return None


_CALLBACK_PARSERS: dict[str, Callable[[Any], Any]] = {
    "max_body": size(MIN_MAX_BODY, MAX_MAX_BODY),
    "rate_limit": integer(1, MAX_RATE_LIMIT),
    "client_timeout": duration(0.0, MAX_CLIENT_TIMEOUT, low_inclusive=False),
    "tolerance": duration(MIN_TOLERANCE, MAX_TOLERANCE),
}


def _parse_callback(raw: Any, env: Mapping[str, str], base_dir: Path | None,
                    problems: list[str]) -> CallbackSettings | None:
    if not isinstance(raw, Mapping):
        problems.append(f"approval.callback must be a table ([approval.callback]), got {raw!r}")
        return None
    before = len(problems)
    _unknown_keys(raw, CALLBACK_KEYS, "approval.callback", problems)
    values: dict[str, Any] = {}
    if "listen" not in raw:
        problems.append("approval.callback: missing 'listen' (for example listen = \"127.0.0.1:8787\")")
    else:
        try:
            values["host"], values["port"] = parse_listen(raw["listen"])
        except ValueError as exc:
            problems.append(f"approval.callback.listen: {exc}")
    values.update(parse_table(_CALLBACK_PARSERS, raw, "approval.callback", problems))
    has_cert, has_key = raw.get("tls_cert") is not None, raw.get("tls_key") is not None
    if has_cert != has_key:
        missing, given = ("tls_key", "tls_cert") if has_cert else ("tls_cert", "tls_key")
        problems.append(f"approval.callback.{missing}: required with {given} (set both or neither)")
    tls_files = {key: lambda value: _readable_file(value, base_dir) for key in ("tls_cert", "tls_key")}
    present = {key: value for key, value in raw.items() if value is not None}
    values.update(parse_table(tls_files, present, "approval.callback", problems))
    if "tls_cert" in values and "tls_key" in values:
        problems.extend(_tls_problems(values["tls_cert"], values["tls_key"]))
    keys = _load_keys(raw, env, base_dir, problems)
    if len(problems) > before or keys is None:
        return None
    return CallbackSettings(keys=keys, **values)


def _tls_problems(cert: Path, key: Path) -> list[str]:
    """Load the pair as the server will at start, so a wrong or mismatched file fails the check instead."""
    import ssl  # only a config with a TLS callback pays for it

    try:
        tls_server_context(cert, key)
    except (OSError, ssl.SSLError) as exc:
        # The reason only (e.g. "KEY_VALUES_MISMATCH"): never the file's content.
        reason = getattr(exc, "reason", None) or type(exc).__name__
        return [f"approval.callback.tls_cert: cannot load {str(cert)!r} with tls_key {str(key)!r} ({reason}): "
                "both must be PEM files, the key matching the certificate"]
    return []


_FLAT_PARSERS: dict[str, Callable[[Any], Any]] = {
    "scope": choice(SCOPES),
    "hook_timeout": duration(0.0, MAX_HOOK_TIMEOUT, low_inclusive=False),
    "hook_output_limit": size(0, MAX_HOOK_OUTPUT),
    "dry_run": boolean,
    "deadline_margin": duration(0.0, 3600.0),
    "workers": integer(1, MAX_WORKERS),
}


def parse_approval(
    raw: Mapping[str, Any], env: Mapping[str, str], base_dir: Path | None, *, protect: bool = False
) -> tuple[ApprovalConfig, list[str]]:
    """Validate the ``[approval]`` table plus ``SEFWD_APPROVAL_*`` overrides; returns (config, problems).

    The config is the default one whenever there are problems. Relative file paths resolve
    against ``base_dir`` (the config file's directory), else the working directory.
    """
    problems: list[str] = []
    if not isinstance(raw, Mapping):
        return ApprovalConfig(), [f"approval must be a table ([approval]), got {raw!r}"]
    _unknown_keys(raw, APPROVAL_KEYS, "approval", problems)
    flat: dict[str, tuple[Any, str]] = {k: (raw[k], f"approval.{k}") for k in _FLAT_PARSERS if k in raw}
    secret_var = raw.get("callback", {}).get("secret_env") if isinstance(raw.get("callback"), Mapping) else None
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or var == secret_var:
            continue
        key = var[len(ENV_PREFIX):].lower()
        if key not in APPROVAL_ENV_KEYS:
            names = [f"{ENV_PREFIX}{k.upper()}" for k in APPROVAL_ENV_KEYS]
            problems.append(f"unknown environment variable {var}: [approval] has no flat key {key!r}"
                            f"{suggest(var, names)}")
        elif env[var] != "":  # empty means unset, as elsewhere
            flat[key] = (env[var], f"environment {var}")
    values = parse_labelled(_FLAT_PARSERS, flat, problems)
    hooks = _parse_hooks(raw["hooks"], problems) if "hooks" in raw else {}
    # An invalid [approval.hooks] is reported on its own; do not pile after_hooks problems on it.
    # ([protect]'s enter is what after_hooks waits for, when it is configured)
    have_hooks = bool(hooks) or bool(raw.get("hooks")) or protect
    rules = _parse_rules(raw["rules"], have_hooks, problems) if "rules" in raw else ()
    callback = _parse_callback(raw["callback"], env, base_dir, problems) if "callback" in raw else None
    hook_env = _parse_hook_env(raw["hook_env"], problems) if "hook_env" in raw else ()
    if problems:
        return ApprovalConfig(), problems
    return ApprovalConfig(rules=rules, hooks=hooks, callback=callback, hook_env=hook_env, **values), problems
