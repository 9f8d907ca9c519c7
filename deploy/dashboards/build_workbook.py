"""Build ``workbook.json`` and its ARM template ``azuredeploy.json`` from ``queries/*.kql``.

The queries are the source of truth; the workbook embeds each file verbatim, so a query pasted
into Log Analytics and the workbook tile can never disagree. Each file starts with a header of
``// key: value`` comment lines (title, description, visualization, timerange = a fixed
look-back like ``14d`` or ``param`` for the workbook's time picker).

    python deploy/dashboards/build_workbook.py          # rewrite both files
    python deploy/dashboards/build_workbook.py --check  # exit 1 if either is stale
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
QUERIES = HERE / "queries"
WORKBOOK = HERE / "workbook.json"
TEMPLATE = HERE / "azuredeploy.json"

HEADER_KEYS = ("title", "description", "visualization", "timerange")
VISUALIZATIONS = ("table", "timechart", "barchart", "piechart", "tiles")
TIME_RANGE_PARAMETER = "TimeRange"
_UNITS_MS = {"m": 60_000, "h": 3_600_000, "d": 86_400_000}
WORKSPACE_RESOURCE_TYPE = "microsoft.operationalinsights/workspaces"
WORKBOOK_SCHEMA = "https://github.com/Microsoft/Application-Insights-Workbooks/blob/master/schema/workbook.json"


def parse_header(text: str) -> dict[str, str]:
    """The leading ``// key: value`` lines of a query file."""
    header: dict[str, str] = {}
    for line in text.splitlines():
        match = re.fullmatch(r"//\s*(\w+):\s*(.*)", line.strip())
        if not match:
            break
        header[match.group(1)] = match.group(2).strip()
    missing = [key for key in HEADER_KEYS if not header.get(key)]
    if missing:
        raise ValueError(f"header lacks {', '.join(missing)}")
    if header["visualization"] not in VISUALIZATIONS:
        raise ValueError(f"unknown visualization {header['visualization']!r}")
    return header


def _time_context(timerange: str) -> dict[str, Any]:
    if timerange == "param":
        return {"timeContextFromParameter": TIME_RANGE_PARAMETER}
    match = re.fullmatch(r"(\d+)([mhd])", timerange)
    if not match:
        raise ValueError(f"timerange must be 'param' or like '14d', got {timerange!r}")
    return {"timeContext": {"durationMs": int(match.group(1)) * _UNITS_MS[match.group(2)]}}


def load_queries() -> list[tuple[str, str, dict[str, str]]]:
    """(file stem, full text, header) of every query, in file-name order."""
    out = []
    for path in sorted(QUERIES.glob("*.kql")):
        text = path.read_text(encoding="utf-8")
        try:
            header = parse_header(text)
        except ValueError as exc:
            raise ValueError(f"{path.name}: {exc}") from None
        out.append((path.stem, text, header))
    return out


def workbook() -> dict[str, Any]:
    """The Azure Workbook (Notebook/1.0) with one KqlItem per query file."""
    queries = load_queries()
    intro = ["## sefwd — Scheduled Events across the fleet", "",
             ("Rows of `SefwdEvents_CL`, written by the sefwd `loganalytics` sink. Delivery is at least "
              "once, so the queries first keep one row per `RecordId` (or per VM)."), ""]
    intro += [f"- **{header['title']}**: {header['description']}" for _, _, header in queries]
    items: list[dict[str, Any]] = [
        {"type": 1, "content": {"json": "\n".join(intro)}, "name": "intro"},
        {
            "type": 9,
            "content": {
                "version": "KqlParameterItem/1.0",
                "parameters": [{
                    "id": "4b0f3a52-5d0e-4c59-9d43-0b7f5e0c1a01",
                    "version": "KqlParameterItem/1.0",
                    "name": TIME_RANGE_PARAMETER,
                    "label": "Time range",
                    "type": 4,
                    "isRequired": True,
                    "value": {"durationMs": 604_800_000},
                    "typeSettings": {
                        "selectableValues": [{"durationMs": ms} for ms in (
                            3_600_000, 14_400_000, 86_400_000, 259_200_000, 604_800_000, 1_209_600_000, 2_592_000_000)],
                        "allowCustom": True,
                    },
                }],
                "style": "pills",
                "queryType": 0,
                "resourceType": WORKSPACE_RESOURCE_TYPE,
            },
            "name": "parameters",
        },
    ]
    for stem, text, header in queries:
        content: dict[str, Any] = {
            "version": "KqlItem/1.0",
            "query": text,
            "size": 0,
            "title": header["title"],
            "noDataMessage": "No matching rows.",
            **_time_context(header["timerange"]),
            "queryType": 0,
            "resourceType": WORKSPACE_RESOURCE_TYPE,
            "visualization": header["visualization"],
        }
        items.append({"type": 3, "content": content, "name": f"query - {stem}"})
    return {"version": "Notebook/1.0", "items": items, "fallbackResourceIds": ["Azure Monitor"], "$schema": WORKBOOK_SCHEMA}


