"""Built-in sinks have one registry, ``forwarder.sinkapi.BUILTIN_SINKS``, and it is complete."""
from __future__ import annotations

import ast
from importlib.metadata import entry_points

from forwarder.common.compat import tomllib
from forwarder.sinkapi import BUILTIN_SINKS, ENTRY_POINT_GROUP, available_sinks
from tests.conftest import ROOT


def _sink_classes() -> set[str]:
    """Every public class in sinks/ shaped like a sink (OPTIONS, check, send, close)."""
    found = set()
    for path in sorted((ROOT / "sinks").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                names = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
                names |= {t.id for n in node.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                          for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
                if {"OPTIONS", "check", "send", "close"} <= names:
                    found.add(f"sinks.{path.stem}:{node.name}")
    return found


def test_the_table_names_every_builtin_sink_class():
    assert _sink_classes() == set(BUILTIN_SINKS.values())
    assert len(set(BUILTIN_SINKS.values())) == len(BUILTIN_SINKS)


def test_no_entry_point_duplicates_the_table():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = project.get("entry-points", {}).get(ENTRY_POINT_GROUP, {})
    assert not set(declared) & set(BUILTIN_SINKS), "built-in sinks are registered in sinkapi.BUILTIN_SINKS only"
    installed = {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    assert not installed & set(BUILTIN_SINKS)
    assert {k: available_sinks()[k] for k in BUILTIN_SINKS} == BUILTIN_SINKS
