"""The Log Analytics row shape agrees with the committed ARM template (table, DCR stream)."""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

from sinks import la_schema
from sinks.la_schema import COLUMNS, MAX_VALUE_BYTES, to_row

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "azure" / "loganalytics"
TEMPLATE = json.loads((DEPLOY / "azuredeploy.json").read_text())
# Standard columns every Log Analytics table already has; a custom column may not reuse them.
STANDARD_COLUMNS = {"TenantId", "Type", "_ResourceId", "_SubscriptionId", "_ItemId", "_IsBillable", "_BilledSize"}


def _resource(rtype: str) -> dict:
    (found,) = [r for r in TEMPLATE["resources"] if r["type"] == rtype]
    return found


def test_columns_are_valid_for_a_custom_table():
    names = [name for name, _ in COLUMNS]
    assert names[0] == "TimeGenerated" and dict(COLUMNS)["TimeGenerated"] == "dateTime"
    assert len(names) == len(set(names))
    for name, ctype in COLUMNS:
        assert len(name) <= la_schema.MAX_NAME_LENGTH, name
        assert re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", name), name
        assert name not in STANDARD_COLUMNS, name
        assert ctype in la_schema.TYPES, (name, ctype)


def test_table_columns_equal_the_schema():
    table = _resource("Microsoft.OperationalInsights/workspaces/tables")
    assert table["properties"]["schema"]["name"] == la_schema.TABLE
    assert la_schema.TABLE.endswith("_CL")
    assert [(c["name"], c["type"]) for c in table["properties"]["schema"]["columns"]] == list(COLUMNS)


def test_dcr_stream_columns_equal_the_schema_and_flow_into_the_table():
    dcr = _resource("Microsoft.Insights/dataCollectionRules")
    assert dcr["kind"] == "Direct" and dcr["apiVersion"] == "2023-03-11"
    streams = dcr["properties"]["streamDeclarations"]
    assert list(streams) == [la_schema.STREAM]
    declared = [(c["name"], c["type"]) for c in streams[la_schema.STREAM]["columns"]]
    assert declared == [(name, la_schema.dcr_type(ctype)) for name, ctype in COLUMNS]
    assert {t for _, t in declared} <= {"string", "int", "long", "real", "boolean", "datetime", "dynamic"}
    (flow,) = dcr["properties"]["dataFlows"]
    assert flow["streams"] == [la_schema.STREAM]
    assert flow["transformKql"] == "source"
    assert flow["outputStream"] == f"Custom-{la_schema.TABLE}" == la_schema.OUTPUT_STREAM
    destinations = [d["name"] for d in dcr["properties"]["destinations"]["logAnalytics"]]
    assert flow["destinations"] == destinations


def test_the_role_assignment_grants_monitoring_metrics_publisher_on_the_rule_to_the_principal():
    assignment = _resource("Microsoft.Authorization/roleAssignments")
    assert "3913510d-42f4-4e42-8a64-420c390055eb" in assignment["properties"]["roleDefinitionId"]
    assert assignment["properties"]["principalId"] == "[parameters('principalId')]"
    assert "dataCollectionRules" in assignment["scope"]


def test_every_template_parameter_is_used():
    text = json.dumps({k: v for k, v in TEMPLATE.items() if k != "parameters"})
    for name in TEMPLATE["parameters"]:
        assert f"parameters('{name}')" in text, name


def test_the_committed_template_is_what_the_generator_writes():
    spec = importlib.util.spec_from_file_location("la_generate", DEPLOY / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (DEPLOY / "azuredeploy.json").read_text() == module.render(), "run deploy/azure/loganalytics/generate.py"


# -- to_row ---------------------------------------------------------------------------------------

def _event(**data) -> dict:
    return {"id": "r1", "type": "scheduledevent.updated", "source": "/vm/x", "subject": "E1",
            "time": "2026-11-22T07:58:31.031Z", "sequence": "00000000000000000042", "eventkey": "E1:updated",
            "data": data}


def test_to_row_gives_every_column_in_schema_order():
    row = to_row(_event(EventId="E1", Vm={"Name": "vm-0", "VmId": "id"}))
    assert list(row) == [name for name, _ in COLUMNS]
    assert row["TimeGenerated"] == "2026-11-22T07:58:31.031Z"
    assert row["Sequence"] == 42 and row["EventId"] == "E1" and row["VmName"] == "vm-0" and row["VmId"] == "id"
    assert row["Data"] is None


def test_to_row_keeps_what_has_no_column_in_data():
    row = to_row(_event(DocumentIncarnation="opaque", HttpStatus=None, EventIds=["E1"], Extra={}, Vm={"Other": 1}))
    assert row["DocumentIncarnation"] is None
    assert row["Data"] == {"DocumentIncarnation": "opaque", "EventIds": ["E1"], "Vm": {"Other": 1}}


def test_to_row_types_fit_the_columns():
    row = to_row(_event(DocumentIncarnation=7, DurationInSeconds=-1, Initial=True, Resources=["a"], Client={"ip": "x"}))
    assert row["DocumentIncarnation"] == 7 and row["DurationInSeconds"] == -1 and row["Initial"] is True
    assert row["Resources"] == ["a"]
    assert row["Client"] == '{"ip":"x"}'  # a string column never gets an object


def test_to_row_truncates_big_values_below_the_services_64_kb():
    row = to_row(_event(Description="x" * 200_000, Extra={"Blob": "y" * 200_000}))
    assert len(row["Description"].encode()) <= MAX_VALUE_BYTES and row["Description"].endswith("bytes]")
    assert row["Data"]["Truncated"] is True and row["Data"]["OriginalBytes"] > 200_000
    assert len(json.dumps(row["Data"]).encode()) <= MAX_VALUE_BYTES + 1024
