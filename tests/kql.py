"""Every KQL query the project ships, and Microsoft's Kusto language service to check them with.

The checker is ``tests/peers/kusto/check.js`` on npm ``@kusto/language-service-next`` (installed by
``tests/peers/kusto/install.sh``): it parses and analyzes each query against declared table schemas,
offline, and reports unknown tables and columns, operators applied to the wrong types and syntax
errors. ``SefwdEvents_CL``'s schema is generated from ``sinks.la_schema.COLUMNS``; the DCR's
``transformKql`` is checked against its own ``source`` stream declaration; the standard tables the
alert rules in the docs use are declared from Microsoft's table reference.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sinks.la_schema import COLUMNS, TABLE

ROOT = Path(__file__).resolve().parent.parent
KUSTO = ROOT / "tests" / "peers" / "kusto"
PACKAGE = KUSTO / "node_modules" / "@kusto" / "language-service-next"
DEPLOY = ROOT / "deploy"
DASHBOARDS = DEPLOY / "dashboards"
DCR_TEMPLATE = DEPLOY / "azure" / "loganalytics" / "azuredeploy.json"

# Log Analytics column types -> Kusto scalar type names.
_KUSTO_TYPES = {"string": "string", "int": "int", "long": "long", "real": "real", "boolean": "bool",
                "bool": "bool", "dateTime": "datetime", "datetime": "datetime", "dynamic": "dynamic",
                "guid": "guid", "timespan": "timespan"}

# Standard tables the example alert rules in the docs read: the columns they may use, from Microsoft's
# reference pages (learn.microsoft.com/azure/azure-monitor/reference/tables/appmetrics).
STANDARD_TABLES: dict[str, tuple[tuple[str, str], ...]] = {
    "AppMetrics": (
        ("TimeGenerated", "datetime"), ("AppRoleInstance", "string"), ("AppRoleName", "string"),
        ("AppVersion", "string"), ("ClientType", "string"), ("IKey", "string"), ("ItemCount", "int"),
        ("Max", "real"), ("Min", "real"), ("Name", "string"), ("OperationId", "string"),
        ("OperationName", "string"), ("ParentId", "string"), ("Properties", "dynamic"),
        ("ResourceGUID", "string"), ("SDKVersion", "string"), ("SessionId", "string"), ("Sum", "real"),
        ("SyntheticSource", "string"), ("UserAuthenticatedId", "string"), ("UserId", "string"),
        ("_ResourceId", "string"), ("Type", "string"),
    ),
}


class KustoUnavailable(RuntimeError):
    """node or the npm package is missing (run tests/peers/install.sh)."""


@dataclass(frozen=True)
class Query:
    """One shipped query, where it comes from, and the tables it may read."""

    name: str
    text: str
    tables: dict[str, str]


def schema(columns: Any) -> str:
    """``(Name:type, ...)`` in Kusto's schema syntax from (name, Log Analytics type) pairs."""
    return "(" + ", ".join(f"['{name}']:{_KUSTO_TYPES[ctype]}" for name, ctype in columns) + ")"


def workspace_tables() -> dict[str, str]:
    """The tables a workspace query may read: ours, generated from la_schema, and the standard ones."""
    tables = {TABLE: schema(COLUMNS)}
    tables.update({name: schema(cols) for name, cols in STANDARD_TABLES.items()})
    return tables


def _markdown_queries(path: Path) -> list[tuple[str, str]]:
    text = path.read_text(encoding="utf-8")
    blocks = re.findall(r"^```(?:kusto|kql)\s*\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)
    return [(f"{path.relative_to(ROOT)}#{n + 1}", block) for n, block in enumerate(blocks)]


def _dcr_queries() -> list[Query]:
    template = json.loads(DCR_TEMPLATE.read_text(encoding="utf-8"))
    out = []
    for resource in template["resources"]:
        if resource["type"] != "Microsoft.Insights/dataCollectionRules":
            continue
        streams = resource["properties"]["streamDeclarations"]
        for n, flow in enumerate(resource["properties"]["dataFlows"]):
            (stream,) = flow["streams"]
            columns = [(c["name"], c["type"]) for c in streams[stream]["columns"]]
            # A transformation reads its input as the table `source` (Azure Monitor: "transformation structure").
            out.append(Query(f"{DCR_TEMPLATE.relative_to(ROOT)}#dataFlows[{n}]", flow["transformKql"],
                             {"source": schema(columns)}))
    return out


def _workbook_queries(path: Path, *, serialized: bool = False) -> list[Query]:
    data = json.loads(path.read_text(encoding="utf-8"))
    workbook = data["variables"]["workbookContent"] if serialized else data
    tables = workspace_tables()
    return [Query(f"{path.relative_to(ROOT)}#items[{n}]", item["content"]["query"], tables)
            for n, item in enumerate(workbook["items"]) if item["type"] == 3]


def shipped_queries() -> list[Query]:
    """Every KQL query in the repository: dashboards, workbook (and its ARM copy), DCR, docs."""
    tables = workspace_tables()
    out = [Query(str(p.relative_to(ROOT)), p.read_text(encoding="utf-8"), tables)
           for p in sorted((DASHBOARDS / "queries").glob("*.kql"))]
    out += _workbook_queries(DASHBOARDS / "workbook.json")
    out += _workbook_queries(DASHBOARDS / "azuredeploy.json", serialized=True)
    out += _dcr_queries()
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(DEPLOY.glob("**/*.md"))]
    for path in docs:
        out += [Query(name, text, tables) for name, text in _markdown_queries(path)]
    return out


def available() -> str | None:
    """None if the checker can run, else why not."""
    if shutil.which("node") is None:
        return "node is not installed"
    if not (PACKAGE / "package.json").is_file():
        return f"{PACKAGE.relative_to(ROOT)} is missing: run tests/peers/install.sh"
    return None


def check(queries: list[Query], timeout: float = 120.0) -> dict[str, list[dict[str, Any]]]:
    """The language service's diagnostics for each query (errors and warnings), by query name."""
    why = available()
    if why is not None:
        raise KustoUnavailable(why)
    request = {"queries": [{"name": q.name, "query": q.text, "tables": q.tables} for q in queries]}
    done = subprocess.run(["node", str(KUSTO / "check.js")], input=json.dumps(request).encode(), cwd=str(KUSTO),
                          capture_output=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"check.js failed ({done.returncode}): {done.stderr.decode(errors='replace')[-2000:]}")
    return {r["name"]: r["diagnostics"] for r in json.loads(done.stdout)}


def errors(diagnostics: list[dict[str, Any]]) -> list[str]:
    """The error diagnostics as ``KS142 at 10: The name 'bb' ...`` lines."""
    return [f"{d['code']} at {d['start']}: {d['message']}" for d in diagnostics if d["severity"] == "Error"]
