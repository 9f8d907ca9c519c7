"""What read-only commands (``status``, ``deadletter list``, ``config show``) need of the config: the state dir.

An operator on the VM, or a monitoring script, has the state dir but not the service's secrets. These
commands read ``[state]`` (and the sink names they display) and never need a sink's secret: the full
check still runs, and what it finds becomes warnings in their output instead of an exit 2. Only a
problem with the file itself or with ``[state]`` stops them.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forwarder.agent.config import (
    DEFAULTS_SOURCE, ENV_PREFIX, Config, _parse_sections, load_config, read_config_file,
)
from forwarder.errors import ConfigError

_STATE_PREFIX = f"{ENV_PREFIX}STATE_"


@dataclass(frozen=True)
class ReadView:
    """The state dir and sink names of a config, with its problems as warnings."""

    source: str
    state_dir: Path
    sink_names: tuple[str, ...]
    warnings: tuple[str, ...] = ()
    config: Config | None = None  # the whole config, when it is valid


def _sink_names(data: Mapping[str, Any]) -> tuple[str, ...]:
    """The names the config gives its sinks (as the agent names them), without checking any option."""
    entries = data.get("sinks", [{"type": "stdout"}])
    if not isinstance(entries, list):
        return ()
    names = []
    for entry in entries:
        if isinstance(entry, Mapping):
            name = entry.get("name", entry.get("type"))
            if isinstance(name, str) and name not in names:
                names.append(name)
    return tuple(names)


def load_for_reading(path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None) -> ReadView:
    """The state dir from ``path`` (as ``load_config`` chooses it); other problems become warnings."""
    env = os.environ if env is None else env
    try:
        config = load_config(path, env)
    except ConfigError as exc:
        warnings = tuple(exc.problems)
    else:
        return ReadView(config.source, config.state.dir, tuple(s.name for s in config.sinks), (), config)
    chosen, data = read_config_file(path, env)  # a missing or unreadable file stays an error
    source = str(chosen) if chosen is not None else DEFAULTS_SOURCE
    # [state] alone, with only its own overrides (HOME and XDG_STATE_HOME still pick the default dir).
    state_env = {k: v for k, v in env.items() if not k.startswith(ENV_PREFIX) or k.startswith(_STATE_PREFIX)}
    state_data = {"state": data["state"]} if "state" in data else {}
    problems: list[str] = []
    parsed = _parse_sections(state_data, state_env, chosen.absolute().parent if chosen is not None else None, problems)
    if problems:
        raise ConfigError(problems)
    return ReadView(source, parsed["state"]["dir"], _sink_names(data), warnings)
