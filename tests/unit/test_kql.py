"""Every KQL query the project ships passes Microsoft's Kusto language service against the real schemas."""
from __future__ import annotations

import os
from typing import Any

import pytest

from sinks.la_schema import COLUMNS, TABLE
from tests import kql

pytestmark = pytest.mark.timeout(300)

_WHY = kql.available()
if _WHY is not None and os.environ.get("SEFWD_REQUIRE_PEERS"):
    # CI installs the peers (tests/peers/install.sh): a missing checker is a failure there, not a skip.
    raise RuntimeError(f"the Kusto language service is required here (SEFWD_REQUIRE_PEERS) but {_WHY}")
if _WHY is not None:
    pytest.skip(f"Kusto language service unavailable: {_WHY}", allow_module_level=True)

QUERIES = kql.shipped_queries()

# The checker's own tests: what it must catch, each in a query that is otherwise fine.
BROKEN = {
    "misspelt column": f'{TABLE} | where VmNmae == "vm-1"',
    "unknown table": "SefwdEvent_CL | take 1",
    "wrong type": f"{TABLE} | where NotBefore > 5 and Sequence > 0",  # datetime compared with an int
    "string minus datetime": f"{TABLE} | extend Lead = EventType - TimeGenerated",
    "syntax error": f"{TABLE} | where (Sequence > 1 | take 1",
    "unknown function": f"{TABLE} | summarize arg_maxx(TimeGenerated, *) by RecordId",
}
GOOD = {
    "every column": f"{TABLE} | project " + ", ".join(f"['{name}']" for name, _ in COLUMNS),
    "dynamic property": f"{TABLE} | extend Ids = Data.EventIds | mv-expand Ids | project tostring(Ids)",
    "defined names": f"{TABLE} | extend Late = NotBefore - TimeGenerated | where Late < 5m | project Late",
}


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict[str, Any]]]:
    tables = kql.workspace_tables()
    own = [kql.Query(f"broken: {k}", v, tables) for k, v in BROKEN.items()]
    own += [kql.Query(f"good: {k}", v, tables) for k, v in GOOD.items()]
    (dcr,) = [q for q in QUERIES if "dataFlows" in q.name]
    own += [kql.Query("dcr: unknown column", "source | extend X = Bogus", dcr.tables),
            kql.Query("dcr: a real column", "source | where isnotempty(RecordId)", dcr.tables)]
    return kql.check(QUERIES + own)  # one node process for all (its start-up is most of the cost)


def test_every_kind_of_shipped_query_is_found() -> None:
    names = [q.name for q in QUERIES]
    assert sum(n.startswith("deploy/dashboards/queries/") for n in names) >= 8
    assert sum(n.startswith("deploy/dashboards/workbook.json#") for n in names) >= 8
    assert sum(n.startswith("deploy/dashboards/azuredeploy.json#") for n in names) >= 8
    assert any(n.startswith("deploy/azure/loganalytics/azuredeploy.json#dataFlows") for n in names)
    assert any(n.startswith("docs/") for n in names)  # the alert rules
    assert any(n.startswith("deploy/README.md#") for n in names)


@pytest.mark.parametrize("name", [q.name for q in QUERIES])
def test_shipped_query_has_no_error(results: dict[str, list[dict[str, Any]]], name: str) -> None:
    assert kql.errors(results[name]) == [], next(q.text for q in QUERIES if q.name == name)


@pytest.mark.parametrize("what", sorted(BROKEN))
def test_the_checker_catches(results: dict[str, list[dict[str, Any]]], what: str) -> None:
    assert kql.errors(results[f"broken: {what}"]), f"the language service let through: {BROKEN[what]}"


def test_the_checker_names_the_misspelt_column_and_the_types(results: dict[str, list[dict[str, Any]]]) -> None:
    (column,) = kql.errors(results["broken: misspelt column"])
    assert "'VmNmae'" in column
    assert any("datetime and long" in e for e in kql.errors(results["broken: wrong type"]))
    assert any(d["code"] == "KS005" or "Expected" in d["message"] for d in results["broken: syntax error"])


@pytest.mark.parametrize("what", sorted(GOOD))
def test_the_checker_accepts(results: dict[str, list[dict[str, Any]]], what: str) -> None:
    assert kql.errors(results[f"good: {what}"]) == []


def test_the_dcr_transform_is_checked_against_its_source_stream(results: dict[str, list[dict[str, Any]]]) -> None:
    (dcr,) = [q for q in QUERIES if "dataFlows" in q.name]
    assert set(dcr.tables) == {"source"}
    # Its stream declares exactly the table's columns (generated from la_schema), in Kusto's types.
    assert dcr.tables["source"] == kql.workspace_tables()[TABLE]
    assert kql.errors(results["dcr: unknown column"]) and kql.errors(results["dcr: a real column"]) == []
