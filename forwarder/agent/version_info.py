"""What `sefwd --version` prints: the agent's version, the Python it runs on, the extras installed."""
from __future__ import annotations

import argparse
import platform
import re
import sys
from typing import TYPE_CHECKING, Any

from forwarder import __version__

if TYPE_CHECKING:
    from importlib.metadata import Distribution

DIST = "scheduled-events-forwarder"
# Extras that group others (or serve development) rather than enable a sink or feature.
_GROUPS = frozenset({"all", "test", "bench"})
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
_EXTRA = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")


def _installed(name: str) -> bool:
    from importlib import metadata  # here, not at import: every sefwd start imports this module

    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def extras(dist: Distribution) -> tuple[list[str], list[str]]:
    """(installed, not installed) extras: installed when every requirement it adds is."""
    needs: dict[str, list[str]] = {name: [] for name in dist.metadata.get_all("Provides-Extra") or []}
    for requirement in dist.requires or []:
        name, extra = _NAME.match(requirement), _EXTRA.search(requirement)
        if name and extra and extra.group(1) in needs and name.group(1).lower() != DIST:
            needs[extra.group(1)].append(name.group(1))
    wanted = sorted(e for e in needs if e not in _GROUPS)
    have = [e for e in wanted if all(_installed(n) for n in needs[e])]
    return have, [e for e in wanted if e not in have]


def describe() -> str:
    """Three lines: version (as installed), Python, extras."""
    from importlib import metadata

    try:
        dist: Distribution | None = metadata.distribution(DIST)
    except metadata.PackageNotFoundError:
        dist = None
    version = dist.version if dist is not None else f"{__version__} (not installed: run from a source tree)"
    lines = [f"sefwd {version}",
             f"Python {platform.python_version()} ({platform.python_implementation()}) at {sys.executable}"]
    if dist is not None:
        have, missing = extras(dist)
        lines.append("extras: " + (", ".join(have) or "none") + ("; not installed: " + ", ".join(missing) if missing else ""))
    return "\n".join(lines)


class VersionAction(argparse.Action):
    """argparse's --version, computed only when asked (reading package metadata costs a few ms)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the version, the Python it runs on and the installed extras, then exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(describe())
        parser.exit()