def _arm_literal(value: Any) -> Any:
    """Escape strings ARM would otherwise evaluate as expressions ("[...]" becomes "[[...]")."""
    if isinstance(value, str):
        return "[" + value if value.startswith("[") and value.endswith("]") else value
    if isinstance(value, list):
        return [_arm_literal(v) for v in value]
    if isinstance(value, dict):
        return {k: _arm_literal(v) for k, v in value.items()}
    return value


def template() -> dict[str, Any]:
    """An ARM template that saves the workbook in a resource group, bound to a workspace."""
    content = {k: v for k, v in workbook().items() if k != "fallbackResourceIds"}
    workspace_id = "resourceId('Microsoft.OperationalInsights/workspaces', parameters('workspaceName'))"
    return {
        "$schema": "https://schema.management.azure.com/schemas/2019-04-01/deploymentTemplate.json#",
        "contentVersion": "1.0.0.0",
        "metadata": {
            "description": "The sefwd Scheduled Events workbook, bound to the Log Analytics workspace holding "
                           "SefwdEvents_CL. Generated by deploy/dashboards/build_workbook.py from queries/*.kql: do not edit.",
        },
        "parameters": {
            "workspaceName": {
                "type": "string",
                "metadata": {"description": "Existing Log Analytics workspace (in this resource group) with the SefwdEvents_CL table."},
            },
            "workbookDisplayName": {
                "type": "string",
                "defaultValue": "sefwd - Scheduled Events",
                "metadata": {"description": "Name shown in the Workbooks gallery; the workbook's resource name is derived from it."},
            },
            "location": {
                "type": "string",
                "defaultValue": "[resourceGroup().location]",
                "metadata": {"description": "Region of the workbook resource."},
            },
        },
        "variables": {"workbookContent": _arm_literal(content)},
        "resources": [{
            "type": "Microsoft.Insights/workbooks",
            "apiVersion": "2022-04-01",
            "name": "[guid(resourceGroup().id, 'sefwd-workbook', parameters('workbookDisplayName'))]",
            "location": "[parameters('location')]",
            "kind": "shared",
            "properties": {
                "displayName": "[parameters('workbookDisplayName')]",
                "category": "workbook",
                "version": "Notebook/1.0",
                "sourceId": f"[{workspace_id}]",
                "serializedData": f"[string(union(variables('workbookContent'), createObject('fallbackResourceIds', createArray({workspace_id}))))]",
            },
        }],
        "outputs": {
            "workbookId": {
                "type": "string",
                "value": "[resourceId('Microsoft.Insights/workbooks', guid(resourceGroup().id, 'sefwd-workbook', parameters('workbookDisplayName')))]",
            },
        },
    }


def render(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if workbook.json or azuredeploy.json is stale")
    args = parser.parse_args(argv)
    outputs = {WORKBOOK: render(workbook()), TEMPLATE: render(template())}
    stale = [path for path, text in outputs.items() if not path.exists() or path.read_text(encoding="utf-8") != text]
    if args.check:
        for path in stale:
            print(f"{path.name} is stale: run python {Path(__file__).relative_to(HERE.parents[1])}", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(outputs[path], encoding="utf-8")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
